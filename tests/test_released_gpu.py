"""`clover bench released` (what scripts/gpu-check.sh runs on a lent GPU) at its tiny shape on the CPU:
the same code as the full-shape GPU check but the device, the dtype and the peak-memory reading, so
the GPU path cannot rot unseen. The full shapes are pinned by their parameter counts on meta."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.mark.parametrize("name,total,model_type,tied", [
    ("sdar-1.7b", 1.7e9, "sdar", True),  # Qwen3-1.7B: 1.7B with tied embeddings
    ("fast-dllm-v2-1.5b", 1.54e9, "Fast_dLLM_Qwen", True),  # Qwen2.5-1.5B: 1.54B with tied embeddings
])
def test_dense_released_shapes_on_meta(name, total, model_type, tied):
    """The dense released shapes build on meta with their published parameter counts (within 3%) and
    their family's decoding defaults."""
    from clover.bench.released import family_config
    from clover.models import parameter_counts
    from clover.models.shapes import shape_config

    c = shape_config(name)
    assert c.model_type == model_type and c.tie_word_embeddings is tied and c.vocab_size == 151936
    assert abs(parameter_counts(c)["total"] / total - 1) < 0.03
    assert family_config(name).to_dict() == c.to_dict()
    if name == "sdar-1.7b":
        assert (c.block_size, c.threshold, c.mask_token_id, c.head_dim) == (4, 0.9, 151669, 128)
    else:
        assert (c.block_size, c.sub_block, c.threshold, c.mask_token_id, c.qkv_bias) == (32, 8, 0.9, 151665, True)


def test_random_weights_drawn_on_the_device():
    """`build_random_model(on_device=True)`: the model materialised from meta in the run's dtype, drawn
    in place (norms 1, biases 0, matrices normal(0, σ)), tied embeddings still tied, reproducible by
    seed; the mask token's head row at zero."""
    from clover.bench.released import family_config, random_llm

    c = family_config("fast-dllm-v2-1.5b", tiny=True).replace(tie_word_embeddings=True)
    a = random_llm(c, device="cpu", dtype=torch.bfloat16).model
    b = random_llm(c, device="cpu", dtype=torch.bfloat16).model
    assert a.lm_head.weight is a.model.embed_tokens.weight and a.lm_head.weight.dtype == torch.bfloat16
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), name
        if "norm" in name:
            assert torch.all(p == 1), name
        elif name.endswith("bias"):
            assert torch.all(p == 0), name
    assert torch.all(a.lm_head.weight[c.mask_token_id] == 0)
    w = a.model.layers[0].mlp.gate_proj.weight.float()
    assert abs(w.std().item() / c.initializer_range - 1) < 0.1


def test_released_check_runs_tiny_on_cpu(tmp_path, capsys):
    """The whole check through the CLI at the tiny shape: every family decoded at batch 1 and 3 with
    its defaults, batched == alone and cached == naive hold, the large shapes' plans, one JSON and a
    table; the JSON is written after every phase."""
    from clover.bench import released
    from clover.cli import main

    out = tmp_path / "released.json"
    assert main(["bench", "released", "--tiny", "--batch", "3", "-n", "12", "--check-tokens", "6", "--json", str(out)]) == 0
    captured = capsys.readouterr()
    text = captured.out
    assert "sdar-1.7b: checked (" in captured.err  # progress: a line after every phase
    r = json.loads(out.read_text())
    assert r["schema"] == released.SCHEMA and r["tiny"] is True and r["batch"] == 3
    fams = {f["family"]: f for f in r["families"]}
    assert list(fams) == [*released.PLANNED, *released.FAMILIES]  # the plans first: a timeout keeps them
    for name in released.FAMILIES:
        f = fams[name]
        assert f["mode"] == "diffusion" and f["shape"] == "tiny"
        assert f["checks"]["batched_equals_alone"]["ok"] and f["checks"]["cached_equals_naive"]["ok"], f["checks"]
        assert {c["dtype"] for c in f["checks"].values()} == {"float32"} and len(f["agreement"]["rows"]) == 3
        assert f["batch1"]["rows"] == 1 * 3 and f["batch"]["rows"] == 3
        assert f["batch1"]["tokens"] == f["batch"]["tokens"] == 3 * 12
        assert f["batch"]["forwards"] > 0 and f["batch"]["tokens_per_forward"] > 0
        assert f["plan"]["weights_bytes"] == 4 * f["config"]["parameters"]["total"]  # float32
        assert f["measured"]["weights_peak_bytes"] is None  # CUDA only
        assert f"| {name} |" in text
    assert fams["llada2-mini"]["defaults"]["block_size"] == 32 and fams["sdar-1.7b"]["defaults"]["block_size"] == 4
    assert fams["fast-dllm-v2-1.5b"]["defaults"]["sub_block"] == 8
    for name in released.PLANNED:
        assert fams[name]["skipped"] == "memory plan only" and fams[name]["plan"]["weights_bytes"] > 30e9 * 2
    phases = []
    rec = released.run_family("sdar-1.7b", tiny=True, device="cpu", dtype=torch.bfloat16, batch=2, new_tokens=4,
                              check_tokens=4, report=lambda rec: phases.append(sorted(rec)))
    assert len(phases) == 4 and "batch1" not in phases[1] and "checks" in phases[-1]
    assert rec["config"]["dtype"] == "bfloat16" and rec["checks"]["batched_equals_alone"]["dtype"] == "float32"


def test_released_check_refusals(capsys):
    from clover.cli import main

    assert main(["bench", "released", "--tiny", "--families", "nope"]) == 2
    assert "family: 'nope' is not one of" in capsys.readouterr().err
    assert main(["bench", "released", "--tiny", "--batch", "0"]) == 2
    assert "--batch: must be a positive integer" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert main(["bench", "released", "--plans", "none"]) == 2  # the full check defaults to cuda
        assert "cuda is not available" in capsys.readouterr().err


def test_checks_fall_back_to_the_run_dtype_when_float32_runs_out_of_memory(monkeypatch):
    """A float32 rebuild that runs out of device memory (the plan's tenth to spare too little): the
    checks run in the run's dtype, and say so."""
    from clover.bench import released

    real = released.random_llm

    def random_llm(config, *, device, dtype, seed=released.SEED):
        if dtype == torch.float32:
            raise torch.OutOfMemoryError("stand-in")
        return real(config, device=device, dtype=dtype, seed=seed)

    monkeypatch.setattr(released, "random_llm", random_llm)
    rec = released.run_family("sdar-1.7b", tiny=True, device="cpu", dtype=torch.bfloat16, batch=2, new_tokens=4,
                              check_tokens=4)
    assert {c["dtype"] for c in rec["checks"].values()} == {"bfloat16"}
    assert rec["checks"]["cached_equals_naive"]["ok"]


def test_cli_names_the_released_families_as_the_bench_does():
    """`clover bench released`'s defaults are named in the CLI (so `--help` does not import torch): the
    same names as `clover.bench.released`'s, in its order."""
    from clover.bench.released import FAMILIES, PLANNED
    from clover.cli.bench import RELEASED_FAMILIES, RELEASED_PLANS

    assert RELEASED_FAMILIES.split(",") == list(FAMILIES) and RELEASED_PLANS.split(",") == list(PLANNED)
