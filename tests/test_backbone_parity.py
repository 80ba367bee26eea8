"""The backbone against transformers' Qwen3_5MoeForCausalLM: logits, cached decoding, greedy generation."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import clover
from clover.checkpoint import load_model

from hf_reference import hf_config, hf_model

CONFIGS = {
    # 3:1 pattern, GQA 2, partial rotary 0.5, GDN 2 key -> 4 value heads
    "base": {},
    # MHA, full rotary, different head dims, more experts, top-3, key heads == value heads, K != V
    "mha_top3": dict(
        num_attention_heads=2, num_key_value_heads=2, head_dim=32, num_experts=16, num_experts_per_tok=3,
        linear_num_key_heads=3, linear_num_value_heads=3, linear_key_head_dim=8, linear_value_head_dim=24,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 1.0},
    ),
    # explicit layer pattern (attention first), GQA 4, rotary 0.25, top-1, conv kernel 3
    "pattern": dict(
        num_hidden_layers=3, layer_types=["full_attention", "linear_attention", "linear_attention"],
        num_attention_heads=8, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=1,
        linear_conv_kernel_dim=3, rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
        shared_expert_intermediate_size=16,
    ),
}


def _save_hf(name, tmp_path, seed=0):
    cfg = hf_config(**CONFIGS[name])
    ref = hf_model(cfg, seed=seed)
    out = tmp_path / name
    ref.save_pretrained(out)
    return ref, out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name, tmp_path):
    ref, path = _save_hf(name, tmp_path)
    ours = load_model(path)
    ids = torch.randint(0, ref.config.vocab_size, (2, 75), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits
        got = ours(ids)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)

    # prefill + token-by-token cached decoding gives the same logits
    with torch.no_grad():
        cache = ours.make_cache(2, 80)
        out = ours.step(cache, commit_ids=ids[:, :40], all_logits=True)
        torch.testing.assert_close(out.commit_logits, expected[:, :40], atol=1e-4, rtol=1e-4)
        for t in range(40, 75):
            out = ours.step(cache, commit_ids=ids[:, t : t + 1])
            torch.testing.assert_close(out.commit_logits, expected[:, t], atol=1e-4, rtol=1e-4)
        # and chunked continuation (prefill in pieces)
        cache = ours.make_cache(2, 80)
        ours.step(cache, commit_ids=ids[:, :30])
        out = ours.step(cache, commit_ids=ids[:, 30:75], all_logits=True)
        torch.testing.assert_close(out.commit_logits, expected[:, 30:], atol=1e-4, rtol=1e-4)


def test_multimodal_layout_with_skipped_keys(tmp_path):
    ref, path = _save_hf("base", tmp_path)
    state = load_file(str(path / "model.safetensors"))
    mm = {}
    for k, v in state.items():
        mm[k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k] = v
    mm["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(4, 4)
    mm["mtp.layers.0.mlp.gate.weight"] = torch.zeros(4, 4)
    out = tmp_path / "mm"
    out.mkdir()
    save_file(mm, str(out / "model.safetensors"), metadata={"format": "pt"})
    text_cfg = json.loads((path / "config.json").read_text())
    cfg = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"], "text_config": text_cfg,
           "vision_config": {"depth": 1}, "image_token_id": 5}
    (out / "config.json").write_text(json.dumps(cfg))
    ours = load_model(out)
    ids = torch.randint(0, 300, (1, 33))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), ref(ids).logits, atol=1e-4, rtol=1e-4)


def test_per_expert_layout_and_sharded(tmp_path):
    ref, path = _save_hf("base", tmp_path)
    state = load_file(str(path / "model.safetensors"))
    split = {}
    for k, v in state.items():
        if k.endswith("mlp.experts.gate_up_proj"):
            prefix = k[: -len(".gate_up_proj")]
            inter = v.shape[1] // 2
            for e in range(v.shape[0]):
                split[f"{prefix}.{e}.gate_proj.weight"] = v[e, :inter].clone()
                split[f"{prefix}.{e}.up_proj.weight"] = v[e, inter:].clone()
        elif k.endswith("mlp.experts.down_proj"):
            prefix = k[: -len(".down_proj")]
            for e in range(v.shape[0]):
                split[f"{prefix}.{e}.down_proj.weight"] = v[e].clone()
        else:
            split[k] = v
    from clover.checkpoint import save_state_dict

    out = tmp_path / "per_expert"
    save_state_dict(split, out, max_shard_bytes=200_000)  # forces several shards + an index
    assert (out / "model.safetensors.index.json").exists()
    (out / "config.json").write_text((path / "config.json").read_text())
    ours = load_model(out)
    ids = torch.randint(0, 300, (1, 20))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), ref(ids).logits, atol=1e-4, rtol=1e-4)


def test_ar_greedy_matches_transformers_generate(tmp_path):
    ref, path = _save_hf("base", tmp_path)
    from clover.tokenizer import write_byte_tokenizer

    write_byte_tokenizer(path)
    llm = clover.load(path)
    prompt = [5, 17, 42, 99, 7, 3, 250, 12]
    with torch.no_grad():
        hf = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = hf[0, len(prompt):].tolist()
    got = llm.generate(prompt, max_new_tokens=24, ignore_eos=True)
    assert got.token_ids == expected
    assert got.stats.forwards == 24 and got.stats.tokens_per_forward == 1.0


def test_save_roundtrip(tmp_path, tiny_dir):
    from clover.checkpoint import save_model

    m = load_model(tiny_dir)
    save_model(m, tmp_path / "copy", max_shard_bytes=100_000)
    m2 = load_model(tmp_path / "copy")
    for (k, a), (k2, b) in zip(m.state_dict().items(), m2.state_dict().items()):
        assert k == k2
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_full_size_config_on_meta():
    from clover.models.qwen3_5_moe import full_size_config
    from clover.models import build_model, parameter_counts

    cfg = full_size_config()
    model = build_model(cfg, device="meta")
    total = sum(p.numel() for p in model.parameters())
    counts = parameter_counts(cfg)
    assert counts["total"] == total
    assert 34e9 < total < 36.5e9, total
    assert 2.5e9 < counts["active"] < 3.6e9, counts["active"]
    assert sum(t == "full_attention" for t in cfg.layer_types) == 10


def test_registry_covers_every_model_type():
    """Every model_type the registry reads has an architecture, whose config class answers to it, and
    each builds its own model class."""
    from clover.models import (ARCHITECTURES, DEFAULT_BACKBONE, REGISTERED, SUPPORTED_MODEL_TYPES,
                               architecture, build_model)
    from clover.tiny import tiny_config

    import clover.models as models
    # one import line per architecture module, each registered once, in import order
    assert [a.name for a in REGISTERED] == ["qwen3_5_moe", "qwen3_5", "llama", "qwen3", "qwen3_moe", "qwen2", "dream",
                                            "llada", "llada_moe", "rnd1", "bailing_moe_v2"]
    assert all(getattr(models, a.name.upper()) is a for a in REGISTERED)
    assert DEFAULT_BACKBONE in REGISTERED[0].config_class.MODEL_TYPES
    assert set(ARCHITECTURES) | {"clover"} == set(SUPPORTED_MODEL_TYPES)
    for model_type in ARCHITECTURES:
        assert model_type in architecture(model_type).model_types
    assert len({t for a in REGISTERED for t in a.model_types}) == sum(len(a.model_types) for a in REGISTERED)
    for dense in (False, True):
        for clover_ in (False, True):
            cfg = tiny_config(clover=clover_, dense=dense)
            model = build_model(cfg)
            assert type(model).__name__ == ("Qwen3_5ForCausalLM" if dense else "Qwen3_5MoeForCausalLM")
            assert hasattr(model.model.layers[0].linear_attn, "intra_scale") == clover_
