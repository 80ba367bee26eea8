"""llama-clover, the llama.cpp port of Clover's own modes, on a GGUF export with the `.clover.gguf` sidecar; on a
Llama model (clover-smol) its ar and dflash on the `llama` GGUF export (the stock converter's tensors)."""

from __future__ import annotations

import os
from pathlib import Path

from .base import Engine, Runner


def _llama_clover(directory: Path, config) -> dict:
    exe = directory / "bin" / "llama-clover"
    if not (exe.is_file() and os.access(exe, os.X_OK)):
        return {"available": False, "note": f"the llama.cpp port is not built ({exe}): PORT=1 scripts/build-llama-cpp.sh"}
    from ...integrations.llama_port import LLAMA_MODES, modes_for

    llama = modes_for(config) == LLAMA_MODES
    if not llama and (not config.is_clover or config.mask_token_id is None):
        return {"available": False, "note": "an AR checkpoint: the port's diffusion needs Clover's tensors and mask token"}
    note = f"a Llama target: the port runs {' and '.join(LLAMA_MODES)}" if llama else None
    return {"available": True, "binary": str(exe), "note": note}



class PortRunner(Runner):
    """llama-clover (the llama.cpp port) in one mode with the model's default options, one prompt per
    process; seconds = the port's clock over its decode loop (prefill included, as clover's)."""

    engine = "llama-clover"

    def __init__(self, llm, exe: str, gguf: Path, mode: str, threads: int, n: int, drafter: Path | None = None,
                 to_eos: bool = False) -> None:
        from ...integrations.llama_port import port_args

        self.exe, self.gguf, self.threads, self.n, self.variant = exe, gguf, threads, n, mode
        self.args = lambda n: port_args(mode, llm.params(mode, {"max_new_tokens": n, "ignore_eos": not to_eos}),
                                        drafter=drafter, config=llm.config)
        self.eos = sorted(llm.eos_ids())

    def _run(self, ids, n):
        from ...integrations.llama_port import run

        return run(self.gguf, [ids], self.args(n), eos_ids=self.eos, threads=self.threads, binary=self.exe,
                   timeout=1200)[0]

    def warm(self, ids):
        self._run(ids, min(self.n, 8))

    def one(self, ids):
        r = self._run(ids, self.n)
        self.forwards = r["forwards"]
        self.accepts = r["accept_lengths"] or None  # dflash: tokens kept per verify
        return list(r["tokens"]), r["n_tokens"], r["seconds"]



class PortEngine(Engine):
    name = "llama-clover"
    fails = "GGUF export failed"

    @staticmethod
    def find(config, *, llama_dir, **_) -> dict:
        return _llama_clover(llama_dir, config)

    def prepare(self):
        self.setup.say("llama-clover: exporting GGUF with the Clover sidecar")
        from . import gguf_file  # looked up on the package at call time: tests stand a fake export in

        self.gguf = gguf_file(self.setup.src, self.setup.work, self.setup.gguf, clover_tensors="sidecar")
        self.found["gguf"] = str(self.gguf)

    def runners(self, threads):
        from ...integrations.llama_port import export_drafter, modes_for

        st = self.setup
        # dflash: the model's drafter as a GGUF of the port's own (in a folder of its own: llama.cpp-dflash's
        # converted drafter has the same name), in the GGUF type (no drafter: no dflash row)
        drafter = export_drafter(st.llm, st.work / "llama-clover", dtype=st.gguf) if "dflash" in st.modes else None
        runs = modes_for(st.config)
        return [PortRunner(st.llm, self.found["binary"], self.gguf, m, threads, st.max_new_tokens, drafter=drafter,
                           to_eos=st.to_eos)
                for m in st.modes if m in runs and (m != "dflash" or drafter is not None)]
