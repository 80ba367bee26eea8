"""Denoise mode and the block-diffusion engine: cached == uncached, batched == one-by-one, limits."""

import pytest
import torch

import clover
from clover.checkpoint import load_model
from clover.tiny import build_tiny_checkpoint


@pytest.fixture(scope="module")
def live_dir(tmp_path_factory):
    """A tiny Clover model whose new (zero-initialised) parameters are made non-zero, so every
    branch of the bidirectional GDN is exercised."""
    d = build_tiny_checkpoint(tmp_path_factory.mktemp("live") / "m", seed=3, init_std=0.15)
    model = load_model(d)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "conv1d_right" in name or "block_gain" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    from clover.checkpoint import save_model

    save_model(model, d)
    return d


@pytest.fixture(scope="module")
def llm(live_dir):
    return clover.load(live_dir)


def test_training_forward_equals_engine_denoise(llm):
    model = llm.model
    Bs, L = 8, 32
    g = torch.Generator().manual_seed(0)
    clean = torch.randint(0, 256, (2, L), generator=g)
    noisy = clean.clone()
    noisy[torch.rand(2, L, generator=g) < 0.5] = llm.tokenizer.mask_token_id
    with torch.no_grad():
        clean_logits, noisy_logits = model.forward_block_diffusion(clean, noisy, Bs)
        torch.testing.assert_close(clean_logits, model(clean), atol=1e-4, rtol=1e-4)
        for b in range(L // Bs):
            s = b * Bs
            cache = model.make_cache(2, L + Bs)
            if s:
                model.step(cache, commit_ids=clean[:, :s])
            out = model.step(cache, denoise_ids=noisy[:, s : s + Bs])
            torch.testing.assert_close(out.denoise_logits, noisy_logits[:, s : s + Bs], atol=1e-4, rtol=1e-4)


def test_training_forward_copies_share_one_clean_stream(llm):
    """k noisy copies in one row (complementary masks) == k separate forwards, and copies never mix."""
    model = llm.model
    Bs, L = 8, 32
    g = torch.Generator().manual_seed(1)
    clean = torch.randint(0, 256, (2, L), generator=g)
    copies = []
    for _ in range(3):
        c = clean.clone()
        c[torch.rand(2, L, generator=g) < 0.6] = llm.tokenizer.mask_token_id
        copies.append(c)
    with torch.no_grad():
        cl, nl = model.forward_block_diffusion(clean, torch.cat(copies, 1), Bs)
        assert nl.shape[:2] == (2, 3 * L)
        for i, c in enumerate(copies):
            cl1, nl1 = model.forward_block_diffusion(clean, c, Bs)
            torch.testing.assert_close(cl, cl1, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(nl[:, i * L : (i + 1) * L], nl1, atol=1e-4, rtol=1e-4)
        at = torch.rand(2, 3 * L, generator=g) < 0.4  # noisy logits at selected positions only, packed
        cl2, packed = model.forward_block_diffusion(clean, torch.cat(copies, 1), Bs, noisy_logits_at=at)
        torch.testing.assert_close(cl2, cl)
        torch.testing.assert_close(packed, nl[at])
    with pytest.raises(ValueError, match="k\\*L"):
        model.forward_block_diffusion(clean, torch.cat(copies, 1)[:, :-3], Bs)


def test_fused_commit_and_denoise_equals_separate(llm):
    model = llm.model
    ids = torch.randint(0, 256, (1, 20))
    block = torch.full((1, 8), llm.tokenizer.mask_token_id)
    block[0, 2] = 65
    with torch.no_grad():
        c1 = model.make_cache(1, 64)
        fused = model.step(c1, commit_ids=ids, denoise_ids=block)
        c2 = model.make_cache(1, 64)
        sep_commit = model.step(c2, commit_ids=ids)
        sep_denoise = model.step(c2, denoise_ids=block)
    torch.testing.assert_close(fused.commit_logits, sep_commit.commit_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused.denoise_logits, sep_denoise.denoise_logits, atol=1e-5, rtol=1e-5)
    assert int(c1.lengths[0]) == int(c2.lengths[0]) == 20


@pytest.mark.parametrize("Tc,Bd", [(1, 8), (5, 8), (8, 16), (16, 16)])
def test_commit_and_block_share_one_causal_conv(llm, Tc, Bd):
    """A GDN layer's commit and denoise block in one forward run one causal conv over both parts: the
    same values, bit for bit, as the path that convolves each part on its own (a commit whose
    `n_commit` is given), outputs and the states it leaves alike."""
    from clover.models.layers import Segments

    layer = next(l.linear_attn for l in llm.model.model.layers if l.layer_type == "linear_attention")
    g = torch.Generator().manual_seed(Tc + Bd)
    x = torch.randn(2, Tc + Bd, llm.config.hidden_size, generator=g).to(layer.in_proj_qkv.weight.dtype)
    outs = []
    with torch.no_grad():
        for n in (None, torch.full((2,), Tc)):
            conv = torch.randn(2, layer.conv_dim, layer.kernel_size - 1, generator=torch.Generator().manual_seed(1))
            rec = torch.randn(2, layer.hv, layer.dk, layer.dv, generator=torch.Generator().manual_seed(2))
            y = layer(x, Segments(commit_len=Tc, denoise_len=Bd, n_commit=n), (conv, rec), records=[])
            outs.append((y, conv, rec))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@pytest.mark.parametrize("block_size", [4, 8, 32])
@pytest.mark.parametrize("prompt_len", [8, 13])
def test_cached_equals_naive(llm, block_size, prompt_len):
    prompt = list(range(40, 40 + prompt_len))
    for threshold in (0.3, 0.95):
        n = 2 * block_size + 3 if block_size < 32 else block_size + 5
        kw = dict(max_new_tokens=n, block_size=block_size, threshold=threshold, ignore_eos=True)
        cached = llm.generate(prompt, mode="diffusion", **kw)
        naive = llm.generate(prompt, mode="naive", **kw)
        assert cached.token_ids == naive.token_ids
        assert cached.decode_steps == naive.decode_steps
        assert cached.forced_tokens == naive.forced_tokens
        assert cached.stats.forwards == naive.stats.forwards
        assert len(cached.token_ids) == kw["max_new_tokens"]


def test_fusion_costs_no_extra_forward(llm):
    g = llm.generate([5, 6, 7], mode="diffusion", max_new_tokens=24, block_size=8, threshold=0.3, ignore_eos=True)
    assert g.stats.forwards == sum(g.stats.block_steps)
    assert len(g.stats.block_steps) == 3
    assert all(1 <= s <= 8 for s in g.stats.block_steps)


def test_threshold_above_one_decodes_one_token_per_step(llm):
    g = llm.generate([1, 2, 3, 4], mode="diffusion", max_new_tokens=16, block_size=8, threshold=1.5, ignore_eos=True)
    assert g.stats.forwards == 16 and g.stats.tokens_per_forward == 1.0
    assert g.stats.block_steps == [8, 8]
    assert sorted(g.decode_steps[:8]) == list(range(1, 9))
    assert g.stats.forced_steps == 16  # nothing can reach 1.5: every step commits its best position
    assert g.forced_tokens == list(range(16))


def test_forced_steps_count_steps_without_a_confident_position(llm, monkeypatch):
    import clover.decoding.diffusion as engine

    kw = dict(max_new_tokens=24, block_size=8, ignore_eos=True)
    easy = llm.generate([5, 6, 7], mode="diffusion", threshold=1e-6, **kw)
    assert easy.stats.forced_steps == 0 and easy.stats.forwards == 3  # every position passes at once
    best = []  # the highest confidence each denoise step saw
    propose = engine.propose_tokens

    def spy(*a, **k):
        toks, conf = propose(*a, **k)
        best.append(float(conf.max()))
        return toks, conf

    monkeypatch.setattr(engine, "propose_tokens", spy)
    mixed = []
    for threshold in (0.05, 0.1, 0.3):
        best.clear()
        g = llm.generate([5, 6, 7], mode="diffusion", threshold=threshold, **kw)
        assert len(best) == g.stats.forwards
        assert g.stats.forced_steps == sum(b < threshold for b in best)
        assert g.as_dict()["stats"]["forced_steps"] == g.stats.forced_steps
        assert len(g.forced_tokens) == g.stats.forced_steps  # a forced step commits exactly one token
        assert g.forced_tokens == sorted(set(g.forced_tokens)) and all(0 <= k < len(g.token_ids) for k in g.forced_tokens)
        mixed.append(0 < g.stats.forced_steps < g.stats.forwards)
    assert any(mixed)  # some step passed the threshold, some did not


def test_block_size_one_equals_ar_greedy(llm):
    for prompt in ([9, 8, 7], list(range(100, 117))):
        ar = llm.generate(prompt, mode="ar", max_new_tokens=12, ignore_eos=True)
        d1 = llm.generate(prompt, mode="diffusion", max_new_tokens=12, block_size=1, ignore_eos=True)
        assert d1.token_ids == ar.token_ids


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_batched_equals_one_by_one(llm, mode):
    prompts = [list(range(30, 35)), list(range(60, 79)), [200, 3, 4, 5, 6, 7, 8, 9, 10]]
    kw = dict(mode=mode, max_new_tokens=20, block_size=8, threshold=0.3, ignore_eos=True)
    batch = llm.generate(prompts, **kw)
    for p, got in zip(prompts, batch):
        alone = llm.generate(p, **kw)
        assert got.token_ids == alone.token_ids
        assert got.decode_steps == alone.decode_steps


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_seeded_sampling_is_reproducible(llm, mode):
    kw = dict(mode=mode, max_new_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=1234, block_size=8, ignore_eos=True)
    a = llm.generate([1, 2, 3], **kw)
    b = llm.generate([1, 2, 3], **kw)
    c = llm.generate([1, 2, 3], **{**kw, "seed": 99})
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


@pytest.mark.parametrize("mode", ["ar", "diffusion", "naive"])
def test_eos_ends_generation(llm, mode):
    eos = llm.tokenizer.eos_token_id
    # bias towards EOS so it is accepted early; nothing from EOS on may be returned
    g = llm.generate([10, 11, 12], mode=mode, max_new_tokens=24, block_size=8, eos_penalty=-6.0)
    assert g.finish_reason == "stop"
    assert eos not in g.token_ids
    assert len(g.token_ids) < 24
    free = llm.generate([10, 11, 12], mode=mode, max_new_tokens=24, block_size=8, eos_penalty=-6.0, ignore_eos=True)
    if mode == "ar":  # the same tokens up to where EOS was chosen
        assert free.token_ids[: len(g.token_ids)] == g.token_ids


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_stop_strings_cut_text(llm, mode):
    kw = dict(mode=mode, max_new_tokens=30, block_size=8, threshold=0.3, ignore_eos=True)
    full = llm.generate("abc", **kw)
    assert llm.generate("abc", stop=None, **kw).token_ids == full.token_ids  # None = no stop strings
    text = full.text
    stop = text[10:12]
    cut = llm.generate("abc", stop=[stop], **kw)
    assert cut.finish_reason == "stop"
    assert cut.text == text[: text.find(stop)]
    assert stop not in cut.text
    assert all(k < len(cut.token_ids) for k in cut.forced_tokens)  # the cut tokens leave the forced list too
    # the row ends as soon as the decoded prefix of a block holds the stop string
    assert cut.stats.forwards <= full.stats.forwards


def test_decoded_stop_caps_the_block(llm):
    """Once a block position holds a stop token (or a token whose text is a stop string), later
    positions are never decoded: with one token per step the block ends after exactly the positions
    up to the stop."""
    kw = dict(mode="diffusion", max_new_tokens=16, block_size=16, threshold=2.0, ignore_eos=True)
    checked = 0
    for prompt in ("abc", "hello", "xyz", "clover", "12345", "def f", "import os", "qwerty"):
        free = llm.generate(prompt, **kw)
        p = free.decode_steps.index(1)  # the position decoded first
        tok = free.token_ids[p]
        if p < 1 or tok in free.token_ids[:p]:
            continue
        ch = llm.tokenizer.decode([tok])
        stops = [dict(stop_token_ids=[tok])]
        if len(ch) == 1 and ch != "\ufffd" and ch not in llm.tokenizer.decode(free.token_ids[:p]):
            stops.append(dict(stop=[ch]))
        for stop in stops:
            cut = llm.generate(prompt, **stop, **kw)
            assert cut.finish_reason == "stop"
            assert (ch not in cut.text) if "stop" in stop else (tok not in cut.token_ids)
            assert cut.stats.forwards <= p + 1 < free.stats.forwards
            naive = llm.generate(prompt, **stop, **{**kw, "mode": "naive"})
            assert naive.token_ids == cut.token_ids and naive.stats.forwards == cut.stats.forwards
            checked += 1
    assert checked >= 2


def test_stream_matches_generate(llm):
    kw = dict(mode="diffusion", max_new_tokens=20, block_size=8, threshold=0.3, ignore_eos=True)
    g = llm.generate("hello", **kw)
    events = list(llm.stream("hello", provisional=True, **kw))
    blocks = [e for e in events if e.kind == "block"]
    prov = [e for e in events if e.kind == "provisional"]
    assert events[-1].kind == "done" and events[-1].generation.token_ids == g.token_ids
    assert "".join(e.text for e in blocks) == g.text
    assert sum(len(e.token_ids) for e in blocks) == len(g.token_ids)
    assert len(prov) == g.stats.forwards
    # provisional states only ever fill in: a decoded position keeps its token and step
    for a, b in zip(prov, prov[1:]):
        if a.block == b.block:
            for ta, tb in zip(a.token_ids, b.token_ids):
                assert ta is None or ta == tb


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(block_size=0),
        dict(block_size=-3),
        dict(threshold=0),
        dict(threshold=-0.5),
        dict(max_new_tokens=-1),
        dict(confidence="vibes"),
        dict(top_p=0),
        dict(temperature=-1),
    ],
)
def test_bad_parameters_raise(llm, kwargs):
    with pytest.raises(ValueError):
        llm.generate("x", mode="diffusion", **kwargs)


def test_prompt_longer_than_context(llm):
    with pytest.raises(ValueError, match="context length"):
        llm.generate([5] * (llm.config.max_position_embeddings + 1), mode="diffusion", max_new_tokens=4)
    with pytest.raises(ValueError, match="context length"):
        llm.generate([5] * 10, mode="ar", max_new_tokens=llm.config.max_position_embeddings)


@pytest.mark.parametrize("confidence", ["margin", "entropy"])
def test_confidence_kinds_run(llm, confidence):
    g = llm.generate([1, 2], mode="diffusion", max_new_tokens=16, block_size=8, threshold=0.2, confidence=confidence, ignore_eos=True)
    assert len(g.token_ids) == 16


def test_max_new_tokens_zero(llm):
    for mode in ("ar", "diffusion"):
        g = llm.generate("hi", mode=mode, max_new_tokens=0)
        assert g.token_ids == [] and g.finish_reason == "length"


@pytest.mark.parametrize("has_room", [True, False])
def test_convert_keeps_commit_mode_and_adds_mask(tmp_path, has_room):
    from hf_reference import hf_config, hf_model

    from clover.convert import convert_to_clover
    from clover.tokenizer import SPECIAL_TOKENS, write_byte_tokenizer

    specials = tuple(t for t in SPECIAL_TOKENS if t != "<|mask|>")
    vocab = 300 if has_room else 256 + len(specials)
    ref = hf_model(hf_config(vocab_size=vocab, eos_token_id=256), seed=5)
    src = tmp_path / "ar"
    ref.save_pretrained(src)
    write_byte_tokenizer(src, specials=specials)
    cfg = convert_to_clover(src, tmp_path / "clover", progress=False)
    assert cfg.is_clover and cfg.mask_token_id == 256 + len(specials)
    assert cfg.vocab_size == (300 if has_room else vocab + 1)
    llm = clover.load(tmp_path / "clover")
    assert llm.tokenizer.mask_token_id == cfg.mask_token_id
    assert llm.tokenizer.decode([cfg.mask_token_id]) == "<|mask|>"
    ids = torch.randint(0, 256, (1, 24))
    with torch.no_grad():
        torch.testing.assert_close(llm.model(ids)[..., :vocab], ref(ids).logits, atol=1e-4, rtol=1e-4)
    g = llm.generate([5, 6, 7], mode="diffusion", max_new_tokens=8, block_size=4, ignore_eos=True)
    assert len(g.token_ids) == 8
    with pytest.raises(ValueError, match="already a Clover"):
        convert_to_clover(tmp_path / "clover", tmp_path / "again", progress=False)


# --------------------------------------------------------------------------- what a forward computes
def _step_pair(model, live: bool, **kw):
    """A ragged commit fused with a denoise block, then an AR step, on a fresh cache; the model's
    `live_positions` off computes every position (the exact path)."""
    saved = model.live_positions
    model.live_positions = live
    try:
        g = torch.Generator().manual_seed(5)
        with torch.inference_mode():
            cache = model.make_cache(2, 96)
            model.step(cache, commit_ids=torch.randint(3, 250, (2, 12), generator=g), n_commit=torch.tensor([12, 9]))
            out = model.step(cache, commit_ids=torch.randint(3, 250, (2, 8), generator=g), n_commit=torch.tensor([8, 5]),
                             **kw)
            ar = model.step(cache, commit_ids=torch.randint(3, 250, (2, 1), generator=g))
        return out, ar, cache
    finally:
        model.live_positions = saved


def _block(llm, B=2, Bd=8):
    blk = torch.full((B, Bd), llm.tokenizer.mask_token_id)
    blk[0, :3] = torch.tensor([50, 60, 70])
    blk[1, 5] = 99
    need = torch.zeros(B, Bd, dtype=torch.bool)
    need[0, 2:6] = True
    need[1, [0, 1, 3, 6]] = True
    return blk, need


@pytest.mark.parametrize("all_logits", [False, True])
def test_forward_computes_only_the_positions_it_reads(llm, all_logits):
    """Eagerly the last layer computes only where logits are read: every output the step returns
    or writes equals the full forward's."""
    blk, need = _block(llm)
    kw = dict(denoise_ids=blk, denoise_need=need, all_logits=all_logits)
    full, full_ar, full_cache = _step_pair(llm.model, False, **kw)
    live, live_ar, live_cache = _step_pair(llm.model, True, **kw)
    torch.testing.assert_close(live.commit_logits, full.commit_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(live.denoise_logits[need], full.denoise_logits[need], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(live_ar.commit_logits, full_ar.commit_logits, atol=1e-4, rtol=1e-4)
    for a, b in zip(live_cache.layers, full_cache.layers):
        for x, y in zip(a.tensors(), b.tensors()):
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)


def test_frozen_positions_read_their_memo(llm):
    """skip_decoded's mechanics: positions frozen with a memo of the same inputs give the full
    forward's logits; the memo holds each layer's block inputs."""
    model = llm.model
    blk, need = _block(llm)
    memo: list = []
    first, _, _ = _step_pair(model, True, denoise_ids=blk, denoise_need=need, denoise_memo=memo)
    assert len(memo) == len(model.model.layers) and all(t.shape[:2] == (2, 8) for layer in memo for t in layer)
    frozen = torch.zeros(2, 8, dtype=torch.bool)
    frozen[0, :2] = True  # decoded, their own predictions not needed
    frozen[1, 5] = True
    again, _, _ = _step_pair(model, True, denoise_ids=blk, denoise_need=need, denoise_memo=list(memo), denoise_frozen=frozen)
    torch.testing.assert_close(again.denoise_logits[need], first.denoise_logits[need], atol=1e-4, rtol=1e-4)
    moved = [list(layer) for layer in memo]
    moved[0][0] = moved[0][0] + 1.0  # a stale memo changes what the others read
    stale, _, _ = _step_pair(model, True, denoise_ids=blk, denoise_need=need,
                             denoise_memo=[tuple(x) for x in moved], denoise_frozen=frozen)
    assert not torch.allclose(stale.denoise_logits[need], first.denoise_logits[need], atol=1e-4)


def test_a_row_whose_block_ends_early_computes_the_cut_block(llm):
    """skip_window's mechanics: `denoise_valid` ends each row's block at its own point, which is what
    the row computes alone with the block cut there (batched == one-by-one)."""
    model = llm.model
    blk, need = _block(llm)
    ends = [6, 4]
    valid = torch.arange(8)[None, :] < torch.tensor(ends)[:, None]
    need = need & valid
    both, _, _ = _step_pair(model, True, denoise_ids=blk, denoise_need=need, denoise_valid=valid, denoise_width=8)
    for b, e in enumerate(ends):
        g = torch.Generator().manual_seed(5)
        with torch.inference_mode():
            cache = model.make_cache(2, 96)
            model.step(cache, commit_ids=torch.randint(3, 250, (2, 12), generator=g), n_commit=torch.tensor([12, 9]))
            alone = model.step(cache, commit_ids=torch.randint(3, 250, (2, 8), generator=g), n_commit=torch.tensor([8, 5]),
                               denoise_ids=blk[:, :e], denoise_need=need[:, :e], denoise_width=8)
        torch.testing.assert_close(both.denoise_logits[b, :e][need[b, :e]], alone.denoise_logits[b][need[b, :e]],
                                   atol=1e-4, rtol=1e-4)


SKIPS = [dict(skip_window=True), dict(skip_decoded=True), dict(skip_window=True, skip_decoded=True)]


def test_skip_window_changes_nothing_where_nothing_is_cut(llm):
    """Without sub-blocks, stops or EOS no position is right of the window: skip_window gives the
    exact path's tokens."""
    kw = dict(mode="diffusion", max_new_tokens=24, block_size=8, ignore_eos=True)
    for prompt in ([5, 6, 7], list(range(40, 53))):
        for threshold in (0.3, 0.95):
            exact = llm.generate(prompt, threshold=threshold, **kw)
            assert llm.generate(prompt, threshold=threshold, skip_window=True, **kw).token_ids == exact.token_ids


@pytest.mark.parametrize("skips", SKIPS, ids=lambda d: "+".join(d))
def test_skips_keep_batched_equal_to_one_by_one(llm, skips):
    prompts = [list(range(30, 35)), list(range(60, 79)), [200, 3, 4, 5, 6, 7, 8, 9, 10]]
    kw = dict(mode="diffusion", max_new_tokens=20, block_size=8, threshold=0.9, sub_block=4, ignore_eos=True, **skips)
    batch = llm.generate(prompts, **kw)
    for p, got in zip(prompts, batch):
        alone = llm.generate(p, **kw)
        assert got.token_ids == alone.token_ids
        assert got.decode_steps == alone.decode_steps


def test_skips_cut_and_freeze_positions(llm, monkeypatch):
    """The options do what they say: sub-blocks leave positions right of the window out of the
    forward, a block decoded over several steps freezes decoded positions."""
    model = llm.model
    seen = {"width": [], "frozen": 0}
    step = model.step

    def spy(cache, **kw):
        if kw.get("denoise_ids") is not None:
            seen["width"].append(kw["denoise_ids"].shape[1])
            if kw.get("denoise_frozen") is not None:
                seen["frozen"] += int(kw["denoise_frozen"].sum())
        return step(cache, **kw)

    monkeypatch.setattr(model, "step", spy)
    llm.generate([5, 6, 7], mode="diffusion", max_new_tokens=16, block_size=16, sub_block=4, threshold=0.9,
                 ignore_eos=True, skip_window=True)
    assert min(seen["width"]) == 4 and max(seen["width"]) <= 16
    llm.generate([5, 6, 7], mode="diffusion", max_new_tokens=16, block_size=16, threshold=2.0, ignore_eos=True,
                 skip_decoded=True)
    assert seen["frozen"] > 0


def test_a_finished_row_costs_nothing_after(llm, monkeypatch):
    """A row whose output has ended leaves the batch after the forward that ended it."""
    from clover.decoding import get_mode
    from clover.decoding.modes import resolve_params

    model = llm.model
    mode = get_mode("diffusion")
    kw = dict(block_size=8, threshold=2.0, ignore_eos=True)
    short, long_ = (llm.row([5, 6, 7], resolve_params(mode, dict(max_new_tokens=n, **kw), llm.config)) for n in (8, 24))
    engine = llm.engine(mode.spec(short.params))
    rows = []
    step = model.step

    def spy(cache, **kw):
        rows.append(cache.batch_size)
        return step(cache, **kw)

    monkeypatch.setattr(model, "step", spy)
    engine.add(short)
    engine.add(long_)
    for _ in engine.run():
        pass
    assert len(short.tokens) == 8 and len(long_.tokens) == 24
    assert rows == [2] * short.forwards + [1] * (long_.forwards - short.forwards)
