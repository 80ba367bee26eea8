"""Timing of the llama.cpp port against stock llama.cpp AR (docs/llama-port.md, "Speed").

    python ports/llama.cpp/bench_port.py [--model DIR] [--dtypes f32,bf16,q8_0] [--prompts 20] [-n 64]
                                         [--rounds 3] [--clock cpu|wall] [--configs "ar;speculative, draft 4"]
                                         [--compare "--moe mul_mat_id"] [--drafter DIR]

One thread, the same held-out task prompts (as token ids) everywhere, `--rounds` interleaved rounds
(stock and every port row in turn, per round), the median round reported:
- stock llama.cpp AR: `clover-llama-probe greedy N` per prompt, timed as t(greedy N) - t(greedy 0)
  (process start, load and prefill cancel; EOS banned so every prompt runs N tokens), and
  `llama-bench -p 0 -n N -r 1 -t 1` (wall clock, its own);
- the port (`llama-clover`): ar, diffusion (the model's defaults: its block size and rule; threshold
  0.95: block 32 with the threshold rule and the entropy rule, blocks 16 and 8 with the threshold rule),
  speculative (draft 32, 8, 6, 4, 3; drafts 6 and 3 also with expert budget 2), dflash (the DFlash
  drafter `--drafter DIR`, by default the bundled model's, exported in the row's dtype or in q8_0:
  its default confidence cut; `--verify batched`; fixed drafts of 3 and 7), block_size "auto" in
  diffusion, speculative and dflash (the step costs measured in the first round, cached for the later ones; a
  comment line after the table gives them and the decisions per width), and denoise forwards
  of width 8 and 32 (threshold 1.5: one token per forward, the block never ended early: the cost of
  a denoise forward of that width, a block's commit in every width-th); its own clock over the
  decode loop with the first (prefill) forward taken out, as stock's.
`--clock cpu` (the default) times CPU seconds (the child's user + system time for the probe, the
port's process CPU clock), which a loaded machine disturbs far less than wall time; `wall` times
wall seconds. Prints a Markdown table: tokens, forwards, tokens per forward, time per forward (and
over a stock AR step), tokens/s, and tokens/s over stock AR. `--compare ARGS` runs every port row a
second time with ARGS added to its command line, in the same rounds (one change measured on its own:
e.g. `--moe mul_mat_id`, the port's routed experts through ggml_mul_mat_id instead of its grouped
expert matmul), and reports whether both gave the same tokens. `--model DIR` times another
checkpoint (the 0.7B rows: `clover tiny DIR --shape 0.7b`, `--dtypes q8_0 --configs "ar;denoise,
width 8;denoise, width 32"`).

`--batch 1,4,8,16` times rows in one forward instead (docs/llama-port.md, "Rows in one forward"): per
batch size B, every prompt through one port process with `--parallel B` (B rows in flight, a row
joining as one leaves), the aggregate generated tokens over the process's CPU seconds less those of
the same command with `-n 1` (start, load and the prompts' prefill); B = 1 is the port decoding
the rows one by one. Stock llama.cpp's own batched decode alongside: `llama-batched-bench -npl B` with
the prompts' mean length and N tokens per row, B·(N − 1) over the CPU seconds of `-ntg N` less `-ntg 1`.
The configs default to "ar" and "diffusion, the model's defaults"; each batched row reports its rows
per forward and whether its tokens equal B = 1's.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "src"))

from clover.integrations.llama_port import llama_cache_dir, port_binary, run  # noqa: E402


def child_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def probe_tokens_per_s(probe: Path, gguf: Path, prompts, n: int, eos, clock: str) -> float:
    env = {**os.environ, "CLOVER_PROBE_THREADS": "1"}
    if os.environ.get("CLOVER_PROBE_NO_REPACK"):
        env["CLOVER_PROBE_NO_REPACK"] = "1"
    total = 0.0
    for ids in prompts:
        spent = []
        for k in (n, 0):
            t, c = time.perf_counter(), child_cpu()
            subprocess.run([str(probe), str(gguf), "greedy", str(k), *map(str, eos)], input=" ".join(map(str, ids)).encode(),
                           capture_output=True, check=True, env=env)
            spent.append(child_cpu() - c if clock == "cpu" else time.perf_counter() - t)
        total += spent[0] - spent[1]
    return len(prompts) * n / total


def port_seconds(r: dict, clock: str) -> float:
    """The port's decode time with the first (prefill) forward taken out."""
    if clock == "cpu":
        return r["cpu_seconds"] - r["prefill_forward_cpu_seconds"]
    return r["seconds"] - r["prefill_forward_seconds"]


def port_batch_tokens_per_s(gguf: Path, prompts, args: list[str], n: int, eos, parallel: int, port: Path):
    """(aggregate tokens/s, tokens, results) of every prompt through one port process with
    `--parallel`: the tokens and CPU seconds of an `-n N` run less those of an `-n 1` run (start,
    load and the prompts' prefill)."""
    spent, res = [], []
    for k in (n, 1):
        c = child_cpu()
        res.append(run(gguf, prompts, [*args, "-n", str(k)], eos_ids=eos, binary=port, parallel=parallel))
        spent.append(child_cpu() - c)
    tok = [sum(r["n_tokens"] for r in out) for out in res]
    return (tok[0] - tok[1]) / (spent[0] - spent[1]), tok[0], res[0]


def stock_batched_tokens_per_s(gguf: Path, n_prompt: int, n: int, batch: int) -> float | None:
    """llama-batched-bench's aggregate decode tokens/s at `batch` rows of `n_prompt` + `n` tokens: the
    `batch` (n - 1) tokens over the CPU seconds of `-ntg n` less those of `-ntg 1` (start, load,
    prefill, the first step's graph); weight repacking off with CLOVER_PROBE_NO_REPACK=1, as the probe."""
    exe = llama_cache_dir() / "build" / "bin" / "llama-batched-bench"
    if not exe.exists():
        return None
    spent = []
    for k in (n, 1):
        cmd = [str(exe), "-m", str(gguf), "-c", str(batch * (n_prompt + n) + 256), "-b", "2048", "-ub", "512",
               "-npp", str(n_prompt), "-ntg", str(k), "-npl", str(batch), "-t", "1", "-fa", "on"]
        if os.environ.get("CLOVER_PROBE_NO_REPACK"):
            cmd.append("--no-repack")
        c = child_cpu()
        r = subprocess.run(cmd, capture_output=True)
        if r.returncode != 0:
            print(f"llama-batched-bench failed ({r.returncode}) on {gguf.name}; row left out", file=sys.stderr)
            return None
        spent.append(child_cpu() - c)
    return batch * (n - 1) / (spent[0] - spent[1])


def exported(model, dtypes: str, tmp: str):
    """(dtype, GGUF path) for each of the comma-separated `dtypes`: `model` exported into `tmp`."""
    from clover.export.gguf import export_gguf

    for dtype in dtypes.split(","):
        gguf = Path(tmp) / f"model-{dtype}.gguf"
        export_gguf(model, gguf, dtype=dtype, progress=False)
        yield dtype, gguf


def batch_table(a, llm, prompts, eos, port: Path, configs: dict) -> None:
    batches = [int(b) for b in a.batch.split(",")]
    n_prompt = round(sum(map(len, prompts)) / len(prompts))
    print(f"clock: cpu, prefill excluded; {a.rounds} interleaved rounds, the median shown; "
          f"{len(prompts)} prompts (mean {n_prompt} tokens) x {a.n} tokens")
    print("| dtype | engine | B | tokens | rows per forward | tokens/s | × B = 1 | × stock at B | same tokens as B = 1 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for dtype, gguf in exported(a.model, a.dtypes, tmp):
            stock = {b: [] for b in batches}
            rows = {(name, b): [] for name in configs for b in batches}
            for _ in range(a.rounds):
                for b in batches:
                    if (tps := stock_batched_tokens_per_s(gguf, n_prompt, a.n, b)) is not None:
                        stock[b].append(tps)
                for name, args in configs.items():
                    for b in batches:
                        rows[name, b].append(port_batch_tokens_per_s(gguf, prompts, args, a.n, eos, b, port))
            for b in batches:
                if stock[b] and stock[batches[0]]:
                    tps = statistics.median(stock[b])
                    print(f"| {dtype} | stock llama.cpp (llama-batched-bench) | {b} | {b * a.n} | {b} | {tps:.1f} | "
                          f"{tps / statistics.median(stock[batches[0]]):.2f} | 1.00 | |")
            for name in configs:
                one = statistics.median(v[0] for v in rows[name, batches[0]])
                base = [r["tokens"] for r in rows[name, batches[0]][0][2]]
                for b in batches:
                    vals = rows[name, b]
                    tps = statistics.median(v[0] for v in vals)
                    res = vals[0][2]
                    per = sum(r.get("batch_rows", 1.0) * r["forwards"] for r in res) / sum(r["forwards"] for r in res)
                    same = sum(x["tokens"] == y for x, y in zip(res, base))
                    vs = f"{tps / statistics.median(stock[b]):.2f}" if stock[b] else ""
                    print(f"| {dtype} | port {name} | {b} | {vals[0][1]} | {per:.1f} | {tps:.1f} | {tps / one:.2f} | {vs} | {same}/{len(base)} |")
            sys.stdout.flush()


def llama_bench_tokens_per_s(gguf: Path, n: int) -> float | None:
    exe = llama_cache_dir() / "build" / "bin" / "llama-bench"
    if not exe.exists():
        return None
    r = subprocess.run([str(exe), "-m", str(gguf), "-p", "0", "-n", str(n), "-r", "1", "-t", "1", "-o", "json"],
                       capture_output=True)
    if r.returncode != 0:  # e.g. its q8_0 weight repacking dies with SIGILL on some VMs
        print(f"llama-bench failed ({r.returncode}) on {gguf.name}; row left out", file=sys.stderr)
        return None
    return float(json.loads(r.stdout)[0]["avg_ts"])


CONFIGS = {
    "ar": ["--mode", "ar", "--ignore-eos"],
    "diffusion, the model's defaults": ["--mode", "diffusion"],
    "diffusion, threshold rule": ["--mode", "diffusion", "--block", "32", "--policy", "threshold", "--threshold", "0.95"],
    "diffusion, entropy rule": ["--mode", "diffusion", "--block", "32", "--policy", "entropy", "--threshold", "0.95"],
    "diffusion, threshold rule, block 16": ["--mode", "diffusion", "--block", "16", "--policy", "threshold", "--threshold", "0.95"],
    "diffusion, threshold rule, block 8": ["--mode", "diffusion", "--block", "8", "--policy", "threshold", "--threshold", "0.95"],
    "denoise, width 8": ["--mode", "diffusion", "--block", "8", "--policy", "threshold", "--threshold", "1.5"],
    "denoise, width 32": ["--mode", "diffusion", "--block", "32", "--policy", "threshold", "--threshold", "1.5"],
    "speculative, draft 32": ["--mode", "speculative", "--block", "32", "--ignore-eos"],
    "speculative, draft 8": ["--mode", "speculative", "--block", "32", "--draft", "8", "--ignore-eos"],
    "speculative, draft 4": ["--mode", "speculative", "--block", "32", "--draft", "4", "--ignore-eos"],
    "speculative, draft 6": ["--mode", "speculative", "--block", "32", "--draft", "6", "--ignore-eos"],
    "speculative, draft 3": ["--mode", "speculative", "--block", "32", "--draft", "3", "--ignore-eos"],
    # the draft (denoise) columns share the block's 2 best experts; the verify columns route as AR: lossless
    "speculative, draft 3, expert budget 2": ["--mode", "speculative", "--block", "32", "--draft", "3", "--expert-budget", "2", "--ignore-eos"],
    "speculative, draft 6, expert budget 2": ["--mode", "speculative", "--block", "32", "--draft", "6", "--expert-budget", "2", "--ignore-eos"],
    # AR with the DFlash drafter (lossless): drafts cut by the drafter's confidence, verified at width 4, 8 or 16
    "dflash": ["--mode", "dflash", "--ignore-eos"],
    "dflash, batched verify": ["--mode", "dflash", "--verify", "batched", "--ignore-eos"],
    "dflash, draft 3": ["--mode", "dflash", "--draft", "3", "--ignore-eos"],
    "dflash, draft 7": ["--mode", "dflash", "--draft", "7", "--ignore-eos"],
    "dflash, draft 3, q8_0 drafter": ["--mode", "dflash", "--draft", "3", "--ignore-eos"],
    "dflash, q8_0 drafter": ["--mode", "dflash", "--ignore-eos"],
    # block_size "auto": each block's (diffusion, the model's rule) or draft's width chosen from the row's
    # tokens per forward or acceptance over the step costs the port
    # measures at its first such request (in the first round; cached for the next)
    "diffusion, auto": ["--mode", "diffusion", "--block", "auto"],
    "speculative, auto": ["--mode", "speculative", "--block", "auto", "--ignore-eos"],
    "dflash, auto": ["--mode", "dflash", "--block", "auto", "--ignore-eos"],
    "dflash, auto, q8_0 drafter": ["--mode", "dflash", "--block", "auto", "--ignore-eos"],
}
DRAFTER_DTYPE = {"dflash, draft 3, q8_0 drafter": "q8_0", "dflash, q8_0 drafter": "q8_0",
                 "dflash, auto, q8_0 drafter": "q8_0"}  # else the row's dtype


def drafter_dtype(name: str, dtype: str) -> str:
    """The dtype of row `name`'s drafter (a `--compare` row's too: "NAME [ARGS]"); else the row's `dtype`."""
    return DRAFTER_DTYPE.get(name.split(" [")[0], dtype)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(REPO / "src" / "clover" / "assets" / "clover-tiny"))
    ap.add_argument("--dtypes", default="f32,bf16,q8_0")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--configs", default="all", help="names of the port rows separated by ; (default: all)")
    ap.add_argument("--compare", default="", help="port arguments: every port row runs a second time with them")
    ap.add_argument("--drafter", default=None, help="the dflash rows' drafter directory (default: the bundled model's)")
    ap.add_argument("--batch", default="", help="batch sizes, e.g. 1,4,8,16: rows in one forward (aggregate tokens/s)")
    a = ap.parse_args()

    import clover
    from clover.api import BUNDLED_DRAFTER
    from clover.data.tasks import heldout_tasks
    from clover.export.gguf import export_gguf

    llm = clover.load(a.model, dtype="float32")
    prompts = [llm.tokenizer.encode(t.prompt) for t in heldout_tasks(a.prompts)]
    eos = llm.config.eos_token_ids
    probe = llama_cache_dir() / "bin" / "clover-llama-probe"
    port = port_binary()
    if a.batch:
        names = ["ar", "diffusion, the model's defaults"] if a.configs == "all" else [k.strip() for k in a.configs.split(";")]
        batch_table(a, llm, prompts, eos, port, {k: CONFIGS[k] for k in names})
        return 0
    configs = CONFIGS if a.configs == "all" else {k.strip(): CONFIGS[k.strip()] for k in a.configs.split(";")}
    drafter = a.drafter or (BUNDLED_DRAFTER if Path(a.model).resolve() == (REPO / "src" / "clover" / "assets" / "clover-tiny").resolve() else None)
    if drafter is None:
        configs = {k: v for k, v in configs.items() if "dflash" not in v}
    if a.compare:
        configs = {**configs, **{f"{name} [{a.compare}]": [*args, *a.compare.split()] for name, args in configs.items()}}
    print(f"clock: {a.clock}; {a.rounds} interleaved rounds, the median shown")
    print("| dtype | engine | tokens | forwards | tokens/forward | ms/forward | × stock AR step | tokens/s | × stock AR |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for dtype, gguf in exported(a.model, a.dtypes, tmp):
            drafters = {}  # the drafter GGUF of each dtype the rows use
            if drafter is not None:
                for name in configs:
                    dt = drafter_dtype(name, dtype)
                    if "dflash" in configs[name] and dt not in drafters:
                        drafters[dt] = Path(tmp) / f"drafter-{dtype}-{dt}.gguf"
                        export_gguf(drafter, drafters[dt], dtype=dt, progress=False)
            stock, rows, autos = [], {name: [] for name in configs}, {}
            for _ in range(a.rounds):
                stock.append(probe_tokens_per_s(probe, gguf, prompts, a.n, eos, a.clock))
                for name, args in configs.items():
                    extra = ["--drafter", str(drafters[drafter_dtype(name, dtype)])] if "dflash" in args else []
                    res = run(gguf, prompts, ["-n", str(a.n), *args, *extra], eos_ids=eos, binary=port)
                    tok = sum(r["n_tokens"] for r in res)
                    fwd = sum(r["forwards"] for r in res)
                    sec = sum(port_seconds(r, a.clock) for r in res)
                    # per forward: the timed ones (each prompt's first, prefill forward is not timed)
                    rows[name].append((tok / sec, tok, fwd, [r["tokens"] for r in res], sec / (fwd - len(res))))
                    if "width_choices" in res[0]:  # block_size "auto": its step costs and decisions
                        autos.setdefault(name, []).append(res)
            s = statistics.median(stock)
            bench = llama_bench_tokens_per_s(gguf, a.n)
            print(f"| {dtype} | stock llama.cpp AR (probe) | {len(prompts) * a.n} | {len(prompts) * a.n} | 1.00 | {1e3 / s:.3f} | 1.00 | {s:.1f} | 1.00 |")
            if bench is not None:
                print(f"| {dtype} | stock llama.cpp AR (llama-bench, wall) | {a.n} | {a.n} | 1.00 | {1e3 / bench:.3f} | {s / bench:.2f} | {bench:.1f} | {bench / s:.2f} |")
            for name, vals in rows.items():
                tps = statistics.median(v[0] for v in vals)
                ms = 1e3 * statistics.median(v[4] for v in vals)
                tok, fwd = vals[0][1], vals[0][2]
                same = ""
                if a.compare and name.endswith(f" [{a.compare}]"):
                    base = rows[name[: -len(f" [{a.compare}]")]][0][3]
                    same = f" (same tokens: {sum(x == y for x, y in zip(base, vals[0][3]))}/{len(base)})"
                elif "ar" in rows and name != "ar" and "--ignore-eos" in configs[name] and "diffusion" not in configs[name]:
                    base = rows["ar"][0][3]  # a lossless mode: its tokens against the port's AR greedy
                    same = f" (tokens = port AR: {sum(x == y for x, y in zip(base, vals[0][3]))}/{len(base)})"
                print(f"| {dtype} | port {name}{same} | {tok} | {fwd} | {tok / fwd:.2f} | {ms:.3f} | {ms * s / 1e3:.2f} | {tps:.1f} | {tps / s:.2f} |")
            for name, runs in autos.items():  # the first round measured the step costs, the later ones read them
                costs = runs[0][0]["step_costs"]
                blocks = costs.get("block", {})  # diffusion: / a block's last forward
                table = ", ".join(f"{w}: {1e3 * c:.3f}" + (f" / {1e3 * blocks[w]:.3f}" if w in blocks else "")
                                  for w, c in sorted(costs["seconds"].items(), key=lambda x: int(x[0])))
                chosen = Counter(c["width"] for r in runs[0] for c in r["width_choices"])
                how = f"measured in {costs['measure_seconds']:.2f} s" if costs["source"] == "measured" else costs["source"]
                print(f"<!-- {dtype} {name}: step costs ms ({table}), {how}, then {runs[-1][0]['step_costs']['source']}; "
                      f"decisions per width {dict(sorted(chosen.items()))} -->")
            sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
