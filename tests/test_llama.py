"""The Llama backbone: commit mode against transformers' LlamaForCausalLM (GQA, RoPE theta and
scaling, tied and untied embeddings); cached == recomputed, batch == one-by-one, the denoise mode
against its uncached definition, and speculative == AR greedy."""

import json

import pytest
import torch

import clover
from clover.checkpoint import load_model
from clover.config import CloverConfig, ConfigError
from clover.tiny import build_tiny_checkpoint

LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
CONFIGS = {
    "gqa_untied": dict(num_attention_heads=4, num_key_value_heads=2),
    "mha_tied_llama3": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True, rope_parameters=LLAMA3),
    "gqa3_linear_bias": dict(num_attention_heads=6, num_key_value_heads=2, head_dim=8, attention_bias=True, mlp_bias=True,
                             rope_parameters={"rope_type": "linear", "rope_theta": 1e5, "factor": 2.0}),
}


def _hf(name, tmp_path, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=300, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                      max_position_embeddings=256, rms_norm_eps=1e-5, **CONFIGS[name])
    torch.manual_seed(seed)
    ref = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norms off their identity, so a wrong norm formula shows
        for n, p in ref.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in n else 0.1 * torch.randn_like(p))
    ref.save_pretrained(tmp_path / name)
    return ref, tmp_path / name


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(name, tmp_path):
    ref, path = _hf(name, tmp_path)
    ours = load_model(path)
    assert ours.config.tie_word_embeddings == ref.config.tie_word_embeddings
    ids = torch.randint(0, 300, (2, 60), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = ref(ids).logits
        torch.testing.assert_close(ours(ids), expected, atol=1e-4, rtol=1e-4)
        cache = ours.make_cache(2, 64)  # prefill in pieces, then token by token
        out = ours.step(cache, commit_ids=ids[:, :30], all_logits=True)
        torch.testing.assert_close(out.commit_logits, expected[:, :30], atol=1e-4, rtol=1e-4)
        for t in range(30, 60):
            out = ours.step(cache, commit_ids=ids[:, t : t + 1])
            torch.testing.assert_close(out.commit_logits, expected[:, t], atol=1e-4, rtol=1e-4)


def test_config_defaults_and_round_trip(tmp_path):
    raw = {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16, "num_hidden_layers": 2,
           "num_attention_heads": 2, "num_key_value_heads": 1}
    c = CloverConfig.from_dict(raw)
    assert (c.rope_theta, c.partial_rotary_factor, c.layer_types) == (10000.0, 1.0, ["full_attention"] * 2)
    c = CloverConfig.from_dict({**raw, "rope_scaling": {"type": "llama3", **{k: v for k, v in LLAMA3.items() if k != "rope_type"}}})
    assert c.rope_scaling["rope_type"] == "llama3" and c.rope_theta == 500000.0
    c.save(tmp_path)
    again = CloverConfig.from_file(tmp_path)
    assert again == c
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(tmp_path)
    assert hf.model_type == "llama" and hf.rope_parameters["rope_type"] == "llama3"
    with pytest.raises(ConfigError, match="rope type 'yarn'"):
        from clover.models import build_model

        build_model(CloverConfig.from_dict({**raw, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}}))


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    d = build_tiny_checkpoint(tmp_path_factory.mktemp("llama") / "m", seed=3, init_std=0.15, dense=True,
                              backbone="llama", rms_norm_eps=1e-5)
    return clover.load(d)


def test_denoise_step_equals_uncached_definition(llm):
    """The fused commit+denoise step against one uncached forward with the block's mask written out:
    causal over the prefix, the block seeing the prefix and itself."""
    m, mask_id = llm.model, llm.config.mask_token_id
    assert llm.config.base_model_type == "llama"
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))
    block = torch.full((2, 8), mask_id)
    block[:, 3] = ids[:, 5]
    with torch.no_grad():
        cache = m.make_cache(2, 32)
        m.step(cache, commit_ids=ids[:, :12])
        out = m.step(cache, commit_ids=ids[:, 12:20], denoise_ids=block)
        full = torch.cat([ids, block], 1)
        L = full.shape[1]
        allowed = torch.tril(torch.ones(L, L, dtype=torch.bool))
        allowed[20:, 20:] = True
        x = m.model.embed_tokens(full)
        rope = m.model.rotary_emb(torch.arange(L).expand(2, L), x.dtype)
        from clover.models.layers import Segments

        h, _ = m._layers(x, rope, Segments(commit_len=L), mask=allowed[None, None])
        ref = m._logits(h)
    torch.testing.assert_close(out.denoise_logits, ref[:, 20:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out.commit_logits, ref[:, 19], atol=1e-4, rtol=1e-4)


def test_block_diffusion_training_forward_matches_step(llm):
    m, mask_id = llm.model, llm.config.mask_token_id
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(2))
    noisy = ids.clone()
    noisy[:, 9:14] = mask_id
    with torch.no_grad():
        clean_logits, noisy_logits = m.forward_block_diffusion(ids, noisy, 8)
        torch.testing.assert_close(clean_logits, m(ids), atol=1e-4, rtol=1e-4)
        cache = m.make_cache(1, 16)
        out = m.step(cache, commit_ids=ids[:, :8], denoise_ids=noisy[:, 8:])
    torch.testing.assert_close(noisy_logits[:, 8:], out.denoise_logits, atol=1e-4, rtol=1e-4)


def test_batch_equals_one_by_one_in_every_mode(llm):
    prompts = [[5, 6, 7], list(range(60, 80)), [100] * 9]
    for mode in ("ar", "diffusion", "speculative"):
        kw = dict(mode=mode, max_new_tokens=16, ignore_eos=True)
        if mode != "ar":
            kw["block_size"] = 8
        batch = llm.generate(prompts, **kw)
        for p, b in zip(prompts, batch):
            assert llm.generate(p, **kw).token_ids == b.token_ids, mode


@pytest.mark.parametrize("seed", [0, 1])
def test_speculative_equals_ar_greedy(tmp_path, seed):
    d = build_tiny_checkpoint(tmp_path / "m", seed=seed, init_std=0.2, dense=True, backbone="llama")
    llm = clover.load(d)
    g = torch.Generator().manual_seed(seed)
    for plen, draft in ((3, 4), (17, 8)):
        prompt = torch.randint(0, 256, (plen,), generator=g).tolist()
        ar = llm.generate(prompt, mode="ar", max_new_tokens=24, ignore_eos=True)
        sp = llm.generate(prompt, mode="speculative", max_new_tokens=24, draft_length=draft, block_size=8, ignore_eos=True)
        assert sp.token_ids == ar.token_ids
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["backbone"] == "llama" and "layer_types" not in cfg
