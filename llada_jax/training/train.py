"""Training the embedded model with LLaDA's masked-diffusion objective (optax; orbax checkpoints, resumable).

Objective (LLaDA SFT): per example t ~ U(eps, 1]; each response token is masked with probability t;
cross-entropy on masked positions weighted by 1/t, summed and divided by the response length; the
prompt is never masked. A fraction `block_aware` of examples is instead masked the way semi-AR
decoding meets the canvas: answer blocks before a random block b clean, block b masked with
probability t (weight 1/t), later blocks fully masked (t = 1, weight 1).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import tempfile
import time
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from llada_jax.model.config import LLaDAConfig
from llada_jax.model.forward import forward, lm_logits
from llada_jax.model.kv_state import HIDDEN
from llada_jax.model.params import init_params
from llada_jax.system.atomic import atomic_write_bytes, check_output_dir
from llada_jax.system.errors import LladaError
from llada_jax.system.interrupts import signals_deferred
from llada_jax.training.tasks import held_out, training_examples
from llada_jax.weights import char_tokenizer
from llada_jax.weights.checkpoint import save_hf
from llada_jax.weights.tokenizer import load_tokenizer

MIN_T = 1e-3


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    steps: int = 24_000
    batch: int = 64
    seq_len: int = 96            # prompt + gen_length, padded
    gen_length: int = 32
    block_length: int = 8
    learning_rate: float = 1e-3
    warmup: int = 500
    weight_decay: float = 0.01
    block_aware: float = 0.5
    seed: int = 0
    checkpoint_every: int = 1000

    def __post_init__(self):
        for name in ("steps", "batch", "seq_len", "gen_length", "block_length", "checkpoint_every"):
            if getattr(self, name) <= 0:
                raise LladaError(f"training {name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.gen_length % self.block_length or self.gen_length > self.seq_len:
            raise LladaError("training gen-length must be a multiple of block-length and fit seq-len")
        if not 0 < self.learning_rate < math.inf or not 0.0 <= self.block_aware <= 1.0 or self.warmup < 0:
            raise LladaError("training needs a finite lr > 0, warmup >= 0 and block-aware in [0, 1]")
        if not 0 <= self.seed < 2**32:
            raise LladaError(f"training seed must be in [0, 2^32), got {self.seed}")


def embedded_model_config(d_model: int = 128, n_layers: int = 4) -> LLaDAConfig:
    ids = char_tokenizer.vocabulary()
    size = char_tokenizer.vocab_size()
    return LLaDAConfig(d_model=d_model, n_layers=n_layers, n_heads=max(1, d_model // 32),
                       n_kv_heads=max(1, d_model // 32), mlp_hidden_size=3 * d_model, vocab_size=size,
                       embedding_size=size, max_sequence_length=256, rope_theta=10000.0, rms_norm_eps=1e-5,
                       mask_token_id=ids[char_tokenizer.MASK], eos_token_id=ids[char_tokenizer.EOS],
                       eot_token_id=ids[char_tokenizer.EOT])


def encode(tokenizer, prompt: str, answer: str, config: LLaDAConfig, gen_length: int) -> tuple[list[int], int]:
    """Chat-formatted prompt ids + answer, EoT and EOS padding to `gen_length`; returns (ids, prompt_len)."""
    prompt_ids = tokenizer.encode(tokenizer.chat_prompt(prompt))
    answer_ids = tokenizer.encode(answer) + [config.eot_token_id]
    if len(answer_ids) > gen_length:
        raise LladaError(f"answer of {len(answer_ids)} tokens does not fit gen_length={gen_length}: {answer!r}")
    return prompt_ids + answer_ids + [config.eos_token_id] * (gen_length - len(answer_ids)), len(prompt_ids)


def make_batch(tokenizer, config: LLaDAConfig, settings: TrainSettings, step: int, excluded: set[str]):
    """The batch of `step`, a pure function of (seed, step): resuming needs no data-loader state."""
    examples = training_examples(random.Random(settings.seed * 1_000_003 + step), excluded)
    tokens = np.full((settings.batch, settings.seq_len), config.eos_token_id, np.int32)
    prompt_len = np.zeros(settings.batch, np.int32)
    for row in range(settings.batch):
        example = next(examples)
        ids, prompt_len[row] = encode(tokenizer, example.prompt, example.answer, config, settings.gen_length)
        if len(ids) > settings.seq_len:
            raise LladaError(f"example of {len(ids)} tokens exceeds seq_len={settings.seq_len}")
        tokens[row, : len(ids)] = ids
    return tokens, prompt_len


def corrupt(key, tokens, prompt_len, settings: TrainSettings, mask_id: int):
    """Masked tokens and per-position loss weights `[B, T]` (0 where not masked)."""
    b, t_len = tokens.shape
    pos = jnp.arange(t_len)[None, :]
    rel = pos - prompt_len[:, None]
    response = (rel >= 0) & (rel < settings.gen_length)
    k_t, k_u, k_blk, k_mode = jax.random.split(key, 4)
    t = jax.random.uniform(k_t, (b, 1), minval=MIN_T, maxval=1.0)
    coin = jax.random.uniform(k_u, (b, t_len)) < t
    blocks = settings.gen_length // settings.block_length
    current = jax.random.randint(k_blk, (b, 1), 0, blocks)
    block_of = rel // settings.block_length
    aware = jax.random.uniform(k_mode, (b, 1)) < settings.block_aware
    masked_uniform = response & coin
    masked_aware = response & ((block_of > current) | ((block_of == current) & coin))
    masked = jnp.where(aware, masked_aware, masked_uniform)
    weight = jnp.where(aware & (block_of > current), 1.0, 1.0 / t)
    return jnp.where(masked, mask_id, tokens), jnp.where(masked, weight, 0.0)


def loss_fn(params, key, tokens, prompt_len, *, config: LLaDAConfig, settings: TrainSettings):
    noisy, weight = corrupt(key, tokens, prompt_len, settings, config.mask_token_id)
    pos = jnp.arange(tokens.shape[1])
    valid = pos[None, :] < (prompt_len[:, None] + settings.gen_length)
    bias = jnp.where(valid, 0.0, HIDDEN).astype(jnp.float32)
    hidden = forward(params, noisy, jnp.broadcast_to(pos, tokens.shape), bias, None, config).hidden
    logits = lm_logits(params, hidden)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens)
    return jnp.sum(ce * weight) / (tokens.shape[0] * settings.gen_length)


def optimizer(settings: TrainSettings):
    warmup = min(settings.warmup, settings.steps // 10)
    schedule = optax.warmup_cosine_decay_schedule(0.0, settings.learning_rate, warmup, settings.steps,
                                                  settings.learning_rate * 0.05)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, weight_decay=settings.weight_decay))


@partial(jax.jit, static_argnames=("config", "settings"))
def train_step(params, opt_state, key, tokens, prompt_len, *, config: LLaDAConfig, settings: TrainSettings):
    loss, grads = jax.value_and_grad(loss_fn)(params, key, tokens, prompt_len, config=config, settings=settings)
    updates, opt_state = optimizer(settings).update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


TRAIN_COMMAND = "llada train"


def export_model(params, config: LLaDAConfig, out_dir: Path, run_dir: Path, force: bool = False) -> Path:
    """An HF LLaDA directory with the char tokenizer files, written atomically; it replaces only an earlier
    export (with `force`), and never the run directory or one holding it."""
    with tempfile.TemporaryDirectory() as tokenizer_dir:
        char_tokenizer.write_tokenizer_files(Path(tokenizer_dir))
        files = {name: Path(tokenizer_dir) / name
                 for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")}
        save_hf(jax.device_get(params), config, out_dir, extra_files=files, command=TRAIN_COMMAND,
                inputs=(run_dir,), force=force)
    return Path(out_dir)


def train(run_dir: Path, settings: TrainSettings, config: LLaDAConfig, progress: bool = True,
          stop_at: int | None = None) -> Path:
    """Train (resuming from `run_dir` if it holds checkpoints) up to `stop_at` (default: the end of the
    schedule); export the model to run_dir/model. Stopping early keeps the schedule of `settings.steps`,
    so a later call without `stop_at` continues the same run."""
    stop = settings.steps if stop_at is None else stop_at
    if not 0 < stop <= settings.steps:
        raise LladaError(f"--stop-at must be in [1, {settings.steps}], got {stop_at}")
    import orbax.checkpoint as ocp  # heavy (~0.4 s): only a training run loads it, not every `llada` command

    run_dir = Path(run_dir).absolute()
    run_dir.mkdir(parents=True, exist_ok=True)
    _check_run_settings(run_dir, settings, config)
    tok_dir = run_dir / "tokenizer"
    tok_dir.mkdir(exist_ok=True)
    char_tokenizer.write_tokenizer_files(tok_dir)
    tokenizer = load_tokenizer(tok_dir)
    excluded = {example.prompt for example in held_out()}

    params = init_params(config, seed=settings.seed)
    opt_state = optimizer(settings).init(params)
    # Synchronous saves: a run killed at any moment leaves only complete checkpoints behind.
    options = ocp.CheckpointManagerOptions(max_to_keep=2, enable_async_checkpointing=False)
    with ocp.CheckpointManager(run_dir / "checkpoints", options=options) as manager:
        params, opt_state = _train_loop(manager, params, opt_state, tokenizer, excluded, settings, config, progress,
                                        stop)
    # The run's own export, made anew each time the run ends.
    return export_model(params, config, run_dir / "model", run_dir / "checkpoints", force=True)


def _train_loop(manager, params, opt_state, tokenizer, excluded, settings: TrainSettings, config: LLaDAConfig,
                progress: bool, stop: int):
    import orbax.checkpoint as ocp  # heavy (~0.4 s): only a training run loads it, not every `llada` command

    start = 0
    if manager.latest_step() is not None:
        start = manager.latest_step()
        if start > stop:
            raise LladaError(f"this run is already at step {start}, past --stop-at {stop}: a run does not go back "
                             "(--export-to exports its newest checkpoint)")
        restored = _restore(manager, start, ocp.args.StandardRestore({"params": params, "opt": opt_state}))
        params, opt_state = restored["params"], restored["opt"]
    bar = tqdm(range(start, stop), initial=start, total=stop, disable=not progress, desc="train", unit="step")
    smoothed, began = None, time.perf_counter()
    for step in bar:
        tokens, prompt_len = make_batch(tokenizer, config, settings, step, excluded)
        key = jax.random.fold_in(jax.random.PRNGKey(settings.seed), step)
        params, opt_state, loss = train_step(params, opt_state, key, jnp.asarray(tokens), jnp.asarray(prompt_len),
                                             config=config, settings=settings)
        if step % 50 == 0 or step == stop - 1:
            value = float(loss)
            smoothed = value if smoothed is None else 0.9 * smoothed + 0.1 * value
            rate = (step + 1 - start) * settings.batch * settings.seq_len / (time.perf_counter() - began)
            bar.set_postfix(loss=f"{smoothed:.4f}", tok_s=f"{rate:,.0f}")
        if (step + 1) % settings.checkpoint_every == 0 or step == stop - 1:
            _check_finite(params, loss, step + 1, manager.latest_step())
            with signals_deferred():  # an interrupt waits for the save, which orbax cannot have cut
                manager.save(step + 1, args=ocp.args.StandardSave({"params": params, "opt": opt_state}))
    return params, opt_state


def _check_finite(params, loss, step: int, saved: int | None) -> None:
    """A diverged run (a learning rate too large) is stopped before it saves or exports non-finite weights."""
    finite = bool(jnp.isfinite(loss)) and all(bool(jnp.isfinite(leaf).all()) for leaf in jax.tree.leaves(params))
    if not finite:
        kept = f"its newest checkpoint (step {saved}) is kept" if saved else "nothing was saved"
        raise LladaError(f"training diverged by step {step} (a non-finite loss or weight): {kept}; start a new run "
                         "with a smaller --lr")


def export_latest(run_dir: Path, out_dir: Path, force: bool = False) -> tuple[Path, int]:
    """Export the newest complete checkpoint of a run (finished or still going) as an HF directory."""
    import orbax.checkpoint as ocp  # heavy (~0.4 s): only a training run loads it, not every `llada` command

    run_dir = Path(run_dir).absolute()
    if not (run_dir / "run.json").is_file():
        raise LladaError(f"{run_dir} is not a training run directory (no run.json)")
    check_output_dir(out_dir, TRAIN_COMMAND, (run_dir,), force)  # before restoring the checkpoint
    config = LLaDAConfig.from_hf_dict(_run_record(run_dir)["config"])
    with ocp.CheckpointManager(run_dir / "checkpoints") as manager:
        step = manager.latest_step()
        if step is None:
            raise LladaError(f"{run_dir} has no checkpoint yet")
        restored = _restore(manager, step, ocp.args.StandardRestore())
    return export_model(restored["params"], config, out_dir, run_dir, force=force), step


def _restore(manager, step: int, args):
    """Checkpoint `step`, or a one-line error: orbax raises whatever its reader meets in a damaged checkpoint."""
    try:
        return manager.restore(step, args=args)
    except Exception as err:  # noqa: BLE001 - any failure here means the files on disk are not a checkpoint
        detail = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise LladaError(f"checkpoint {step} of the run cannot be restored ({detail[:200]}); it is damaged: move "
                         "it aside to resume from the one before") from None


def _run_record(run_dir: Path) -> dict:
    """run.json: the run's settings and model config."""
    path = run_dir / "run.json"
    try:
        record = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise LladaError(f"{path} is not valid JSON; it is not a run this command wrote") from None
    if not (isinstance(record, dict) and isinstance(record.get("settings"), dict)
            and isinstance(record.get("config"), dict)):
        raise LladaError(f"{path} holds no run's settings and config; it is not a run this command wrote")
    return record


def _check_run_settings(run_dir: Path, settings: TrainSettings, config: LLaDAConfig) -> None:
    """A run directory belongs to one setting: resuming with different settings is refused, unless the run
    never got to save anything (it failed before its first checkpoint)."""
    record = {"settings": dataclasses.asdict(settings), "config": config.to_hf_dict()}
    path = run_dir / "run.json"
    if path.exists():
        if _run_record(run_dir) == json.loads(json.dumps(record)):
            return
        checkpoints = run_dir / "checkpoints"
        if (checkpoints.exists() and any(checkpoints.iterdir())) or (run_dir / "model").exists():
            raise LladaError(f"{run_dir} holds a run with other settings; use a new --out directory")
    elif any(run_dir.iterdir()):
        raise LladaError(f"{run_dir} is not empty and holds no training run (no run.json); use a new --out directory")
    atomic_write_bytes(path, (json.dumps(record, indent=2) + "\n").encode(), TRAIN_COMMAND)
