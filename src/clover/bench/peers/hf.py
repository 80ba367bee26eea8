"""transformers: the backbone's own class on the same safetensors, `generate`, greedy, in this process."""

from __future__ import annotations

import importlib.util

import torch

from .base import Engine, Runner, write_hf_dir
from ..common import timed


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
