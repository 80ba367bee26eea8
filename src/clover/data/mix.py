"""Packed token stream for training: stdlib files + task lines, EOS-separated.

Each of the ``batch_size`` rows of a batch is an independent, deterministic
stream of documents (seeded by ``seed``, ``split`` and the row number).
Document ``i`` of a row is, with a probability chosen so that about
``task_fraction`` of the *tokens* come from tasks, either

* a task document: 4-16 task lines joined by ``"\\n"`` (with a final
  ``"\\n"``).  The train split draws from the training task stream with all
  reserved held-out prompts removed; the held-out split draws from the
  reserved held-out task set; or
* the next stdlib file of the row's current epoch (a seeded permutation of
  the split's files, re-shuffled every epoch).

With a self-distillation set (``distill``, see :mod:`clover.data.distill`), a
``distill_fraction`` of the documents are drawn from it instead: 4-16 of its
task lines, or one of its code documents.

Every document is followed by the EOS token; documents are concatenated and
cut into rows of ``seq_len`` tokens (a document may continue into the next
batch).  The stream is infinite, and its position is captured exactly by
:meth:`PackedStream.state_dict` (a small JSON-serialisable dict), so
training can resume bit-for-bit with :meth:`PackedStream.load_state_dict`.

With ``sources`` (:mod:`clover.data.sources`: local text files, JSON Lines,
datasets saved with ``save_to_disk``, the stdlib), each non-task document is
drawn from one source, chosen by the sources' weights, and the next document of
that source's own per-row permutation.

Stdlib files (and each source's documents) are tokenised once and cached as ``.npy`` arrays (no pickle)
under ``cache_dir``, keyed by a hash of the tokenizer and of the file list.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import corpus, sources, tasks
from .sources import STDLIB, Source
from .tokenizer import EOS_TOKEN, load_tokenizer, tokenizer_hash

CACHE_VERSION = 1
TASK_GROUP = (4, 16)


def _default_cache_dir() -> Path:
    root = Path(__file__).resolve().parents[3]
    if (root / "src" / "clover").is_dir():
        return root / "build" / "data-cache"
    return Path("build") / "data-cache"


DEFAULT_CACHE_DIR = _default_cache_dir()
# building a cache: about this many `encode_batch` calls (bar updates), each of at least ENCODE_MIN_FILES
# files (a call is parallel over its files)
ENCODE_STEPS, ENCODE_MIN_FILES = 32, 8


def load_source_tokens(
    tokenizer: Any,
    source: Source,
    split: corpus.Split = "train",
    cache_dir: str | Path | None = None,
    max_files: int | None = None,
    verbose: bool = False,
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Token ids of a data source's split (`clover.data.sources`; "stdlib": the split's stdlib files),
    tokenised once and cached on disk, keyed by the tokenizer and the documents: the stdlib files'
    names and the Python version, another source's settings and its files' sizes and modification times.

    Returns ``(tokens, offsets, names)``: document ``j`` is ``tokens[offsets[j]:offsets[j+1]]`` (no
    EOS). ``max_files`` keeps only the first files of the sorted split (for tests). Builds the cache
    if missing.
    """
    tok = load_tokenizer(tokenizer)
    if source.kind == "stdlib":
        paths = corpus.stdlib_files(split)
        if max_files is not None:
            paths = paths[:max_files]
        name, key = split, {"split": split, "py": sys.version, "files": [corpus.relpath(p) for p in paths]}

        def documents() -> list[tuple[str, str]]:
            texts = ((corpus.relpath(p), corpus.read_text(p)) for p in paths)
            return [(rel, text) for rel, text in texts if text is not None and text.strip()]
    else:
        name = f"{source.kind}-{split}"
        key = {"split": split, "max_files": max_files, "source": sources.fingerprint(source)}

        def documents() -> list[tuple[str, str]]:
            return sources.read_documents(source, split, max_files=max_files)
    key_src = json.dumps({"v": CACHE_VERSION, "tok": tokenizer_hash(tok), **key}, sort_keys=True)
    base = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE_DIR
    d = base / f"{name}-{hashlib.sha1(key_src.encode()).hexdigest()[:20]}"
    if not (d / "files.json").is_file():
        _build_cache(tok, documents(), d, verbose)
    tokens = np.load(d / "tokens.npy", mmap_mode="r", allow_pickle=False)
    offsets = np.load(d / "offsets.npy", allow_pickle=False)
    return tokens, offsets, json.loads((d / "files.json").read_text())


def _build_cache(tok, docs: list[tuple[str, str]], d: Path, verbose: bool) -> None:
    """Tokenise `docs` into the cache directory `d` (with a bar over their characters when `verbose`):
    in calls of about 1/ENCODE_STEPS of the characters each, over files of about the same length,
    longest first, so that no call waits long on one large file while the other threads are idle."""
    from tqdm import tqdm

    order = sorted(range(len(docs)), key=lambda j: -len(docs[j][1]))
    total = sum(len(t) for _, t in docs)
    encs = [None] * len(docs)
    with tqdm(total=total, desc=f"tokenizing {len(docs)} files into {d.parent.name}/", unit="char",
              unit_scale=True, file=sys.stderr, dynamic_ncols=True, disable=not verbose) as bar:
        chunk, chars = [], 0
        for n, j in enumerate(order, 1):
            chunk.append(j)
            chars += len(docs[j][1])
            if n == len(order) or (chars * ENCODE_STEPS >= total and len(chunk) >= ENCODE_MIN_FILES):
                for k, e in zip(chunk, tok.encode_batch([docs[k][1] for k in chunk], add_special_tokens=False)):
                    encs[k] = e
                bar.update(chars)
                chunk, chars = [], 0
    lens = np.array([len(e.ids) for e in encs], dtype=np.int64)
    offsets = np.zeros(len(docs) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    dtype = np.uint16 if tok.get_vocab_size() <= np.iinfo(np.uint16).max + 1 else np.int32
    tokens = np.zeros(int(offsets[-1]), dtype=dtype)
    for j, e in enumerate(encs):
        tokens[offsets[j] : offsets[j + 1]] = e.ids
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=d.name + ".tmp", dir=d.parent))
    try:
        np.save(tmp / "tokens.npy", tokens, allow_pickle=False)
        np.save(tmp / "offsets.npy", offsets, allow_pickle=False)
        (tmp / "files.json").write_text(json.dumps([r for r, _ in docs]))
        try:
            os.replace(tmp, d)
        except OSError:
            if not (d / "files.json").is_file():  # not a concurrent builder's result
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


class PackedStream:
    """Infinite, resumable stream of ``[batch_size, seq_len]`` int64 batches.

    ``tokenizer`` is a directory (or ``tokenizer.json``), a
    ``tokenizers.Tokenizer`` or a transformers fast tokenizer.
    ``split`` is "train" or "heldout".  Iterate it, or call
    :meth:`next_batch`.
    """

    def __init__(
        self,
        tokenizer: Any,
        split: corpus.Split = "train",
        seq_len: int = 512,
        batch_size: int = 8,
        task_fraction: float = 0.5,
        seed: int = 0,
        cache_dir: str | Path | None = None,
        max_files: int | None = None,
        verbose: bool = False,
        task_weights: dict[str, float] | None = None,
        distill=None,
        distill_fraction: float = 0.0,
        sources: list[Source] | None = None,
    ):
        if split not in ("train", "heldout"):
            raise ValueError(f"split must be 'train' or 'heldout', not {split!r}")
        if not 0.0 <= task_fraction <= 1.0:
            raise ValueError("task_fraction must be in [0, 1]")
        self.tok = load_tokenizer(tokenizer)
        self.eos_id = self.tok.token_to_id(EOS_TOKEN)
        if self.eos_id is None:
            raise ValueError(f"tokenizer has no {EOS_TOKEN} token")
        self.split = split
        self.seq_len = int(seq_len)
        self.batch_size = int(batch_size)
        self.task_fraction = float(task_fraction)
        self.seed = int(seed)
        if task_weights and split == "heldout":
            raise ValueError("task_weights apply to training streams only; held-out tasks are uniform over kinds")
        self.task_weights = tasks.check_task_weights(task_weights)
        if not 0.0 <= distill_fraction <= 1.0:
            raise ValueError("distill_fraction must be in [0, 1]")
        if distill_fraction and (distill is None or not (distill.task_lines or distill.code_docs)):
            raise ValueError("distill_fraction > 0 needs a non-empty self-distillation set")
        self.distill = distill if distill_fraction else None
        self.distill_fraction = float(distill_fraction) if distill_fraction else 0.0
        # the non-task documents: one pool per source (default: the stdlib alone)
        self.sources = list(sources) if sources else [STDLIB]
        self._custom_sources = bool(sources)
        self.pools = []
        for src in self.sources:
            toks, offs, files = load_source_tokens(self.tok, src, split, cache_dir=cache_dir, max_files=max_files,
                                                   verbose=verbose)
            if not files and self._custom_sources:
                if split == "train":
                    raise ValueError(f"data source {src.label}: no documents to train on")
                continue  # a source too small to have held-out documents
            self.pools.append((toks, offs, files, src.weight))
        if self._custom_sources and not self.pools and task_fraction == 0.0:
            raise ValueError("no held-out documents in the data sources (about 2% of each source's documents are "
                             "held out) and task_fraction == 0")
        self.tokens, self.offsets, self.files = self.pools[0][:3] if self.pools else (np.zeros(0), np.zeros(1), [])
        self.n_files = sum(len(p[2]) for p in self.pools)
        total = sum(p[3] for p in self.pools) or 1.0
        self._pool_cdf = list(np.cumsum([p[3] / total for p in self.pools]))
        self._heldout = tasks.heldout_tasks() if split == "heldout" else None
        self.p_task = self._task_probability()
        self.step = 0
        zero = lambda: 0 if len(self.pools) <= 1 else [0] * len(self.pools)  # noqa: E731
        self._rows = [{"doc": 0, "offset": 0, "files_before": zero()} for _ in range(self.batch_size)]
        self._current: list[tuple[int, np.ndarray, int | None] | None] = [None] * self.batch_size
        self._perm: dict[tuple[int, int], tuple[int, list[int]]] = {}

    # -- document construction -------------------------------------------------

    def _task_probability(self) -> float:
        f = self.task_fraction
        if self.n_files == 0:
            if f == 0.0:
                raise ValueError("no stdlib files and task_fraction == 0")
            return 1.0
        if f in (0.0, 1.0):
            return f
        if len(self.pools) == 1:
            mean_file = float(self.offsets[-1]) / self.n_files + 1.0
        else:  # the mean length of a non-task document, over the pools' shares
            total = sum(p[3] for p in self.pools)
            mean_file = sum(p[3] * (float(p[1][-1]) / len(p[2]) + 1.0) for p in self.pools) / total
        est_rng = random.Random(f"clover-estimate:{self.split}")
        lens = [len(self._task_doc(est_rng)) for _ in range(64)]
        mean_task = sum(lens) / len(lens)
        return f * mean_file / (f * mean_file + (1.0 - f) * mean_task)

    def _task_doc(self, rng: random.Random) -> np.ndarray:
        k = rng.randint(*TASK_GROUP)
        if self._heldout is not None:
            group = [rng.choice(self._heldout) for _ in range(k)]
        else:
            it = tasks.iter_tasks(rng, exclude_heldout=True, weights=self.task_weights)
            group = [next(it) for _ in range(k)]
        text = "\n".join(tasks.task_line(t) for t in group) + "\n"
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return np.array(ids + [self.eos_id], dtype=np.int64)

    def _file_index(self, row: int, n: int, pool: int = 0) -> int:
        n_files = len(self.pools[pool][2])
        epoch, pos = divmod(n, n_files)
        cached = self._perm.get((row, pool))
        if cached is None or cached[0] != epoch:
            perm = list(range(n_files))
            tag = f":{pool}" if pool else ""  # pool 0 shuffles as the single stdlib pool always did
            random.Random(f"clover-perm:{self.seed}:{self.split}:{row}:{epoch}{tag}").shuffle(perm)
            cached = (epoch, perm)
            self._perm[(row, pool)] = cached
        return cached[1][pos]

    def _pick_pool(self, rng: random.Random) -> int:
        if len(self.pools) == 1:
            return 0  # no draw: a single pool decodes the same stream as before sources existed
        u = rng.random()
        return next((k for k, c in enumerate(self._pool_cdf) if u < c), len(self.pools) - 1)

    def _distill_doc(self, rng: random.Random) -> np.ndarray:
        d = self.distill
        if d.task_lines and (not d.code_docs or rng.random() < self.task_fraction):
            text = "\n".join(rng.choice(d.task_lines) for _ in range(rng.randint(*TASK_GROUP))) + "\n"
        else:
            text = rng.choice(d.code_docs)
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return np.array(ids + [self.eos_id], dtype=np.int64)

    def _doc(self, row: int, doc: int, files_before) -> tuple[np.ndarray, int | None]:
        """Document `doc` of `row` and the pool it came from (None: a task or distillation document)."""
        rng = random.Random(f"clover-doc:{self.seed}:{self.split}:{row}:{doc}")
        if self.distill is not None and rng.random() < self.distill_fraction:
            return self._distill_doc(rng), None
        if rng.random() < self.p_task:
            return self._task_doc(rng), None
        k = self._pick_pool(rng)
        seen = files_before[k] if isinstance(files_before, list) else files_before
        tokens, offsets = self.pools[k][0], self.pools[k][1]
        j = self._file_index(row, seen, k)
        a, b = int(offsets[j]), int(offsets[j + 1])
        out = np.empty(b - a + 1, dtype=np.int64)
        out[:-1] = tokens[a:b]
        out[-1] = self.eos_id
        return out, k

    def document(self, row: int, doc: int, files_before) -> np.ndarray:
        """Token ids (EOS included) of document ``doc`` of ``row``."""
        return self._doc(row, doc, files_before)[0]

    # -- batching ----------------------------------------------------------------

    def _fill_row(self, row: int, out: np.ndarray) -> None:
        st = self._rows[row]
        filled = 0
        while filled < self.seq_len:
            cur = self._current[row]
            if cur is None or cur[0] != st["doc"]:
                arr, pool = self._doc(row, st["doc"], st["files_before"])
                cur = (st["doc"], arr, pool)
                self._current[row] = cur
            _, arr, pool = cur
            take = min(self.seq_len - filled, len(arr) - st["offset"])
            out[filled : filled + take] = arr[st["offset"] : st["offset"] + take]
            filled += take
            st["offset"] += take
            if st["offset"] >= len(arr):
                st["doc"] += 1
                st["offset"] = 0
                if pool is not None:
                    if isinstance(st["files_before"], list):
                        st["files_before"][pool] += 1
                    else:
                        st["files_before"] += 1

    def next_batch(self) -> torch.Tensor:
        """The next ``[batch_size, seq_len]`` int64 batch."""
        out = np.empty((self.batch_size, self.seq_len), dtype=np.int64)
        for r in range(self.batch_size):
            self._fill_row(r, out[r])
        self.step += 1
        return torch.from_numpy(out)

    def __iter__(self) -> "PackedStream":
        return self

    def __next__(self) -> torch.Tensor:
        return self.next_batch()

    # -- resume --------------------------------------------------------------------

    def _config(self) -> dict[str, Any]:
        return {
            "split": self.split,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "task_fraction": self.task_fraction,
            "seed": self.seed,
            "tokenizer_hash": tokenizer_hash(self.tok),
            "n_files": self.n_files,
            **({"task_weights": self.task_weights} if self.task_weights else {}),
            **({"tasks_version": tasks.TASKS_VERSION} if self.task_fraction > 0 else {}),
            **({"distill": self.distill.digest, "distill_fraction": self.distill_fraction} if self.distill else {}),
            **({"sources": [s.as_dict() for s in self.sources]} if self._custom_sources else {}),
        }

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position of the stream (plus its configuration)."""
        return {
            "version": CACHE_VERSION,
            "step": self.step,
            "config": self._config(),
            "rows": [{**r, "files_before": list(r["files_before"]) if isinstance(r["files_before"], list)
                      else r["files_before"]} for r in self._rows],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict` (same configuration)."""
        cfg = self._config()
        if state.get("config") != cfg:
            raise ValueError(f"stream configuration mismatch: {state.get('config')} != {cfg}")
        rows = state["rows"]
        if len(rows) != self.batch_size:
            raise ValueError("batch_size mismatch")
        def seen(v):
            return [int(x) for x in v] if isinstance(v, list) else int(v)

        self._rows = [{"doc": int(r["doc"]), "offset": int(r["offset"]), "files_before": seen(r["files_before"])}
                      for r in rows]
        self._current = [None] * self.batch_size
        self.step = int(state["step"])
