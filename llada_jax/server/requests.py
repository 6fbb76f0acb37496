"""From a validated request body to the generations it asks for: the prompt's tokens, the answer length
in whole blocks (the answer is cut to the tokens asked for), the decoder setting, and one `Prepared`
generation per choice. Every error is a `RequestError` naming the field at fault, raised before anything
runs; what can be refused without tokenizing (too many generations, a text too long to fit) is refused first."""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
from typing import Callable

import numpy as np

from llada_jax.model.config import LLaDAConfig
from llada_jax.server.answer import SettledAnswer
from llada_jax.server.protocol import ChatRequest, CompletionRequest, GenerationFields
from llada_jax.system.errors import LladaError
from llada_jax.weights.tokenizer import Tokenizer
from policies.backend import BackendRequest
from policies.generation import Prepared, check_token_ids, prepare_generation
from policies.options import GenerationOptions
from policies.registry import DecoderSetting
from policies.sampling import Remasking
from policies.schedule import Schedule


class RequestError(LladaError):
    """A request the server refuses: HTTP `status`, the OpenAI error `kind` and the field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.kind, self.code = param, status, kind, code


@contextlib.contextmanager
def about(param: str | None):
    """Errors raised inside are the request's fault, in field `param`."""
    try:
        yield
    except RequestError:
        raise
    except LladaError as error:
        raise RequestError(str(error), param) from None


@dataclasses.dataclass(frozen=True)
class Defaults:
    """The server's decoding setting (`llada serve`'s decoder flags): what a request leaves unset."""

    gen_length: int = 32
    block_length: int = 8
    steps: int = 32
    temperature: float = 0.0
    cfg_scale: float = 0.0
    remasking: Remasking = "low_confidence"
    policy: str = "vanilla"
    threshold: float | None = None
    seed: int | None = None     # None: a request without a seed draws one (sampling varies, as OpenAI's does)
    logits_eos_inf: bool = False
    confidence_eos_eot_inf: bool = False
    block_options: tuple = ()   # block diffusion's (name, value) options (LLaDA2), as `llada serve` was given them

    @property
    def tokens_per_step(self) -> float:
        return self.gen_length / self.steps


@dataclasses.dataclass(frozen=True)
class Served:
    """The model a server answers for."""

    name: str
    config: LLaDAConfig
    tokenizer: Tokenizer
    defaults: Defaults
    limit: int | None = None    # a bundle's longest canvas, when lower than the model's own
    check: Callable[[BackendRequest, tuple[int, ...]], None] | None = None  # what its backend refuses (a bundle)

    @property
    def context(self) -> int:
        return min(self.config.max_sequence_length, self.limit or self.config.max_sequence_length)


@dataclasses.dataclass
class Job:
    """One choice of a request: its generation and its answer as it settles."""

    index: int
    prepared: Prepared
    answer: SettledAnswer
    prompt_tokens: int


def check_model(served: Served, model: str) -> None:
    if model != served.name:
        raise RequestError(f"The model `{model}` does not exist (this server serves `{served.name}`).",
                           "model", status=404, code="model_not_found")


def check_count(request: CompletionRequest | ChatRequest, capacity: int) -> None:
    """A request for more generations than the server holds (running and waiting) could never run: that is the
    request's fault (400), not the server's load (429, which clients retry)."""
    prompts = len(request.prompts()) if isinstance(request, CompletionRequest) else 1
    if prompts * request.n > capacity:
        raise RequestError(f"the request asks for {prompts * request.n} generations ({prompts} prompts x n={request.n})"
                           f"; this server holds at most {capacity} at once", "n" if prompts == 1 else "prompt")


def prompts_of(served: Served, request: CompletionRequest | ChatRequest) -> list[np.ndarray]:
    """Each prompt's token ids (a chat is one prompt, rendered with the model's chat template)."""
    if isinstance(request, ChatRequest):
        with about("messages"):
            return [_encoded(served, served.tokenizer.chat(request.turns()))]
    prompts = []
    with about("prompt"):
        for index, prompt in enumerate(request.prompts()):
            prompts.append(_encoded(served, prompt) if isinstance(prompt, str)
                           else check_token_ids(np.asarray(prompt), served.config, f"prompt {index}", allow_mask=False))
    return prompts


def _encoded(served: Served, text: str) -> np.ndarray:
    ids = np.array(served.tokenizer.encode(text, limit=served.context), np.int64)
    if ids.size == 0:
        raise LladaError("the prompt encodes to no tokens")
    return check_token_ids(ids, served.config, "the prompt", allow_mask=False)


def answer_length(served: Served, request: GenerationFields, asked: int | None, prompt_len: int) -> tuple[int, int]:
    """(gen_length, block_length): the answer rounded up to whole blocks, within the model's context. When
    the request gives no length: the server's, shortened (in whole blocks) to the room the prompt leaves."""
    block = request.block_length or served.defaults.block_length
    if block > served.context:
        raise RequestError(f"block_length={block} is longer than the model's context of {served.context} tokens",
                           "block_length")
    room = served.context - prompt_len
    if asked is None:
        if room < block:
            raise RequestError(f"the prompt ({prompt_len} tokens) leaves no room for a block of {block} tokens in "
                               f"the model's context of {served.context} tokens", _prompt_field(request))
        return min(-(-served.defaults.gen_length // block) * block, room // block * block), block
    gen_length = -(-asked // block) * block
    if gen_length > room:
        raise RequestError(f"This model's maximum context length is {served.context} tokens. However, you requested "
                           f"{prompt_len + gen_length} tokens ({prompt_len} in the prompt, {gen_length} for max "
                           f"tokens={asked} in whole blocks of {block}). Please reduce the length of the prompt or "
                           "the completion.", "max_tokens" if room >= block else _prompt_field(request))
    return gen_length, block


def _prompt_field(request) -> str:
    return "messages" if isinstance(request, ChatRequest) else "prompt"


def decoder_of(served: Served, request: GenerationFields) -> tuple[str, float | None]:
    """(policy spec, commit threshold): the request's `policy` (maybe `POLICY@T`) and `threshold`, else the
    server's."""
    defaults = served.defaults
    if request.policy is None:
        return defaults.policy, request.threshold if request.threshold is not None else defaults.threshold
    with about("policy"):
        setting = DecoderSetting.parse(request.policy)  # checks the policy
    if setting.threshold is not None and request.threshold is not None:
        raise RequestError("give the commit threshold once: in policy (POLICY@T) or in threshold", "threshold")
    return setting.policy, setting.threshold if setting.threshold is not None else request.threshold


def jobs_of(served: Served, request: CompletionRequest | ChatRequest, capacity: int) -> list[Job]:
    """Every choice the request asks for (`n` per prompt), validated and ready to run; at most `capacity`."""
    check_model(served, request.model)
    check_count(request, capacity)
    asked = request.answer_tokens if isinstance(request, ChatRequest) else request.max_tokens
    policy, threshold = decoder_of(served, request)
    defaults = served.defaults
    seed = _given(request.seed, defaults.seed)
    seed = secrets.randbelow(2**62) if seed is None else seed
    jobs = []
    for prompt in prompts_of(served, request):
        gen_length, block = answer_length(served, request, asked, len(prompt))
        steps = request_steps(served, request, gen_length, block)
        for choice in range(request.n):
            with about(None):
                prepared = prepare_generation(served.config, prompt, GenerationOptions(
                    gen_length=gen_length, block_length=block, steps=steps,
                    temperature=_given(request.temperature, defaults.temperature),
                    cfg_scale=_given(request.cfg_scale, defaults.cfg_scale),
                    remasking=request.remasking or defaults.remasking, policy=policy, threshold=threshold,
                    seed=seed + choice, logits_eos_inf=defaults.logits_eos_inf,
                    confidence_eos_eot_inf=defaults.confidence_eos_eot_inf, limit=served.limit,
                    **dict(defaults.block_options)))
                if served.check is not None:
                    served.check(prepared.backend_request(), prepared.window_widths)
            answer = SettledAnswer(served.tokenizer, served.config.mask_token_id, end_ids(served.config),
                                   tuple(request.stop or ()), prepared.revisable, asked)
            jobs.append(Job(len(jobs), prepared, answer, len(prompt)))
    return jobs


def request_steps(served: Served, request: GenerationFields, gen_length: int, block: int) -> int:
    """The request's steps, else the server's pace (its tokens per step); on a block-diffusion model steps count
    per block, as its reference samplers count them."""
    defaults = served.defaults
    most = block if served.config.block_causal else gen_length  # a step beyond one per token commits nothing
    if request.steps is not None and request.steps > most:
        raise RequestError(f"steps={request.steps} is more than the answer's {most} tokens"
                           f"{' per block' if served.config.block_causal else ''} (one step commits one token at "
                           "least; more would run idle)", "steps")
    if served.config.block_causal:
        return request.steps or defaults.steps
    steps = request.steps or (gen_length // block) * max(1, round(block / defaults.tokens_per_step))
    with about("steps" if request.steps else "block_length"):
        Schedule(gen_length, block, steps)
    return steps


def _given(value, default):
    return default if value is None else value


def end_ids(config: LLaDAConfig) -> tuple[int, ...]:
    """The tokens that end an answer: EOS and EoT, where the vocabulary has them."""
    return config.special_ids_in_vocab(config.eos_token_id, config.eot_token_id)
