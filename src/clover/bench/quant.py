"""The quantization benchmark: size, memory, speed and quality of a model at fp32 / bf16 / int8 /
int4 (`clover bench quant MODEL_DIR [--variants fp32 bf16 int8 int4] ...`; the footprint of a
config without weights is `clover.quant.footprint`).

Each variant is written to a work folder (a cast copy for fp32/bf16, `quantize_checkpoint` for
int8/int4) and measured in its own subprocess (`python -m clover.bench.quant --worker SPEC`), so
the peak RSS (resource.getrusage) is that variant's alone: load, held-out perplexity, then AR and
diffusion generation.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

PROMPTS = ("def fibonacci(n):", "assert sorted([9, 2, 5]) == ")

# held-out text for perplexity when none is given: prose and code the models are not trained on
HELD_OUT = '''The lighthouse keeper kept two logs. The first recorded the weather every four hours: wind
direction, sea state, visibility in nautical miles. The second, which nobody asked him to keep, listed
the ships that passed without signalling, and by the end of the winter it was the longer of the two.

def merge_intervals(intervals):
    """Merge overlapping [start, end] pairs; the result is sorted by start."""
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged

assert merge_intervals([[1, 3], [2, 6], [8, 10]]) == [[1, 6], [8, 10]]

A recipe for flatbread needs only flour, water, salt and a hot pan. Mix 300 g of flour with 180 ml
of water and a teaspoon of salt, knead for five minutes, rest the dough for half an hour, then roll
it thin and cook each piece for about a minute per side until it blisters.
'''


# ------------------------------------------------------------------------------ the measurements
def cast_checkpoint(src: str | Path, dst: str | Path, dtype: str) -> Path:
    """A float copy of `src` at `dtype` ("float32"/"bfloat16"/"float16"), shard by shard."""
    import torch
    from safetensors.torch import save_file

    from ..checkpoint import INDEX_FILE, iter_tensors, parse_dtype, shard_files
    from ..models import read_config

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    dt = parse_dtype(dtype)
    for path in shard_files(src):
        state = {k: v.contiguous() for k, v in iter_tensors(path, dt)}
        save_file(state, str(dst / path.name), metadata={"format": "pt"})
        del state
    if (src / INDEX_FILE).exists():
        shutil.copy2(src / INDEX_FILE, dst / INDEX_FILE)
    config = read_config(src)
    config.torch_dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[dt]
    config.save(dst)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", INDEX_FILE):
            shutil.copy2(f, dst / f.name)
    return dst


def perplexity(model, ids: list[int], window: int = 256):
    """Next-token perplexity of `ids` (non-overlapping windows); also returns the argmax predictions."""
    import math

    import torch

    nll, count, preds = 0.0, 0, []
    with torch.no_grad():
        for s in range(0, len(ids) - 1, window):
            chunk = torch.tensor([ids[s : s + window + 1]], device=model.device)
            if chunk.shape[1] < 2:
                break
            logits = model(chunk[:, :-1]).float()
            logp = torch.log_softmax(logits, -1)
            nll -= logp.gather(-1, chunk[:, 1:, None]).sum().item()
            count += chunk.shape[1] - 1
            preds += logits.argmax(-1)[0].tolist()
    return math.exp(nll / max(count, 1)), preds


def _current_rss() -> int:
    try:
        import os

        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _worker(spec: dict) -> dict:
    """Runs in its own process: load, perplexity, AR + diffusion generation; peak RSS at the end."""
    import resource
    import time

    import torch

    torch.set_num_threads(spec.get("threads", 1))
    # the runtime's imports first, so the baseline RSS holds them
    import transformers  # noqa: F401

    import clover
    import clover.api
    import clover.tokenizer

    torch.ones(8) @ torch.ones(8)
    base = _current_rss()
    t0 = time.perf_counter()
    llm = clover.load(spec["dir"], device=spec.get("device"))
    load_s = time.perf_counter() - t0
    load_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    ids = llm.tokenizer.encode(spec["text"])
    ppl, preds = perplexity(llm.model, ids)
    out = {"load_s": load_s, "rss_base": base, "rss_after_load": load_peak, "perplexity": ppl, "preds": preds,
           "dtype": str(llm.model.dtype).replace("torch.", "")}
    modes = ["ar"] + (["diffusion"] if llm.config.mask_token_id is not None else [])
    for mode in modes:
        gen_kw = {"eos_penalty": 1e4} if spec.get("fixed_length", True) else {}
        llm.generate(PROMPTS[0], mode=mode, max_new_tokens=4, **gen_kw)  # warm-up
        tokens = forwards = 0
        seconds = 0.0
        for p in PROMPTS:
            g = llm.generate(p, mode=mode, max_new_tokens=spec["max_new_tokens"], **gen_kw)
            tokens += g.stats.tokens
            forwards += g.stats.forwards
            seconds += g.stats.seconds
        out[f"{mode}_tokens_per_s"] = tokens / seconds if seconds else 0.0
        out[f"{mode}_tokens_per_forward"] = tokens / forwards if forwards else 0.0
    out["rss_peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return out


def _disk(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def compare(
    model_dir: str | Path,
    *,
    variants: tuple[str, ...] = ("fp32", "bf16", "int8", "int4"),
    group_size: int = 64,
    text: str | None = None,
    max_new_tokens: int = 64,
    workdir: str | Path | None = None,
    threads: int = 1,
    device: str | None = None,
    fixed_length: bool = True,
    progress: bool = False,
) -> list[dict]:
    """One row per variant: size on disk, peak RSS, tokens/s and tokens/forward (AR, diffusion),
    held-out perplexity and top-1 agreement with the first variant's next-token predictions.
    fixed_length: suppress EOS (eos_penalty) so every variant generates exactly max_new_tokens per
    prompt, greedy; False measures generations as they end naturally."""
    from ..quant.writer import quantize_checkpoint

    model_dir = Path(model_dir)
    cleanup = workdir is None
    work = Path(workdir or tempfile.mkdtemp(prefix="clover-quant-compare-"))
    rows: list[dict] = []
    try:
        for v in variants:
            d = work / v
            if d.exists():
                shutil.rmtree(d)
            if v in ("fp32", "bf16", "fp16"):
                cast_checkpoint(model_dir, d, {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}[v])
            elif v in ("int8", "int4") or v.startswith("int4-g"):
                bits = 8 if v == "int8" else 4
                g = int(v.split("-g")[1]) if "-g" in v else group_size
                quantize_checkpoint(model_dir, d, bits=bits, group_size=g, progress=progress)
            else:
                raise ValueError(f"unknown variant {v!r}; use fp32, bf16, fp16, int8, int4 or int4-gN")
            spec = {"dir": str(d), "text": text or HELD_OUT, "max_new_tokens": max_new_tokens, "threads": threads, "device": device,
                    "fixed_length": fixed_length}
            proc = subprocess.run(
                [sys.executable, "-m", "clover.bench.quant", "--worker", json.dumps(spec)],
                capture_output=True, text=True, check=False,
            )
            if proc.returncode != 0:
                raise RuntimeError(f"measuring {v} failed:\n{proc.stderr[-2000:]}")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            r["variant"] = v if v != "int4" else f"int4-g{group_size}"
            r["disk_bytes"] = _disk(d)
            rows.append(r)
    finally:
        if cleanup:
            shutil.rmtree(work, ignore_errors=True)
    ref = rows[0]["preds"] if rows else []
    for r in rows:
        p = r.pop("preds")
        r["top1_agreement"] = sum(a == b for a, b in zip(p, ref)) / max(len(ref), 1)
    return rows


def format_table(rows: list[dict]) -> str:
    def mib(n):
        return f"{n / 2**20:.2f} MiB"

    out = [
        ("| variant | compute dtype | size on disk | peak RSS (over baseline) | tokens/s AR | tokens/s diffusion | "
         "tokens/forward diffusion | held-out ppl | top-1 agree vs first | parse rate |"),
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        diff_tps = f"{r['diffusion_tokens_per_s']:.1f}" if "diffusion_tokens_per_s" in r else "—"
        diff_tpf = f"{r['diffusion_tokens_per_forward']:.2f}" if "diffusion_tokens_per_forward" in r else "—"
        out.append(
            f"| {r['variant']} | {r['dtype']} | {mib(r['disk_bytes'])} | {mib(r['rss_peak'])} ({mib(r['rss_peak'] - r['rss_base'])}) | "
            f"{r['ar_tokens_per_s']:.1f} | {diff_tps} | {diff_tpf} | {r['perplexity']:.2f} | {r['top1_agreement']:.1%} | — |"
        )
    return "\n".join(out)


if __name__ == "__main__":  # the measuring process of one variant: python -m clover.bench.quant --worker SPEC
    if sys.argv[1:2] != ["--worker"] or len(sys.argv) != 3:
        sys.exit("usage: python -m clover.bench.quant --worker SPEC (run by compare(); the command is `clover bench quant`)")
    print(json.dumps(_worker(json.loads(sys.argv[2]))))
