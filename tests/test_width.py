"""The forward cost curve (`clover bench cost`) and block_size="auto" (`clover.decoding.width`)."""

import json

import pytest
import torch

import clover
from clover.decoding import speculative as S
from clover.decoding import width as W


@pytest.fixture()
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("CLOVER_COST", raising=False)  # the cost files under XDG_CACHE_HOME, as users have them
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def llm(tiny_dir):
    out = clover.load(tiny_dir)
    out.model.config.block_sizes = [4, 8, 16]
    return out


def flat_curve(cheap: set[int], positions=range(1, 129), batches=(1,)) -> W.CostCurve:
    """Denoise forwards that cost 1 at the positions in `cheap` and 100 elsewhere; the AR step
    (a commit of 1) costs 1 when 1 is in `cheap`, else 100."""
    c = W.CostCurve()
    for b in batches:
        for p in positions:
            c.add("denoise", b, p, 1.0 if p in cheap else 100.0)
        c.add("commit", b, 1, 1.0 if 1 in cheap else 100.0)
    return c


def test_curve_interpolates_and_round_trips():
    c = W.CostCurve()
    for p, s in ((1, 1.0), (4, 4.0), (8, 6.0)):
        c.add("denoise", 1, p, s)
    assert c.seconds("denoise", 1, 2) == pytest.approx(2.0)
    assert c.seconds("denoise", 1, 6) == pytest.approx(5.0)
    assert c.seconds("denoise", 1, 16) == pytest.approx(10.0)  # past the last point: the last slope
    assert c.seconds("denoise", 1, 1) == 1.0
    assert c.seconds("denoise", 2, 4) == pytest.approx(6.0)  # an unmeasured batch: same total positions
    back = W.CostCurve.from_dict(json.loads(json.dumps(c.to_dict())))
    assert back.seconds_by == c.seconds_by
    with pytest.raises(KeyError):
        c.seconds("verify", 1, 4)
    with pytest.raises(ValueError, match="schema"):
        W.CostCurve.from_dict({"schema": "other", "seconds": {}})


def test_time_forward_every_kind_keeps_the_cache(llm):
    for kind in W.KINDS:
        ts = W.time_forward(llm.model, kind, 2, 3, prefix=5, repeat=2, warmup=0)
        assert len(ts) == 2 and all(t > 0 for t in ts)
    with pytest.raises(ValueError, match="kind"):
        W.time_forward(llm.model, "bogus", 1, 1)


def test_curve_cached_per_model_and_machine(llm, cache_home):
    assert W.load_curve(llm.model) is None
    c = flat_curve({4}, positions=(4, 8))
    path = W.save_curve(llm.model, c)
    assert path.is_relative_to(cache_home) and path.name.startswith("eager-")
    W.save_curve(llm.model, flat_curve({8}, positions=(8, 16)))  # merged: new points replace old ones
    got = W.load_curve(llm.model)
    assert got.seconds_by["denoise"][1] == {4: 1.0, 8: 1.0, 16: 100.0}
    assert got.key["threads"] == torch.get_num_threads()


def test_calibration_when_nothing_is_cached(llm, cache_home):
    curve = W.curve_for(llm.model, (1, 4, 8))
    assert set(curve.seconds_by["denoise"][1]) == set(curve.seconds_by["block"][1]) == {4, 8}
    assert set(curve.seconds_by["commit"][1]) == {1}
    assert W.load_curve(llm.model) is not None  # cached for the next time


def test_step_curve_times_the_engine_at_each_width_once_and_caches_it(llm, cache_home, monkeypatch):
    """Draft auto's costs: the adaptive draft's engine stepped at each width (1: the AR step) at a
    batch size, measured once per process and kept in the user cache beside the forward costs,
    where a later process reads them and times nothing."""
    c = S.step_curve(llm.model, (1, 4), 2, mask_id=llm.config.mask_token_id, repeat=2)
    assert set(c.seconds_by) == {W.STEP_KIND} and set(c.seconds_by[W.STEP_KIND]) == {2}
    assert set(c.seconds_by[W.STEP_KIND][2]) == {1, 4} and all(s > 0 for s in c.seconds_by[W.STEP_KIND][2].values())
    assert S.step_curve(llm.model, (1, 4), 2, mask_id=llm.config.mask_token_id, repeat=2) is c
    assert W.load_curve(llm.model).seconds_by[W.STEP_KIND] == c.seconds_by[W.STEP_KIND]
    S._STEP_COSTS.pop(llm.model)  # as a new process: read from the cache, nothing timed

    def no_timing(*a, **k):
        raise AssertionError("timed a step the cache holds")

    monkeypatch.setattr(S, "_time_steps", no_timing)
    assert S.step_curve(llm.model, (1, 4), 2, mask_id=llm.config.mask_token_id).seconds_by == c.seconds_by
    with pytest.raises(AssertionError, match="timed"):  # a width the cache lacks is measured
        S.step_curve(llm.model, (1, 4, 8), 2, mask_id=llm.config.mask_token_id)


def test_step_timing_drops_a_burst_and_keeps_wider_steps_no_cheaper(llm, monkeypatch):
    """`step_curve`'s timing, on a fake clock: a burst of load over one pass is dropped (the cheaper
    pass's median is kept), and a width measured dearer than a wider one reads the wider one's."""
    clock = [0.0]
    cost = {1: [1.0, 1.0], 4: [9.0, 2.0], 8: [3.0, 3.0], 16: [2.5, 2.5]}  # per pass; 4: a burst in pass 1

    class FakeEngine:
        def __init__(self, model, *, draft_length, **kw):
            self.w, self.steps = draft_length, 0

        def add(self, row):
            pass

        def step(self):
            self.steps += 1
            if self.steps > 2:  # after the prefill and one untimed step
                clock[0] += cost[self.w][(self.steps - 3) // 4]

    monkeypatch.setattr(S, "SpeculativeEngine", FakeEngine)
    monkeypatch.setattr(W.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(S, "STEP_PASSES", 2)
    c = S._time_steps(llm.model, (1, 4, 8, 16), 1, mask_id=0, pad_id=0, repeat=4)
    assert c.seconds_by[W.STEP_KIND][1] == {1: 1.0, 4: 2.0, 8: 2.5, 16: 2.5}


def test_load_measures_the_step_costs_once_per_machine(tiny_dir, cache_home, monkeypatch):
    """`clover.load(calibrate=True)` (`clover serve`): draft auto's step costs at the batch buckets,
    measured at the first load with a progress bar, read by the second, which times nothing (and
    decodes draft auto at those batch sizes without timing); a corrupt cache file is reported in a
    warning and measured again."""
    measured = []
    real = S._time_steps

    def counting(model, widths, batch, **kw):
        measured.append(batch)
        return real(model, widths, batch, **kw | {"repeat": 2})

    monkeypatch.setattr(S, "_time_steps", counting)
    first = clover.load(tiny_dir, calibrate=True, compile_batch=3)
    assert measured == [1, 2, 4]
    path = W.cost_path(W.cost_key(first.model))
    assert set(W.load_curve(first.model).seconds_by[W.STEP_KIND]) == {1, 2, 4}
    second = clover.load(tiny_dir, calibrate=True, compile_batch=3)
    assert measured == [1, 2, 4]  # read, not timed
    ref = second.generate(["ab", "cd", "ef"], mode="ar", max_new_tokens=6)
    out = second.generate(["ab", "cd", "ef"], mode="speculative", block_size="auto", max_new_tokens=6)
    assert [g.token_ids for g in out] == [g.token_ids for g in ref] and measured == [1, 2, 4]
    path.write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable cost curve"):
        clover.load(tiny_dir, calibrate=True, compile_batch=1)
    assert measured == [1, 2, 4, 1]
    assert set(W.load_curve(first.model).seconds_by[W.STEP_KIND]) == {1}  # written anew


def test_choice_follows_cost_and_row_ease():
    prior = {8: 2.0, 16: 3.0, 32: 4.0}
    linear = W.CostCurve()
    for p in (1, 8, 16, 32, 64):
        linear.add("denoise", 1, p, 1.0 + p / 8)
    pol = W.WidthPolicy((8, 16, 32), prior, linear)
    assert pol.choose([(0.0, 100)]).width == 8  # a row that gains nothing: the cheapest width
    flat = W.CostCurve()
    for p in (1, 64):
        flat.add("denoise", 1, p, 1.0)
    easy = W.WidthPolicy((8, 16, 32), prior, flat).choose([(1.0, 100)])
    assert easy.width == 32 and "width 32" in easy.why()
    assert W.WidthPolicy((8, 16, 32), prior, flat).choose([(1.0, 2)]).width == 8  # 2 tokens left: no gain in width
    # the row scale: no evidence -> 1; a row committing one token per forward -> below 1
    assert pol.row_scale(0, 0, 0.0) == pytest.approx(1.0)
    assert pol.row_scale(10, 10, 20.0) < 0.5


def test_priors_and_trained_widths(llm):
    cfg = llm.model.config
    assert W.trained_widths(cfg) == (4, 8, 16)
    assert W.prior_tokens_per_forward(cfg.replace(block_tokens_per_forward={"8": 2.5}), (4, 8)) == {4: 1.0, 8: 2.5}
    assert W.trained_widths(cfg.replace(block_sizes=None)) == (cfg.block_size,)


@pytest.mark.parametrize("width", [1, 4, 8, 16])
def test_auto_equals_the_fixed_width_it_chose(llm, monkeypatch, width):
    """Width 1 is the AR step: auto's tokens, block 1's and AR's are the same."""
    monkeypatch.setattr(W, "curve_for", lambda model, widths: flat_curve({width, 2 * width}, batches=(1, 3)))
    prompts = ["abc", "hello world", "def f(x):"]
    kw = dict(max_new_tokens=40, ignore_eos=True)
    for p in prompts:
        auto = llm.generate(p, mode="diffusion", block_size="auto", **kw)
        fixed = llm.generate(p, mode="diffusion", block_size=width, **kw)
        assert auto.token_ids == fixed.token_ids
        assert auto.stats.block_widths and set(auto.stats.block_widths) == {width}
        if width == 1:
            assert auto.token_ids == llm.generate(p, mode="ar", **kw).token_ids
            assert auto.stats.forwards == len(auto.token_ids)  # one AR step per token, no denoise forward
    batch = llm.generate(prompts, mode="diffusion", block_size="auto", **kw)
    alone = [llm.generate(p, mode="diffusion", block_size=width, **kw) for p in prompts]
    assert [g.token_ids for g in batch] == [g.token_ids for g in alone]


def test_auto_narrows_to_ar_as_the_batch_grows(llm):
    """A denoise forward that costs what the AR step does at batch 1 and grows with the positions
    under batch: one row decodes wide, a batch of 8 rows at width 1 (the AR step)."""
    c = W.CostCurve()
    for b in (1, 8):
        for p in (1, 2, 4, 8, 16, 32):
            c.add("denoise", b, p, 1.0 if b == 1 else float(p))
        c.add("commit", b, 1, 1.0)
    pol = W.WidthPolicy((1, 4, 8), {1: 1.0, 4: 2.0, 8: 2.5}, c)
    assert pol.choose([(1.0, 100)]).width == 8
    assert pol.choose([(1.0, 100)] * 8).width == 1


def test_auto_changes_width_between_blocks_and_reports_why(llm, monkeypatch):
    from clover.decoding.diffusion import DiffusionEngine
    from clover.decoding.base import RowState
    from clover.decoding.sampling import SamplingParams

    # 4 is cheap at first; once the row has committed, the choice is re-made at every block
    pol = W.WidthPolicy((4, 8, 16), {4: 1.5, 8: 2.0, 16: 3.0}, flat_curve({4, 8, 16, 32}))
    eng = DiffusionEngine(llm.model, block_size="auto", mask_id=llm.config.mask_token_id, width_policy=pol)
    params = SamplingParams(max_new_tokens=20, ignore_eos=True, block_size="auto", threshold=0.9, policy="threshold")
    row = RowState(prompt=llm.tokenizer.encode("abc"), params=params, eos_ids=set(llm.config.eos_token_ids))
    eng.add(row)
    list(eng.run())
    assert len(row.tokens) == 20
    assert eng.choices and all(c.width in (4, 8, 16) for c in eng.choices)
    assert sum(row.block_widths) >= 20 and row.block_widths[-1] in (4, 8, 16)
    assert eng.choices[0].why().startswith(f"width {eng.choices[0].width} for 1 row(s)")


def test_auto_is_refused_where_it_means_nothing(llm):
    out = llm.generate("abc", mode="ar", block_size="auto", max_new_tokens=8)  # ignored, as any block size
    assert out.token_ids == llm.generate("abc", mode="ar", max_new_tokens=8).token_ids
    with pytest.raises(ValueError, match="block_size"):
        llm.generate("abc", mode="diffusion", block_size="wide", max_new_tokens=8)
    with pytest.raises(ValueError, match="draft_length"):
        llm.generate("abc", mode="speculative", block_size="auto", draft_length=4, max_new_tokens=8)


def test_draft_choice_follows_acceptance():
    linear = W.CostCurve()
    for p in (1, 4, 8, 16):
        linear.add("verify", 1, p, 1.0 + p / 4)
    pol = W.DraftPolicy((4, 8, 16), linear)
    assert pol.choose([(0.1, 100)]).width == 4  # unsure: a short draft
    assert pol.choose([(0.99, 100)]).width == 16  # sure: a long one
    assert pol.acceptance(0, 0) == pytest.approx(pol.PRIOR_RATE)
    # the prior from a model card's tokens per forward at its block size: the rate that keeps as many
    assert W.DraftPolicy.rate_keeping(W.DraftPolicy.expected_tokens(8, 0.6, 1 << 30), 8) == pytest.approx(0.6)
    assert W.DraftPolicy((4, 8), linear, prior_rate=0.7).acceptance(0, 0) == pytest.approx(0.7)
    assert pol.acceptance(30, 0) > 0.9 and pol.acceptance(0, 30) < 0.1


@pytest.mark.parametrize("sure", [0.05, 0.99])
def test_adaptive_draft_stays_identical_to_ar(llm, monkeypatch, sure):
    curve = W.CostCurve()
    for b in (1, 2):
        for p in (1, 4, 8, 16):
            curve.add(W.STEP_KIND, b, p, 1.0 + p / 4)
    monkeypatch.setattr(S, "step_curve", lambda *a, **k: curve)
    monkeypatch.setattr(W.DraftPolicy, "PRIOR_RATE", sure)
    monkeypatch.setattr(W.DraftPolicy, "PRIOR_N", 1000.0)  # the prior decides: one draft length throughout
    prompts = ["abc", "def f(x):"]
    kw = dict(max_new_tokens=30, ignore_eos=True)
    ar = llm.generate(prompts, mode="ar", **kw)
    sp = llm.generate(prompts, mode="speculative", block_size="auto", **kw)
    assert [g.token_ids for g in sp] == [g.token_ids for g in ar]
    want = 1 if sure < 0.5 else 16  # unsure: a draft of one (the AR step) beats a verify of 4
    assert all(f"draft width {want}" in g.stats.width_why[0] for g in sp)
    assert all(a <= want for g in sp for a in g.stats.accept_lengths)
    torch.manual_seed(0)
    sampled = llm.generate("abc", mode="speculative", block_size="auto", temperature=0.8, **kw)
    assert len(sampled.token_ids) == 30


def test_bench_cost_table_json_and_plot(llm, cache_home, tmp_path):
    from clover.bench.cost import cost_table, plot_cost, run_cost

    res = run_cost(llm, batches=(1, 2), positions=(1, 2), repeat=1, prefix=4)
    assert len(res["rows"]) == len(W.KINDS) * 2 * 2
    ar = [r for r in res["rows"] if r["kind"] == "commit" and r["positions"] == 1]
    assert all(r["ar_steps"] == pytest.approx(1.0) for r in ar)
    assert res["cached"]["eager"].startswith(str(cache_home))
    assert W.load_curve(llm.model).has("verify")
    from rich.console import Console

    Console(width=200).print(cost_table(res))
    png = plot_cost(res, tmp_path / "cost.png")
    assert png is None or (tmp_path / "cost.png").stat().st_size > 0


def test_bench_cost_cli_errors(tiny_dir, capsys):
    from clover.cli import main

    assert main(["bench", "cost", "--model", str(tiny_dir), "--positions", "0,2"]) != 0
    assert "--positions" in capsys.readouterr().err


@pytest.mark.parametrize("adaptive", [False, True])
def test_draft_length_switching_every_forward_stays_identical_to_ar(llm, alternating_policy, adaptive):
    from clover.decoding.base import RowState
    from clover.decoding.sampling import SamplingParams
    from clover.decoding.speculative import SpeculativeEngine

    curve = W.CostCurve()
    curve.add("verify", 1, 4, 1.0)
    for prompt in ("abc", "hello world"):
        eng = SpeculativeEngine(llm.model, draft_length="auto", mask_id=llm.config.mask_token_id,
                                draft_policy=alternating_policy((W.AR_WIDTH, 4, 8, 16), curve), adaptive=adaptive)
        params = SamplingParams(max_new_tokens=40, ignore_eos=True, block_size="auto")
        row = RowState(prompt=llm.tokenizer.encode(prompt), params=params, eos_ids=set(llm.config.eos_token_ids))
        eng.add(row)
        list(eng.run())
        ar = llm.generate(prompt, mode="ar", max_new_tokens=40, ignore_eos=True)
        assert row.tokens == ar.token_ids
        assert len(eng.choices) > 3


def test_auto_reserves_room_for_the_block_size_and_grows_for_wider_drafts(llm, alternating_policy, monkeypatch):
    """Draft auto's cache keeps room behind each row for drafts of the model's block size, not its
    widest (what every row joining or leaving a batch copies); a wider draft, when chosen, grows the
    cache, and the tokens stay AR's."""
    from clover.decoding.base import RowState
    from clover.decoding.sampling import SamplingParams
    from clover.decoding.speculative import SpeculativeEngine

    monkeypatch.setattr(llm.model.config, "block_size", 4)
    eng = SpeculativeEngine(llm.model, draft_length="auto", mask_id=llm.config.mask_token_id,
                            draft_policy=alternating_policy((W.AR_WIDTH, 4, 16), W.CostCurve()), adaptive=True)
    prompt = llm.tokenizer.encode("hello world")
    row = RowState(prompt=prompt, params=SamplingParams(max_new_tokens=30, ignore_eos=True, block_size="auto"),
                   eos_ids=set(llm.config.eos_token_ids))
    eng.add(row)
    assert eng.cache.capacity == len(prompt) + 30 + 2 * 4 + 1
    list(eng.run())
    assert row.tokens == llm.generate("hello world", mode="ar", max_new_tokens=30, ignore_eos=True).token_ids
    assert 16 in {c.width for c in eng.choices}


def test_bench_cost_with_expert_sharing(llm, cache_home):
    """`expert_budget`: the forwards run with block expert sharing, the curve is not cached, and a
    budget outside [experts per token, experts] is refused in one line."""
    from clover.bench.cost import cost_table, run_cost

    c = llm.model.config
    res = run_cost(llm, kinds=("commit", "denoise"), batches=(1,), positions=(1, 4), repeat=1, prefix=4,
                   expert_budget=c.num_experts_per_tok)
    assert res["cached"] == {} and res["settings"]["expert_budget"] == c.num_experts_per_tok
    assert "expert budget" in str(cost_table(res).title)
    with pytest.raises(ValueError, match="^expert_budget: "):
        run_cost(llm, kinds=("denoise",), batches=(1,), positions=(1,), repeat=1, expert_budget=c.num_experts + 1)


def test_draft_choice_narrows_to_ar_under_batch_and_measures_each_bucket():
    """Draft "auto" with the AR step among its widths: a cheap verify at batch 1 drafts, a verify
    that turns compute-bound under batch gives the AR step; an unmeasured batch bucket is measured
    (`calibrate`) before it is read, once."""
    curve = W.CostCurve()
    curve.add("commit", 1, 1, 1.0)
    for p in (4, 8, 16):
        curve.add("verify", 1, p, 1.2 + p / 64)  # overhead-bound: ~the AR step
    asked = []

    def calibrate(batch):
        asked.append(batch)
        fresh = W.CostCurve()
        fresh.add("commit", batch, 1, 2.0)
        for p in (4, 8, 16):
            fresh.add("verify", batch, p, 2.0 * p)  # compute-bound: p AR steps
        return fresh

    pol = W.DraftPolicy((W.AR_WIDTH, 4, 8, 16), curve, calibrate)
    assert pol.choose([(0.7, 100)]).width > W.AR_WIDTH and asked == []
    choice = pol.choose([(0.7, 100)] * 13)  # between the buckets 8 and 16: both measured
    assert choice.width == W.AR_WIDTH and choice.batch == 13 and sorted(asked) == [8, 16]
    assert pol.choose([(0.7, 100)] * 16).width == W.AR_WIDTH and sorted(asked) == [8, 16]
    assert pol.seconds(8, 1) == pytest.approx(1.2 + 8 / 64) and pol.seconds(8, 12) == pytest.approx(16.0)
    curve.add("verify", 2, 8, 3.0)
    assert pol.seconds(8, 3) == pytest.approx((3.0 + pol.seconds(8, 4)) / 2)  # linear in the batch
    assert W.batch_bucket(1) == 1 and W.batch_bucket(3) == 4 and W.batch_bucket(40) == W.BATCH_BUCKETS[-1]
    assert "width 1" in choice.why()


def test_draft_choice_takes_ar_where_ar_keeps_more_per_second():
    """On a forced cost table (batch 4: the AR step 1, drafting 8 2.62, what the bundled model's
    step costs eagerly): rows drafting in steady state keep drafting where their expected tokens/s
    beat AR's, and rows that took AR's step start drafting only where the draft pays for the
    forward that starts it (that forward keeps AR's token alone) over the tokens they have left;
    the choice is always the width with the most expected tokens/s, AR's step where that is AR's."""
    curve = W.CostCurve()
    for b, c8 in ((1, 2.21), (4, 2.62)):
        curve.add(W.STEP_KIND, b, 1, 1.0)
        curve.add(W.STEP_KIND, b, 8, c8)
    pol = W.DraftPolicy((W.AR_WIDTH, 8), curve, kind=W.STEP_KIND)
    a = W.DraftPolicy.rate_keeping(2.73, 8)  # the bundled model's prior: 2.73 tokens per verify of 8
    steady = pol.choose([(a, 64)] * 4)
    assert steady.width == 8 and steady.expected[8] == pytest.approx(4 * 2.73 / 2.62, rel=1e-3)
    for horizon in (2, 15, 30):  # the batch took AR's step: starting to draft does not pay at 4 rows
        choice = pol.choose([(a, 64, horizon)] * 4)
        assert choice.width == W.AR_WIDTH and choice.expected[1] == pytest.approx(4.0)
        assert choice.expected[8] < choice.expected[1]
    assert pol.choose([(a, 64, 40)]).width == 8  # alone, over 40 tokens left, it does (1 row: 2.21)
    assert pol.choose([(a, 64, 3)]).width == W.AR_WIDTH  # but not for 3
    assert pol.tokens_per_forward(8, a, 64, 1) == pytest.approx(1.0)  # one token left: AR's token only
    assert pol.tokens_per_forward(W.AR_WIDTH, a, 64, 15) == 1.0
    for rows in ([(a, 64)] * 3, [(a, 64, 10)] * 2, [(0.2, 64)], [(0.95, 5, 5)]):
        c = pol.choose(rows)
        assert c.expected[c.width] == max(c.expected.values())


def test_generate_verbose_shows_the_draft_widths_chosen(tiny_dir, capsys):
    from clover.cli import main

    assert main(["generate", "abc", "--model", str(tiny_dir), "--mode", "speculative", "--block-size", "auto",
                 "-n", "6", "--verbose", "--threads", "1"]) == 0
    err = capsys.readouterr().err
    assert "block_size auto: draft widths " in err and "forward 0: draft width " in err
