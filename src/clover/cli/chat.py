"""`clover chat`: a multi-turn chat on stdin/stdout with the tokenizer's chat template."""

from __future__ import annotations

import argparse
import sys

from .common import add_model_arguments, add_sampling_arguments, load_llm, sampling_kwargs, stderr, wants_drafter

CHAT_MAX_NEW_TOKENS = 256
CHAT_HELP = "commands: /reset (forget the conversation), /stats (last reply's numbers), /exit (quit)"


def configure(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_sampling_arguments(p, max_new_tokens=CHAT_MAX_NEW_TOKENS)
    p.add_argument("--system", metavar="TEXT", help="a system message kept at the top of the history")


def fit_history(llm, messages: list[dict], budget: int) -> tuple[list[int], int]:
    """Drop the oldest turns (a leading system message stays) until the templated conversation
    fits in `budget` tokens. Returns (prompt ids, number of messages dropped); raises ValueError
    when even the latest message alone is too long."""
    dropped = 0
    while True:
        ids = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        if len(ids) <= budget:
            return ids, dropped
        first = 1 if messages and messages[0]["role"] == "system" else 0
        if len(messages) - first <= 1:
            raise ValueError(f"message too long: {len(ids)} tokens, the context allows {budget} with the reply")
        del messages[first]
        dropped += 1
        if len(messages) - first > 1 and messages[first]["role"] == "assistant":
            del messages[first]
            dropped += 1


def run(args: argparse.Namespace) -> int:
    from .. import viz
    from ..tokenizer import IM_END

    kwargs = sampling_kwargs(args)
    llm = load_llm(args, bundled_drafter=wants_drafter(args))
    mode = llm.mode(args.mode)  # None: the model's default
    kwargs = llm.chat_options(kwargs)  # the reply ends with its turn
    params = llm.params(mode, kwargs)
    budget = llm.room(0, params, mode) - params.max_new_tokens  # the history, with room for the reply
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    last = None
    interactive = sys.stdin.isatty()
    tty_out = sys.stdout.isatty()
    if interactive:
        stderr(f"clover chat · {llm.path} · {mode.name} · {CHAT_HELP}")
    while True:
        try:
            line = input("you › ") if interactive else sys.stdin.readline()
        except EOFError:
            break
        if not interactive and line == "":
            break  # end of piped input
        line = line.rstrip("\n")
        if not line.strip():
            continue
        if line.startswith("/"):
            cmd = line.strip().lower()
            if cmd in ("/exit", "/quit"):
                break
            if cmd == "/reset":
                messages, last = list(system), None
                print("(conversation cleared)", flush=True)
            elif cmd == "/stats":
                turns = sum(m["role"] == "user" for m in messages)
                size = len(llm.tokenizer.apply_chat_template(messages, add_generation_prompt=False)) if messages else 0
                print(f"(turns: {turns} · history: {size} / {llm.context_length} tokens)", flush=True)
                if last is not None:
                    s = last.stats
                    print("(last reply: " + viz.stats_line(s.tokens, s.forwards, s.seconds, last.finish_reason) + ")", flush=True)
            else:
                print(f"(unknown command {line.split()[0]!r}; {CHAT_HELP})", flush=True)
            continue
        messages.append({"role": "user", "content": line})
        try:
            ids, dropped = fit_history(llm, messages, budget)
        except ValueError as e:
            messages.pop()
            stderr(f"clover chat: {e}")
            continue
        if dropped and interactive:
            stderr(f"(dropped {dropped} old message(s) to fit the context)")
        gen, ends_nl = None, True
        for ev in llm.stream(ids, mode=mode, **kwargs):
            if ev.kind == "block" and ev.text:
                sys.stdout.write(viz.printable_text(ev.text) if tty_out else ev.text)
                sys.stdout.flush()
                ends_nl = ev.text.endswith("\n")
            elif ev.kind == "done":
                gen = ev.generation
        if not ends_nl:
            sys.stdout.write("\n")
        sys.stdout.flush()
        s = gen.stats  # the speed of every answer, on stderr (the reply alone on stdout)
        stderr(f"[{mode.name}] {s.tokens} tokens · {s.tokens_per_second:.1f} tokens/s")
        reply = gen.text.split(IM_END)[0]
        messages.append({"role": "assistant", "content": reply})
        last = gen
    return 0

