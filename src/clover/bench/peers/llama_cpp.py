"""Stock llama.cpp (the build of `scripts/build-llama-cpp.sh`) on a GGUF export: llama-bench, the greedy
probe and llama-batched-bench."""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from pathlib import Path

from .base import Engine, Runner


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



class LlamaCppEngine(Engine):
    name = "llama.cpp"
    fails = "GGUF export failed"

    @staticmethod
    def find(config, *, llama_dir, **_) -> dict:
        return _llama_cpp(llama_dir)

    def prepare(self):
        self.setup.say("llama.cpp: exporting GGUF")
        from . import gguf_file  # looked up on the package at call time: tests stand a fake export in

        self.gguf = gguf_file(self.setup.src, self.setup.work, self.setup.gguf)
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
