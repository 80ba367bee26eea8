"""`clover demo`: a model on three prompts, AR against diffusion (and speculative, for a chat
model), with a stats table. Without --model: clover-smol (SmolLM2-135M-Instruct converted to block
diffusion), pulled into the user cache on first use; if it cannot be pulled (offline), the bundled
clover-tiny, with a one-line note saying why."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .common import UsageError, add_model_arguments, load_llm, model_dir_or_tiny, stderr

DEMO_PROMPTS = ("def fibonacci(n):", "assert sorted([9, 2, 5]) == ", "assert [x * 2 for x in [14, 3, 25, 7]] == ")
DEMO_MODES = ("ar", "diffusion")  # the baseline and the mode it is compared with; those the model can run
DEMO_MODEL = "clover-smol"  # the default demo model (clover.named); clover-tiny when it cannot be pulled
CHAT_PROMPTS = ("What is the capital of France?", "Write a Python function that reverses a string.",
                "List three fruits.")
CHAT_EXTRA_MODE = "speculative"  # a chat model also shows the lossless mode


def demo_model(args: argparse.Namespace):
    """(path, note): --model, else clover-smol (pulled once), else the bundled model or a tiny one."""
    if getattr(args, "model", None):
        return model_dir_or_tiny(args)
    from ..named import PullError, is_pulled, named_dir, pull

    if is_pulled(DEMO_MODEL):
        return named_dir(DEMO_MODEL), None
    stderr(f"clover demo: pulling {DEMO_MODEL} into the user cache (once)")
    try:
        return pull(DEMO_MODEL), None
    except (PullError, OSError, ValueError) as e:
        path, note = model_dir_or_tiny(args)
        stderr(f"clover demo: {DEMO_MODEL} is not available ({e}); showing {path.name} instead")
        return path, note


def configure(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--max-new-tokens", "-n", type=int, default=64, metavar="N", help="tokens per generation (default: 64)")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from .. import viz
    from ..data.tasks import PROMPT_SEP
    from ..decoding import get_mode

    if args.max_new_tokens <= 0:
        raise UsageError("--max-new-tokens: must be a positive integer")
    path, note = demo_model(args)
    if note:
        stderr(f"the bundled model is not there yet; using a tiny random checkpoint at {path} (its output is noise)")
    llm = load_llm(args, path)
    has_mask = llm.config.mask_token_id is not None
    chat = llm.config.base_model_type == "llama" and bool(getattr(llm.tokenizer.hf, "chat_template", None))
    wanted = DEMO_MODES + ((CHAT_EXTRA_MODE,) if chat else ())
    modes = [m for m in wanted if has_mask or not get_mode(m).needs_mask]
    console = Console(width=None if sys.stdout.isatty() else 120)
    cfg = llm.config
    policy = (f" · diffusion at the model's default policy: block {cfg.block_size}, {cfg.policy} {cfg.threshold}"
              if "diffusion" in modes else "")
    table = Table(title=f"clover demo · {llm.path}{policy}", title_justify="left")
    for col in ("prompt", "mode", "tokens", "forwards", "tokens/forward", "tokens/s", "finish", "= AR"):
        table.add_column(col, justify="left" if col in ("prompt", "mode", "finish", "= AR") else "right")
    prompts = CHAT_PROMPTS if chat else DEMO_PROMPTS
    same = {m: 0 for m in modes if m != "ar"}  # prompts on which a mode wrote AR's tokens
    for prompt in prompts:
        ar_ids = None
        for mode in modes:
            # a task prompt's answer is the rest of its line: stop there, as `clover eval` does
            stop = ["\n"] if prompt.endswith(PROMPT_SEP) else None
            ids = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
            gen = llm.generate(ids, mode=mode, max_new_tokens=args.max_new_tokens, stop=stop)
            s = gen.stats
            if mode == "ar":
                ar_ids, as_ar = gen.token_ids, "-"
            else:
                as_ar = "yes" if gen.token_ids == ar_ids else "no"
                same[mode] += as_ar == "yes"
            console.rule(f"{mode} · {prompt!r}", align="left")
            shown = gen.text if chat else prompt + gen.text
            console.print(viz.printable_text(shown), markup=False, highlight=False)
            table.add_row(repr(prompt), mode, str(s.tokens), str(s.forwards), f"{s.tokens_per_forward:.2f}",
                          f"{s.tokens_per_second:.1f}", gen.finish_reason, as_ar)
    console.print()
    console.print(table)
    # the honest summary: how often each mode wrote what AR writes (speculative always does: it is lossless)
    def say(text: str) -> None:
        console.print(text, markup=False, highlight=False)

    say("; ".join(f"{m}: AR's text on {k} of {len(prompts)} prompts" for m, k in same.items()))
    if same.get("diffusion", len(prompts)) < len(prompts):
        say("where diffusion's text differs from AR's, it is what block decoding made of the answer (a small model "
            "can repeat or drop words there); speculative decoding always gives AR's text")
    card = Path(llm.path) / "README.md"
    if card.is_file():
        say(f"measured quality and speed, and what the model cannot do: {card}")
    return 0
