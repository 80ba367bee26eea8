"""docs/checkpoints.md's `KeyLayout` example: a checkpoint whose keys are renamed does not load,
and loads with the renaming layout set on the backbone's class, to the same logits."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import clover
from clover.checkpoint import CheckpointError
from clover.models.qwen3_5_moe import MoeKeyLayout, Qwen3_5MoeForCausalLM


class RenamedLayout(MoeKeyLayout):
    def name(self, key):
        if key.startswith("transformer."):
            key = "model." + key[len("transformer."):]
        return super().name(key)


def test_renamed_keys_load_through_the_layout_hook(tiny_dir, tmp_path, monkeypatch):
    out = tmp_path / "renamed"
    shutil.copytree(tiny_dir, out)
    state = load_file(str(out / "model.safetensors"))
    save_file({("transformer." + k[len("model."):] if k.startswith("model.") else k): v for k, v in state.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises((CheckpointError, ValueError), match="model.layers|transformer"):
        clover.load(out)
    monkeypatch.setattr(Qwen3_5MoeForCausalLM, "key_layout", RenamedLayout())
    ours, ref = clover.load(out), clover.load(tiny_dir)
    ids = torch.randint(0, 200, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(ours.model(ids), ref.model(ids))
