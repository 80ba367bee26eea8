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
        assert sp.stats.forwards <= 2 * len(sp.stats.accept_lengths) + 1
        assert all(1 <= a <= draft for a in sp.stats.accept_lengths)


def test_speculative_batched_and_eos(llm):
    prompts = [[1, 2, 3], list(range(50, 70))]
    ar = llm.generate(prompts, mode="ar", max_new_tokens=20, eos_penalty=-3.0)
    sp = llm.generate(prompts, mode="speculative", max_new_tokens=20, eos_penalty=-3.0, block_size=8)
    for a, s in zip(ar, sp):
        assert a.token_ids == s.token_ids and a.finish_reason == s.finish_reason


def test_rollback_equals_fresh_prefill(llm):
    m = llm.model
    ids = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = m.make_cache(2, 64)
        m.step(cache, commit_ids=ids[:, :12])
        snap = cache.start_recording()
        m.step(cache, commit_ids=ids[:, 12:20], denoise_ids=torch.full((2, 4), llm.config.mask_token_id))
        keep = torch.tensor([3, 6])
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


def test_speculative_refuses_sampling(llm):
    with pytest.raises(ValueError, match="greedy"):
        llm.generate("x", mode="speculative", temperature=0.7)
    with pytest.raises(ValueError, match="draft_length"):
        llm.generate("x", mode="speculative", draft_length=64, block_size=8)
