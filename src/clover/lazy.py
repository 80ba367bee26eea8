"""Lazy package exports: a package's public names imported on first use, so that importing the
package (e.g. for `clover --help`) does not import torch or fastapi."""

from __future__ import annotations

import importlib
import sys


def lazy_exports(package: str, exports: dict[str, tuple[str, ...]]):
    """`package`'s module-level `__getattr__` and `__all__`: `exports` maps a module to the names it
    defines; a name's module is imported on its first use and the value kept in the package."""
    where = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str):
        if name in where:
            value = getattr(importlib.import_module(where[name]), name)
            setattr(sys.modules[package], name, value)
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__, list(where)
