"""LLaDA-MoE (`LLaDAMoEModelLM`, released with model_type "llada") against its reference code: a tiny
random checkpoint in its layout (its config.json keys, Qwen3-MoE-style tensor names, mask 156895),
rebuilt from the seed and shapes in tests/golden/llada_moe/cases.json (scripts/rnd1-llada-moe-golden.py
wrote them by running its remote code's `LLaDAMoEModelLM` and LLaDA's `generate`), gives the
reference's full-sequence logits and, in the canvas mode, its greedy tokens, alone and batched."""

import json

import pytest
import torch
from test_canvas import decode, golden_checkpoint

from clover.checkpoint import load_model
from clover.config import ConfigError
from clover.decoding import get_mode
from clover.models import config_from_dict


@pytest.fixture(scope="module")
def llada_moe(tmp_path_factory):
    out = tmp_path_factory.mktemp("llada_moe")
    return golden_checkpoint("llada_moe", out), load_model(out)


def test_config_reads_llada_moe_under_lladas_model_type(llada_moe):
    """The released config.json says model_type "llada": its architecture name makes it LLaDA-MoE."""
    g, model = llada_moe
    c = model.config
    assert g["config"]["model_type"] == "llada" and c.model_type == "lladamoe"
    assert type(model).__name__ == "LLaDAMoEModelLM" and not c.norm_topk_prob and c.head_dim == 8
    assert c.mask_token_id == 156895 and c.commit_attention == "full" and c.logit_shift == 0
    assert get_mode(c.default_mode).name == "canvas"
    assert config_from_dict(json.loads(json.dumps(c.to_dict()))) == c
    with pytest.raises(ConfigError, match="shared_expert_intermediate_size"):
        config_from_dict({**g["config"], "shared_expert_intermediate_size": 16})
    with pytest.raises(ConfigError, match="moe_layer_freq"):
        config_from_dict({**g["config"], "moe_layer_freq": [0, 1]})


def test_logits_match_reference(llada_moe):
    ref = llada_moe[0]["logits"]
    with torch.no_grad():
        logits = llada_moe[1](torch.tensor([ref["ids"]]))[0]
    for got, want in ((logits[:, :len(ref["columns"][0])], ref["columns"]), (logits.logsumexp(-1), ref["logsumexp"])):
        torch.testing.assert_close(got, torch.tensor(want), atol=1e-4, rtol=1e-4)
    assert logits.argmax(-1).tolist() == ref["argmax"]


def _options(case: dict) -> dict:
    return dict(max_new_tokens=case["gen_length"], steps=case["steps"], block_size=case["block_length"], temperature=0)


def test_tokens_match_reference_alone_and_batched(llada_moe):
    g, model = llada_moe
    for case in g["cases"]:
        assert decode(model, case["prompts"], [_options(case)]) == case["tokens"], case["name"]
    prompts = [c["prompts"][0] for c in g["cases"]]
    assert decode(model, prompts, [_options(c) for c in g["cases"]]) == [c["tokens"][0] for c in g["cases"]]
