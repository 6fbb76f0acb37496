"""Model configuration, read from an HF LLaDA `config.json`; every size and id comes from there."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from llada_jax.errors import LladaError

# LLaDA-8B values, used only where a checkpoint's config.json leaves a field out.
LLADA_8B_MASK_ID = 126336
LLADA_8B_EOS_ID = 126081
LLADA_8B_EOT_ID = 126348

# The HF architectures (`config.json`'s `architectures[0]`) this loader reads; LLaDA 1.5 is LLaDAModelLM too.
SUPPORTED_ARCHITECTURES = ("LLaDAModelLM",)

# Fields whose value must be exactly this for the architecture we implement.
_REQUIRED_VALUES = {
    "block_type": "llama",
    "layer_norm_type": "rms",
    "activation_type": "silu",
    "alibi": False,
    "rope": True,
    "include_bias": False,
    "include_qkv_bias": False,
    "weight_tying": False,
    "scale_logits": False,
    "input_emb_norm": False,
    "attention_layer_norm": False,
}


@dataclasses.dataclass(frozen=True)
class LLaDAConfig:
    """Architecture and special ids of one LLaDA checkpoint (hashable: it is a static jit argument)."""

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
    mask_token_id: int = LLADA_8B_MASK_ID
    eos_token_id: int = LLADA_8B_EOS_ID
    eot_token_id: int = LLADA_8B_EOT_ID

    def __post_init__(self):
        for name in ("d_model", "n_layers", "n_heads", "n_kv_heads", "mlp_hidden_size",
                     "vocab_size", "embedding_size", "max_sequence_length"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) <= 0:
                raise LladaError(f"config field {name} must be a positive integer, got {getattr(self, name)!r}")
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
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise LladaError("config rope_theta and rms_norm_eps must be positive")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def special_ids_in_vocab(self, *ids: int) -> tuple[int, ...]:
        """The given ids that exist in this model's output vocabulary (EoT may not, on a small model)."""
        return tuple(sorted({i for i in ids if 0 <= i < self.embedding_size}))

    @classmethod
    def from_hf_dict(cls, raw: dict, eot_token_id: int | None = None) -> "LLaDAConfig":
        """Build from the fields of an HF config.json; unsupported architecture options are errors."""
        _check_architecture(raw.get("architectures"))
        for field, wanted in _REQUIRED_VALUES.items():
            if field in raw and raw[field] is not None and raw[field] != wanted:
                raise LladaError(f"config field {field}={raw[field]!r} is not supported (need {wanted!r})")
        try:
            d_model, n_layers, n_heads = int(raw["d_model"]), int(raw["n_layers"]), int(raw["n_heads"])
        except KeyError as missing:
            raise LladaError(f"config.json lacks required field {missing.args[0]}") from None
        except (TypeError, ValueError):
            raise LladaError("config.json fields d_model, n_layers and n_heads must be integers") from None
        vocab_size = int(raw.get("vocab_size") or raw.get("embedding_size") or 0)
        if not vocab_size:
            raise LladaError("config.json lacks both vocab_size and embedding_size")
        n_kv_heads = raw.get("n_kv_heads")
        if n_kv_heads is None:
            n_kv_heads = 1 if raw.get("multi_query_attention") else n_heads
        mlp_hidden = raw.get("mlp_hidden_size") or int(raw.get("mlp_ratio", 4)) * d_model
        return cls(
            d_model=d_model,
            n_layers=n_layers,
            n_heads=n_heads,
            n_kv_heads=int(n_kv_heads),
            mlp_hidden_size=int(mlp_hidden),
            vocab_size=vocab_size,
            embedding_size=int(raw.get("embedding_size") or vocab_size),
            max_sequence_length=int(raw.get("max_sequence_length", 4096)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            mask_token_id=int(raw.get("mask_token_id", LLADA_8B_MASK_ID)),
            eos_token_id=int(raw.get("eos_token_id", LLADA_8B_EOS_ID)),
            eot_token_id=int(eot_token_id if eot_token_id is not None else raw.get("eot_token_id", LLADA_8B_EOT_ID)),
        )

    def to_hf_dict(self) -> dict:
        """The config.json that HF `LLaDAModelLM` (and our loader) reads back to this config."""
        return {
            "architectures": ["LLaDAModelLM"],
            "model_type": "llada",
            **_REQUIRED_VALUES,
            "d_model": self.d_model,
            "n_layers": self.n_layers,
            "n_heads": self.n_heads,
            "n_kv_heads": self.n_kv_heads,
            "mlp_hidden_size": self.mlp_hidden_size,
            "mlp_ratio": max(1, self.mlp_hidden_size // self.d_model),
            "vocab_size": self.vocab_size,
            "embedding_size": self.embedding_size,
            "max_sequence_length": self.max_sequence_length,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "mask_token_id": self.mask_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.eos_token_id,
            "layer_norm_with_affine": True,
            "bias_for_layer_norm": False,
            "rope_full_precision": True,
        }


def _check_architecture(architectures) -> None:
    """Families are chosen by the architecture config.json names, never guessed from shapes (LLaDA-MoE's
    config says `model_type: llada` too). A config without the field is read as LLaDA."""
    if architectures is None:
        return
    if not isinstance(architectures, list) or not architectures or not isinstance(architectures[0], str):
        raise LladaError(f"config.json field architectures must be a list of names, got {architectures!r}")
    if architectures[0] not in SUPPORTED_ARCHITECTURES:
        raise LladaError(f"config.json names architecture {architectures[0]!r}, which llada-jax does not load "
                         f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")


def read_config(model_dir: Path, eot_token_id: int | None = None) -> LLaDAConfig:
    """Parse `model_dir/config.json`, with a one-line error for a missing or malformed file."""
    return LLaDAConfig.from_hf_dict(read_hf_dict(model_dir), eot_token_id=eot_token_id)


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
