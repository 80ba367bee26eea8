"""`clover bench slice` (quick shapes) and `clover bench matmul` (quick): schema, accounting
invariants, and the in-memory quantized model against the float one. No timing is asserted."""

from __future__ import annotations

import json

import torch

from clover import cli
from clover.bench.slice import build_slice_model, layer_bytes, quantize_model, slice_config


def test_slice_model_shapes_and_int4_close():
    config = slice_config(4, quick=True)
    assert config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    model = build_slice_model(config, seed=0)
    assert model.dtype == torch.bfloat16
    assert not any(p.is_meta for p in model.parameters())
    q = quantize_model(model, bits=4, group_size=32)
    assert type(q.model.layers[0].mlp.experts).__name__ == "QuantExperts"
    assert type(q.model.layers[0].linear_attn.in_proj_qkv).__name__ == "Int4Linear"
    # unquantized tensors are shared, not copied
    assert q.lm_head.weight.data_ptr() == model.lm_head.weight.data_ptr()
    lb, qb = layer_bytes(model), layer_bytes(q)
    for a, b in zip(lb, qb):
        assert 0 < b["expert"] < a["expert"] / 3 and b["dense"] < a["dense"]
    ids = torch.randint(0, config.vocab_size - 1, (1, 12))
    q8 = quantize_model(model, bits=8, group_size=None)
    with torch.inference_mode():
        ref, got4, got8 = model(ids).float(), q(ids).float(), q8(ids).float()
    # int8 tracks the bf16 logits closely; int4 of random weights (plus routing flips) only roughly
    assert ((got8 - ref).norm() / ref.norm()).item() < 0.1
    assert torch.nn.functional.cosine_similarity(got4.flatten(), ref.flatten(), dim=0).item() > 0.85


def test_bench_slice_quick_json(capsys):
    rc = cli.main(["bench", "slice", "--quick", "--repeat", "1", "--threads", "1", "--json", "-"])
    out, _ = capsys.readouterr()
    assert rc == 0
    r = json.loads(out)
    assert r["schema"] == "clover.bench.slice/1" and "extrapolation" in r["note"]
    E = r["config"]["num_experts"]
    k = r["config"]["num_experts_per_tok"]
    for name in ("bf16", "int4"):
        fw = r["models"][name]["forwards"]
        assert set(fw) == {"ar", "denoise", "denoise_shared", "verify", "verify_shared"}
        assert fw["ar"]["experts_touched_per_layer"] == k
        for f in fw.values():
            assert len(f["layers"]) == 4
            assert all(0 < row["experts_touched"] <= E and row["bytes"] > 0 and row["ms"] > 0 for row in f["layers"])
            assert f["extrapolated_40_layers"]["bytes"] > 0
        # sharing caps the denoise block's experts at the budget
        assert fw["denoise_shared"]["experts_touched_per_layer"] <= r["expert_budget"]
        assert fw["denoise"]["bytes_per_layer"] > fw["ar"]["bytes_per_layer"]
    assert r["models"]["int4"]["forwards"]["ar"]["bytes_per_layer"] < r["models"]["bf16"]["forwards"]["ar"]["bytes_per_layer"]


def test_bench_matmul_quick_json(capsys):
    rc = cli.main(["bench", "matmul", "--quick", "--repeat", "1", "--rows", "1,8", "--threads", "1", "--json", "-"])
    out, _ = capsys.readouterr()
    assert rc == 0
    r = json.loads(out)
    assert r["schema"] == "clover.bench.matmul/1"
    assert {x["M"] for x in r["results"]} == {1, 8}
    for x in r["results"]:
        assert set(x["ms"]) == set(r["paths"])
        # the low-bit kernels agree with the dequantize reference (bf16 activations)
        assert all(e < 2e-2 for e in x["rel_err_vs_reference"].values()), x["rel_err_vs_reference"]


def test_bench_matmul_fp32_paths_cold(capsys):
    """The opt-in fp32 paths (oneDNN on a packed weight, the row kernel up to 16 rows) through cycled
    weight copies: each agrees with the fp32 reference; the row kernel has no time above 16 rows."""
    from clover.kernels import packed, rows

    rc = cli.main(["bench", "matmul", "--quick", "--repeat", "1", "--rows", "2,17", "--cold", "3", "--threads", "1",
                   "--paths", "fp32,fp32-onednn,fp32-rows", "--json", "-"])
    out, _ = capsys.readouterr()
    assert rc == 0
    r = json.loads(out)
    assert r["cold"] == 3 and r["paths"] == ["fp32", "fp32-onednn", "fp32-rows"]
    for x in r["results"]:
        want = {"fp32"} | ({"fp32-onednn"} if packed.available() else set())
        want |= {"fp32-rows"} if x["M"] <= 16 and rows.library() is not None else set()
        assert set(x["ms"]) == want
        assert all(e < 1e-5 for e in x["rel_err_vs_reference"].values()), x["rel_err_vs_reference"]
    assert cli.main(["bench", "matmul", "--quick", "--paths", "fp32,fp64"]) != 0
    assert "--paths: fp64: not among" in capsys.readouterr().err


def test_int8_routing_by_rows(monkeypatch):
    """From `int8_cast_rows` rows on, bf16 activations take the cast + bf16 GEMM path (the int8
    kernel is not consulted); below it the kernel path; both match the dequantize reference."""
    from clover.quant import ops

    g = torch.Generator().manual_seed(0)
    n, k = 48, 64
    q, s = ops.quantize_int8(torch.randn(n, k, generator=g))
    rows = ops.int8_cast_rows(n, k)
    assert rows == ops.INT8_CAST_ROWS[0] and ops.int8_cast_rows(4096, 2048) == ops.INT8_CAST_ROWS[1]
    for m in (1, rows - 1, rows, 2 * rows):
        x = torch.randn(m, k, generator=g).bfloat16()
        ref = x.float() @ ops.dequantize_int8(q, s).t()
        got = ops.int8_matmul(x, q, s).float()
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
    called = []
    monkeypatch.setattr(ops, "_int8_fast_available", lambda *a: called.append(a) or False)
    ops.int8_matmul(torch.randn(rows, k).bfloat16(), q, s)
    assert not called
    ops.int8_matmul(torch.randn(rows - 1, k).bfloat16(), q, s)
    assert called
