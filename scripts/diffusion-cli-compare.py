#!/usr/bin/env python3
"""clover's canvas mode beside stock llama.cpp's `llama-diffusion-cli` on the same weights: the tokens
(agreement) and the tokens/s, the two run in turn per prompt, 1 thread (docs/checkpoints.md, "Beside
llama.cpp's llama-diffusion-cli"; the figures in docs/experiments.md).

    scripts/diffusion-cli-compare.py MODEL_DIR MODEL.gguf --steps 8,16,N [--canvas 64] [--block B]
        [--prompts 10] [--set canvas_cache=dual ...] [--json OUT.json]

MODEL_DIR is a Dream, LLaDA or LLaDA-MoE checkpoint and MODEL.gguf the same weights converted by llama.cpp's
own `convert_hf_to_gguf.py` (in the tree `scripts/build-llama-cpp.sh` unpacks; it needs sentencepiece).
Both decode in the CLI's only deterministic setting: the CLI with `--top-k 1 --temp 0 -s 1
--diffusion-algorithm 4` (its sampler always draws; top-k 1 leaves one candidate, so every confidence
ties and it unmasks left to right), clover with `top_k=1, temperature=0, canvas_ties="position"` (the
same ties broken the same way). The prompt goes through the chat template (the CLI always applies it);
the canvas is `--canvas` positions, prompt included (the CLI's -c/-b/-ub). `--steps N` means one token a
step. For LLaDA the CLI counts its blocks over the whole canvas, prompt included; a prompt whose masks
make another number of blocks is skipped with a line saying so. `--set k=v` adds a clover option (e.g.
`canvas_cache=dual`): an approximate mode, so agreement is no longer expected; the speed is the point.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):", "Water boils at", "List three colours:",
           "Write a haiku about rain.", "What is 12 times 7?", "Translate 'good morning' to French.",
           "Name a prime number.", "Explain gravity in one sentence.", "SELECT * FROM", "The quick brown fox",
           "import numpy as np", "Dear Sir or Madam,", "In 1492, Columbus"]


def run_cli(cli: Path, gguf: Path, prompt: str, steps: int, canvas: int, block: int | None, dream: bool) -> tuple[str, float]:
    """(the CLI's canvas as text, its own total time in seconds)."""
    cmd = [str(cli), "-m", str(gguf), "-p", prompt, "-t", "1", "-ub", str(canvas), "-b", str(canvas), "-c", str(canvas),
           "--diffusion-steps", str(steps), "--top-k", "1", "--temp", "0", "-s", "1", "--diffusion-algorithm", "4"]
    cmd += ["--diffusion-eps", "0.001"] if dream else ["--diffusion-block-length", str(block or canvas)]
    r = subprocess.run(cmd, capture_output=True, timeout=3600)
    err = r.stderr.decode("utf-8", "replace")
    total = re.search(r"total time: ([\d.]+)ms", err)
    if r.returncode != 0 or total is None or "sampling time per step" not in err:
        sys.exit(f"error: llama-diffusion-cli failed ({r.returncode}): {err.strip()[-400:]}")
    tail = err.rsplit("sampling time per step", 1)[1].split("\n", 1)[1]
    return tail.split("\n", 1)[1].rstrip("\n"), float(total.group(1)) / 1000  # after the log line's prefix


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help="the checkpoint directory (Dream, LLaDA, LLaDA-MoE)")
    ap.add_argument("gguf", type=Path, help="the same weights converted by llama.cpp's convert_hf_to_gguf.py")
    ap.add_argument("--steps", default="N", help="comma-separated step counts; N: one token a step (default: N)")
    ap.add_argument("--canvas", type=int, default=64, help="positions, prompt included (default: 64)")
    ap.add_argument("--block", type=int, default=None, help="LLaDA's block length (default: the canvas)")
    ap.add_argument("--prompts", type=int, default=10, help=f"how many of the {len(PROMPTS)} prompts (default: 10)")
    ap.add_argument("--set", action="append", default=[], metavar="K=V", help="an extra clover option")
    ap.add_argument("--json", type=Path, help="write the per-prompt rows here")
    a = ap.parse_args()

    import torch

    import clover
    from clover.integrations.llama_port import llama_cache_dir

    torch.set_num_threads(1)
    cli = llama_cache_dir() / "build" / "bin" / "llama-diffusion-cli"
    if not cli.is_file():
        sys.exit(f"error: {cli} not found: run scripts/build-llama-cpp.sh")
    if not a.gguf.is_file():
        sys.exit(f"error: {a.gguf}: no such GGUF (convert the checkpoint with llama.cpp's convert_hf_to_gguf.py)")
    extra = {}
    for kv in a.set:
        k, _, v = kv.partition("=")
        extra[k] = int(v) if v.lstrip("-").isdigit() else float(v) if re.fullmatch(r"-?\d*\.\d+", v) else v
    llm = clover.load(a.model)
    family = llm.config.model_type
    dream = family == "Dream"
    rows = []
    for steps_s in a.steps.split(","):
        for p in PROMPTS[: a.prompts]:
            tok = llm.tokenizer  # the CLI applies the GGUF's chat template, chatml where it has none
            chat = (tok.apply_chat_template([{"role": "user", "content": p}]) if tok.chat_template else
                    tok.encode(f"<|im_start|>user\n{p}<|im_end|>\n<|im_start|>assistant\n"))
            n = a.canvas - len(chat)
            steps = n if steps_s == "N" else int(steps_s)
            kw = dict(mode="canvas", steps=steps, max_new_tokens=n, temperature=0, ignore_eos=True, top_k=1,
                      canvas_ties="position", **extra)
            if not dream:
                block = min(a.block or a.canvas, n)
                if -(-n // block) != a.canvas // (a.block or a.canvas):
                    print(f"skip {p!r}: {n} masks make {-(-n // block)} blocks of {block}; the CLI counts "
                          f"{a.canvas // (a.block or a.canvas)} (prompt included)")
                    continue
                kw["block_size"] = block
            theirs, cli_s = run_cli(cli, a.gguf, p, steps, a.canvas, a.block, dream)
            t0 = time.perf_counter()
            out = llm.generate(chat, **kw)
            ours_s = time.perf_counter() - t0
            ours = llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
            at = next((i for i, (x, y) in enumerate(zip(theirs, ours)) if x != y), None)
            same = theirs == ours
            rows.append(dict(prompt=p, steps=steps, masks=n, same=same, cli_s=cli_s, clover_s=ours_s, differs_at=at))
            print(f"steps={steps:3d} masks={n:3d} same={same!s:5} cli {cli_s:7.3f}s clover {ours_s:7.3f}s {p!r}", flush=True)
            if not same:
                i = at if at is not None else min(len(theirs), len(ours))
                print(f"    cli   : {theirs[max(0, i - 20): i + 50]!r}\n    clover: {ours[max(0, i - 20): i + 50]!r}")
    if not rows:
        sys.exit("error: no prompt fits this canvas and block")
    cli_t, ours_t = sum(r["cli_s"] for r in rows), sum(r["clover_s"] for r in rows)
    print(f"{family}: identical {sum(r['same'] for r in rows)}/{len(rows)}; seconds: llama-diffusion-cli {cli_t:.2f}, "
          f"clover {ours_t:.2f}: clover's tokens/s {cli_t / ours_t:.2f}x the CLI's ({', '.join(a.set) or 'exact'})")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
