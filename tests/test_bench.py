"""`clover bench`: decode JSON schema and consistency on a tiny checkpoint, the sweep PNG, and the
quick kernels / roofline runs. Everything here is sized to finish in well under a minute."""

from __future__ import annotations

import json
import sys

import pytest

import clover
from clover import cli
from clover.bench.decode import Item, load_items, score, summarize, trim_body


MODES = ["ar", "diffusion", "naive", "speculative"]


def bench(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(["bench", *[str(a) for a in argv]])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def decode_result(tmp_path_factory, tiny_dir):
    out = tmp_path_factory.mktemp("bench") / "decode.json"
    rc = cli.main(["bench", "decode", "--model", str(tiny_dir), "--prompts", "2", "--workload", "both",
                   "-n", "16", "--block-size", "8", "--json", str(out), "--threads", "1"])
    assert rc == 0
    return json.loads(out.read_text())


def test_decode_schema_and_consistency(decode_result):
    r = decode_result
    assert r["schema"] == "clover.bench.decode/1"
    assert list(r["modes"]) == MODES
    assert r["settings"]["prompts"] == 4 and r["settings"]["block_size"] == 8
    assert len(r["runs"]) == 4 * len(MODES)
    assert r["max_rss_bytes"] > 0
    for m, s in r["modes"].items():
        runs = [x for x in r["runs"] if x["mode"] == m]
        assert s["tokens"] == sum(x["tokens"] for x in runs)
        assert s["forwards"] == sum(x["forwards"] for x in runs)
        assert s["tokens_per_forward"] == pytest.approx(s["tokens"] / s["forwards"])
        assert s["ms_per_forward"] == pytest.approx(1e3 * s["seconds"] / s["forwards"])
        tps = s["tokens_per_second"]
        assert tps["min"] <= tps["q1"] <= tps["median"] <= tps["q3"] <= tps["max"]
        assert s["cache_bytes"] > 0
        assert set(s["quality"]) == {"tasks", "code"}
        assert 0 <= s["quality"]["tasks"]["exact_match"] <= 1
        kinds = s["quality"]["tasks"]["by_kind"]
        assert sum(k["n"] for k in kinds.values()) == s["quality"]["tasks"]["n"]
        assert sum(k["n"] * k["exact_match"] for k in kinds.values()) == pytest.approx(
            s["quality"]["tasks"]["n"] * s["quality"]["tasks"]["exact_match"])
        assert 0 <= s["quality"]["code"]["edit_similarity"] <= 1
        assert "vs_ar" in s
        for x in runs:
            assert x["tokens_per_forward"] == pytest.approx(x["tokens"] / x["forwards"])
            assert x["tokens"] == len(x["token_ids"])
    assert r["modes"]["ar"]["vs_ar"]["tokens_per_second"] == pytest.approx(1.0)
    # greedy speculative decoding is lossless: the same tokens as AR, prompt by prompt
    ar = {x["item"]: x["token_ids"] for x in r["runs"] if x["mode"] == "ar"}
    spec = {x["item"]: x["token_ids"] for x in r["runs"] if x["mode"] == "speculative"}
    assert spec == ar and r["modes"]["speculative"]["matches_ar"] == 1.0
    assert r["modes"]["speculative"]["tokens"] == r["modes"]["ar"]["tokens"]
    # naive recomputation decodes exactly what cached diffusion decodes
    dif = {x["item"]: x["token_ids"] for x in r["runs"] if x["mode"] == "diffusion"}
    naive = {x["item"]: x["token_ids"] for x in r["runs"] if x["mode"] == "naive"}
    assert dif == naive


def test_decode_table_and_plot(tiny_dir, tmp_path, capsys):
    rc, out, err = bench(capsys, "decode", "--model", tiny_dir, "--prompts", "1", "--workload", "tasks", "-n", "8",
                         "--block-size", "8", "--modes", "ar,diffusion", "--plot", tmp_path)
    assert rc == 0, err
    assert "diffusion" in out and "tok/s" in out
    assert (tmp_path / "decode.png").read_bytes()[:4] == b"\x89PNG"


def test_decode_bad_flags(tiny_dir, capsys):
    rc, _, err = bench(capsys, "decode", "--model", tiny_dir, "--modes", "ar,fast")
    assert rc == 2 and "--modes" in err
    rc, _, err = bench(capsys, "decode", "--model", tiny_dir, "--prompts", "0")
    assert rc == 2 and "--prompts" in err


def test_sweep_writes_png(tiny_dir, tmp_path, capsys):
    png, js = tmp_path / "sweep.png", tmp_path / "sweep.json"
    rc, out, err = bench(capsys, "sweep", "--model", tiny_dir, "--prompts", "1", "-n", "8", "--thresholds", "0.5,0.9",
                         "--block-sizes", "4,8", "--block-size", "8", "--confidences", "prob, entropy,margin",
                         "--plot", png, "--json", js)
    assert rc == 0, err
    assert png.read_bytes()[:4] == b"\x89PNG"
    r = json.loads(js.read_text())
    labels = [p["label"] for p in r["points"]]
    assert labels == ["ar", "B8/t0.5", "B8/t0.9", "B4/t0.95", "B8/t0.95", "B8/t0.95/entropy", "B8/t0.95/margin"]
    assert r["settings"]["confidences"] == ["prob", "entropy", "margin"]
    for p in r["points"]:
        assert p["tokens_per_forward"] == pytest.approx(p["tokens"] / p["forwards"])
    # the measure reaches the decoder: the same prompt decoded directly with that measure
    llm = clover.load(tiny_dir)
    item = load_items("tasks", 1)[0]
    for p in r["points"][-2:]:
        gen = llm.generate(item.prompt, mode="diffusion", max_new_tokens=8, block_size=8, threshold=0.95,
                           confidence=p["confidence"])
        run = next(x for x in r["runs"] if x["label"] == p["label"])
        assert run["token_ids"] == list(gen.token_ids) and run["forwards"] == gen.stats.forwards
    rc, _, err = bench(capsys, "sweep", "--model", tiny_dir, "--prompts", "1", "--confidences", "prob,softmax")
    assert rc == 2 and "confidences" in err and "softmax" in err


def test_kernels_quick(capsys):
    rc, out, err = bench(capsys, "kernels", "--quick", "--repeat", "1", "--json", "-")
    assert rc == 0, err
    r = json.loads(out)
    groups = {row["group"] for row in r["rows"]}
    assert groups == {"gdn", "attention", "moe"}
    for row in r["rows"]:
        for name, diff in row["max_abs_diff"].items():
            assert diff < 1e-3, (row["case"], name, diff)
    moe_cases = [row["case"] for row in r["rows"] if row["group"] == "moe"]
    assert moe_cases[0].startswith("1 ") and moe_cases[1].startswith("32 ")


def test_kernels_gdn_shape(capsys):
    """`make bench`'s GDN rows at a chosen shape and chunk: ours against transformers' fallback on
    the same inputs; a shape that is not five positive integers is a one-line error."""
    rc, out, err = bench(capsys, "kernels", "--only", "gdn", "--gdn-shape", "2,48,2,16,8", "--gdn-chunk", "16",
                         "--repeat", "1", "--json", "-")
    assert rc == 0, err
    r = json.loads(out)
    assert r["shapes"]["gdn"] == {"B": 2, "T": 48, "H": 2, "K": 16, "V": 8, "chunk": 16}
    assert [row["case"] for row in r["rows"]] == ["chunk prefill B=2 T=48 H=2 K=16 V=8 chunk=16",
                                                  "recurrent step B=2 T=1 H=2 K=16 V=8"]
    assert all(d < 1e-4 for row in r["rows"] for d in row["max_abs_diff"].values())
    for bad in ("2,48", "2,48,0,16,8"):
        rc, _, err = bench(capsys, "kernels", "--only", "gdn", "--gdn-shape", bad)
        assert rc == 2 and "--gdn-shape" in err


def test_roofline_quick(capsys):
    rc, out, err = bench(capsys, "roofline", "--quick", "--json", "-")
    assert rc == 0, err
    r = json.loads(out)
    assert r["bandwidth"]["read_gbps"] > 0
    ar, dn = r["steps"]["ar_step"], r["steps"]["denoise_step_B32"]
    assert ar["tokens"] == 1 and dn["tokens"] == 32
    assert 0 < ar["experts_touched_per_layer"] <= r["config"]["num_experts_per_tok"]
    assert 0 < dn["experts_touched_per_layer"] <= r["config"]["num_experts"]
    for s in (ar, dn):
        assert s["weight_bytes"] >= r["weight_bytes"]["dense"] + r["weight_bytes"]["lm_head"]
        assert s["pct_of_read_bandwidth"] == pytest.approx(100 * s["achieved_gbps"] / r["bandwidth"]["read_gbps"])


def test_profile_steps(tiny_dir, tmp_path, capsys):
    rc, out, err = bench(capsys, "profile", "--model", str(tiny_dir), "--ar-steps", "1", "--denoise-steps", "1",
                         "--block-size", "4")
    assert rc == 0, err
    assert "== AR step:" in out and "== denoise step (block 4):" in out
    assert out.count("Self CPU") >= 2 and out.count("function calls") >= 2  # torch.profiler and cProfile, each kind

    from clover.tiny import build_tiny_checkpoint

    eight = build_tiny_checkpoint(tmp_path / "b8", block_size=8)
    rc, out, err = bench(capsys, "profile", "--model", str(eight), "--ar-steps", "1", "--denoise-steps", "1")
    assert rc == 0 and "== denoise step (block 8):" in out, err  # the model's block size by default
    rc, out, err = bench(capsys, "profile", "--ar-steps", "0")
    assert rc == 2 and "--ar-steps: must be a positive integer" in err


def test_profile_of_an_ar_checkpoint_is_one_line(tmp_path, capsys):
    from clover.tiny import build_tiny_checkpoint

    ar = build_tiny_checkpoint(tmp_path / "ar", clover=False)
    rc, out, err = bench(capsys, "profile", "--model", str(ar), "--ar-steps", "1", "--denoise-steps", "1")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "no mask token" in err, err


def test_code_scoring():
    header = "    def f(self, x):\n"
    body = "        y = x + 1\n        if y:\n            return y\n        return 0\n"
    item = Item("code", header, body)
    assert score(item, body + "\n    def g(self):\n        pass\n", "length") == {"parses": True, "similarity": 1.0, "ended": True}
    # cut by the length limit inside the `if`: the unfinished statement is dropped
    trimmed, ok, ended = trim_body(header, "        y = x + 1\n        if y:\n            ret", truncated=True)
    assert ok and not ended and trimmed == "        y = x + 1\n"
    assert score(item, "", "length")["parses"] is False
    task_items = load_items("tasks", 2)
    assert score(task_items[0], task_items[0].reference + "\nassert", "length")["exact"] is True


def test_divergence_from_ar():
    from clover.bench.decode import divergence

    ar = [{"token_ids": [1, 2, 3, 4]}] * 4
    runs = [{"token_ids": [1, 2, 3, 4], "forced_tokens": [2]},  # same as AR
            {"token_ids": [1, 9, 3, 4], "forced_tokens": [1]},  # first difference at 1, a forced commit
            {"token_ids": [1, 2, 9, 9], "forced_tokens": [3]},  # at 2, committed confidently
            {"token_ids": [1, 2], "forced_tokens": [0, 1]}]     # ended early: the difference is past its tokens
    d = divergence(list(zip(ar, runs)))
    assert d == {"prompts": 4, "diverged": 0.75, "first_at_forced_commit": pytest.approx(1 / 3)}
    assert divergence([(ar[0], runs[0])])["first_at_forced_commit"] is None


def test_summarize_ratios():
    runs = [
        {"item": 0, "mode": "ar", "workload": "tasks", "tokens": 10, "forwards": 10, "seconds": 1.0, "tokens_per_second": 10.0,
         "forced_steps": 0, "experts_touched": 2.0, "cache_bytes": 1, "cuda_peak_bytes": None, "token_ids": [1] * 10, "score": {"exact": True, "kind": "max"}},
        {"item": 0, "mode": "diffusion", "workload": "tasks", "tokens": 10, "forwards": 4, "seconds": 0.5,
         "tokens_per_second": 20.0, "forced_steps": 3, "experts_touched": 4.0, "cache_bytes": 2, "cuda_peak_bytes": None,
         "token_ids": [1] * 10, "score": {"exact": False, "kind": "add"}},
        {"item": 1, "mode": "diffusion", "workload": "tasks", "tokens": 6, "forwards": 1, "seconds": 0.5,
         "tokens_per_second": 12.0, "forced_steps": 0, "experts_touched": 4.0, "cache_bytes": 2, "cuda_peak_bytes": None,
         "token_ids": [1] * 6, "score": {"exact": True, "kind": "add"}},
    ]
    s = summarize(runs, ["ar", "diffusion"])
    assert s["diffusion"]["vs_ar"]["tokens_per_second"] == pytest.approx(1.6)  # aggregate: 16 tokens in 1 s vs 10
    assert s["diffusion"]["vs_ar"]["forwards"] == pytest.approx(0.5)
    assert s["diffusion"]["tokens_per_forward"] == pytest.approx(16 / 5)
    assert s["diffusion"]["forced_share"] == pytest.approx(3 / 5) and s["ar"]["forced_share"] is None
    assert s["diffusion"]["vs_ar"]["divergence"] == {"prompts": 1, "diverged": 0.0, "first_at_forced_commit": None}
    assert s["diffusion"]["quality"]["tasks"]["by_kind"] == {"add": {"n": 2, "exact_match": 0.5, "tokens_per_forward": 16 / 5}}
    assert s["ar"]["quality"]["tasks"]["by_kind"]["max"] == {"n": 1, "exact_match": 1.0, "tokens_per_forward": 1.0}
    assert s["ar"]["quality"]["tasks"]["exact_match"] == 1.0


def test_bench_experts_ablation(tiny_dir, capsys):
    from clover import cli

    rc = cli.main(["bench", "experts", "--model", str(tiny_dir), "--prompts", "1", "--max-new-tokens", "8", "--workload", "tasks"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| off |" in out and "| budget 2 (sum) |" in out and "| budget 2 (max) |" in out and "| ar |" in out


def test_bench_experts_refuses_a_dense_model(tmp_path, capsys):
    from clover import cli
    from clover.tiny import build_tiny_checkpoint

    for backbone in ("qwen3_5_text", "llama"):  # dense: no expert fields to share (Llama has none at all)
        d = build_tiny_checkpoint(tmp_path / backbone, dense=True, backbone=backbone)
        assert cli.main(["bench", "experts", "--model", str(d), "--prompts", "1", "--max-new-tokens", "4"]) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and "block expert sharing needs a mixture-of-experts backbone" in err, err


def test_sweep_policy_specs():
    from clover.bench.sweep import configurations, parse_policy

    assert parse_policy("entropy:0.5/sub8") == {"policy": "entropy", "entropy_budget": 0.5, "sub_block": 8}
    assert parse_policy("threshold/leftmost") == {"policy": "threshold", "fallback": "leftmost"}
    assert parse_policy("hierarchy:0.6") == {"policy": "hierarchy", "low_threshold": 0.6}
    for bad, needle in (("nope", "unknown policy"), ("factor:x", "not a number"), ("factor/sub", "modifier"),
                        ("factor:-1", "factor")):
        with pytest.raises(ValueError, match=needle):
            parse_policy(bad)
    cfg = configurations([0.9], [32], 32, 0.9, policies=["factor:1", "threshold:0.7/sub8"])
    pol = [c for c in cfg if c["sweep"] == "policy"]
    assert [c["options"] for c in pol] == [{"policy": "factor", "factor": 1.0}, {"policy": "threshold", "sub_block": 8}]
    assert pol[1]["threshold"] == 0.7


def _hide_matplotlib(monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ModuleNotFoundError


def test_sweep_without_matplotlib_keeps_the_results(tiny_dir, tmp_path, capsys, monkeypatch):
    """The table and the JSON come out before the plot; without the plot extra, one line names it."""
    _hide_matplotlib(monkeypatch)
    png, js = tmp_path / "sweep.png", tmp_path / "sweep.json"
    rc, out, err = bench(capsys, "sweep", "--model", tiny_dir, "--prompts", "1", "-n", "4", "--thresholds", "0.9",
                         "--block-sizes", "8", "--block-size", "8", "--plot", png, "--json", js, "--threads", "1")
    assert rc == 0, err
    assert json.loads(js.read_text())["points"] and "B8/t0.9" in out
    assert not png.exists() and "plot written" not in out
    line = [x for x in err.splitlines() if "plot skipped" in x]
    assert len(line) == 1 and "pip install 'clover-dlm[plot]'" in line[0] and "Traceback" not in err


def test_decode_runs_each_mode_with_its_defaults_unless_told(tiny_llm, monkeypatch):
    """No block size or threshold given: each mode's own defaults reach `generate` (the model's block
    and policy; speculative's adaptive draft), recorded as such; given ones reach every mode."""
    from clover.bench.decode import Workload, options_label, run_decode

    seen = []
    real = tiny_llm.generate
    monkeypatch.setattr(tiny_llm, "generate", lambda prompt, **kw: seen.append(kw) or real(prompt, **kw))
    work = Workload("tasks", prompts=1, max_new_tokens=4)
    res = run_decode(tiny_llm, work, modes=["ar", "speculative"], warmup=False)
    assert seen and not any("block_size" in kw or "threshold" in kw for kw in seen)
    s = res["settings"]
    assert s["defaults"] and s["block_size"] == tiny_llm.config.block_size and "each mode's defaults" in options_label(s)
    seen.clear()
    res = run_decode(tiny_llm, work, modes=["ar", "speculative"], block_size=4, warmup=False)
    assert seen and all(kw["block_size"] == 4 and "threshold" not in kw for kw in seen)
    assert not res["settings"]["defaults"] and options_label(res["settings"]).startswith("block 4 · threshold")


def test_default_workloads_decode_each_answer_to_its_end(tiny_llm, monkeypatch):
    """A task's answer is its line and a function ends where the next definition at its level
    begins: by default every generation stops there (`Item.stop`), not at a fixed length past it;
    `to_end=False` (`--fixed-length`) runs every prompt to max_new_tokens, as before."""
    from clover.bench.decode import Workload, code_stops, run_decode

    assert all(it.stop == ["\n"] for it in load_items("tasks", 3))
    code = load_items("code", 3)
    assert all(it.stop == code_stops(it.prompt) for it in code)
    assert "\n    def " in code_stops("    def f(self):\n") and "\ndef " in code_stops("    def f(self):\n")
    assert code_stops("def f(x):\n") == sorted({"\ndef ", "\nasync def ", "\nclass ", "\n@"})

    seen = []
    real = tiny_llm.generate
    monkeypatch.setattr(tiny_llm, "generate", lambda prompt, **kw: seen.append(kw) or real(prompt, **kw))
    res = run_decode(tiny_llm, Workload("both", prompts=1, max_new_tokens=24), modes=["ar"], warmup=False)
    assert [kw.get("stop") for kw in seen] == [["\n"], code_stops(res["items"][1]["prompt"])]
    assert res["settings"]["to_end"] and res["items"][0]["stop"] == ["\n"]
    for run in res["runs"]:
        if run["finish_reason"] == "stop" and run["workload"] == "tasks":
            assert "\n" not in run["text"]
    seen.clear()
    res = run_decode(tiny_llm, Workload("both", prompts=1, max_new_tokens=24, to_end=False), modes=["ar"], warmup=False)
    assert seen and not any("stop" in kw for kw in seen) and not res["settings"]["to_end"]
    assert "stop" not in res["items"][0]
