"""Drive `llama-clover`, the llama.cpp/ggml port of Clover's decoding (ports/llama.cpp,
docs/llama-port.md), from Python.

The port is a separate program built by `PORT=1 scripts/build-llama-cpp.sh` into the llama.cpp cache
dir. It reads a GGUF export (`clover export-gguf`, plus its `.clover.gguf` sidecar). Two ways in:
- `run`: prompts as token ids on stdin, the options as command-line flags (`port_args`), one JSON
  result line per prompt (what the tests and benchmarks use);
- `PortProcess`: one long-lived `llama-clover --json` process; each request is a JSON line with the
  prompt (token ids, text or chat messages) and clover's option names (`port_options`), answered by
  `commit` events as blocks commit (when streaming) and a `done` line. `generate` and the server's
  engine (`PortEngine`, `clover serve --engine llama.cpp`) use it.

Every option of `clover generate` maps onto the port (`port_options`); the modes it runs are `MODES`
(dflash with the DFlash drafter as a GGUF of its own, `--drafter FILE`: `export_drafter`), on a Llama
target `LLAMA_MODES` (`modes_for`; the others are refused here, before the port starts).
The port samples with its own generator, so a seed gives a different (equally distributed) draw
than clover's torch generator.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from dataclasses import fields
from pathlib import Path
from typing import Iterator

import numpy as np
from ..paths import user_cache
from ..serve.defaults import MAX_BATCH as MAX_PARALLEL  # the server's batch: the rows the port decodes together

MODES = ("ar", "diffusion", "speculative", "dflash")
LLAMA_MODES = ("ar", "dflash")  # on a Llama target (arch llama): no Clover tensors (its denoise adapter is not ported)
OTHER_MODES = {  # clover's other modes: why the port does not run them
    "naive": "naive is diffusion without the cache (the uncached baseline); the port always caches: use mode diffusion (the same tokens)",
}
NO_DRAFTER = ("dflash needs its drafter as a GGUF (`clover export-gguf DRAFTER_DIR FILE`, the port's --drafter FILE), "
              "and none was given; or use mode speculative (the model drafts itself)")
OPTIONS = ("max_new_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos",
           "repetition_penalty", "presence_penalty", "eos_penalty", "no_repeat_ngram_size", "block_size", "threshold",
           "confidence", "policy", "fallback", "factor", "low_threshold", "entropy_budget", "sub_block", "expert_budget",
           "expert_rank", "draft_length", "logit_bias")  # SamplingParams' fields, the names of the port's JSON requests
NOT_IN_PORT = {  # clover's options the port does not run: why (refused when set)
    "skip_window": "the port computes every block position (clover's exact path)",
    "skip_decoded": "the port computes every block position (clover's exact path)",
    "frequency_penalty": "the port applies presence_penalty and repetition_penalty, not counts",
    "steps": "the port has neither the canvas mode nor diffusion's quota fallback (SDAR / LLaDA2's rule)",
    "canvas_cache": "the port has no canvas mode (whole-sequence diffusion)",
    "canvas_threshold": "the port has no canvas mode (whole-sequence diffusion)",
    "cfg_scale": "the port has no canvas mode (whole-sequence diffusion)",
    "canvas_ties": "the port has no canvas mode (whole-sequence diffusion)",
}
FLAGS = {"max_new_tokens": "-n", "block_size": "--block", "draft_length": "--draft", "no_repeat_ngram_size": "--no-repeat-ngram",
         "stop_token_ids": "--stop-ids"}


def llama_cache_dir() -> Path:
    """The cache dir of scripts/build-llama-cpp.sh."""
    return user_cache("llama.cpp", env="CLOVER_LLAMA_CPP_DIR")


def port_binary() -> Path:
    return llama_cache_dir() / "bin" / "llama-clover"


def require_port() -> Path:
    b = port_binary()
    if not b.exists():
        raise FileNotFoundError(f"llama-clover not built ({b} not found): run PORT=1 scripts/build-llama-cpp.sh")
    return b


def modes_for(config) -> tuple[str, ...]:
    """The modes the port runs on a model of `config`: a Llama's `LLAMA_MODES`, Clover's `MODES`."""
    from ..gguf.names import LLAMA, table_for

    return LLAMA_MODES if table_for(config) is LLAMA else MODES


def check_mode(mode: str, drafter=None, config=None) -> None:
    """ValueError (one line, with the reason) for a mode the port does not run (on a model of `config`
    when given: `modes_for`); dflash needs `drafter`, the drafter's GGUF."""
    if mode in OTHER_MODES:
        raise ValueError(f"mode: {OTHER_MODES[mode]}")
    modes = MODES if config is None else modes_for(config)
    if mode not in modes:
        on = " on a Llama target (its denoise adapter is not ported)" if modes == LLAMA_MODES else ""
        raise ValueError(f"mode: the llama.cpp port runs {', '.join(modes)}{on}, got {mode!r}")
    if mode == "dflash" and drafter is None:
        raise ValueError(f"mode: {NO_DRAFTER}")


def port_options(mode: str, params, *, drafter=None, config=None) -> dict:
    """`SamplingParams` (with the model's defaults filled in, `LLM.params`) -> the port's request
    options (clover's names). ValueError for a mode the port does not run (on a model of `config` when
    given; dflash without `drafter`, the drafter GGUF the port process was given)."""
    check_mode(mode, drafter, config)
    known = {f.name for f in fields(params)}
    for name, why in NOT_IN_PORT.items():
        if getattr(params, name, False):
            raise ValueError(f"{name}: not in the llama.cpp port ({why})")
    missing = known - set(OPTIONS) - set(NOT_IN_PORT)
    if missing:  # an option added to clover that the port does not know yet: refuse it when it is set
        from ..decoding.sampling import SamplingParams

        default = SamplingParams()
        for name in sorted(missing):
            if getattr(params, name) != getattr(default, name):
                raise ValueError(f"{name}: not supported by the llama.cpp port yet")
    if mode in ("speculative", "dflash") and params.temperature != 0:
        raise ValueError(f"temperature: sampled {mode} decoding (the rejection rule) is not in the llama.cpp port; "
                         "use temperature 0, or mode ar or diffusion to sample")
    out = {"mode": mode}
    out.update({k: getattr(params, k) for k in OPTIONS if k in known})
    if out.get("logit_bias"):
        out["logit_bias"] = {str(k): v for k, v in out["logit_bias"].items()}
    return out


def port_args(mode: str, params, *, drafter=None, config=None) -> list[str]:
    """The same as command-line flags of `llama-clover` (`--drafter FILE` when given: dflash needs it;
    `config` as `port_options`)."""
    a = ["--mode", mode]
    for k, v in port_options(mode, params, drafter=drafter, config=config).items():
        if k == "mode" or v is None or (k == "stop_token_ids" and not v):
            continue
        if k == "logit_bias":
            a += ["--logit-bias", json.dumps(v)]
            continue
        flag = FLAGS.get(k, "--" + k.replace("_", "-"))
        if k == "stop":
            for s in v:
                a += ["--stop", s]
        elif k == "stop_token_ids":
            a += [flag, ",".join(map(str, v))]
        elif isinstance(v, bool):
            if v:
                a.append(flag)
        else:
            a += [flag, repr(v) if isinstance(v, float) else str(v)]
    if drafter is not None:
        a += ["--drafter", str(drafter)]
    return a


def run(gguf: str | os.PathLike, prompts: list[list[int]], args: list[str], *, eos_ids=None, threads: int = 1,
        binary: str | os.PathLike | None = None, timeout: float | None = None, parallel: int = 1) -> list[dict]:
    """Run llama-clover on `prompts` (token ids) with flags `args` (`port_args`); one dict per prompt:
    tokens, n_tokens, text, forwards, tokens_per_forward, seconds, tokens_per_second, finish,
    block_steps, forced_steps, accept_lengths (and batch_rows with `parallel` > 1: up to that many
    prompts decoded together, their rows in one forward). `eos_ids` overrides the GGUF's EOS id."""
    cmd = [str(binary or require_port()), str(gguf), *args, "--threads", str(threads)]
    if parallel > 1:
        cmd += ["--parallel", str(parallel)]
    if eos_ids:
        cmd += ["--eos", ",".join(map(str, eos_ids))]
    stdin = "".join(" ".join(map(str, p)) + "\n" for p in prompts)
    r = subprocess.run(cmd, input=stdin.encode(), capture_output=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"llama-clover failed ({r.returncode}): {r.stderr.decode()[-2000:]}")
    out = [json.loads(line) for line in r.stdout.decode().splitlines() if line.strip()]
    if len(out) != len(prompts):
        raise RuntimeError(f"llama-clover answered {len(out)} of {len(prompts)} prompts")
    return out


def forward_logits(gguf: str | os.PathLike, commit: list[int], block: list[int], out: str | os.PathLike, *,
                   threads: int = 1, binary: str | os.PathLike | None = None, args=()) -> np.ndarray:
    """One port forward from an empty cache: `commit` committed, `block` denoised (`args`: more port
    flags, e.g. `--matmul ggml`). Returns f32 logits [len(commit) + len(block), V]: every commit
    position, then every block position."""
    cmd = [str(binary or require_port()), str(gguf), "--mode", "forward", "--out", str(out), "--threads", str(threads),
           *args]
    stdin = " ".join(map(str, commit)) + "\n" + " ".join(map(str, block)) + "\n"
    r = subprocess.run(cmd, input=stdin.encode(), capture_output=True)
    if r.returncode != 0:
        raise RuntimeError(f"llama-clover failed ({r.returncode}): {r.stderr.decode()[-2000:]}")
    info = json.loads(r.stdout.decode())
    return np.fromfile(out, dtype=np.float32).reshape(info["rows"], info["vocab"])


class PortProcess:
    """One `llama-clover --json` process: requests in, events out. With `parallel` > 1 it decodes up to
    that many requests together (ar, diffusion and speculative rows in one forward; the others alone, between
    batches), their events interleaved; `request` still sends one and reads its events to the end."""

    def __init__(self, gguf: str | os.PathLike, *, threads: int = 1, eos_ids=None,
                 binary: str | os.PathLike | None = None, drafter: str | os.PathLike | None = None,
                 parallel: int = 1) -> None:
        cmd = [str(binary or require_port()), str(gguf), "--json", "--threads", str(threads)]
        if parallel > 1:
            cmd += ["--parallel", str(parallel)]
        if eos_ids:
            cmd += ["--eos", ",".join(map(str, sorted(eos_ids)))]
        if drafter is not None:  # mode dflash's drafter GGUF
            cmd += ["--drafter", str(drafter)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, encoding="utf-8", bufsize=1)
        self.lock = threading.Lock()
        self._n = 0

    def send(self, request: dict) -> int:
        """Queue one request (its prompt: token ids, text or `messages`); returns its id."""
        self._n += 1
        self.proc.stdin.write(json.dumps({**request, "id": self._n}) + "\n")
        self.proc.stdin.flush()
        return self._n

    def cancel(self, rid: int) -> None:
        """Stop request `rid` before its next forward (its `done` line then says finish "abort")."""
        self.proc.stdin.write(json.dumps({"cancel": rid}) + "\n")
        self.proc.stdin.flush()

    def event(self) -> dict:
        """The next output line: {"event": "commit" | "done" | "error", "id", ...}."""
        line = self.proc.stdout.readline()
        if not line:
            err = self.proc.stderr.read()[-2000:] if self.proc.poll() is not None else ""
            raise RuntimeError(f"llama-clover stopped ({self.proc.poll()}): {err}")
        return json.loads(line)

    def request(self, request: dict) -> Iterator[dict]:
        """Send one request and yield its events up to its `done` line (an `error` line raises ValueError)."""
        with self.lock:
            self.send(request)
            while True:
                ev = self.event()
                if ev["event"] == "error":
                    raise ValueError(ev["message"])
                yield ev
                if ev["event"] == "done":
                    return

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "PortProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def export_for_port(llm, directory: str | os.PathLike) -> Path:
    """The model's f32 GGUF export (with the sidecar) in `directory`."""
    from ..gguf.write import export_gguf

    gguf = Path(directory) / "model.gguf"
    export_gguf(llm.path, gguf, dtype="f32", progress=False)
    return gguf


def export_drafter(llm, directory: str | os.PathLike, *, dtype: str = "f32") -> Path | None:
    """The model's DFlash drafter (`llm.drafter`) as a GGUF in `directory` (the port's `--drafter`; f32
    unless `dtype`), or None when the model has none."""
    from ..gguf.write import export_drafter_gguf

    if llm.drafter is None:
        return None
    path = Path(directory) / f"drafter-{dtype}.gguf"
    export_drafter_gguf(llm.drafter, path, dtype=dtype, target=llm.model)
    return path


def generate(llm, prompt, mode: str, kwargs: dict, *, gguf: str | os.PathLike | None = None, threads: int = 1,
             on_text=None, drafter: str | os.PathLike | None = None) -> dict:
    """One prompt through the port with the options of `clover generate` (`kwargs`, the model's
    defaults filled in as `LLM.generate` does). The prompt goes as clover's token ids (its tokenizer
    is exact; the port tokenizes text itself when given text); the text is the port's. Without `gguf`
    the model is exported (f32) to a temporary file first; mode dflash without `drafter` (a drafter
    GGUF) exports the model's drafter there too. `on_text(delta)` gets the text as blocks commit.
    Returns {text, token_ids, finish_reason, stats, streamed (the text given to on_text)}."""
    import tempfile

    mode = llm.mode(mode)
    params = llm.params(mode, kwargs)
    ids = llm.encode_prompt(prompt)
    llm.check_length(len(ids), params, mode)
    streamed = ""
    with tempfile.TemporaryDirectory() as tmp:
        if mode.name == "dflash" and drafter is None:
            drafter = export_drafter(llm, tmp)
        req = {"prompt": ids, "stream": on_text is not None, **port_options(mode.name, params, drafter=drafter, config=llm.config)}
        path = gguf or export_for_port(llm, tmp)
        with PortProcess(path, threads=threads, eos_ids=llm.eos_ids(), drafter=drafter) as port:
            for ev in port.request(req):
                if ev["event"] == "commit" and on_text and ev["text"]:
                    on_text(ev["text"])
                    streamed += ev["text"]
                r = ev
    stats = {k: r[k] for k in ("forwards", "tokens_per_forward", "seconds", "tokens_per_second", "block_steps",
                               "forced_steps", "accept_lengths", "draft_forwards", "width_why", "step_costs") if k in r}
    stats.update(prompt_tokens=len(ids), tokens=r["n_tokens"])
    return {"text": r["text"], "token_ids": r["tokens"], "finish_reason": r["finish"], "stats": stats, "streamed": streamed}


# ------------------------------------------------------------------ the server's engine
class PortEngine:
    """The llama.cpp port as a decoding engine of clover's server (`LLM.engine`'s interface:
    `add(row)`, `step()`, `rows`, `cancel(row)`; events as clover's engines yield them). Rows are
    requests to one shared `llama-clover --json --parallel N` process, which decodes the rows in flight
    together (ar, diffusion and speculative rows of every engine in one forward; dflash rows alone,
    between batches); each streamed block becomes a "commit" event, applied to the row with
    `RowState.accept` (which reproduces the port's own EOS / stop / length decision)."""

    def __init__(self, backend: "PortBackend", mode: str, config=None) -> None:  # mode: its name
        self.backend, self.mode, self.config = backend, mode, config  # config: the model's (`port_options`)
        self.rows: list = []
        self.events: list = []  # events routed here by the backend, not yet returned

    def __len__(self) -> int:
        return len(self.rows)

    def add(self, row) -> list:
        from ..decoding.base import DecodeEvent

        if getattr(row, "constraint", None) is not None:
            raise ValueError("response_format: structured output (a grammar) is not in the llama.cpp port; "
                             "serve with --engine torch for it")
        if row.params.max_new_tokens == 0:
            row._finish("length")
            return [DecodeEvent("finish", -1, [], [], row_state=row)]
        req = {"prompt": list(row.prompt), "stream": True, "eos_token_ids": sorted(row.eos_ids),
               **port_options(self.mode, row.params, drafter=self.backend.drafter, config=self.config)}
        self.backend.send(self, row, req)
        self.rows.append(row)
        return []

    def cancel(self, row, reason: str = "abort") -> None:
        row.cancel(reason)
        self.backend.cancel(row)
        self.rows = [r for r in self.rows if r is not row]

    def step(self) -> list:
        while not self.events and self.rows:
            self.backend.read_one()
        out, self.events = self.events, []
        return out

    def run(self):
        while self.rows:
            yield from self.step()

    def on_event(self, row, ev: dict) -> None:
        from ..decoding.base import DecodeEvent

        if row.finished and row not in self.rows:
            return  # cancelled: what the port still sends is dropped
        i = self.rows.index(row)
        if ev["event"] == "error":
            raise RuntimeError(f"llama-clover: {ev['message']}")
        if ev["event"] == "commit":
            kept = row.accept(list(ev["tokens"]), [1] * len(ev["tokens"]))
            if kept:
                self.events.append(DecodeEvent("commit", i, kept, [1] * len(kept), row_state=row))
            return
        row.forwards = ev["forwards"]
        row.block_steps = list(ev["block_steps"])
        row.forced_steps = ev["forced_steps"]
        row.accept_lengths = list(ev["accept_lengths"])
        row.draft_forwards = ev.get("draft_forwards", 0)
        if not row.finished:
            row._finish(ev["finish"])
        self.events.append(DecodeEvent("finish", i, [], [], row_state=row))
        self.rows.remove(row)


class PortBackend:
    """One `llama-clover --json` process shared by the server's engines; routes its events by request id."""

    def __init__(self, gguf, *, threads: int = 1, eos_ids=None, binary=None, drafter=None, parallel: int = 1) -> None:
        self.drafter = drafter  # the process's --drafter GGUF (mode dflash), or None
        self.proc = PortProcess(gguf, threads=threads, eos_ids=eos_ids, binary=binary, drafter=drafter, parallel=parallel)
        self.owner: dict[int, tuple] = {}

    def send(self, engine: PortEngine, row, req: dict) -> None:
        rid = self.proc.send(req)
        self.owner[rid] = (engine, row)
        row.state = rid

    def cancel(self, row) -> None:
        if row.state in self.owner:
            self.proc.cancel(row.state)

    def read_one(self) -> None:
        ev = self.proc.event()
        engine, row = self.owner.get(ev.get("id"), (None, None))
        if engine is None:
            raise RuntimeError(f"llama-clover answered an unknown request: {ev}")
        if ev["event"] != "commit":
            del self.owner[ev["id"]]
        engine.on_event(row, ev)

    def close(self) -> None:
        self.proc.close()


class PortLLM:
    """An `LLM` whose engines are the llama.cpp port (`clover serve --engine llama.cpp`): the same
    tokenizer, options, limits and errors; generation goes through `PortEngine`. `parallel`: the rows
    the port decodes together (the server's batch, `--max-batch`)."""

    def __init__(self, llm, gguf, *, threads: int = 1, binary=None, drafter=None, parallel: int = MAX_PARALLEL) -> None:
        self._llm = llm
        self.backend = PortBackend(gguf, threads=threads, eos_ids=llm.eos_ids(), binary=binary, drafter=drafter,
                                   parallel=parallel)

    def __getattr__(self, name):
        return getattr(self._llm, name)

    from ..api import LLM as _LLM

    generate, stream, _events = _LLM.generate, _LLM.stream, _LLM._events  # clover's API, on the port's engines
    del _LLM

    def params(self, mode, kwargs: dict):
        """clover's options, checked, and refused here when the port lacks them (a 400 in the server)."""
        name = self._llm.mode(mode).name
        check_mode(name, self.backend.drafter, self._llm.config)
        params = self._llm.params(mode, kwargs)
        port_options(name, params, drafter=self.backend.drafter, config=self._llm.config)
        return params

    def engine(self, spec) -> PortEngine:
        """The engine for rows of `spec` (`Mode.spec`): all share the one port process."""
        if spec.provisional:
            raise ValueError("provisional: the llama.cpp engine streams committed blocks only")
        check_mode(spec.mode.name, self.backend.drafter, self._llm.config)
        return PortEngine(self.backend, spec.mode.name, self._llm.config)

    def close(self) -> None:
        self.backend.close()


def port_llm(llm, stack, *, gguf=None, threads: int = 1, parallel: int = MAX_PARALLEL) -> PortLLM:
    """`llm` served through the port: `gguf`, or the model exported (f32) into a temporary directory
    that `stack` (a contextlib.ExitStack) removes, as it closes the port process; the model's drafter
    (if it has one, for mode dflash) is exported there too. `parallel`: the rows decoded together."""
    import tempfile

    require_port()
    tmp = stack.enter_context(tempfile.TemporaryDirectory())
    path = gguf or export_for_port(llm, tmp)
    out = PortLLM(llm, path, threads=threads, drafter=export_drafter(llm, tmp), parallel=parallel)
    stack.callback(out.close)
    return out
