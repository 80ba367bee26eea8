"""`compile` on the released block-diffusion families (SDAR, LLaDA2, Fast-dLLM v2): the static steps
(`clover.models.static`) commit block-causally through the attention mask, so the denoise step, the
block commit fused with the next denoise step and Fast-dLLM v2's commit-only forward (the block's
first token is that commit's argmax) each run as one graph. Their code run eagerly (torch.compile
replaced by the identity) gives each reference's golden tokens and forwards, alone and batched;
compiled for real (slow: minutes on a CPU), the tokens of eager clover."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import clover
from test_sdar import _generate, _word_tokenizer

GOLDEN = Path(__file__).parent / "golden"
FAMILIES = ("sdar", "llada2", "fastdllm2")


def _cases(family: str) -> list[dict]:
    return json.loads((GOLDEN / family / "cases.json").read_text())["cases"]


def _options(family: str, case: dict) -> dict:
    """Each test file's options for its case (LLaDA2's quota of fewer steps; Fast-dLLM v2's sub-block)."""
    if family == "llada2" and case["steps"] != case["block_length"]:
        return dict(fallback="quota", steps=case["steps"])
    if family == "fastdllm2" and case["block_length"] != 32:
        return dict(sub_block=case["sub_block"])
    return {}


def _expected(family: str, case: dict) -> list[int]:
    """The reference's tokens as clover reports them (Fast-dLLM v2: its stop token ends the output)."""
    toks = case["tokens"]
    if family == "fastdllm2":
        eos = json.loads((GOLDEN / family / "cases.json").read_text())["eos_token_id"]
        return toks[:-1] if toks[-1] == eos else toks
    return toks


def _schedules(family: str) -> dict[tuple, list[dict]]:
    out: dict[tuple, list[dict]] = {}
    for c in _cases(family):
        out.setdefault((c["block_length"], tuple(sorted(_options(family, c).items()))), []).append(c)
    return out


def _load(tmp_path, family: str, monkeypatch=None, block: int | None = None, **kw):
    """The golden checkpoint (with `block`: its config.json's `block_size` set to it), loaded."""
    d = tmp_path / family
    shutil.copytree(GOLDEN / family / "checkpoint", d)
    _word_tokenizer(d, 128)
    if block is not None:
        raw = json.loads((d / "config.json").read_text())
        (d / "config.json").write_text(json.dumps(raw | {"block_size": block}))
    if monkeypatch is not None:
        monkeypatch.setattr(torch, "compile", lambda fn, **_: fn)
    return clover.load(d, **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_static_steps_give_the_references_tokens(tmp_path, monkeypatch, family):
    """Every golden case through the static steps' code (run eagerly), alone and each schedule's
    prompts in one batch: the reference's tokens and denoising forwards per block, every forward on
    a graph kind (none eagerly but the prompt prefills)."""
    llm = _load(tmp_path, family, monkeypatch, compile=True, compile_batch=4)
    steps = llm.model.static_steps
    assert steps.frozen
    for cases in _schedules(family).values():
        opts = _options(family, cases[0])
        for c in cases:
            (g,) = _generate(llm, [c], **opts)
            assert g.token_ids == _expected(family, c) and g.stats.block_steps == c["denoise_forwards_per_block"], c["name"]
        for g, c in zip(_generate(llm, cases, **opts), cases):
            assert g.token_ids == _expected(family, c) and g.stats.block_steps == c["denoise_forwards_per_block"], c["name"]
    assert steps.calls["denoise"] and steps.calls["commit+denoise"], steps.calls
    if family == "fastdllm2":  # the commit-only forward of a block's first token
        assert steps.calls["block-commit"], steps.calls


@pytest.mark.parametrize("family", FAMILIES)
def test_load_compiles_the_block_diffusion_graphs_only(tmp_path, monkeypatch, family):
    """At load: the denoise and commit+denoise graphs at the checkpoint's block size (and Fast-dLLM
    v2's block-commit), no AR nor verify graph (those modes are refused for these families)."""
    warmed = []
    from clover.models.static import StaticSteps

    real_warm = StaticSteps.warm
    monkeypatch.setattr(StaticSteps, "warm", lambda self, *a, **k: warmed.append(a) or real_warm(self, *a, **k))
    llm = _load(tmp_path, family, monkeypatch, compile=True, compile_batch=2)
    want = {"denoise", "commit+denoise"} | ({"block-commit"} if family == "fastdllm2" else set())
    assert {a[0] for a in warmed} == want and {a[2] for a in warmed} == {llm.config.block_size}
    assert {a[1] for a in warmed} == {1, 2}


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_tokens_equal_eager(tmp_path, family):
    """Compiled for real (inductor): the golden cases of the checkpoint's block size (its default
    schedule) give the reference's tokens, alone and batched, on the graphs."""
    torch.set_num_threads(1)
    # LLaDA2's golden cases decode blocks of 4 and 8, its checkpoint's default is 32: compiled at 4
    llm = _load(tmp_path, family, compile=True, compile_batch=4, block=4 if family == "llada2" else None)
    block = llm.config.block_size
    cases = [c for c in _cases(family) if c["block_length"] == block and not _options(family, c)]
    opts = {}
    for g, c in zip(_generate(llm, cases, **opts), cases):
        assert g.token_ids == _expected(family, c), c["name"]
    for c in cases:
        (g,) = _generate(llm, [c], **opts)
        assert g.token_ids == _expected(family, c), c["name"]
    assert cases
    calls = llm.model.static_steps.calls
    assert calls["denoise"] and calls["commit+denoise"] and not calls["eager"], calls


def test_static_read_positions_give_the_full_forwards_logits(tmp_path):
    """`denoise_read` (a model denoised in sub-blocks: Fast-dLLM v2): the static forward computes the last
    layer's outputs and the LM head at K positions per row only; there, and at each committing row's
    last commit token, its logits equal the full static forward's, and the cache it writes is the same."""
    import copy

    llm = _load(tmp_path, "fastdllm2")
    m = llm.model
    torch.manual_seed(0)
    with torch.inference_mode():
        cache = m.make_cache(3, 128)
        m.step(cache, commit_ids=torch.randint(0, 120, (3, 64)), n_commit=torch.tensor([32, 64, 32]), commit_block=32)
        commit, block = torch.randint(0, 120, (3, 32)), torch.randint(0, 120, (3, 32))
        n = torch.tensor([32, 0, 0])
        read = torch.tensor([[3, 4, 5, 6], [0, 1, 2, 2], [28, 29, 30, 31]])
        outs, caches = [], []
        for r in (None, read):
            c = copy.deepcopy(cache)
            states = [s.tensors() for s in c.layers]
            outs.append(m.forward_step(commit, n, block, c.lengths, states, static=True, commit_block=32, denoise_read=r))
            caches.append(states)
    (cf, df, *_), (cr, dr, *_) = outs
    torch.testing.assert_close(cr[0], cf[0], atol=1e-5, rtol=0)
    rows = torch.arange(3)[:, None]
    torch.testing.assert_close(dr[rows, read], df[rows, read], atol=1e-5, rtol=0)
    for a, b in zip(*caches):
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=0)
