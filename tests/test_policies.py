"""Acceptance policies, pinned on hand-worked examples. The shared example gives a different answer
under every rule, so a test passes only for its own rule."""

from __future__ import annotations

import pytest
import torch

import clover
from clover.decoding.acceptance import POLICIES, accept
from clover.decoding.sampling import SamplingParams

# candidates at block positions 0, 1, 2, 4, 5, 6 (position 3 is already decoded)
CONF = torch.tensor([0.97, 0.80, 0.60, 0.70, 0.65, 0.10])
POS = torch.tensor([0, 1, 2, 4, 5, 6])
ENT = torch.tensor([0.10, 0.50, 0.90, 0.70, 0.80, 2.00])

EXPECTED = {
    # conf >= 0.95: position 0 only
    "threshold": [0],
    # sorted 0.97, 0.80, 0.70, 0.65, 0.60, 0.10 vs 1 - 1/(n+1) = 0.5, 0.667, 0.75, 0.8, ...:
    # 0.97 >= 0.5, 0.80 >= 0.667, 0.70 < 0.75 -> the top 2 (indices 0, 1)
    "factor": [0, 1],
    # >= 0.95: idx 0; in [0.5, 0.95): idx 1 (0.80; left neighbour 0.97 is higher -> not a local max),
    # idx 2 (0.60 < left 0.80: no), idx 3 (0.70: left is position 2? no, position 3 is decoded, so
    # its run starts here; right 0.65 -> local max: yes), idx 4 (0.65 < 0.70: no)
    "hierarchy": [0, 3],
    # by confidence: ent 0.10, +0.50 = 0.60, +0.70 = 1.30 > 1.2 -> the two most confident
    # ... with budget 1.4: 0.10 + 0.50 + 0.70 = 1.30, +0.80 = 2.10 > 1.4 -> idx 0, 1, 3
    "entropy": [0, 1, 3],
}


def params(policy: str, **kw) -> SamplingParams:
    base = dict(policy=policy, threshold=0.95, factor=1.0, low_threshold=0.5, entropy_budget=1.4)
    return SamplingParams(**{**base, **kw}).validate()


@pytest.mark.parametrize("policy", list(EXPECTED))
def test_policy_by_hand(policy):
    take, forced = accept(params(policy), CONF, POS, ENT)
    assert take.tolist() == EXPECTED[policy] and not forced


def test_the_example_tells_every_rule_apart():
    answers = {p: tuple(accept(params(p), CONF, POS, ENT)[0].tolist()) for p in POLICIES}
    assert len(set(answers.values())) == len(POLICIES), answers
    assert set(EXPECTED) == set(POLICIES)


@pytest.mark.parametrize("policy", list(EXPECTED))
def test_forced_step_fallbacks(policy):
    conf = torch.tensor([0.2, 0.4, 0.3])  # nothing passes any rule's bar
    ent = torch.tensor([3.0, 2.0, 2.5])
    pos = torch.tensor([1, 2, 3])
    p = params(policy, factor=0.5, low_threshold=0.45, entropy_budget=1.0)
    take, forced = accept(p, conf, pos, ent)
    assert forced and take.tolist() == [1]  # the most confident
    take, forced = accept(params(policy, factor=0.5, low_threshold=0.45, entropy_budget=1.0, fallback="leftmost"),
                          conf, pos, ent)
    assert forced and take.tolist() == [0]  # the leftmost candidate


def test_factor_takes_more_when_all_are_sure():
    conf = torch.tensor([0.99, 0.98, 0.97, 0.96])  # 1 - 1/5 = 0.8 for n = 4: all pass
    assert accept(params("factor"), conf, torch.arange(4))[0].tolist() == [0, 1, 2, 3]
    assert accept(params("factor", factor=0.05), conf, torch.arange(4))[0].tolist() == [0]  # 1-0.05/2=0.975


def test_hierarchy_refuses_low_above_high(tiny_llm):
    with pytest.raises(ValueError, match="^low_threshold: "):
        tiny_llm.generate("x", mode="diffusion", policy="hierarchy", threshold=0.6, low_threshold=0.7)


@pytest.fixture(scope="module")
def llm():
    return clover.load()


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_policies_decode_and_naive_agrees(llm, policy):
    prompt = "assert sorted([31, 7, 19]) == "
    kw = dict(max_new_tokens=24, policy=policy, stop=["\n"])
    g = llm.generate(prompt, mode="diffusion", **kw)
    n = llm.generate(prompt, mode="naive", **kw)
    assert (g.token_ids, g.text, g.finish_reason) == (n.token_ids, n.text, n.finish_reason)
    assert g.stats.forwards >= 1 and g.text


def test_sub_blocks_decode_left_to_right(llm):
    """With sub-blocks of 8 no position of a later sub-block is decoded before every position of the
    earlier ones (the decode steps never go down across a sub-block boundary)."""
    g = llm.generate("def add(a, b):\n", mode="diffusion", max_new_tokens=32, sub_block=8, block_size=32,
                     ignore_eos=True)
    steps = g.decode_steps
    for b in range(0, 32 - 8, 8):
        assert max(steps[b : b + 8]) <= min(steps[b + 8 : b + 16]), steps
    whole = llm.generate("def add(a, b):\n", mode="diffusion", max_new_tokens=32, block_size=32, ignore_eos=True)
    assert g.stats.forwards >= whole.stats.forwards


def test_default_policy_comes_from_the_model(llm, tiny_llm):
    assert llm.config.policy == "entropy"  # the bundled model's, chosen by the sweep (docs/benchmarks.md)
    assert llm.params("diffusion", {}).policy == "entropy"
    assert llm.params("diffusion", {"threshold": 0.9}).policy == "threshold"  # a threshold alone
    assert llm.params("diffusion", {"threshold": 0.9, "policy": "factor"}).policy == "factor"
    assert tiny_llm.config.policy == "threshold"  # a checkpoint that names none
    assert tiny_llm.params("diffusion", {}).policy == "threshold"


def test_config_refuses_an_unknown_policy():
    from clover.config import ConfigError
    from clover.models import config_from_dict
    from clover.tiny import tiny_config

    with pytest.raises(ConfigError, match="policy"):
        config_from_dict({**tiny_config().to_dict(), "policy": "yolo"})


def test_quota_fallback_by_hand():
    """fallback="quota" (SDAR / LLaDA2's low_confidence_dynamic): a step that accepts fewer than its quota
    (block // steps, one more for the first block % steps steps) commits the quota most confident."""
    from clover.decoding.acceptance import step_quota

    assert [step_quota(8, 4, s) for s in range(4)] == [2, 2, 2, 2]
    assert [step_quota(7, 4, s) for s in range(5)] == [2, 2, 2, 1, 1]  # past the last step: the last's
    assert [step_quota(4, None, s) for s in range(4)] == [1, 1, 1, 1]  # steps null: the block size
    quota = params("threshold", fallback="quota", steps=4)
    take, forced = accept(quota, CONF, POS, ENT, step=0, width=8)  # only 0.97 passes 0.95: the top 2
    assert take.tolist() == [0, 1] and forced
    take, forced = accept(quota, CONF, POS, ENT, step=3, width=7)  # quota 1: what passes
    assert take.tolist() == [0] and not forced
    take, forced = accept(params("threshold", threshold=0.6, fallback="quota", steps=4), CONF, POS, ENT, step=0, width=8)
    assert take.tolist() == [0, 1, 2, 3, 4] and not forced  # five pass: all of them
    take, forced = accept(params("threshold", fallback="quota", steps=1), CONF, POS, ENT, step=0, width=8)
    assert take.tolist() == [0, 1, 2, 3, 4, 5] and forced  # a quota beyond the candidates: all of them
    with pytest.raises(ValueError, match="steps: sets the quota of fallback='quota'"):
        clover.decoding.modes.get_mode("diffusion").check(params("threshold", steps=4))
