"""The transformers config of a Clover checkpoint (`configuration_clover.py` in an export).

`clover export-hf` writes this module, with the clover modules it needs, into the export directory
(`clover.export.hf`): transformers loads it through `auto_map` with `trust_remote_code=True`. Every
key of config.json stays an attribute, so `model_config()` rebuilds clover's own config from it
(the one description of the fields, their defaults and their checks).
"""

from __future__ import annotations

from transformers import PretrainedConfig

from ..config import CloverConfig
from ..models import config_from_dict


class CloverHFConfig(PretrainedConfig):
    model_type = "clover"
    keys_to_ignore_at_inference = ["cache"]

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)

    def model_config(self) -> CloverConfig:
        """clover's config (checked) from the keys of this one."""
        raw = self.to_dict()
        raw["model_type"] = "clover"
        return config_from_dict(raw, source="config.json")
