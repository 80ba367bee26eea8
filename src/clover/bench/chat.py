"""`clover bench chat`: an instruction-tuned model on held-out questions with known answers, every
mode on the same weights, through the model's own chat template.

Questions (`clover.data.instructions.questions`: facts, arithmetic, lists, code asserts; none of
them ever in a training stream) are asked as one user turn; a reply is right when it contains an
accepted answer. Protocol as `clover bench decode`: greedy, batch 1, one warm-up per mode, then every
mode in turn on each question (interleaved, so load on a shared machine hits all modes alike).
Per mode: accuracy (overall and per kind), tokens/forward, tokens/s (median over questions and
total tokens over total seconds), whether the tokens equal AR's, and the ratios to AR. With
`llama_bench` (a llama.cpp `llama-bench` binary and the GGUF the model came from) llama.cpp's AR
decode speed on that file is measured in the same run, with the same thread count.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from pathlib import Path

SCHEMA = "clover.bench.chat/1"
DEFAULT_MODES = "ar,diffusion,speculative"  # the baseline, the default mode, the lossless one


def run_chat(llm, *, questions: int = 40, modes=DEFAULT_MODES.split(","), max_new_tokens: int = 48,
             block_size: int | None = None, threshold: float | None = None, seed: int = 0, progress=None) -> dict:
    from ..data.instructions import questions as held_out_questions

    qs = held_out_questions(questions, seed=seed)
    kw = dict(max_new_tokens=max_new_tokens, temperature=0.0)
    if block_size is not None:
        kw["block_size"] = block_size
    if threshold is not None:
        kw["threshold"] = threshold
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q.prompt}]) for q in qs]
    for m in modes:  # warm-up
        llm.generate(prompts[0], mode=m, **{**kw, "max_new_tokens": 8})
    runs = []
    for i, (q, ids) in enumerate(zip(qs, prompts)):
        for m in modes:
            t0 = time.perf_counter()
            g = llm.generate(ids, mode=m, **kw)
            dt = time.perf_counter() - t0
            runs.append({"q": i, "kind": q.kind, "mode": m, "text": g.text, "token_ids": list(g.token_ids),
                         "tokens": g.stats.tokens, "forwards": g.stats.forwards, "seconds": dt,
                         "correct": q.check(g.text), "finish_reason": g.finish_reason})
        if progress:
            progress(f"question {i + 1}/{len(qs)}")
    return {"schema": SCHEMA, "model": str(llm.path), "questions": [q.__dict__ for q in qs],
            "settings": {"modes": list(modes), "max_new_tokens": max_new_tokens, "block_size": block_size or llm.config.block_size,
                         "threshold": threshold or llm.config.threshold, "greedy": True, "batch_size": 1,
                         "interleaved": True},
            "modes": summarize(runs, modes), "runs": runs}


def summarize(runs: list[dict], modes) -> dict:
    out: dict[str, dict] = {}
    ar = {r["q"]: r for r in runs if r["mode"] == "ar"}
    for m in modes:
        rs = [r for r in runs if r["mode"] == m]
        kinds = sorted({r["kind"] for r in rs})
        tokens, forwards, seconds = (sum(r[k] for r in rs) for k in ("tokens", "forwards", "seconds"))
        rec = {
            "accuracy": sum(r["correct"] for r in rs) / max(len(rs), 1),
            "by_kind": {k: sum(r["correct"] for r in rs if r["kind"] == k) / sum(r["kind"] == k for r in rs) for k in kinds},
            "tokens": tokens, "forwards": forwards, "tokens_per_forward": tokens / max(forwards, 1),
            "tokens_per_second": tokens / seconds if seconds else 0.0,
            "tokens_per_second_median": statistics.median(r["tokens"] / r["seconds"] for r in rs if r["seconds"]),
        }
        if ar and m != "ar":
            rec["matches_ar"] = sum(r["token_ids"] == ar[r["q"]]["token_ids"] for r in rs) / max(len(rs), 1)
            rec["vs_ar_tokens_per_second"] = rec["tokens_per_second"] / max(out["ar"]["tokens_per_second"], 1e-9) \
                if "ar" in out else None
        out[m] = rec
    return out


def llama_bench(binary: str | Path, gguf: str | Path, *, threads: int = 1, n: int = 48, reps: int = 3) -> dict:
    """llama.cpp's AR decode speed (tg N, no prompt) on `gguf`: `llama-bench -p 0 -n N -t T -r R -o json`."""
    cmd = [str(binary), "-m", str(gguf), "-p", "0", "-n", str(n), "-t", str(threads), "-r", str(reps), "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"llama-bench failed: {r.stderr.strip().splitlines()[-1:]}")
    rows = json.loads(r.stdout)
    tg = next(x for x in rows if x.get("n_gen"))
    return {"engine": "llama.cpp", "tokens_per_second": tg["avg_ts"], "stddev": tg.get("stddev_ts"), "n_gen": tg["n_gen"],
            "threads": threads, "type": tg.get("model_type"), "command": " ".join(cmd)}


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [f"clover bench chat · {result['model']} · {len(result['questions'])} held-out questions · "
             f"{s['max_new_tokens']} new tokens · block {s['block_size']} · threshold {s['threshold']}", "",
             "| mode | accuracy | by kind | tokens/forward | tokens/s | ×AR tok/s | = AR |", "|---|---|---|---|---|---|---|"]
    for m, r in result["modes"].items():
        kinds = ", ".join(f"{k} {v:.0%}" for k, v in r["by_kind"].items())
        vs = r.get("vs_ar_tokens_per_second")
        lines.append(f"| {m} | {r['accuracy']:.1%} | {kinds} | {r['tokens_per_forward']:.2f} | {r['tokens_per_second']:.1f} | "
                     f"{'-' if vs is None else f'{vs:.2f}'} | {'-' if 'matches_ar' not in r else format(r['matches_ar'], '.0%')} |")
    if result.get("llama_cpp"):
        lc = result["llama_cpp"]
        lines.append(f"| llama.cpp AR ({lc['type']}) | - | - | 1.00 | {lc['tokens_per_second']:.1f} | "
                     f"{lc['tokens_per_second'] / max(result['modes']['ar']['tokens_per_second'], 1e-9):.2f} | - |")
    return "\n".join(lines)
