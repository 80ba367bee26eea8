"""transformers' built-in DFlash assisted generation (`generate(..., assistant_model=DRAFTER,
speculation_type="dflash")`, its `DFlashTokenCandidateGenerator`), in this process.

The only DFlash drafter class transformers ships is `MuseGlimmerAssistantModel` (a DFlash drafter:
`encoder.fc` + `encoder.output_norm_enc` over the target's layers `target_layer_ids`, Qwen3-style
layers whose keys and values cover the context features and the block, bidirectional in the block,
a final norm; the target's embedding and head). The model's drafter is loaded into it key for key
(`fc` -> `encoder.fc`, `hidden_norm` -> `encoder.output_norm_enc`), every layer full attention.
transformers has no reduced draft vocabulary: its candidates come from the target's whole head (the
`d2t` table is left unread), so its drafts may differ from clover's; verification keeps the text AR's.
The target is `drafted.target_hf_dir` with the mask token's input row set (`dflash_worker.set_mask_row`).
Tokens per verify: the matches each verify kept + 1 (`update_candidate_strategy`'s `num_matches`)."""

from __future__ import annotations

import importlib.util

import torch

from ..common import timed
from .base import Runner
from .hf import TransformersEngine

ASSISTANT = "MuseGlimmerAssistantModel"


def _find() -> dict:
    if importlib.util.find_spec("transformers") is None:
        return {"available": False, "note": "transformers is not installed"}
    import transformers
    from transformers.generation import candidate_generator as cg

    if not hasattr(cg, "DFlashTokenCandidateGenerator") or not hasattr(transformers, ASSISTANT):
        return {"available": False, "note": f"transformers {transformers.__version__} has no DFlash assisted generation "
                                            "(DFlashTokenCandidateGenerator, 5.x)"}
    return {"available": True, "version": transformers.__version__, "note": None}


def assistant_for(drafter, dtype: torch.dtype):
    """transformers' DFlash drafter class holding `drafter`'s weights (module doc)."""
    import transformers

    c = drafter.config
    cfg = transformers.MuseGlimmerAssistantConfig(
        hidden_size=c.hidden_size, intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps, rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
        max_position_embeddings=c.max_position_embeddings, layer_types=["full_attention"] * c.num_hidden_layers,
        block_size=c.block_size, mask_token_id=c.mask_token_id, target_layer_ids=list(c.target_layer_ids),
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = getattr(transformers, ASSISTANT)(cfg)
    rename = {"fc.weight": "encoder.fc.weight", "hidden_norm.weight": "encoder.output_norm_enc.weight"}
    sd = {rename.get(k, k): v.to(dtype) for k, v in drafter.state_dict().items() if k != "d2t"}
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("inv_freq")]
    if missing or unexpected:
        raise RuntimeError(f"{ASSISTANT}: the drafter's keys do not fit (missing {missing[:3]}, unexpected {unexpected[:3]})")
    return model.to(dtype).eval()


class HFDFlashRunner(Runner):
    engine = "transformers-dflash"
    variant = "generate speculation_type=dflash"

    def __init__(self, target, assistant, n: int, eos: list[int] | None, pad_id: int) -> None:
        self.target, self.assistant, self.n, self.eos, self.pad = target, assistant, n, eos, pad_id

    def _gen(self, ids, n):
        from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator as Gen

        matches: list[int] = []
        plain = Gen.update_candidate_strategy
        Gen.update_candidate_strategy = lambda gen, input_ids, scores, num_matches: matches.append(int(num_matches))
        try:
            with torch.inference_mode():
                x = torch.tensor([ids])
                out = self.target.generate(x, attention_mask=torch.ones_like(x), assistant_model=self.assistant,
                                           speculation_type="dflash", do_sample=False, max_new_tokens=n,
                                           min_new_tokens=0 if self.eos else n, eos_token_id=self.eos,
                                           pad_token_id=self.pad)
        finally:
            Gen.update_candidate_strategy = plain
        return out[0, len(ids):].tolist(), [m + 1 for m in matches[1:]]  # the first loop is the target's prefill

    def warm(self, ids):
        self._gen(ids, 8)

    def one(self, ids):
        (out, accepts), s = timed(lambda: self._gen(ids, self.n))
        if self.eos and out and out[-1] in self.eos:
            out = out[:-1]  # answers exclude the EOS, as clover's
        self.accepts = accepts or None
        return out, len(out), s


class HFDFlashEngine(TransformersEngine):
    """transformers' own engine, with the DFlash drafter as its assistant model."""

    name = "transformers-dflash"

    @staticmethod
    def find(config, **_) -> dict:
        return _find()

    def prepare(self):
        import transformers

        from .dflash_worker import set_mask_row
        from .drafted import drafter_of, target_hf_dir

        st = self.setup
        st.say("transformers-dflash: loading")
        dtype = getattr(torch, st.dtype)
        hf = target_hf_dir(st)
        self.target = transformers.AutoModelForCausalLM.from_pretrained(hf, dtype=dtype).eval()
        set_mask_row(self.target, hf)
        self.assistant = assistant_for(drafter_of(st), dtype)

    def runners(self, threads):
        st = self.setup
        eos = sorted(st.llm.eos_ids()) if st.to_eos else None
        return [HFDFlashRunner(self.target, self.assistant, st.max_new_tokens, eos, st.config.pad_token_id or 0)]
