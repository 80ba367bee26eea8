"""clover against a released family's reference `generate`, at several generation lengths: the table and a plot.

    python scripts/reference-lengths.py CHECKPOINT --engine llada2-reference --reference DIR \
        --reference-python PYTHON [--lengths 64,128,256] [--batch 8] [--out build/bench/lengths]

A reference that keeps no cache (LLaDA2's `generate` recomputes the whole window up to the block it
decodes at every step) costs more per token the longer the answer, while clover's cached step costs the
same: the ratio depends on the generation length, so this measures it at each length instead of one.
Each length is one `clover bench peers` run (`bench.peers.run_peers`: clover's diffusion mode and the
reference on the same prompts, interleaved, greedy, no stop, 1 thread; batch 1 and `--batch`, the
reference one prompt at a time) on 8 prompts of 9–39 random token ids (a fixed draw). Writes
`lengths.json` (every run's result) and `lengths.png` (`--replot` redraws it from the JSON) (clover × reference against the generation
length, batch 1 and batch `--batch`, with the 2× / 4× lines of issue 48) to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch


def prompts(vocab: int, n: int = 8, seed: int = 1) -> list[str]:
    """`n` prompts of 9–39 token ids written as the tiny tokenizers' `t<id>` words (the draw of the runs in docs)."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(9, 40, (n,), generator=gen).tolist()
    return [" ".join(f"t{i}" for i in torch.randint(0, vocab - 2, (k,), generator=gen).tolist()) for k in lengths]


def speedups(result: dict, batch: int) -> dict:
    """{batch: clover diffusion's aggregate tok/s over the reference's} for batch 1 and `batch` of one run:
    the reference row's `clover_speedup` (`bench.peers.report.summarize`)."""
    return {b: next((r["clover_speedup"] for r in result["rows"] if r["engine"] != "clover" and r["batch"] == b), None)
            for b in (1, batch)}


def plot(runs: list[dict], batch: int, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.2, 3.2), dpi=100)
    ns = [r["n"] for r in runs]
    top = 0.0
    for b, goal, colour in ((1, 2.0, "#4c72b0"), (batch, 4.0, "#dd8452")):
        ys = [r["speedup"][str(b)] if str(b) in r["speedup"] else r["speedup"].get(b) for r in runs]
        ax.plot(ns, ys, "o-", color=colour, label=f"batch {b}")
        for x, y in zip(ns, ys):
            if y:
                ax.annotate(f"{y:.2f}×", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        ax.axhline(goal, color=colour, ls=":", lw=1)
        ax.text(ns[-1], goal, f"goal {goal:.0f}× (batch {b}) ", ha="right", va="top", fontsize=6, color=colour)
        top = max([top, goal] + [y for y in ys if y])
    ax.set_xscale("log", base=2)
    ax.set_xticks(ns)
    ax.set_xticklabels([str(n) for n in ns], fontsize=7)
    ax.tick_params(axis="y", labelsize=7)
    ax.set_xlabel("new tokens per prompt", fontsize=8)
    ax.set_ylabel("clover × reference (tokens/s)", fontsize=8)
    ax.set_ylim(0, top * 1.15)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    ax.set_title(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkpoint", type=Path, help="a checkpoint of the family in its released layout")
    ap.add_argument("--engine", required=True, choices=["sdar-reference", "llada2-reference", "fastdllm2-reference"])
    ap.add_argument("--reference", required=True, help="the reference's code (as `clover bench peers --reference`)")
    ap.add_argument("--reference-python", required=True, help="the interpreter that runs it")
    ap.add_argument("--lengths", default="64,128,256", help="comma-separated new tokens per prompt")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--out", type=Path, default=Path("build/bench/lengths"))
    ap.add_argument("--title", default=None, help="the plot's title (default: the checkpoint's folder name)")
    ap.add_argument("--replot", action="store_true", help="only redraw lengths.png from --out's lengths.json")
    a = ap.parse_args()
    title = a.title or f"{a.checkpoint.name}: clover against {a.engine}, 1 thread"
    if a.replot:
        runs = json.loads((a.out / "lengths.json").read_text())
        plot(runs, a.batch, a.out / "lengths.png", title)
        print(f"wrote {a.out / 'lengths.png'}")
        return
    from clover.bench.peers import run_peers

    lengths = [int(x) for x in a.lengths.split(",")]
    vocab = json.loads((a.checkpoint / "config.json").read_text())["vocab_size"]
    texts = prompts(vocab)
    torch.set_num_threads(1)
    a.out.mkdir(parents=True, exist_ok=True)
    runs = []
    for n in lengths:
        t0, load = time.time(), os.getloadavg()[0]
        result = run_peers(a.checkpoint, prompt_texts=texts, max_new_tokens=n, threads=[1], batch=a.batch,
                           batch_rounds=1, modes=["diffusion"], engines=["clover", a.engine], reference=a.reference,
                           reference_python=a.reference_python, progress=lambda s, n=n: print(f"[n={n}] {s}", flush=True))
        sp = speedups(result, a.batch)
        same = [r.get("matches_clover_mode") for r in result["rows"] if r["engine"] == a.engine and r["batch"] == 1]
        runs.append({"n": n, "load": [load, os.getloadavg()[0]], "seconds": time.time() - t0, "speedup": sp,
                     "reference_same_tokens": same[0] if same else None, "result": result})
        print(f"n={n}: clover x reference " + ", ".join(f"batch {b} {v:.2f}x" for b, v in sp.items() if v)
              + f"; same tokens {same}; load {load:.1f}-{os.getloadavg()[0]:.1f}", flush=True)
        (a.out / "lengths.json").write_text(json.dumps(runs, indent=1, default=str))
    plot(runs, a.batch, a.out / "lengths.png", title)
    print(f"wrote {a.out / 'lengths.json'} and {a.out / 'lengths.png'}")


if __name__ == "__main__":
    main()
