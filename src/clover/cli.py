"""The `clover` command line.

Each sub-command is a pair of functions — `configure(parser)` adds its arguments, `run(args) -> int`
does the work — registered once in `COMMANDS` (see `register`). Either may be given as a
"module:function" string, imported only when that sub-command is chosen, so `clover --help` stays
fast and a command's heavy dependencies load only when it runs. Heavy modules (torch, the model,
rich, matplotlib) are imported inside the run functions.

Errors a user can fix (a missing or broken model directory, a bad flag value) print one line on
stderr and exit with status 2; Ctrl-C exits with 130. Set CLOVER_DEBUG=1 to see tracebacks.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130
DEMO_PROMPTS = ("def fibonacci(n):", "assert sorted([9, 2, 5]) == ", "assert [x * 2 for x in [14, 3, 25, 7]] == ")
DEMO_TINY_DIR = Path("build") / "demo-tiny"
CHAT_STOP = "<|im_end|>"
SERVE_EXTRA = ("fastapi", "uvicorn", "pydantic", "starlette", "prometheus_client")  # pyproject's `serve` extra


class UsageError(Exception):
    """A problem the user can fix; printed as one line, exit status 2."""


# ------------------------------------------------------------------------------- the registry
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


def _resolve(target):
    if callable(target):
        return target
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


# -------------------------------------------------------------------------- shared arguments
def add_model_arguments(p: argparse.ArgumentParser, *, positional: bool = False, weights: bool = True) -> None:
    """--model DIR (default: the bundled model), --device, --dtype, and for commands that load the
    weights (`weights`) --no-check-finite."""
    if positional:
        p.add_argument("model_pos", nargs="?", metavar="MODEL", help="model directory (same as --model)")
    p.add_argument("--model", "-m", metavar="DIR", help="model directory (default: $CLOVER_MODEL or the bundled model)")
    p.add_argument("--device", help="torch device, e.g. cpu, cuda, cuda:1 (default: cpu)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="weight dtype (default: the checkpoint's)")
    if weights:
        p.add_argument("--no-check-finite", dest="check_finite", action="store_false",
                       help="load weights holding NaN/Inf instead of refusing them (skips the scan at load)")


def add_sampling_arguments(p: argparse.ArgumentParser, *, max_new_tokens: int | None = None) -> None:
    g = p.add_argument_group("decoding")
    g.add_argument("--mode", choices=["ar", "diffusion", "speculative", "naive"],
                   help="decoding mode (default: diffusion when the model has a mask token, else ar)")
    g.add_argument("--block-size", type=int, metavar="N", help="diffusion block size (default: the model's)")
    g.add_argument("--threshold", type=float, metavar="X", help="confidence needed to accept a token (default: the model's)")
    g.add_argument("--confidence", choices=["prob", "margin", "entropy"], help="confidence measure (default: prob)")
    g.add_argument("--max-new-tokens", "-n", type=int, metavar="N", default=max_new_tokens,
                   help=f"generation length limit (default: {max_new_tokens or 256})")
    g.add_argument("--temperature", "-t", type=float, metavar="T", help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, metavar="P")
    g.add_argument("--top-k", type=int, metavar="K")
    g.add_argument("--seed", type=int, metavar="S", help="sampling seed")
    g.add_argument("--stop", action="append", metavar="STR",
                   help=r"stop string (repeatable); escapes are processed: \n \t \r \\ \" \' \xNN \uNNNN")
    g.add_argument("--repetition-penalty", type=float, metavar="X")
    g.add_argument("--presence-penalty", type=float, metavar="X")
    g.add_argument("--eos-penalty", type=float, metavar="X", help="subtracted from the EOS logit")
    g.add_argument("--no-repeat-ngram-size", type=int, metavar="N")
    g.add_argument("--expert-budget", type=int, metavar="M", help="block expert sharing: experts per block forward")


_SAMPLING_FLAGS = (
    "block_size", "threshold", "confidence", "max_new_tokens", "temperature", "top_p", "top_k", "seed",
    "stop", "repetition_penalty", "presence_penalty", "eos_penalty", "no_repeat_ngram_size", "expert_budget",
)


_SIMPLE_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'"}
_HEX = set("0123456789abcdefABCDEF")


def process_escapes(text: str, *, flag: str = "--stop") -> str:
    r"""Turn the escapes a shell passes through literally into the characters they name, as
    llama.cpp's CLI does: \n \t \r \\ \" \' and \xNN (a byte: \xe2\x80\x94 is the UTF-8 of an em
    dash), plus \uNNNN (a code point). Unknown or incomplete escapes are kept as written."""
    if "\\" not in text:
        return text
    out = bytearray()
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        nxt = text[i + 1] if i + 1 < n else ""
        if c != "\\" or not nxt:
            out += c.encode("utf-8", "surrogatepass")
            i += 1
        elif nxt in _SIMPLE_ESCAPES:
            out += _SIMPLE_ESCAPES[nxt].encode()
            i += 2
        elif nxt == "x" and len(text[i + 2 : i + 4]) == 2 and set(text[i + 2 : i + 4]) <= _HEX:
            out.append(int(text[i + 2 : i + 4], 16))
            i += 4
        elif nxt == "u" and len(text[i + 2 : i + 6]) == 4 and set(text[i + 2 : i + 6]) <= _HEX:
            code = int(text[i + 2 : i + 6], 16)
            if 0xD800 <= code <= 0xDFFF:
                raise UsageError(f"{flag} {text!r}: \\u{code:04x} is a UTF-16 surrogate, not a character")
            out += chr(code).encode()
            i += 6
        else:  # not an escape we know: keep the backslash
            out += b"\\"
            i += 1
    try:
        return out.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{flag} {text!r}: the \\x bytes do not form valid UTF-8 text") from None


def sampling_kwargs(args: argparse.Namespace) -> dict:
    """The generation kwargs the user set (unset flags keep the API's / the model's defaults),
    checked before any model is loaded. Escapes in --stop are processed (see process_escapes)."""
    from .decoding.sampling import SamplingParams

    kwargs = {k: getattr(args, k) for k in _SAMPLING_FLAGS if getattr(args, k, None) is not None}
    if "stop" in kwargs:
        kwargs["stop"] = [process_escapes(s, flag="--stop") for s in kwargs["stop"]]
    SamplingParams.from_kwargs(**kwargs)  # raises ValueError with the flag's name
    return kwargs


def _check_device(device: str | None) -> None:
    if device is None:
        return
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise UsageError(f"--device: not a torch device: {device!r} (try cpu or cuda)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device}: CUDA is not available on this machine")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise UsageError(f"--device {device}: MPS is not available on this machine")


def model_dir(args: argparse.Namespace) -> Path:
    """The model directory the user chose, or the default one (raises FileNotFoundError)."""
    given = getattr(args, "model_pos", None) or getattr(args, "model", None)
    if given:
        return Path(given)
    from .api import default_model_path

    return default_model_path()


def load_llm(args: argparse.Namespace, path: Path | None = None):
    """clover.load with the user's --model/--device/--dtype/--no-check-finite; any failure to read
    the directory becomes a one-line error."""
    from . import api
    from .checkpoint import CheckpointError, finite_check
    from .config import ConfigError

    path = path or model_dir(args)
    _check_device(getattr(args, "device", None))
    if not path.exists():
        raise UsageError(f"{path}: no such model directory")
    try:
        with finite_check(getattr(args, "check_finite", True)):
            return api.load(path, dtype=getattr(args, "dtype", None), device=getattr(args, "device", None))
    except (CheckpointError, ConfigError, FileNotFoundError, UsageError):
        raise
    except Exception as e:  # a corrupt safetensors or tokenizer file, ...
        raise UsageError(f"{path}: cannot load the model ({type(e).__name__}: {e})") from None


def default_mode(llm) -> str:
    """diffusion for a Clover checkpoint (config has a mask token), ar for a plain AR one."""
    return "diffusion" if llm.config.mask_token_id is not None else "ar"


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _human(n: float, unit: str = "") -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "G" if unit == "B" else "B"), (1e6, "M"), (1e3, "K" if unit == "B" else "k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {suffix}{unit}".rstrip()
    return f"{n:.0f} {unit}".rstrip()


# ---------------------------------------------------------------------------------- generate
def configure_generate(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", nargs="?", help="the prompt; read from stdin when omitted or '-'")
    add_model_arguments(p)
    add_sampling_arguments(p)
    out = p.add_argument_group("output")
    out.add_argument("--live", action="store_true", help="show the block being denoised (a terminal view)")
    out.add_argument("--step-delay", type=float, default=0.0, metavar="SEC", help="--live: pause after each denoise step")
    out.add_argument("--timeline", metavar="FILE", help="write a picture of the decoding: FILE.png (or .svg) or FILE.html")
    out.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")


def read_prompt(arg: str | None) -> str:
    if arg is not None and arg != "-":
        return arg
    if sys.stdin is None or sys.stdin.isatty():
        raise UsageError("no prompt: give one as an argument or pipe it on stdin")
    text = sys.stdin.read()
    if text.endswith("\n"):
        text = text[:-1]
    if not text:
        raise UsageError("no prompt: stdin was empty")
    return text


def _block_size(llm, args) -> int:
    return args.block_size or llm.config.block_size


def write_timeline(llm, gen, mode: str, block_size: int, path: str) -> Path:
    """Render Generation `gen` with viz.render_timeline."""
    from . import viz

    tokens = [llm.tokenizer.decode([t]) for t in gen.token_ids]
    steps = list(gen.decode_steps) or [1] * len(tokens)
    if mode in ("diffusion", "naive"):
        forwards = gen.stats.block_steps or None
    else:  # one forward per token (speculative: approximate)
        forwards = [len(tokens[i : i + block_size]) for i in range(0, len(tokens), block_size)]
    title = f"{Path(str(llm.path)).name} · {mode} · block {block_size}"
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


def run_generate(args: argparse.Namespace) -> int:
    from . import viz

    if args.timeline and Path(args.timeline).suffix.lower() not in (".png", ".svg", ".pdf", ".html", ".htm"):
        raise UsageError(f"--timeline {args.timeline}: use a .png, .svg, .pdf or .html file name")
    if args.step_delay < 0:
        raise UsageError("--step-delay: must be >= 0")
    kwargs = sampling_kwargs(args)
    prompt = read_prompt(args.prompt)
    llm = load_llm(args)
    mode = args.mode or default_mode(llm)
    diffusion = mode in ("diffusion", "naive", "speculative")
    block_size = _block_size(llm, args)
    threshold = (args.threshold if args.threshold is not None else llm.config.threshold) if diffusion else None
    tty = sys.stdout.isatty()

    if args.json:
        gen = llm.generate(prompt, mode=mode, **kwargs)
        print(json.dumps(generation_record(llm, gen, mode, block_size if diffusion else None, threshold), ensure_ascii=False))
    elif args.live and tty:
        from rich.console import Console

        console = Console()
        view = viz.LiveView(lambda t: llm.tokenizer.decode([t]), block_size, console=console,
                            title=f"clover · {mode}", step_delay=args.step_delay)
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
        _stderr(f"[{mode}] " + viz.stats_line(s.tokens, s.forwards, s.seconds, gen.finish_reason))
    if args.timeline:
        out = write_timeline(llm, gen, mode, block_size, args.timeline)
        _stderr(f"timeline written to {out}")
    return 0


# -------------------------------------------------------------------------------------- chat
def configure_chat(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    add_sampling_arguments(p, max_new_tokens=256)
    p.add_argument("--system", metavar="TEXT", help="a system message kept at the top of the history")


CHAT_HELP = "commands: /reset (forget the conversation), /stats (last reply's numbers), /exit (quit)"


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


def _special_id(llm, token: str) -> int | None:
    hf = llm.tokenizer.hf
    tid = hf.convert_tokens_to_ids(token)
    if tid is None or (hf.unk_token_id is not None and tid == hf.unk_token_id):
        return None
    return int(tid)


def run_chat(args: argparse.Namespace) -> int:
    from . import viz

    kwargs = sampling_kwargs(args)
    llm = load_llm(args)
    mode = args.mode or default_mode(llm)
    kwargs["stop"] = [CHAT_STOP] + list(kwargs.get("stop", []))
    end_id = _special_id(llm, CHAT_STOP)
    if end_id is not None:
        kwargs["stop_token_ids"] = [end_id]
    max_new = kwargs.get("max_new_tokens", 256)
    extra = _block_size(llm, args) if mode in ("diffusion", "naive", "speculative") else 0
    budget = llm.context_length - max_new - extra
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    last = None
    interactive = sys.stdin.isatty()
    tty_out = sys.stdout.isatty()
    if interactive:
        _stderr(f"clover chat · {llm.path} · {mode} · {CHAT_HELP}")
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
            _stderr(f"clover chat: {e}")
            continue
        if dropped and interactive:
            _stderr(f"(dropped {dropped} old message(s) to fit the context)")
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
        reply = gen.text.split(CHAT_STOP)[0]
        messages.append({"role": "assistant", "content": reply})
        last = gen
    return 0


# -------------------------------------------------------------------------------------- info
def configure_info(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p, positional=True, weights=False)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _disk_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _stored_dtype(path: Path) -> str | None:
    """The dtype of the first tensor in the first safetensors file (reads only the header)."""
    files = [f for f in sorted(path.glob("*.safetensors")) if f.is_file()]  # never open a FIFO
    if not files:
        return None
    try:
        with open(files[0], "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
    except (OSError, ValueError):
        return None
    names = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "I8": "int8", "U8": "uint8", "F8_E4M3": "float8_e4m3"}
    for k, v in header.items():
        if k != "__metadata__" and isinstance(v, dict):
            return names.get(v.get("dtype"), v.get("dtype"))
    return None


def _token_string(path: Path, token_id: int | None) -> str | None:
    if token_id is None or not (path / "tokenizer.json").is_file():  # a FIFO would block the read
        return None
    try:
        tok = json.loads((path / "tokenizer.json").read_text())
    except (OSError, ValueError):
        return None
    for t in tok.get("added_tokens", []):
        if t.get("id") == token_id:
            return t.get("content")
    return None


def model_info(path: Path) -> dict:
    """The facts `clover info` prints, from config.json and file sizes (no weights are loaded)."""
    from .config import CloverConfig

    if not path.exists():
        raise UsageError(f"{path}: no such model directory")
    if not path.is_dir():
        raise UsageError(f"{path}: not a directory; pass the folder holding config.json and the safetensors")
    c = CloverConfig.from_file(path)
    counts = c.parameter_counts()
    n_attn = sum(t == "full_attention" for t in c.layer_types)
    n_gdn = sum(t == "linear_attention" for t in c.layer_types)
    return {
        "path": str(path),
        "model_type": c.model_type,
        "layers": c.num_hidden_layers,
        "layer_pattern": "".join("A" if t == "full_attention" else "L" for t in c.layer_types),
        "attention_layers": n_attn,
        "gdn_layers": n_gdn,
        "hidden_size": c.hidden_size,
        "vocab_size": c.vocab_size,
        "attention": {"q_heads": c.num_attention_heads, "kv_heads": c.num_key_value_heads, "head_dim": c.head_dim,
                      "rotary_dim": c.rotary_dim, "rope_theta": c.rope_theta},
        "gdn": {"key_heads": c.linear_num_key_heads, "value_heads": c.linear_num_value_heads,
                "key_dim": c.linear_key_head_dim, "value_dim": c.linear_value_head_dim, "conv_kernel": c.linear_conv_kernel_dim},
        "experts": {"num": c.num_experts, "top_k": c.num_experts_per_tok, "intermediate": c.moe_intermediate_size,
                    "shared_intermediate": c.shared_expert_intermediate_size, "expert_budget": c.expert_budget},
        "parameters": {"total": counts["total"], "active": counts["active"]},
        "dtype": c.torch_dtype or _stored_dtype(path),
        "disk_bytes": _disk_size(path),
        "context_length": c.max_position_embeddings,
        "diffusion": c.mask_token_id is not None,
        "block_size": c.block_size if c.mask_token_id is not None else None,
        "threshold": c.threshold if c.mask_token_id is not None else None,
        "mask_token_id": c.mask_token_id,
        "mask_token": _token_string(path, c.mask_token_id),
        "eos_token_ids": c.eos_token_ids,
        "quantization": c.quantization_config,
    }


def format_info(info: dict) -> str:
    a, g, e, p = info["attention"], info["gdn"], info["experts"], info["parameters"]
    pattern = info["layer_pattern"]
    if len(pattern) > 48:
        pattern = pattern[:45] + "…"
    rows = [
        ("model", f"{info['path']} ({info['model_type']})"),
        ("layers", f"{info['layers']}: {info['gdn_layers']} GDN (linear attention) + {info['attention_layers']} full attention  [{pattern}]"),
        ("hidden / vocab", f"{info['hidden_size']} / {info['vocab_size']}"),
        ("attention", f"{a['q_heads']} q heads, {a['kv_heads']} kv heads, head dim {a['head_dim']}, rotary dims {a['rotary_dim']}"),
        ("GDN", f"{g['key_heads']} key heads × {g['key_dim']}, {g['value_heads']} value heads × {g['value_dim']}, conv kernel {g['conv_kernel']}"),
        ("experts", f"{e['num']} routed, top-{e['top_k']}, intermediate {e['intermediate']}"
         + (f", shared expert {e['shared_intermediate']}" if e["shared_intermediate"] else "")
         + (f", block budget {e['expert_budget']}" if e["expert_budget"] else "")),
        ("parameters", f"{_human(p['total'])} total, {_human(p['active'])} active per token ({p['total']:,} / {p['active']:,})"),
        ("dtype", info["dtype"] or "unknown"),
        ("size on disk", _human(info["disk_bytes"], "B")),
        ("context length", f"{info['context_length']:,}"),
    ]
    if info["diffusion"]:
        mask = f"{info['mask_token_id']}" + (f" {info['mask_token']}" if info["mask_token"] else "")
        rows += [("block size", str(info["block_size"])), ("threshold", str(info["threshold"])), ("mask token", mask)]
    else:
        rows.append(("diffusion", "no mask token: autoregressive only"))
    q = info["quantization"]
    if isinstance(q, dict):
        shown = {k: (f"{len(v)} modules" if isinstance(v, list) and k == "modules" else v) for k, v in q.items()}
        rows.append(("quantization", ", ".join(f"{k}={v}" for k, v in shown.items())))
    else:
        rows.append(("quantization", "none"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def run_info(args: argparse.Namespace) -> int:
    info = model_info(model_dir(args))
    print(json.dumps(info) if args.json else format_info(info))
    return 0


# -------------------------------------------------------------------------------------- tiny
def configure_tiny(p: argparse.ArgumentParser) -> None:
    p.add_argument("directory", metavar="DIR", help="where to write the checkpoint")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default: 0)")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--clover", dest="clover", action="store_true", default=True, help="a Clover (diffusion) checkpoint (default)")
    kind.add_argument("--ar", dest="clover", action="store_false", help="a plain AR (Qwen3.5-MoE) checkpoint, no mask token")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")


def run_tiny(args: argparse.Namespace) -> int:
    from .checkpoint import parse_dtype
    from .tiny import build_tiny_checkpoint

    d = Path(args.directory)
    if d.exists() and (not d.is_dir() or (any(d.iterdir()) and not (d / "config.json").exists())):
        raise UsageError(f"{d}: exists and is not a model directory; choose a new or empty folder")
    build_tiny_checkpoint(d, seed=args.seed, clover=args.clover, dtype=parse_dtype(args.dtype))
    info = model_info(d)
    kind = "clover (diffusion)" if args.clover else "AR"
    print(f"wrote a tiny random {kind} checkpoint to {d} ({_human(info['parameters']['total'])} parameters, "
          f"{_human(info['disk_bytes'], 'B')}); its output is noise")
    return 0


# -------------------------------------------------------------------------------------- demo
def configure_demo(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--max-new-tokens", "-n", type=int, default=64, metavar="N", help="tokens per generation (default: 64)")


def demo_model_dir(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model)
    from .api import default_model_path

    try:
        return default_model_path()
    except FileNotFoundError:
        pass
    d = DEMO_TINY_DIR
    if not (d / "config.json").exists():
        from .tiny import build_tiny_checkpoint

        build_tiny_checkpoint(d)
    _stderr(f"the bundled model is not there yet; using a tiny random checkpoint at {d} (its output is noise)")
    return d


def run_demo(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    from . import viz
    from .data.tasks import PROMPT_SEP

    if args.max_new_tokens <= 0:
        raise UsageError("--max-new-tokens: must be a positive integer")
    llm = load_llm(args, demo_model_dir(args))
    console = Console(width=None if sys.stdout.isatty() else 120)
    modes = ["ar", "diffusion"] if default_mode(llm) == "diffusion" else ["ar"]
    table = Table(title=f"clover demo · {llm.path}", title_justify="left")
    for col in ("prompt", "mode", "tokens", "forwards", "tokens/forward", "tokens/s", "finish"):
        table.add_column(col, justify="left" if col in ("prompt", "mode", "finish") else "right")
    for prompt in DEMO_PROMPTS:
        for mode in modes:
            # a task prompt's answer is the rest of its line: stop there, as `clover eval` does
            stop = ["\n"] if prompt.endswith(PROMPT_SEP) else None
            gen = llm.generate(prompt, mode=mode, max_new_tokens=args.max_new_tokens, stop=stop)
            s = gen.stats
            console.rule(f"{mode} · {prompt!r}", align="left")
            console.print(viz.printable_text(prompt + gen.text), markup=False, highlight=False)
            table.add_row(repr(prompt), mode, str(s.tokens), str(s.forwards), f"{s.tokens_per_forward:.2f}",
                          f"{s.tokens_per_second:.1f}", gen.finish_reason)
    console.print()
    console.print(table)
    return 0


# ------------------------------------------------------------------------------ registration
register("generate", "generate text from a prompt (streams as blocks commit)", configure_generate, run_generate)
register("chat", "a multi-turn chat on stdin/stdout", configure_chat, run_chat)
register("info", "summarise a model directory (architecture, parameters, size)", configure_info, run_info)
register("tiny", "write a tiny random checkpoint (for demos and bug reports)", configure_tiny, run_tiny)
register("demo", "generate with the default model in AR and diffusion mode and compare", configure_demo, run_demo)


def configure_convert(p: argparse.ArgumentParser) -> None:
    p.add_argument("src", help="a Qwen3.5/3.6-MoE checkpoint directory (safetensors + tokenizer)")
    p.add_argument("dst", help="where to write the Clover checkpoint")
    p.add_argument("--block-size", type=int, default=32, help="default block size stored in the config (32)")
    p.add_argument("--threshold", type=float, default=0.95, help="default confidence threshold stored in the config (0.95)")


def run_convert(args: argparse.Namespace) -> int:
    from .convert import convert_to_clover

    cfg = convert_to_clover(args.src, args.dst, block_size=args.block_size, threshold=args.threshold)
    print(f"wrote {args.dst}: model_type clover, mask token id {cfg.mask_token_id}, vocab {cfg.vocab_size}")
    return 0


def configure_serve(p: argparse.ArgumentParser) -> None:
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--max-batch", type=int, default=8, help="rows decoded together (default 8)")
    p.add_argument("--max-queue", type=int, default=64, help="rows waiting beyond the batch before 429 (default 64)")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the directory name)")


def _missing_serve_extra() -> str | None:
    """The first module of the `serve` extra that cannot be imported, or None."""
    import importlib.util

    for name in SERVE_EXTRA:
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except (ImportError, ValueError):  # a broken install, or sys.modules[name] is None
            return name
    return None


def run_serve(args: argparse.Namespace) -> int:
    missing = _missing_serve_extra()  # before loading the model: uvicorn is only imported to run
    if missing is None:
        try:
            from .serve import main_serve
        except ImportError as e:
            if (e.name or "").split(".")[0] not in SERVE_EXTRA:
                raise
            missing = e.name
    if missing is not None:
        raise UsageError(f"serving needs the serve extra ({missing} is not installed): pip install 'clover[serve]'")
    return main_serve(args)


register("serve", "an OpenAI-compatible HTTP server with batching across requests", configure_serve, run_serve)
register("bench", "benchmarks: decode modes, speed/quality sweeps, kernels, roofline",
         "clover.bench.cli:configure", "clover.bench.cli:run")
register("eval", "evaluate a checkpoint: held-out tasks and code, every mode on the same weights",
         "clover.eval:configure", "clover.eval:run")
def configure_train(p: argparse.ArgumentParser) -> None:
    p.add_argument("train_args", nargs=argparse.REMAINDER,
                   help="RECIPE [--out DIR] [--steps N] [--resume|--no-resume] [--set KEY=VALUE]... | RUN_DIR | export CKPT OUT | plot RUN_DIR... "
                        "(see docs/training.md; `clover train -- --help` for all options)")


def run_train(args: argparse.Namespace) -> int:
    from .train import main as train_main

    argv = [a for a in args.train_args if a != "--"] if args.train_args[:1] == ["--"] else list(args.train_args)
    if not argv:
        raise UsageError("train: give a recipe file (e.g. recipes/clover-tiny-ar.toml) or a run directory")
    return train_main(argv)


register("train", "train: AR pretraining or AR -> Clover block-diffusion conversion, from a recipe",
         configure_train, run_train)
register("quantize", "weight-only INT8/INT4 quantization of a model directory",
         "clover.quant.cli:configure", "clover.quant.cli:run")
register("convert", "turn a Qwen3.5-MoE checkpoint into a Clover one (mask token + zero-initialised new parameters)",
         configure_convert, run_convert)
register("export-gguf", "write a checkpoint as GGUF for llama.cpp (arch qwen35moe; see docs/gguf.md)",
         "clover.export.cli:configure", "clover.export.cli:run")


# -------------------------------------------------------------------------------------- main
def build_parser(selected: str | None = None) -> argparse.ArgumentParser:
    """The argument parser. Lazily-registered commands are configured only when `selected`."""
    from . import __version__

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
        _stderr("\ninterrupted")
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
        _stderr(f"clover {cmd.name}: error: {e}")
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
