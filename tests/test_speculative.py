"""Self-speculative decoding is lossless: greedy output == AR greedy; cache rollback is exact."""

import pytest
import torch

import clover
from clover.tiny import build_tiny_checkpoint


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    d = build_tiny_checkpoint(tmp_path_factory.mktemp("spec") / "m", seed=11, init_std=0.15)
    return clover.load(d)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_speculative_equals_ar_greedy(tmp_path, seed):
    d = build_tiny_checkpoint(tmp_path / "m", seed=seed, init_std=0.2)
    llm = clover.load(d)
    g = torch.Generator().manual_seed(seed)
    for plen, draft in ((3, 4), (11, 8), (20, 2)):
        prompt = torch.randint(0, 256, (plen,), generator=g).tolist()
        ar = llm.generate(prompt, mode="ar", max_new_tokens=30, ignore_eos=True)
        sp = llm.generate(prompt, mode="speculative", max_new_tokens=30, draft_length=draft, block_size=8, ignore_eos=True)
        assert sp.token_ids == ar.token_ids
        assert all(1 <= a <= draft for a in sp.stats.accept_lengths)
        # every forward after the prompt's verifies a draft: after a rejection the next one commits
        # AR's own next token (a draft of one) while it denoises the block after it
        assert any(a < draft for a in sp.stats.accept_lengths[:-1])
        assert sp.stats.forwards == len(sp.stats.accept_lengths) + 1


def test_speculative_batched_and_eos(llm):
    prompts = [[1, 2, 3], list(range(50, 70))]
    ar = llm.generate(prompts, mode="ar", max_new_tokens=20, eos_penalty=-3.0)
    sp = llm.generate(prompts, mode="speculative", max_new_tokens=20, eos_penalty=-3.0, block_size=8)
    for a, s in zip(ar, sp):
        assert a.token_ids == s.token_ids and a.finish_reason == s.finish_reason


@pytest.mark.parametrize("keep", [[3, 6], [1, 4], [0, 2]])  # re-run chunked; token by token; nothing kept
def test_rollback_equals_fresh_prefill(llm, keep):
    m = llm.model
    ids = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = m.make_cache(2, 64)
        m.step(cache, commit_ids=ids[:, :12])
        snap = cache.start_recording()
        m.step(cache, commit_ids=ids[:, 12:20], denoise_ids=torch.full((2, 4), llm.config.mask_token_id))
        keep = torch.tensor(keep)
        cache.rollback(snap, keep)
        for b in range(2):
            n = 12 + int(keep[b])
            fresh = m.make_cache(1, 64)
            m.step(fresh, commit_ids=ids[b : b + 1, :n])
            assert int(cache.lengths[b]) == n
            for i in fresh.recurrent:
                torch.testing.assert_close(cache.recurrent[i][b], fresh.recurrent[i][0], atol=1e-5, rtol=1e-5)
                torch.testing.assert_close(cache.conv[i][b], fresh.conv[i][0], atol=1e-5, rtol=1e-5)
            for i in fresh.keys:
                torch.testing.assert_close(cache.keys[i][b, :, :n], fresh.keys[i][0, :, :n], atol=1e-5, rtol=1e-5)
            # and decoding continues identically
            nxt = ids[b : b + 1, n : n + 1]
            a = m.step(cache.select_rows([b]), commit_ids=nxt).commit_logits
            c = m.step(fresh, commit_ids=nxt).commit_logits
            torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)


def test_speculative_refuses_what_it_cannot_keep_lossless(llm):
    with pytest.raises(ValueError, match="repetition_penalty"):
        llm.generate("x", mode="speculative", temperature=0.7, repetition_penalty=1.3)
    with pytest.raises(ValueError, match="draft_length"):
        llm.generate("x", mode="speculative", draft_length=64, block_size=8)


def test_rejection_rule_emits_the_target_distribution():
    """A small vocabulary, fixed target p and draft q per position: the first emitted token after
    draft[0] is distributed as p[0], and the next (given the first draft token kept) as p[1]."""
    from clover.decoding.speculative import accept_draft

    V, D, trials = 5, 4, 8000
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(D - 1, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(D - 1, V, generator=g) * 1.5, -1)
    first = torch.zeros(V)
    second, kept1 = torch.zeros(V), 0
    for _ in range(trials):
        draft = [0] + torch.multinomial(q, 1, generator=g).flatten().tolist()
        m, tok = accept_draft(draft, q, p, g)
        emitted = draft[:m] + ([tok] if tok is not None else [])
        assert 1 <= m <= D and (tok is None) == (m == D)
        first[emitted[1]] += 1
        if m >= 2:
            kept1 += 1
            second[emitted[2]] += 1
    assert (first / trials - p[0]).abs().sum() < 0.04  # twice the total variation; its noise here is ~0.015
    assert (second / kept1 - p[1]).abs().sum() < 0.06
    # the draft distribution itself differs from p: a rule that kept every draft token would fail
    assert (q[0] - p[0]).abs().sum() > 0.2
    # greedy as the degenerate case: one-hot p and q agree -> kept; disagree -> the target's token
    one = torch.eye(V)
    assert accept_draft([0, 2, 3], one[[2, 3]], one[[2, 3]], g) == (3, None)
    assert accept_draft([0, 2, 3], one[[2, 3]], one[[4, 3]], g) == (1, 4)


def test_speculative_sampling_matches_ar_sampling(llm):
    """End to end on the tiny model: the first two sampled tokens' distribution, AR vs speculative."""
    kw = dict(max_new_tokens=2, temperature=1.0, top_k=3, ignore_eos=True)
    n = 400
    counts = {}
    for mode, seed in (("ar", 1), ("speculative", 2)):
        torch.manual_seed(seed)
        gens = llm.generate([[5, 6, 7]] * n, mode=mode, block_size=8, **kw) if mode != "ar" else \
            llm.generate([[5, 6, 7]] * n, mode=mode, **kw)
        c = {}
        for gen in gens:
            c[tuple(gen.token_ids)] = c.get(tuple(gen.token_ids), 0) + 1
        counts[mode] = c
    keys = set(counts["ar"]) | set(counts["speculative"])
    tv = sum(abs(counts["ar"].get(k, 0) - counts["speculative"].get(k, 0)) for k in keys) / (2 * n)
    assert len(keys) > 2 and tv < 0.12, (tv, counts)
    a = llm.generate("hello", mode="speculative", block_size=8, seed=7, **kw)
    b = llm.generate("hello", mode="speculative", block_size=8, seed=7, **kw)
    assert a.token_ids == b.token_ids  # seeded: reproducible
