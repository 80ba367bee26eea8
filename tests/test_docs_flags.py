"""Every `clover COMMAND --flag` that README.md or a docs/ page writes (in code: fenced blocks and
inline `code`) names a command that exists and flags its parser has; so a reader who copies a
command line from the docs gets no "unrecognized arguments"."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
from pathlib import Path

import pytest

from clover import cli

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# history is what was true then: experiments.md keeps the flags of its day
SKIP_PAGES = {"experiments.md"}
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
CALL = re.compile(r"(?:^|[\s`(\[$])clover ([a-z][a-z0-9-]*)((?: [^|;&#`]*)?)")


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {o for a in parser._actions for o in a.option_strings}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            return dict(a.choices)
    return {}


def _train_options() -> set[str]:
    from clover.cli.train import main as train_main

    out: set[str] = set()
    for argv in (["--help"], *([sub, "--help"] for sub in ("export", "plan", "plot", "evaluate", "tokenizer"))):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
            train_main(argv)
        out |= set(FLAG.findall(buf.getvalue()))
    return out


def command_options(name: str, sub: str | None) -> set[str] | None:
    """The flags of `clover name [sub]` (None: no such command)."""
    if name not in cli.COMMANDS:
        return None
    if name == "train":
        return _train_options()
    parser = _subparsers(cli.build_parser(name))[name]
    subs = _subparsers(parser)
    if subs and sub in subs:
        return _options(parser) | _options(subs[sub])
    return _options(parser)


def code_segments(text: str):
    """(line number, code) for every line of a fenced block and every inline code span."""
    fenced, shell = False, False
    for n, line in enumerate(text.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            shell = line.strip()[3:] in ("", "bash", "sh", "shell", "console", "text")  # not python, toml, json
            continue
        if fenced:
            if shell:
                yield n, line
        else:
            for m in re.finditer(r"`([^`]+)`", line):
                yield n, m.group(1)


def named_calls():
    for page in PAGES:
        if page.name in SKIP_PAGES:
            continue
        for n, code in code_segments(page.read_text()):
            for m in CALL.finditer(code):
                name, rest = m.group(1), m.group(2) or ""
                words = rest.split()
                sub = words[0] if words and not words[0].startswith("-") else None
                yield f"{page.relative_to(REPO)}:{n}", name, sub, FLAG.findall(rest)


def test_docs_name_only_real_commands_and_flags():
    cache: dict = {}
    bad = []
    for where, name, sub, flags in named_calls():
        key = (name, sub)
        if key not in cache:
            cache[key] = command_options(name, sub)
        opts = cache[key]
        if opts is None:
            bad.append(f"{where}: `clover {name}` is not a command")
            continue
        for f in flags:
            if f not in opts and f != "--help":
                bad.append(f"{where}: `clover {name}{' ' + sub if sub else ''}` has no {f}")
    assert not bad, "\n".join(bad)


def test_the_checker_sees_a_wrong_flag():
    assert command_options("generate", None) and "--mode" in command_options("generate", None)
    assert "--no-such-flag" not in command_options("generate", None)
    assert command_options("nonsense", None) is None
    assert "--plot" in command_options("bench", "sweep") and "--thresholds" not in command_options("bench", "decode")


def test_cli_md_covers_every_command():
    """docs/cli.md, the command reference, names every command and every `clover bench` benchmark."""
    text = (REPO / "docs" / "cli.md").read_text()
    bench = _subparsers(_subparsers(cli.build_parser("bench"))["bench"])
    missing = [f"clover {c}" for c in cli.COMMANDS if f"clover {c}" not in text]
    missing += [f"clover bench {b}" for b in bench if f"clover bench {b}" not in text]
    assert not missing, f"docs/cli.md does not mention: {', '.join(missing)}"


def test_every_help_page_renders(capsys):
    """`clover COMMAND --help` (and `clover bench BENCH --help`) print their page: argparse formats
    help strings with %, so a stray % in one breaks the whole page."""
    bench = _subparsers(_subparsers(cli.build_parser("bench"))["bench"])
    for argv in [[c, "--help"] for c in cli.COMMANDS if c != "train"] + [["bench", b, "--help"] for b in bench]:
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 0, argv
    capsys.readouterr()
