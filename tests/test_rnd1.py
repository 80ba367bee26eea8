"""RND1 (model_type `rnd1`) against its reference code: a tiny random checkpoint in RND1's layout
(Qwen3-MoE's tensor names and keys, the real vocabulary and mask token), rebuilt from the seed and
shapes in tests/golden/rnd1/cases.json (scripts/rnd1-llada-moe-golden.py wrote them by running
RadicalNumerics/RND1's `RND1LM` and its `generate`), gives the reference's full-sequence logits and,
in the canvas mode ("keep" schedule), the reference's greedy tokens on every case, alone and batched."""

import json

import pytest
import torch
from test_canvas import decode, golden_checkpoint

from clover.checkpoint import load_model
from clover.decoding import get_mode
from clover.models import config_from_dict


@pytest.fixture(scope="module")
def rnd1(tmp_path_factory):
    out = tmp_path_factory.mktemp("rnd1")
    return golden_checkpoint("rnd1", out), load_model(out)


def test_config_reads_rnd1(rnd1):
    g, model = rnd1
    c = model.config
    assert type(model).__name__ == "RND1LM" and c.mask_token_id == 151669 and c.num_experts == g["config"]["num_experts"]
    assert c.commit_attention == "full" and c.logit_shift == 1 and c.norm_topk_prob
    assert get_mode(c.default_mode).name == "canvas"
    assert config_from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_logits_match_reference(rnd1):
    ref = rnd1[0]["logits"]
    with torch.no_grad():
        logits = rnd1[1](torch.tensor([ref["ids"]]))[0]
    for got, want in ((logits[:, :len(ref["columns"][0])], ref["columns"]), (logits.logsumexp(-1), ref["logsumexp"])):
        torch.testing.assert_close(got, torch.tensor(want), atol=1e-4, rtol=1e-4)
    assert logits.argmax(-1).tolist() == ref["argmax"]


def _options(case: dict) -> dict:
    return dict(max_new_tokens=case["max_new_tokens"], steps=case["steps"], temperature=0)


def test_tokens_match_reference_alone_and_batched(rnd1):
    """Greedy (the reference's demo at temperature 0): every case's tokens after the prompt, the
    canvas's last position RND1's reserved pad; then all cases' rows in one engine."""
    g, model = rnd1
    for case in g["cases"]:
        assert decode(model, case["prompts"], [_options(case)]) == case["tokens"], case["name"]
    prompts = [c["prompts"][0] for c in g["cases"]]
    assert decode(model, prompts, [_options(c) for c in g["cases"]]) == [c["tokens"][0] for c in g["cases"]]


def test_rnd1_refuses_sampling(rnd1):
    _, model = rnd1
    with pytest.raises(ValueError, match="^temperature: RND1's canvas decodes greedily only"):
        decode(model, [[5, 6]], [dict(max_new_tokens=4, temperature=0.5)])
