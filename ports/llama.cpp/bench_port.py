"""Timing of the llama.cpp port against stock llama.cpp AR (docs/llama-port.md, "Speed").

    python ports/llama.cpp/bench_port.py [--model DIR] [--dtypes f32,bf16,q8_0] [--prompts 20] [-n 64]

One thread, one run per configuration, the same held-out task prompts (as token ids) everywhere:
- stock llama.cpp AR: `clover-llama-probe greedy N` per prompt, timed as wall(greedy N) - wall(greedy 0)
  (process start, load and prefill cancel; EOS banned so every prompt runs N tokens), and
  `llama-bench -p 0 -n N -r 1 -t 1`;
- the port (`llama-clover`): ar, diffusion (threshold 0.95: block 32 with the threshold rule and the
  model's entropy rule, blocks 16 and 8 with the threshold rule), speculative (draft 32, 8, 4); its own
  clock: the decode loop, prefill included.
Prints a Markdown table: tokens, forwards, tokens per forward, tokens/s, and tokens/s over stock AR.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))

from clover.integrations.llama_port import llama_cache_dir, port_binary, run  # noqa: E402


def probe_tokens_per_s(probe: Path, gguf: Path, prompts, n: int, eos) -> float:
    env = {**os.environ, "CLOVER_PROBE_THREADS": "1"}
    total = 0.0
    for ids in prompts:
        walls = []
        for k in (n, 0):
            t = time.perf_counter()
            subprocess.run([str(probe), str(gguf), "greedy", str(k), *map(str, eos)], input=" ".join(map(str, ids)).encode(),
                           capture_output=True, check=True, env=env)
            walls.append(time.perf_counter() - t)
        total += walls[0] - walls[1]
    return len(prompts) * n / total


def llama_bench_tokens_per_s(gguf: Path, n: int) -> float | None:
    exe = llama_cache_dir() / "build" / "bin" / "llama-bench"
    if not exe.exists():
        return None
    r = subprocess.run([str(exe), "-m", str(gguf), "-p", "0", "-n", str(n), "-r", "1", "-t", "1", "-o", "json"],
                       capture_output=True, check=True)
    return float(json.loads(r.stdout)[0]["avg_ts"])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(REPO / "src" / "clover" / "assets" / "clover-tiny"))
    ap.add_argument("--dtypes", default="f32,bf16,q8_0")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("-n", type=int, default=64)
    a = ap.parse_args()

    import clover
    from clover.data.tasks import heldout_tasks
    from clover.export.gguf import export_gguf

    llm = clover.load(a.model, dtype="float32")
    prompts = [llm.tokenizer.encode(t.prompt) for t in heldout_tasks(a.prompts)]
    eos = llm.config.eos_token_ids
    probe = llama_cache_dir() / "bin" / "clover-llama-probe"
    port = port_binary()
    configs = [
        ("ar", ["--mode", "ar", "--ignore-eos"]),
        ("diffusion, threshold rule", ["--mode", "diffusion", "--block", "32", "--policy", "threshold", "--threshold", "0.95"]),
        ("diffusion, entropy rule", ["--mode", "diffusion", "--block", "32", "--policy", "entropy", "--threshold", "0.95"]),
        ("diffusion, threshold rule, block 16", ["--mode", "diffusion", "--block", "16", "--policy", "threshold", "--threshold", "0.95"]),
        ("diffusion, threshold rule, block 8", ["--mode", "diffusion", "--block", "8", "--policy", "threshold", "--threshold", "0.95"]),
        ("speculative, draft 32", ["--mode", "speculative", "--block", "32", "--ignore-eos"]),
        ("speculative, draft 8", ["--mode", "speculative", "--block", "32", "--draft", "8", "--ignore-eos"]),
        ("speculative, draft 4", ["--mode", "speculative", "--block", "32", "--draft", "4", "--ignore-eos"]),
    ]
    print(f"| dtype | engine | tokens | forwards | tokens/forward | tokens/s | × stock AR |")
    print("|---|---|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in a.dtypes.split(","):
            gguf = Path(tmp) / f"model-{dtype}.gguf"
            export_gguf(a.model, gguf, dtype=dtype, progress=False)
            stock = probe_tokens_per_s(probe, gguf, prompts, a.n, eos)
            bench = llama_bench_tokens_per_s(gguf, a.n)
            print(f"| {dtype} | stock llama.cpp AR (probe) | {len(prompts) * a.n} | {len(prompts) * a.n} | 1.00 | {stock:.1f} | 1.00 |")
            if bench is not None:
                print(f"| {dtype} | stock llama.cpp AR (llama-bench) | {a.n} | {a.n} | 1.00 | {bench:.1f} | {bench / stock:.2f} |")
            for name, args in configs:
                res = run(gguf, prompts, ["-n", str(a.n), *args], eos_ids=eos, binary=port)
                tok = sum(r["n_tokens"] for r in res)
                fwd = sum(r["forwards"] for r in res)
                sec = sum(r["seconds"] for r in res)
                print(f"| {dtype} | port {name} | {tok} | {fwd} | {tok / fwd:.2f} | {tok / sec:.1f} | {tok / sec / stock:.2f} |")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
