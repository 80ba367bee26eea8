"""The house rules, checked on the source: the import graph of `src/clover` has no cycle, no lower
layer imports a higher one, nothing imports the CLI, and there is one list of decoding modes."""

from __future__ import annotations

import ast
import collections
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "clover"

# lowest first; a module may import its own layer and the ones below
LAYERS = [
    # "clover": the package face (its names are imported lazily, through `clover.lazy`)
    {"clover", "config", "kernels", "tokenizer", "moe", "decoding", "data", "precision", "grammar", "lazy", "paths"},
    {"cache", "models", "model"},
    {"checkpoint", "weights", "convert", "quant", "tiny", "export", "gguf", "gguf_import", "named", "hub"},
    {"api"},
    {"serve", "bench", "train", "viz", "integrations"},
    {"cli", "__main__"},
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the clover modules it imports (at any depth: lazy imports inside functions count)."""
    modules = {module_name(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = collections.defaultdict(set)
    for mod, path in modules.items():
        pkg = mod if path.name == "__init__.py" else mod.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                targets = [f"{target}.{a.name}" for a in node.names] + [target]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            for t in targets:
                # the longest known module the name refers to (`from .x import y`: y may be a module)
                while t and t not in modules:
                    t = t.rpartition(".")[0]
                # a module's own packages are not edges (`from . import sibling` names the package,
                # which is always imported before its modules)
                if t.startswith("clover") and t != mod and t != "clover" and not mod.startswith(t + "."):
                    graph[mod].add(t)
    return graph


def layer_of(mod: str) -> int:
    top = mod.split(".")[1] if "." in mod else mod
    for i, names in enumerate(LAYERS):
        if top in names:
            return i
    raise AssertionError(f"{mod}: its top-level name {top!r} is in no layer; add it to LAYERS")


def test_no_import_cycle():
    graph = import_graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_layers_only_import_down():
    bad = [f"{a} (layer {layer_of(a)}) imports {b} (layer {layer_of(b)})"
           for a, bs in import_graph().items() for b in bs
           if layer_of(b) > layer_of(a)]
    assert not bad, "\n".join(sorted(bad))


def test_nothing_imports_the_cli():
    bad = [a for a, bs in import_graph().items() for b in bs
           if (b == "clover.cli" or b.startswith("clover.cli.")) and not a.startswith("clover.cli")
           and a != "clover.__main__"]
    assert not bad, bad


def test_one_list_of_modes():
    """No module spells a list of the decoding modes (three or more of them); they come from the
    registry."""
    from clover.decoding import mode_names

    names = set(mode_names())
    # lists that name a fixed subset on purpose: what an external implementation supports
    subsets = {"clover/integrations/llama_port.py"}  # the modes the C++ port implements (ports/llama.cpp)
    bad = []
    for p in PKG.rglob("*.py"):
        if str(p.relative_to(SRC)) in subsets:
            continue
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                consts = {e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
                if len(consts & names) >= 3:
                    bad.append(f"{p.relative_to(SRC)}:{node.lineno}")
    assert not bad, bad
