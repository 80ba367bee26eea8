"""Checks that need a CUDA GPU; skipped without one. `bash scripts/gpu-check.sh` runs them (and a
short benchmark) on a lent GPU machine in one go.

Each pins the CUDA path to the CPU path it must agree with: the GDN kernels (the `fla` Triton
kernels when installed, else the torch path on CUDA) against the naive reference, the model's
logits and greedy decoding against the same weights on the CPU, and training steps on CUDA whose
checkpoint resumes on the CPU.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch.testing import assert_close

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (bash scripts/gpu-check.sh)")

PROMPTS = ["assert sorted([31, 7, 19]) == ", "assert max([3, 11, 4]) == ", "def add(a, b):\n"]


def _gdn_inputs(B=2, T=100, H=4, K=32, V=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, K, generator=g)
    k = torch.randn(B, T, H, K, generator=g)
    v = torch.randn(B, T, H, V, generator=g)
    gate = -torch.rand(B, T, H, generator=g) * 0.5
    beta = torch.rand(B, T, H, generator=g)
    s0 = torch.randn(B, H, K, V, generator=g) * 0.1
    return (q, k, v, gate, beta), s0


@pytest.mark.parametrize("name", ["chunk_gated_delta_rule", "recurrent_gated_delta_rule"])
def test_gdn_kernels_on_cuda_match_reference(name):
    import clover.kernels as K

    (q, k, v, g, beta), s0 = _gdn_inputs()
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ref, s_ref = K.naive_gated_delta_rule(q.double(), k.double(), v.double(), g.double(), beta.double(),
                                            initial_state=s0.double(), output_final_state=True,
                                            use_qk_l2norm_in_kernel=True)
    dev = [t.cuda() for t in (q, k, v, g, beta)]
    o, s = getattr(K, name)(*dev, **{**kw, "initial_state": s0.cuda()})
    # fla computes in tf32/bf16 tiles: a few 1e-3 of the outputs' scale is expected
    assert_close(o.cpu().double(), o_ref.double(), atol=2e-2, rtol=2e-2)
    assert_close(s.cpu().double(), s_ref.double(), atol=2e-2, rtol=2e-2)


def test_model_logits_on_cuda_match_cpu():
    from clover.api import BUNDLED_MODEL
    from clover.checkpoint import load_model

    cpu = load_model(BUNDLED_MODEL, dtype=torch.float32)
    gpu = load_model(BUNDLED_MODEL, dtype=torch.float32, device="cuda")
    ids = torch.randint(3, cpu.config.vocab_size, (2, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = cpu(ids)
        got = gpu(ids.cuda()).cpu()
    assert_close(got, ref, atol=5e-2, rtol=5e-2)
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.99


@pytest.mark.parametrize("mode", ["ar", "diffusion", "speculative"])
def test_greedy_decoding_on_cuda_matches_cpu(mode):
    import clover

    cpu = clover.load(dtype="float32")
    gpu = clover.load(dtype="float32", device="cuda")
    for p in PROMPTS:
        a = cpu.generate(p, mode=mode, max_new_tokens=24)
        b = gpu.generate(p, mode=mode, max_new_tokens=24)
        assert b.token_ids == a.token_ids, (mode, p, a.text, b.text)
    batch = gpu.generate(PROMPTS, mode=mode, max_new_tokens=24)  # batched on CUDA == one by one on CUDA
    assert [g.token_ids for g in batch] == [gpu.generate(p, mode=mode, max_new_tokens=24).token_ids for p in PROMPTS]


@pytest.mark.parametrize("stage", ["ar", "diffusion"])
def test_training_on_cuda_resumes_on_cpu(tmp_path, stage):
    from test_train import micro_raw

    from clover.tokenizer import write_byte_tokenizer
    from clover.train.recipes import recipe_from_dict
    from clover.train.trainer import Trainer

    tok = tmp_path / "tok"
    write_byte_tokenizer(tok)
    raw = micro_raw(tok, tmp_path / "cache", tmp_path / "run", stage=stage, steps=3, autocast="bf16", device="cuda")
    t = Trainer(recipe_from_dict(raw), resume=False, quiet=True)
    assert next(t.model.parameters()).device.type == "cuda"
    hist = t.train()
    assert len(hist) == 3 and all(torch.isfinite(torch.tensor(h["loss"])) for h in hist)
    state = json.loads((tmp_path / "run" / "ckpt" / "step-00000003" / "trainer.json").read_text())
    assert state["step"] == 3
    raw["optim"]["steps"] = 4
    raw["run"]["device"] = "cpu"
    t2 = Trainer(recipe_from_dict(raw), quiet=True)  # the CUDA run's checkpoint continues on the CPU
    assert t2.step == 3 and len(t2.train()) == 1
