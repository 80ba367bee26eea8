"""What clover adds, on the released families (SDAR `sdar`, LLaDA2 `llada2_moe`, Fast-dLLM v2
`Fast_dLLM_Qwen`, Dream `Dream`): INT8 / INT4 weight-only quantization gives the tokens of the float
model holding the dequantized weights (the low-bit kernels in float32), `compile` is refused in one
line on Dream (the block families compile: tests/test_released_compile.py), `bench decode` and `eval` run the modes each family decodes with (and say which they skip). The
tiny checkpoints are the golden ones in each family's real layout (tests/test_released_serve.py widens
the block families' vocabulary to the byte tokenizer)."""

from __future__ import annotations

import json

import pytest
import torch

import clover
from clover.bench.decode import Workload, run_decode
from clover.bench.eval import run_eval
from clover.quant import ops
from clover.quant.writer import quantize_checkpoint
from test_quant import _dequantized_float_model
from test_released_serve import chat_checkpoint

FAMILIES = ("sdar", "llada2", "fastdllm2", "dream")
DEFAULT = {"sdar": {"diffusion", "naive"}, "llada2": {"diffusion", "naive"}, "fastdllm2": {"diffusion", "naive"},
           "dream": {"canvas"}}


def dream_checkpoint(directory):
    from safetensors.torch import save_file
    from test_canvas import _script, golden

    from clover.tokenizer import write_byte_tokenizer

    g = golden("dream")
    directory.mkdir(parents=True, exist_ok=True)
    weights = _script().tiny_parameters([(n, s) for n, s in g["parameters"]], g["seed"], g["head"],
                                        g["config"]["mask_token_id"])
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(g["config"]))
    write_byte_tokenizer(directory)
    return directory


@pytest.fixture(scope="module", params=FAMILIES)
def checkpoint(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param) / "float"
    return request.param, (dream_checkpoint(d) if request.param == "dream" else chat_checkpoint(request.param, d))


@pytest.mark.parametrize("bits,group", [(8, None), (4, 32)], ids=["int8", "int4-g32"])
def test_quantized_tokens_are_the_dequantized_float_models(checkpoint, tmp_path, bits, group, monkeypatch):
    name, src = checkpoint
    dst = tmp_path / "q"
    quantize_checkpoint(src, dst, bits=bits, group_size=group or 64, progress=False)
    modules = json.loads((dst / "config.json").read_text())["quantization_config"]["modules"]
    want = {"llada2": "model.layers.1.mlp.experts"}.get(name, "model.layers.0.self_attn.q_proj")
    assert want in modules
    if name == "llada2":  # its fused attention and shared experts too
        assert {"model.layers.1.self_attn.query_key_value", "model.layers.1.mlp.shared_experts.up_proj"} <= set(modules)
    monkeypatch.setattr(ops, "FP32_VIA_BF16", False)  # the low-bit matmuls in float32: the dequantized math
    q = clover.load(dst)
    ref = clover.load(src)
    ref.model.load_state_dict(_dequantized_float_model(src, dst).state_dict())
    kw = dict(max_new_tokens=12, ignore_eos=True) | ({"steps": 6} if name == "dream" else {})
    for prompt in ("hello", "a longer prompt, here"):
        assert q.generate(prompt, **kw).token_ids == ref.generate(prompt, **kw).token_ids, (name, prompt)


def test_compile_is_refused_in_one_line(checkpoint):
    """The whole-sequence family (Dream: the canvas mode has no static steps); the block families
    compile (tests/test_released_compile.py)."""
    name, src = checkpoint
    if name != "dream":
        pytest.skip("compiles: tests/test_released_compile.py")
    with pytest.raises(ValueError, match="^compile: the static steps commit causally") as e:
        clover.load(src, compile=True)
    assert "\n" not in str(e.value)


def test_bench_decode_and_eval_run_the_familys_modes(checkpoint):
    name, src = checkpoint
    llm = clover.load(src)
    items = Workload("tasks", prompts=2).load()
    r = run_decode(llm, Workload("tasks", max_new_tokens=8, items=items), warmup=False)
    assert set(r["settings"]["modes"]) == DEFAULT[name] and "ar" in r["settings"]["skipped_modes"]
    assert all(s["tokens"] > 0 for s in r["modes"].values())
    e = run_eval(llm, task_prompts=2, code_prompts=1, max_new_tokens=8)
    assert set(e["tasks"]["modes"]) == DEFAULT[name]
    assert ("tasks_sweep" in e) == (name != "dream")  # the threshold/block sweep: block diffusion only
    assert "ar" not in {p["mode"] for p in e.get("tasks_sweep", {}).get("points", [])}
    assert "skipped" in e["teacher_forced"]  # no causal, shifted forward to score


@pytest.mark.parametrize("name,total,active,model_type", [
    ("sdar-30b-a3b", 30.5e9, 3.3e9, "sdar_moe"),  # Qwen3-30B-A3B: 30.5B, 3.3B active
    ("llada2-flash", 100e9, 6.1e9, "llada2_moe"),  # Ling-flash-2.0: 100B, 6.1B active
    ("llada2-mini", 16e9, 1.4e9, "llada2_moe"),  # Ling-mini-2.0: 16B, 1.4B active
])
def test_full_size_shapes_build_on_meta_with_their_memory_plan(name, total, active, model_type, capsys):
    """A 30B-A3B and a 100B-A6B config build on the meta device (their published parameter counts within
    3%), and `clover info NAME --memory` prints what decoding holds at a context: weights at bf16 / int8 /
    int4 and the K/V cache."""
    from clover.cli import main
    from clover.models import build_model, parameter_counts
    from clover.models.shapes import shape_config
    from clover.quant.sizes import memory_plan

    c = shape_config(name)
    assert c.model_type == model_type and c.mask_token_id is not None
    model = build_model(c, device="meta")
    assert all(p.is_meta for p in model.parameters())
    counts = parameter_counts(c)
    assert abs(counts["total"] / total - 1) < 0.03 and abs(counts["active"] / active - 1) < 0.03, counts
    plan = memory_plan(c, context=32768, batch=2)
    kv = 2 * c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 32768 * 2  # bf16 K and V, two rows
    bf16, int8, int4 = (plan["precisions"][k] for k in ("bf16", "int8", "int4 g64"))
    assert bf16["kv_bytes"] == kv and bf16["weights_bytes"] == 2 * counts["total"]
    assert bf16["weights_bytes"] > int8["weights_bytes"] > int4["weights_bytes"] > counts["total"] / 2
    assert main(["info", name, "--memory", "--context", "32768", "--batch", "2"]) == 0
    out = capsys.readouterr().out
    assert f"{counts['total'] / 1e9:.2f} B parameters" in out and "| int4 g64 |" in out and "32,768 tokens x 2" in out
    assert main(["info", name, "--memory", "--context", "0"]) == 2
    assert "context and batch must be positive" in capsys.readouterr().err
    assert main(["info", name, "--vllm-memory"]) == 2  # the vLLM plugin's tables are Qwen3.5's
    assert "use --memory" in capsys.readouterr().err
