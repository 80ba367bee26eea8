"""DFlash block drafter: the published checkpoint layout, the refusal of a drafter for another target,
the cached draft equal to the training forward, and the `dflash` mode lossless w.r.t. AR (greedy token
for token, alone and batched; sampling through the rejection rule, a statistical test)."""

import json
import math

import pytest
import torch
from safetensors import safe_open

import clover
from clover.checkpoint import load_drafter, save_drafter
from clover.decoding.dflash import DFlashEngine
from clover.models.dflash import DFlashConfig, DrafterMismatch, build_drafter, drafter_config_for
from clover.tiny import build_tiny_checkpoint
from heldout import held_out_prompts


def _drafter_dir(tmp_path, target_config, name="drafter", seed=1, **kw):
    kw.setdefault("num_hidden_layers", 2)
    kw.setdefault("block_size", 8)
    cfg = drafter_config_for(target_config, **kw)
    return save_drafter(build_drafter(cfg, seed=seed), tmp_path / name)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("dflash") / "target", seed=3, init_std=0.2)


@pytest.fixture(scope="module")
def llm(target_dir, tmp_path_factory):
    base = clover.load(target_dir)
    d = _drafter_dir(tmp_path_factory.mktemp("drafter"), base.config)
    return clover.load(target_dir, drafter=d)


# ------------------------------------------------------------------------------ the layout
def test_published_layout_round_trip(tmp_path, llm):
    d = save_drafter(llm.drafter, tmp_path / "d")
    raw = json.loads((d / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"]
    assert raw["dflash_config"]["target_layer_ids"] == llm.drafter.target_layer_ids
    assert raw["dflash_config"]["mask_token_id"] == llm.config.mask_token_id
    assert raw["block_size"] == 8 and raw["num_target_layers"] == llm.config.num_hidden_layers
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    n = len(llm.drafter.target_layer_ids)
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        assert tuple(f.get_slice("fc.weight").get_shape()) == (llm.config.hidden_size, n * llm.config.hidden_size)
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(2):
        expected |= {f"layers.{i}.{p}.weight" for p in (
            "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
            "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert keys == expected  # no embedding, no LM head: the target's
    again = load_drafter(d, llm.model)
    for (k, a), (_, b) in zip(sorted(llm.drafter.state_dict().items()), sorted(again.state_dict().items())):
        torch.testing.assert_close(a, b, msg=k)


def test_reference_config_keys_are_read(tmp_path, llm):
    """A config as z-lab writes it: block_size at the top, mask token and layer ids in dflash_config,
    rope_theta at the top level; a "model." key prefix is accepted."""
    d = save_drafter(llm.drafter, tmp_path / "d")
    raw = json.loads((d / "config.json").read_text())
    raw.pop("rope_parameters")
    raw["rope_theta"] = 10000.0
    raw["dflash_config"]["block_size"] = raw.pop("block_size")
    (d / "config.json").write_text(json.dumps(raw))
    cfg = DFlashConfig.from_file(d)
    assert cfg.block_size == 8 and cfg.rope_theta == 10000.0 and cfg.mask_token_id == llm.config.mask_token_id


@pytest.mark.parametrize("change, words", [
    ({"hidden_size": 32, "num_attention_heads": 2, "head_dim": 16}, "hidden_size 32"),
    ({"vocab_size": 999}, "vocab_size 999"),
    ({"target_layer_ids": [1, 7]}, "layer 7"),
    ({"num_target_layers": 12}, "num_target_layers 12"),
])
def test_wrong_target_is_refused_in_one_line(tmp_path, target_dir, llm, change, words):
    cfg = drafter_config_for(llm.config, num_hidden_layers=1, block_size=8)
    for k, v in change.items():
        setattr(cfg, k, v)
    d = save_drafter(build_drafter(cfg), tmp_path / "wrong")
    with pytest.raises(DrafterMismatch) as e:
        clover.load(target_dir, drafter=d)
    msg = str(e.value)
    assert words in msg and "\n" not in msg and msg.startswith("drafter:")


def test_dflash_needs_a_drafter(target_dir):
    plain = clover.load(target_dir)
    with pytest.raises(ValueError, match="needs a DFlash drafter"):
        plain.generate([1, 2, 3], mode="dflash", max_new_tokens=4)


def _context_features(llm, seed: int):
    """Two random rows of 30 tokens through the target: (ids, the drafter's target layers' hidden
    states, the drafter's context features of them)."""
    m, dr = llm.model, llm.drafter
    ids = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(seed))
    hidden = dict.fromkeys(dr.target_layer_ids)
    m(ids, hidden_out=hidden)
    return ids, hidden, dr.context_features(hidden, m)


def test_cached_draft_equals_training_forward(llm):
    m, dr = llm.model, llm.drafter
    with torch.no_grad():
        ids, hidden, ctx = _context_features(llm, seed=0)
        anchors = torch.tensor([[12, 5], [20, 9]])
        block = torch.full((2, 2, 8), dr.mask_token_id)
        block[:, :, 0] = ids.gather(1, anchors)
        train = dr.forward_train(ctx, anchors, dr.embed(block, m))
        for b in range(2):
            for j in range(2):
                a = int(anchors[b, j])
                cache = dr.make_cache(1, 8)  # grows as needed
                dr.draft(cache, ctx[b : b + 1, :3], None, dr.embed(block[b : b + 1, j], m))  # context in two pieces
                out = dr.draft(cache, ctx[b : b + 1, 3:a], None, dr.embed(block[b : b + 1, j], m))
                torch.testing.assert_close(out[0], train[b, j], atol=1e-5, rtol=1e-5)
        # the target's hidden states from the cached step equal the plain forward's
        cache = m.make_cache(2, 64)
        got = dict.fromkeys(dr.target_layer_ids)
        m.step(cache, commit_ids=ids[:, :20], hidden_out=got)
        for i in got:
            torch.testing.assert_close(got[i], hidden[i][:, :20], atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ lossless
def _oracle(monkeypatch, llm, refs: dict, wrong_every: int):
    """Drafts from the AR reference continuation of each row's prompt, every `wrong_every`-th wrong:
    acceptance of every length, rollback after partial accepts, full accepts."""
    real = DFlashEngine._draft
    calls = {"n": 0}

    def draft(self, rows):
        drafts, q = real(self, rows)
        for i, r in enumerate(rows):
            if drafts[i] is None:
                continue
            ref = refs[tuple(r.prompt)]
            k = len(r.tokens)
            d = (ref[k : k + self.draft_length] + [0] * self.draft_length)[: self.draft_length]
            calls["n"] += 1
            cut = calls["n"] % wrong_every
            if cut < len(d):
                d[cut] = (d[cut] + 1) % 256
            drafts[i] = d
        return drafts, q

    monkeypatch.setattr(DFlashEngine, "_draft", draft)


@pytest.mark.parametrize("seed", [0, 1])
def test_dflash_equals_ar_greedy_alone(llm, seed):
    g = torch.Generator().manual_seed(seed)
    for plen in (3, 17):
        prompt = torch.randint(0, 256, (plen,), generator=g).tolist()
        ar = llm.generate(prompt, mode="ar", max_new_tokens=20, ignore_eos=True)
        df = llm.generate(prompt, mode="dflash", max_new_tokens=20, ignore_eos=True)
        assert df.token_ids == ar.token_ids
        assert df.stats.forwards == len(df.stats.accept_lengths) + 1  # + the prefill
        assert df.stats.draft_forwards == len(df.stats.accept_lengths)


def test_dflash_equals_ar_with_oracle_drafts_batched(monkeypatch, llm):
    prompts = [[1, 2, 3], list(range(50, 70)), [9] * 5, [200, 7]]
    kw = dict(max_new_tokens=40, ignore_eos=True)
    ar = llm.generate(prompts, mode="ar", **kw)
    refs = {tuple(p): a.token_ids for p, a in zip(prompts, ar)}
    _oracle(monkeypatch, llm, refs, wrong_every=11)
    batched = llm.generate(prompts, mode="dflash", **kw)
    alone = [llm.generate(p, mode="dflash", **kw) for p in prompts]
    for a, b, s in zip(ar, batched, alone):
        assert b.token_ids == a.token_ids and s.token_ids == a.token_ids
        assert max(b.stats.accept_lengths) == 8  # full accepts (7 drafts + 1) happened
        assert min(b.stats.accept_lengths) < 8
        assert b.stats.forwards < a.stats.forwards / 2


@pytest.mark.parametrize("kw", [
    dict(eos_penalty=-3.0),
    dict(repetition_penalty=1.3, ignore_eos=True),
    dict(presence_penalty=0.7, no_repeat_ngram_size=2, ignore_eos=True),
    dict(stop=["a", "\x05"], ignore_eos=True),
    dict(stop_token_ids=[17, 40], ignore_eos=True),
])
def test_dflash_options_as_ar(monkeypatch, llm, kw):
    prompts = [[1, 2, 3], list(range(50, 70)), [9] * 5]
    ar = llm.generate(prompts, mode="ar", max_new_tokens=25, **kw)
    refs = {tuple(p): a.token_ids + [5] * 30 for p, a in zip(prompts, ar)}
    _oracle(monkeypatch, llm, refs, wrong_every=4)
    df = llm.generate(prompts, mode="dflash", max_new_tokens=25, **kw)
    for a, b in zip(ar, df):
        assert (b.token_ids, b.finish_reason, b.text) == (a.token_ids, a.finish_reason, a.text)


def test_dflash_draft_length_limit(llm):
    with pytest.raises(ValueError, match="draft_length"):
        llm.generate([1, 2], mode="dflash", max_new_tokens=4, draft_length=8)  # the drafter's block is 8
    out = llm.generate([1, 2], mode="dflash", max_new_tokens=12, draft_length=3, ignore_eos=True)
    assert out.token_ids == llm.generate([1, 2], mode="ar", max_new_tokens=12, ignore_eos=True).token_ids
    assert all(a <= 4 for a in out.stats.accept_lengths)


@pytest.mark.parametrize("cut, width", [(1.01, 4), (0.0, 8)])  # every draft cut to the narrowest width; none cut
def test_draft_cut_narrows_the_verify_and_keeps_ar(monkeypatch, llm, cut, width):
    """The default draft ends before its first token the drafter gives less than `DRAFT_CUT`, and
    the verify runs at the narrowest of the drafter's widths that holds it (batched: the widest any
    row needs); a draft length asked for is never cut. Greedy output stays AR's."""
    import clover.decoding.dflash as dflash_mode

    monkeypatch.setattr(dflash_mode, "DRAFT_CUT", cut)
    assert llm.drafter.verify_widths == (4, 8)
    widths = []
    real = llm.model.step

    def step(cache, *a, **kw):
        if cache.record is not None:  # a verify (a prefill is never rolled back)
            widths.append(kw["commit_ids"].shape[1])
        return real(cache, *a, **kw)

    monkeypatch.setattr(llm.model, "step", step)
    prompts = [[1, 2, 3], list(range(50, 70)), [9] * 5]
    kw = dict(max_new_tokens=30, ignore_eos=True)
    ar = llm.generate(prompts, mode="ar", **kw)
    batched = llm.generate(prompts, mode="dflash", **kw)
    alone = [llm.generate(p, mode="dflash", **kw) for p in prompts]
    for a, b, s in zip(ar, batched, alone):
        assert b.token_ids == a.token_ids and s.token_ids == a.token_ids
    assert widths and set(widths) == {width}
    widths.clear()
    asked = llm.generate(prompts[0], mode="dflash", draft_length=7, **kw)
    assert asked.token_ids == ar[0].token_ids and set(widths) == {8}


# ------------------------------------------------------------------------------ sampling
def test_dflash_sampling_keeps_ar_distribution(monkeypatch, llm):
    """The second token (the first draft, through accept / reject / residual) follows the target's
    distribution: sum over t1 of p(t1) p(t2 | t1), with top_k = 4, over 600 rows; the draft for it
    comes from q = (p + uniform over the target's raw top 8) / 2, so both branches of the rule run."""
    prompt = [10, 20, 30]
    kw = dict(temperature=1.0, top_k=4)
    m = llm.model
    real = DFlashEngine._draft

    memo: dict[tuple, torch.Tensor] = {}  # the rows share 4 contexts

    def draft(self, rows):
        drafts, q = real(self, rows)
        for i, r in enumerate(rows):
            if drafts[i] is None:
                continue
            key = tuple(r.prompt + r.tokens)
            if key not in memo:
                with torch.no_grad():
                    logits = m(torch.tensor([list(key)]))[0, -1:]
                p = self._probs(r, logits)[0]
                u = torch.zeros_like(p)
                u[logits[0].topk(8).indices] = 1 / 8
                memo[key] = (p + u) / 2
            drafts[i][0] = int(torch.multinomial(memo[key], 1, generator=r.state.sampler.generator))
            q[i][0] = memo[key]
        return drafts, q

    monkeypatch.setattr(DFlashEngine, "_draft", draft)

    def dist(ids):
        with torch.no_grad():
            logits = m(torch.tensor([ids]))[0, -1]
        top = logits.topk(4)
        return dict(zip(top.indices.tolist(), top.values.softmax(-1).tolist()))

    expected: dict[int, float] = {}
    for t1, p1 in dist(prompt).items():
        for t2, p2 in dist(prompt + [t1]).items():
            expected[t2] = expected.get(t2, 0.0) + p1 * p2
    N = 600
    torch.manual_seed(7)  # rows of one request share the options: unseeded, they draw from the global generator
    outs = llm.generate([prompt] * N, mode="dflash", max_new_tokens=2, ignore_eos=True, **kw)
    counts: dict[int, int] = {}
    for o in outs:
        counts[o.token_ids[1]] = counts.get(o.token_ids[1], 0) + 1
    assert set(counts) <= set(expected)
    chi2 = sum((counts.get(t, 0) - N * p) ** 2 / (N * p) for t, p in expected.items() if N * p >= 5)
    dof = sum(1 for p in expected.values() if N * p >= 5) - 1
    # p < 1e-3 for a chi-square with dof degrees of freedom: mean dof, sd sqrt(2 dof); 3.3 sd is ~1e-3
    assert chi2 < dof + 3.3 * math.sqrt(2 * dof) + 6, (chi2, dof, counts, expected)


def _drafter_recipe(target_dir, dflash: str = "") -> str:
    """A stage "drafter" recipe of two steps for `target_dir`; `dflash`: more lines of its [dflash] table."""
    return f'''name = "d"
stage = "drafter"
init = "{target_dir}"
[data]
tokenizer = "{target_dir}"
seq_len = 40
batch_size = 2
distill_fraction = 1.0
distill_tasks = 4
distill_code = 2
[dflash]
block_size = 8
layers = 1
anchors = 4
{dflash}[optim]
steps = 2
warmup_steps = 1
[run]
threads = 1
autocast = "none"
progress = false
'''


# ------------------------------------------------------------------------------ training
def test_train_a_drafter_resume_and_export(tmp_path, target_dir):
    """`clover train` stage "drafter": the target's greedy outputs, one document per row; a checkpoint
    resumes; the export is a drafter in the published layout that loads next to its target."""
    from clover.train import load_recipe
    from clover.train.trainer import Trainer, export_model

    recipe = tmp_path / "r.toml"
    recipe.write_text(_drafter_recipe(target_dir))
    r = load_recipe(recipe, {"run.out": str(tmp_path / "run")})
    t = Trainer(r, quiet=True)
    hist = t.train()
    assert len(hist) == 2 and all(math.isfinite(h["loss"]) and 0 < h["valid"] <= 1 for h in hist)
    t2 = Trainer(load_recipe(recipe, {"run.out": str(tmp_path / "run"), "optim.steps": 3}), quiet=True)
    assert t2.step == 2 and len(t2.train()) == 1
    out = export_model(tmp_path / "run" / "ckpt" / "step-00000003", tmp_path / "exported")
    llm = clover.load(target_dir, drafter=out)
    assert llm.drafter.block_size == 8 and llm.drafter.dtype == torch.float32
    got = llm.generate([1, 2, 3], mode="dflash", max_new_tokens=10, ignore_eos=True)
    assert got.token_ids == llm.generate([1, 2, 3], mode="ar", max_new_tokens=10, ignore_eos=True).token_ids


def test_bundled_model_ships_its_drafter():
    llm = clover.load()
    assert llm.drafter is not None and llm.mode_available("dflash")
    prompt = "def fibonacci(n):"
    df = llm.generate(prompt, mode="dflash", max_new_tokens=24)
    assert df.token_ids == llm.generate(prompt, mode="ar", max_new_tokens=24).token_ids
    assert df.stats.forwards < 24 and df.stats.draft_forwards == len(df.stats.accept_lengths)


def test_bundled_dflash_equals_ar_on_held_out_prompts_batched_and_alone():
    """The goal's check with the shipped drafter: on held-out task prompts and `def` headers,
    greedy dflash gives AR's tokens, every row of one batch and each prompt alone, and drafts pay
    (fewer target forwards than tokens)."""
    llm = clover.load()
    prompts = held_out_prompts(12)
    kw = dict(max_new_tokens=32)
    ar = [llm.generate(p, mode="ar", **kw) for p in prompts]
    batched = llm.generate(prompts, mode="dflash", **kw)
    alone = [llm.generate(p, mode="dflash", **kw) for p in prompts]
    for p, a, b, s in zip(prompts, ar, batched, alone):
        assert b.token_ids == a.token_ids, p
        assert s.token_ids == a.token_ids, p
        assert (b.finish_reason, s.finish_reason) == (a.finish_reason, a.finish_reason)
    tokens = sum(s.stats.tokens for s in alone)
    assert sum(s.stats.forwards for s in alone) < 0.6 * tokens


# ------------------------------------------------------------------------------ draft "auto"
def test_adaptive_draft_length_stays_identical_to_ar(monkeypatch, llm, alternating_policy):
    """block_size="auto": the block (anchor + drafts) changes every iteration (an alternating
    policy), rows batched, oracle drafts with rejections: the tokens stay AR's; the choices and why
    are recorded."""
    from clover.decoding import width as W
    from clover.decoding.base import RowState
    from clover.decoding.sampling import SamplingParams

    prompts = [[1, 2, 3], list(range(50, 70)), [9] * 5]
    ar = llm.generate(prompts, mode="ar", max_new_tokens=40, ignore_eos=True)
    _oracle(monkeypatch, llm, {tuple(p): a.token_ids for p, a in zip(prompts, ar)}, wrong_every=5)
    curve = W.CostCurve()
    curve.add("verify", 1, 2, 1.0)
    eng = DFlashEngine(llm.model, llm.drafter, draft_length="auto", draft_policy=alternating_policy((2, 4, 8), curve))
    eos = set(llm.config.eos_token_ids)
    rows = [RowState(list(p), SamplingParams(max_new_tokens=40, ignore_eos=True), eos) for p in prompts]
    for r in rows:
        eng.add(r)
    list(eng.run())
    assert [r.tokens for r in rows] == [a.token_ids for a in ar]
    assert len(eng.choices) > 3 and {c.width for c in eng.choices} == {2, 4, 8}
    assert max(a for r in rows for a in r.accept_lengths) > 4 and "draft width" in rows[0].width_why[0]


@pytest.mark.parametrize("sure", [0.05, 0.99])
def test_adaptive_draft_follows_acceptance(monkeypatch, llm, sure):
    """The measured iteration cost and the row's acceptance rate pick the block: a short one for a
    row whose drafts are rejected, the drafter's whole block for one whose drafts are kept (the
    prior decides here); greedy tokens equal AR's either way."""
    from clover.decoding import dflash as DF
    from clover.decoding import width as W

    curve = W.CostCurve()
    for b in (2, 4, 8):
        curve.add("verify", 1, b, 1.0 + b / 4)
    monkeypatch.setattr(DF, "iteration_curve", lambda model, drafter, blocks: curve)
    monkeypatch.setattr(W.DraftPolicy, "PRIOR_RATE", sure)
    monkeypatch.setattr(W.DraftPolicy, "PRIOR_N", 1000.0)
    kw = dict(max_new_tokens=20, ignore_eos=True)
    got = llm.generate([1, 2, 3], mode="dflash", block_size="auto", **kw)
    assert got.token_ids == llm.generate([1, 2, 3], mode="ar", **kw).token_ids
    want = 2 if sure < 0.5 else 8
    assert f"draft width {want}" in got.stats.width_why[0] and max(got.stats.accept_lengths) <= want
    with pytest.raises(ValueError, match="draft_length"):
        llm.generate([1, 2, 3], mode="dflash", block_size="auto", draft_length=3, **kw)


def test_iteration_curve_is_measured_per_block(llm):
    from clover.decoding.dflash import iteration_curve

    curve = iteration_curve(llm.model, llm.drafter, (2, 8), repeat=1)
    assert set(curve.seconds_by["verify"][1]) == {2, 8} and all(s > 0 for s in curve.seconds_by["verify"][1].values())
    assert iteration_curve(llm.model, llm.drafter, (2, 8)) is curve  # once per process


def test_iteration_curves_go_with_their_drafter(llm):
    """The curves are kept per model and drafter object, not per id (ids are reused after a
    collection): a drafter collected takes its curves with it."""
    import gc
    import weakref

    from clover.decoding.dflash import _ITERATION_COSTS, iteration_curve

    other = build_drafter(llm.drafter.config, seed=5)
    iteration_curve(llm.model, other, (2,), repeat=1)
    assert other in _ITERATION_COSTS[llm.model]
    gone, n = weakref.ref(other), len(_ITERATION_COSTS[llm.model])
    del other
    gc.collect()
    assert gone() is None and len(_ITERATION_COSTS[llm.model]) == n - 1


@pytest.mark.parametrize("block", [8, 32])
def test_reserved_positions_are_the_engines(target_dir, tmp_path, block):
    """What `LLM.check_length` / `room` reserve past prompt + max_new_tokens for dflash is what its
    engine's cache holds with the drafter it decodes with (its block by default, a larger one too)."""
    from clover.decoding import get_mode
    from clover.decoding.base import RowState
    from clover.decoding.sampling import AUTO, SamplingParams

    lm = clover.load(target_dir, drafter=_drafter_dir(tmp_path, clover.load(target_dir).config, block_size=block))
    mode = get_mode("dflash")
    for draft in (None, 3, AUTO):
        params = SamplingParams(max_new_tokens=10, draft_length=None if draft == AUTO else draft,
                                block_size=AUTO if draft == AUTO else None)
        engine = mode.make_engine(lm.model, mode.spec(params), mask_id=None, pad_id=0, drafter=lm.drafter)
        need = engine._capacity(RowState([1, 2, 3], params, set())) - 3 - 10
        assert lm.room(3, params, mode) == lm.context_length - 3 - need, draft
        assert need == (3 if draft == 3 else block - 1) + 1


# ------------------------------------------------------------------------------ compiled
def test_static_dflash_equals_eager(monkeypatch, target_dir, llm, tmp_path):
    """compile=True with a drafter: the verify (every logit, the drafter's hidden states, the GDN
    inputs for the rollback) runs as the target's static "verify" step and the draft as the
    drafter's static forward (context padded to the block) -- here with torch.compile replaced by
    the identity, so the static code runs eagerly -- and the tokens stay AR's, batched and alone,
    fixed and adaptive draft lengths."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    d = save_drafter(llm.drafter, tmp_path / "d")
    static = clover.load(target_dir, drafter=d, compile=True)
    drafts = []
    real = static.drafter.static_draft
    static.drafter.static_draft = lambda *a: drafts.append(a[0].shape[1]) or real(*a)
    prompts = [[1, 2, 3], list(range(50, 70)), [9] * 5]
    kw = dict(max_new_tokens=30, ignore_eos=True)
    ar = llm.generate(prompts, mode="ar", **kw)
    for extra in (dict(draft_length=5), dict(block_size="auto")):
        batched = static.generate(prompts, mode="dflash", **kw, **extra)
        alone = [static.generate(p, mode="dflash", **kw, **extra) for p in prompts]
        for a, b, s in zip(ar, batched, alone):
            assert b.token_ids == a.token_ids and s.token_ids == a.token_ids, extra
    assert static.model.static_steps.calls["verify-commit"] > 0 and drafts and set(drafts) != {0}
    # the prompt's prefill is not a graph (one per prompt length): only the verifies are
    calls = static.model.static_steps.calls
    calls.clear()
    one = static.generate(list(range(30, 53)), mode="dflash", draft_length=5, **kw)
    assert calls["verify-commit"] == len(one.stats.accept_lengths) == one.stats.forwards - 1


def test_load_compiles_dflash_graphs(monkeypatch, target_dir, llm, tmp_path):
    """compile=True with a drafter warms, beside the target's set, dflash's verify-commit at each of
    the drafter's verify widths (with the hidden states of the layers it reads) and the drafter's draft of a full
    block, at every compiled batch size; both are then frozen. (torch.compile replaced by the
    identity: tests/test_compile.py checks the same wiring for the target's other kinds.)"""
    from clover.models.static import StaticSteps

    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    warmed = []
    real_warm = StaticSteps.warm
    monkeypatch.setattr(StaticSteps, "warm", lambda self, *a, **k: warmed.append((a, k)) or real_warm(self, *a, **k))
    static = clover.load(target_dir, drafter=save_drafter(llm.drafter, tmp_path / "d"), compile=True, compile_batch=2)
    bs, ids = llm.drafter.block_size, tuple(llm.drafter.target_layer_ids)
    assert llm.drafter.verify_widths == (4, bs)
    assert [(a, k["ragged"]) for a, k in warmed if a[0] == "verify-commit" and k["hidden"] == ids] == [
        (("verify-commit", b, w, 512), False) for b in (1, 2) for w in (4, bs)]
    assert static.model.static_steps.frozen and static.drafter.static_batches == (1, 2)


@pytest.mark.slow
def test_frozen_dflash_runs_its_graphs_and_never_compiles(target_dir, llm, tmp_path):
    """After the load-time set is compiled and frozen (dynamo's tracing, the "eager" backend:
    seconds), dflash's verifies and full-block drafts run on those graphs -- alone and batched --
    with AR's tokens: none runs eagerly for want of a graph, and none compiles (a compile under the
    "fail_on_recompile" stance would have fallen back to eager and been counted)."""
    from clover.models.compile import compile_model
    from clover.models.static import LOAD_CAPACITIES, load_shapes

    torch.set_num_threads(1)
    frozen = clover.load(target_dir, drafter=save_drafter(llm.drafter, tmp_path / "d"))
    compile_model(frozen.model, backend="eager")
    steps, dr = frozen.model.static_steps, frozen.drafter.compile_static(backend="eager")
    steps.warm_all(load_shapes(frozen.config, batches=(1, 2), drafter=dr))
    dr.warm_static((1, 2), LOAD_CAPACITIES)
    prompts, kw = [[1, 2, 3], list(range(50, 60))], dict(max_new_tokens=24, ignore_eos=True)
    ar = llm.generate(prompts, mode="ar", **kw)
    assert [r.token_ids for r in frozen.generate(prompts, mode="dflash", **kw)] == [r.token_ids for r in ar]
    assert [frozen.generate(p, mode="dflash", **kw).token_ids for p in prompts] == [r.token_ids for r in ar]
    assert steps.calls["verify-commit"] > 0 and not steps.calls["eager"], steps.calls
    assert dr.static_calls["static"] > 0 and not dr.static_calls["eager"], dr.static_calls


@pytest.mark.slow
def test_compiled_dflash_equals_ar(target_dir, llm, tmp_path):
    torch.set_num_threads(1)
    compiled = clover.load(target_dir, drafter=save_drafter(llm.drafter, tmp_path / "d"), compile=True)
    kw = dict(max_new_tokens=16, ignore_eos=True)
    got = compiled.generate([1, 2, 3], mode="dflash", **kw)  # the drafter's block: the graphs compiled at load
    assert got.token_ids == llm.generate([1, 2, 3], mode="ar", **kw).token_ids
    calls = compiled.model.static_steps.calls
    assert calls["verify-commit"] > 0 and not calls["eager"] and not compiled.drafter.static_calls["eager"]


def test_static_draft_forward_equals_eager(llm):
    """The drafter's static forward (context padded to the block's width, attention over the
    whole capacity under the length mask) gives the eager draft's hidden states, rows at different
    lengths with different context counts."""
    m, dr = llm.model, llm.drafter
    with torch.no_grad():
        _, _, ctx = _context_features(llm, seed=1)
        block = dr.embed(torch.full((2, 8), dr.mask_token_id), m)
        n1, n2 = torch.tensor([9, 14]), torch.tensor([3, 8])
        first = torch.zeros(2, 14, ctx.shape[-1])
        first[0, :9], first[1] = ctx[0, :9], ctx[1, :14]
        second = torch.zeros(2, 8, ctx.shape[-1])
        second[0, :3], second[1] = ctx[0, 9:12], ctx[1, 14:22]
        eager, static = dr.make_cache(2, 64), dr.make_cache(2, 64)
        dr.draft(eager, first, n1, block)
        dr.draft(static, first, n1, block)
        want = dr.draft(eager, second, n2, block)
        got = dr.forward_draft(second, n2, block, static.lengths, [s.tensors() for s in static.layers], static=True)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------ grammar
def test_constrained_dflash_equals_constrained_ar():
    """A grammar masks each draft token (after the anchor and the drafts before it) and each verify
    position: greedy constrained dflash gives constrained AR's tokens on the held-out schemas,
    alone and batched, and a GBNF grammar."""
    jsonschema = pytest.importorskip("jsonschema")
    from test_grammar import SCHEMAS, _rf

    llm = clover.load()
    for name, schema in SCHEMAS.items():
        ar = llm.generate("Data:", mode="ar", max_new_tokens=96, response_format=_rf(schema))
        df = llm.generate("Data:", mode="dflash", max_new_tokens=96, response_format=_rf(schema))
        assert df.token_ids == ar.token_ids and df.finish_reason == ar.finish_reason == "stop", name
        jsonschema.validate(json.loads(df.text), schema)
        assert df.stats.forwards < ar.stats.forwards, name
    prompts = ["a", "bb", "Data:"]
    rf = _rf(SCHEMAS["nested"])
    ar = [llm.generate(p, mode="ar", max_new_tokens=96, response_format=rf) for p in prompts]
    for a, b in zip(ar, llm.generate(prompts, mode="dflash", max_new_tokens=96, response_format=rf)):
        assert b.token_ids == a.token_ids
    gbnf = {"gbnf": 'root ::= ("yes" | "no") "!"'}
    assert (llm.generate("Answer:", mode="dflash", max_new_tokens=16, grammar=gbnf).token_ids
            == llm.generate("Answer:", mode="ar", max_new_tokens=16, grammar=gbnf).token_ids)


def test_constrained_dflash_sampling_stays_valid(llm):
    jsonschema = pytest.importorskip("jsonschema")
    from test_grammar import SCHEMAS, _rf

    schema = SCHEMAS["enum_array"]
    for seed in range(3):
        g = llm.generate("x", mode="dflash", max_new_tokens=96, temperature=1.0, seed=seed, response_format=_rf(schema))
        jsonschema.validate(json.loads(g.text), schema)
        assert g.stats.draft_forwards > 0


# ------------------------------------------------------------------------------ a reduced draft vocabulary
def _vocab_drafter(tmp_path, llm, ids):
    cfg = drafter_config_for(llm.config, num_hidden_layers=2, block_size=8, draft_vocab_size=len(ids))
    dr = build_drafter(cfg, seed=1)
    dr.set_draft_vocab(ids)
    return save_drafter(dr, tmp_path / "vocab")


def test_draft_vocab_round_trips_and_scores_its_rows(tmp_path, target_dir, llm):
    """EAGLE-3's d2t on a borrowed head: the draft vocabulary is stored as int64 offsets, loads back,
    and the drafter's logits are the full head's on those tokens and far below them elsewhere."""
    ids = sorted(torch.randperm(llm.config.vocab_size, generator=torch.Generator().manual_seed(0))[:40].tolist())
    d = _vocab_drafter(tmp_path, llm, ids)
    raw = json.loads((d / "config.json").read_text())
    assert raw["dflash_config"]["draft_vocab_size"] == 40
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        d2t = f.get_tensor("d2t")
    assert d2t.dtype == torch.int64 and (torch.arange(40) + d2t).tolist() == ids
    again = clover.load(target_dir, drafter=d).drafter
    assert again.draft_ids.tolist() == ids
    h = torch.randn(2, 3, llm.config.hidden_size)
    full = llm.model.lm_head(h)
    got = again.logits(h, llm.model)
    torch.testing.assert_close(got[..., ids], full[..., ids])
    torch.testing.assert_close(again.draft_logits(h, llm.model), full[..., ids])
    outside = torch.ones(llm.config.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert (got[..., outside] < full.min() - 100).all()


def test_draft_vocab_refusals(tmp_path, llm):
    cfg = drafter_config_for(llm.config, num_hidden_layers=1, block_size=8, draft_vocab_size=4)
    dr = build_drafter(cfg)
    with pytest.raises(ValueError, match="4 distinct token ids"):
        dr.set_draft_vocab([1, 2, 2, 3])
    cfg.draft_vocab_size = llm.config.vocab_size + 1
    with pytest.raises(DrafterMismatch, match="draft_vocab_size"):
        cfg.check_target(llm.config)


@pytest.mark.parametrize("seed", [0, 1])
def test_dflash_with_a_draft_vocab_equals_ar_greedy(tmp_path, target_dir, llm, seed):
    """Tokens outside the draft vocabulary are never drafted; the verify keeps AR's text, alone and batched."""
    ids = list(range(0, llm.config.vocab_size, 3))
    vocab = clover.load(target_dir, drafter=_vocab_drafter(tmp_path, llm, ids))
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 11, 17)]
    ar = [llm.generate(p, mode="ar", max_new_tokens=20, ignore_eos=True).token_ids for p in prompts]
    alone = [vocab.generate(p, mode="dflash", max_new_tokens=20, ignore_eos=True) for p in prompts]
    assert [a.token_ids for a in alone] == ar
    assert [g.token_ids for g in vocab.generate(prompts, mode="dflash", max_new_tokens=20, ignore_eos=True)] == ar


def test_train_a_drafter_with_a_draft_vocab(tmp_path, target_dir):
    """`dflash.draft_vocab`: the drafter drafts over the distillation set's most frequent tokens, from
    its first step; the checkpoint and the export keep them."""
    from clover.data.distill import frequent_tokens, load_distill_set
    from clover.train import load_recipe
    from clover.train.trainer import Trainer, export_model

    recipe = tmp_path / "r.toml"
    recipe.write_text(_drafter_recipe(target_dir, "draft_vocab = 64\n"))
    t = Trainer(load_recipe(recipe, {"run.out": str(tmp_path / "run")}), quiet=True)
    want = frequent_tokens(load_distill_set(tmp_path / "run" / "distill"), t.tokenizer, 64, t.target.config.vocab_size)
    assert t.model.draft_ids.tolist() == want
    hist = t.train()
    assert len(hist) == 2 and all(math.isfinite(h["loss"]) and 0 < h["valid"] <= 1 for h in hist)
    out = export_model(tmp_path / "run" / "ckpt" / "step-00000002", tmp_path / "exported")
    llm = clover.load(target_dir, drafter=out)
    assert llm.drafter.draft_ids.tolist() == want
    got = llm.generate([1, 2, 3], mode="dflash", max_new_tokens=10, ignore_eos=True)
    assert got.token_ids == llm.generate([1, 2, 3], mode="ar", max_new_tokens=10, ignore_eos=True).token_ids


@pytest.mark.parametrize("vocab", [None, 64])
def test_target_memo_gives_the_same_loss(monkeypatch, llm, vocab):
    """`TargetMemo` (the target's outputs kept per document) with every token in its top-k: the loss of
    a step is the one that runs the target, up to the kept features' bfloat16; a second epoch runs
    no target forward."""
    from clover.train.losses import TargetMemo, dflash_step_loss

    cfg = drafter_config_for(llm.config, num_hidden_layers=1, block_size=8, draft_vocab_size=vocab)
    dr = build_drafter(cfg, seed=2)
    if vocab:
        dr.set_draft_vocab(range(0, 2 * vocab, 2))
    ids = torch.randint(1, 200, (2, 30), generator=torch.Generator().manual_seed(0))
    ids[1, 24:] = 0  # padding
    kw = dict(anchors=4, decay=4.0, kl_weight=0.5, pad_id=0)
    exact, _ = dflash_step_loss(dr, llm.model, ids, torch.Generator().manual_seed(5), **kw)
    memo = TargetMemo(vocab or llm.config.vocab_size)
    kept, _ = dflash_step_loss(dr, llm.model, ids, torch.Generator().manual_seed(5), memo=memo, **kw)
    torch.testing.assert_close(kept, exact, rtol=2e-2, atol=1e-3)
    assert len(memo.rows) == 2

    def no_forward(*a, **k):
        raise AssertionError("the target ran again")

    monkeypatch.setattr(llm.model, "forward", no_forward)
    again, _ = dflash_step_loss(dr, llm.model, ids, torch.Generator().manual_seed(5), memo=memo, **kw)
    torch.testing.assert_close(again, kept)
