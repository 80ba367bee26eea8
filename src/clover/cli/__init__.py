"""The `clover` command line: a dispatcher.

Each sub-command lives in its own module of this package, a pair of functions — `configure(parser)`
adds its arguments, `run(args) -> int` parses nothing more and calls the library — registered once
in `COMMANDS` (see `register`) as "module:function" strings, imported only when that sub-command is
chosen: `clover --help` stays fast and a command's heavy dependencies load only when it runs.
Shared flags and helpers are in `clover.cli.common`. Nothing outside this package imports it.

Errors a user can fix (a missing or broken model directory, a bad flag value) print one line on
stderr and exit with status 2; Ctrl-C exits with 130. Set CLOVER_DEBUG=1 to see tracebacks.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import dataclass
from typing import Callable, Sequence

from .common import UsageError, stderr

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130

__all__ = ["main", "entry", "register", "Command", "COMMANDS", "UsageError", "build_parser"]


@dataclass
class Command:
    name: str
    help: str
    configure: Callable[[argparse.ArgumentParser], None] | str
    run: Callable[[argparse.Namespace], int | None] | str
    description: str | None = None


COMMANDS: dict[str, Command] = {}


def register(
    name: str,
    help: str,
    configure: Callable[[argparse.ArgumentParser], None] | str,
    run: Callable[[argparse.Namespace], int | None] | str,
    *,
    description: str | None = None,
) -> Command:
    """Add a sub-command. `configure`/`run` may be callables or lazy "package.module:function"
    strings. `run` returns the exit status (None = 0) and may raise UsageError / ValueError /
    FileNotFoundError for one-line errors."""
    cmd = Command(name, help, configure, run, description)
    COMMANDS[name] = cmd
    return cmd


def _command(name: str, module: str, help: str) -> None:
    """A built-in command: `clover.cli.<module>` defines configure(parser) and run(args)."""
    register(name, help, f"clover.cli.{module}:configure", f"clover.cli.{module}:run")


_command("generate", "generate", "generate text from a prompt (streams as blocks commit)")
_command("chat", "chat", "a multi-turn chat on stdin/stdout")
_command("info", "info", "summarise a model directory (architecture, parameters, size)")
_command("tiny", "tiny", "write a tiny random checkpoint (for demos and bug reports)")
_command("demo", "demo", "generate with the default model in AR and diffusion mode and compare")
_command("serve", "serve", "an OpenAI-compatible HTTP server with batching across requests")
_command("bench", "bench", "benchmarks: decode modes, speed/quality sweeps, kernels, roofline, quantization")
_command("eval", "eval", "evaluate a checkpoint: held-out tasks and code, every mode on the same weights")
_command("train", "train", "train: AR pretraining or AR -> Clover block-diffusion conversion, from a recipe")
_command("quantize", "quantize", "weight-only INT8/INT4 quantization of a model directory")
_command("convert", "convert",
         "turn a Qwen3.5-MoE checkpoint into a Clover one (mask token + zero-initialised new parameters)")
_command("pull", "pull", "download a named model (clover-smol) into the user cache; then --model NAME works offline")
_command("list", "ls", "the models in the user cache (pulled, imported GGUF files, downloads) with their sizes")
_command("rm", "rm", "delete a model from the user cache (a name that `clover list` shows)")
_command("import-gguf", "import_gguf", "turn a GGUF file (llama; qwen35moe as export-gguf writes it) into a model directory (safetensors, tokenizer, chat template)")
_command("export-gguf", "export_gguf", "write a checkpoint as GGUF for llama.cpp (arch qwen35moe; see docs/gguf.md)")
_command("export-hf", "export_hf", "write a Clover checkpoint as a transformers directory (trust_remote_code; see docs/transformers.md)")


def _resolve(target):
    if callable(target):
        return target
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """The argument parser. Lazily-registered commands are configured only when `selected`."""
    from .. import __version__

    parser = argparse.ArgumentParser(
        prog="clover",
        description="Block-diffusion language models on the Qwen3.5/3.6-MoE backbone.",
        epilog="Run `clover COMMAND --help` for a command's options. Set CLOVER_DEBUG=1 for tracebacks.",
    )
    parser.add_argument("--version", action="version", version=f"clover {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for cmd in COMMANDS.values():
        p = sub.add_parser(cmd.name, help=cmd.help, description=cmd.description or cmd.help)
        if callable(cmd.configure) or cmd.name == selected:
            _resolve(cmd.configure)(p)
        p.set_defaults(_command=cmd)
    return parser


def _selected(argv: Sequence[str]) -> str | None:
    for a in argv:
        if not a.startswith("-"):
            return a if a in COMMANDS else None
    return None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(_selected(argv))
    args = parser.parse_args(argv)  # exits 2 itself on bad syntax
    cmd: Command | None = getattr(args, "_command", None)
    if cmd is None:
        parser.print_help()
        return EXIT_USAGE
    debug = os.environ.get("CLOVER_DEBUG") == "1"
    try:
        rc = _resolve(cmd.run)(args)
        return int(rc or 0)
    except KeyboardInterrupt:
        stderr("\ninterrupted")
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # `clover generate ... | head`
        try:
            sys.stdout = open(os.devnull, "w")
        except OSError:
            pass
        return 0
    except (UsageError, ValueError, FileNotFoundError, NotADirectoryError) as e:
        if debug:
            raise
        stderr(f"clover {cmd.name}: error: {e}")
        return EXIT_USAGE


def entry() -> None:
    """The `clover` command (the console script and `python -m clover`): `main`, then the exit without
    the interpreter's teardown, which after importing torch takes about a second (every module and
    library torn down one by one) and does nothing a finished command needs. Before it: other
    non-daemon threads are joined, atexit handlers run and stdout/stderr are flushed, as at a normal exit."""
    import atexit
    import threading

    rc = main()
    for t in threading.enumerate():
        if t is not threading.current_thread() and not t.daemon:
            t.join()
    run_exitfuncs = getattr(atexit, "_run_exitfuncs", None)
    if run_exitfuncs is None:  # not CPython: the ordinary exit
        sys.exit(rc)
    run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`clover generate ... | head`) or stream
            pass
    os._exit(rc)
