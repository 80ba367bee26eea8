"""Regenerate tests/golden/rnd1/ from RND1's reference code.

    python scripts/rnd1-golden.py RND1 [--out tests/golden]

RND1 is a checkout of github.com/RadicalNumerics/RND1 (its `rnd/`: configuration_rnd.py, modeling_rnd.py,
generation_utils.py, sampling.py with `diffusion_sample`). Run it in a scratch environment with a
transformers that has Qwen3-MoE (4.57.1 here), torch and accelerate; nothing of clover is imported
(the weights come from `tiny_parameters` of scripts/dream-llada-golden.py, read as a file). It builds
a tiny random checkpoint in RND1's layout (Qwen3-MoE's names and keys, the real vocabulary and mask
token), loads it with the reference's `RND1LM` and decodes with its `generate` (greedy, as its demo
at temperature 0), writing `cases.json` as the Dream/LLaDA script does: `config`, `parameters`
(names and shapes in `tiny_parameters` order from `seed`), `logits` (one canvas's full-sequence
logits, summarised) and `cases` (prompt, `max_new_tokens`, `num_diffusion_steps`, the tokens after
the prompt, the canvas's reserved last position included).

Shims: the package's `__init__` is emptied (it imports the terminal visualizer, which needs `rich`);
`RND1Config.__init__` overwrites every size with Qwen3-30B-A3B's (`set_config_defaults`), so the
tiny sizes are set again on the config after it is built. The model runs in float32 on the CPU through
the reference's "hf" MoE backend and SDPA attention.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import shutil
import sys
import tempfile
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
STEPS = (16, 8, 5, 3)  # one token a step, two, uneven, and fewer steps than the masks fill evenly
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
    torch.manual_seed(common.SEED)
    model = modeling.RND1LM(config).eval()
    shapes = common.fill(model, "lm_head.weight", RND1["mask_token_id"])
    mask = RND1["mask_token_id"]
    canvas = PROMPTS["p9"] + [mask] * 7
    with torch.no_grad():
        logits = model(torch.tensor([canvas])).logits[0]
    cases = []
    for name, prompt in PROMPTS.items():
        for steps in STEPS:
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("rnd1", type=Path, help="a checkout of github.com/RadicalNumerics/RND1")
    ap.add_argument("--out", type=Path, default=HERE.parent / "tests/golden")
    args = ap.parse_args()
    if not (args.rnd1 / "rnd/sampling.py").exists():
        sys.exit(f"{args.rnd1 / 'rnd/sampling.py'}: missing (see the usage line)")
    torch.set_num_threads(1)
    work = Path(tempfile.mkdtemp(prefix="rnd1-golden-"))
    try:
        common.write(rnd1(args.rnd1, work), args.out / "rnd1")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
