"""`clover eval`: every registered mode on the same weights, held-out tasks and code (`clover.bench.eval`)."""

from __future__ import annotations

import argparse
import json
import sys

from .common import UsageError, add_model_arguments, load_llm, parse_modes


def configure(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--task-prompts", type=int, default=100, help="held-out task prompts (default 100)")
    p.add_argument("--code-prompts", type=int, default=20, help="held-out def headers (default 20)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per code generation (default 64)")
    p.add_argument("--no-sweep", action="store_true", help="skip the threshold/block-size sweep")
    p.add_argument("--modes", metavar="LIST",
                   help="comma-separated modes (default: every registered mode the model can run)")
    p.add_argument("--json", metavar="FILE", help="write the full result as JSON")


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ..bench.eval import markdown, run_eval

    if args.task_prompts <= 0 or args.code_prompts <= 0:
        raise UsageError("--task-prompts/--code-prompts: must be positive")
    modes = parse_modes(args.modes)
    llm = load_llm(args)
    bar = tqdm(desc="eval", unit="prompt", file=sys.stderr)
    result = run_eval(llm, task_prompts=args.task_prompts, code_prompts=args.code_prompts,
                      max_new_tokens=args.max_new_tokens, sweep=not args.no_sweep,
                      modes=modes, progress=lambda _: bar.update(1))
    bar.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    print(markdown(result))
    return 0
