"""z-lab's `dflash` package (PyPI `dflash`, its transformers backend: `dflash.model.dflash_generate`) on
the same target and drafter, in an interpreter that has it (`$CLOVER_DFLASH_PYTHON`, else this one),
as a worker process fed prompt ids on stdin.

The target is the transformers directory of `drafted.target_hf_dir` (its mask token's input row set to
the vector the drafter was trained on); the drafter is z-lab's layout as clover saves it. z-lab's
package has no reduced draft vocabulary: it drafts over the target's whole head (variant
`dflash_generate`, the package as published; the `d2t` tensor is left unread). Variant `+d2t` changes
one thing, the drafter's `compute_logits`, to score only the drafter's own vocabulary as clover does,
so its drafts are clover's. Seconds: the `dflash_generate` call (prefill + decode), as clover's; its
`return_stats` clock (`_cuda_time`, which synchronises CUDA) is swapped for a plain one on the CPU."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .base import Engine, WorkerRunner, interpreter_with

VERSION = "import importlib.metadata as m, sys; import dflash.model; sys.stdout.write(m.version('dflash'))"
WORKER = Path(__file__).with_name("dflash_worker.py")  # run as a script: it imports nothing from clover


def _find() -> dict:
    return interpreter_with(os.environ.get("CLOVER_DFLASH_PYTHON") or sys.executable, VERSION, module="dflash",
                            missing="z-lab's dflash (pip install dflash, or $CLOVER_DFLASH_PYTHON: an interpreter "
                                    "that has it) is not importable")


class ZlabRunner(WorkerRunner):
    """`dflash_generate` in a worker process (`dflash_worker.py`; one per thread count and variant)."""

    engine = "z-lab dflash"
    what = "z-lab dflash worker"

    def __init__(self, python: str, target: Path, draft: Path, dtype: str, threads: int, n: int, stop: list[int] | None,
                 with_d2t: bool, timeout: float = 900) -> None:
        self.n, self.stop, self.timeout = n, stop, timeout
        self.variant = "dflash_generate" + ("+d2t" if with_d2t else "")
        self.start([python, str(WORKER), str(target), str(draft), dtype, str(threads), "1" if with_d2t else "0"],
                   dict(os.environ, OMP_NUM_THREADS=str(threads)))

    def one(self, ids):
        r = self.ask({"ids": ids, "n": self.n, "stop": self.stop})
        out = r["token_ids"]
        if self.stop and out and out[-1] in self.stop:
            out = out[:-1]  # answers exclude the EOS, as clover's
        self.accepts = r["accepts"] or None
        return out, len(out), r["seconds"]


class ZlabEngine(Engine):
    name = "z-lab dflash"
    fails = "failed to start"

    @staticmethod
    def find(config, **_) -> dict:
        return _find()

    def prepare(self):
        from .drafted import drafter_of, target_hf_dir, zlab_drafter_dir

        st = self.setup
        self.d2t = drafter_of(st).config.draft_vocab_size is not None
        self.target, self.draft = target_hf_dir(st), zlab_drafter_dir(st)

    def runners(self, threads):
        st = self.setup
        st.say(f"z-lab dflash: starting ({threads} threads)")
        stop = sorted(st.llm.eos_ids()) if st.to_eos else None
        return [ZlabRunner(self.found["python"], self.target, self.draft, st.dtype, threads, st.max_new_tokens, stop, d)
                for d in ([False, True] if self.d2t else [False])]
