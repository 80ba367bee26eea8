"""`clover bench {decode,sweep,kernels,roofline}`: `configure(parser)` adds the sub-commands,
`run(args)` dispatches. Registered in `clover.cli` as

    register("bench", "benchmarks: decode modes, sweeps, kernels, roofline",
             "clover.bench.cli:configure", "clover.bench.cli:run")

and runnable on its own as `python -m clover.bench ...`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .common import parse_list, set_threads

HELP = "benchmarks: decode modes, speed/quality sweeps, kernels, roofline"


def _model_arguments(p: argparse.ArgumentParser) -> None:
    from ..cli import add_model_arguments

    add_model_arguments(p)
    p.add_argument("--threads", type=int, metavar="N", help="torch CPU threads (default: torch's)")
    p.add_argument("--json", metavar="FILE", help="also write the full result as JSON ('-' = stdout, no table)")


def _workload_arguments(p: argparse.ArgumentParser, *, workload: str, prompts: int, max_new_tokens: int) -> None:
    p.add_argument("--workload", choices=["tasks", "code", "both"], default=workload,
                   help=f"held-out task prompts, held-out def headers, or both (default: {workload})")
    p.add_argument("--prompts", type=int, default=prompts, metavar="N", help=f"prompts per workload (default: {prompts})")
    p.add_argument("--max-new-tokens", "-n", type=int, default=max_new_tokens, metavar="N",
                   help=f"tokens per generation (default: {max_new_tokens})")
    p.add_argument("--stop-newline", action="store_true", help="stop every generation at its first newline")


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH")
    sub.required = True

    p = sub.add_parser("decode", help="all decoding modes on the same held-out prompts (interleaved)",
                       description="AR / diffusion / naive / speculative on the same weights and held-out prompts, "
                                   "greedy, batch 1, interleaved per prompt after one warm-up.")
    _model_arguments(p)
    _workload_arguments(p, workload="both", prompts=8, max_new_tokens=64)
    p.add_argument("--modes", help="comma-separated (default: every registered mode)")
    p.add_argument("--block-size", type=int, metavar="N", help="diffusion block / speculative draft length (default: the model's)")
    p.add_argument("--threshold", type=float, metavar="X", help="diffusion confidence threshold (default: the model's)")
    p.add_argument("--plot", metavar="DIR", help="write DIR/decode.png")

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
                        "prob,margin,entropy (default: prob only; the other sweeps always use prob)")
    p.add_argument("--policies", metavar="LIST",
                   help="acceptance policies compared at the default block size, comma-separated specs "
                        "POLICY[:VALUE][/subN][/leftmost], e.g. threshold/leftmost,factor:1,hierarchy:0.5,entropy:0.3/sub8")
    p.add_argument("--plot", metavar="FILE", default="build/bench/sweep.png", help="PNG path (default: build/bench/sweep.png)")

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
    p.add_argument("--only", default="gdn,attention,moe", help="comma-separated subset of gdn,attention,moe")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--threads", type=int, metavar="N", help="torch CPU threads (default: torch's)")
    p.add_argument("--json", metavar="FILE", help="also write the result as JSON ('-' = stdout, no table)")

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
    p.add_argument("--threads", type=int, metavar="N", help="torch CPU threads (default: torch's)")
    p.add_argument("--json", metavar="FILE", help="also write the result as JSON ('-' = stdout, no table)")


# ------------------------------------------------------------------------------------ helpers
def _positive(name: str, value) -> None:
    if value is not None and value <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {value}")


def _emit(result: dict, table, json_path: str | None) -> None:
    from rich.console import Console

    if json_path == "-":
        json.dump(result, sys.stdout, indent=1)
        sys.stdout.write("\n")
        return
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=1) + "\n")
        print(f"json written to {json_path}")


def _progress(json_path: str | None):
    if json_path == "-" or not sys.stderr.isatty():
        return None
    return lambda msg: print(f"\r{msg}", end="", file=sys.stderr, flush=True)


def _load(args):
    """The model to benchmark; without --model and without a bundled model, a tiny random one
    (still runs; the result is labelled)."""
    from .. import cli

    note = None
    if args.model:
        path = Path(args.model)
    else:
        from ..api import default_model_path

        try:
            path = default_model_path()
        except FileNotFoundError:
            path = cli.demo_model_dir(args)
            note = "tiny random weights (no trained model yet)"
    return cli.load_llm(args, path), note


# ---------------------------------------------------------------------------------------- run
def run(args: argparse.Namespace) -> int:
    set_threads(getattr(args, "threads", None))
    return {"decode": run_decode_cmd, "sweep": run_sweep_cmd, "kernels": run_kernels_cmd,
            "roofline": run_roofline_cmd, "experts": run_experts_cmd}[args.bench_command](args)


def run_experts_cmd(args) -> int:
    from .experts import experts_markdown, run_experts

    _positive("--prompts", args.prompts)
    _positive("--max-new-tokens", args.max_new_tokens)
    llm, note = _load(args)
    result = run_experts(llm, workload=args.workload, prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                         stop_newline=args.stop_newline, progress=_progress(args.json))
    result["model_note"] = note
    if args.json and args.json != "-":
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1, default=str) + "\n")
    if args.json == "-":
        json.dump(result, sys.stdout, indent=1, default=str)
    else:
        print(experts_markdown(result))
    return 0


def run_decode_cmd(args) -> int:
    from ..decoding import get_mode, mode_names
    from .decode import decode_table, plot_decode, run_decode

    _positive("--prompts", args.prompts)
    _positive("--max-new-tokens", args.max_new_tokens)
    _positive("--block-size", args.block_size)
    if args.threshold is not None and not args.threshold > 0:
        raise ValueError(f"--threshold: must be > 0, got {args.threshold}")
    modes = parse_list(args.modes, str, "--modes") if args.modes else list(mode_names())
    for m in modes:
        try:
            get_mode(m)
        except ValueError as e:
            raise ValueError(f"--modes: {str(e).split(': ', 1)[1]}") from None
    llm, note = _load(args)
    result = run_decode(llm, workload=args.workload, prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                        modes=modes, block_size=args.block_size, threshold=args.threshold,
                        stop_newline=args.stop_newline, progress=_progress(args.json), model_note=note)
    if _progress(args.json):
        print(file=sys.stderr)
    if result["settings"]["skipped_modes"]:
        print(f"skipped (no mask token in this checkpoint): {', '.join(result['settings']['skipped_modes'])}", file=sys.stderr)
    _emit(result, decode_table(result), args.json)
    if args.plot:
        path = plot_decode(result, args.plot)
        if args.json != "-":
            print(f"plot written to {path}")
    return 0


def run_sweep_cmd(args) -> int:
    from .sweep import plot_sweep, run_sweep, sweep_table

    _positive("--prompts", args.prompts)
    _positive("--max-new-tokens", args.max_new_tokens)
    _positive("--block-size", args.block_size)
    thresholds = parse_list(args.thresholds, float, "--thresholds")
    block_sizes = parse_list(args.block_sizes, int, "--block-sizes")
    confidences = parse_list(args.confidences, str, "--confidences")
    policies = parse_list(args.policies, str, "--policies") if getattr(args, "policies", None) else []
    llm, note = _load(args)
    result = run_sweep(llm, workload=args.workload, prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                       thresholds=thresholds, block_sizes=block_sizes, block_size=args.block_size,
                       threshold=args.threshold, confidences=confidences, policies=policies,
                       stop_newline=args.stop_newline,
                       progress=_progress(args.json),
                       model_note=note)
    if _progress(args.json):
        print(file=sys.stderr)
    path = plot_sweep(result, args.plot)
    result["plot"] = path
    _emit(result, sweep_table(result), args.json)
    if args.json != "-":
        print(f"plot written to {path}")
    return 0


def run_kernels_cmd(args) -> int:
    import torch

    from .kernels import kernels_table, run_kernels

    _positive("--repeat", args.repeat)
    only = tuple(parse_list(args.only, str, "--only"))
    bad = [o for o in only if o not in ("gdn", "attention", "moe")]
    if bad:
        raise ValueError(f"--only: unknown kernel group {bad[0]!r}; choose from gdn, attention, moe")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    result = run_kernels(quick=args.quick, repeat=args.repeat, dtype=dtype, only=only)
    _emit(result, kernels_table(result), args.json)
    return 0


def run_roofline_cmd(args) -> int:
    import torch

    from .roofline import roofline_table, run_roofline

    for name in ("block_size", "prefix", "ar_steps", "denoise_steps"):
        _positive("--" + name.replace("_", "-"), getattr(args, name))
    from ..cli import _check_device

    _check_device(args.device)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    result = run_roofline(quick=args.quick, dtype=dtype, device=args.device, prefix=args.prefix,
                          block_size=args.block_size, ar_steps=args.ar_steps, denoise_steps=args.denoise_steps)
    _emit(result, roofline_table(result), args.json)
    return 0


def main(argv=None) -> int:
    """`python -m clover.bench ...`: the same sub-commands through the project's CLI machinery."""
    from .. import cli

    if "bench" not in cli.COMMANDS:
        cli.register("bench", HELP, "clover.bench.cli:configure", "clover.bench.cli:run")
    return cli.main(["bench", *(sys.argv[1:] if argv is None else argv)])
