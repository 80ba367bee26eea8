"""`clover.load(compile=True)` / `--compile`: the compiled whole-step graphs give the same tokens as
eager in every decoding mode (tiny model). Compiling takes minutes on a CPU, so that token test is
marked slow; the wiring, and the compiled function (`forward_step(static=True)`) run eagerly
(torch.compile replaced by the identity), are checked without compiling."""

from __future__ import annotations

import pytest
import torch

import clover
from clover.decoding import mode_names
from clover.models.compile import compile_model, is_compiled
from clover.models.static import CAPACITY_QUANTUM, batch_buckets, load_shapes


def fixed_draft(mode: str, config) -> dict:
    """Speculative's fixed draft of the model's block size (its default is the adaptive draft, which
    takes AR's step where drafting does not pay): the options that exercise the verify graphs."""
    return {"block_size": config.block_size} if mode == "speculative" else {}


def _identity_compile(monkeypatch, seen=None):
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: (seen.append(kw) if seen is not None else None) or fn)


def test_compile_wiring(tiny_dir, monkeypatch):
    """compile=True reaches compile_model; the state dict keys are unchanged; nothing compiles by default."""
    seen = []
    _identity_compile(monkeypatch, seen)
    llm = clover.load(tiny_dir)
    assert not is_compiled(llm.model) and llm.model.static_steps is None
    keys = set(llm.model.state_dict())
    llm = clover.load(tiny_dir, compile=True)  # True means the static steps
    assert is_compiled(llm.model) and seen == [dict(fullgraph=True, dynamic=False, backend="inductor",
                                                                   options={"cpp_wrapper": True})]
    assert set(llm.model.state_dict()) == keys
    for gone in ("fast", "layers"):
        with pytest.raises(ValueError, match="compile mode"):
            clover.load(tiny_dir, compile=gone)


def test_compiled_function_is_the_eager_forward(tiny_dir, monkeypatch):
    """What is compiled is the model's own `forward_step` (one layer loop), with `static=True`."""
    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(fn) or fn)
    llm = clover.load(tiny_dir, compile=True)
    (fn,) = seen
    assert fn.func == llm.model.forward_step and fn.keywords == {"static": True}


def test_static_steps_run_eagerly_equal_eager_step(tiny_dir, monkeypatch):
    """The static graphs' code (no compile) gives the eager step's tokens in every mode, in a batch
    of rows at different lengths, and serves each forward kind it claims."""
    torch.set_num_threads(1)
    _identity_compile(monkeypatch)
    eager = clover.load(tiny_dir)
    static = clover.load(tiny_dir, compile="static")
    prompts = ["def f(x):", "ab", "a longer prompt of a few words"]
    for mode in filter(eager.mode_available, mode_names()):  # dflash: no drafter here (tests/test_dflash.py)
        kw = dict(mode=mode, max_new_tokens=12, ignore_eos=True) | fixed_draft(mode, eager.config)
        if mode != "ar":
            kw["block_size"] = 4
        for a, b in zip(eager.generate(prompts, **kw), static.generate(prompts, **kw)):
            assert a.token_ids == b.token_ids, mode
            assert a.finish_reason == b.finish_reason
    calls = static.model.static_steps.calls
    assert calls["ar"] and calls["denoise"] and calls["commit+denoise"] and calls["verify"], calls


def test_static_cache_capacity_is_rounded(tiny_dir, monkeypatch):
    _identity_compile(monkeypatch)
    llm = clover.load(tiny_dir, compile=True)
    assert llm.model.make_cache(2, 37).capacity == CAPACITY_QUANTUM
    assert llm.model.make_cache(1, CAPACITY_QUANTUM + 1).capacity == 2 * CAPACITY_QUANTUM
    assert llm.model.make_cache(1, 3 * CAPACITY_QUANTUM + 1).capacity == 4 * CAPACITY_QUANTUM  # powers of two
    assert clover.load(tiny_dir).model.make_cache(2, 37).capacity == 37


def test_warm_compiles_one_shape_ahead(tiny_dir, monkeypatch):
    """`StaticSteps.warm(kind, batch, width, capacity)` runs the graph of that shape on a scratch
    cache (here eagerly), counts no request, and refuses unknown kinds."""
    _identity_compile(monkeypatch)
    llm = clover.load(tiny_dir, compile=True)
    steps = llm.model.static_steps
    for kind in ("ar", "denoise", "commit+denoise", "verify"):
        steps.warm(kind, 2, 4, CAPACITY_QUANTUM)
    steps.warm("commit+denoise", 1, 4, CAPACITY_QUANTUM, ragged=True)
    assert not +steps.calls
    with pytest.raises(ValueError, match="kind"):
        steps.warm("prefill", 1, 4, CAPACITY_QUANTUM)


def test_load_compiles_a_bounded_set_then_freezes(tiny_dir, monkeypatch):
    """`clover.load(compile=True)` warms `load_shapes` (batch sizes in powers of two, the model's
    block size) and freezes; a batch between two compiled sizes runs on the larger graph with
    dummy rows, giving eager's tokens in every mode."""
    _identity_compile(monkeypatch)
    warmed = []
    from clover.models.static import StaticSteps

    real_warm = StaticSteps.warm
    monkeypatch.setattr(StaticSteps, "warm", lambda self, *a, **k: warmed.append(a) or real_warm(self, *a, **k))
    llm = clover.load(tiny_dir, compile=True, compile_batch=5)
    steps = llm.model.static_steps
    assert steps.frozen and steps.batches == batch_buckets(5) == (1, 2, 4, 5)  # a full batch has its own graph
    assert batch_buckets(1) == (1,) and batch_buckets(8) == (1, 2, 4, 8)
    w = llm.config.block_size
    assert len(warmed) == len(load_shapes(llm.config, batches=(1, 2, 4, 5))) and ("denoise", 4, w, 512) in warmed
    assert {a[0] for a in warmed} == {"ar", "denoise", "commit+denoise", "verify"} and not +steps.calls
    eager = clover.load(tiny_dir)
    prompts = ["def f(x):", "ab", "a longer prompt of a few words"]  # 3 rows: the graphs of 4
    for mode in filter(eager.mode_available, mode_names()):
        kw = dict(mode=mode, max_new_tokens=w + 6, ignore_eos=True) | fixed_draft(mode, eager.config)  # a second block: a commit+denoise step
        for a, b in zip(eager.generate(prompts, **kw), llm.generate(prompts, **kw)):
            assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason, mode
    assert steps.calls["padded"] and steps.calls["commit+denoise"] and steps.calls["verify"], steps.calls


def test_padded_batch_runs_in_place(tiny_dir, monkeypatch):
    """A batch between two compiled sizes runs on the larger graph over the cache's own memory (the
    cache keeps spare rows, the dummies), not on padded copies of it; the spare rows survive the
    cache growing and a rollback; logits equal the eager step's."""
    from clover.cache import row_room

    _identity_compile(monkeypatch)
    llm = clover.load(tiny_dir, compile=True, compile_batch=4)  # graphs of 1, 2 and 4 rows
    eager = clover.load(tiny_dir)
    steps = llm.model.static_steps
    seen = []
    real = steps._forward
    steps._forward = lambda c, n, d, lengths, states, **kw: (
        seen.append((lengths.shape[0], [t.data_ptr() for s in states for t in s])) or real(c, n, d, lengths, states, **kw))
    torch.manual_seed(0)
    prompt = torch.randint(3, llm.config.vocab_size, (3, 5))
    caches = []
    with torch.inference_mode():
        for m in (llm.model, eager.model):
            cache = m.make_cache(3, 40)
            m.step(cache, commit_ids=prompt)  # a prompt: eager in both
            caches.append(cache)
        assert not seen and all(row_room(t) == 4 for s in caches[0].layers for t in s.tensors())
        ids = torch.randint(3, llm.config.vocab_size, (3, 1))
        a, b = (m.step(c, commit_ids=ids) for m, c in zip((llm.model, eager.model), caches))
        assert seen == [(4, [t.data_ptr() for s in caches[0].layers for t in s.tensors()])]  # the cache itself
        torch.testing.assert_close(a.commit_logits, b.commit_logits)
        caches[0].ensure_capacity(2 * CAPACITY_QUANTUM)
        snap = caches[0].start_recording()
        llm.model.step(caches[0], commit_ids=torch.randint(3, llm.config.vocab_size, (3, 4)))
        caches[0].rollback(snap, torch.tensor([1, 0, 2]))
        assert all(row_room(t) == 4 for s in caches[0].layers for t in s.tensors())
    assert steps.calls["padded"] == 2, steps.calls  # the AR step and the recorded commit


@pytest.mark.parametrize("auto", [False, True])
def test_every_frozen_step_has_a_compiled_shape(tiny_dir, monkeypatch, alternating_policy, auto):
    """Once frozen, every step a generation hands the compiled forward (AR, diffusion, speculative,
    at batch 1 and padded from 3 to 4) is one of the shapes compiled at load: no step would fall
    back to eager, e.g. speculative's one-token draft after a rejection runs on the ragged verify
    graph, padded to the block. `auto`: speculative's adaptive draft switching between the AR step
    and the block every forward (leftover drafts, the verify before an AR step), eager's tokens."""
    from clover.decoding import width as W

    _identity_compile(monkeypatch)
    llm = clover.load(tiny_dir, compile=True, compile_batch=4)
    if auto:
        policy = alternating_policy((W.AR_WIDTH, llm.config.block_size), W.CostCurve())
        monkeypatch.setattr(W.DraftPolicy, "for_model", classmethod(lambda cls, model, curve=None: policy))
    steps = llm.model.static_steps
    compiled = set()
    for kind, b, w, cap, ragged, _ in load_shapes(llm.config, batches=batch_buckets(4)):
        Tc, Bd = {"ar": (1, 0), "denoise": (0, w)}.get(kind, (w, w))
        compiled.add((b, Tc, Bd, cap, ragged, kind == "verify"))
    seen = set()
    real = steps._forward
    attention = llm.config.layer_types.index("full_attention")

    def spy(c, n, d, lengths, states, **kw):
        cap = states[attention][0].shape[2]  # K [B, H_kv, capacity, D]
        seen.add((lengths.shape[0], 0 if c is None else c.shape[1], 0 if d is None else d.shape[1], cap,
                  n is not None, kw["record"]))
        return real(c, n, d, lengths, states, **kw)

    steps._forward = spy
    eager = clover.load(tiny_dir)
    for prompts in (["def f(x):"], ["def f(x):", "ab", "a longer prompt of a few words"]):
        for mode in ("speculative",) if auto else ("ar", "diffusion", "speculative"):
            kw = dict(mode=mode, max_new_tokens=40, ignore_eos=True) | ({"block_size": "auto"} if auto else fixed_draft(mode, eager.config))
            out = llm.generate(prompts, **kw)
            if auto:
                assert [g.token_ids for g in out] == [g.token_ids for g in eager.generate(prompts, **kw)]
                assert any("width 1 " in line for g in out for line in g.stats.width_why)
    assert seen and seen <= compiled, seen - compiled
    assert any(c[1] == c[2] and c[4] and c[5] and c[0] == 1 for c in seen)  # a ragged verify at batch 1


def test_serve_compiles_its_batch_sizes_at_load(tiny_dir, monkeypatch):
    """`clover serve --compile --max-batch N` compiles the powers of two below N and N itself at load (a full batch has its own graph)."""
    import argparse

    from clover.cli.common import load_llm

    _identity_compile(monkeypatch)
    llm = load_llm(argparse.Namespace(model=str(tiny_dir), compile="static", max_batch=6))
    assert llm.model.static_steps.frozen and llm.model.static_steps.batches == (1, 2, 4, 6)
    assert load_llm(argparse.Namespace(model=str(tiny_dir), compile="static")).model.static_steps.batches == (1,)


@pytest.mark.slow
def test_frozen_steps_never_compile_a_new_shape(tiny_dir):
    """After `warm_all` a shape without a graph runs eagerly (dynamo's "fail_on_recompile" stance)
    instead of compiling: same tokens, counted as eager."""
    torch.set_num_threads(1)
    eager = clover.load(tiny_dir)
    llm = clover.load(tiny_dir)
    compile_model(llm.model, backend="eager")  # dynamo's tracing without inductor: seconds
    steps = llm.model.static_steps
    steps.warm_all([("ar", 1, 1, CAPACITY_QUANTUM, False)])
    kw = dict(max_new_tokens=10, ignore_eos=True)
    assert llm.generate("def f(x):", mode="ar", **kw).token_ids == eager.generate("def f(x):", mode="ar", **kw).token_ids
    assert steps.calls["ar"] and not steps.calls["eager"]
    kw["block_size"] = 4
    got = llm.generate("def f(x):", mode="diffusion", **kw)  # denoise / commit+denoise: no graph
    assert got.token_ids == eager.generate("def f(x):", mode="diffusion", **kw).token_ids
    assert steps.calls["eager"] and not steps.calls["denoise"] and not steps.calls["commit+denoise"]


@pytest.mark.slow
def test_compiled_tokens_equal_eager(tiny_dir):
    torch.set_num_threads(1)
    eager = clover.load(tiny_dir)
    compiled = clover.load(tiny_dir)
    compile_model(compiled.model)
    for mode in filter(eager.mode_available, mode_names()):  # dflash: no drafter here
        kw = dict(mode=mode, max_new_tokens=12, ignore_eos=True) | fixed_draft(mode, eager.config)
        if mode != "ar":
            kw["block_size"] = 4
        a = eager.generate("def f(x):", **kw)
        b = compiled.generate("def f(x):", **kw)
        assert a.token_ids == b.token_ids, mode


def test_static_refuses_quantized_experts(tiny_dir, tmp_path, monkeypatch):
    from clover.quant import quantize_checkpoint

    _identity_compile(monkeypatch)
    q = tmp_path / "int8"
    quantize_checkpoint(tiny_dir, q, bits=8, progress=False)
    with pytest.raises(ValueError, match="quantized experts.*without compiling"):
        clover.load(q, compile=True)


def test_static_falls_back_to_eager_past_the_graph_limit(tiny_dir, monkeypatch):
    """More shapes than the recompile limit: the call runs eagerly (same tokens), with one warning."""
    import torch._dynamo.exc as dexc

    _identity_compile(monkeypatch)
    eager = clover.load(tiny_dir)
    static = clover.load(tiny_dir, compile=True)
    steps = static.model.static_steps

    def refuse(*a, **k):
        raise dexc.FailOnRecompileLimitHit("limit")

    steps._forward = refuse
    kw = dict(mode="diffusion", max_new_tokens=8, ignore_eos=True, block_size=4)
    with pytest.warns(RuntimeWarning, match="graphs reached"):
        out = static.generate("def f(x):", **kw)
    assert out.token_ids == eager.generate("def f(x):", **kw).token_ids
    assert steps.limit_hit and steps.calls["eager"] >= 2 and steps.calls["denoise"] == 0


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny Llama target (clover-smol's family) with a denoise adapter moved off zero, and a DFlash
    drafter for it (`drafter/`)."""
    from clover.checkpoint import load_model, save_drafter, save_model
    from clover.models.dflash import build_drafter, drafter_config_for
    from clover.tiny import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("llama-compile")
    m = load_model(build_tiny_checkpoint(root / "base", seed=4, init_std=0.15, dense=True, backbone="llama",
                                         rms_norm_eps=1e-5))
    m.attach_denoise_adapter(rank=4)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("lora_B") or n.endswith("mask_embedding"):
                p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    save_model(m, root / "m")
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (root / "base" / f).exists():
            (root / "m" / f).write_bytes((root / "base" / f).read_bytes())
    cfg = drafter_config_for(m.config, num_hidden_layers=2, block_size=8)
    save_drafter(build_drafter(cfg, seed=1), root / "m" / "drafter")
    return root / "m"


def _llama_modes(eager, compiled, prompts, max_new_tokens):
    """Each mode's tokens, eager against compiled, alone (dflash: also batched, and AR's tokens)."""
    for mode in ("ar", "dflash", "speculative", "diffusion"):
        kw = dict(mode=mode, max_new_tokens=max_new_tokens, ignore_eos=True) | fixed_draft(mode, eager.config)
        for p in prompts:
            assert compiled.generate(p, **kw).token_ids == eager.generate(p, **kw).token_ids, mode
    kw = dict(max_new_tokens=max_new_tokens, ignore_eos=True)
    ar = [r.token_ids for r in eager.generate(prompts, mode="ar", **kw)]
    assert [r.token_ids for r in compiled.generate(prompts, mode="dflash", **kw)] == ar


def test_static_steps_on_a_llama_with_an_adapter_and_a_drafter(llama_dir, monkeypatch):
    """A Llama target (its own rotary frequencies, the denoise adapter applied from the block on) and
    its DFlash drafter: the static graphs' code (no compile) gives the eager tokens in every mode,
    dflash AR's, alone and batched, and the verifies run on the verify-commit kind."""
    torch.set_num_threads(1)
    _identity_compile(monkeypatch)
    eager = clover.load(llama_dir, drafter=llama_dir / "drafter")
    static = clover.load(llama_dir, drafter=llama_dir / "drafter", compile=True)
    _llama_modes(eager, static, [[5, 6, 7], list(range(40, 61))], 16)
    calls = static.model.static_steps.calls
    assert calls["ar"] and calls["verify-commit"] and calls["denoise"] and calls["verify"], calls


@pytest.mark.slow
def test_compiled_llama_with_a_drafter_equals_eager(llama_dir):
    """The same, compiled (inductor): the graphs compiled at load serve the verifies and the drafts."""
    torch.set_num_threads(1)
    eager = clover.load(llama_dir, drafter=llama_dir / "drafter")
    compiled = clover.load(llama_dir, drafter=llama_dir / "drafter", compile=True)
    _llama_modes(eager, compiled, [[5, 6, 7], list(range(40, 61))], 16)
    calls = compiled.model.static_steps.calls
    assert calls["verify-commit"] and calls["ar"] and compiled.drafter.static_calls["static"], calls


def test_freezing_where_eager_would_pack(tiny_dir, llama_dir, monkeypatch):
    """Inductor's freezing is an option of these graphs alone (`torch.compile`'s options, not the
    global config), chosen where eager clover packs its linear layers for oneDNN (a float32 model large
    enough, `default_packing` True): the target's graphs and the drafter's then freeze, else neither."""
    import clover.kernels.packed as packed
    from clover.models import compile as compile_mod

    seen = []
    _identity_compile(monkeypatch, seen)
    llm = clover.load(tiny_dir)
    assert not compile_mod.default_freezing(llm.model)  # a tiny model is not packed
    compile_model(llm.model, freezing=True)
    assert llm.model.static_steps.freezing and seen[-1]["options"] == {"cpp_wrapper": True, "freezing": True}
    monkeypatch.setattr(packed, "default_packing", lambda model: True)
    assert compile_mod.default_freezing(llm.model)
    seen.clear()
    clover.load(llama_dir, drafter=llama_dir / "drafter", compile=True)
    assert len(seen) == 2 and all(kw["options"].get("freezing") for kw in seen), seen
    assert not torch._inductor.config.freezing


@pytest.mark.slow
def test_frozen_compiled_llama_with_a_drafter_equals_eager(llama_dir, monkeypatch):
    """Compiled with inductor's freezing (the weights constants of the graphs, packed for oneDNN):
    the eager tokens in AR and dflash, alone and batched (a batch of two runs eagerly: graphs of batch 1
    only), with the graphs compiled at load serving the verifies and the drafts."""
    import clover.kernels.packed as packed

    torch.set_num_threads(1)
    eager = clover.load(llama_dir, drafter=llama_dir / "drafter")
    monkeypatch.setattr(packed, "default_packing", lambda model: True)
    compiled = clover.load(llama_dir, drafter=llama_dir / "drafter", compile=True, pack=False)
    assert compiled.model.static_steps.freezing
    prompts, kw = [[5, 6, 7], list(range(40, 61))], dict(max_new_tokens=16, ignore_eos=True)
    for mode in ("ar", "dflash"):
        for p in prompts:
            assert compiled.generate(p, mode=mode, **kw).token_ids == eager.generate(p, mode=mode, **kw).token_ids, mode
    ar = [r.token_ids for r in eager.generate(prompts, mode="ar", **kw)]
    assert [r.token_ids for r in compiled.generate(prompts, mode="dflash", **kw)] == ar
    calls = compiled.model.static_steps.calls
    assert calls["verify-commit"] and calls["ar"] and compiled.drafter.static_calls["static"], calls
