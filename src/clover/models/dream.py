"""Dream (Dream 7B, Dream-Coder-v0-7B, DiffuCoder-7B; model_type `Dream`, `DreamModel`): the Qwen2.5
stack (`qwen2.py`: its tensors under its names, bias on q/k/v only) read as a whole-sequence masked
diffusion model. What differs from Qwen2 is data on the config: every position attends to every
other over the whole canvas (`commit_attention` "full"), the hidden state at position i predicts
token i+1 (`logit_shift` 1; the canvas's first position reads its own), the mask token is 151666,
and the checkpoint decodes with the canvas mode (`clover.decoding.canvas`: Dream's
`diffusion_generate`, entropy ordering by default).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..config import CanvasConfig
from .qwen2 import Qwen2Config, Qwen2ForCausalLM
from .registry import Architecture


@dataclass(kw_only=True)
class DreamConfig(CanvasConfig, Qwen2Config):
    """A Dream `config.json` (configuration_dream.py's keys and defaults: Qwen2's, with
    `mask_token_id` 151666 and `pad_token_id` 151643, 32768 positions)."""

    MODEL_TYPES = ("Dream",)
    HF_ARCHITECTURE = "DreamModel"
    canvas_schedule: ClassVar[str] = "timesteps"  # how the canvas mode paces the unmasking (Dream's timesteps)
    canvas_sampler: ClassVar[str] = "categorical"  # its draw above temperature 0 (sample_tokens)
    # the top-k diffusion_generate reads confidences over when none is given (transformers' PretrainedConfig
    # default, 50, reaches its generation config; Dream's README passes none)
    canvas_top_k: ClassVar[int] = 50

    mask_token_id: int | None = 151666
    pad_token_id: int | None = 151643


class DreamModel(Qwen2ForCausalLM):
    """The Qwen2 stack, bidirectional over the canvas (its config's `commit_attention`)."""


ARCHITECTURE = Architecture(name="dream", config_class=DreamConfig, model_class=DreamModel)
