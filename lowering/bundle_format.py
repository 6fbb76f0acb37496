"""What a bundle directory holds and how its integrity is checked (no JAX, no compiler)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Literal

from llada_jax.system.errors import LladaError

PARAMETER_SCOPE = "model"  # IREE parameter scope the weights are bound under
MANIFEST = "manifest.json"
VMFB = "steps.vmfb"
ARCHIVE = "weights.irpa"  # a CPU bundle's copied weights, as one IREE parameter archive
FORMAT_VERSION = 11  # 2: staged pieces take one argument per weight tensor; 3: the head is staged in vocabulary
# chunks; 4: quantized parameters, and whether the weights stream recorded as "staged"; 5: full and window
# steps give hidden rows, `read` steps the readout on the rows a decoder uses; 6: `read` takes those rows'
# indices (the block's masks), not the first row of a slice; 7: resident CPU bundles copy their weights as
# one parameter archive, quantized integers signed; 8: decode loops run on the bundle's own driver (their
# cached decoders' first pass peeled out of the step loop); 9: quantized matmuls run our kernels, linked into the
# vmfb, their weights declared and archived as the bytes stored (the manifest's "kernels"); 10: under a budget the
# program streams its layers and head itself (the manifest's "streamed"), no per-layer pieces; 11: the manifest
# carries its own checksum ("manifest_sha256")
MANIFEST_DIGEST = "manifest_sha256"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


StepKind = Literal["full", "window", "read", "commit"]


@dataclasses.dataclass(frozen=True)
class StepSpec:
    """One compiled function: `full` (canvas S) and `window` (W positions against S slots), each giving the
    hidden rows and K/V; `read` (the LM head and readout on W of S hidden rows); or `commit`."""

    kind: StepKind
    batch: int
    slots: int
    width: int = 0

    @property
    def name(self) -> str:
        base = f"{self.kind}_b{self.batch}_s{self.slots}"
        return base if self.kind == "full" else f"{base}_w{self.width}"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def file_stamp(path: Path) -> list[int]:
    """A linked file's size and modification time: hashing a model's weights at every load would take minutes."""
    status = Path(path).stat()
    return [status.st_size, status.st_mtime_ns]


def manifest_digest(manifest: dict) -> str:
    """The sha256 of the manifest's fields other than the digest itself, in a canonical spelling."""
    fields = {key: value for key, value in manifest.items() if key != MANIFEST_DIGEST}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


# The fields the runtime reads, and their JSON types (bool is not an int here).
FIELDS = {"target": str, "driver": str, "max_len": int, "compute_dtype": str, "activations": str,
          "model_config": dict, "steps": list, "files": dict, "weights": dict}
STEP_FIELDS = {"name": str, "kind": str, "batch": int, "slots": int}
KIND_NAMES = {str: "text", int: "an integer", dict: "an object", list: "a list"}


def _typed(value, kind: type) -> bool:
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def check_fields(bundle_dir: Path, manifest: dict) -> None:
    """Every field the runtime reads is there with its type: a manifest edited with its checksum recomputed is
    refused in one line, not read halfway."""
    def refuse(what: str):
        raise LladaError(f"{bundle_dir}: {MANIFEST} is not a bundle manifest ({what}); recompile it")

    for field, kind in FIELDS.items():
        if not _typed(manifest.get(field), kind):
            refuse(f"{field} is missing or not {KIND_NAMES[kind]}")
    for step in manifest["steps"]:
        if not isinstance(step, dict) or not all(_typed(step.get(f), k) for f, k in STEP_FIELDS.items()):
            refuse(f"a step is not an object with {', '.join(STEP_FIELDS)}")
        if step["kind"] == "window" and not _typed(step.get("width"), int):
            refuse("a window step has no integer width")
    if not all(isinstance(name, str) and isinstance(digest, str) for name, digest in manifest["files"].items()):
        refuse("files is not a map of names to checksums")
    files, stamps = manifest["weights"].get("files"), manifest["weights"].get("stamps", [])
    if not isinstance(files, list) or not all(isinstance(path, str) for path in files):
        refuse("weights has no list of files")
    if not isinstance(stamps, list) or not all(isinstance(stamp, list) and len(stamp) == 2
                                               and all(_typed(n, int) for n in stamp) for stamp in stamps):
        refuse("weights' stamps are not [size, time] pairs")


def check_files(bundle_dir: Path, manifest: dict) -> None:
    """The manifest is as written (its own checksum) and every file it lists exists with its recorded sha256: an
    edited manifest (a field removed, a config changed) would otherwise skip checks or run another model."""
    if manifest.get("format") != FORMAT_VERSION:
        raise LladaError(f"{bundle_dir}: bundle format {manifest.get('format')} is not {FORMAT_VERSION}; recompile it")
    if manifest.get(MANIFEST_DIGEST) != manifest_digest(manifest):
        raise LladaError(f"{bundle_dir}: {MANIFEST} does not match its checksum (corrupt or edited); recompile it")
    check_fields(bundle_dir, manifest)
    weights = manifest["weights"]
    for path, stamp in zip(weights["files"], weights.get("stamps", [])):  # a linked model's files, as compiled
        if not Path(path).is_file():
            raise LladaError(f"{bundle_dir}: the bundle's linked weights {path} are missing")
        if file_stamp(Path(path)) != stamp:
            raise LladaError(f"{bundle_dir}: the linked weights {path} changed since the bundle was compiled (size or "
                             "time); recompile it")
    for name, digest in manifest["files"].items():
        path = bundle_dir / name
        if not path.is_file():
            raise LladaError(f"{bundle_dir}: bundle file {name} is missing")
        if sha256(path) != digest:
            raise LladaError(f"{bundle_dir}: bundle file {name} does not match its checksum (corrupt or edited)")
