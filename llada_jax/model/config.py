"""Model configuration, read from an HF `config.json`; every size and id comes from there. Each family
(`llada_jax.families`) reads and writes its own config.json fields into this one record."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from llada_jax import families
from llada_jax.families import llada
from llada_jax.system.errors import LladaError

MAX_SIZE = 2**31 - 1  # a width, length or vocabulary past this overflows XLA's int32 indexing
MAX_LAYERS = 4096    # layers, or experts: far past any model, and a table per tensor stays seconds to build
SIZES = ("d_model", "n_heads", "n_kv_heads", "mlp_hidden_size", "vocab_size", "embedding_size", "max_sequence_length",
         "dense_hidden_size", "shared_expert_size")


@dataclasses.dataclass(frozen=True)
class LLaDAConfig:
    """Architecture and special ids of one checkpoint (hashable: it is a static jit argument). The family's
    deltas over LLaDA's forward are flags: biases on q/k/v, per-head q/k norms, a sparse MoE in place of the
    MLP (`mlp_hidden_size` is then each expert's), logits shifted by one position; LLaDA2's fused q/k/v,
    partial rotary, dense first layers, grouped sigmoid router with a shared expert, block-causal attention."""

    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    mlp_hidden_size: int
    vocab_size: int
    embedding_size: int
    max_sequence_length: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    mask_token_id: int = llada.MASK_ID
    eos_token_id: int = llada.EOS_ID
    eot_token_id: int = llada.EOT_ID
    family: str = llada.NAME
    qkv_bias: bool = False
    qk_norm: bool = False
    n_experts: int = 0           # 0: a dense MLP
    experts_per_token: int = 0
    logits_shift: bool = False
    rotary_dim: int = 0          # the first dims of each head that rotate (0: all of them)
    dense_layers: int = 0        # of a sparse MoE model, the first layers that are a dense MLP ...
    dense_hidden_size: int = 0   # ... this wide
    shared_expert_size: int = 0  # an always-on SwiGLU beside the routed experts (0: none)
    router: str = "softmax"      # softmax top-k (LLaDA-MoE) or sigmoid-grouped (LLaDA2)
    expert_groups: int = 1       # sigmoid-grouped: experts in this many groups, ...
    groups_kept: int = 1         # ... the top ones kept before the top k
    routed_scaling: float = 1.0  # sigmoid-grouped: the routed experts' weights (summing to 1) times this
    block_causal: bool = False   # attention sees the own block and earlier ones only (block diffusion)

    def __post_init__(self):
        for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_hidden_size",
                     "vocab_size", "embedding_size", "max_sequence_length"):
            if type(getattr(self, name)) is not int or getattr(self, name) <= 0:
                raise LladaError(f"config field {name} must be a positive integer, got {getattr(self, name)!r}")
        for name, most in (*((name, MAX_SIZE) for name in SIZES), ("n_layers", MAX_LAYERS), ("n_experts", MAX_LAYERS)):
            if getattr(self, name) > most:  # checked before any per-layer or per-expert table is built
                raise LladaError(f"config field {name} must be at most {most}, got {getattr(self, name):.3g}")
        for name in ("mask_token_id", "eos_token_id", "eot_token_id"):  # EOS / EoT may lie past a small vocabulary
            if type(getattr(self, name)) is not int or getattr(self, name) < 0:
                raise LladaError(f"config field {name} must be a token id >= 0, got {getattr(self, name)!r}")
        if self.d_model % self.n_heads:
            raise LladaError(f"config d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise LladaError(f"config n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise LladaError(f"config head dimension {self.head_dim} must be even for rotary embeddings")
        if self.embedding_size < self.vocab_size:
            raise LladaError(f"config embedding_size={self.embedding_size} is smaller than "
                             f"vocab_size={self.vocab_size}")
        if not 0 <= self.mask_token_id < self.embedding_size:
            raise LladaError(f"config mask_token_id={self.mask_token_id} is outside the embedding "
                             f"(size {self.embedding_size})")
        if self.mask_token_id in (self.eos_token_id, self.eot_token_id):  # every answer would end at once
            raise LladaError(f"config mask_token_id={self.mask_token_id} is also the end-of-text id (eos "
                             f"{self.eos_token_id}, eot {self.eot_token_id})")
        if not (0 < self.rope_theta < math.inf and 0 < self.rms_norm_eps < math.inf):
            raise LladaError(f"config rope_theta and rms_norm_eps must be finite and positive, got {self.rope_theta} "
                             f"and {self.rms_norm_eps}")
        if self.family not in families.BY_NAME:
            raise LladaError(f"unknown model family {self.family!r}; choose one of {', '.join(families.BY_NAME)}")
        if not 0 <= self.rotary_dim <= self.head_dim or self.rotary_dim % 2:
            raise LladaError(f"config rotary_dim={self.rotary_dim} must be even and at most the head dimension "
                             f"{self.head_dim}")
        if self.router not in ("softmax", "sigmoid-grouped"):
            raise LladaError(f"unknown router {self.router!r}; choose softmax or sigmoid-grouped")
        if self.n_experts and not 1 <= self.experts_per_token <= self.n_experts:
            raise LladaError(f"config experts per token ({self.experts_per_token}) must be in [1, "
                             f"{self.n_experts}] (the experts)")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def rotary_width(self) -> int:
        """The dims of each head that rotary embeddings rotate (the first ones)."""
        return self.rotary_dim or self.head_dim

    def special_ids_in_vocab(self, *ids: int) -> tuple[int, ...]:
        """The given ids that exist in this model's output vocabulary (EoT may not, on a small model)."""
        return tuple(sorted({i for i in ids if 0 <= i < self.embedding_size}))

    @classmethod
    def from_hf_dict(cls, raw: dict, eot_token_id: int | None = None) -> "LLaDAConfig":
        """Build from the fields of an HF config.json, read by the family its `architectures` names;
        unsupported architecture options are errors."""
        try:
            fields = families.from_architectures(raw.get("architectures")).config_fields(raw)
        except (TypeError, ValueError) as err:  # a number field holding a string, a list, ...
            raise LladaError(f"config.json holds a malformed value ({err})") from None
        if eot_token_id is not None:
            fields["eot_token_id"] = int(eot_token_id)
        return cls(**fields)

    def to_hf_dict(self) -> dict:
        """The config.json that the family's HF model (and our loader) reads back to this config."""
        return families.named(self.family).hf_config(self)


def read_config(model_dir: Path, eot_token_id: int | None = None) -> LLaDAConfig:
    """Parse `model_dir/config.json`, with a one-line error for a missing or malformed file."""
    return LLaDAConfig.from_hf_dict(read_hf_dict(model_dir), eot_token_id=eot_token_id)


def checked_model_dir(path) -> Path:
    """`path` as a model directory, or a one-line error saying what it is instead."""
    model_dir = Path(path)
    if not model_dir.exists():
        raise LladaError(f"model directory {model_dir} does not exist")
    if not model_dir.is_dir():
        raise LladaError(f"{model_dir} is a file, not a model directory (config.json, weights, tokenizer)")
    return model_dir


def read_hf_dict(model_dir: Path) -> dict:
    """`model_dir/config.json` as a dict (one-line errors for a missing or malformed file)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise LladaError(f"{model_dir}: no config.json (not an HF LLaDA model directory)")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise LladaError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(raw, dict):
        raise LladaError(f"{path}: expected a JSON object")
    return raw
