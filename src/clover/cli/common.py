"""What several commands share: the model and sampling flags, the one-line `UsageError`, loading
with the user's flags, reading the prompt. Only the standard library is imported at module level;
the sampling flags read the option table (`clover.decoding.sampling.LIMITS`) and the mode registry
when a command that has them is configured."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

DTYPE_CHOICES = ("float32", "bfloat16", "float16")
DEMO_TINY_DIR = Path("build") / "demo-tiny"


class UsageError(Exception):
    """A problem the user can fix; printed as one line, exit status 2."""


def stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


DISTRIBUTION = "clover-dlm"  # the name on PyPI (`clover` there is another project)


def extra_hint(extra: str) -> str:
    """How to install an optional extra: from the clone (`pip install -e '.[EXTRA]'`: the package is
    not on PyPI yet), or, once published, pip install 'clover-dlm[EXTRA]'."""
    return (f"in the clover clone: pip install -e '.[{extra}]'; "
            f"once published: pip install '{DISTRIBUTION}[{extra}]'")


def has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def draw_plot(draw, *args, **kwargs):
    """Call a plotting function after the results are out; without matplotlib, one line on stderr
    naming the extra (the results already printed or written are complete) and None."""
    try:
        return draw(*args, **kwargs)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] != "matplotlib":
            raise
        stderr(f"plot skipped: matplotlib is not installed ({extra_hint('plot')}); the results above are complete")
        return None


def human(n: float, unit: str = "") -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "G" if unit == "B" else "B"), (1e6, "M"), (1e3, "K" if unit == "B" else "k")):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {suffix}{unit}".rstrip()
    return f"{n:.0f} {unit}".rstrip()


def positive(flag: str, value) -> None:
    """ValueError "--flag: must be a positive integer" for a value <= 0 (None passes)."""
    if value is not None and value <= 0:
        raise ValueError(f"{flag}: must be a positive integer, got {value}")


# ------------------------------------------------------------------------------ model flags
def default_threads() -> int:
    """torch's CPU threads when --threads is not given: what OMP_NUM_THREADS (or MKL_NUM_THREADS)
    says when set (torch read it), else one per idle core: the cores this process may use less the
    busy ones (the other processes running now, or the 1-minute load average, whichever is more;
    rounded up), at least 1 and at most torch's own default. With torch's default alone (one thread
    per core) a forward waits for every core, so one busy process elsewhere makes each parallel
    region wait a scheduler slice: on a 2-core box a generate ran 4-10x slower than on 1 thread
    (docs/experiments.md, 2026-12-06)."""
    import math
    import os

    import torch

    if os.environ.get("OMP_NUM_THREADS") or os.environ.get("MKL_NUM_THREADS"):
        return torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    busy = 0.0
    try:
        busy = os.getloadavg()[0]
    except (OSError, AttributeError):  # not on this platform
        pass
    try:
        with open("/proc/loadavg") as f:  # "0.53 0.34 0.14 3/180 1234": 3 runnable now, this one among them
            busy = max(busy, int(f.read().split()[3].split("/")[0]) - 1)
    except (OSError, ValueError, IndexError):
        pass
    return max(1, min(torch.get_num_threads(), cores - math.ceil(busy - 0.2)))


def apply_threads(args: argparse.Namespace) -> int:
    """Set torch's CPU threads: --threads N, else `default_threads()`. Returns the number set."""
    import torch

    n = getattr(args, "threads", None)
    positive("--threads", n)
    n = n or default_threads()
    torch.set_num_threads(n)
    return n


def add_engine_arguments(p: argparse.ArgumentParser, what: str) -> None:
    """--engine torch|llama.cpp, --gguf FILE and --llama-threads N (the port's threads; --threads is
    torch's and, given alone, the port's too)."""
    eng = p.add_argument_group("engine")
    eng.add_argument("--engine", choices=("torch", "llama.cpp"), default="torch",
                     help=f"llama.cpp: {what} with the ggml port (PORT=1 scripts/build-llama-cpp.sh; docs/llama-port.md)")
    eng.add_argument("--gguf", metavar="FILE", help="--engine llama.cpp: the model's GGUF export (default: export it, f32)")
    eng.add_argument("--llama-threads", type=int, metavar="N",
                     help="--engine llama.cpp: the port's CPU threads (default: --threads, else 1)")


def llama_threads(args: argparse.Namespace) -> int:
    """The llama.cpp port's threads: --llama-threads, else --threads, else 1."""
    n = args.llama_threads or getattr(args, "threads", None) or 1
    positive("--llama-threads", n)
    return n


def add_model_arguments(p: argparse.ArgumentParser, *, positional: bool = False, weights: bool = True,
                        threads: bool = True) -> None:
    """--model DIR (default: the bundled model), --device, --dtype, and for commands that load the
    weights (`weights`) --no-check-finite and (`threads`) --threads, torch's CPU threads."""
    if positional:
        p.add_argument("model_pos", nargs="?", metavar="MODEL", help="model directory (same as --model)")
    p.add_argument("--model", "-m", metavar="DIR", help="model directory, GGUF file (imported into the user cache on "
                   "first use), name (clover-smol) or Hugging Face repo id ORG/NAME (from the hub cache, else "
                   "downloaded) (default: $CLOVER_MODEL or the bundled model)")
    p.add_argument("--device", help="torch device, e.g. cpu, cuda, cuda:1 (default: cpu)")
    p.add_argument("--dtype", choices=DTYPE_CHOICES, help="weight dtype (default: the checkpoint's)")
    p.add_argument("--compile", action="store_const", const="static", default=False,
                   help="torch.compile the AR, denoise, block-commit and verify steps whole over static shapes: "
                        "a bounded set at load (the model's block size, batch sizes in powers of two, cache "
                        "sizes up to 512; minutes on a CPU, with a progress bar), other shapes run eagerly")
    if weights:
        p.add_argument("--drafter", metavar="DIR",
                       help="a DFlash drafter directory for --mode dflash (default: the bundled model's own)")
        p.add_argument("--no-check-finite", dest="check_finite", action="store_false",
                       help="load weights holding NaN/Inf instead of refusing them (skips the scan at load)")
        if threads:
            p.add_argument("--threads", type=int, metavar="N",
                           help="torch CPU threads (default: $OMP_NUM_THREADS, else one per idle core)")


def given_model(args: argparse.Namespace) -> str | None:
    """MODEL as given (positional, else --model), or None."""
    return getattr(args, "model_pos", None) or getattr(args, "model", None)


def model_dir(args: argparse.Namespace) -> Path:
    """The model directory the user chose (a directory, or a model name such as clover-smol, pulled
    into the user cache), or the default one (raises FileNotFoundError)."""
    from ..api import default_model_path, model_path

    given = given_model(args)
    return model_path(given, device=getattr(args, "device", None)) if given else default_model_path()


def model_dir_or_tiny(args: argparse.Namespace) -> tuple[Path, str | None]:
    """The model the user chose, else the default one, else a tiny random checkpoint built once in
    build/demo-tiny (so `clover demo` and `clover bench` run before any model is trained). Returns
    (directory, a note when it is the tiny random one)."""
    from ..api import default_model_path, model_path

    if getattr(args, "model", None):
        return model_path(args.model, device=getattr(args, "device", None)), None
    try:
        return default_model_path(), None
    except FileNotFoundError:
        pass
    d = DEMO_TINY_DIR
    if not (d / "config.json").exists():
        from ..tiny import build_tiny_checkpoint

        build_tiny_checkpoint(d)
    return d, "tiny random weights (no trained model yet)"


def wants_drafter(args: argparse.Namespace) -> bool:
    """Whether the mode the user named (--mode), or else the model's default (its config's
    `default_mode`), drafts with a DFlash drafter: then `load_llm` loads the model's own drafter."""
    from ..decoding import get_mode

    name = getattr(args, "mode", None)
    if name is None:
        from ..models import read_config

        try:
            name = read_config(model_dir(args)).default_mode
        except Exception:  # noqa: BLE001 - load_llm reports a missing or broken model with its own message
            return False
    return name is not None and get_mode(name).needs_drafter


def check_device(device: str | None) -> None:
    """`clover.api.check_device`, its error naming the flag (--device)."""
    from ..api import check_device as api_check_device

    try:
        api_check_device(device)
    except ValueError as e:
        raise UsageError(f"--{e}") from None


def load_llm(args: argparse.Namespace, path: Path | None = None, *, bundled_drafter: bool = True,
             calibrate: bool = False):
    """`clover.load` with the user's --model/--device/--dtype/--no-check-finite; any failure to
    read the directory becomes a one-line error. `bundled_drafter=False`: without the bundled
    model's drafter unless --drafter names one (a command that runs no drafting mode). `calibrate`:
    draft auto's step costs measured (or read from the user cache) at load (`clover.load`)."""
    from .. import api
    from ..checkpoint import CheckpointError
    from ..config import ConfigError

    path = path or model_dir(args)
    device = getattr(args, "device", None)
    check_device(device)
    apply_threads(args)
    drafter = getattr(args, "drafter", None) or (None if bundled_drafter else False)
    mismatch = ()  # the drafter's error, when there is a drafter (its module is imported only then)
    if drafter:
        from ..models.dflash import DrafterMismatch as mismatch

    try:
        return api.load(path, dtype=getattr(args, "dtype", None), device=device,
                        check_finite=getattr(args, "check_finite", True), compile=getattr(args, "compile", False),
                        drafter=drafter, compile_batch=getattr(args, "max_batch", 1),
                        calibrate=calibrate)
    except mismatch as e:
        raise UsageError(f"--{e}") from None
    except (CheckpointError, ConfigError, FileNotFoundError, UsageError):
        raise
    except Exception as e:  # a corrupt safetensors or tokenizer file, ...
        raise UsageError(f"{path}: cannot load the model ({type(e).__name__}: {e})") from None


# --------------------------------------------------------------------------- sampling flags
FLAG_ALIASES = {"max_new_tokens": ("-n",), "temperature": ("-t",)}
STOP_HELP = r"stop string (repeatable); escapes are processed: \n \t \r \\ \" \' \xNN \uNNNN"


def flag(name: str) -> str:
    """The command-line flag of generation option `name`: max_new_tokens -> --max-new-tokens."""
    return "--" + name.replace("_", "-")


def _flag_help(name: str, lim, default) -> str:
    doc = lim.doc.replace("(null = ", "(unset = ")
    if name == "stop":
        return STOP_HELP
    if lim.kind is list:
        return f"{doc} (repeatable)"
    bounds = "" if lim.choices or lim.kind is bool else lim.describe()
    for said in ("; or null", "or null", " (finite number)", " (integer)"):  # the metavar says the type
        bounds = bounds.replace(said, "")
    shown = "" if default is None or lim.kind is bool or "unset =" in doc else f"default: {default}"
    extra = "; ".join(x for x in (bounds, shown) if x)
    return f"{doc}" + (f" [{extra}]" if extra else "")


def add_sampling_arguments(p: argparse.ArgumentParser, *, max_new_tokens: int | None = None) -> None:
    """--mode (the registered modes) and one flag per generation option of `LIMITS`, with its
    type, choices and limits from that table; unset flags keep the API's and the model's defaults."""
    from ..decoding import mode_names
    from ..decoding.sampling import LIMITS, SamplingParams

    defaults = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    if max_new_tokens is not None:
        defaults["max_new_tokens"] = max_new_tokens
    g = p.add_argument_group("decoding")
    g.add_argument("--mode", choices=mode_names(),
                   help="decoding mode (default: the model's own, its config's default_mode; else diffusion when "
                        "it has a mask token, else ar)")
    for name, lim in LIMITS.items():
        names = (flag(name), *FLAG_ALIASES.get(name, ()))
        kw: dict = {"dest": name, "help": _flag_help(name, lim, defaults.get(name))}
        if lim.kind is bool:
            kw.update(action="store_true", default=None)
        elif lim.kind is list:
            kw.update(action="append", type=lim.item, metavar="STR" if lim.item is str else "ID")
        else:
            kw.update(type=lim.kind, metavar="{" + ",".join(lim.choices) + "}" if lim.choices else
                      ("N" if lim.kind is int else "X" if lim.kind is float else "STR"))
            if lim.choices:
                kw["choices"] = lim.choices
            if name == "max_new_tokens":
                kw["default"] = max_new_tokens
            if name == "block_size":  # an integer, or "auto" (diffusion: the engine picks a trained width)
                kw.update(type=_int_or_auto, metavar="N|auto")
        g.add_argument(*names, **kw)


def _int_or_auto(text: str):
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None


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
    from ..decoding.sampling import LIMITS, SamplingParams

    kwargs = {k: getattr(args, k) for k in LIMITS if getattr(args, k, None) is not None}
    if "stop" in kwargs:
        kwargs["stop"] = [process_escapes(s, flag="--stop") for s in kwargs["stop"]]
    SamplingParams.from_kwargs(**kwargs)  # raises ValueError with the option's name
    return kwargs


def read_prompt(arg: str | None) -> str:
    """The prompt argument, or stdin when it is omitted or '-' (one trailing newline dropped)."""
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


def parse_list(text: str, kind: type, flag: str) -> list:
    """'0.5,0.9' -> [0.5, 0.9]; a one-line ValueError naming the flag otherwise."""
    try:
        out = [kind(x.strip()) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag}: expected a comma-separated list of {kind.__name__}, got {text!r}") from None
    if not out:
        raise ValueError(f"{flag}: empty list")
    return out


def parse_modes(text: str | None, flag: str = "--modes") -> list[str] | None:
    """A comma-separated list of registered modes (None: not given, i.e. every mode), each checked
    against the registry; a one-line ValueError naming the flag otherwise."""
    if text is None:
        return None
    from ..decoding import get_mode

    modes = parse_list(text, str, flag)
    for m in modes:
        try:
            get_mode(m)
        except ValueError as e:
            raise ValueError(f"{flag}: {str(e).split(': ', 1)[1]}") from None
    return modes
