"""The plan (`EngineSpec`, `Mode.plan`): a request's options resolved once into what the context
check, the cache and the engine read. Its reserve is one number: a prompt exactly at the limit it
sets decodes in every mode with no position past the context and a cache made once (never grown),
as long as the check allowed; one token more is refused in one line."""

from __future__ import annotations

import pytest

import clover
from clover.decoding import width as W

CTX = 160  # the context these tests shrink the tiny model to (wide enough for auto's block of 64)
PROMPT = "def f(x):"


@pytest.fixture(scope="module")
def plan_llm(tiny_dir, tmp_path_factory):
    from clover.checkpoint import save_drafter
    from clover.models.dflash import build_drafter, drafter_config_for

    base = clover.load(tiny_dir)
    cfg = drafter_config_for(base.config, num_hidden_layers=1, block_size=8)
    return clover.load(tiny_dir, drafter=save_drafter(build_drafter(cfg, seed=1), tmp_path_factory.mktemp("plan") / "d"))


def _flat(kind: str, widths) -> W.CostCurve:
    c = W.CostCurve()
    for w in widths:
        c.add(kind, 1, w, 1.0)
    return c


@pytest.fixture()
def widest(monkeypatch):
    """Every "auto" policy picks its widest width, measured nothing (no timing in a unit test)."""
    from clover.decoding import dflash as D, speculative as S

    class WidestBlock(W.WidthPolicy):
        def choose(self, rows):
            return W.WidthChoice(self.widths[-1], len(rows), {self.widths[-1]: 1.0})

    class WidestDraft(W.DraftPolicy):
        def choose(self, rows):
            return W.WidthChoice(self.widths[-1], len(rows), {self.widths[-1]: 1.0})

    monkeypatch.setattr(W.WidthPolicy, "for_model", classmethod(
        lambda cls, model, curve=None: WidestBlock((1,) + W.trained_widths(model.config),
                                                   {w: 1.0 for w in (1,) + W.trained_widths(model.config)},
                                                   _flat("denoise", W.trained_widths(model.config)))))
    monkeypatch.setattr(W.DraftPolicy, "for_model", classmethod(
        lambda cls, model, measure: WidestDraft(W.draft_widths(model.config), _flat("verify", W.draft_widths(model.config)))))
    monkeypatch.setattr(D, "iteration_curve", lambda model, drafter, blocks, **kw: _flat("verify", blocks))
    monkeypatch.setattr(S, "SKIP_BLOCK_BELOW", 0.0)  # every forward drafts


CASES = [
    ("ar", {}),
    ("diffusion", {}),
    ("diffusion", {"block_size": 16}),
    ("diffusion", {"block_size": "auto"}),
    ("naive", {}),
    ("speculative", {}),  # draft "auto", the default
    ("speculative", {"block_size": 8}),
    ("speculative", {"draft_length": 5}),
    ("dflash", {}),
    ("dflash", {"draft_length": 3}),
    ("dflash", {"block_size": "auto"}),
]


@pytest.mark.parametrize("mode,options", CASES, ids=[f"{m}-{'-'.join(f'{k}={v}' for k, v in o.items())}" for m, o in CASES])
def test_a_prompt_at_the_limit_decodes_and_one_past_it_is_refused(plan_llm, monkeypatch, widest, mode, options):
    llm = plan_llm
    monkeypatch.setattr(llm.config, "max_position_embeddings", CTX)
    m = llm.mode(mode)
    params = llm.params(m, dict(options))
    plan = llm.plan(m, params)
    ids = llm.tokenizer.encode(PROMPT)
    n = llm.room(len(ids), params, m)
    assert n == CTX - len(ids) - plan.reserve > 0  # the check reserves the plan's reserve

    seen = []  # per forward: (the furthest position it reaches, the cache's room before it)
    real = llm.model.step

    def spy(cache, commit_ids=None, denoise_ids=None, **kw):
        tc = 0 if commit_ids is None else commit_ids.shape[1]
        bd = 0 if denoise_ids is None else denoise_ids.shape[1]
        seen.append((int(cache.lengths.max()) + tc + bd, cache.capacity - int(cache.lengths.max()) - tc, cache.capacity))
        return real(cache, commit_ids=commit_ids, denoise_ids=denoise_ids, **kw)

    monkeypatch.setattr(llm.model, "step", spy)
    out = llm.generate(ids, mode=m, max_new_tokens=n, ignore_eos=True, **options)
    assert len(out.token_ids) == n
    assert max(end for end, _, _ in seen) <= CTX  # no position past the context
    assert min(room for _, room, _ in seen) >= 0  # every commit fits the cache it was made with
    if mode != "naive":  # (naive makes a fresh cache per forward)
        assert {cap for _, _, cap in seen} == {len(ids) + n + plan.reserve}  # made once, at the plan's size
    if mode in ("ar", "speculative", "dflash") and "block_size" not in options and "draft_length" not in options:
        assert out.token_ids == llm.generate(ids, mode="ar", max_new_tokens=n, ignore_eos=True).token_ids

    with pytest.raises(ValueError, match="exceeds the context length") as e:
        llm.generate(ids, mode=m, max_new_tokens=n + 1, ignore_eos=True, **options)
    assert "\n" not in str(e.value) and str(e.value).startswith("prompt: ")


def test_the_plan_is_frozen_and_the_batching_key(tiny_llm):
    """Options that mean the same plan give equal plans (one engine); the plan cannot be changed."""
    import dataclasses

    m = tiny_llm.mode("diffusion")
    a = tiny_llm.plan(m, tiny_llm.params(m, {"block_size": 8, "threshold": 0.5}))
    b = tiny_llm.plan(m, tiny_llm.params(m, {"block_size": 8, "threshold": 0.9}))  # a per-row option
    c = tiny_llm.plan(m, tiny_llm.params(m, {"block_size": 16}))
    assert a == b and hash(a) == hash(b) and a != c
    assert (a.width, a.auto, a.reserve) == (8, False, 8) and (c.width, c.reserve) == (16, 16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.width = 4
    auto = tiny_llm.plan(m, tiny_llm.params(m, {"block_size": "auto"}))
    assert (auto.width, auto.auto, auto.reserve) == (None, True, max(W.trained_widths(tiny_llm.config)))


def test_dflash_plans_its_drafters_block_and_checks_a_draft_against_it(plan_llm):
    """dflash's width comes from its drafter, in the plan: its whole block (cut by confidence) where
    no draft length was asked for, and a draft longer than the drafter drafts is refused there."""
    from clover.decoding.dflash import DRAFT_CUT

    m = plan_llm.mode("dflash")
    plan = plan_llm.plan(m, plan_llm.params(m, {}))
    assert (plan.width, plan.draft_cut, plan.reserve) == (8, DRAFT_CUT, 8)
    fixed = plan_llm.plan(m, plan_llm.params(m, {"draft_length": 3}))
    assert (fixed.width, fixed.draft_cut, fixed.reserve) == (4, None, 4)
    with pytest.raises(ValueError, match=r"draft_length: must lie in \[1, 7\]"):
        plan_llm.plan(m, plan_llm.params(m, {"draft_length": 9}))
