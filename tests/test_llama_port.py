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
- speculative: the same tokens as AR greedy, and the same forwards as clover's speculative engine.
"""

from __future__ import annotations

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
    assert "--ignore-eos" not in a
    a = port_args("ar", SamplingParams(max_new_tokens=8, stop=["\n", "))"]).validate())
    assert [a[i + 1] for i, x in enumerate(a) if x == "--stop"] == ["\n", "))"]
    s = port_args("speculative", SamplingParams(max_new_tokens=8, block_size=32, draft_length=8, ignore_eos=True).validate())
    assert s[s.index("--draft") + 1] == "8" and "--ignore-eos" in s and "--policy" not in s


@pytest.mark.parametrize("bad, name", [
    (dict(temperature=0.7), "temperature"), (dict(repetition_penalty=1.2), "repetition_penalty"),
    (dict(policy="hierarchy"), "policy"), (dict(confidence="margin"), "confidence"), (dict(expert_budget=4), "expert_budget"),
])
def test_port_args_refuses_what_the_port_lacks(bad, name):
    kw = dict(max_new_tokens=8, block_size=32, threshold=0.95, policy="threshold") | bad
    with pytest.raises(ValueError, match=name):
        port_args("diffusion", SamplingParams(**kw).validate())
    with pytest.raises(ValueError, match="mode"):
        port_args("naive", SamplingParams(max_new_tokens=8).validate())


# ------------------------------------------------------------------------------ slow: the port itself
PORT = port_binary()
PROBE = llama_cache_dir() / "bin" / "clover-llama-probe"


@pytest.fixture(scope="module")
def port():
    if not PORT.exists():
        pytest.skip(f"llama.cpp port absent ({PORT} not found): run PORT=1 scripts/build-llama-cpp.sh")
    return PORT


@pytest.fixture(scope="module")
def gguf_f32(tmp_path_factory) -> Path:
    from clover.export.gguf import export_gguf

    out = tmp_path_factory.mktemp("port") / "clover-tiny-f32.gguf"
    export_gguf(BUNDLED, out, dtype="f32", progress=False)
    return out


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


def port_run(gguf, prompts, mode, llm, **kw):
    from clover.integrations.llama_port import run

    params = llm.params(mode, dict(max_new_tokens=TOKENS, temperature=0.0) | kw)
    return run(gguf, prompts, port_args(mode, params), eos_ids=llm.config.eos_token_ids, timeout=900)


@pytest.mark.slow
def test_port_forward_matches_clover(port, gguf_f32, llm, tmp_path):
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
    theirs = forward_logits(gguf_f32, prompt, block, tmp_path / "logits.f32", binary=port)
    assert theirs.shape == ours.shape
    diff = np.abs(ours - theirs)
    scale = np.abs(ours).max(axis=1, keepdims=True)
    Tc = len(prompt)
    print(f"\nforward: commit max |diff| {diff[:Tc].max():.2e}, denoise max |diff| {diff[Tc:].max():.2e}, "
          f"logit scale {scale.max():.1f}")
    assert (diff <= LOGIT_ATOL + LOGIT_RTOL * scale).all()
    assert (ours.argmax(1) == theirs.argmax(1)).all()


@pytest.mark.slow
def test_port_ar_matches_stock_llama_cpp_and_clover(port, gguf_f32, llm):
    if not PROBE.exists():
        pytest.skip(f"stock llama.cpp build absent ({PROBE} not found): run scripts/build-llama-cpp.sh")
    prompts = mixed_prompts(llm, PROMPTS)
    res = port_run(gguf_f32, prompts, "ar", llm, ignore_eos=True)
    eos = llm.config.eos_token_ids
    for ids, r in zip(prompts, res):
        stock = subprocess.run([str(PROBE), str(gguf_f32), "greedy", str(TOKENS), *map(str, eos)],
                               input=" ".join(map(str, ids)).encode(), capture_output=True, timeout=600,
                               env={**os.environ, "CLOVER_PROBE_THREADS": "1"})
        assert stock.returncode == 0, stock.stderr.decode()[-2000:]
        assert r["tokens"] == [int(x) for x in stock.stdout.split()]
        ours = llm.generate(ids, mode="ar", max_new_tokens=TOKENS, ignore_eos=True, temperature=0.0)
        assert r["tokens"] == ours.token_ids
        assert r["forwards"] == ours.stats.forwards == TOKENS


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["threshold", "entropy", "factor"])
def test_port_diffusion_matches_clover(port, gguf_f32, llm, policy):
    """Block 32, threshold 0.95, greedy, EOS on: tokens and forwards, prompt by prompt."""
    prompts = task_prompts(llm, PROMPTS)
    kw = dict(block_size=32, threshold=0.95, policy=policy)
    res = port_run(gguf_f32, prompts, "diffusion", llm, **kw)
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
def test_port_speculative_equals_ar(port, gguf_f32, llm, ignore_eos):
    prompts = task_prompts(llm, PROMPTS)
    spec = port_run(gguf_f32, prompts, "speculative", llm, block_size=32, ignore_eos=ignore_eos)
    ar = port_run(gguf_f32, prompts, "ar", llm, ignore_eos=ignore_eos)
    for ids, s, a in zip(prompts, spec, ar):
        assert s["tokens"] == a["tokens"]
        ours = llm.generate(ids, mode="speculative", max_new_tokens=TOKENS, temperature=0.0, block_size=32,
                            ignore_eos=ignore_eos)
        assert s["tokens"] == ours.token_ids
        assert s["forwards"] == ours.stats.forwards


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["diffusion", "speculative"])
def test_generate_engine_llama_cpp(port, gguf_f32, mode, capsys):
    """`clover generate --engine llama.cpp --json` gives clover's own text, tokens and forwards."""
    import json

    from clover.cli import main

    prompt = "assert sorted([9, 2, 5]) == "
    common = [prompt, "--model", str(BUNDLED), "--dtype", "float32", "--mode", mode, "-n", "40", "--json"]
    assert main(["generate", *common]) == 0
    ours = json.loads(capsys.readouterr().out)
    assert main(["generate", *common, "--engine", "llama.cpp", "--gguf", str(gguf_f32)]) == 0
    theirs = json.loads(capsys.readouterr().out)
    assert theirs["engine"] == "llama.cpp"
    assert theirs["token_ids"] == ours["token_ids"] and theirs["text"] == ours["text"]
    assert theirs["stats"]["forwards"] == ours["stats"]["forwards"]


def port_stops_like_clover(gguf, llm, prompts, mode, kw) -> int:
    """The port against clover on `prompts`: tokens, forwards and finish reason equal prompt by
    prompt; returns how many ended on a stop."""
    from clover.integrations.llama_port import run

    res = run(gguf, prompts, port_args(mode, llm.params(mode, kw)), eos_ids=llm.config.eos_token_ids)
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
def test_port_stop_token_matches_clover(port, gguf_f32, llm, mode, kw):
    """A stop token (newline) caps the block, a length limit that is no multiple of the block:
    tokens, forwards and finish reason equal clover's, prompt by prompt."""
    kw = dict(max_new_tokens=40, temperature=0.0, stop_token_ids=llm.tokenizer.encode("\n")) | kw
    assert port_stops_like_clover(gguf_f32, llm, task_prompts(llm, PROMPTS), mode, kw) > 0  # the stop token fires


@pytest.mark.slow
@pytest.mark.parametrize("mode, kw", [
    ("diffusion", dict(block_size=32, threshold=0.95, policy="threshold")),
    ("speculative", dict(block_size=32)),
    ("ar", {}),
])
def test_port_stop_strings_match_clover(port, gguf_f32, llm, mode, kw):
    """Stop strings, decided in the port on the GGUF vocabulary's bytes: tokens (up to the one that
    completes the string), forwards and finish reason equal clover's prompt by prompt, and the
    driver's text is trimmed as clover's is."""
    from clover.integrations.llama_port import generate

    kw = dict(max_new_tokens=40, temperature=0.0, stop=[", ", "\n"]) | kw
    prompts = mixed_prompts(llm, PROMPTS)
    assert port_stops_like_clover(gguf_f32, llm, prompts, mode, kw) > 0
    text = llm.tokenizer.decode(prompts[0])
    theirs = generate(llm, text, mode, kw, gguf=gguf_f32)
    ours = llm.generate(text, mode=mode, **kw)
    assert (theirs["text"], theirs["finish_reason"]) == (ours.text, ours.finish_reason)
