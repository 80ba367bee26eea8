"""Quick held-out metrics for a checkpoint (teacher-forced, so they cost one forward per batch).

- `heldout_lm`: next-token loss / accuracy on the held-out packed stream (held-out stdlib files +
  held-out tasks).
- `task_answer_metrics`: for held-out tasks presented as a fresh document (EOS, then the prompt
  `assert <expr> == `), the answer tokens and the closing newline are scored teacher-forced:
  token accuracy (argmax == target), the fraction of answer tokens whose target probability is
  >= `threshold` (what a confidence-threshold decoder could accept at once), and exact match
  (every answer token argmax-correct, which is what greedy AR decoding produces).

CLI: `clover train evaluate MODEL_OR_CKPT_DIR [--tokenizer DIR] [--tasks 500] [--batches 8]`.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F


@torch.no_grad()
def heldout_lm(model, tokenizer, *, batches: int = 8, seq_len: int = 256, batch_size: int = 8,
               task_fraction: float = 0.6, seed: int = 0) -> dict[str, float]:
    from ..data.mix import PackedStream

    stream = PackedStream(tokenizer, "heldout", seq_len=seq_len, batch_size=batch_size, task_fraction=task_fraction, seed=seed)
    tot_loss, tot_correct, n = 0.0, 0, 0
    for _ in range(batches):
        ids = stream.next_batch().to(model.device)
        logits = model(ids)[:, :-1].float()
        tgt = ids[:, 1:]
        tot_loss += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt.reshape(-1), reduction="sum"))
        tot_correct += int((logits.argmax(-1) == tgt).sum())
        n += tgt.numel()
    return {"heldout_loss": tot_loss / n, "heldout_acc": tot_correct / n, "heldout_tokens": n}


@torch.no_grad()
def task_answer_metrics(model, tokenizer, *, n_tasks: int = 500, threshold: float = 0.95, batch_size: int = 64) -> dict:
    from ..data import tasks as T
    from ..data.tokenizer import EOS_TOKEN, load_tokenizer

    tok = load_tokenizer(tokenizer)
    eos = tok.token_to_id(EOS_TOKEN)
    items = []
    for t in T.heldout_tasks(n_tasks):
        p = tok.encode(t.prompt, add_special_tokens=False).ids
        a = tok.encode(t.answer + "\n", add_special_tokens=False).ids
        items.append((t.kind, [eos] + p, a))
    n_tok = n_ok = n_conf = n_exact = 0
    per_kind = defaultdict(lambda: [0, 0])
    for i in range(0, len(items), batch_size):
        chunk = items[i : i + batch_size]
        L = max(len(p) + len(a) for _, p, a in chunk)
        ids = torch.zeros(len(chunk), L, dtype=torch.long)  # right-padded; causal, so padding is harmless
        for r, (_, p, a) in enumerate(chunk):
            ids[r, : len(p) + len(a)] = torch.tensor(p + a)
        probs = model(ids.to(model.device)).float().softmax(-1).cpu()
        for r, (kind, p, a) in enumerate(chunk):
            pos = torch.arange(len(p) - 1, len(p) + len(a) - 1)
            tgt = torch.tensor(a)
            pr = probs[r, pos]
            ok = pr.argmax(-1) == tgt
            conf = pr.gather(1, tgt[:, None])[:, 0] >= threshold
            n_tok += len(a)
            n_ok += int(ok.sum())
            n_conf += int(conf.sum())
            exact = bool(ok.all())
            n_exact += exact
            per_kind[kind][0] += exact
            per_kind[kind][1] += 1
    return {
        "tasks": len(items),
        "answer_token_acc": n_ok / max(n_tok, 1),
        f"answer_tokens_p>={threshold}": n_conf / max(n_tok, 1),
        "exact_match": n_exact / max(len(items), 1),
        "exact_by_kind": {k: round(v[0] / v[1], 3) for k, v in sorted(per_kind.items())},
    }


def find_tokenizer(model: str | Path) -> str | None:
    """The tokenizer beside a model directory, or a training checkpoint's run's (`<run>/tokenizer`)."""
    d = Path(model)
    for cand in (d, d.parent.parent / "tokenizer"):
        if (cand / "tokenizer.json").is_file():
            return str(cand)
    return None


def evaluate(model: str | Path, tokenizer: str, *, tasks: int = 500, batches: int = 8, threshold: float = 0.95) -> dict:
    """`heldout_lm` and `task_answer_metrics` of a model directory or checkpoint, in float32."""
    from ..checkpoint import load_model

    m = load_model(Path(model), dtype=torch.float32)
    return {**heldout_lm(m, tokenizer, batches=batches), **task_answer_metrics(m, tokenizer, n_tasks=tasks, threshold=threshold)}
