"""What every peer engine of `clover bench peers` shares: the `Runner` and `Engine` interfaces, the run's
`Setup`, and the model directories engines load (a transformers directory, a GGUF export)."""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ...models.layers import is_clover_parameter

SCHEMA = "clover.bench.peers/1"
WORKER_MARK = "CLOVER_PEERS "  # the start of a worker's answer lines (`WorkerRunner`)
GGUF_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
GGUF_TYPES = ("f32", "bf16", "f16", "q8_0")  # what --gguf-type may ask of the GGUF engines (default: --dtype's)
STATIC_SUFFIX = "+static"  # clover's variants with compile="static"


def interpreter_with(python: str, code: str, *, module: str, missing: str) -> dict:
    """`find`'s answer for an engine in another interpreter: whether `python` exists and runs `code`
    (which imports `module` and prints its version); `missing` starts the note when it cannot."""
    exe = shutil.which(python) or python
    if not (Path(exe).is_file() and os.access(exe, os.X_OK)):
        return {"available": False, "note": f"{python}: no such interpreter"}
    try:
        r = subprocess.run([exe, "-c", code], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return {"available": False, "note": f"{python}: `import {module}` took over 300 s"}
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["?"])[-1]
        return {"available": False, "note": f"{missing} by {python}: {tail}"}
    return {"available": True, "version": r.stdout.strip(), "python": exe, "note": None}


def llama_cpp_dir() -> Path:
    """Where `scripts/build-llama-cpp.sh` builds llama.cpp (and the port)."""
    from ...integrations.llama_port import llama_cache_dir

    return llama_cache_dir()



def hf_config_dict(config) -> dict:
    """transformers' text config (the backbone's: Qwen3.5, Qwen3.5-MoE, ...) for a clover config."""
    d = config.replace(model_type=config.base_model_type, backbone=None).to_dict()  # the AR config: no Clover keys
    for k in ("auto_map", "torch_dtype"):
        d.pop(k, None)
    return d


def write_hf_head(src: Path, dst: Path, config, *, dtype: str) -> None:
    """`dst`'s HF config.json (`hf_config_dict` in `dtype`) and the tokenizer files of `src`, copied."""
    dst.mkdir(parents=True, exist_ok=True)
    d = hf_config_dict(config)
    d["torch_dtype"] = dtype
    (dst / "config.json").write_text(json.dumps(d, indent=1) + "\n")
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "generation_config.json", "vocab.json",
                                                         "merges.txt", "chat_template.jinja"):
            shutil.copy(f, dst / f.name)


def write_hf_dir(src: Path, dst: Path, config, *, dtype: str, copy: bool = False) -> Path:
    """A transformers-loadable directory for clover checkpoint `src`: an HF config.json, the tokenizer
    files, and the weights — linked (transformers skips clover's extra tensors with a warning) or,
    with `copy`, rewritten without them in `dtype` (for loaders that refuse unknown keys)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    write_hf_head(src, dst, config, dtype=dtype)
    shards = sorted(src.glob("*.safetensors"))
    if not copy:
        for f in shards + sorted(src.glob("*.safetensors.index.json")):
            link = dst / f.name
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(f.resolve())
        return dst
    want = getattr(torch, dtype)
    index = {}
    for i, shard in enumerate(shards):
        out = {}
        with safe_open(str(shard), "pt") as fh:
            for k in fh.keys():
                if is_clover_parameter(k):
                    continue
                t = fh.get_tensor(k)
                out[k] = t.to(want) if t.is_floating_point() else t
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
        save_file(out, str(dst / name), metadata={"format": "pt"})
        index.update({k: name for k in out})
    if len(shards) > 1:
        (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    return dst


def gguf_file(src: Path, workdir: Path, kind: str, *, clover_tensors: str = "none") -> Path:
    """`clover export-gguf` of `src` in `workdir` as GGUF type `kind` (`GGUF_TYPES`, `Setup.gguf`) (AR
    tensors only; `clover_tensors="sidecar"`: plus DST.clover.gguf for the port), reused when newer than
    the weights."""
    from ...gguf.write import export_gguf

    tag = "" if clover_tensors == "none" else "-port"
    dst = workdir / f"{src.resolve().name}-{kind}{tag}.gguf"
    newest = max(p.stat().st_mtime for p in src.glob("*.safetensors"))
    if not (dst.is_file() and dst.stat().st_mtime > newest):
        export_gguf(src, dst, dtype=kind, clover_tensors=clover_tensors, progress=False)
    return dst



class Runner:
    """One engine configuration. `one(ids)` -> (generated ids or None, tokens, seconds) for a runner
    that runs single prompts (`single`); `many(list of ids)` -> (tokens, seconds) or (tokens, seconds,
    each row's generated ids) for one that batches (`batches`)."""

    engine = ""
    variant = ""
    single = True
    batches = False
    accepts: list[int] | None = None  # a drafting runner: tokens kept by each verify of its last `one`
    compare: str | None = None  # a clover mode whose tokens this runner's must equal (a family's reference)
    cpu_seconds: float | None = None  # the CPU seconds of its last `one` / `many`, where it measures them

    def warm(self, ids: list[int]) -> None:
        self.one(ids)

    def one(self, ids: list[int]):
        raise NotImplementedError

    def many(self, prompts: list[list[int]]):
        return None

    def close(self) -> None:
        pass


class WorkerRunner(Runner):
    """A runner whose engine lives in another interpreter: a worker process that reads one JSON
    request per stdin line and answers each (and first its readiness) on a stdout line starting with
    `WORKER_MARK`; other output is skipped. `what` names it in errors."""

    what = "worker"
    timeout = 900.0

    def start(self, cmd: list[str], env: dict) -> None:
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.read()  # ready

    def read(self) -> dict:
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            ready, _, _ = select.select([self.proc.stdout], [], [], 5)
            if not ready:
                if self.proc.poll() is not None:
                    break
                continue
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith(WORKER_MARK):
                return json.loads(line[len(WORKER_MARK):])
        self.close()
        err = self.proc.stderr.read() if self.proc.stderr else ""
        raise RuntimeError(f"{self.what} ended or timed out: {err.strip()[-500:]}")

    def ask(self, request: dict) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()



@dataclass
class Setup:
    """What an engine's preparation and runners read: the run's model, options and work directory."""

    src: Path
    llm: object
    static_llm: object | None
    dtype: str
    work: Path
    max_new_tokens: int
    modes: list[str]  # clover's modes in this run
    batch_ids: list[list[int]]
    batch_rounds: int
    n_ctx: int
    llama_dir: Path
    vllm_python: str | None
    say: Callable[[str], None]
    to_eos: bool = False  # each generation ends at EOS (else exactly max_new_tokens, EOS banned)
    reference: Path | None = None  # the user's checkout of the model family's reference code
    reference_python: str | None = None  # the interpreter that runs it
    gguf_type: str | None = None  # the GGUF engines' weights (`GGUF_TYPES`; None: the dtype's)

    @property
    def config(self):
        return self.llm.config

    @property
    def gguf(self) -> str:
        """The GGUF type the llama.cpp engines run (their target and drafter files)."""
        return self.gguf_type or GGUF_DTYPES[self.dtype]


class Engine:
    """One peer engine: `find` says whether this machine has it (and why not), `prepare` readies it
    once per run (loading a model, exporting a GGUF; what it raises skips the engine with a note
    beginning `fails`), `runners` gives its configurations for a thread count. A new engine is one
    subclass, registered in `ENGINES`."""

    name = ""
    fails = "failed to prepare"
    causal = True  # decodes autoregressively: only a model that clover's ar mode decodes (not SDAR, LLaDA2, Dream)

    def __init__(self, setup: Setup, found: dict) -> None:
        self.setup, self.found = setup, found

    @staticmethod
    def find(config, *, dtype: str, llama_dir: Path, vllm_python: str | None, reference: Path | None = None,
             reference_python: str | None = None) -> dict:
        raise NotImplementedError

    def prepare(self) -> None:
        pass

    def runners(self, threads: int) -> list[Runner]:
        return []
