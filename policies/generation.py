"""Generation, whatever runs the steps: validate every input on the host, pick readout, sampler, commit rule
and policy, then run the decode loop. No JAX here: bundles run through this module too."""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import numpy as np

from llada_jax import families
from llada_jax.model.config import LLaDAConfig
from llada_jax.model.readout import ReadoutSpec, TokenBiases
from llada_jax.model.shapes import bucket
from llada_jax.system.errors import LladaError
from policies.backend import BackendRequest
from policies.batch import decode_batch
from policies.block_diffusion import BLOCK_POLICY, BlockSettings, decode_blocks
from policies.block_loop_io import BlockLoopSpec, block_loop_spec, run_block_loop
from policies.compiled_loop import draft_threshold_of, loop_spec, run_compiled
from policies.loop import decode_steps, run_alone
from policies.loop_io import LoopSpec
from policies.options import BLOCK_OPTIONS, GenerationOptions
from policies.registry import make_policy, parse_policy
from policies.sampling import Sampler
from policies.schedule import Schedule, make_rule
from policies.speculative import Speculative

LOOPS = ("auto", "host", "compiled")


def check_token_ids(ids, config: LLaDAConfig, what: str, allow_mask: bool) -> np.ndarray:
    """Integer ids inside the vocabulary (and, for prompts, not the mask token)."""
    try:
        ids = np.asarray(ids)
    except ValueError:  # numpy refuses ragged nesting
        raise LladaError(f"{what} must be token ids, or rows of them of one length (a list of rows for a batch of "
                         "different lengths)") from None
    if ids.size == 0:
        raise LladaError(f"{what} is empty")
    if ids.dtype == object and all(isinstance(i, int) and not isinstance(i, bool) for i in ids.flat):
        raise LladaError(f"{what} holds token id {max(ids.flat, key=abs)} outside the vocabulary "
                         f"[0, {config.embedding_size})")  # Python ints beyond int64
    if not np.issubdtype(ids.dtype, np.integer):
        raise LladaError(f"{what} must be integer token ids, got dtype {ids.dtype}")
    bad = (ids < 0) | (ids >= config.embedding_size)
    if bad.any():
        raise LladaError(f"{what} holds token id {int(ids[bad][0])} outside the vocabulary "
                         f"[0, {config.embedding_size})")
    if not allow_mask and (ids == config.mask_token_id).any():
        raise LladaError(f"{what} holds the mask token id {config.mask_token_id}")
    return ids.astype(np.int32)


def prompt_rows(prompt_ids, config: LLaDAConfig) -> tuple[list[np.ndarray], bool]:
    """(prompts, batched): one sequence (`[L]`, or the reference's `[1, L]`), or a batch: a list of
    sequences of any lengths, or an `[N, L]` array."""
    if isinstance(prompt_ids, (list, tuple)) and prompt_ids and not np.isscalar(prompt_ids[0]):
        return [_one_prompt(ids, config, f"prompt {index}") for index, ids in enumerate(prompt_ids)], True
    prompt = check_token_ids(prompt_ids, config, "prompt", allow_mask=False)
    if prompt.ndim == 2 and prompt.shape[0] > 1:
        return [_one_prompt(row, config, f"prompt {index}") for index, row in enumerate(prompt)], True
    return [_one_prompt(prompt, config, "prompt")], False


def _one_prompt(ids, config: LLaDAConfig, what: str) -> np.ndarray:
    prompt = check_token_ids(ids, config, what, allow_mask=False)
    if prompt.ndim == 2 and prompt.shape[0] == 1:  # the reference's [1, L] prompt shape
        prompt = prompt[0]
    if prompt.ndim != 1:
        raise LladaError(f"{what} must be one sequence [length], got shape {list(prompt.shape)}")
    return prompt


@dataclasses.dataclass(frozen=True)
class Prepared:
    """One validated generation request: its prompts, what its backend must read out, and `decode_row`:
    `(backend, prompt, offset=0, on_step=None)`, one prompt's host loop as the generator of its step calls
    (`policies.loop.decode_steps`; `policies.loop.run_alone` runs it alone)."""

    prompts: list[np.ndarray]
    batched: bool                 # a batch was given (a list of results comes back)
    readout_spec: ReadoutSpec
    biases: TokenBiases
    cfg_scale: float
    slots: int                    # canvas positions, padded to the shape bucket
    decode_row: Callable
    loop_spec: LoopSpec | BlockLoopSpec | None  # the compiled loop's spec for this setting (None: host loop only)
    run_loop: Callable | None     # (compiled loop, prompt) -> Result: one prompt through `loop_spec`'s loop
    revisable: bool               # committed tokens may still change (revision): settled only at the end
    block_windows: bool = False   # windows of several diffusion blocks (block speculation: `Backend.block_windows`)
    block_length: int | None = None  # block diffusion's blocks

    @property
    def window_widths(self) -> tuple[int, ...]:
        """The window steps' widths its decoder is known to take (those of its compiled loop's spec)."""
        return self.loop_spec.window_widths() if isinstance(self.loop_spec, LoopSpec) else ()

    @property
    def rows_per_prompt(self) -> int:
        """Canvas rows of one prompt: 2 under CFG (conditional, unconditional)."""
        return 2 if self.cfg_scale > 0.0 else 1

    def backend_request(self, prompts: int | None = None, slots: int | None = None) -> BackendRequest:
        """What its backend must offer, for its own prompts and canvas (or `prompts` rows of `slots`)."""
        return BackendRequest(readout_spec=self.readout_spec, biases=self.biases, cfg_scale=self.cfg_scale,
                              rows=self.rows_per_prompt * (len(self.prompts) if prompts is None else prompts),
                              slots=self.slots if slots is None else slots, block_length=self.block_length)


def canvas_length(prompt_length: int, gen_length: int, block_length: int | None = None) -> int:
    """The canvas a prompt of `prompt_length` tokens needs: it must fit the model's max_sequence_length. Block
    diffusion (`block_length` given) rounds it up to whole blocks."""
    total = prompt_length + gen_length
    return total if block_length is None else -(-total // block_length) * block_length


def check_fits(config: LLaDAConfig, prompts: list[np.ndarray], gen_length: int, batched: bool, limit: int | None,
               block_length: int | None = None) -> int:
    """The canvas length of the longest prompt, refused in one line past the model's context."""
    longest = max(len(prompt) for prompt in prompts)
    total = canvas_length(longest, gen_length, block_length)
    if total > config.max_sequence_length:
        whole = block_length and total > longest + gen_length
        rounded = f" rounded up to whole blocks of {block_length}" if whole else ""
        raise LladaError(f"{'the longest ' if batched else ''}prompt ({longest}) + gen_length "
                         f"({gen_length}){rounded} = {total} exceeds max_sequence_length={config.max_sequence_length}"
                         f"{' (the bundle was compiled with --max-len ' + str(limit) + ')' if limit else ''}")
    return total


def prepare_generation(config: LLaDAConfig, prompt_ids, options: GenerationOptions) -> Prepared:
    """Validate every input on the host and pick readout, sampler, commit rule and policy (see
    `run_generation`); nothing runs yet."""
    limit = options.limit
    if limit is not None:
        config = dataclasses.replace(config, max_sequence_length=min(limit, config.max_sequence_length))
    prompts, batched = prompt_rows(prompt_ids, config)
    policy = options.policy or (BLOCK_POLICY if config.block_causal else "vanilla")  # the family's default
    if config.block_causal:
        return prepare_blocks(config, prompts, batched, policy, options)
    check_block_options(options, config)
    schedule = Schedule(int(options.gen_length), int(options.block_length), int(options.steps))
    total = check_fits(config, prompts, schedule.gen_length, batched, limit)
    if not options.cfg_scale >= 0.0:
        raise LladaError(f"cfg_scale must be >= 0, got {options.cfg_scale}")
    decoding_policy = make_policy(policy)
    family = families.named(config.family)  # its reference code's conventions are the defaults
    first_token = options.first_token
    if first_token is None:
        first_token = family.FIRST_TOKEN_BLOCKS and parse_policy(policy)[0] != "vanilla"
    rule = make_rule(schedule, options.threshold, options.schedule, first_token)
    unconfident = (config.special_ids_in_vocab(config.eos_token_id, config.eot_token_id)
                   if options.confidence_eos_eot_inf else ())
    top_k = family.CONFIDENCE_TOP_K if options.top_k is None else options.top_k
    sampler = Sampler(float(options.temperature), options.remasking, unconfident, top_k, options.top_p)
    if "revision" in parse_policy(policy)[1] and sampler.readout_kind != "argmax":
        raise LladaError("revision re-scores with argmax readouts: use temperature 0 (and no confidence top-k)")
    cfg = options.cfg_scale > 0.0
    forbid = config.special_ids_in_vocab(config.eos_token_id) if options.logits_eos_inf else ()
    slots = bucket(total, config.max_sequence_length)
    spec = loop_spec(decoding_policy, rule, sampler, cfg, schedule, slots)
    biases = TokenBiases.build(config.embedding_size, forbid, unconfident)
    decode_row = functools.partial(decode_steps, schedule=schedule, policy=decoding_policy, rule=rule, sampler=sampler,
                                   mask_id=config.mask_token_id, max_len=config.max_sequence_length, cfg=cfg,
                                   seed=options.seed)
    return Prepared(prompts=prompts, batched=batched, readout_spec=ReadoutSpec(kind=sampler.readout_kind, cfg=cfg),
                    biases=biases, cfg_scale=float(options.cfg_scale), slots=slots, decode_row=decode_row,
                    loop_spec=spec,
                    run_loop=None if spec is None else functools.partial(
                        run_compiled, spec=spec, biases=biases, threshold=options.threshold,
                        draft_threshold=draft_threshold_of(decoding_policy)),
                    revisable="revision" in parse_policy(policy)[1])


def check_block_options(options: GenerationOptions, config: LLaDAConfig) -> None:
    """Block diffusion's own options, refused on a family that does not decode by blocks."""
    for name in BLOCK_OPTIONS:
        if getattr(options, name) != getattr(GenerationOptions, name):
            raise LladaError(f"generation option {name} is LLaDA2's (block diffusion); {config.family} models "
                             "do not take it")


def prepare_blocks(config: LLaDAConfig, prompts: list[np.ndarray], batched: bool, policy: str,
                   options: GenerationOptions) -> Prepared:
    """A block-causal family's generation (`policies.block_diffusion`): the exact block cache, or `vanilla`, its
    uncached twin; LLaDA2.1's editing decoder when `editing_threshold` is set."""
    settings = block_settings(policy, options)
    total = check_fits(config, prompts, settings.gen_length, batched, options.limit, settings.block_length)
    sampler = Sampler(float(options.temperature))
    decode_row = functools.partial(decode_blocks, settings=settings, sampler=sampler, mask_id=config.mask_token_id,
                                   max_len=config.max_sequence_length, seed=options.seed)
    slots = bucket(total, config.max_sequence_length)
    spec = block_loop_spec(settings, sampler, slots)
    return Prepared(prompts=prompts, batched=batched, readout_spec=ReadoutSpec(kind=sampler.readout_kind),
                    biases=TokenBiases.build(config.embedding_size), cfg_scale=0.0, slots=slots,
                    decode_row=decode_row, loop_spec=spec,
                    run_loop=None if spec is None else functools.partial(run_block_loop, spec=spec, settings=settings),
                    revisable=settings.editing_threshold is not None,
                    block_windows=settings.lookahead > 0, block_length=settings.block_length)


def block_settings(policy: str, options: GenerationOptions) -> BlockSettings:
    """The block-diffusion settings of `policy` and `options`, refusing what block diffusion does not take."""
    base, modifiers = parse_policy(policy)
    if "revision" in modifiers:
        raise LladaError("+revision is LLaDA's; block-diffusion models revise their own block with "
                         "--editing-threshold (LLaDA2.1's editing decoder)")
    speculative = make_policy(policy) if modifiers else Speculative(lookahead=0)
    assert isinstance(speculative, Speculative), "speculative is the only modifier left"
    unsupported = {"cfg_scale": options.cfg_scale != 0.0, "remasking": options.remasking != "low_confidence",
                   "schedule": options.schedule != "llada", "top_k": bool(options.top_k),
                   "top_p": options.top_p not in (None, 1.0), "first_token": bool(options.first_token),
                   "logits_eos_inf": options.logits_eos_inf, "confidence_eos_eot_inf": options.confidence_eos_eot_inf}
    for name, given in unsupported.items():
        if given:
            raise LladaError(f"generation option {name} is not implemented for block-diffusion models")
    return BlockSettings(
        gen_length=int(options.gen_length), block_length=int(options.block_length), steps=int(options.steps),
        threshold=options.threshold, cached=base != "vanilla", minimal_topk=options.minimal_topk,
        editing_threshold=options.editing_threshold, max_post_steps=options.max_post_steps,
        num_to_transfer=options.num_to_transfer, lookahead=speculative.lookahead,
        draft_threshold=speculative.draft_threshold)


def run_generation(make_backend: Callable, config: LLaDAConfig, prompt_ids, *, on_step: Callable | None = None,
                   loop: str = "auto", **options):
    """Validate everything, then decode with `make_backend(request)` (a `policies.backend.BackendRequest`:
    its rows and canvas slots let a backend size its device memory before any step runs).
    `prompt_ids`: one prompt (returns a `Result`) or a batch (see `prompt_rows`; returns a list of them,
    each row as that prompt alone would decode; `on_step(row, canvas, record)`). A batch of one prompt
    decodes as that prompt alone (the compiled loop included).
    `options`: the fields of `policies.options.GenerationOptions` (an unknown or missing one is a one-line
    error). Unset, top_k and first_token follow the family's reference code (`CONFIDENCE_TOP_K`, 50 on Dream;
    `FIRST_TOKEN_BLOCKS`, as Fast-dLLM's Dream decoder does). `loop`: "auto" runs the compiled decode loop
    where the setting and backend offer it (one prompt, no live `on_step`), "host" the host loop, "compiled"
    insists on the compiled one."""
    if on_step is not None and not callable(on_step):
        raise LladaError(f"on_step must be a function of (canvas, record), got {on_step!r}")
    prepared = prepare_generation(config, prompt_ids, GenerationOptions.of(options))
    prompts = prepared.prompts
    spec = _check_loop(loop, prepared.loop_spec, on_step, len(prompts) > 1)
    backend = make_backend(prepared.backend_request())
    if prepared.batched and on_step is not None and len(prompts) == 1:  # a batch of one: the lone prompt's path
        on_step = functools.partial(on_step, 0)
    compiled = _compiled_loop(backend, loop, spec, on_step) if len(prompts) == 1 else None
    if prepared.block_windows and not backend.block_windows() and compiled is None:
        raise LladaError("+speculative on block-diffusion models drafts the next blocks under block-causal "
                         "attention, which a bundle's window steps cannot mask; run it on XLA (--model), or "
                         "through a bundle compiled with this setting's loop (--loop compiled)")
    if len(prompts) > 1:
        return [_with_staging(result, backend)
                for result in decode_batch(backend, prompts, prepared.decode_row, on_step)]
    if compiled is not None and prepared.run_loop is not None:
        result = prepared.run_loop(compiled, prompts[0])
    else:
        result = _with_staging(run_alone(backend, prepared.decode_row(backend, prompts[0], on_step=on_step)), backend)
    return [result] if prepared.batched else result


def _with_staging(result, backend):
    """The result with the backend's weight-staging counters, when it streams weights."""
    staging = backend.staging_stats()
    return dataclasses.replace(result, stats={**result.stats, **staging}) if staging else result


def _check_loop(loop: str, spec: LoopSpec | BlockLoopSpec | None, on_step, several: bool):
    """The compiled loop's spec for this setting (None: host loop only), refusing what `loop` cannot give."""
    if loop not in LOOPS:
        raise LladaError(f"unknown loop {loop!r}; choose one of {', '.join(LOOPS)}")
    if loop == "compiled" and several:
        raise LladaError("the compiled loop decodes one prompt at a time; use --loop host for a batch")
    if loop == "compiled" and spec is None:
        raise LladaError("the compiled loop covers vanilla, prefix-cache and dual-cache (+speculative) at "
                         "temperature 0 with low-confidence remasking and no CFG, and block diffusion's cached "
                         "decoders at temperature 0; use --loop host for this setting")
    if loop == "compiled" and on_step is not None:
        raise LladaError("the compiled loop reports no steps while it runs; use --loop host for a live canvas")
    return spec


def _compiled_loop(backend, loop: str, spec, on_step):
    """The backend's compiled loop when `loop` asks for it (auto: wherever it covers the setting), else None."""
    wanted = loop == "compiled" or (loop == "auto" and on_step is None and spec is not None)
    compiled = backend.compiled_loop(spec) if wanted else None
    if loop == "compiled" and compiled is None:
        raise LladaError("this backend runs only the host loop (staged weights, or a bundle compiled without "
                         "this loop); use --loop host")
    return compiled
