"""The `run.sh` of a bundle with compiled decode loops: generation with IREE's own `iree-run-module` and a
POSIX shell, no Python (a phone's `adb shell` has `sh`, `sed` and `tr`).

    IREE_RUN_MODULE=<command> ./run.sh 1,2,3

checks the prompt ids (integers in the vocabulary, not the mask, room in the largest canvas), picks the
smallest compiled canvas that holds prompt + gen_length (the size the host would pick), pads the prompt,
runs the loop function, and prints the generated ids, comma-separated, on its last line (the number of
forward passes goes to stderr). `<command>` is the tool's path (spaces and all) or a command with arguments, e.g.
an emulator in front of the tool.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import numpy as np

from policies.block_loop_io import BakedBlockLoops, BlockLoopOutputs
from policies.loop_io import BakedLoops, LoopOutputs

SCRIPT = "run.sh"

TEMPLATE = r"""#!/bin/sh
# Written by `llada compile`: {setting}, gen_length {gen_length}, block_length {block_length}, steps {steps}.
# Usage: [IREE_RUN_MODULE="<iree-run-module command>"] ./run.sh ID,ID,...  (prompt token ids)
# Prints the {gen_length} generated token ids, comma-separated, on its last line.
set -eu
fail() {{ echo "run.sh: error: $*" >&2; exit 1; }}
script=$0
while [ -L "$script" ]; do  # called through a link: the bundle's files are next to the script itself
  target=$(readlink -- "$script") || fail "cannot read the link $script"
  case $target in /*) script=$target ;; *) script=$(dirname -- "$script")/$target ;; esac
done
here=$(CDPATH= cd -- "$(dirname -- "$script")" && pwd)
[ $# -eq 1 ] || fail "usage: ./run.sh ID,ID,... (comma-separated prompt token ids)"
case $1 in
  '' | *[!0-9,]* | ,* | *, | *,,*) fail "prompt ids must be comma-separated non-negative integers, got '$1'" ;;
esac
given=$(($(printf '%s' "$1" | tr -cd , | wc -c) + 1))  # counted before any per-id work
[ "$given" -le {largest} ] || fail "prompt ($given) + gen_length ({gen_length}) = $((given + {gen_length})) exceeds \
the bundle's longest canvas ({largest})"
count=0
padded=""
for id in $(echo "$1" | tr ',' ' '); do
  id=$(echo "$id" | sed 's/^0*\([0-9]\)/\1/')
  [ ${{#id}} -le 9 ] && [ "$id" -lt {vocab} ] || fail "prompt token id $id is outside the vocabulary [0, {vocab})"
  [ "$id" -ne {mask} ] || fail "prompt holds the mask token id {mask}"
  count=$((count + 1))
  padded="$padded $id"
done
prompt_len=$count
total={total}
{choices}
else
  fail "prompt ($count) + gen_length ({gen_length}) = $total exceeds the bundle's longest canvas ({largest})"
fi
while [ "$count" -lt "$slots" ]; do padded="$padded 0"; count=$((count + 1)); done
tool=${{IREE_RUN_MODULE:-iree-run-module}}
set -f  # a tool file's path is one word, spaces and all; anything else is a command with arguments (an emulator)
if [ -f "$tool" ] && [ -x "$tool" ]; then set -- "$tool"; else set -- $tool; fi
set +f
out=$("$@" --module="$here/steps.vmfb" --device={device} {parameters} \
  --function="$function" --input="${{slots}}xi32=${{padded# }}" --input="i32=$prompt_len" \
  {inputs} --output_max_element_count={gen_length}) || fail "iree-run-module failed (set IREE_RUN_MODULE to its path)"
result() {{ echo "$out" | sed -n "/^result\[$1\]/{{n;s/^[^=]*=//;p;q;}}"; }}
bad=$(result {bad_pass}) at=$(result {bad_position})
[ -n "$bad" ] || fail "iree-run-module printed no results (is IREE_RUN_MODULE iree-run-module?)"
[ "$bad" = "-1" ] || fail "step $((bad + 1)) produced a non-finite score (NaN/Inf) at canvas position $at"
echo "[$(result 1) forward passes]" >&2
result 0 | tr -s ' ' ','
"""


def _float(value: float) -> str:
    """A float32 constant as text that parses back to the same float32."""
    return np.format_float_scientific(np.float32(value), unique=True)


def write_run_script(bundle_dir: Path, loops: BakedLoops | BakedBlockLoops, config, device: str, weights: dict) -> Path:
    """Write `run.sh` for `loops` into `bundle_dir` (weights as the bundle records them)."""
    # A linked model's path is the user's: quoted for sh, so no character of it runs as shell code.
    files = [f'"$here/{name}"' if weights["copied"] else shlex.quote(name) for name in weights["files"]]
    parameters = " ".join(f"--parameters=model={file}" for file in files)
    choices = "\n".join(f'{"if" if i == 0 else "elif"} [ "$total" -le {spec.slots} ]; then slots={spec.slots}; '
                        f'function={spec.name}' for i, spec in enumerate(loops.specs))
    manifest = loops.manifest()
    gen_length, block_length = manifest["gen_length"], manifest["block_length"]
    if isinstance(loops, BakedBlockLoops):  # the canvas holds the prompt and the answer in whole blocks
        outputs, biases, cutoffs = BlockLoopOutputs, "", ("commit_cutoff", "edit_cutoff", "draft_cutoff")
        total = f"$(((count + {gen_length} + {block_length - 1}) / {block_length} * {block_length}))"
    else:
        outputs, cutoffs = LoopOutputs, ("commit_cutoff", "draft_cutoff")
        biases = f'--input="{config.embedding_size}xf32=0" --input="{config.embedding_size}xf32=0" '
        total = f"$((count + {gen_length}))"
    inputs = biases + " ".join(f'--input="f32={_float(np.inf if manifest[name] is None else manifest[name])}"'
                               for name in cutoffs)
    text = TEMPLATE.format(setting=loops.setting, gen_length=gen_length, block_length=block_length,
                           steps=manifest["steps"], vocab=config.embedding_size, mask=config.mask_token_id,
                           choices=choices, largest=loops.specs[-1].slots, device=device, parameters=parameters,
                           total=total, inputs=inputs, bad_pass=outputs._fields.index("bad_pass"),
                           bad_position=outputs._fields.index("bad_position"))
    path = bundle_dir / SCRIPT
    path.write_text(text)
    path.chmod(0o755)
    return path
