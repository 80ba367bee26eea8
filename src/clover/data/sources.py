"""Where the training stream's documents come from: `[[data.sources]]` in a recipe.

Each source is one table::

    [[data.sources]]
    kind = "text"          # one document per file: a file, a directory (every file under it), or a glob
    path = "corpus/**/*.md"
    weight = 2.0           # relative share of the non-task documents drawn from this source

    [[data.sources]]
    kind = "jsonl"         # one document per line: a JSON object whose `field` (default "text") is the text
    path = "data/chats.jsonl"

    [[data.sources]]
    kind = "datasets"      # a directory written by `datasets` (Dataset.save_to_disk / DatasetDict.save_to_disk)
    path = "data/my-set"
    split = "train"        # a DatasetDict's split (default "train")
    field = "text"

    [[data.sources]]
    kind = "stdlib"        # the running interpreter's standard library (what a recipe without sources uses)

Without sources the stream is the stdlib plus the synthetic tasks, as before. With sources, each
non-task document is drawn from source k with probability weight_k / sum(weights); `task_fraction`
still sets the tasks' share of the tokens (0: the sources only). About 2% of each source's documents
are held out (by a sha1 of the document's name: its path, or `path:line`, or `path[index]`), as for
the stdlib, so the held-out stream never sees a training document.

`read_documents(source, split)` lists a source's (name, text) pairs; the token cache of
`clover.data.mix` stores them once per tokenizer.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

from . import corpus

KINDS = ("text", "jsonl", "datasets", "stdlib")
KEYS = ("kind", "path", "weight", "field", "split")


class SourceError(ValueError):
    """A data source that cannot be read as written."""


@dataclass(frozen=True)
class Source:
    kind: str
    path: str = ""
    weight: float = 1.0
    field: str = "text"  # jsonl / datasets: the text column
    split: str = "train"  # datasets: the split of a DatasetDict

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.path}" if self.path else self.kind

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "path": self.path, "weight": self.weight, "field": self.field, "split": self.split}


STDLIB = Source("stdlib")


def parse_sources(raw: Iterable[Any] | None, *, base: Path | None = None) -> list[Source]:
    """`[[data.sources]]` tables -> Sources (relative paths against `base`, then the working
    directory); a SourceError names the source and what is wrong."""
    out = []
    for i, item in enumerate(raw or ()):
        where = f"data.sources[{i}]"
        if isinstance(item, Source):
            out.append(item)
            continue
        if not isinstance(item, dict):
            raise SourceError(f"{where}: must be a table like {{kind = \"text\", path = \"...\"}}")
        unknown = sorted(set(item) - set(KEYS))
        if unknown:
            raise SourceError(f"{where}: unknown key(s) {', '.join(unknown)}; known: {', '.join(KEYS)}")
        kind = item.get("kind")
        if kind not in KINDS:
            raise SourceError(f"{where}: kind must be one of {', '.join(KINDS)}, not {kind!r}")
        path = str(item.get("path", ""))
        if kind == "stdlib" and path:
            raise SourceError(f"{where}: kind 'stdlib' takes no path")
        if kind != "stdlib" and not path:
            raise SourceError(f"{where}: kind {kind!r} needs a path")
        weight = item.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise SourceError(f"{where}: weight must be a number > 0, not {weight!r}")
        if path:
            path = _resolve(os.path.expanduser(path), base)
        out.append(Source(kind, path, float(weight), str(item.get("field", "text")), str(item.get("split", "train"))))
    return out


def _resolve(path: str, base: Path | None) -> str:
    p = Path(path)
    if p.is_absolute() or base is None:
        return path
    for root in (base, Path.cwd()):
        if (root / p).exists() or glob.glob(str(root / p), recursive=True):
            return str(root / p)
    return path


def heldout(name: str) -> bool:
    """Whether a document belongs to the held-out split (stable: a sha1 of its name)."""
    h = int.from_bytes(hashlib.sha1(name.encode("utf-8")).digest()[:4], "big")
    return h % 1000 < corpus.HELDOUT_PERMILLE


def _files(source: Source) -> list[Path]:
    p = Path(source.path)
    if p.is_file():
        return [p]
    if p.is_dir():
        files = sorted(q for q in p.rglob("*") if q.is_file() and not any(part.startswith(".") for part in q.relative_to(p).parts))
    else:
        files = sorted(Path(q) for q in glob.glob(source.path, recursive=True) if Path(q).is_file())
    if not files:
        raise SourceError(f"data source {source.label}: no such file, directory or matching files")
    return files


def _text_documents(source: Source) -> Iterator[tuple[str, str]]:
    for f in _files(source):
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # a binary file in a directory of text: skipped, as the stdlib corpus skips them
        yield str(f), text


def _jsonl_documents(source: Source) -> Iterator[tuple[str, str]]:
    for f in _files(source):
        with open(f, encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise SourceError(f"{f}:{n}: not a JSON object ({e.msg}); a JSON Lines file has one object per line") from None
                if not isinstance(obj, dict) or not isinstance(obj.get(source.field), str):
                    raise SourceError(f"{f}:{n}: no string field {source.field!r} (set `field` in the source to the "
                                      f"key that holds the text)")
                yield f"{f}:{n}", obj[source.field]


def _datasets_documents(source: Source) -> Iterator[tuple[str, str]]:
    try:
        import datasets
    except ModuleNotFoundError:
        raise SourceError(f"data source {source.label}: reading a saved dataset needs the `datasets` library "
                          "(pip install 'clover-dlm[data]')") from None
    p = Path(source.path)
    if not p.is_dir():
        raise SourceError(f"data source {source.label}: no such directory (a directory written by save_to_disk)")
    try:
        ds = datasets.load_from_disk(str(p))
    except FileNotFoundError as e:
        raise SourceError(f"data source {source.label}: not a dataset saved with save_to_disk ({e})") from None
    if isinstance(ds, datasets.DatasetDict):
        if source.split not in ds:
            raise SourceError(f"data source {source.label}: no split {source.split!r}; it has {', '.join(ds)}")
        ds = ds[source.split]
    if source.field not in ds.column_names:
        raise SourceError(f"data source {source.label}: no column {source.field!r}; it has {', '.join(ds.column_names)} "
                          "(set `field` in the source)")
    for i, text in enumerate(ds[source.field]):
        if isinstance(text, str):
            yield f"{p}[{i}]", text


def _stdlib_documents(split: corpus.Split, max_files: int | None) -> Iterator[tuple[str, str]]:
    paths = corpus.stdlib_files(split)
    if max_files is not None:
        paths = paths[:max_files]
    for p in paths:
        text = corpus.read_text(p)
        if text is not None:
            yield corpus.relpath(p), text


def read_documents(source: Source, split: corpus.Split = "train", *, max_files: int | None = None) -> list[tuple[str, str]]:
    """The (name, text) documents of `source` in `split` ("train" or "heldout"), blank ones left out."""
    if source.kind == "stdlib":
        return [(n, t) for n, t in _stdlib_documents(split, max_files) if t.strip()]
    reader = {"text": _text_documents, "jsonl": _jsonl_documents, "datasets": _datasets_documents}[source.kind]
    want = split == "heldout"
    docs = [(n, t) for n, t in reader(source) if t.strip() and heldout(n) == want]
    return docs[:max_files] if max_files is not None else docs


def fingerprint(source: Source) -> dict[str, Any]:
    """What the token cache of a source is keyed by: its settings and its files' sizes and times."""
    d = source.as_dict()
    if source.kind != "stdlib":
        try:
            files = [Path(source.path)] if source.kind == "datasets" else _files(source)
        except SourceError:
            files = []
        stats = []
        for f in files:
            for q in ([f] if f.is_file() else sorted(x for x in f.rglob("*") if x.is_file())):
                st = q.stat()
                stats.append([str(q), st.st_size, st.st_mtime_ns])
        d["files"] = stats
    return d
