"""The Llama backbone: commit mode against transformers' LlamaForCausalLM (GQA, RoPE theta and
scaling, tied and untied embeddings); cached == recomputed, batch == one-by-one, the denoise mode
against its uncached definition, and speculative == AR greedy."""

import json

import pytest
import torch

import clover
from clover.checkpoint import load_model
from clover.config import ConfigError
from clover.models import config_from_dict, read_config
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
    c = config_from_dict(raw)
    # Llama's own defaults (its arguments dataclass), none of the Qwen3.5 hybrid's (a quarter rotary, GDN keys)
    assert type(c).__name__ == "LlamaConfig"
    assert (c.rope_theta, c.rotary_dim, c.max_position_embeddings, c.layer_types) == (10000.0, 4, 2048, ["full_attention"] * 2)
    assert not hasattr(c, "partial_rotary_factor") and not hasattr(c, "linear_num_key_heads")
    c = config_from_dict({**raw, "rope_scaling": {"type": "llama3", **{k: v for k, v in LLAMA3.items() if k != "rope_type"}}})
    assert c.rope_scaling["rope_type"] == "llama3" and c.rope_theta == 500000.0
    c.save(tmp_path)
    again = read_config(tmp_path)
    assert again == c
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(tmp_path)
    assert hf.model_type == "llama" and hf.rope_parameters["rope_type"] == "llama3"
    with pytest.raises(ConfigError, match="rope type 'yarn'"):
        from clover.models import build_model

        build_model(config_from_dict({**raw, "rope_parameters": {"rope_type": "yarn", "factor": 2.0}}))


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


def test_denoise_adapter_acts_on_the_block_only(tmp_path):
    """With an adapter attached and trained away from zero, commit mode (AR, the verify pass) is
    unchanged, the denoise logits move, speculative stays equal to AR, and the saved checkpoint
    loads back with the adapter."""
    from clover.checkpoint import save_model
    from clover.models.llama import adapter_state_dict

    d = build_tiny_checkpoint(tmp_path / "m", seed=4, init_std=0.15, dense=True, backbone="llama")
    llm = clover.load(d)
    m, mask_id = llm.model, llm.config.mask_token_id
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    block = torch.full((1, 8), mask_id)
    with torch.no_grad():
        before = m.step(m.make_cache(1, 32), commit_ids=ids, denoise_ids=block)
        ar_before = llm.generate([5, 6, 7], mode="ar", max_new_tokens=12, ignore_eos=True).token_ids
    trainable = m.attach_denoise_adapter(rank=4, targets=("q_proj", "v_proj", "down_proj"))
    assert trainable and all(".adapters." in n or n.endswith("mask_embedding") for n in trainable)
    with torch.no_grad():
        same = m.step(m.make_cache(1, 32), commit_ids=ids, denoise_ids=block)  # B = 0: nothing changed yet
        torch.testing.assert_close(same.denoise_logits, before.denoise_logits)
        for n, p in m.named_parameters():
            if n.endswith("lora_B") or n.endswith("mask_embedding"):
                p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
        after = m.step(m.make_cache(1, 32), commit_ids=ids, denoise_ids=block)
    torch.testing.assert_close(after.commit_logits, before.commit_logits)
    assert (after.denoise_logits - before.denoise_logits).abs().max() > 1e-3
    assert float(after.denoise_logits[..., mask_id].max()) < -1e8  # the mask token is never predicted
    clean_logits, _ = m.forward_block_diffusion(ids[:, :8], block, 8)
    assert not clean_logits.requires_grad or clean_logits.grad_fn is not None
    assert llm.generate([5, 6, 7], mode="ar", max_new_tokens=12, ignore_eos=True).token_ids == ar_before
    sp = llm.generate([5, 6, 7], mode="speculative", max_new_tokens=12, ignore_eos=True, block_size=8)
    assert sp.token_ids == ar_before
    save_model(m, tmp_path / "adapted")
    back = load_model(tmp_path / "adapted")
    assert back.config.denoise_adapter == m.config.denoise_adapter
    for k, v in adapter_state_dict(m).items():
        torch.testing.assert_close(back.state_dict()[k], v)


def test_adapter_training_forward_matches_step_and_trains_the_block_only(tmp_path):
    d = build_tiny_checkpoint(tmp_path / "m", seed=5, init_std=0.15, dense=True, backbone="llama")
    m = load_model(d)
    m.attach_denoise_adapter(rank=4)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("lora_B"):
                p.add_(0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(n))))
    mask_id = m.config.mask_token_id
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(2))
    noisy = torch.cat([ids, ids], 1)
    noisy[:, 9:14] = mask_id
    noisy[:, 16 + 2 : 16 + 6] = mask_id
    need = torch.zeros_like(noisy, dtype=torch.bool)
    need[:, 8:13] = True
    clean_logits, sel = m.forward_block_diffusion(ids, noisy, 8, noisy_logits_at=need)
    with torch.no_grad():
        torch.testing.assert_close(clean_logits, m(ids), atol=1e-4, rtol=1e-4)
        for copy in range(2):
            cache = m.make_cache(2, 16)
            out = m.step(cache, commit_ids=ids[:, :8], denoise_ids=noisy[:, 16 * copy + 8 : 16 * copy + 16])
            if copy == 0:
                torch.testing.assert_close(sel.reshape(2, 5, -1), out.denoise_logits[:, :5], atol=1e-4, rtol=1e-4)
            cache = m.make_cache(2, 16)
            first = m.step(cache, denoise_ids=noisy[:, 16 * copy : 16 * copy + 8]).denoise_logits
            _, full = m.forward_block_diffusion(ids, noisy, 8)
            torch.testing.assert_close(full[:, 16 * copy : 16 * copy + 8], first, atol=1e-4, rtol=1e-4)
    sel.float().logsumexp(-1).sum().backward()
    grads = {n for n, p in m.named_parameters() if p.grad is not None}
    assert grads and all(".adapters." in n or n.endswith("mask_embedding") for n in grads)


def test_adapter_training_resumes_exactly(tmp_path):
    """A stage-2 run with `[adapter]` on a tied llama: only the adapter trains (the base weights in
    the checkpoint equal the init's), the chat self-distillation set is built, and resume is exact."""
    from clover.train.recipes import recipe_from_dict
    from clover.train.trainer import Trainer

    init = build_tiny_checkpoint(tmp_path / "init", seed=6, init_std=0.15, dense=True, backbone="llama",
                                 tie_word_embeddings=True)

    def raw(out):
        return {"name": "a", "stage": "diffusion", "seed": 1, "init": str(init),
                "data": {"tokenizer": str(init), "seq_len": 32, "batch_size": 2, "task_fraction": 0.5,
                         "cache_dir": str(tmp_path / "cache"), "max_files": 2, "distill_fraction": 0.5,
                         "distill_tasks": 4, "distill_code": 0, "distill_chat": 3, "distill_chat_tokens": 6},
                "optim": {"lr": 1e-2, "steps": 4, "warmup_steps": 1, "weight_decay": 0.0},
                "diffusion": {"block_sizes": [8], "ar_weight": 0.0},
                "adapter": {"rank": 2, "targets": ["q_proj", "v_proj", "up_proj"]},
                "run": {"out": str(out), "threads": 1, "log_every": 1, "ckpt_every_s": 0, "progress": False}}

    ref = [s["loss"] for s in Trainer(recipe_from_dict(raw(tmp_path / "full")), quiet=True).train()]
    first = Trainer(recipe_from_dict(raw(tmp_path / "b")), quiet=True)
    part = [s["loss"] for s in first.train(steps=2)]
    del first
    second = Trainer(recipe_from_dict(raw(tmp_path / "b")), quiet=True)
    part += [s["loss"] for s in second.train()]
    torch.testing.assert_close(torch.tensor(part), torch.tensor(ref), rtol=0, atol=0)
    rows = [json.loads(x) for x in (tmp_path / "b" / "distill" / "distill.jsonl").read_text().splitlines()]
    assert sum(r["kind"] == "chat" for r in rows) == 3 and all("<|im_start|>" in r["text"] for r in rows if r["kind"] == "chat")
    trained = load_model(tmp_path / "b" / "ckpt" / "step-00000004")
    base = load_model(init)
    assert trained.config.denoise_adapter["rank"] == 2
    for k, v in base.state_dict().items():
        torch.testing.assert_close(trained.state_dict()[k], v, rtol=0, atol=0)
    moved = [k for k, v in trained.state_dict().items() if k.endswith("lora_B") and v.abs().max() > 0]
    assert moved


def test_info_and_plan_tell_the_truth_for_a_llama(llm, capsys, tmp_path):
    """A Llama has no GDN, no experts and no attention output gate (`has_linear_attention`,
    `has_experts`, `has_gated_attention` False): `clover info` shows none of them (no rows of
    zeros), and the training planner's activation estimate counts a plain attention (q, k, v, the
    attention output) where the Qwen3.5 layer of the same shapes adds its gate and gated o_proj input."""
    from clover.cli import main
    from clover.models import build_model
    from clover.tiny import tiny_config
    from clover.train import plan as plan_mod
    from clover.train.recipes import recipe_from_dict

    c = llm.config
    qwen = tiny_config(dense=True)
    assert (c.has_linear_attention, c.has_experts, c.has_gated_attention) == (False, False, False)
    assert (qwen.has_linear_attention, qwen.has_experts, qwen.has_gated_attention) == (True, False, True)
    for cfg in (c, qwen):  # the capability is the model's: a gated q_proj yields q and the gate
        attn = next(layer.self_attn for layer in build_model(cfg, device="meta").model.layers if hasattr(layer, "self_attn"))
        assert attn.q_proj.out_features == (2 if cfg.has_gated_attention else 1) * cfg.num_attention_heads * cfg.head_dim

    assert main(["info", str(llm.path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["gdn"] is None and info["experts"] is None and info["gdn_layers"] == 0
    assert info["attention"]["output_gate"] is False and info["mlp_intermediate"] == c.intermediate_size
    assert main(["info", str(llm.path)]) == 0
    out = capsys.readouterr().out
    assert "GDN" not in out and "experts" not in out and "output gate" not in out
    assert f"{c.num_hidden_layers}: {c.num_hidden_layers} full attention" in out and f"dense, intermediate {c.intermediate_size}" in out

    h, i = c.hidden_size, c.intermediate_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    plain = 4 * h + 2 * q + 2 * kv + h + 3 * i  # norms in/out; q, k, v, attention output; the dense MLP
    assert plan_mod.activation_bytes_per_position(c, "full_attention", 2) == 2 * plain
    same_shapes = tiny_config(dense=True, hidden_size=h, intermediate_size=i, num_attention_heads=c.num_attention_heads,
                              num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim)
    assert plan_mod.activation_bytes_per_position(same_shapes, "full_attention", 2) == 2 * (plain + 2 * q)
    r = recipe_from_dict({"name": "llama", "stage": "ar", "init": str(llm.path), "data": {"seq_len": 64, "batch_size": 2}})
    p = plan_mod.plan(r, gpus=1, micro_batch=2)  # bf16 autocast: 2 bytes an element
    assert p.memory_gb["activations"] == pytest.approx(2 * 64 * c.num_hidden_layers * 4 * plain / 1e9)
