"""clover itself: every decoding mode of this run, eager and (with `compiled`) `compile="static"`."""

from __future__ import annotations

import time

from .base import STATIC_SUFFIX, Engine, Runner
from ..common import timed


class CloverRunner(Runner):
    engine = "clover"
    batches = True

    def __init__(self, llm, mode: str, n: int, *, warm_batch: list | None = None, to_eos: bool = False) -> None:
        self.llm, self.mode, self.n, self.to_eos = llm, mode, n, to_eos
        self.variant = mode + (STATIC_SUFFIX if llm.model.static_steps is not None else "")
        self.warm_batch = warm_batch  # compiled steps: build the batch's graphs before timing

    def _kw(self, n: int) -> dict:
        return {"mode": self.mode, "max_new_tokens": n, "ignore_eos": not self.to_eos}

    def warm(self, ids):
        self.llm.generate(ids, **self._kw(min(self.n, 2 * self.llm.config.block_size)))
        if self.warm_batch:
            self.llm.generate(self.warm_batch, **self._kw(self.n))

    def _timed(self, fn):
        c0 = time.process_time()
        out = timed(fn, self.llm.model.device)
        self.cpu_seconds = time.process_time() - c0
        return out

    def one(self, ids):
        gen, s = self._timed(lambda: self.llm.generate(ids, **self._kw(self.n)))
        self.forwards = gen.stats.forwards
        self.accepts = list(gen.stats.accept_lengths) or None
        return list(gen.token_ids), len(gen.token_ids), s

    def many(self, prompts):
        gens, s = self._timed(lambda: self.llm.generate(prompts, **self._kw(self.n)))
        return sum(len(g.token_ids) for g in gens), s, [list(g.token_ids) for g in gens]



class CloverEngine(Engine):
    name = "clover"
    causal = False  # every mode the model runs

    @staticmethod
    def find(config, **_) -> dict:
        import clover

        return {"available": True, "version": clover.__version__, "note": None}

    def runners(self, threads):
        st = self.setup
        out = [CloverRunner(st.llm, m, st.max_new_tokens, to_eos=st.to_eos) for m in st.modes]
        if st.static_llm is not None:
            out += [CloverRunner(st.static_llm, m, st.max_new_tokens, warm_batch=st.batch_ids if st.batch_rounds else None,
                                 to_eos=st.to_eos) for m in st.modes]
        return out
