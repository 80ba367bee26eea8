"""Weight-only INT8 / INT4 quantization: kernels vs the dequantize reference, the on-disk format,
loading through clover.load, generation, experts, and errors on corrupt files."""

import argparse
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

import clover
from clover.checkpoint import CheckpointError, load_model
from clover.moe import reference_expert_forward
from clover.quant import ops
from clover.quant.format import quantizable, quantize_tensor, tensor_specs
from clover.quant.modules import Int4Linear, Int8Linear, QuantExperts
from clover.quant.writer import quantize_checkpoint

LAYOUTS = [(8, None), (4, 32), (4, 64), (4, 128)]
LAYOUT_IDS = ["int8", "int4-g32", "int4-g64", "int4-g128"]


def _tight(a, b, scale=None):
    scale = scale if scale is not None else max(b.abs().max().item(), 1.0)
    torch.testing.assert_close(a, b, rtol=0, atol=2e-5 * scale)


def _bf16_close(a, ref):
    """The same math with bf16 activations: within bf16 rounding of the output (and of the scales)."""
    a = a.float()
    bound = 1e-2 * (ref.abs() + 1e-2 * ref.abs().max())
    assert bool(((a - ref).abs() <= bound).all()), ((a - ref).abs() / (ref.abs() + 1e-2 * ref.abs().max())).max()


@pytest.fixture
def exact_fp32(monkeypatch):
    """fp32 activations stay fp32 in the low-bit matmuls (by default they are rounded to bf16 on CPU)."""
    monkeypatch.setattr(ops, "FP32_VIA_BF16", False)


# ------------------------------------------------------------------------------------ kernels
@pytest.mark.parametrize("m", [1, 33])
@pytest.mark.parametrize("n,k", [(48, 64), (17, 63), (1, 5), (64, 256)])
def test_int8_matmul_matches_dequantize(m, n, k, monkeypatch):
    g = torch.Generator().manual_seed(n * 1000 + k)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    q, s = ops.quantize_int8(w)
    deq = ops.dequantize_int8(q, s)
    ref = torch.nn.functional.linear(x, deq)
    _tight(ops.int8_matmul(x, q, s, fast=False), ref)
    if k % 16 == 0:  # the CPU kernel: bf16 activations, and fp32 ones rounded to bf16 (the default)
        ref_b = torch.nn.functional.linear(x.bfloat16().float(), deq)
        _bf16_close(ops.int8_matmul(x.bfloat16(), q, s), ref_b)
        _bf16_close(ops.int8_matmul(x, q, s), ref_b)
    monkeypatch.setattr(ops, "FP32_VIA_BF16", False)
    _tight(ops.int8_matmul(x, q, s), ref)


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("m", [1, 33])
@pytest.mark.parametrize("n,k", [(48, 256), (32, 96), (17, 128), (16, 32)])
def test_int4_matmul_matches_dequantize(group, m, n, k, monkeypatch):
    g = torch.Generator().manual_seed(n * 1000 + k + group)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    packed, scales, zeros = ops.quantize_int4(w, group)
    kp = ops.padded_k(k, group)
    assert packed.shape == (n, kp // 2) and packed.dtype == torch.uint8
    assert scales.shape == zeros.shape == (n, kp // group) and scales.dtype == torch.bfloat16
    deq = ops.dequantize_int4(packed, scales, zeros, k)
    ref = torch.nn.functional.linear(x, deq)
    fast = ops.Int4Weights.pack(packed, scales, zeros, k, group, torch.float32)
    if hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        assert fast.kernel == ("cpu" if n % 16 == 0 else None)  # N % 16 != 0: the fallback
    slow = ops.Int4Weights.pack(packed, scales, zeros, k, group, torch.float32, kernel=False)
    _tight(slow.matmul(x), ref)
    if fast.kernel:
        ref_b = torch.nn.functional.linear(x.bfloat16().float(), deq)
        _bf16_close(fast.matmul(x.bfloat16()), ref_b)
        _bf16_close(fast.matmul(x), ref_b)  # fp32 activations rounded to bf16 (the default on CPU)
    monkeypatch.setattr(ops, "FP32_VIA_BF16", False)
    _tight(fast.matmul(x), ref)  # the kernel in fp32: exactly the dequantized weight


def _misaligned(t, offset_bytes=8):
    buf = torch.empty(t.numel() * t.element_size() + 64, dtype=torch.uint8)
    start = (-buf.data_ptr()) % 64 + offset_bytes
    v = buf[start : start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
    v.copy_(t)
    return v


def test_int8_kernel_misaligned_operands():
    """The CPU int8 kernel crashes on misaligned memory (tensors read from safetensors, slices):
    such operands are copied or take the fallback."""
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(128, 64, generator=g), torch.randn(74, 64, generator=g).bfloat16()
    q, s = ops.quantize_int8(w)
    qm, xm = _misaligned(q), _misaligned(x)
    assert qm.data_ptr() % 64 and xm.data_ptr() % 64
    ref = torch.nn.functional.linear(x.float(), ops.dequantize_int8(q, s))
    _bf16_close(ops.int8_matmul(xm, q, s), ref)
    torch.testing.assert_close(ops.int8_matmul(x, qm, s).float(), ref, rtol=0, atol=0.05 * ref.abs().max().item())


def test_int4_pack_and_error_bounds():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (5, 64), generator=g, dtype=torch.uint8)
    assert torch.equal(ops.unpack_int4(ops.pack_int4(codes)), codes)
    assert ops.pack_int4(torch.tensor([[1, 2]])).item() == 0x12  # even input in the high nibble
    w = torch.randn(16, 100, generator=g)
    packed, scales, zeros = ops.quantize_int4(w, 32)
    err = (ops.dequantize_int4(packed, scales, zeros, 100) - w).abs()
    step = scales.float().repeat_interleave(32, dim=1)[:, :100]
    assert bool((err <= 0.51 * step + 1e-3 * w.abs().max()).all())
    q8, s8 = ops.quantize_int8(w)
    assert bool(((ops.dequantize_int8(q8, s8) - w).abs() <= 0.501 * s8[:, None]).all())
    # constant and zero rows stay finite and exact
    flat = torch.zeros(16, 64)
    flat[1] = 3.0
    for deq in (ops.dequantize_int4(*ops.quantize_int4(flat, 32), 64), ops.dequantize_int8(*ops.quantize_int8(flat))):
        assert torch.isfinite(deq).all()
        torch.testing.assert_close(deq, flat, rtol=0, atol=1e-2)


@pytest.mark.parametrize("bits,group", LAYOUTS, ids=LAYOUT_IDS)
def test_row_blocked_quantization_is_identical(bits, group):
    """Large weights are quantized in row blocks to bound temporaries; the result must not change."""
    w = torch.randn(3, 37, 100, generator=torch.Generator().manual_seed(2))
    whole = quantize_tensor(w, bits, group)
    blocked = quantize_tensor(w, bits, group, chunk_elems=1000)
    assert whole.keys() == blocked.keys()
    for k in whole:
        assert torch.equal(whole[k], blocked[k]), k


@pytest.mark.parametrize("bits,group", LAYOUTS, ids=LAYOUT_IDS)
def test_linear_modules(bits, group, exact_fp32):
    g = torch.Generator().manual_seed(bits)
    lin = torch.nn.Linear(96, 48, bias=True)
    x = torch.randn(3, 11, 96, generator=g)
    t = quantize_tensor(lin.weight.data, bits, group)
    if bits == 8:
        mod = Int8Linear(96, 48, bias=True)
        mod.set_quantized(t["qweight"], t["scales"], lin.bias.data, dtype=torch.float32)
        w = ops.dequantize_int8(t["qweight"], t["scales"])
    else:
        mod = Int4Linear(96, 48, group_size=group, bias=True)
        mod.set_quantized(t["qweight"], t["scales"], t["zeros"], lin.bias.data, dtype=torch.float32)
        w = ops.dequantize_int4(t["qweight"], t["scales"], t["zeros"], 96)
    ref = torch.nn.functional.linear(x, w, lin.bias.data)
    _tight(mod(x), ref)
    assert mod.weight.dtype == torch.float32 and mod.weight.numel() == 0


@pytest.mark.parametrize("bits,group", LAYOUTS, ids=LAYOUT_IDS)
def test_quant_experts_dispatch(bits, group, exact_fp32):
    g = torch.Generator().manual_seed(7)
    E, H, inter, N, k = 6, 64, 32, 33, 2
    gate_up, down = torch.randn(E, 2 * inter, H, generator=g) * 0.1, torch.randn(E, H, inter, generator=g) * 0.1
    qe = QuantExperts(E, H, inter, bits=bits, group_size=group)
    ref = argparse.Namespace(num_experts=E)
    for part, w in (("gate_up_proj", gate_up), ("down_proj", down)):
        t = quantize_tensor(w, bits, group)
        qe.set_quantized(part, t, dtype=torch.float32)
        deq = ops.dequantize_int8(t["qweight"], t["scales"]) if bits == 8 else ops.dequantize_int4(t["qweight"], t["scales"], t["zeros"], w.shape[-1])
        setattr(ref, part, deq)
    if bits == 4 and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"):
        assert qe.kernels == {"gate_up_proj": "cpu", "down_proj": "cpu"}
    x = torch.randn(N, H, generator=g)
    top_idx = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(N)])
    top_w = torch.rand(N, k, generator=g)
    top_w = top_w / top_w.sum(-1, keepdim=True)
    _tight(qe(x, top_idx, top_w), reference_expert_forward(ref, x, top_idx, top_w), scale=1.0)


# ------------------------------------------------------------------------------- checkpoints
@pytest.fixture(scope="module")
def float_dir(tmp_path_factory):
    # a gentle init: random tiny models are chaotic (routing flips), this keeps "close to float" meaningful
    return clover.build_tiny_checkpoint(tmp_path_factory.mktemp("qfloat") / "model", seed=3, init_std=0.02)


@pytest.fixture(scope="module")
def quant_dirs(float_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    out = {}
    for (bits, group), name in zip(LAYOUTS, LAYOUT_IDS):
        out[name] = root / name
        quantize_checkpoint(float_dir, out[name], bits=bits, group_size=group or 64, progress=False)
    return out


def _dequantized_float_model(float_dir, quant_dir):
    """The float model with every quantized weight replaced by its dequantized value."""
    model = load_model(float_dir)
    qc = json.loads((quant_dir / "config.json").read_text())["quantization_config"]
    st = load_file(str(quant_dir / "model.safetensors"))
    params = dict(model.named_parameters())
    targets = quantizable(model.config)
    with torch.no_grad():
        for name in qc["modules"]:
            for wname, shape in targets[name].weight_shapes().items():
                base = wname.removesuffix(".weight")
                if qc["bits"] == 8:
                    w = ops.dequantize_int8(st[base + ".qweight"], st[base + ".scales"])
                else:
                    w = ops.dequantize_int4(st[base + ".qweight"], st[base + ".scales"], st[base + ".zeros"], shape[-1])
                params[wname].copy_(w)
    return model


@pytest.mark.parametrize("name", LAYOUT_IDS)
def test_on_disk_format_round_trip(float_dir, quant_dirs, name):
    bits, group = LAYOUTS[LAYOUT_IDS.index(name)]
    d = quant_dirs[name]
    cfg = json.loads((d / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "clover-weight-only" and qc["format_version"] == 1
    assert qc["bits"] == bits and qc["group_size"] == group
    assert "model.layers.0.mlp.experts" in qc["modules"] and "model.layers.0.linear_attn.in_proj_qkv" in qc["modules"]
    assert not any(m.endswith(("mlp.gate", "in_proj_a", "in_proj_b", "shared_expert_gate")) for m in qc["modules"])
    assert "model.embed_tokens" not in qc["modules"] and "lm_head" not in qc["modules"]
    assert (d / "tokenizer.json").exists() and (d / "tokenizer_config.json").exists()
    on_disk = load_file(str(d / "model.safetensors"))
    fl = load_file(str(float_dir / "model.safetensors"))
    from clover.models import read_config

    targets = quantizable(read_config(d))
    expected_keys = set()
    for m in qc["modules"]:
        specs = tensor_specs(targets[m], bits, group)
        expected_keys |= set(specs)
        for wname in targets[m].weight_shapes():
            base = wname.removesuffix(".weight")
            for k, v in quantize_tensor(fl[wname], bits, group).items():
                key = f"{base}.{k}"
                assert on_disk[key].dtype == specs[key][0] and tuple(on_disk[key].shape) == specs[key][1]
                assert torch.equal(on_disk[key], v), key  # identical tensors
            assert wname not in on_disk
    for k, v in fl.items():  # everything else is kept exactly
        if k not in {w for m in qc["modules"] for w in targets[m].weight_shapes()}:
            assert torch.equal(on_disk[k], v), k
            expected_keys.add(k)
    assert set(on_disk) == expected_keys
    assert on_disk["model.layers.0.mlp.gate.weight"].dtype == torch.float32  # the router stays float


@pytest.mark.parametrize("name", LAYOUT_IDS)
def test_load_quantized_logits(float_dir, quant_dirs, name, monkeypatch):
    llm = clover.load(quant_dirs[name])
    layer = llm.model.model.layers[0]
    assert isinstance(layer.mlp.experts, QuantExperts)
    assert isinstance(layer.linear_attn.in_proj_qkv, Int8Linear if name == "int8" else Int4Linear)
    assert isinstance(layer.linear_attn.in_proj_a, torch.nn.Linear) and isinstance(layer.mlp.gate, torch.nn.Linear)
    assert not llm.model.training
    ids = torch.randint(0, 256, (2, 37), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        q = llm.model(ids)
        same_math = _dequantized_float_model(float_dir, quant_dirs[name])(ids)
        fl = load_model(float_dir)(ids)
        monkeypatch.setattr(ops, "FP32_VIA_BF16", False)
        q_exact = llm.model(ids)
    _tight(q_exact, same_math)  # the low-bit kernels compute exactly the dequantized model
    assert torch.nn.functional.cosine_similarity(q.flatten(), same_math.flatten(), dim=0).item() > 0.999  # bf16 activations
    cos = torch.nn.functional.cosine_similarity(q.flatten(), fl.flatten(), dim=0).item()
    assert cos > (0.99 if name == "int8" else 0.8), cos  # and it stays near the float model


@pytest.mark.parametrize("name", ["int8", "int4-g32"])
def test_generate_ar_and_diffusion(quant_dirs, name):
    llm = clover.load(quant_dirs[name])
    for mode in ("ar", "diffusion"):
        g = llm.generate("def f(x):", mode=mode, max_new_tokens=12, block_size=8)
        assert g.stats.tokens == len(g.token_ids) > 0
    # the cached step path agrees with the plain forward
    ids = torch.tensor([llm.tokenizer.encode("quantized")])
    cache = llm.model.make_cache(1, 64)
    with torch.no_grad():
        out = llm.model.step(cache, commit_ids=ids)
        ref = llm.model(ids)[:, -1]
    torch.testing.assert_close(out.commit_logits, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits", [8, 4])
def test_llama_quantizes_its_own_layers(tmp_path, bits, monkeypatch):
    """The quantizable layers are read off the architecture's model: a Llama (no GDN, no experts, no
    attention gate) quantizes its q/k/v/o and SwiGLU projections at their own shapes, and the loaded
    model computes exactly its dequantized float model."""
    from clover.models import build_model
    from clover.tiny import build_tiny_checkpoint

    float_dir = build_tiny_checkpoint(tmp_path / "f", seed=3, init_std=0.15, dense=True, backbone="llama")
    quant_dir = tmp_path / "q"
    quantize_checkpoint(float_dir, quant_dir, bits=bits, group_size=32, progress=False)
    config = load_model(float_dir).config
    linear = {n: m for n, m in build_model(config).named_modules()
              if isinstance(m, torch.nn.Linear) and n.startswith("model.layers.") and ".adapters." not in n}
    targets = quantizable(config)
    assert set(targets) - {"model.embed_tokens", "lm_head"} == set(linear)
    for n, m in linear.items():
        assert (targets[n].n, targets[n].k) == (m.out_features, m.in_features), n
    llm = clover.load(quant_dir)
    assert isinstance(llm.model.model.layers[0].self_attn.q_proj, Int8Linear if bits == 8 else Int4Linear)
    monkeypatch.setattr(ops, "FP32_VIA_BF16", False)
    ids = torch.randint(0, 256, (2, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _tight(llm.model(ids), _dequantized_float_model(float_dir, quant_dir)(ids))
    assert len(llm.generate("def f(x):", mode="ar", max_new_tokens=6, ignore_eos=True).token_ids) == 6


def test_bfloat16_compute(quant_dirs):
    llm = clover.load(quant_dirs["int4-g64"], dtype="bfloat16")
    assert llm.model.dtype == torch.bfloat16
    g = llm.generate("hi", mode="diffusion", max_new_tokens=8, block_size=8)
    assert len(g.token_ids) == 8


@pytest.mark.parametrize("tied", [False, True])
def test_include_embeddings(tmp_path, tied):
    src = clover.build_tiny_checkpoint(tmp_path / "f", seed=1, init_std=0.02, tie_word_embeddings=tied)
    dst = tmp_path / "q"
    qc = quantize_checkpoint(src, dst, bits=8, include_embeddings=True, progress=False)
    assert "model.embed_tokens" in qc["modules"] and ("lm_head" in qc["modules"]) == (not tied)
    llm = clover.load(dst)
    assert llm.model.dtype == torch.float32 and llm.model.device.type == "cpu"
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        q, fl = llm.model(ids), load_model(src)(ids)
    assert torch.nn.functional.cosine_similarity(q.flatten(), fl.flatten(), dim=0).item() > 0.99
    assert len(llm.generate("ab", mode="ar", max_new_tokens=4).token_ids) == 4


def test_skip_patterns(float_dir, tmp_path):
    qc = quantize_checkpoint(float_dir, tmp_path / "q", bits=4, group_size=32, skip=["*.mlp.experts", "model.layers.3.*"], progress=False)
    assert not any(m.endswith("mlp.experts") or m.startswith("model.layers.3.") for m in qc["modules"])
    model = load_model(tmp_path / "q")
    assert isinstance(model.model.layers[0].mlp.experts.gate_up_proj, torch.nn.Parameter)
    assert isinstance(model.model.layers[3].mlp.shared_expert.up_proj, torch.nn.Linear)
    with pytest.raises(ValueError, match="matches no quantizable module"):
        quantize_checkpoint(float_dir, tmp_path / "q2", bits=8, skip=["*.nothing"], progress=False)


def test_per_expert_sharded_source(float_dir, tmp_path):
    """A source with per-expert keys spread over two shards quantizes to the same tensors."""
    src = tmp_path / "src"
    shutil.copytree(float_dir, src)
    state = load_file(str(src / "model.safetensors"))
    (src / "model.safetensors").unlink()
    split = {}
    for k in list(state):
        if k.endswith("mlp.experts.gate_up_proj"):
            gu = state.pop(k)
            inter = gu.shape[1] // 2
            for e in range(gu.shape[0]):
                split[f"{k[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = gu[e, :inter].contiguous()
                split[f"{k[:-len('gate_up_proj')]}{e}.up_proj.weight"] = gu[e, inter:].contiguous()
        elif k.endswith("mlp.experts.down_proj"):
            dn = state.pop(k)
            for e in range(dn.shape[0]):
                split[f"{k[:-len('down_proj')]}{e}.down_proj.weight"] = dn[e].contiguous()
    keys = sorted(split)
    a = {**state, **{k: split[k] for k in keys[: len(keys) // 2]}}
    b = {k: split[k] for k in keys[len(keys) // 2 :]}
    save_file(a, str(src / "model-00001-of-00002.safetensors"))
    save_file(b, str(src / "model-00002-of-00002.safetensors"))
    wm = {**{k: "model-00001-of-00002.safetensors" for k in a}, **{k: "model-00002-of-00002.safetensors" for k in b}}
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    quantize_checkpoint(src, tmp_path / "q", bits=4, group_size=32, progress=False)
    quantize_checkpoint(float_dir, tmp_path / "ref", bits=4, group_size=32, progress=False)
    got = {}
    for f in (tmp_path / "q").glob("*.safetensors"):
        got.update(load_file(str(f)))
    ref = load_file(str(tmp_path / "ref" / "model.safetensors"))
    assert set(got) == set(ref)
    for k in ref:
        assert torch.equal(got[k], ref[k]), k
    assert clover.load(tmp_path / "q").generate("x", mode="ar", max_new_tokens=3).stats.tokens == 3


# ----------------------------------------------------------------------------------- errors
def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


KEY = "model.layers.0.linear_attn.in_proj_qkv"


def test_wrong_shape_names_file_and_key(quant_dirs, tmp_path):
    d = _copy(quant_dirs["int4-g32"], tmp_path / "m")
    st = load_file(str(d / "model.safetensors"))
    st[KEY + ".qweight"] = st[KEY + ".qweight"][:, :-1].contiguous()
    save_file(st, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        clover.load(d)
    msg = str(e.value)
    assert "model.safetensors" in msg and KEY in msg and "int4 weight" in msg and "config implies" in msg


def test_wrong_dtype_names_file_and_key(quant_dirs, tmp_path):
    d = _copy(quant_dirs["int8"], tmp_path / "m")
    st = load_file(str(d / "model.safetensors"))
    st[KEY + ".qweight"] = st[KEY + ".qweight"].float()
    save_file(st, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        load_model(d)
    assert "model.safetensors" in str(e.value) and KEY in str(e.value) and "int8" in str(e.value)


def test_expert_shape_mismatch_with_config(quant_dirs, tmp_path):
    """Weights quantized with one group size, config claiming another."""
    d = _copy(quant_dirs["int4-g32"], tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["group_size"] = 128
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*config implies"):
        load_model(d)


def test_missing_and_corrupt(quant_dirs, tmp_path):
    d = _copy(quant_dirs["int4-g64"], tmp_path / "missing")
    st = load_file(str(d / "model.safetensors"))
    del st["model.layers.1.mlp.experts.down_proj.zeros"]
    save_file(st, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing.*model\.layers\.1\.mlp\.experts\.down_proj\.zeros"):
        load_model(d)
    d = _copy(quant_dirs["int4-g64"], tmp_path / "nan")
    st = load_file(str(d / "model.safetensors"))
    st[KEY + ".scales"][0, 0] = float("nan")
    save_file(st, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="non-finite"):
        load_model(d)
    d = _copy(quant_dirs["int8"], tmp_path / "trunc")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*(truncated|corrupt)"):
        load_model(d)
    d = _copy(quant_dirs["int8"], tmp_path / "method")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "something-else"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="quant_method"):
        load_model(d)


def test_float_tensor_where_quantized_expected(quant_dirs, float_dir, tmp_path):
    d = _copy(quant_dirs["int8"], tmp_path / "m")
    st = load_file(str(d / "model.safetensors"))
    st[KEY + ".weight"] = load_file(str(float_dir / "model.safetensors"))[KEY + ".weight"]
    save_file(st, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"unexpected key '{KEY}\.weight'.*quantized"):
        load_model(d)


# -------------------------------------------------------------------------------------- CLI
def _cli(argv):
    from clover.cli.quantize import configure, run

    p = argparse.ArgumentParser()
    configure(p)
    return run(p.parse_args(argv))


def test_cli(float_dir, tmp_path, capsys):
    assert _cli([str(float_dir), str(tmp_path / "q"), "--bits", "4", "--group-size", "32", "--skip", "*.self_attn.*", "--no-progress"]) == 0
    assert "int4 group 32" in capsys.readouterr().out
    cfg = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert cfg["skip"] == ["*.self_attn.*"] and not any("self_attn" in m for m in cfg["modules"])
    with pytest.raises(ValueError, match="group-size"):
        _cli([str(float_dir), str(tmp_path / "q8"), "--bits", "8", "--group-size", "32"])
    with pytest.raises(ValueError, match="already quantized"):
        _cli([str(tmp_path / "q"), str(tmp_path / "qq"), "--bits", "8"])
    with pytest.raises(SystemExit):
        _cli([str(float_dir), str(tmp_path / "x"), "--bits", "3"])


def test_footprint_full_size():
    from clover.models.qwen3_5_moe import full_size_config
    from clover.quant import footprint

    c = full_size_config()
    from clover.models import parameter_counts

    total = parameter_counts(c)["total"]
    bf16 = footprint(c)
    int8 = footprint(c, bits=8)
    int4 = footprint(c, bits=4, group_size=64)
    assert bf16["disk_bytes"] == 2 * total
    assert int8["quantized_params"] == int4["quantized_params"] > 0.95 * total
    assert 0.5 * bf16["disk_bytes"] < int8["disk_bytes"] < 0.56 * bf16["disk_bytes"]
    assert 0.25 * bf16["disk_bytes"] < int4["disk_bytes"] < int8["disk_bytes"]
