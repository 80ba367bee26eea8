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


@pytest.mark.parametrize("wy", [True, False])  # read from the commit's WY terms; the recurrence run again
@pytest.mark.parametrize("keep", [[3, 6], [1, 4], [0, 2]])  # re-run chunked; token by token; nothing kept
def test_rollback_equals_fresh_prefill(llm, keep, wy, monkeypatch):
    from clover.models import layers

    if not wy:
        monkeypatch.setattr(layers, "ONE_CHUNK_RECORDED", 0)
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
    from clover.decoding.verify import accept_draft

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


@pytest.mark.parametrize("width", [8, "auto"])  # the fixed draft; the adaptive one (drafting 8 here)
def test_speculative_sampling_matches_ar_sampling(llm, width, monkeypatch):
    """End to end on the tiny model: the first two sampled tokens' distribution, AR vs speculative."""
    from clover.decoding import speculative as S
    from clover.decoding import width as W

    curve = W.CostCurve()  # the verify of 8 as cheap as the AR step: draft "auto" drafts 8
    for b in W.BATCH_BUCKETS:
        curve.add(W.STEP_KIND, b, 1, 1.0)
        for p in (8, 16, 32, 64):
            curve.add(W.STEP_KIND, b, p, p / 8)
    monkeypatch.setattr(S, "step_curve", lambda *a, **k: curve)
    kw = dict(max_new_tokens=2, temperature=1.0, top_k=3, ignore_eos=True)
    n = 400
    counts = {}
    for mode, seed in (("ar", 1), ("speculative", 2)):
        torch.manual_seed(seed)
        gens = llm.generate([[5, 6, 7]] * n, mode=mode, block_size=width, **kw) if mode != "ar" else \
            llm.generate([[5, 6, 7]] * n, mode=mode, **kw)
        c = {}
        for gen in gens:
            c[tuple(gen.token_ids)] = c.get(tuple(gen.token_ids), 0) + 1
        counts[mode] = c
    keys = set(counts["ar"]) | set(counts["speculative"])
    tv = sum(abs(counts["ar"].get(k, 0) - counts["speculative"].get(k, 0)) for k in keys) / (2 * n)
    assert len(keys) > 2 and tv < 0.12, (tv, counts)
    a = llm.generate("hello", mode="speculative", block_size=width, seed=7, **kw)
    b = llm.generate("hello", mode="speculative", block_size=width, seed=7, **kw)
    assert a.token_ids == b.token_ids  # seeded: reproducible


def _two_tokens(p1, p2, qs, cut, g, drawn_cut=False, reuse=True):
    """(x1, x2) as the engine emits them after a context token: a draft [c, d1, d2], d_j ~ q_j (the
    q's drawn per trial from `qs`: the denoiser's confidence varies with the context), cut before its
    first unsure token (`sure_prefix`), verified by the rejection rule against p1 and p2[d1]; after a
    rejection of d1 the leftover d2 rides behind the residual token (`reuse`), else x2 is AR's draw."""
    from clover.decoding.verify import accept_draft, sure_prefix

    q = qs[int(torch.randint(len(qs), (1,), generator=g))]
    d = torch.multinomial(q, 1, generator=g)[:, 0].tolist()
    conf = q.gather(-1, torch.tensor(d)[:, None])[:, 0] if drawn_cut else q.amax(-1)
    k = sure_prefix(conf[None], cut)[0]
    if k == 0:  # a draft of one: x1 is AR's draw, and so is x2 (the next draft's first token)
        x1 = int(torch.multinomial(p1, 1, generator=g))
        return x1, int(torch.multinomial(p2[x1], 1, generator=g))
    m, tok = accept_draft([0] + d[:k], q[:k], torch.stack([p1, p2[d[0]]])[:k], g)
    out = d[: m - 1] + ([tok] if tok is not None else [])
    if len(out) == 2:
        return out[0], out[1]
    if tok is not None and k == 2 and reuse:  # d1 rejected: [x1, d2] verified by the next forward
        _, tok2 = accept_draft([out[0], d[1]], q[1:2], p2[out[0]][None], g)
        return out[0], d[1] if tok2 is None else tok2
    return out[0], int(torch.multinomial(p2[out[0]], 1, generator=g))


@pytest.mark.parametrize("cut,drawn_cut,lossless", [(0.0, False, True), (0.5, False, True), (0.65, False, True),
                                                    (0.5, True, False)])
def test_cut_and_leftover_drafts_keep_the_target_distribution(cut, drawn_cut, lossless):
    """The adaptive draft's sampling rules on a 3-token vocabulary: a draft cut before its first
    token whose distribution's top probability is below the cut, and the leftover of a rejected
    draft verified behind the residual token, emit two tokens distributed as AR's p1(x1) p2(x2|x1).
    A cut that read the drawn token's probability instead is biased (TV 0.058 here, noise ~0.01)."""
    p1 = torch.tensor([0.5, 0.3, 0.2])
    p2 = torch.tensor([[0.6, 0.2, 0.2], [0.1, 0.8, 0.1], [0.3, 0.3, 0.4]])
    qs = [torch.tensor([[0.9, 0.05, 0.05], [0.2, 0.6, 0.2]]), torch.tensor([[0.4, 0.35, 0.25], [0.7, 0.2, 0.1]])]
    g, n = torch.Generator().manual_seed(0), 20000
    counts = torch.zeros(3, 3)
    for _ in range(n):
        counts[_two_tokens(p1, p2, qs, cut, g, drawn_cut=drawn_cut)] += 1
    tv = float((counts / n - p1[:, None] * p2).abs().sum() / 2)
    assert (tv < 0.025) if lossless else (tv > 0.04), tv


@pytest.fixture(scope="module")
def bundled():
    return clover.load()  # it keeps drafts (a random model rejects nearly every one)


def _spec_rows(llm, prompts, n, **engine_kw):
    from clover.decoding.base import RowState
    from clover.decoding.sampling import SamplingParams
    from clover.decoding.speculative import SpeculativeEngine

    eng = SpeculativeEngine(llm.model, draft_length=8, mask_id=llm.config.mask_token_id, **engine_kw)
    rows = [RowState(prompt=p, params=SamplingParams(max_new_tokens=n, ignore_eos=True), eos_ids=set()) for p in prompts]
    for r in rows:
        eng.add(r)
    list(eng.run())
    return rows


@pytest.mark.parametrize("cut,adaptive", [(None, False), (0.0, True), (0.3, True), (0.9, False), (1.01, True),
                                          (1.01, False)])
def test_every_draft_policy_equals_ar_greedy(bundled, cut, adaptive):
    """Fixed and adaptive drafts (the leftover of a rejected draft drafting on, the first token
    emitted when drafted), uncut and cut (above 1: every draft is AR's token alone) give AR's tokens
    on held-out prompts, batched as one by one."""
    from clover.data.tasks import heldout_tasks

    prompts = [bundled.tokenizer.encode(t.prompt) for t in heldout_tasks(5000)[3000:3003]]
    ar = [g.token_ids for g in bundled.generate(prompts, mode="ar", max_new_tokens=24, ignore_eos=True)]
    batched = _spec_rows(bundled, prompts, 24, cut=cut, adaptive=adaptive)
    alone = [_spec_rows(bundled, [p], 24, cut=cut, adaptive=adaptive)[0] for p in prompts]
    assert [r.tokens for r in batched] == [r.tokens for r in alone] == ar
    if cut is not None and cut > 1:
        assert all(a == 1 for r in batched for a in r.accept_lengths)
        # AR's forwards when the first token is emitted as drafted, else one more (it waits for its verify)
        assert all(r.forwards == len(r.tokens) + (not adaptive) and not r.state.rejected_draft for r in batched)
    else:
        assert any(a > 1 for r in batched for a in r.accept_lengths)


def _auto_engine(llm, skip_below: float | None = None):
    """A draft "auto" engine whose step costs make drafting 8 as cheap as the AR step (it drafts 8
    throughout); `skip_below`: its block-skip threshold, else the default."""
    from clover.decoding import width as W
    from clover.decoding.speculative import SpeculativeEngine

    curve = W.CostCurve()
    for b in W.BATCH_BUCKETS:
        for w in W.draft_widths(llm.config):
            curve.add(W.STEP_KIND, b, w, 1.0 if w <= 8 else 10.0)
    eng = SpeculativeEngine(llm.model, draft_length="auto", mask_id=llm.config.mask_token_id, adaptive=True,
                            draft_policy=W.DraftPolicy(W.draft_widths(llm.config), curve, kind=W.STEP_KIND))
    if skip_below is not None:
        eng.skip_below = skip_below
    return eng


def _decode(eng, prompts, n: int = 24) -> list:
    """`prompts` decoded together by `eng` (greedy, `n` tokens each) -> their rows."""
    from clover.decoding.base import RowState
    from clover.decoding.sampling import SamplingParams

    rows = [RowState(prompt=p, params=SamplingParams(max_new_tokens=n, ignore_eos=True), eos_ids=set()) for p in prompts]
    for r in rows:
        eng.add(r)
    list(eng.run())
    return rows


@pytest.mark.parametrize("skip_below", [0.35, 1.01])  # the default; every forward with long drafts in flight
def test_auto_leaving_out_the_block_equals_ar_greedy(bundled, skip_below):
    """Draft auto leaving out the denoise block of forwards whose drafts in flight are likely
    rejected (it verifies them and drafts nothing; a draft kept whole drafts its block next) gives
    AR's tokens on held-out prompts, batched as one by one, with fewer blocks than forwards."""
    from clover.data.tasks import heldout_tasks

    prompts = [bundled.tokenizer.encode(t.prompt) for t in heldout_tasks(5000)[3000:3003]]
    ar = [g.token_ids for g in bundled.generate(prompts, mode="ar", max_new_tokens=24, ignore_eos=True)]
    skipped = []

    def rows(ps):
        eng = _auto_engine(bundled, skip_below)
        out = _decode(eng, ps)
        skipped.append((eng.skipped, eng.forwards))
        return out

    batched = rows(prompts)
    alone = [rows([p])[0] for p in prompts]
    assert [r.tokens for r in batched] == [r.tokens for r in alone] == ar
    assert all(0 < k < n for k, n in skipped) and any(a > 1 for r in batched for a in r.accept_lengths)


def test_kept_whole_reads_the_drafts_own_probabilities(bundled, monkeypatch):
    """A greedy row's chance of keeping its draft in flight whole (`kept_whole`, what leaves out the
    block) is the product of its tokens' denoise probabilities, which ride along with the tokens of
    a rejected draft's leftover (`draft_sure` stays aligned with draft[1:], each the top probability
    of the denoise logits its token was the argmax of); a row without them (sampled) reads
    a^(L-1). The tokens stay AR's, batched and alone."""
    from clover.data.tasks import heldout_tasks
    from clover.decoding import speculative as S

    checked = {"fresh": 0, "leftover": 0}
    real_draft, real_step = S.SpeculativeEngine._draft, S.SpeculativeEngine.step

    def draft(self, r, denoise_logits):
        out = real_draft(self, r, denoise_logits)
        if denoise_logits is not None:
            probs = r.state.sampler.process(denoise_logits).softmax(-1)
            assert out[1:] == probs.argmax(-1).tolist()
            assert r.state.draft_sure == probs.amax(-1).tolist()
            checked["fresh"] += 1
        return out

    def step(self):
        rows = list(self.rows)
        before = [(r.state.draft, r.state.draft_sure, len(r.accept_lengths)) for r in rows]
        events = real_step(self)
        for r, (d, sure, n) in zip(rows, before):
            if r.finished or r.state.draft is None:
                continue
            assert r.state.draft_sure is not None and len(r.state.draft_sure) == len(r.state.draft) - 1
            if d is not None and len(r.accept_lengths) > n and (m := r.accept_lengths[-1]) < len(d) - 1:
                assert r.state.draft[1:] == d[m + 1 :] and r.state.draft_sure == sure[m:]  # the leftover's
                checked["leftover"] += 1
        return events

    monkeypatch.setattr(S.SpeculativeEngine, "_draft", draft)
    monkeypatch.setattr(S.SpeculativeEngine, "step", step)
    prompts = [bundled.tokenizer.encode(t.prompt) for t in heldout_tasks(5000)[3000:3004]]
    ar = [g.token_ids for g in bundled.generate(prompts, mode="ar", max_new_tokens=24, ignore_eos=True)]
    tokens = lambda ps: [r.tokens for r in _decode(_auto_engine(bundled), ps)]
    assert tokens(prompts) == [tokens([p])[0] for p in prompts] == ar
    assert checked["fresh"] and checked["leftover"]

    eng = _auto_engine(bundled)
    row = S.SpeculativeRow(draft=[5, 6, 7, 8], draft_sure=[0.9, 0.5, 0.8, 0.1])
    assert eng.kept_whole(type("R", (), {"state": row})()) == pytest.approx(0.9 * 0.5 * 0.8)
    row.draft_sure, row.kept_draft, row.rejected_draft = None, 6, 2
    assert eng.kept_whole(type("R", (), {"state": row})()) == pytest.approx(eng.draft_policy.acceptance(6, 2) ** 3)


def test_the_adaptive_draft_saves_forwards(bundled):
    """After a rejection the leftover of the draft verifies behind AR's token, and a draft's first
    token is emitted when drafted: fewer forwards for the same tokens on held-out prompts."""
    from clover.data.tasks import heldout_tasks

    prompts = [bundled.tokenizer.encode(t.prompt) for t in heldout_tasks(5000)[3000:3006]]
    fixed, adaptive = (_spec_rows(bundled, prompts, 32, adaptive=a) for a in (False, True))
    assert [r.tokens for r in fixed] == [r.tokens for r in adaptive]
    assert sum(r.forwards for r in adaptive) < sum(r.forwards for r in fixed)


def test_auto_drafts_adaptively_and_a_fixed_width_as_before(bundled):
    """block_size="auto" is the adaptive draft (its width chosen per forward); a block size or a
    draft length is the fixed draft, as the llama.cpp port decodes it."""
    from clover.decoding.modes import get_mode
    from clover.decoding.speculative import DRAFT_CUT

    mode = get_mode("speculative")
    auto = mode.spec(bundled.params("speculative", {"block_size": "auto"}))
    assert auto.draft_cut == DRAFT_CUT
    assert mode.spec(bundled.params("speculative", {})).draft_cut == DRAFT_CUT  # auto is the default
    for kw in ({"block_size": 8}, {"draft_length": 4}, {"block_size": 16}):
        fixed = mode.spec(bundled.params("speculative", kw))
        assert fixed.draft_cut is None and not mode.make_engine(bundled.model, fixed, mask_id=2, pad_id=1).adaptive


def test_auto_draft_narrows_at_the_end_of_the_context(tiny_dir, monkeypatch):
    """The context reserves the model's block size for speculative's default adaptive draft; a wider
    draft chosen near the end narrows to what fits (no position past the context), AR's tokens."""
    from clover.decoding import speculative as S, width as W

    class Widest(W.DraftPolicy):
        def choose(self, rows):
            return W.WidthChoice(self.widths[-1], len(rows), {self.widths[-1]: 1.0})

    llm = clover.load(tiny_dir)
    ctx, block = 96, llm.config.block_size
    monkeypatch.setattr(llm.config, "max_position_embeddings", ctx)
    monkeypatch.setattr(W.DraftPolicy, "for_model", classmethod(
        lambda cls, model, measure: Widest((1, block, 2 * block), W.CostCurve())))
    seen = []
    real = llm.model.step

    def spy(cache, commit_ids=None, denoise_ids=None, **kw):
        ends = cache.lengths + sum(0 if t is None else t.shape[1] for t in (commit_ids, denoise_ids))
        seen.append((int(ends.max()), 0 if denoise_ids is None else denoise_ids.shape[1]))
        return real(cache, commit_ids=commit_ids, denoise_ids=denoise_ids, **kw)

    monkeypatch.setattr(llm.model, "step", spy)
    monkeypatch.setattr(S, "SKIP_BLOCK_BELOW", 0.0)  # every forward drafts (random weights reject every draft)
    prompt = "def f(x):"
    n = llm.room(len(llm.tokenizer.encode(prompt)), llm.params("speculative", {}), llm.mode("speculative"))
    assert n == ctx - len(llm.tokenizer.encode(prompt)) - block  # the block size reserved, not the widest draft
    out = llm.generate(prompt, mode="speculative", max_new_tokens=n, ignore_eos=True)
    spec = list(seen)
    assert out.token_ids == llm.generate(prompt, mode="ar", max_new_tokens=n, ignore_eos=True).token_ids
    assert max(end for end, _ in spec) <= ctx
    assert 2 * block in {w for _, w in spec}  # the wide draft where it fits
