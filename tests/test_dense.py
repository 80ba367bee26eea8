"""Dense Qwen3.5 (hybrid GDN + gated attention, dense SwiGLU MLP) against transformers'
Qwen3_5ForCausalLM: logits, cached decoding, greedy generation; then `clover convert` and block
diffusion on it."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import clover
from clover.checkpoint import load_model
from clover.models import read_config

from hf_reference import hf_dense_config, hf_model

CONFIGS = {
    # 3:1 pattern, GQA 2, partial rotary 0.5, GDN 2 key -> 4 value heads
    "base": {},
    # MHA, full rotary, wider heads, key heads == value heads with K != V, tied embeddings
    "mha_tied": dict(
        num_attention_heads=2, num_key_value_heads=2, head_dim=32, intermediate_size=48,
        linear_num_key_heads=3, linear_num_value_heads=3, linear_key_head_dim=8, linear_value_head_dim=24,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 1.0},
        tie_word_embeddings=True,
    ),
    # explicit layer pattern (attention first), GQA 4, rotary 0.25, conv kernel 3, GDN 1 -> 4 value heads
    "pattern": dict(
        num_hidden_layers=3, layer_types=["full_attention", "linear_attention", "linear_attention"],
        num_attention_heads=8, num_key_value_heads=2, head_dim=8, intermediate_size=128, linear_conv_kernel_dim=3,
        linear_num_key_heads=1, linear_num_value_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    ),
}


def _save_hf(name, tmp_path, seed=0):
    ref = hf_model(hf_dense_config(**CONFIGS[name]), seed=seed)
    out = tmp_path / name
    ref.save_pretrained(out)
    return ref, out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name, tmp_path):
    ref, path = _save_hf(name, tmp_path)
    ours = load_model(path)
    assert ours.config.model_type == "qwen3_5_text" and not ours.config.has_experts
    assert type(ours).__name__ == "Qwen3_5ForCausalLM"
    ids = torch.randint(0, ref.config.vocab_size, (2, 75), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits
        torch.testing.assert_close(ours(ids), expected, atol=1e-4, rtol=1e-4)
        # prefill + token-by-token cached decoding
        cache = ours.make_cache(2, 80)
        out = ours.step(cache, commit_ids=ids[:, :40], all_logits=True)
        torch.testing.assert_close(out.commit_logits, expected[:, :40], atol=1e-4, rtol=1e-4)
        assert out.experts_touched == []
        for t in range(40, 75):
            out = ours.step(cache, commit_ids=ids[:, t : t + 1], track_experts=True)
            torch.testing.assert_close(out.commit_logits, expected[:, t], atol=1e-4, rtol=1e-4)
        # a prefill in two chunks
        cache = ours.make_cache(2, 80)
        ours.step(cache, commit_ids=ids[:, :30])
        out = ours.step(cache, commit_ids=ids[:, 30:75], all_logits=True)
        torch.testing.assert_close(out.commit_logits, expected[:, 30:], atol=1e-4, rtol=1e-4)


def test_multimodal_layout_with_skipped_keys(tmp_path):
    """`Qwen3_5ForConditionalGeneration` checkpoints: text weights under model.language_model.*, config
    nested in text_config (model_type qwen3_5), vision tower and MTP head skipped."""
    ref, path = _save_hf("base", tmp_path)
    state = load_file(str(path / "model.safetensors"))
    mm = {(k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k): v for k, v in state.items()}
    mm["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(4, 4)
    mm["mtp.layers.0.mlp.gate_proj.weight"] = torch.zeros(4, 4)
    out = tmp_path / "mm"
    out.mkdir()
    save_file(mm, str(out / "model.safetensors"), metadata={"format": "pt"})
    text_cfg = json.loads((path / "config.json").read_text())
    cfg = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": text_cfg,
           "vision_config": {"depth": 1}, "image_token_id": 5}
    (out / "config.json").write_text(json.dumps(cfg))
    assert read_config(out).model_type == "qwen3_5_text"
    ours = load_model(out)
    ids = torch.randint(0, 300, (1, 33))
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
    got = llm.generate(prompt, max_new_tokens=24, ignore_eos=True)
    assert got.token_ids == hf[0, len(prompt):].tolist()
    assert got.stats.forwards == 24 and got.stats.experts_touched is None


def test_convert_then_block_diffusion(tmp_path):
    """`clover convert` on a dense checkpoint: commit mode unchanged, the backbone recorded, and
    cached block diffusion equals the naive recomputation (with the Clover branches made non-zero)."""
    from clover.convert import convert_to_clover
    from clover.tokenizer import SPECIAL_TOKENS, write_byte_tokenizer

    specials = tuple(t for t in SPECIAL_TOKENS if t != "<|mask|>")
    ref = hf_model(hf_dense_config(eos_token_id=256), seed=3)
    src = tmp_path / "ar"
    ref.save_pretrained(src)
    write_byte_tokenizer(src, specials=specials)
    cfg = convert_to_clover(src, tmp_path / "clover", block_size=4, progress=False)
    assert cfg.is_clover and cfg.backbone == "qwen3_5_text" and not cfg.has_experts
    saved = json.loads((tmp_path / "clover" / "config.json").read_text())
    assert saved["model_type"] == "clover" and saved["backbone"] == "qwen3_5_text" and "num_experts" not in saved
    llm = clover.load(tmp_path / "clover")
    ids = torch.randint(0, 256, (1, 24))
    with torch.no_grad():
        torch.testing.assert_close(llm.model(ids), ref(ids).logits, atol=1e-4, rtol=1e-4)
        gen = torch.Generator().manual_seed(0)
        for name, p in llm.model.named_parameters():  # exercise the bidirectional branches too
            if name.endswith(("conv1d_right.weight", "block_gain_a", "block_gain_b")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    prompt = list(range(40, 51))
    for threshold in (0.3, 0.95):
        kw = dict(max_new_tokens=11, block_size=4, threshold=threshold, ignore_eos=True)
        cached = llm.generate(prompt, mode="diffusion", **kw)
        naive = llm.generate(prompt, mode="naive", **kw)
        assert cached.token_ids == naive.token_ids and len(cached.token_ids) == 11
        assert cached.stats.forwards == naive.stats.forwards


def test_parameter_counts_dense_and_tiny_dense_checkpoint(tmp_path):
    from clover.models import build_model, parameter_counts
    from clover.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path / "tiny", dense=True)
    cfg = read_config(path)
    assert cfg.is_clover and cfg.backbone == "qwen3_5_text"
    counts = parameter_counts(cfg)
    assert counts["total"] == counts["active"] == sum(p.numel() for p in build_model(cfg).parameters())
    llm = clover.load(path)
    g = llm.generate("hello", mode="diffusion", max_new_tokens=8, block_size=4, ignore_eos=True)
    assert len(g.token_ids) == 8
