"""Lazy package exports: a package's public names imported on first use, so that importing the
package (e.g. for `clover --help`) does not import torch or fastapi."""

from __future__ import annotations

import importlib
import sys


def lazy_exports(package: str, exports: dict[str, str]):
    """A module-level `__getattr__` for `package`: `exports[name]` names the module that defines
    `name`; it is imported on first use and the value kept in the package."""

    def __getattr__(name: str):
        if name in exports:
            value = getattr(importlib.import_module(exports[name]), name)
            setattr(sys.modules[package], name, value)
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
