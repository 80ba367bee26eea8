"""The Python standard library as a training corpus.

The corpus is the ``.py`` source of the *running* interpreter's standard
library (``sysconfig.get_paths()["stdlib"]``).  Some directories are left out
because they are bulky, generated, or not representative library code:

* ``site-packages`` -- third-party code, not the stdlib;
* ``test``/``tests``/``idle_test`` -- the regression suites (about half the
  stdlib by size, full of odd fixtures and deliberately broken code);
* ``idlelib``, ``turtledemo``, ``lib2to3`` -- applications/demos and a
  deprecated grammar-driven converter with large test data;
* ``ensurepip`` -- bundled wheels and bootstrap glue;
* ``encodings`` -- mostly machine-generated codec tables (long runs of
  unicode literals that would skew a tokenizer);
* ``pydoc_data`` -- one huge generated topics file;
* ``__pycache__``, ``lib-dynload``, ``config-*`` -- build artifacts;
* ``_sysconfigdata*.py`` -- machine-generated build configuration.

Files larger than :data:`MAX_FILE_BYTES` or not valid UTF-8 are skipped.

The train/held-out split is decided per file by a stable hash (sha1) of the
path relative to the stdlib root, so it does not depend on the machine, on
the order of the directory walk or on ``PYTHONHASHSEED``.  About
:data:`HELDOUT_PERMILLE` / 1000 of the files are held out.
"""

from __future__ import annotations

import ast
import hashlib
import os
import random
import sysconfig
from functools import lru_cache
from pathlib import Path
from typing import Iterator, Literal

Split = Literal["train", "heldout"]

MAX_FILE_BYTES = 200 * 1024
HELDOUT_PERMILLE = 20  # ~2 % of files

EXCLUDED_DIRS = frozenset(
    {
        "site-packages",
        "dist-packages",
        "test",
        "tests",
        "idle_test",
        "idlelib",
        "turtledemo",
        "lib2to3",
        "ensurepip",
        "encodings",
        "pydoc_data",
        "__pycache__",
        "lib-dynload",
    }
)
EXCLUDED_FILE_PREFIXES = ("_sysconfigdata",)


@lru_cache(maxsize=1)
def stdlib_root() -> Path:
    """Root directory of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def relpath(path: Path) -> str:
    """Path relative to the stdlib root, with forward slashes."""
    return Path(path).resolve().relative_to(stdlib_root()).as_posix()


def split_of(rel: str) -> Split:
    """The split a file belongs to, from the sha1 of its relative path."""
    h = int.from_bytes(hashlib.sha1(rel.encode("utf-8")).digest()[:8], "big")
    return "heldout" if h % 1000 < HELDOUT_PERMILLE else "train"


def _excluded_dir(name: str) -> bool:
    return name in EXCLUDED_DIRS or name.startswith("config-")


@lru_cache(maxsize=1)
def _all_files() -> tuple[tuple[str, Path], ...]:
    root = stdlib_root()
    out = []
    for here, dirs, files in os.walk(root):  # excluded directories are not entered (site-packages alone: thousands of files)
        dirs[:] = [d for d in dirs if not _excluded_dir(d)]
        for name in files:
            if not name.endswith(".py") or name.startswith(EXCLUDED_FILE_PREFIXES):
                continue
            p = Path(here, name)
            rel = p.relative_to(root)
            if not p.is_file():
                continue
            try:
                if p.stat().st_size > MAX_FILE_BYTES:
                    continue
            except OSError:
                continue
            out.append((rel.as_posix(), p))
    out.sort()
    return tuple(out)


def stdlib_files(split: Split = "train") -> list[Path]:
    """Sorted list of stdlib ``.py`` files in ``split`` ("train" or "heldout").

    Sorted by path relative to the stdlib root.  Files over the size limit are
    excluded here already; undecodable ones are skipped by :func:`read_text`.
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', not {split!r}")
    return [p for rel, p in _all_files() if split_of(rel) == split]


def read_text(path: Path, max_bytes: int = MAX_FILE_BYTES) -> str | None:
    """Read a file as UTF-8 text; ``None`` if too big, unreadable or not UTF-8.

    Line endings are normalised to ``\\n``; a byte-order mark is dropped.
    """
    try:
        data = Path(path).read_bytes()
    except OSError:
        return None
    if len(data) > max_bytes:
        return None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return None
    if text.startswith("\ufeff"):
        text = text[1:]
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text


def iter_documents(split: Split = "train") -> Iterator[tuple[str, str]]:
    """Yield ``(relative_path, text)`` for each readable file of ``split``."""
    for p in stdlib_files(split):
        text = read_text(p)
        if text is not None and text.strip():
            yield relpath(p), text


def _function_pairs(text: str, max_body_lines: int) -> list[tuple[str, str]]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    lines = text.splitlines(keepends=True)
    nodes: list[ast.AST] = []
    for node in tree.body:  # top-level functions and methods of top-level classes
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            nodes.append(node)
        elif isinstance(node, ast.ClassDef):
            nodes.extend(
                n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            )
    pairs = []
    for node in nodes:
        first = node.body[0].lineno  # 1-based line of the first body statement
        # a decorator-free header that ends on the line before the body
        if first <= node.lineno:
            continue  # one-liner "def f(): pass"
        header_lines = lines[node.lineno - 1 : first - 1]
        # drop trailing blank / comment-only lines between signature and body
        while header_lines and (
            not header_lines[-1].strip() or header_lines[-1].lstrip().startswith("#")
        ):
            header_lines.pop()
        if not header_lines or not header_lines[-1].rstrip().endswith(":"):
            continue
        body_lines = lines[first - 1 : node.end_lineno]
        if not body_lines or len(body_lines) > max_body_lines:
            continue
        header = "".join(header_lines)
        body = "".join(body_lines)
        if not header.endswith("\n"):
            header += "\n"
        if not body.endswith("\n"):
            body += "\n"
        pairs.append((header, body))
    return pairs


def heldout_functions(n: int, seed: int = 0, max_body_lines: int = 40) -> list[tuple[str, str]]:
    """``n`` ``(header, body)`` pairs from held-out stdlib files.

    ``header`` is the source of the ``def ...:`` signature (one or more lines,
    original indentation, decorators not included), ending in a newline.
    ``body`` is the source of the function body (docstring included, original
    indentation), ending in a newline, so ``header + body`` is the verbatim
    function text.  Top-level functions and methods of top-level classes are
    considered; bodies over ``max_body_lines`` lines are skipped.  The choice
    is a deterministic sample given ``seed``; fewer than ``n`` pairs are
    returned if not enough exist.
    """
    return functions("heldout", n, seed=seed, max_body_lines=max_body_lines)


@lru_cache(maxsize=4)
def _all_function_pairs(split: Split, max_body_lines: int) -> tuple[tuple[str, str], ...]:
    """Every `(header, body)` pair of `split`'s files, in file order: parsing the stdlib takes seconds,
    and a process asks for the same split again and again (each distillation prompt set, each eval)."""
    return tuple(pair for _rel, text in iter_documents(split) for pair in _function_pairs(text, max_body_lines))


def functions(split: Split, n: int, seed: int = 0, max_body_lines: int = 40) -> list[tuple[str, str]]:
    """``n`` ``(header, body)`` pairs from the stdlib files of ``split`` (see `heldout_functions`)."""
    candidates = list(_all_function_pairs(split, max_body_lines))
    rng = random.Random(seed)
    if n >= len(candidates):
        rng.shuffle(candidates)
        return candidates
    return rng.sample(candidates, n)
