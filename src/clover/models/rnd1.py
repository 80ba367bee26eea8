"""RND1 (RND1-Base, Radical Numerics; model_type `rnd1`, `RND1LM`): the Qwen3-MoE stack (`qwen3_moe.py`:
its tensors under its names, q/k norms, a sparse MoE with `norm_topk_prob` in every layer) read as a
whole-sequence masked diffusion model. What differs from Qwen3-MoE is data on the config: every position
attends to every other over the whole canvas (`commit_attention` "full"), the hidden state at position i
predicts token i+1 (`logit_shift` 1), the mask token is 151669, and the checkpoint decodes with the
canvas mode's "keep" schedule (`clover.decoding.canvas`: RND1's `diffusion_sample`, the most uncertain
masks kept masked, entropy-ordered).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..config import CanvasConfig
from .qwen3_moe import Qwen3MoeConfig, Qwen3MoeForCausalLM
from .registry import Architecture


@dataclass(kw_only=True)
class RND1Config(CanvasConfig, Qwen3MoeConfig):
    """An RND1 `config.json` (configuration_rnd.py's keys: Qwen3-MoE's with `mask_token_id` 151669;
    its `moe_backend` and `num_diffusion_steps` are the reference's runtime choices, not read: the
    canvas mode's `steps` says how many)."""

    MODEL_TYPES = ("rnd1",)
    HF_ARCHITECTURE = "RND1LM"
    canvas_schedule: ClassVar[str] = "keep"  # RND1's diffusion_sample: the highest-entropy masks stay masked
    canvas_sampler: ClassVar[str] = "greedy"  # its greedy path only (the sampled draw is not built)

    mask_token_id: int | None = 151669
    pad_token_id: int | None = 151643
    norm_topk_prob: bool = True  # Qwen3-30B-A3B's, which RND1's config forces


class RND1LM(Qwen3MoeForCausalLM):
    """The Qwen3-MoE stack, bidirectional over the canvas (its config's `commit_attention`)."""


ARCHITECTURE = Architecture(name="rnd1", config_class=RND1Config, model_class=RND1LM)
