"""Self-distillation data (sequence-level knowledge distillation): the model's own AR greedy
continuations of training prompts, used as stage-2 targets.

A parallel decoder trained on the sequential decoder's outputs learns one mode of each answer
instead of the spread of the real data, which is what lets it commit many positions at once; here
the teacher is free, since it is the same weights decoding in AR mode. Prompts are training task
prompts (never the held-out ones) and function headers from the training split of the stdlib;
the targets are what AR greedy writes after them (tasks up to the end of the line, or `task_tokens`
past it with `task_line=False`; code up to `code_tokens`).

A set is a directory: `distill.jsonl` (one JSON object per line: {"kind": "task" | "code" | "chat",
"text": prompt + continuation}) and `meta.json` (the teacher, the counts, a digest of the texts).
`PackedStream(distill=...)` mixes it into the training stream; `ensure_distill_set` builds it once
per run (so each phase distils from the model it starts from)."""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

from . import corpus, tasks

FORMAT = "clover.distill/1"


@dataclass
class DistillSet:
    task_lines: list[str]  # prompt + AR answer: one line (no newline), or the longer continuation
    code_docs: list[str]  # function header + AR continuation
    meta: dict

    @property
    def digest(self) -> str:
        return self.meta["digest"]


def distill_prompts(n_tasks: int, n_code: int, seed: int = 0) -> tuple[list[str], list[str]]:
    """Training task prompts (held-out ones excluded) and training-split function headers."""
    rng = random.Random(f"clover-distill:{seed}")
    it = tasks.iter_tasks(rng, exclude_heldout=True)
    task_prompts = [next(it).prompt for _ in range(n_tasks)]
    code_prompts = [h for h, _ in corpus.functions("train", n_code, seed=seed)] if n_code else []
    return task_prompts, code_prompts


def build_distill_set(llm, out: str | Path, *, n_tasks: int, n_code: int, seed: int = 0, task_tokens: int = 24,
                      code_tokens: int = 96, batch_size: int = 16, progress: bool = True, n_chat: int = 0,
                      chat_tokens: int = 48, task_line: bool = True) -> DistillSet:
    """Decode the prompts with `llm` in AR greedy mode, in batches, and write the set to `out`.
    A task's continuation stops at the end of its answer line (`task_line`), else runs `task_tokens`
    on, as a decode with no stop string does (what a drafter meets after a task prompt).
    `n_chat` training instructions (`clover.data.instructions`) are written with the model's chat
    template; the document is the rendered conversation up to the end of the answer's turn."""
    from tqdm import tqdm

    from . import instructions

    out = Path(out)
    task_prompts, code_prompts = distill_prompts(n_tasks, n_code, seed)
    tok = llm.tokenizer
    chat_prompts = [tok.apply_chat_template([{"role": "user", "content": m}])
                    for m in instructions.instructions("train", n_chat, seed=seed)] if n_chat else []
    prompts = {"task": task_prompts, "code": code_prompts, "chat": chat_prompts}
    # rows are appended to a part file after every batch, so an interrupted build continues where it
    # stopped; a row is kept only while it is the answer to the same prompt at the same place (so a
    # build with other counts keeps the prefix they share), decoded with the same token limits
    out.mkdir(parents=True, exist_ok=True)
    part = out / "distill.jsonl.part"
    header = _part_header(dict(seed=seed, task_tokens=task_tokens, code_tokens=code_tokens, chat_tokens=chat_tokens,
                               task_line=task_line))
    old = _read_part(part, header)
    shown = {"task": task_prompts, "code": code_prompts, "chat": [tok.decode(p) for p in chat_prompts]}
    results = []
    kept: dict[str, int] = {}  # per kind: how many of the old rows stay
    for kind in ("task", "code", "chat"):
        rows = [t for k, t in old if k == kind]
        n = 0
        while n < min(len(rows), len(shown[kind])) and rows[n].startswith(shown[kind][n]):
            n += 1
        results += [(kind, t) for t in rows[:n]]
        kept[kind] = n
    with open(part, "w", encoding="utf-8") as f:  # rewritten: a torn last line of a killed build goes
        f.write(json.dumps(header) + "\n")
        f.write(_jsonl(results))
        bar = tqdm(total=sum(map(len, prompts.values())), initial=len(results), desc="self-distillation (AR greedy)",
                   unit="prompt", disable=not progress)
        for kind, size in (("task", task_tokens), ("code", code_tokens), ("chat", chat_tokens)):
            for i in range(kept[kind], len(prompts[kind]), batch_size):
                chunk = prompts[kind][i : i + batch_size]
                kw = dict(mode="ar", max_new_tokens=size, temperature=0.0)
                if kind == "task" and task_line:
                    kw["stop"] = ["\n"]
                gens = llm.generate(chunk, **kw)
                rows = []
                for p, g in zip(chunk, gens):
                    if kind == "chat":  # the turn, closed by the end token when the answer ended in time
                        end = tok.decode([tok.eos_token_id]) if g.finish_reason == "stop" else ""
                        rows.append((kind, tok.decode(p) + g.text + end))
                    else:
                        rows.append((kind, p + g.text))
                f.write(_jsonl(rows))
                f.flush()
                results.extend(rows)
                bar.update(len(chunk))
        bar.close()
    order = {"task": 0, "code": 1, "chat": 2}  # kept rows of every kind came first: the set lists kind by kind
    results.sort(key=lambda r: order[r[0]])
    task_lines = [t for k, t in results if k == "task" and t.strip()]
    code_docs = [t for k, t in results if k in ("code", "chat") and t.strip()]
    digest = hashlib.sha256("\x00".join(t for _, t in results).encode()).hexdigest()[:16]
    meta = {"format": FORMAT, "teacher": str(getattr(llm, "path", "")), "tasks": len(task_lines),
            "code": sum(k == "code" for k, _ in results), "chat": sum(k == "chat" for k, _ in results), "seed": seed, "task_tokens": task_tokens, "code_tokens": code_tokens,
            "chat_tokens": chat_tokens, "task_line": task_line, "digest": digest}
    tmp = out / "distill.jsonl.tmp"
    tmp.write_text(_jsonl((k, t) for k, t in results if t.strip()), encoding="utf-8")
    tmp.replace(out / "distill.jsonl")
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    part.unlink()
    return DistillSet(task_lines, code_docs, meta)


def _jsonl(rows) -> str:
    """(kind, text) rows as the set's JSON Lines."""
    return "".join(json.dumps({"kind": k, "text": t}, ensure_ascii=False) + "\n" for k, t in rows)


def _read_part(part: Path, header: dict) -> list[tuple[str, str]]:
    """The rows an interrupted build left in `part` (none when it is absent or was for other prompts)."""
    try:
        lines = part.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    rows: list[tuple[str, str]] = []
    try:
        if not lines or json.loads(lines[0]) != header:
            return []
        for line in lines[1:]:
            r = json.loads(line)
            rows.append((r["kind"], r["text"]))
    except (ValueError, KeyError):  # a torn last line: keep the complete rows before it
        pass
    return rows


def load_distill_set(path: str | Path) -> DistillSet:
    path = Path(path)
    try:
        meta = json.loads((path / "meta.json").read_text())
        rows = [json.loads(line) for line in (path / "distill.jsonl").read_text(encoding="utf-8").splitlines() if line]
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not a self-distillation set ({e}); delete it to rebuild") from None
    if meta.get("format") != FORMAT:
        raise ValueError(f"{path}/meta.json: format {meta.get('format')!r}, expected {FORMAT!r}; delete it to rebuild")
    return DistillSet([r["text"] for r in rows if r["kind"] == "task"],
                      [r["text"] for r in rows if r["kind"] in ("code", "chat")], meta)


def ensure_distill_set(path: str | Path, teacher, **kw) -> DistillSet:
    """The set at `path`, built with `teacher()` (a function returning a `clover.LLM`) if it is not
    there yet. A set built with the same token limits and seed but fewer prompts of some kind than
    `kw` asks for grows: its rows are kept and only the new prompts are decoded (so a long run can
    start training on a first part and add more at a resume)."""
    path = Path(path)
    if (path / "meta.json").exists():
        have = load_distill_set(path)
        header = _part_header(kw)
        m = have.meta
        same = all(m.get(k) == v for k, v in header.items())
        more = (kw.get("n_tasks", 0) > m.get("tasks", 0) or kw.get("n_code", 0) > m.get("code", 0)
                or kw.get("n_chat", 0) > m.get("chat", 0))
        if not (same and more):
            return have
        rows = [(r["kind"], r["text"]) for r in map(json.loads, (path / "distill.jsonl").read_text(encoding="utf-8").splitlines())]
        (path / "distill.jsonl.part").write_text(json.dumps(header) + "\n" + _jsonl(rows), encoding="utf-8")
        (path / "meta.json").unlink()
    return build_distill_set(teacher(), path, **kw)


def _part_header(kw: dict) -> dict:
    """The part file's header for `build_distill_set(**kw)` (its defaults where `kw` has none)."""
    import inspect

    d = {k: p.default for k, p in inspect.signature(build_distill_set).parameters.items()}
    get = lambda k: kw.get(k, d[k])  # noqa: E731
    return {"format": FORMAT, "seed": get("seed"), "task_tokens": get("task_tokens"), "code_tokens": get("code_tokens"),
            "chat_tokens": get("chat_tokens"), "task_line": get("task_line")}


def frequent_tokens(distill: DistillSet, tokenizer: str | Path, n: int, vocab_size: int) -> list[int]:
    """The `n` token ids most frequent in the set's documents (ties and the rest of the `n`, when the
    set holds fewer distinct tokens, in id order: BPE ids run roughly from frequent to rare), for a
    drafter's reduced vocabulary (`DFlashConfig.draft_vocab_size`)."""
    from collections import Counter

    from .tokenizer import load_tokenizer

    if not 0 < n <= vocab_size:
        raise ValueError(f"a draft vocabulary of {n} tokens does not fit a vocabulary of {vocab_size}")
    tok = load_tokenizer(str(tokenizer))
    counts = Counter(i for t in distill.task_lines + distill.code_docs for i in tok.encode(t, add_special_tokens=False).ids)
    ranked = sorted((i for i in counts if i < vocab_size), key=lambda i: (-counts[i], i))[:n]
    chosen = set(ranked)
    rest = (i for i in range(vocab_size) if i not in chosen)
    return sorted(ranked + [next(rest) for _ in range(n - len(ranked))])


class DistillRows:
    """Rows of a self-distillation set, one document per row (not packed), right-padded with
    `pad_id`: each continuation is seen after its own prompt only, exactly as it was generated, so the
    data is the model's greedy output in its own context (a DFlash drafter's training stream).
    A `task_fraction` of the rows is one task line, the rest one code document; documents longer than
    `seq_len` are cut. With `min_len`, a batch is cut after its longest row (at least `min_len`
    columns), and `tail` columns of padding follow it: a drafter's anchor needs its whole block inside
    the batch, so without them a batch of short rows (a task's answer line) would never anchor on the
    last tokens of its longest row. Seeded per batch, so `state_dict` is just the batch count."""

    def __init__(self, distill: DistillSet, tokenizer: str | Path, *, seq_len: int, batch_size: int, seed: int,
                 task_fraction: float, pad_id: int, min_len: int = 0, tail: int = 0) -> None:
        from .tokenizer import load_tokenizer

        if not (distill.task_lines or distill.code_docs):
            raise ValueError("the self-distillation set is empty")
        tok = load_tokenizer(str(tokenizer))
        self.task = [tok.encode(t, add_special_tokens=False).ids[:seq_len] for t in distill.task_lines]
        self.code = [tok.encode(t, add_special_tokens=False).ids[:seq_len] for t in distill.code_docs]
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.task_fraction, self.pad_id, self.min_len = task_fraction, pad_id, min(min_len, seq_len)
        self.tail = tail if min_len else 0
        self.batches = 0

    def next_batch(self):
        import torch

        rng = random.Random(f"clover-distill-rows:{self.seed}:{self.batches}")
        self.batches += 1
        ids = torch.full((self.batch_size, self.seq_len + self.tail), self.pad_id, dtype=torch.long)
        for b in range(self.batch_size):
            pool = self.task if self.task and (not self.code or rng.random() < self.task_fraction) else self.code
            doc = rng.choice(pool)
            ids[b, : len(doc)] = torch.tensor(doc, dtype=torch.long)
        if self.min_len:  # the batch ends after its longest row: no forward over columns of padding alone
            used = int((ids != self.pad_id).any(0).nonzero().max()) + 1 if (ids != self.pad_id).any() else 0
            ids = ids[:, : max(used + self.tail, self.min_len)]
        return ids

    def state_dict(self) -> dict:
        return {"batches": self.batches, "config": {"seed": self.seed, "seq_len": self.seq_len,
                                                    "batch_size": self.batch_size, "task_fraction": self.task_fraction}}

    def load_state_dict(self, state: dict) -> None:
        self.batches = int(state["batches"])
