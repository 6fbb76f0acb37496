"""lm-evaluation-harness adapter: the model `llada-jax`.

    python -m eval.lm_harness --model llada-jax --model_args pretrained=DIR,policy=dual-cache --tasks llada_tasks

(or `llada-lm-eval ...`) is lm-eval's own command line with this adapter registered and the local task
definitions of `eval/lm_tasks` included: lm-eval 0.4 finds only models imported before its command line
runs (it has no plugin entry points). From Python: `import eval.lm_harness`, then
`lm_eval.simple_evaluate(model="llada-jax", ...)`.

- `generate_until`: batched `llada_jax.generate` (any policy; `batch_size` prompts at a time), the answer
  cut at EOS / EoT and then at the request's stop strings (`until`).
- `loglikelihood`: LLaDA's Monte Carlo estimate (its `mc_num`), see `eval.mc_likelihood`; whether the
  continuation is the greedy answer is checked by decoding it with LLaDA's reference decoder. On block diffusion
  (LLaDA2), the BD3LM bound and greedy check of dllm's eval, blocks of `block_length`.
- `loglikelihood_rolling` is refused: a diffusion model gives a bound on a text's likelihood, not the
  exact per-token likelihood perplexity tasks need.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Callable, cast

import numpy as np
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm import tqdm

import llada_jax
from eval.mc_likelihood import block_greedy_answer, greedy_matches, mc_log_likelihood, request_rng
from llada_jax.model.mesh import MeshSpec
from llada_jax.system.errors import LladaError
from llada_jax.system.locations import default_model_dir
from llada_jax.weights.tokenizer import answer_text
from policies.block_diffusion import family_decoder
from policies.generation import check_token_ids
from policies.options import MAX_CFG_SCALE
from policies.registry import DecoderSetting

TASKS_DIR = Path(__file__).resolve().parent / "lm_tasks"


def _flag(value) -> bool:
    return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")


def _mesh(data_devices, model_devices):
    """`data_devices=N|all,model_devices=M`: the mesh of `--mesh data=N,model=M`; neither: one device."""
    if data_devices is None and model_devices is None:
        return None
    data = None if data_devices in (None, "all") else _number("data_devices", data_devices, minimum=1)
    return MeshSpec(data, 1 if model_devices is None else _number("model_devices", model_devices, minimum=1)).build()


def _number(name: str, value, kind: Callable = int, minimum=None, maximum=None, what: str = "model argument"):
    """A model argument (or request field) as a finite number (lm-eval passes them as text), or a one-line
    error naming it."""
    try:
        number = kind(value)
    except (TypeError, ValueError, OverflowError):
        kind_name = {"int": "an integer", "float": "a number"}.get(kind.__name__, kind.__name__)
        raise LladaError(f"{what} {name} must be {kind_name}, got {value!r}") from None
    if not math.isfinite(number):
        raise LladaError(f"{what} {name} must be finite, got {value!r}")
    if minimum is not None and number < minimum:
        raise LladaError(f"{what} {name} must be >= {minimum}, got {value!r}")
    if maximum is not None and number > maximum:
        raise LladaError(f"{what} {name} must be <= {maximum}, got {value!r}")
    return number


def _request(instance, fields: int) -> tuple:
    """A request's arguments: `fields` of them, the first (the context) text; one-line error otherwise."""
    args = getattr(instance, "args", None)
    if not isinstance(args, tuple) or len(args) != fields:
        raise LladaError(f"a request must carry {fields} arguments, got {args!r:.80}")
    if not isinstance(args[0], str):
        raise LladaError(f"a request's context must be text, got {type(args[0]).__name__}")
    return args


@register_model("llada-jax")
class LladaLM(LM):
    """LLaDA through llada-jax (model arguments: see `__init__`). Every argument is checked before the model
    loads."""

    def __init__(self, pretrained: str | None = None, dtype: str = "float32", batch_size=8, gen_length=None,
                 block_length: int = 32, steps=None, policy: str | None = None, threshold=None, cfg_scale: float = 0.0,
                 remasking: str = "low_confidence", mc_num: int = 128, mc_batch_size: int = 32,
                 check_greedy=True, seed: int = 1234, data_devices=None, model_devices=None, device=None,
                 max_batch_size=None, **unknown):
        super().__init__()
        if unknown:
            raise LladaError(f"unknown llada-jax model arguments: {', '.join(sorted(unknown))}")
        self.batch_size = 8 if str(batch_size).startswith("auto") else _number("batch_size", batch_size, minimum=1)
        self.gen_length = None if gen_length is None else _number("gen_length", gen_length, minimum=1)
        self.block_length = _number("block_length", block_length, minimum=1)
        self.steps = None if steps is None else _number("steps", steps, minimum=1)
        setting = DecoderSetting.parse(policy or "vanilla")
        if setting.threshold is not None and threshold is not None:
            raise LladaError("give the commit threshold once: policy=POLICY@T or threshold=T")
        self.policy = setting.policy if policy else None  # None: the family's default decoder
        self.threshold = setting.threshold if threshold is None else DecoderSetting(
            setting.policy, _number("threshold", threshold, float)).threshold
        self.cfg_scale, self.remasking = _number("cfg_scale", cfg_scale, float, 0.0, MAX_CFG_SCALE), remasking
        self.mc_batch_size = _number("mc_batch_size", mc_batch_size, minimum=1)
        self.mc_num = _number("mc_num", mc_num, minimum=self.mc_batch_size)
        if self.mc_num % self.mc_batch_size:
            raise LladaError(f"mc_num ({mc_num}) must be a multiple of mc_batch_size ({mc_batch_size})")
        self.check_greedy, self.seed = _flag(check_greedy), _number("seed", seed, minimum=0)
        if pretrained is not None and not str(pretrained).strip():
            raise LladaError("model argument pretrained must name a model directory, got an empty string")
        self.model = llada_jax.load(Path(pretrained) if pretrained is not None else default_model_dir(), dtype=dtype,
                                    mesh=_mesh(data_devices, model_devices))
        if self.model.tokenizer is None:
            raise LladaError(f"{pretrained}: lm-eval needs a model with a tokenizer.json")
        self.policy, self.threshold = family_decoder(self.model.config.block_causal, self.policy, self.threshold)

    @property
    def tokenizer_name(self) -> str:
        return str(self.model.path)

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        return self.model.tokenizer.chat(chat_history, add_generation_prompt)

    def chat_template(self, chat_template=False) -> str | None:
        return self.model.tokenizer.chat_template

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids) as the whole text tokenizes: the context's trailing spaces belong to
        the continuation, and the continuation is what the whole text has past the context's tokens."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        encode = self.model.tokenizer.encode
        whole, prefix = encode(context + continuation), encode(context)
        return prefix, whole[len(prefix):]

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        block_length = self.block_length if self.model.config.block_causal else None
        results = []
        for instance in tqdm(requests, desc="llada-jax loglikelihood", disable=len(requests) < 2):
            context, continuation = _request(instance, 2)
            if not isinstance(continuation, str):
                raise LladaError(f"a request's continuation must be text, got {type(continuation).__name__}")
            prefix, target = self._scored_pair(context, continuation)
            rng = request_rng(self.seed, context, continuation)
            ll = mc_log_likelihood(self.model, prefix, target, self.mc_num, self.mc_batch_size, rng, self.cfg_scale,
                                   block_length)
            greedy = self.check_greedy and (
                greedy_matches(self.model, prefix, target, self.cfg_scale) if block_length is None
                else block_greedy_answer(self.model, prefix, target, block_length) == target)
            results.append((ll, greedy))
            self.cache_hook.add_partial("loglikelihood", (context, continuation), (ll, greedy))
        return results

    def _scored_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids) for the likelihood: neither holds the mask token (it would count as a
        position to predict), and a context too long for the model keeps its last tokens (lm-eval's rule)."""
        config = self.model.config
        prefix, target = self.encode_pair(context, continuation)
        if not target:
            raise LladaError(f"the continuation {continuation!r} adds no token to its context")
        check_token_ids(prefix + target, config, "a request's context and continuation", allow_mask=False)
        room = config.max_sequence_length - len(target)
        if room < 0:
            raise LladaError(f"the continuation's {len(target)} tokens exceed the model's "
                             f"{config.max_sequence_length} positions")
        return prefix[len(prefix) - min(room, len(prefix)):], target

    def loglikelihood_rolling(self, requests):
        raise LladaError("llada-jax gives no rolling log-likelihood: a diffusion model bounds a text's likelihood "
                         "rather than scoring it token by token; use loglikelihood or generate_until tasks")

    def generate_until(self, requests) -> list[str]:
        """Requests of one generation setting at a time, `batch_size` prompts per batch, in request order."""
        answers: list[str | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = {}
        for index, instance in enumerate(requests):
            groups.setdefault(self._gen_setting(_request(instance, 2)[1]), []).append(index)
        progress = tqdm(total=len(requests), desc="llada-jax generate_until", disable=len(requests) < 2)
        for (gen_length, temperature), indices in groups.items():
            for start in range(0, len(indices), self.batch_size):
                chunk = indices[start: start + self.batch_size]
                prompts = [self._prompt(requests[i].args[0], gen_length) for i in chunk]
                results = llada_jax.generate(self.model, prompts, **self._options(gen_length, temperature))
                assert isinstance(results, list), "a batch of prompts gives a list of results"
                for index, result in zip(chunk, results):
                    answers[index] = self._cut(result.output_ids, cast(tuple, requests[index].args)[1])
                    self.cache_hook.add_partial("generate_until", requests[index].args, answers[index])
                progress.update(len(chunk))
        progress.close()
        return [answer or "" for answer in answers]  # every request was answered

    def _gen_setting(self, gen_kwargs) -> tuple[int, float]:
        """(answer length in whole blocks, temperature) of a request, its fields checked."""
        if not isinstance(gen_kwargs, dict):
            raise LladaError(f"a request's generation arguments must be a dict, got {type(gen_kwargs).__name__}")
        until = gen_kwargs.get("until") or []
        if not all(isinstance(stop, str) for stop in ([until] if isinstance(until, str) else
                                                      until if isinstance(until, (list, tuple)) else [until])):
            raise LladaError(f"a request's stop strings (until) must be text, got {until!r:.80}")
        wanted = self.gen_length or _number("max_gen_toks", gen_kwargs.get("max_gen_toks", 256), minimum=1,
                                            what="request field")
        temperature = 0.0
        if _flag(gen_kwargs.get("do_sample", False)):
            temperature = _number("temperature", gen_kwargs.get("temperature", 0.0), float, 0.0, what="request field")
        return -(-wanted // self.block_length) * self.block_length, temperature

    def _options(self, gen_length: int, temperature: float) -> dict:
        """generate's keywords; steps count per block on a block-diffusion model (default: one per position)."""
        steps = self.steps if self.steps is not None else (
            self.block_length if self.model.config.block_causal else gen_length)
        return dict(gen_length=gen_length, block_length=self.block_length, steps=steps, temperature=temperature,
                    cfg_scale=self.cfg_scale, remasking=self.remasking, policy=self.policy, threshold=self.threshold,
                    seed=self.seed, loop="host")

    def _prompt(self, context: str, gen_length: int) -> np.ndarray:
        """The context's tokens; a context too long for the canvas keeps its last tokens (lm-eval's rule)."""
        ids = self.model.tokenizer.encode(context)
        room = self.model.config.max_sequence_length - gen_length
        if room <= 0:
            raise LladaError(f"gen_length {gen_length} leaves no room for a prompt in the model's "
                             f"{self.model.config.max_sequence_length} positions")
        return np.array(ids[-room:], np.int64)

    def _cut(self, output_ids: np.ndarray, gen_kwargs: dict) -> str:
        """The answer before EOS / EoT, then before the first of the request's stop strings."""
        text = answer_text(self.model.tokenizer, output_ids, self.model.config)
        until = gen_kwargs.get("until") or []
        for stop in [until] if isinstance(until, str) else until:
            if stop:
                text = text.split(stop)[0]
        return text


def main(argv: list[str] | None = None) -> None:
    """lm-eval's command line, with `llada-jax` registered and the local tasks included."""
    from lm_eval.__main__ import cli_evaluate

    argv = list(sys.argv[1:] if argv is None else argv)
    if "--include_path" not in argv:
        argv += ["--include_path", str(TASKS_DIR)]
    sys.argv = [sys.argv[0]] + argv
    try:
        cli_evaluate()
    except LladaError as error:
        print(f"llada-lm-eval: error: {error}", file=sys.stderr)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
