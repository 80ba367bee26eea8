"""`clover generate`: one prompt, streamed as blocks commit; --live, --timeline, --json."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .common import (UsageError, add_engine_arguments, add_model_arguments, add_sampling_arguments, extra_hint, has_module,
                     llama_threads, load_llm, read_prompt,
                     sampling_kwargs, stderr, wants_drafter)

TIMELINE_SUFFIXES = (".png", ".svg", ".pdf", ".html", ".htm")


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", help="the prompt; read from stdin when omitted or '-'")
    add_model_arguments(p)
    add_sampling_arguments(p)
    con = p.add_argument_group("structured output (docs/structured-output.md)")
    con.add_argument("--json-schema", metavar="FILE", help="the output must match this JSON Schema (a .json file)")
    con.add_argument("--grammar", metavar="FILE",
                     help="the output must match this grammar: FILE.lark, FILE.gbnf, FILE.regex, or a .json schema")
    out = p.add_argument_group("output")
    out.add_argument("--live", action="store_true", help="show the block being denoised (a terminal view)")
    out.add_argument("--step-delay", type=float, default=0.0, metavar="SEC", help="--live: pause after each denoise step")
    out.add_argument("--timeline", metavar="FILE", help="write a picture of the decoding: FILE.png (or .svg) or FILE.html")
    out.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.add_argument("--raw", action="store_true",
                   help="a chat model: send the prompt as it is (default: as a user message through its chat template)")
    out.add_argument("--verbose", "-v", action="store_true",
                     help="also print each block_size=auto width decision and why (expected tokens/s per width)")
    add_engine_arguments(p, "run")


def write_timeline(llm, gen, mode, block_size: int, path: str) -> Path:
    """Render Generation `gen` (decoded by `Mode` `mode`) with viz.render_timeline."""
    from .. import viz

    tokens = [llm.tokenizer.decode([t]) for t in gen.token_ids]
    steps = list(gen.decode_steps) or [1] * len(tokens)
    if mode.threshold_commit:
        forwards = gen.stats.block_steps or None
    else:  # one forward per token (speculative: approximate)
        forwards = [len(tokens[i : i + block_size]) for i in range(0, len(tokens), block_size)]
    title = f"{Path(str(llm.path)).name} · {mode.name} · block {block_size}"
    return viz.render_timeline(path, tokens, steps, block_size, forwards_per_block=forwards,
                               forced=gen.forced_tokens, title=title)


def generation_record(llm, gen, mode: str, block_size: int | None, threshold: float | None) -> dict:
    d = gen.as_dict()
    return {
        "model": str(llm.path),
        "mode": mode,
        "text": d["text"],
        "token_ids": d["token_ids"],
        "finish_reason": d["finish_reason"],
        "stats": d["stats"],
        "decode_steps": list(gen.decode_steps),
        "block_size": block_size,
        "threshold": threshold,
    }


def draft_widths(width_why: list[str]) -> str:
    """The width of each block_size="auto" decision ("forward N: [draft] width W ..."; 1: AR's step)."""
    return " → ".join(line.split(" width ", 1)[1].split(" ", 1)[0] for line in width_why)


def grammar_spec(args: argparse.Namespace):
    """The --json-schema / --grammar file as a GrammarSpec (None without either)."""
    if args.json_schema and args.grammar:
        raise UsageError("--json-schema and --grammar: give one of them")
    if not (args.json_schema or args.grammar):
        return None
    from ..grammar import GrammarSpec

    if args.json_schema:
        return GrammarSpec.from_file(args.json_schema, "json_schema")
    return GrammarSpec.from_file(args.grammar)


def run(args: argparse.Namespace) -> int:
    from .. import viz

    if args.timeline and Path(args.timeline).suffix.lower() not in TIMELINE_SUFFIXES:
        raise UsageError(f"--timeline {args.timeline}: use a .png, .svg, .pdf or .html file name")
    if args.timeline and Path(args.timeline).suffix.lower() not in (".html", ".htm") and not has_module("matplotlib"):
        raise UsageError(f"--timeline {args.timeline}: pictures need matplotlib ({extra_hint('plot')}); "
                         "or write a .html timeline, which needs nothing")
    if args.step_delay < 0:
        raise UsageError("--step-delay: must be >= 0")
    kwargs = sampling_kwargs(args)
    prompt = read_prompt(args.prompt)
    # the model's drafter is loaded for a mode that drafts with it (named, or the model's default)
    llm = load_llm(args, bundled_drafter=wants_drafter(args))
    mode = llm.mode(args.mode)  # None: the model's default, as LLM.generate and the server use
    chat = llm.is_chat and not args.raw
    if chat:  # an instruct model answers a user turn; raw text it mostly ends at once
        prompt, kwargs = llm.chat_prompt([{"role": "user", "content": prompt}]), llm.chat_options(kwargs)
        if not args.json:
            stderr(f"[{mode.name}] a chat model: the prompt goes as a user message through its chat template "
                   "(--raw sends it as it is)")
    params = llm.params(mode, kwargs)  # the options with the model's defaults filled in
    grammar = grammar_spec(args)
    if grammar is not None:
        if args.engine != "torch":
            raise UsageError("--json-schema / --grammar: only with --engine torch")
        llm.compile_grammar(grammar, params, mode=mode)  # a bad grammar is reported before anything runs
        kwargs["grammar"] = grammar
    masked = mode.needs_mask  # block size and threshold mean something for this mode
    tty = sys.stdout.isatty()

    if args.engine == "llama.cpp":
        from ..integrations.llama_port import generate as port_generate

        def show(delta: str) -> None:  # the text as blocks commit
            sys.stdout.write(viz.printable_text(delta) if tty else delta)
            sys.stdout.flush()

        rec = port_generate(llm, prompt, mode, kwargs, gguf=args.gguf, threads=llama_threads(args),
                            on_text=None if args.json else show)
        streamed = rec.pop("streamed")
        if args.json:
            print(json.dumps({"model": str(llm.path), "mode": mode.name, "engine": "llama.cpp", **rec}, ensure_ascii=False))
        else:
            sys.stdout.write(rec["text"][len(streamed):] + ("" if rec["text"].endswith("\n") else "\n"))
            s = rec["stats"]
            stderr(f"[{mode.name} · llama.cpp] " + viz.stats_line(s["tokens"], s["forwards"], s["seconds"], rec["finish_reason"]))
            if s.get("width_why"):  # block_size="auto": the draft widths chosen (every decision with --verbose)
                what = "block widths" if mode.name == "diffusion" else "draft widths"
                stderr(f"[{mode.name} · llama.cpp] block_size auto: {what} {draft_widths(s['width_why'])}")
                for line in s["width_why"] if args.verbose else []:
                    stderr(f"  {line}")
        return 0

    if args.json:
        gen = llm.generate(prompt, mode=mode, **kwargs)
        record = generation_record(llm, gen, mode.name, params.block_size if masked else None,
                                   params.threshold if masked else None)
        record["chat_template"] = chat
        print(json.dumps(record, ensure_ascii=False))
    elif args.live and tty:
        from rich.console import Console

        console = Console()
        view = viz.LiveView(lambda t: llm.tokenizer.decode([t]),
                            params.block_size if isinstance(params.block_size, int) else 64, console=console,
                            title=f"clover · {mode.name}", step_delay=args.step_delay)
        gen = None
        with view:
            for ev in llm.stream(prompt, mode=mode, provisional=True, **kwargs):
                view.update(ev)
                if ev.kind == "done":
                    gen = ev.generation
    elif args.live:  # not a terminal: the final text and stats only
        gen = llm.generate(prompt, mode=mode, **kwargs)
        sys.stdout.write(gen.text + ("" if gen.text.endswith("\n") else "\n"))
        sys.stdout.flush()
    else:
        gen, last = None, "\n"
        for ev in llm.stream(prompt, mode=mode, **kwargs):
            if ev.kind == "block" and ev.text:
                sys.stdout.write(viz.printable_text(ev.text) if tty else ev.text)
                sys.stdout.flush()
                last = ev.text[-1]
            elif ev.kind == "done":
                gen = ev.generation
        if last != "\n":
            sys.stdout.write("\n")
        sys.stdout.flush()

    s = gen.stats
    if not args.json and not (args.live and tty):  # the live view already shows the stats
        stderr(f"[{mode.name}] " + viz.stats_line(s.tokens, s.forwards, s.seconds, gen.finish_reason))
    if s.width_why and not args.json:  # block_size="auto": the widths chosen (every decision with --verbose)
        if s.block_widths:
            widths = ", ".join(f"{w}×{s.block_widths.count(w)}" for w in sorted(set(s.block_widths)))
            stderr(f"[{mode.name}] block_size auto: blocks of {widths}")
        else:  # speculative: the draft width of each decision (1: AR's step)
            stderr(f"[{mode.name}] block_size auto: draft widths {draft_widths(s.width_why)}")
        if args.verbose:
            for line in s.width_why:
                stderr(f"  {line}")
    if args.timeline:
        width = params.block_size if isinstance(params.block_size, int) else max(s.block_widths or [llm.config.block_size])
        out = write_timeline(llm, gen, mode, width, args.timeline)
        stderr(f"timeline written to {out}")
    return 0
