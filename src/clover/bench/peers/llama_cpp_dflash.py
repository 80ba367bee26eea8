"""Stock llama.cpp with the model's DFlash drafter: `llama-speculative-simple --spec-type draft-dflash`
on GGUFs made by llama.cpp's own `convert_hf_to_gguf.py` (the target from its transformers directory,
the drafter from `clover.export.drafter`'s layout with `--target-model-dir`), and stock AR greedy on
the same target GGUF (`clover-llama-probe greedy`).

Seconds are llama.cpp's own decode clock for both rows (prefill excluded; clover's include it):
llama-speculative-simple's "decoded N tokens in S seconds", and wall(greedy K) - wall(greedy 0) for
the probe. llama-speculative-simple takes its prompt as text (the chat-templated prompt, special
tokens parsed: the same ids as clover's for SmolLM2's template) and prints the answer as text: its
tokens here are that text encoded again by clover's tokenizer, so "= AR" compares text. Answers
exclude the EOS, as clover's. Tokens per verify: n_predict / (n_predict - n_accept), one verify per
loop (it prints only the totals)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import torch

from .base import Engine, Runner

SPEC = "llama-speculative-simple"


def _converter(directory: Path) -> Path | None:
    found = sorted(directory.glob("src/*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    return found[-1] if found else None


def _find(directory: Path) -> dict:
    spec, probe = directory / "build" / "bin" / SPEC, directory / "bin" / "clover-llama-probe"
    if not (spec.is_file() and os.access(spec, os.X_OK)):
        return {"available": False, "note": f"no {spec} (scripts/build-llama-cpp.sh builds it)"}
    conv = _converter(directory)
    if conv is None:
        return {"available": False, "note": f"no llama.cpp source with convert_hf_to_gguf.py under {directory / 'src'}"}
    ready = directory / "bin" / "READY"
    return {"available": True, "version": ready.read_text().strip() if ready.is_file() else None, "binary": str(spec),
            "probe": str(probe) if probe.is_file() else None, "converter": str(conv),
            "note": None if probe.is_file() else f"no {probe}: the stock AR row is skipped"}


def convert(converter: str, hf_dir: Path, out: Path, *, outtype: str, target_dir: Path | None = None) -> Path:
    """llama.cpp's own `convert_hf_to_gguf.py` (in this interpreter), reused while newer than its input."""
    newest = max(p.stat().st_mtime for p in hf_dir.iterdir())
    if out.is_file() and out.stat().st_mtime > newest:
        return out
    cmd = [sys.executable, converter, str(hf_dir), "--outtype", outtype, "--outfile", str(out)]
    if target_dir is not None:
        cmd += ["--target-model-dir", str(target_dir)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["?"])[-1]
        hint = " (pip install sentencepiece: the converter's Llama vocabulary imports it)" if "sentencepiece" in tail else ""
        raise RuntimeError(f"convert_hf_to_gguf.py {hf_dir.name}: {tail}{hint}")
    return out


class SpecDFlashRunner(Runner):
    """llama-speculative-simple with the drafter, greedy, one process per prompt."""

    engine = "llama.cpp-dflash"
    variant = "speculative-simple draft-dflash"

    def __init__(self, exe: str, gguf: Path, draft: Path, llm, threads: int, n: int, draft_max: int, work: Path,
                 to_eos: bool) -> None:
        self.exe, self.gguf, self.draft, self.llm, self.n, self.work = exe, gguf, draft, llm, n, work
        self.threads, self.draft_max, self.to_eos = threads, draft_max, to_eos

    def _run(self, ids, n):
        text = self.llm.tokenizer.decode(ids, skip_special_tokens=False)
        prompt = self.work / "llama-dflash-prompt.txt"
        prompt.write_text(text, encoding="utf-8")
        cmd = [self.exe, "-m", str(self.gguf), "-md", str(self.draft), "--spec-type", "draft-dflash",
               "--spec-draft-n-max", str(self.draft_max), "-f", str(prompt), "-n", str(n), "-t", str(self.threads),
               "-td", str(self.threads), "--temp", "0", "-c", str(len(ids) + n + 64)]
        if not self.to_eos:
            cmd += ["--ignore-eos"]
        r = subprocess.run(cmd, capture_output=True, env=dict(os.environ, OMP_NUM_THREADS=str(self.threads)),
                           timeout=1200)
        out, err = r.stdout.decode(errors="replace"), r.stderr.decode(errors="replace")
        if r.returncode != 0:
            raise RuntimeError(f"{SPEC} failed ({r.returncode}): {err.strip()[-300:]}")
        stat = {k: float(v) for k, v in re.findall(r"(n_predict|n_accept|n_drafted)\s*=\s*([\d.]+)", err)}
        dec = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", err)
        if dec is None or "n_predict" not in stat:
            raise RuntimeError(f"{SPEC} printed no statistics: {err.strip()[-300:]}")
        head = "\n\n" + text
        if not out.startswith(head):
            raise RuntimeError(f"{SPEC} echoed another prompt than it was given")
        answer = out[len(head):].removesuffix("\n\n\n\n")
        return answer, stat, float(dec.group(2))

    def warm(self, ids):
        self._run(ids, 8)

    def one(self, ids):
        answer, stat, s = self._run(ids, self.n)
        toks = self.llm.tokenizer.encode(answer) if answer else []
        n_pred, n_acc = int(stat["n_predict"]), int(stat.get("n_accept", 0))
        verifies = n_pred - n_acc
        self.accepts = [n_pred / verifies] * verifies if verifies > 0 else None  # only the mean is printed
        return toks, len(toks), s


class ProbeARRunner(Runner):
    """Stock llama.cpp AR greedy on the converted target (`clover-llama-probe greedy`): decode seconds =
    wall(greedy K) - wall(greedy 0); to EOS, K is where the first greedy run met an EOS."""

    engine = "llama.cpp-dflash"
    variant = "probe greedy (AR)"

    def __init__(self, probe: str, gguf: Path, threads: int, n: int, eos: list[int], to_eos: bool) -> None:
        self.probe, self.gguf, self.n, self.eos, self.to_eos = probe, gguf, n, eos, to_eos
        self.env = dict(os.environ, CLOVER_PROBE_THREADS=str(threads), OMP_NUM_THREADS=str(threads))

    def _run(self, ids, n, banned):
        t0 = time.perf_counter()
        r = subprocess.run([self.probe, str(self.gguf), "greedy", str(n), *map(str, banned)],
                           input=" ".join(map(str, ids)).encode(), capture_output=True, env=self.env, timeout=1200)
        s = time.perf_counter() - t0
        if r.returncode != 0:
            raise RuntimeError(f"clover-llama-probe failed ({r.returncode}): {r.stderr.decode(errors='replace').strip()[-300:]}")
        return [int(x) for x in r.stdout.split()], s

    def warm(self, ids):
        self._run(ids, 4, [])

    def one(self, ids):
        n, banned = self.n, ([] if self.to_eos else self.eos)
        if self.to_eos:
            first, _ = self._run(ids, n, [])
            stop = next((i for i, t in enumerate(first) if t in self.eos), None)
            n = n if stop is None else stop + 1
        _, base = self._run(ids, 0, banned)
        out, s = self._run(ids, n, banned)
        out = out[:-1] if self.to_eos and out and out[-1] in self.eos else out  # answers exclude the EOS, as clover's
        return out, len(out), max(s - base, 1e-9)


class LlamaCppDFlashEngine(Engine):
    name = "llama.cpp-dflash"
    fails = "conversion failed"

    @staticmethod
    def find(config, *, llama_dir, **_) -> dict:
        return _find(llama_dir)

    def prepare(self):
        from ...export.drafter import export_drafter_for_llama_cpp
        from .drafted import drafter_of, target_hf_dir

        st = self.setup
        drafter = drafter_of(st)
        outtype = st.gguf
        st.say("llama.cpp-dflash: converting the target and the drafter with convert_hf_to_gguf.py")
        hf = target_hf_dir(st)
        self.gguf = convert(self.found["converter"], hf, st.work / f"target-{outtype}.gguf", outtype=outtype)
        draft_hf = export_drafter_for_llama_cpp(drafter, st.llm.model, st.work / "dflash-llama-cpp",
                                                dtype=getattr(torch, st.dtype))
        self.draft = convert(self.found["converter"], draft_hf, st.work / f"drafter-{outtype}.gguf", outtype=outtype,
                             target_dir=hf)
        self.draft_max = drafter.config.block_size - 1
        self.found.update(gguf=str(self.gguf), drafter_gguf=str(self.draft))

    def runners(self, threads):
        st = self.setup
        out = [SpecDFlashRunner(self.found["binary"], self.gguf, self.draft, st.llm, threads, st.max_new_tokens,
                                self.draft_max, st.work, st.to_eos)]
        if self.found.get("probe"):
            out.append(ProbeARRunner(self.found["probe"], self.gguf, threads, st.max_new_tokens,
                                     sorted(st.llm.eos_ids()), st.to_eos))
        return out
