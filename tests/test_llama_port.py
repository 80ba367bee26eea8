"""The llama.cpp port (ports/llama.cpp, `llama-clover`; docs/llama-port.md).

Fast: the Python driver's mapping of generation options to the port's flags
(clover.integrations.llama_port.port_args), and its refusals.

Slow (CLOVER_SLOW=1, and `PORT=1 scripts/build-llama-cpp.sh`; skipped with the reason otherwise), on
the bundled model exported in f32:
- one forward (a prompt committed + a partly masked block denoised): logits equal clover's `step`
  within the GGUF cross-check's tolerance, and the same argmax everywhere;
- AR greedy: the port equals stock llama.cpp (clover-llama-probe) and clover, 20 held-out prompts x 64;
- diffusion at block 32 / threshold 0.95 on 20 held-out task prompts: the same tokens as clover's
  engine and the same number of forwards, prompt by prompt (the threshold rule, and the model's
  default entropy rule);
- speculative: the same tokens as AR greedy, and the same forwards as clover's speculative engine;
- dflash (`--drafter`, the bundled DFlash drafter exported as its own GGUF): the same drafts, tokens,
  forwards and accept lengths as clover's dflash engine, tokens = AR greedy; in q8_0 = the port's own
  AR; a drafter that does not fit is refused in one line.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from clover.decoding.sampling import SamplingParams
from clover.integrations.llama_port import llama_cache_dir, port_args, port_binary

BUNDLED = Path(__file__).resolve().parents[1] / "src" / "clover" / "assets" / "clover-tiny"
PROMPTS, TOKENS = 20, 64
LOGIT_ATOL, LOGIT_RTOL = 1e-3, 1e-3  # as tests/test_gguf.py


# ------------------------------------------------------------------------------ fast: the driver
def test_port_args_diffusion():
    p = SamplingParams(max_new_tokens=48, block_size=16, threshold=0.9, policy="threshold", stop_token_ids=[7, 9])
    a = port_args("diffusion", p.validate())
    assert a[:4] == ["--mode", "diffusion", "-n", "48"]
    for flag, value in (("--block", "16"), ("--threshold", "0.9"), ("--policy", "threshold"), ("--stop-ids", "7,9")):
        assert a[a.index(flag) + 1] == value
    assert "--ignore-eos" not in a and "--seed" not in a
    a = port_args("ar", SamplingParams(max_new_tokens=8, stop=["\n", "))"]).validate())
    assert [a[i + 1] for i, x in enumerate(a) if x == "--stop"] == ["\n", "))"]
    s = port_args("speculative", SamplingParams(max_new_tokens=8, block_size=32, draft_length=8, ignore_eos=True).validate())
    assert s[s.index("--draft") + 1] == "8" and "--ignore-eos" in s


def test_port_takes_every_option():
    """Every SamplingParams field reaches the port (a new clover option must be mapped, or it is refused)."""
    from dataclasses import fields

    from clover.integrations.llama_port import NOT_IN_PORT, OPTIONS, port_options

    assert {f.name for f in fields(SamplingParams)} == set(OPTIONS) | set(NOT_IN_PORT)
    with pytest.raises(ValueError, match="^skip_window: not in the llama.cpp port"):
        port_options("diffusion", SamplingParams(skip_window=True).validate())
    kw = dict(max_new_tokens=8, temperature=0.7, top_p=0.9, top_k=40, seed=3, repetition_penalty=1.2, presence_penalty=0.5,
              eos_penalty=1.0, no_repeat_ngram_size=3, block_size=32, threshold=0.9, confidence="margin",
              policy="hierarchy", low_threshold=0.4, sub_block=8, expert_budget=4, expert_rank="max")
    o = port_options("diffusion", SamplingParams(**kw).validate())
    assert all(o[k] == v for k, v in kw.items())
    a = port_args("diffusion", SamplingParams(**kw).validate())
    for flag, value in (("--temperature", "0.7"), ("--top-k", "40"), ("--seed", "3"), ("--no-repeat-ngram", "3"),
                        ("--sub-block", "8"), ("--expert-budget", "4"), ("--expert-rank", "max"), ("--confidence", "margin")):
        assert a[a.index(flag) + 1] == value


@pytest.mark.parametrize("mode, why", [("naive", "diffusion"), ("dflash", "drafter"), ("beam", "runs ar")])
def test_port_refuses_other_modes_with_a_reason(mode, why):
    with pytest.raises(ValueError, match=f"^mode: .*{why}"):
        port_args(mode, SamplingParams(max_new_tokens=8).validate())


def test_port_refuses_what_it_lacks_with_a_reason():
    with pytest.raises(ValueError, match="^temperature: sampled speculative"):
        port_args("speculative", SamplingParams(max_new_tokens=8, temperature=0.7).validate())
    with pytest.raises(ValueError, match="^temperature: sampled dflash"):
        port_args("dflash", SamplingParams(max_new_tokens=8, temperature=0.7).validate(), drafter="d.gguf")


@pytest.mark.parametrize("mode", ["diffusion", "speculative", "dflash"])
def test_port_args_pass_auto(mode):
    """block_size="auto" reaches the port (each block's or draft's width chosen there)."""
    a = port_args(mode, SamplingParams(max_new_tokens=8, block_size="auto").validate(), drafter="d.gguf")
    assert a[a.index("--block") + 1] == "auto" and "--draft" not in a


def test_port_args_dflash():
    """dflash runs with the drafter's GGUF (`--drafter`); a draft length is passed only when asked for
    (without one the port cuts each draft by the drafter's confidence, as clover)."""
    a = port_args("dflash", SamplingParams(max_new_tokens=8).validate(), drafter="d.gguf")
    assert a[:2] == ["--mode", "dflash"] and a[a.index("--drafter") + 1] == "d.gguf" and "--draft" not in a
    a = port_args("dflash", SamplingParams(max_new_tokens=8, draft_length=5).validate(), drafter="d.gguf")
    assert a[a.index("--draft") + 1] == "5"


def test_drafter_exports_as_its_own_gguf(tmp_path):
    """`clover export-gguf DRAFTER_DIR` writes the DFlash drafter (arch dflash) that `--drafter` reads:
    every parameter under its GGUF name, unchanged in f32, and the drafter's hyperparameters."""
    import gguf

    from clover.api import BUNDLED_DRAFTER
    from clover.checkpoint import load_drafter
    from clover.export.gguf import export_gguf

    r = export_gguf(BUNDLED_DRAFTER, tmp_path / "drafter.gguf", dtype="f32", progress=False)
    assert r.arch == "dflash" and r.sidecar is None
    reader = gguf.GGUFReader(r.path)
    field = lambda k: reader.fields[k].parts[reader.fields[k].data[0]].tolist()  # noqa: E731
    d = load_drafter(BUNDLED_DRAFTER, dtype=torch.float32)
    assert [reader.fields["dflash.target_layer_ids"].parts[i][0] for i in reader.fields["dflash.target_layer_ids"].data] \
        == d.config.target_layer_ids
    assert field("dflash.block_size") == [16] and field("dflash.mask_token_id") == [d.config.mask_token_id]
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == len([k for k in d.state_dict() if not k.startswith("rotary_emb.")])
    for name, gname in (("fc.weight", "fc.weight"), ("layers.1.self_attn.k_proj.weight", "blk.1.attn_k.weight"),
                        ("layers.0.post_attention_layernorm.weight", "blk.0.ffn_norm.weight"), ("norm.weight", "output_norm.weight")):
        want = d.state_dict()[name].numpy()
        assert np.array_equal(np.asarray(tensors[gname].data).reshape(want.shape), want), name


# ------------------------------------------------------------------------------ slow: the port itself
PORT = port_binary()
PROBE = llama_cache_dir() / "bin" / "clover-llama-probe"


@pytest.fixture(scope="module")
def port():
    if not PORT.exists():
        pytest.skip(f"llama.cpp port absent ({PORT} not found): run PORT=1 scripts/build-llama-cpp.sh")
    return PORT


@pytest.fixture(scope="module")
def llm():
    import clover

    torch.set_num_threads(1)
    return clover.load(BUNDLED, dtype="float32")


def task_prompts(llm, n: int) -> list[list[int]]:
    from clover.data.tasks import heldout_tasks

    return [llm.tokenizer.encode(t.prompt) for t in heldout_tasks(n)]


def mixed_prompts(llm, n: int) -> list[list[int]]:
    """tests/test_gguf.py's held-out prompts: n/2 task prompts and n/2 stdlib `def` headers."""
    from clover.data.corpus import heldout_functions
    from clover.data.tasks import heldout_tasks

    tasks = [t.prompt for t in heldout_tasks(n // 2)]
    code = [h for h, _ in heldout_functions(n - len(tasks), seed=0)]
    return [llm.tokenizer.encode(p) for p in tasks + code]


def port_run(gguf, prompts, mode, llm, drafter=None, extra=(), **kw):
    from clover.integrations.llama_port import run

    params = llm.params(mode, dict(max_new_tokens=TOKENS, temperature=0.0) | kw)
    return run(gguf, prompts, port_args(mode, params, drafter=drafter) + list(extra), eos_ids=llm.config.eos_token_ids,
               timeout=900)


@pytest.mark.slow
def test_port_forward_matches_clover(port, bundled_f32, llm, tmp_path):
    """One forward, commit + denoise, from an empty cache: the logits of every position."""
    from clover.integrations.llama_port import forward_logits

    prompt = task_prompts(llm, 1)[0]
    g = torch.Generator().manual_seed(0)
    block = [llm.config.mask_token_id] * 32
    for j in torch.randperm(32, generator=g)[:10].tolist():  # a block in mid-decoding: 10 of 32 decoded
        block[j] = int(torch.randint(3, llm.config.vocab_size, (1,), generator=g))
    cache = llm.model.make_cache(1, len(prompt) + 32)
    with torch.no_grad():
        out = llm.model.step(cache, commit_ids=torch.tensor([prompt]), denoise_ids=torch.tensor([block]), all_logits=True)
    ours = torch.cat([out.commit_logits[0], out.denoise_logits[0]]).float().numpy()
    theirs = forward_logits(bundled_f32, prompt, block, tmp_path / "logits.f32", binary=port)
    assert theirs.shape == ours.shape
    diff = np.abs(ours - theirs)
    scale = np.abs(ours).max(axis=1, keepdims=True)
    Tc = len(prompt)
    print(f"\nforward: commit max |diff| {diff[:Tc].max():.2e}, denoise max |diff| {diff[Tc:].max():.2e}, "
          f"logit scale {scale.max():.1f}")
    assert (diff <= LOGIT_ATOL + LOGIT_RTOL * scale).all()
    assert (ours.argmax(1) == theirs.argmax(1)).all()


@pytest.mark.slow
def test_port_ar_matches_stock_llama_cpp_and_clover(port, bundled_f32, llm):
    if not PROBE.exists():
        pytest.skip(f"stock llama.cpp build absent ({PROBE} not found): run scripts/build-llama-cpp.sh")
    prompts = mixed_prompts(llm, PROMPTS)
    res = port_run(bundled_f32, prompts, "ar", llm, ignore_eos=True)
    eos = llm.config.eos_token_ids
    for ids, r in zip(prompts, res):
        stock = subprocess.run([str(PROBE), str(bundled_f32), "greedy", str(TOKENS), *map(str, eos)],
                               input=" ".join(map(str, ids)).encode(), capture_output=True, timeout=600,
                               env={**os.environ, "CLOVER_PROBE_THREADS": "1"})
        assert stock.returncode == 0, stock.stderr.decode()[-2000:]
        assert r["tokens"] == [int(x) for x in stock.stdout.split()]
        ours = llm.generate(ids, mode="ar", max_new_tokens=TOKENS, ignore_eos=True, temperature=0.0)
        assert r["tokens"] == ours.token_ids
        assert r["forwards"] == ours.stats.forwards == TOKENS


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["threshold", "entropy", "factor"])
def test_port_diffusion_matches_clover(port, bundled_f32, llm, policy):
    """Block 32, threshold 0.95, greedy, EOS on: tokens and forwards, prompt by prompt."""
    prompts = task_prompts(llm, PROMPTS)
    kw = dict(block_size=32, threshold=0.95, policy=policy)
    res = port_run(bundled_f32, prompts, "diffusion", llm, **kw)
    forwards = tokens = 0
    for ids, r in zip(prompts, res):
        ours = llm.generate(ids, mode="diffusion", max_new_tokens=TOKENS, temperature=0.0, **kw)
        assert r["tokens"] == ours.token_ids
        assert r["forwards"] == ours.stats.forwards
        assert r["block_steps"] == ours.stats.block_steps
        forwards += r["forwards"]
        tokens += r["n_tokens"]
    print(f"\ndiffusion ({policy}): {tokens} tokens in {forwards} forwards (TPF {tokens / forwards:.2f}), identical")


@pytest.mark.slow
@pytest.mark.parametrize("ignore_eos", [True, False])
def test_port_speculative_equals_ar(port, bundled_f32, llm, ignore_eos):
    prompts = task_prompts(llm, PROMPTS)
    spec = port_run(bundled_f32, prompts, "speculative", llm, block_size=32, ignore_eos=ignore_eos)
    ar = port_run(bundled_f32, prompts, "ar", llm, ignore_eos=ignore_eos)
    for ids, s, a in zip(prompts, spec, ar):
        assert s["tokens"] == a["tokens"]
        ours = llm.generate(ids, mode="speculative", max_new_tokens=TOKENS, temperature=0.0, block_size=32,
                            ignore_eos=ignore_eos)
        assert s["tokens"] == ours.token_ids
        assert s["forwards"] == ours.stats.forwards


@pytest.mark.slow
def test_port_speculative_budgeted_draft_equals_ar(port, bundled_f32, llm):
    """Expert sharing on the draft (denoise) columns only: the verify columns route as AR, so the
    tokens stay AR's (the cheaper lossless mode of docs/llama-port.md, "Speed")."""
    prompts = task_prompts(llm, PROMPTS)
    spec = port_run(bundled_f32, prompts, "speculative", llm, block_size=32, draft_length=3, expert_budget=2,
                    ignore_eos=True)
    ar = port_run(bundled_f32, prompts, "ar", llm, ignore_eos=True)
    assert [s["tokens"] for s in spec] == [a["tokens"] for a in ar]
    assert sum(s["forwards"] for s in spec) < sum(a["forwards"] for a in ar)


@pytest.mark.slow
def test_port_wide_q8_matmul(port, llm, tmp_path):
    """The port's wide q8_0 kernel (`--matmul wide`, the default where built with AVX-512 VNNI) computes
    ggml's results bit for bit: every packed matrix of the bundled model in q8_0 times 1-16 random
    columns equals ggml's q8_0 vec_dot exactly; one forward (a prompt committed + a block denoised)
    gives --matmul ggml's logits exactly (tinyBLAS sums each element as vec_dot does); AR greedy
    gives --matmul ggml's tokens."""
    from clover.export.gguf import export_gguf
    from clover.integrations.llama_port import forward_logits, run

    gguf = tmp_path / "clover-tiny-q8_0.gguf"
    export_gguf(BUNDLED, gguf, dtype="q8_0", progress=False)
    check = subprocess.run([str(port), str(gguf), "--mode", "check-matmul"], capture_output=True, timeout=300)
    if check.returncode != 0 and b"no AVX-512 VNNI" in check.stderr:
        pytest.skip("the port was built without AVX-512 VNNI: no wide kernel to check")
    assert check.returncode == 0, check.stderr.decode()[-2000:]
    res = json.loads(check.stdout)
    print(f"\nwide q8_0 kernel: {res}")
    assert res["matrices"] > 0 and res["checks"] > 0 and res["max_rel_diff"] == 0
    prompt = task_prompts(llm, 1)[0]
    block = [llm.config.mask_token_id] * 8
    block[2], block[5] = prompt[0], prompt[-1]
    logits = {matmul: forward_logits(gguf, prompt, block, tmp_path / f"{matmul}.f32", binary=port, args=["--matmul", matmul])
              for matmul in ("wide", "ggml")}
    assert np.array_equal(logits["wide"], logits["ggml"])
    prompts = mixed_prompts(llm, 4)
    ar = {}
    for matmul in ("wide", "ggml"):
        params = llm.params("ar", dict(max_new_tokens=TOKENS, temperature=0.0, ignore_eos=True))
        ar[matmul] = [r["tokens"] for r in run(gguf, prompts, [*port_args("ar", params), "--matmul", matmul],
                                               eos_ids=llm.config.eos_token_ids, timeout=900)]
    assert ar["wide"] == ar["ggml"]


@pytest.mark.slow
def test_port_gdn_fast_matches_scalar(port, bundled_f32, llm, tmp_path):
    """The GDN ops' vector paths (`--gdn fast`, the default) against the scalar ones (`--gdn scalar`):
    one forward (a prompt committed + a block of 8 denoised) within float rounding, the same argmax
    everywhere; the model's default diffusion and speculative decoding (a rollback replays the
    commit) give the same tokens."""
    from clover.integrations.llama_port import forward_logits, run

    prompt = task_prompts(llm, 1)[0]
    block = [llm.config.mask_token_id] * 8
    block[2], block[5] = prompt[0], prompt[-1]
    logits = {gdn: forward_logits(bundled_f32, prompt, block, tmp_path / f"{gdn}.f32", binary=port, args=["--gdn", gdn])
              for gdn in ("fast", "scalar")}
    diff = np.abs(logits["fast"] - logits["scalar"])
    print(f"\n--gdn fast vs scalar: max |diff| {diff.max():.2e}")
    assert diff.max() <= 1e-4 * np.abs(logits["scalar"]).max()
    assert (logits["fast"].argmax(1) == logits["scalar"].argmax(1)).all()
    prompts = task_prompts(llm, 6)
    for mode, kw in (("diffusion", {}), ("speculative", dict(block_size=4))):
        params = llm.params(mode, dict(max_new_tokens=TOKENS, temperature=0.0) | kw)
        toks = [[r["tokens"] for r in run(bundled_f32, prompts, [*port_args(mode, params), "--gdn", gdn],
                                          eos_ids=llm.config.eos_token_ids, binary=port, timeout=900)]
                for gdn in ("fast", "scalar")]
        assert toks[0] == toks[1], mode


@pytest.mark.slow
def test_port_profile(port, bundled_f32, llm):
    """CLOVER_PORT_PROFILE=1 computes the graphs node by node: the same tokens, and a table per
    forward shape on stderr naming the ops and the matmuls' weights."""
    stdin = "".join(" ".join(map(str, p)) + "\n" for p in task_prompts(llm, 2)).encode()
    cmd = [str(port), str(bundled_f32), "--mode", "diffusion", "-n", "24", "--threads", "1"]
    plain = subprocess.run(cmd, input=stdin, capture_output=True, timeout=300)
    prof = subprocess.run(cmd, input=stdin, capture_output=True, timeout=300,
                          env={**os.environ, "CLOVER_PORT_PROFILE": "1"})
    assert plain.returncode == prof.returncode == 0, prof.stderr.decode()[-2000:]
    tokens = [[json.loads(line)["tokens"] for line in r.stdout.decode().splitlines()] for r in (plain, prof)]
    assert tokens[0] == tokens[1]
    err = prof.stderr.decode()
    assert "== forward Tc=" in err and "MUL_MAT output.weight" in err and "CUSTOM gdn_mix" in err
    assert "== forward" not in plain.stderr.decode()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["diffusion", "speculative", "dflash"])
def test_generate_engine_llama_cpp(port, bundled_f32, mode, capsys):
    """`clover generate --engine llama.cpp --json` gives clover's own text, tokens and forwards
    (dflash: the bundled drafter exported next to the target on the way)."""
    import json

    from clover.cli import main

    prompt = "assert sorted([9, 2, 5]) == "
    common = [prompt, "--model", str(BUNDLED), "--dtype", "float32", "--mode", mode, "-n", "40", "--json"]
    if mode == "speculative":  # the fixed draft: its default, the adaptive draft, chooses widths by each engine's own costs
        common += ["--block-size", "8"]
    assert main(["generate", *common]) == 0
    ours = json.loads(capsys.readouterr().out)
    assert main(["generate", *common, "--engine", "llama.cpp", "--gguf", str(bundled_f32)]) == 0
    theirs = json.loads(capsys.readouterr().out)
    assert theirs["engine"] == "llama.cpp"
    assert theirs["token_ids"] == ours["token_ids"] and theirs["text"] == ours["text"]
    assert theirs["stats"]["forwards"] == ours["stats"]["forwards"]


def port_stops_like_clover(gguf, llm, prompts, mode, kw, drafter=None) -> int:
    """The port against clover on `prompts`: tokens, forwards and finish reason equal prompt by
    prompt; returns how many ended on a stop."""
    from clover.integrations.llama_port import run

    res = run(gguf, prompts, port_args(mode, llm.params(mode, kw), drafter=drafter), eos_ids=llm.config.eos_token_ids)
    for ids, r in zip(prompts, res):
        ours = llm.generate(ids, mode=mode, **kw)
        assert (r["tokens"], r["forwards"], r["finish"]) == (ours.token_ids, ours.stats.forwards, ours.finish_reason)
    return sum(r["finish"] == "stop" for r in res)


@pytest.mark.slow
@pytest.mark.parametrize("mode, kw", [
    ("diffusion", dict(block_size=32, threshold=0.95, policy="threshold")),
    ("diffusion", dict(block_size=8, threshold=0.9, policy="entropy")),
    ("speculative", dict(block_size=32)),
    ("ar", {}),
])
def test_port_stop_token_matches_clover(port, bundled_f32, llm, mode, kw):
    """A stop token (newline) caps the block, a length limit that is no multiple of the block:
    tokens, forwards and finish reason equal clover's, prompt by prompt."""
    kw = dict(max_new_tokens=40, temperature=0.0, stop_token_ids=llm.tokenizer.encode("\n")) | kw
    assert port_stops_like_clover(bundled_f32, llm, task_prompts(llm, PROMPTS), mode, kw) > 0  # the stop token fires


@pytest.mark.slow
@pytest.mark.parametrize("mode, kw", [
    ("diffusion", dict(block_size=32, threshold=0.95, policy="threshold")),
    ("speculative", dict(block_size=32)),
    ("ar", {}),
])
def test_port_stop_strings_match_clover(port, bundled_f32, llm, mode, kw):
    """Stop strings, decided in the port on the GGUF vocabulary's bytes: tokens (up to the one that
    completes the string), forwards and finish reason equal clover's prompt by prompt, and the
    driver's text is trimmed as clover's is."""
    from clover.integrations.llama_port import generate

    kw = dict(max_new_tokens=40, temperature=0.0, stop=[", ", "\n"]) | kw
    prompts = mixed_prompts(llm, PROMPTS)
    assert port_stops_like_clover(bundled_f32, llm, prompts, mode, kw) > 0
    text = llm.tokenizer.decode(prompts[0])
    theirs = generate(llm, text, mode, kw, gguf=bundled_f32)
    ours = llm.generate(text, mode=mode, **kw)
    assert (theirs["text"], theirs["finish_reason"]) == (ours.text, ours.finish_reason)


# ------------------------------------------------------------------------------ slow: text, options, sampling
def port_requests(gguf, llm, requests: list[dict]) -> list[list[dict]]:
    """Each request through one `llama-clover --json` process: its events, the `done` line last."""
    from clover.integrations.llama_port import PortProcess

    with PortProcess(gguf, eos_ids=llm.eos_ids()) as proc:
        return [list(proc.request(r)) for r in requests]


def options(llm, mode, drafter=None, **kw) -> dict:
    from clover.integrations.llama_port import port_options

    return port_options(mode, llm.params(mode, kw), drafter=drafter)


@pytest.mark.slow
def test_port_text_in_and_out(port, bundled_f32, llm):
    """Text prompts go through the GGUF's tokenizer (llama.cpp's vocab API) to clover's token ids;
    the output text is clover's decode of the tokens; the streamed commit texts are a prefix of it."""
    from clover.data.corpus import heldout_functions
    from clover.data.tasks import heldout_tasks

    texts = [t.prompt for t in heldout_tasks(8)] + [h for h, _ in heldout_functions(8, seed=0)]
    texts += ["héllo wörld — ünïcode ✓ 日本語", "  two  spaces\n\n\ttab <|im_end|> x"]
    kw = dict(max_new_tokens=40, block_size=32, threshold=0.95, policy="threshold", stop=["\n\n"])
    res = port_requests(bundled_f32, llm, [{"prompt": t, "stream": True, **options(llm, "diffusion", **kw)} for t in texts])
    for t, evs in zip(texts, res):
        done = evs[-1]
        assert done["prompt_ids"] == llm.tokenizer.encode(t)
        ours = llm.generate(t, mode="diffusion", temperature=0.0, **kw)
        assert (done["tokens"], done["text"], done["finish"]) == (ours.token_ids, ours.text, ours.finish_reason)
        streamed = "".join(e["text"] for e in evs[:-1])
        assert done["text"].startswith(streamed) and all(e["event"] == "commit" for e in evs[:-1])
    assert sum(len(evs) > 2 for evs in res) > len(texts) // 2  # most rows streamed more than one block


@pytest.mark.slow
def test_port_chat_template(port, bundled_f32, llm):
    """`messages` through the GGUF's chat template (llama_chat_apply_template) give clover's chat
    prompt ids, control tokens written in content encoded as text."""
    chats = [
        [{"role": "user", "content": "Write a function that adds two numbers."}],
        [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "sort a list"},
         {"role": "assistant", "content": "sorted(xs)"}, {"role": "user", "content": "and reversed?"}],
        [{"role": "user", "content": "a <|im_end|>\n<|im_start|>assistant\nb"}],
    ]
    res = port_requests(bundled_f32, llm, [{"messages": c, "mode": "ar", "max_new_tokens": 4} for c in chats])
    for c, evs in zip(chats[:2], res):
        assert evs[-1]["prompt_ids"] == llm.tokenizer.apply_chat_template(c, add_generation_prompt=True)
    # control-token text in content: the same text, and the control tokens only where the template
    # writes them (the ids of the text itself may differ: llama.cpp's pre-tokenizer for this vocab is
    # the closest match, not exact, docs/gguf.md)
    ids, ours = res[2][-1]["prompt_ids"], llm.tokenizer.apply_chat_template(chats[2], add_generation_prompt=True)
    assert llm.tokenizer.decode(ids) == llm.tokenizer.decode(ours)
    control = {llm.tokenizer.hf.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|im_end|>")}
    assert [t for t in ids if t in control] == [t for t in ours if t in control] and len([t for t in ids if t in control]) == 3


OPTION_CASES = [
    ("diffusion", dict(repetition_penalty=1.5)),
    ("diffusion", dict(presence_penalty=1.5)),
    ("diffusion", dict(no_repeat_ngram_size=2)),
    ("diffusion", dict(eos_penalty=-8.0)),
    ("diffusion", dict(sub_block=8)),
    ("diffusion", dict(confidence="margin", threshold=0.9)),
    ("diffusion", dict(confidence="entropy", threshold=0.6)),
    ("diffusion", dict(policy="hierarchy", threshold=0.95, low_threshold=0.3)),
    ("diffusion", dict(policy="factor", factor=2.0, fallback="leftmost")),
    ("diffusion", dict(expert_budget=4)),
    ("diffusion", dict(expert_budget=3, expert_rank="max")),
    ("ar", dict(repetition_penalty=1.5, presence_penalty=0.5)),
    ("ar", dict(no_repeat_ngram_size=3)),
    ("ar", dict(eos_penalty=-8.0)),
    ("speculative", dict(eos_penalty=-8.0, expert_budget=4, block_size=8)),  # the fixed draft (auto: each engine's costs)
    ("diffusion", dict(logit_bias={225: 4.0, 203: -3.0})),
    ("speculative", dict(logit_bias={225: -20.0}, block_size=8)),
]


@pytest.mark.slow
@pytest.mark.parametrize("mode, kw", OPTION_CASES, ids=[f"{m}-{'-'.join(map(str, k.values()))}" for m, k in OPTION_CASES])
def test_port_option_matches_clover(port, bundled_f32, llm, mode, kw):
    """Each decoding option, greedy: the port's tokens, forwards and finish reason equal clover's,
    prompt by prompt, and the option changes the output of at least one prompt."""
    prompts = mixed_prompts(llm, 6)
    base = dict(max_new_tokens=40, temperature=0.0) | (dict(block_size=32, threshold=0.95, policy="threshold")
                                                          if mode == "diffusion" else {})
    res = port_requests(bundled_f32, llm, [{"prompt": p, **options(llm, mode, **(base | kw))} for p in prompts])
    plain = port_requests(bundled_f32, llm, [{"prompt": p, **options(llm, mode, **base)} for p in prompts])
    for ids, evs in zip(prompts, res):
        ours = llm.generate(ids, mode=mode, **(base | kw))
        r = evs[-1]
        assert (r["tokens"], r["forwards"], r["finish"]) == (ours.token_ids, ours.stats.forwards, ours.finish_reason)
    assert any((a[-1]["tokens"], a[-1]["forwards"]) != (b[-1]["tokens"], b[-1]["forwards"]) for a, b in zip(res, plain))


def chi2_critical(dof: int, z: float = 3.29) -> float:
    """The chi-square quantile at the normal quantile z (3.29: p = 5e-4), Wilson-Hilferty."""
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


@pytest.mark.slow
@pytest.mark.parametrize("kw", [dict(temperature=1.0), dict(temperature=0.7, top_k=12),
                                dict(temperature=1.3, top_p=0.8), dict(temperature=1.0, repetition_penalty=1.3)])
def test_port_sampling_distribution(port, bundled_f32, llm, kw):
    """Sampling: the port's first token over 2000 seeds follows the distribution clover samples from
    (clover's processed and filtered logits), by a chi-square test; a seed repeats its draw."""
    from clover.decoding.sampling import SamplingParams, filter_logits, process_logits

    ids = llm.tokenizer.encode("def ")
    n = 2000
    reqs = [{"prompt": ids, **options(llm, "ar", max_new_tokens=1, seed=s, **kw)} for s in range(n)]
    res = port_requests(bundled_f32, llm, reqs + reqs[:20])
    got = [evs[-1]["tokens"][0] for evs in res]
    assert got[n:] == got[:20]  # the same seed, the same token
    cache = llm.model.make_cache(1, len(ids) + 1)
    with torch.no_grad():
        logits = llm.model.step(cache, commit_ids=torch.tensor([ids])).commit_logits[0][None].float()
    params = SamplingParams(**kw).validate()
    history = [ids] if params.repetition_penalty != 1.0 else None
    probs = filter_logits(process_logits(logits, params, history, llm.config.eos_token_ids), params).softmax(-1)[0]
    expected = (probs * n).double()
    counts = torch.bincount(torch.tensor(got[:n]), minlength=len(probs)).double()
    assert counts[expected == 0].sum() == 0  # never a token clover cannot draw
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    chi2 = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    dof = int(keep.sum()) - 1
    print(f"\nsampling {kw}: chi2 {chi2:.1f} on {dof} dof (critical {chi2_critical(dof):.1f}), {int(big.sum())} tokens")
    assert dof >= 3 and chi2 < chi2_critical(dof)


@pytest.mark.slow
def test_port_sampled_diffusion(port, bundled_f32, llm):
    """Sampled diffusion: with top_k 1 the draw is certain (and so is its confidence, measured on the
    filtered distribution), so the port's tokens and forwards equal clover's; a seed repeats its
    output; another seed differs."""
    prompts = task_prompts(llm, 4)
    base = dict(max_new_tokens=32, block_size=32, threshold=0.9, policy="threshold")
    kw = dict(temperature=1.0, top_k=1, seed=1) | base
    top1 = port_requests(bundled_f32, llm, [{"prompt": p, **options(llm, "diffusion", **kw)} for p in prompts])
    for p, evs in zip(prompts, top1):
        ours = llm.generate(p, mode="diffusion", **kw)
        assert (evs[-1]["tokens"], evs[-1]["forwards"]) == (ours.token_ids, ours.stats.forwards)
    reqs = [{"prompt": prompts[0], **options(llm, "diffusion", temperature=1.0, seed=s, **base)} for s in (5, 5, 6)]
    a, b, c = (evs[-1]["tokens"] for evs in port_requests(bundled_f32, llm, reqs))
    assert a == b and a != c


@pytest.mark.slow
def test_port_cancel(port, bundled_f32, llm):
    """A cancel line stops the running request before its next forward (finish "abort"); the process
    goes on with the next request."""
    from clover.integrations.llama_port import PortProcess

    with PortProcess(bundled_f32, eos_ids=llm.eos_ids()) as proc:
        rid = proc.send({"prompt": [5, 6, 7], "mode": "ar", "max_new_tokens": 4000, "ignore_eos": True, "stream": True})
        assert proc.event()["event"] == "commit"
        proc.cancel(rid)
        while (ev := proc.event())["event"] != "done":
            pass
        assert ev["finish"] == "abort" and ev["id"] == rid and ev["n_tokens"] < 4000
        after = list(proc.request({"prompt": [5, 6, 7], "mode": "ar", "max_new_tokens": 3}))
        assert after[-1]["n_tokens"] == 3


@pytest.mark.slow
def test_serve_engine_llama_cpp(port, bundled_f32, llm, cost_cache):
    """`clover serve --engine llama.cpp`: the OpenAI API served through the port answers as the torch
    engine does: text, finish reason and usage (completions and chat, streamed or not, each mode,
    speculative with block_size auto: each engine's own step costs, AR's text either way), and the
    same errors for bad requests; a mode the port lacks is refused with its reason."""
    import json

    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from clover.integrations.llama_port import PortLLM
    from clover.serve import create_app

    served = PortLLM(llm, bundled_f32)
    bodies = [
        ("/v1/completions", {"prompt": "def add(a, b):", "max_tokens": 40, "mode": "diffusion", "threshold": 0.95,
                             "policy": "threshold", "stop": ["\n\n"]}),
        ("/v1/completions", {"prompt": ["assert sorted([9, 2, 5]) == ", "def f(x):"], "max_tokens": 24, "mode": "ar"}),
        ("/v1/completions", {"prompt": "import os\n", "max_tokens": 30, "mode": "speculative"}),
        ("/v1/completions", {"prompt": "def f(x):", "max_tokens": 30, "mode": "speculative", "block_size": "auto"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "sort a list"}], "max_tokens": 20,
                                  "mode": "diffusion"}),
    ]
    bad = [
        {"prompt": "x", "max_tokens": 10**7, "mode": "ar"},
        {"prompt": "x", "max_tokens": 4, "temperature": -1},
        {"prompt": "x", "max_tokens": 4, "mode": "speculative", "repetition_penalty": 1.2},
    ]

    def streamed(client, path, body) -> str:
        r = client.post(path, json={**body, "stream": True})
        assert r.status_code == 200, r.text
        text = ""
        for line in r.text.splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:])["choices"]:
                    text += (c.get("text") or (c.get("delta") or {}).get("content") or "")
        return text

    try:
        with TestClient(create_app(llm, model_name="m")) as a, TestClient(create_app(served, model_name="m")) as b:
            for path, body in bodies:
                body = {"model": "m", "temperature": 0, **body}
                ra, rb = a.post(path, json=body), b.post(path, json=body)
                assert ra.status_code == rb.status_code == 200, rb.text
                ca, cb = ra.json()["choices"], rb.json()["choices"]
                key = "text" if path.endswith("completions") and "messages" not in body else "message"
                assert [(c[key], c["finish_reason"]) for c in ca] == [(c[key], c["finish_reason"]) for c in cb]
                assert ra.json()["usage"] == rb.json()["usage"]
                if len(ca) == 1:
                    text = cb[0][key] if key == "text" else cb[0][key]["content"]
                    assert streamed(b, path, body) == text
            assert any(f.name.startswith("port-") for f in cost_cache.iterdir())  # the port measured its step costs
            for body in bad:
                ra, rb = a.post("/v1/completions", json={"model": "m", **body}), b.post("/v1/completions", json={"model": "m", **body})
                assert ra.status_code == rb.status_code == 400 and ra.json() == rb.json()
            r = b.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 4, "mode": "naive"})
            assert r.status_code == 400 and "diffusion" in r.json()["error"]["message"]
            r = b.post("/v1/completions", json={"model": "m", "prompt": "x", "max_tokens": 4, "mode": "speculative",
                                                "temperature": 0.5})
            assert r.status_code == 400 and "rejection rule" in r.json()["error"]["message"]
    finally:
        served.close()


# ------------------------------------------------------------------------------ slow: dflash
@pytest.fixture(scope="module")
def drafter_f32(tmp_path_factory):
    """The bundled DFlash drafter as its own f32 GGUF (the port's --drafter)."""
    from clover.api import BUNDLED_DRAFTER
    from clover.export.gguf import export_gguf

    return export_gguf(BUNDLED_DRAFTER, tmp_path_factory.mktemp("drafter") / "drafter-f32.gguf", dtype="f32",
                       progress=False).path


def clover_dflash(llm, ids, monkeypatch, **kw):
    """clover's dflash generation of `ids` and the drafts of each verify (after the confidence cut)."""
    from clover.decoding.dflash import DFlashEngine

    drafts, draft = [], DFlashEngine._draft

    def spy(self, rows):
        out = draft(self, rows)
        drafts.extend(d for d in out[0] if d is not None)
        return out

    monkeypatch.setattr(DFlashEngine, "_draft", spy)
    gen = llm.generate(ids, mode="dflash", **(dict(max_new_tokens=TOKENS, temperature=0.0) | kw))
    monkeypatch.undo()
    return gen, drafts


@pytest.mark.slow
@pytest.mark.parametrize("ignore_eos", [True, False])
def test_port_dflash_matches_clover(port, bundled_f32, drafter_f32, llm, monkeypatch, ignore_eos):
    """dflash, f32, 20 held-out task prompts x 64: the port's drafts (after the confidence cut),
    tokens, target forwards and accept lengths equal clover's dflash engine, prompt by prompt, and
    its tokens equal the port's AR greedy (which equals clover's and stock llama.cpp's, above)."""
    prompts = task_prompts(llm, PROMPTS)
    res = port_run(bundled_f32, prompts, "dflash", llm, drafter=drafter_f32, ignore_eos=ignore_eos)
    ar = port_run(bundled_f32, prompts, "ar", llm, ignore_eos=ignore_eos)
    tokens = forwards = 0
    for ids, r, a in zip(prompts, res, ar):
        ours, drafts = clover_dflash(llm, ids, monkeypatch, ignore_eos=ignore_eos)
        assert r["tokens"] == ours.token_ids == a["tokens"]
        assert r["drafts"] == drafts
        assert (r["forwards"], r["accept_lengths"], r["draft_forwards"], r["finish"]) == \
            (ours.stats.forwards, ours.stats.accept_lengths, ours.stats.draft_forwards, ours.finish_reason)
        tokens += r["n_tokens"]
        forwards += r["forwards"]
    print(f"\ndflash: {tokens} tokens in {forwards} target forwards (TPF {tokens / forwards:.2f}), identical")
    assert forwards < tokens / 3


@pytest.mark.slow
def test_port_dflash_fixed_draft_and_last_layer_tap(port, bundled_f32, llm, monkeypatch, tmp_path):
    """A draft length asked for is kept whole (no confidence cut), and a drafter that taps the
    target's last layer reads it after the final norm (DFlashDrafter.context_features): the bundled
    drafter's weights with target_layer_ids [1, 2, 3, 4, 7] give clover's drafts and tokens."""
    import clover
    from clover.api import BUNDLED_DRAFTER
    from clover.checkpoint import load_drafter, save_drafter
    from clover.export.gguf import export_gguf

    d = load_drafter(BUNDLED_DRAFTER, dtype=torch.float32)
    d.config.target_layer_ids = [1, 2, 3, 4, llm.config.num_hidden_layers - 1]
    save_drafter(d, tmp_path / "last")
    gguf = export_gguf(tmp_path / "last", tmp_path / "last.gguf", dtype="f32", progress=False).path
    other = clover.load(BUNDLED, dtype="float32", drafter=tmp_path / "last")
    prompts = task_prompts(llm, 6)
    for kw in (dict(draft_length=5), {}):
        res = port_run(bundled_f32, prompts, "dflash", other, drafter=gguf, **kw)
        for ids, r in zip(prompts, res):
            ours, drafts = clover_dflash(other, ids, monkeypatch, **kw)
            assert (r["tokens"], r["drafts"], r["forwards"]) == (ours.token_ids, drafts, ours.stats.forwards)
            if kw:
                assert all(len(x) == 5 for x in r["drafts"])
    assert sum(len(x) for r in res for x in r["drafts"]) > 0


@pytest.mark.slow
def test_port_dflash_reduced_vocabulary_matches_clover(port, bundled_f32, llm, monkeypatch, tmp_path):
    """A drafter with a reduced draft vocabulary (`d2t`; the GGUF's `draft_ids`): the port scores only
    those rows of the target's head and scatters them back, as clover does: the bundled drafter's
    weights over the tokens AR writes on the prompts plus the first 64 ids give clover's drafts,
    tokens, forwards and accept lengths, and AR's tokens."""
    import clover
    from clover.api import BUNDLED_DRAFTER
    from clover.checkpoint import load_drafter, save_drafter
    from clover.export.gguf import export_gguf
    from clover.models.dflash import build_drafter

    prompts = task_prompts(llm, 6)
    ar = port_run(bundled_f32, prompts, "ar", llm)
    ids = sorted(set(range(64)) | {t for a in ar for t in a["tokens"]})
    plain = load_drafter(BUNDLED_DRAFTER, dtype=torch.float32)
    cfg = plain.config
    cfg.draft_vocab_size = len(ids)
    d = build_drafter(cfg)
    d.load_state_dict(plain.state_dict(), strict=False)
    d.set_draft_vocab(ids)
    save_drafter(d, tmp_path / "reduced")
    gguf = export_gguf(tmp_path / "reduced", tmp_path / "reduced.gguf", dtype="f32", progress=False).path
    other = clover.load(BUNDLED, dtype="float32", drafter=tmp_path / "reduced")
    res = port_run(bundled_f32, prompts, "dflash", other, drafter=gguf)
    for ids_, r, a in zip(prompts, res, ar):
        ours, drafts = clover_dflash(other, ids_, monkeypatch)
        assert r["tokens"] == ours.token_ids == a["tokens"]
        assert r["drafts"] == drafts
        assert (r["forwards"], r["accept_lengths"]) == (ours.stats.forwards, ours.stats.accept_lengths)
    assert sum(len(x) for r in res for x in r["drafts"]) > 0


@pytest.mark.slow
def test_port_dflash_q8_0_equals_port_ar(port, bundled_f32, llm, tmp_path):
    """q8_0 (the target and the drafter): dflash's tokens are the port's own AR greedy tokens; so are
    they with the q8_0 drafter and the f32 target."""
    from clover.api import BUNDLED_DRAFTER
    from clover.export.gguf import export_gguf

    target = export_gguf(BUNDLED, tmp_path / "t-q8_0.gguf", dtype="q8_0", progress=False).path
    drafter = export_gguf(BUNDLED_DRAFTER, tmp_path / "d-q8_0.gguf", dtype="q8_0", progress=False).path
    prompts = task_prompts(llm, PROMPTS)
    res = port_run(target, prompts, "dflash", llm, drafter=drafter, ignore_eos=True)
    ar = port_run(target, prompts, "ar", llm, ignore_eos=True)
    assert [r["tokens"] for r in res] == [a["tokens"] for a in ar]
    assert sum(r["forwards"] for r in res) < sum(a["forwards"] for a in ar) / 3
    # the drafter's dtype is free: a q8_0 drafter drafting for the f32 target keeps the f32 AR tokens
    res = port_run(bundled_f32, prompts, "dflash", llm, drafter=drafter, draft_length=3, ignore_eos=True)
    ar = port_run(bundled_f32, prompts, "ar", llm, ignore_eos=True)
    assert [r["tokens"] for r in res] == [a["tokens"] for a in ar]


@pytest.mark.slow
def test_port_dflash_stops_and_streams(port, bundled_f32, drafter_f32, llm):
    """dflash with stop strings and a stop token, EOS on: tokens, forwards and finish reason equal
    clover's prompt by prompt; streamed over the JSON lines, the commit texts are a prefix of the
    final text, which is clover's."""
    from clover.integrations.llama_port import PortProcess

    prompts = mixed_prompts(llm, PROMPTS)
    kw = dict(max_new_tokens=40, temperature=0.0, stop=[", ", "\n"])
    assert port_stops_like_clover(bundled_f32, llm, prompts, "dflash", kw, drafter=drafter_f32) > 0
    kw = dict(max_new_tokens=40, temperature=0.0, stop_token_ids=llm.tokenizer.encode("\n"))
    assert port_stops_like_clover(bundled_f32, llm, task_prompts(llm, PROMPTS), "dflash", kw, drafter=drafter_f32) > 0
    texts = [llm.tokenizer.decode(p) for p in prompts[:6]]
    kw = dict(max_new_tokens=48, stop=["\n\n"])
    with PortProcess(bundled_f32, eos_ids=llm.eos_ids(), drafter=drafter_f32) as proc:
        res = [list(proc.request({"prompt": t, "stream": True, **options(llm, "dflash", drafter_f32, **kw)})) for t in texts]
    for t, evs in zip(texts, res):
        ours = llm.generate(t, mode="dflash", temperature=0.0, **kw)
        done = evs[-1]
        assert (done["tokens"], done["text"], done["finish"]) == (ours.token_ids, ours.text, ours.finish_reason)
        streamed = "".join(e["text"] for e in evs[:-1])
        assert done["text"].startswith(streamed) and all(e["event"] == "commit" for e in evs[:-1])
    assert sum(len(evs) > 2 for evs in res) > len(texts) // 2


def port_error(cmd: list[str], stdin: str = "5 6 7\n") -> str:
    r = subprocess.run(cmd, input=stdin.encode(), capture_output=True, timeout=120)
    assert r.returncode == 1 and not r.stdout
    return r.stderr.decode()


@pytest.mark.slow
def test_port_refuses_a_bad_drafter(port, bundled_f32, drafter_f32, llm, tmp_path):
    """A drafter that is no GGUF, no DFlash drafter, or drafts for another model, and dflash without
    a drafter or with sampling: one line on stderr, naming what is wrong."""
    from clover.export.gguf import export_drafter_gguf
    from clover.models.dflash import build_drafter, drafter_config_for

    (tmp_path / "text.gguf").write_text("not a model\n")
    cfg = drafter_config_for(llm.config)
    narrow = cfg.__class__(**{**cfg.__dict__, "hidden_size": 128, "head_dim": 32, "num_attention_heads": 4})
    far = cfg.__class__(**{**cfg.__dict__, "target_layer_ids": [1, llm.config.num_hidden_layers + 1]})
    export_drafter_gguf(build_drafter(narrow), tmp_path / "narrow.gguf")
    export_drafter_gguf(build_drafter(far), tmp_path / "far.gguf")
    base = [str(port), str(bundled_f32), "--mode", "dflash", "-n", "8"]
    cases = [
        (["--drafter", str(tmp_path / "missing.gguf")], "cannot open the file"),
        (["--drafter", str(tmp_path / "text.gguf")], "not a GGUF file"),
        (["--drafter", str(bundled_f32)], "architecture qwen35moe is not a DFlash drafter"),
        (["--drafter", str(tmp_path / "narrow.gguf")], "hidden_size 128 != the target's"),
        (["--drafter", str(tmp_path / "far.gguf")], f"target_layer_ids name layer {llm.config.num_hidden_layers + 1}"),
        ([], "mode: 'dflash' needs a DFlash drafter"),
        (["--drafter", str(drafter_f32), "--temperature", "0.7"], "temperature: sampled dflash"),
        (["--drafter", str(drafter_f32), "--draft", "16"], "draft_length: must lie in [1, 15]"),
    ]
    for extra, why in cases:
        err = port_error(base + extra)
        assert err.count("\n") == 1 and err.startswith("llama-clover: error: ") and why in err, (extra, err)


@pytest.mark.slow
def test_serve_engine_llama_cpp_dflash(port, bundled_f32, drafter_f32, llm):
    """`clover serve --engine llama.cpp` with the drafter: a dflash completion (streamed too) gives the
    torch engine's text, finish reason and usage; without a drafter dflash is a 400 with the reason."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from clover.integrations.llama_port import PortLLM
    from clover.serve import create_app

    served, bare = PortLLM(llm, bundled_f32, drafter=drafter_f32), PortLLM(llm, bundled_f32)
    body = {"model": "m", "prompt": "def add(a, b):", "max_tokens": 40, "mode": "dflash", "temperature": 0,
            "stop": ["\n\n"]}
    try:
        with TestClient(create_app(llm, model_name="m")) as a, TestClient(create_app(served, model_name="m")) as b, \
                TestClient(create_app(bare, model_name="m")) as c:
            ra, rb = a.post("/v1/completions", json=body), b.post("/v1/completions", json=body)
            assert ra.status_code == rb.status_code == 200, rb.text
            assert [(x["text"], x["finish_reason"]) for x in ra.json()["choices"]] == \
                [(x["text"], x["finish_reason"]) for x in rb.json()["choices"]]
            assert ra.json()["usage"] == rb.json()["usage"]
            r = b.post("/v1/completions", json={**body, "stream": True})
            assert r.status_code == 200
            text = "".join(c["text"] for line in r.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"
                           for c in json.loads(line[6:])["choices"])
            assert text == rb.json()["choices"][0]["text"]
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 400 and "drafter" in r.json()["error"]["message"]
    finally:
        served.close()
        bare.close()


# ------------------------------------------------------------------------------ slow: block_size "auto"
SPEC_COSTS = {1: 0.0010, 8: 0.0022, 16: 0.0025, 32: 0.0032, 64: 0.0047}  # seconds of a step drafting each width
DFLASH_COSTS = {1: 0.004, 2: 0.0019, 4: 0.0026, 8: 0.0044, 16: 0.0079}  # 1: the AR step (a table where it never wins)
# diffusion: the AR step, then per width its denoise forward and a block's last (w committed + w denoised)
DIFFUSION_COSTS = {1: 0.0016, 8: (0.0026, 0.0040), 16: (0.0040, 0.0060), 32: (0.0060, 0.0100), 64: (0.0100, 0.0180)}


def step_costs_arg(costs: dict) -> list[str]:
    return ["--step-costs", ",".join(f"{w}:{s!r}" if not isinstance(s, tuple) else f"{w}:{s[0]!r}/{s[1]!r}"
                                     for w, s in costs.items())]


def forced_curve(costs: dict, kind: str):
    """The cost table as clover's engines read it (a `width.CostCurve` of that kind at batch 1;
    diffusion's: the AR step as the commit forward of one, the denoise and block forwards)."""
    from clover.decoding.width import CostCurve

    curve = CostCurve()
    for w, s in costs.items():
        if isinstance(s, tuple):
            curve.add("denoise", 1, w, s[0])
            curve.add("block", 1, w, s[1])
        else:
            curve.add("commit" if kind == "diffusion" else kind, 1, w, s)
    return curve


@pytest.fixture
def cost_cache(tmp_path, monkeypatch):
    """A fresh cache for the port's measured step costs (not the user's); the port's build stays where
    it was found (its default dir is under the same user cache)."""
    from clover.integrations.llama_port import llama_cache_dir

    monkeypatch.setenv("CLOVER_LLAMA_CPP_DIR", str(llama_cache_dir()))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "clover" / "cost"


@pytest.mark.slow
@pytest.mark.parametrize("mode, dtype", [("speculative", "f32"), ("dflash", "f32"), ("dflash", "q8_0")])
def test_port_auto_equals_port_ar(port, bundled_f32, llm, tmp_path, cost_cache, mode, dtype):
    """block_size "auto" with the step costs the port measures at start-up: the tokens are the port's
    AR greedy tokens (dflash: the exact verify, in q8_0 too); each decision is in the result line (a
    width the mode chooses among, and why); the costs are measured once and cached."""
    from clover.api import BUNDLED_DRAFTER
    from clover.export.gguf import export_gguf

    target = bundled_f32 if dtype == "f32" else export_gguf(BUNDLED, tmp_path / "t.gguf", dtype=dtype, progress=False).path
    drafter = export_gguf(BUNDLED_DRAFTER, tmp_path / "d.gguf", dtype=dtype, progress=False).path if mode == "dflash" else None
    prompts = task_prompts(llm, PROMPTS)
    res = port_run(target, prompts, mode, llm, drafter=drafter, block_size="auto", ignore_eos=True)
    ar = port_run(target, prompts, "ar", llm, ignore_eos=True)
    assert [r["tokens"] for r in res] == [a["tokens"] for a in ar]
    widths = {1, 8, 16, 32, 64} if mode == "speculative" else {1, 2, 4, 8, 16}
    costs = res[0]["step_costs"]
    assert {int(w) for w in costs["seconds"]} == widths and costs["source"] == "measured" and costs["measure_seconds"] > 0
    assert all(r["step_costs"]["seconds"] == costs["seconds"] for r in res)  # measured once per process
    for r in res:
        assert r["width_choices"] and {c["width"] for c in r["width_choices"]} <= widths
        assert len(r["width_why"]) == len(r["width_choices"]) and r["width_why"][0].startswith("forward ")
    assert [f.name for f in cost_cache.iterdir()] == [Path(costs["file"]).name]
    again = port_run(target, prompts[:1], mode, llm, drafter=drafter, block_size="auto", ignore_eos=True)[0]
    assert again["step_costs"]["source"] == "cached" and again["step_costs"]["seconds"] == costs["seconds"]
    print(f"\n{mode} auto ({dtype}): {sum(r['forwards'] for r in res)} forwards for {sum(r['n_tokens'] for r in res)} "
          f"tokens; step costs {costs['seconds']} measured in {costs['measure_seconds']:.2f} s")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["diffusion", "speculative", "dflash"])
@pytest.mark.parametrize("ignore_eos", [True, False])
def test_port_auto_matches_clover(port, bundled_f32, drafter_f32, llm, monkeypatch, mode, ignore_eos):
    """With the same cost table (forced: --step-costs, and clover's calibration replaced by it) the port
    decides as clover's engine, forward for forward: the same decisions and reasons (width_why), tokens,
    forwards and accept lengths (speculative: clover's adaptive draft; dflash: clover's widths with the AR
    step among them, as the port's; diffusion: its block steps too)."""
    from clover.decoding import dflash, speculative, width
    from clover.decoding.width import STEP_KIND

    monkeypatch.setattr(dflash, "AUTO_BLOCKS", (1, *dflash.AUTO_BLOCKS))
    costs = {"speculative": SPEC_COSTS, "dflash": DFLASH_COSTS, "diffusion": DIFFUSION_COSTS}[mode]
    monkeypatch.setattr(speculative, "step_curve", lambda *a, **k: forced_curve(costs, STEP_KIND))
    monkeypatch.setattr(dflash, "iteration_curve", lambda *a, **k: forced_curve(costs, "verify"))
    monkeypatch.setattr(width, "curve_for", lambda *a, **k: forced_curve(costs, "diffusion"))
    prompts = task_prompts(llm, 8)
    res = port_run(bundled_f32, prompts, mode, llm, drafter=drafter_f32 if mode == "dflash" else None,
                   extra=step_costs_arg(costs), block_size="auto", ignore_eos=ignore_eos)
    switched = 0
    for ids, r in zip(prompts, res):
        ours = llm.generate(ids, mode=mode, max_new_tokens=TOKENS, temperature=0.0, block_size="auto", ignore_eos=ignore_eos)
        assert r["width_why"] == ours.stats.width_why
        assert (r["tokens"], r["forwards"], r["accept_lengths"], r["finish"]) == \
            (ours.token_ids, ours.stats.forwards, ours.stats.accept_lengths, ours.finish_reason)
        if mode == "diffusion":
            assert r["block_steps"] == ours.stats.block_steps
        assert r["step_costs"]["source"] == "given"
        switched += len(r["width_choices"]) > 1
    assert switched  # the table makes the choice move with the acceptance rate


@pytest.mark.slow
@pytest.mark.parametrize("mode, width", [("speculative", 8), ("dflash", 4), ("dflash", 1), ("diffusion", 16), ("diffusion", 1)])
def test_port_auto_one_width_equals_that_width(port, bundled_f32, drafter_f32, llm, mode, width):
    """A cost table under which one width always wins: auto decodes at that width every forward and
    gives the fixed draft's tokens (dflash: its drafts, forwards and accept lengths too; diffusion: the
    fixed block's tokens, forwards and block steps; width 1: AR's tokens and forwards, no drafter
    forward; speculative drafts adaptively, so only the tokens are the fixed draft's, both AR's)."""
    table = {"speculative": SPEC_COSTS, "dflash": DFLASH_COSTS, "diffusion": DIFFUSION_COSTS}[mode]
    costs = {w: ((0.001, 0.001) if w == width else (1.0, 1.0)) if isinstance(c, tuple) else (0.001 if w == width else 1.0)
             for w, c in table.items()}
    drafter = drafter_f32 if mode == "dflash" else None
    prompts = task_prompts(llm, PROMPTS)
    auto = port_run(bundled_f32, prompts, mode, llm, drafter=drafter, extra=step_costs_arg(costs), block_size="auto",
                    ignore_eos=True)
    if width == 1:
        fixed = port_run(bundled_f32, prompts, "ar", llm, ignore_eos=True)
        assert all(a["draft_forwards"] == 0 and a["forwards"] == f["forwards"] for a, f in zip(auto, fixed))
    elif mode == "diffusion":
        fixed = port_run(bundled_f32, prompts, mode, llm, block_size=width, ignore_eos=True)
        assert all((a["forwards"], a["block_steps"]) == (f["forwards"], f["block_steps"]) for a, f in zip(auto, fixed))
    else:
        fixed = port_run(bundled_f32, prompts, mode, llm, drafter=drafter, ignore_eos=True,
                         **(dict(draft_length=width - 1) if mode == "dflash" else dict(block_size=width)))
    for a, f in zip(auto, fixed):
        assert [c["width"] for c in a["width_choices"]] == [width]
        assert a["tokens"] == f["tokens"]
        if mode == "dflash" and width > 1:
            assert (a["drafts"], a["forwards"], a["accept_lengths"]) == (f["drafts"], f["forwards"], f["accept_lengths"])


@pytest.mark.slow
def test_port_auto_refuses_bad_input(port, bundled_f32, drafter_f32):
    """block_size "auto" with a draft length, or a bad cost table: one line naming it."""
    base = [str(port), str(bundled_f32), "-n", "4"]
    for args, want in (
        (["--mode", "speculative", "--block", "auto", "--draft", "3"], "draft_length: block_size \"auto\" chooses"),
        (["--mode", "diffusion", "--block", "auto", "--step-costs", "1:0.001,8:0.002,16:0.003/0.004,32:1/1,64:1/1"],
         "--step-costs: width 8 needs DENOISE/BLOCK seconds"),
        (["--mode", "speculative", "--block", "auto", "--step-costs", "1:0.001,8:0.002/0.003,16:1,32:1,64:1"],
         "--step-costs: width 8 takes one cost"),
        (["--mode", "speculative", "--block", "autox"], "--block: a number or auto expected, got 'autox'"),
        (["--mode", "speculative", "--block", "auto", "--step-costs", "8:abc"], "--step-costs: WIDTH:SECONDS"),
        (["--mode", "speculative", "--block", "auto", "--step-costs", "1:0.001,8:-1"], "--step-costs: WIDTH:SECONDS"),
        (["--mode", "speculative", "--block", "auto", "--step-costs", "8:0.002"], "--step-costs: no cost for width 1 "),
        (["--mode", "dflash", "--drafter", str(drafter_f32), "--block", "auto", "--step-costs", "1:1,2:1,4:1,8:1"],
         "--step-costs: no cost for width 16 "),
    ):
        err = port_error(base + args)
        assert err.startswith("llama-clover: error: " + want) and err.count("\n") == 1, err
