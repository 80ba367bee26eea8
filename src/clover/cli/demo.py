"""`clover demo`: the real model in its default mode next to AR (the same text, the speed-up), then
the bundled model on its tasks, where block diffusion pays. Without --model: clover-smol
(SmolLM2-135M-Instruct converted to block diffusion), pulled into the user cache on first use; if it
cannot be pulled (offline), the bundled clover-tiny alone, with a one-line note saying why.

Which modes a model is shown in: a checkpoint that states its default mode (config `default_mode`,
from its model card) in that mode next to AR; one that states none in every mode it runs (AR and
diffusion, plus speculative for a chat model). A chat model answers questions through its chat
template (`LLM.chat`); a task model continues task lines, stopping at the end of the line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .common import UsageError, add_model_arguments, load_llm, model_dir_or_tiny, stderr

DEMO_PROMPTS = ("def fibonacci(n):", "assert sorted([9, 2, 5]) == ", "assert [x * 2 for x in [14, 3, 25, 7]] == ")
DEMO_MODES = ("ar", "diffusion")  # the baseline and the mode it is compared with; those the model can run
DEMO_MODEL = "clover-smol"  # the default demo model (clover.named); clover-tiny when it cannot be pulled
TASK_PROMPTS = ("assert sorted([9, 2, 5]) == ", "assert [x * 2 for x in [14, 3, 25, 7]] == ",
                "assert list(reversed([1, 2, 3])) == ")  # the bundled model's tasks: where diffusion pays
CHAT_PROMPTS = ("What is the capital of France?", "Write a Python function that reverses a string.",
                "List three fruits.")
CHAT_EXTRA_MODE = "speculative"  # a chat model that states no default also shows the lossless mode
LIVE_HINT = "watch block diffusion decode a task line: clover generate 'assert sorted([9, 2, 5]) == ' --live"


def demo_model(args: argparse.Namespace):
    """(path, note, pulled): --model, else clover-smol (pulled once), else the bundled model or a tiny one."""
    if getattr(args, "model", None):
        return (*model_dir_or_tiny(args), False)
    from ..named import PullError, is_pulled, named_dir, pull

    if is_pulled(DEMO_MODEL):
        return named_dir(DEMO_MODEL), None, True
    stderr(f"clover demo: pulling {DEMO_MODEL} into the user cache (once)")
    try:
        return pull(DEMO_MODEL), None, True
    except (PullError, OSError, ValueError) as e:
        path, note = model_dir_or_tiny(args)
        stderr(f"clover demo: {DEMO_MODEL} is not available ({e}); showing {path.name} instead")
        return path, note, False


def configure(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--max-new-tokens", "-n", type=int, default=64, metavar="N", help="tokens per generation (default: 64)")


def demo_modes(llm, chat: bool) -> list[str]:
    """The modes a model is shown in (see the module's docstring), AR first."""
    from ..decoding import get_mode

    default = llm.default_mode
    if llm.config.default_mode is not None:  # the checkpoint states its best mode
        return ["ar"] + ([default] if default != "ar" else [])
    wanted = DEMO_MODES + ((CHAT_EXTRA_MODE,) if chat else ())
    return [m for m in wanted if llm.mode_available(m) and (llm.config.mask_token_id is not None or not get_mode(m).needs_mask)]


def show_model(console, llm, *, prompts, modes, chat: bool, max_new_tokens: int, title: str) -> dict[str, int]:
    """Each prompt in each mode (AR first; one short warm-up per mode first, so that no row pays a
    one-time cost), the text of each, then a table; returns {mode: prompts on which it wrote AR's tokens}."""
    from rich.table import Table

    from .. import viz
    from ..data.tasks import PROMPT_SEP

    def run(prompt: str, mode: str, n: int):
        # a task prompt's answer is the rest of its line: stop there, as `clover eval` does
        stop = ["\n"] if prompt.endswith(PROMPT_SEP) else None
        if chat:
            return llm.chat([{"role": "user", "content": prompt}], mode=mode, max_new_tokens=n, stop=stop)
        return llm.generate(prompt, mode=mode, max_new_tokens=n, stop=stop)

    for mode in modes:
        run(prompts[0], mode, 2)
    table = Table(title=title, title_justify="left")
    for col in ("prompt", "mode", "tokens", "forwards", "tokens/forward", "tokens/s", "× AR", "finish", "= AR"):
        table.add_column(col, justify="left" if col in ("prompt", "mode", "finish", "= AR") else "right")
    same = {m: 0 for m in modes if m != "ar"}
    for prompt in prompts:
        ar = None
        for mode in modes:
            gen = run(prompt, mode, max_new_tokens)
            s = gen.stats
            if mode == "ar":
                ar, as_ar, speed = gen, "-", "1.00"
            else:
                as_ar = "yes" if gen.token_ids == ar.token_ids else "no"
                same[mode] += as_ar == "yes"
                ar_tps = ar.stats.tokens_per_second
                speed = f"{s.tokens_per_second / ar_tps:.2f}" if ar_tps > 0 else "-"
            console.rule(f"{mode} · {prompt!r}", align="left")
            console.print(viz.printable_text(gen.text if chat else prompt + gen.text), markup=False, highlight=False)
            table.add_row(repr(prompt), mode, str(s.tokens), str(s.forwards), f"{s.tokens_per_forward:.2f}",
                          f"{s.tokens_per_second:.1f}", speed, gen.finish_reason, as_ar)
    console.print()
    console.print(table)
    return same


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..api import BUNDLED_MODEL

    if args.max_new_tokens <= 0:
        raise UsageError("--max-new-tokens: must be a positive integer")
    path, note, pulled = demo_model(args)
    if note:
        stderr(f"the bundled model is not there yet; using a tiny random checkpoint at {path} (its output is noise)")
    llm = load_llm(args, path)
    console = Console(width=None if sys.stdout.isatty() else 120)

    def say(text: str) -> None:
        console.print(text, markup=False, highlight=False)

    chat = llm.is_chat
    modes = demo_modes(llm, chat)
    cfg = llm.config
    policy = (f" · diffusion at the model's default policy: block {cfg.block_size}, {cfg.policy} {cfg.threshold}"
              if "diffusion" in modes else "")
    stated = f" · its default mode: {llm.default_mode}" if cfg.default_mode is not None else ""
    prompts = CHAT_PROMPTS if chat else DEMO_PROMPTS
    same = show_model(console, llm, prompts=prompts, modes=modes, chat=chat, max_new_tokens=args.max_new_tokens,
                      title=f"clover demo · {llm.path}{stated}{policy}")
    # the honest summary: how often each mode wrote what AR writes (speculative always does: it is lossless)
    if same:
        say("; ".join(f"{m}: AR's text on {k} of {len(prompts)} prompts" for m, k in same.items()))
    elif cfg.default_mode is not None:
        say(f"{Path(str(llm.path)).name} states ar as its default mode: its model card measured no faster mode "
            "giving AR's text")
    if same.get("diffusion", len(prompts)) < len(prompts):
        say("where diffusion's text differs from AR's, it is what block decoding made of the answer (a small model "
            "can repeat or drop words there); speculative decoding always gives AR's text")
    card = Path(llm.path) / "README.md"
    if card.is_file():
        say(f"measured quality and speed, and what the model cannot do: {card}")
    bundled = BUNDLED_MODEL
    if pulled and (bundled / "config.json").is_file() and Path(llm.path).resolve() != bundled.resolve():
        # where block diffusion pays today: the bundled model on the tasks it was trained on
        del llm
        tiny = load_llm(args, bundled, bundled_drafter=False)
        tiny_modes = [m for m in DEMO_MODES if tiny.mode_available(m)]
        console.print()
        done = show_model(console, tiny, prompts=TASK_PROMPTS, modes=tiny_modes, chat=False,
                          max_new_tokens=args.max_new_tokens,
                          title=f"the bundled model on its tasks · {bundled.name} · {tiny.default_mode} by default")
        say(f"{bundled.name} (11M parameters, trained on task lines): "
            + "; ".join(f"{m} gave AR's answer on {k}" for m, k in done.items()) + f" of {len(TASK_PROMPTS)}")
    say(LIVE_HINT)
    return 0
