"""Regenerate tests/golden/rnd1/ and tests/golden/llada_moe/ from the two MoE whole-sequence families'
reference code (each in its own scratch environment).

    python scripts/rnd1-llada-moe-golden.py rnd1 RND1 [--out tests/golden]
    python scripts/rnd1-llada-moe-golden.py llada_moe MODELING LLADA [--out tests/golden]

RND1 is a checkout of github.com/RadicalNumerics/RND1 (its `rnd/`: configuration_rnd.py, modeling_rnd.py,
generation_utils.py, sampling.py with `diffusion_sample`), run with a transformers that has Qwen3-MoE
(4.57.1 here). MODELING is a folder holding LLaDA-MoE's modeling_lladamoe.py and
configuration_lladamoe.py (the remote code of inclusionAI/LLaDA-MoE-7B-A1B-*, as github.com/ZHZisZZ/dllm
keeps it in `dllm/pipelines/llada/models/`), LLADA a checkout of github.com/ML-GSAI/LLaDA (its
generate.py: the authors' `generate`, which LLaDA-MoE's README uses with mask id 156895), run with
transformers 4.49.0. Nothing of clover is imported (the weights come from `tiny_parameters` of
scripts/dream-llada-golden.py, read as a file). Each builds a tiny random checkpoint in the family's
layout (its config.json keys, the real mask token; RND1 the real vocabulary), loads it with the
reference's model class and decodes greedily with the reference's own decoding (RND1: `generate` as
its demo at temperature 0; LLaDA-MoE: `generate`, low-confidence remasking), writing `cases.json` as the
Dream/LLaDA script does: `config`, `parameters` (names and shapes in `tiny_parameters` order from
`seed`), `logits` (one canvas's full-sequence logits, summarised) and `cases` (prompt, options, the
tokens after the prompt; RND1's include the canvas's reserved last position).

Shims: RND1's package `__init__` is emptied (it imports the terminal visualizer, which needs `rich`),
and the tiny sizes are set again on its config after `RND1Config.__init__` (which overwrites every size
with Qwen3-30B-A3B's, `set_config_defaults`); LLaDA-MoE's two files are imported as a package
(`modeling_lladamoe.py` imports its config relatively). Both run in float32 on the CPU (RND1's "hf"
MoE backend, SDPA attention).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import shutil
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("dream_llada_golden", HERE / "dream-llada-golden.py")
common = importlib.util.module_from_spec(spec)
spec.loader.exec_module(common)

# RND1-Base's config.json keys (configuration_rnd.py's CONFIG_DEFAULTS, Qwen3-30B-A3B's) with the sizes shrunk
RND1 = {
    "architectures": ["RND1LM"], "model_type": "rnd1", "attention_bias": False, "attention_dropout": 0.0,
    "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 8, "hidden_act": "silu", "hidden_size": 32,
    "initializer_range": 0.02, "intermediate_size": 64, "max_position_embeddings": 256, "max_window_layers": 2,
    "mlp_only_layers": [], "moe_intermediate_size": 16, "norm_topk_prob": True, "num_attention_heads": 4,
    "num_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 2, "num_key_value_heads": 2,
    "output_router_logits": False, "pad_token_id": 151643, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "float32", "use_cache": False, "use_sliding_window": False, "vocab_size": 151936,
    "mask_token_id": 151669, "moe_backend": "hf", "num_diffusion_steps": 256,
}
GEN_LENGTH = 16
RND1_STEPS = (16, 8, 5, 3)  # one token a step, two, uneven, and fewer steps than the masks fill evenly
PROMPTS = common.PROMPTS


def rnd1(checkout: Path, work: Path) -> dict:
    shutil.copytree(checkout / "rnd", work / "rnd")
    (work / "rnd" / "__init__.py").write_text("")  # the shim: its __init__ imports the rich-based visualizer
    sys.path.insert(0, str(work))
    ref = importlib.import_module("rnd.configuration_rnd")
    modeling = importlib.import_module("rnd.modeling_rnd")
    gen = importlib.import_module("rnd.generation_config")
    keys = {k: v for k, v in RND1.items() if k not in ("architectures", "model_type")}
    config = ref.RND1Config(**keys)
    for k, v in keys.items():  # the shim: set_config_defaults put Qwen3-30B-A3B's sizes back
        setattr(config, k, v)
    config._attn_implementation = "sdpa"
    model = modeling.RND1LM(config).eval()
    shapes = common.fill(model, "lm_head.weight", RND1["mask_token_id"])
    mask = RND1["mask_token_id"]
    canvas = PROMPTS["p9"] + [mask] * 7
    with torch.no_grad():
        logits = model(torch.tensor([canvas])).logits[0]
    cases = []
    for name, prompt in PROMPTS.items():
        for steps in RND1_STEPS:
            cfg = gen.RND1GenerationConfig(max_new_tokens=GEN_LENGTH, num_diffusion_steps=steps, mask_token_id=mask,
                                           temperature=0.0, greedy=True, eos_token_id=RND1["eos_token_id"],
                                           pad_token_id=RND1["pad_token_id"], bos_token_id=None)
            out = model.generate(inputs=torch.tensor([prompt]), generation_config=cfg)
            cases.append({"name": f"{name}_s{steps}", "prompts": [prompt], "steps": steps, "max_new_tokens": GEN_LENGTH,
                          "tokens": [out[0, len(prompt):].tolist()]})
    return {"reference": "github.com/RadicalNumerics/RND1 rnd/ (modeling_rnd.py RND1LM, generation_utils.py generate, "
                         "sampling.py diffusion_sample; greedy)",
            "seed": common.SEED, "head": "lm_head.weight", "config": RND1, "parameters": shapes,
            "logits": {"ids": canvas, **common.logit_summary(logits)}, "cases": cases}


# LLaDA-MoE-7B-A1B's config.json keys (configuration_lladamoe.py's), the sizes shrunk
LLADA_MOE = {
    "architectures": ["LLaDAMoEModelLM"], "model_type": "llada", "attention_bias": False, "attention_dropout": 0.0,
    "clip_qkv": None, "dense_intermediate_size": 64, "eos_token_id": 156892, "expert_intermediate_size": 16,
    "hidden_act": "silu", "hidden_size": 32, "initializer_range": 0.02, "max_position_embeddings": 256,
    "moe_layer_freq": [1, 1], "moe_router_enable_expert_bias": False, "moe_router_score_function": "softmax",
    "norm_topk_prob": False, "num_attention_heads": 4, "num_experts": 8, "num_experts_per_tok": 2,
    "num_hidden_layers": 2, "num_key_value_heads": 4, "output_router_logits": False, "pad_token_id": 156892,
    "partial_rotary_factor": 1, "qk_layernorm": True, "rms_norm_eps": 1e-05, "rope_scaling": None,
    "rope_theta": 50000.0, "routed_scaling_factor": 1, "router_aux_loss_coef": 0.01,
    "shared_expert_intermediate_size": None, "tie_word_embeddings": False, "torch_dtype": "float32",
    "use_cache": False, "vocab_size": 157184, "mask_token_id": 156895,
}
LLADA_MOE_SCHEDULES = ((16, 16), (8, 16), (16, 8), (8, 4))  # (steps, block_length) over 16 generated tokens


def llada_moe(modeling: Path, llada: Path, work: Path) -> dict:
    (work / "lladamoe_ref").mkdir()
    for name in ("modeling_lladamoe.py", "configuration_lladamoe.py"):
        shutil.copy(modeling / name, work / "lladamoe_ref" / name)
    (work / "lladamoe_ref" / "__init__.py").write_text("")
    shutil.copy(llada / "generate.py", work / "llada_generate.py")
    sys.path.insert(0, str(work))
    config_mod = importlib.import_module("lladamoe_ref.configuration_lladamoe")
    modeling_mod = importlib.import_module("lladamoe_ref.modeling_lladamoe")
    gen = importlib.import_module("llada_generate")
    config = config_mod.LLaDAMoEConfig(**{k: v for k, v in LLADA_MOE.items() if k not in ("architectures", "model_type")})
    config._attn_implementation = "sdpa"
    model = modeling_mod.LLaDAMoEModelLM(config).eval()
    mask = LLADA_MOE["mask_token_id"]
    shapes = common.fill(model, "lm_head.weight", mask)
    canvas = PROMPTS["p9"] + [mask] * 7
    with torch.no_grad():
        logits = model(torch.tensor([canvas])).logits[0]
    cases = []
    for name, prompt in PROMPTS.items():
        for steps, block in LLADA_MOE_SCHEDULES:
            x = gen.generate(model, torch.tensor([prompt]), steps=steps, gen_length=GEN_LENGTH, block_length=block,
                             temperature=0.0, cfg_scale=0.0, remasking="low_confidence", mask_id=mask)
            cases.append({"name": f"{name}_s{steps}_b{block}", "prompts": [prompt], "steps": steps,
                          "gen_length": GEN_LENGTH, "block_length": block, "cfg_scale": 0.0,
                          "tokens": [x[0, len(prompt):].tolist()]})
    return {"reference": "inclusionAI LLaDA-MoE remote code (modeling_lladamoe.py, as github.com/ZHZisZZ/dllm keeps it) "
                         "with github.com/ML-GSAI/LLaDA generate.py",
            "seed": common.SEED, "head": "lm_head.weight", "config": LLADA_MOE, "parameters": shapes,
            "logits": {"ids": canvas, **common.logit_summary(logits)}, "cases": cases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("family", choices=("rnd1", "llada_moe"))
    ap.add_argument("sources", type=Path, nargs="+", help="rnd1: RND1; llada_moe: MODELING LLADA (see the usage lines)")
    ap.add_argument("--out", type=Path, default=HERE.parent / "tests/golden")
    args = ap.parse_args()
    need = {"rnd1": ("rnd/sampling.py",), "llada_moe": ("modeling_lladamoe.py", "generate.py")}[args.family]
    if len(args.sources) != len(need):
        sys.exit(f"{args.family}: expected {len(need)} folder(s) (see the usage lines)")
    for folder, name in zip(args.sources, need):
        if not (folder / name).exists():
            sys.exit(f"{folder / name}: missing (see the usage lines)")
    build = rnd1 if args.family == "rnd1" else llada_moe
    common.run(lambda work: build(*args.sources, work), args.out, args.family)


if __name__ == "__main__":
    main()
