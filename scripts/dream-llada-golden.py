"""Regenerate tests/golden/dream/ and tests/golden/llada/ from the families' reference code.

    python scripts/dream-llada-golden.py FAST_DLLM LLADA [--out tests/golden]

FAST_DLLM is a checkout of github.com/NVlabs/Fast-dLLM (its `dream/model/` holds Dream's
modeling_dream.py, configuration_dream.py and generation_utils.py with `diffusion_generate`; its
`llada/model/` LLaDA's modeling_llada.py and configuration_llada.py), LLADA one of
github.com/ML-GSAI/LLaDA (its generate.py: the authors' `generate`). Run it in a scratch environment
with the transformers the reference pins (4.49.0, Fast-dLLM's requirements.txt), torch and einops;
nothing of clover is imported. For each family it builds a tiny random checkpoint in the family's real
layout (the released config.json with the sizes shrunk, the real vocabulary and mask token; the
reference's own parameter names), loads it with the reference's model class and runs the reference's
decoding on it. It writes, per family, `cases.json`:

- `config`: the tiny config.json; `parameters`: every stored tensor's name and shape, in the order
  `tiny_parameters` fills them from `seed` (so the test rebuilds the same weights: no weights are
  committed);
- `logits`: one canvas (a prompt and masks) and the reference's full-sequence logits on it, as their
  first `LOGIT_COLUMNS` vocabulary columns plus each position's argmax, maximum and logsumexp;
- `cases`: per case the prompt(s), the decoding options and the tokens the reference returns after
  the prompt (the whole canvas: nothing is cut at EOS).

Shims: none. The tiny model runs in float32 on the CPU through the reference's own SDPA path
(`attn_implementation="sdpa"` for Dream; LLaDA's blocks call torch's SDPA themselves). Decoding is
greedy (temperature 0), which both references implement as the argmax (Dream's `sample_tokens`,
LLaDA's `add_gumbel_noise` returning the logits unchanged), so no random number is drawn; the
`_sampled` cases draw at temperature 0.5 (Dream: top_p 0.95) after `torch.manual_seed(7)`. LLaDA's
`generate` is given an all-ones `attention_mask` (its classifier-free guidance branch reads one and
fails without it; the prompts are not padded, so it changes nothing).
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

SEED = 0
HEAD_STD = 8.0  # the LM head's scale: peaked predictions whose confidences are well apart (tiny random weights are flat)
LOGIT_COLUMNS = 64
GEN_LENGTH = 16
PROMPTS = {"p5": [1012, 3, 77, 5120, 42], "p9": [9, 801, 14, 3, 77, 151, 26, 1190, 40]}
PROMPT_SAME_LEN = [60, 7, 840, 113, 58, 5, 17, 33, 2]  # batched with p9 (LLaDA's reference pads nothing)

# Dream-v0-Base-7B's config.json, the sizes shrunk (every other key kept)
DREAM = {
    "architectures": ["DreamModel"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151643,
    "hidden_act": "silu", "hidden_size": 32, "initializer_range": 0.02, "intermediate_size": 64,
    "mask_token_id": 151666, "max_position_embeddings": 256, "max_window_layers": 2, "model_type": "Dream",
    "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "pad_token_id": 151643,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": 256,
    "tie_word_embeddings": False, "torch_dtype": "float32", "use_cache": False, "use_sliding_window": False,
    "vocab_size": 152064,
}
DREAM_ALGS = ("entropy", "maskgit_plus", "topk_margin")
DREAM_STEPS = (16, 8, 5)  # one token per step, two, and an uneven schedule
SAMPLED = dict(temperature=0.5, seed=7)  # seeded sampling: the reference after torch.manual_seed(seed)
DREAM_TOP_P = 0.95  # Dream's README sampling setting (with its temperature 0.2: here 0.5, for more spread)

# LLaDA-8B-Instruct's config.json, the sizes shrunk (every other key kept; init_device on the CPU)
LLADA = {
    "activation_type": "silu", "alibi": False, "alibi_bias_max": 8.0, "architectures": ["LLaDAModelLM"],
    "attention_dropout": 0.0, "attention_layer_norm": False, "attention_layer_norm_with_affine": True,
    "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama", "d_model": 32,
    "embedding_dropout": 0.0, "embedding_size": 126464, "eos_token_id": 126081, "flash_attention": False,
    "include_bias": False, "include_qkv_bias": False, "init_cutoff_factor": None, "init_device": "cpu",
    "init_fn": "mitchell", "init_std": 0.02, "input_emb_norm": False, "layer_norm_type": "rms",
    "layer_norm_with_affine": True, "mask_token_id": 126336, "max_sequence_length": 256, "mlp_hidden_size": 64,
    "mlp_ratio": 4, "model_type": "llada", "multi_query_attention": None, "n_heads": 4, "n_kv_heads": 4,
    "n_layers": 2, "pad_token_id": 126081, "precision": "amp_bf16", "residual_dropout": 0.0, "rms_norm_eps": 1e-05,
    "rope": True, "rope_full_precision": True, "rope_theta": 500000.0, "scale_logits": False, "use_cache": False,
    "vocab_size": 126464, "weight_tying": False,
}
# (steps, block_length, cfg_scale): one block at one and two tokens a step, two and four semi-AR blocks,
# an uneven quota (3, 3, 2 a block), and classifier-free guidance
LLADA_SCHEDULES = ((16, 16, 0.0), (8, 16, 0.0), (16, 8, 0.0), (8, 4, 0.0), (6, 8, 0.0), (8, 8, 1.0))


def tiny_parameters(shapes: list[tuple[str, list[int]]], seed: int, head: str, mask_token_id: int) -> dict:
    """The tiny weights, drawn in the order of `shapes` from `seed`: norms 1 + 0.1 N, biases 0.1 N, the
    LM head (`head`) N * HEAD_STD / sqrt(width) with the mask token's row at zero (a trained model
    never predicts the mask), every other matrix N / sqrt(width). The test rebuilds them with this."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in shapes:
        r = torch.randn(shape, generator=gen)
        if "norm" in name:
            out[name] = 1.0 + 0.1 * r
        elif name.endswith("bias"):
            out[name] = 0.1 * r
        elif name == head:
            r = r * HEAD_STD / shape[-1] ** 0.5
            r[mask_token_id] = 0.0
            out[name] = r
        else:
            out[name] = r / shape[-1] ** 0.5
    return out


def fill(model, head: str, mask_token_id: int) -> list[tuple[str, list[int]]]:
    """Set the reference model's weights by `tiny_parameters` (names sorted) -> the names and shapes."""
    state = model.state_dict()
    shapes = [(k, list(v.shape)) for k, v in sorted(state.items())]
    values = tiny_parameters(shapes, SEED, head, mask_token_id)
    model.load_state_dict(values, strict=True)
    return shapes


def logit_summary(logits: torch.Tensor) -> dict:
    """[T, V] -> what the test compares: the first columns, and per position argmax, max, logsumexp."""
    return {"columns": logits[:, :LOGIT_COLUMNS].tolist(), "argmax": logits.argmax(-1).tolist(),
            "max": logits.max(-1).values.tolist(), "logsumexp": logits.logsumexp(-1).tolist()}


def package(src: Path, work: Path, name: str):
    """The reference's modeling folder as an importable package `name`."""
    shutil.copytree(src, work / name)
    if str(work) not in sys.path:
        sys.path.insert(0, str(work))
    return importlib.import_module(name)


def dream(fast_dllm: Path, work: Path) -> dict:
    ref = package(fast_dllm / "dream" / "model", work, "dream_ref")
    modeling = importlib.import_module("dream_ref.modeling_dream")
    config = ref.DreamConfig(**{k: v for k, v in DREAM.items() if k != "architectures"})
    config._attn_implementation = "sdpa"
    model = modeling.DreamModel(config).eval()
    shapes = fill(model, "lm_head.weight", DREAM["mask_token_id"])
    mask = DREAM["mask_token_id"]
    canvas = PROMPTS["p9"] + [mask] * 7
    with torch.no_grad():
        logits = model(torch.tensor([canvas])).logits[0]
    cases = []
    for name, prompt in PROMPTS.items():
        for alg in DREAM_ALGS:
            for steps in DREAM_STEPS:
                out = model.diffusion_generate(torch.tensor([prompt]), max_new_tokens=GEN_LENGTH, steps=steps,
                                               alg=alg, temperature=0.0, return_dict_in_generate=True)
                tokens = out.sequences[0, len(prompt):].tolist()
                cases.append({"name": f"{name}_{alg}_s{steps}", "prompts": [prompt], "alg": alg, "steps": steps,
                              "max_new_tokens": GEN_LENGTH, "tokens": [tokens]})
        for alg in ("entropy", "maskgit_plus"):
            torch.manual_seed(SAMPLED["seed"])
            out = model.diffusion_generate(torch.tensor([prompt]), max_new_tokens=GEN_LENGTH, steps=8, alg=alg,
                                           temperature=SAMPLED["temperature"], top_p=DREAM_TOP_P,
                                           return_dict_in_generate=True)
            cases.append({"name": f"{name}_{alg}_s8_sampled", "prompts": [prompt], "alg": alg, "steps": 8,
                          "max_new_tokens": GEN_LENGTH, **SAMPLED, "top_p": DREAM_TOP_P,
                          "tokens": [out.sequences[0, len(prompt):].tolist()]})
    # a batch of two prompt lengths, left-padded with the attention mask (diffusion_generate's batching)
    a, b = PROMPTS["p5"], PROMPTS["p9"]
    pad = DREAM["pad_token_id"]
    ids = torch.tensor([[pad] * (len(b) - len(a)) + a, b])
    att = torch.tensor([[0] * (len(b) - len(a)) + [1] * len(a), [1] * len(b)])
    for alg in DREAM_ALGS:
        out = model.diffusion_generate(ids, attention_mask=att, max_new_tokens=GEN_LENGTH, steps=8, alg=alg,
                                       temperature=0.0, return_dict_in_generate=True)
        cases.append({"name": f"batch_{alg}_s8", "prompts": [a, b], "alg": alg, "steps": 8,
                      "max_new_tokens": GEN_LENGTH, "tokens": out.sequences[:, len(b):].tolist()})
    return {"reference": "github.com/NVlabs/Fast-dLLM dream/model (modeling_dream.py, generation_utils.py "
                         "diffusion_generate, no cache)",
            "seed": SEED, "head": "lm_head.weight", "config": DREAM, "parameters": shapes,
            "logits": {"ids": canvas, **logit_summary(logits)}, "cases": cases}


def llada(fast_dllm: Path, llada_checkout: Path, work: Path) -> dict:
    ref = package(fast_dllm / "llada" / "model", work, "llada_ref")
    shutil.copy(llada_checkout / "generate.py", work / "llada_generate.py")
    gen = importlib.import_module("llada_generate")
    config = ref.LLaDAConfig(**{k: v for k, v in LLADA.items() if k != "model_type"})
    model = ref.LLaDAModelLM(config, init_params=True).eval()
    head = "model.transformer.ff_out.weight"
    shapes = fill(model, head, LLADA["mask_token_id"])
    mask = LLADA["mask_token_id"]
    canvas = PROMPTS["p9"] + [mask] * 7
    with torch.no_grad():
        logits = model(torch.tensor([canvas])).logits[0]
    cases = []
    for name, prompt in PROMPTS.items():
        for steps, block, cfg in LLADA_SCHEDULES:
            x = gen.generate(model, torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             steps=steps, gen_length=GEN_LENGTH, block_length=block, temperature=0.0, cfg_scale=cfg, remasking="low_confidence", mask_id=mask)
            cases.append({"name": f"{name}_s{steps}_b{block}" + (f"_cfg{cfg:g}" if cfg else ""), "prompts": [prompt],
                          "steps": steps, "gen_length": GEN_LENGTH, "block_length": block, "cfg_scale": cfg,
                          "tokens": [x[0, len(prompt):].tolist()]})
        for steps, block in ((8, 8), (8, 4)):
            torch.manual_seed(SAMPLED["seed"])
            x = gen.generate(model, torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             steps=steps, gen_length=GEN_LENGTH, block_length=block,
                             temperature=SAMPLED["temperature"], cfg_scale=0.0, remasking="low_confidence", mask_id=mask)
            cases.append({"name": f"{name}_s{steps}_b{block}_sampled", "prompts": [prompt], "steps": steps,
                          "gen_length": GEN_LENGTH, "block_length": block, "cfg_scale": 0.0, **SAMPLED,
                          "tokens": [x[0, len(prompt):].tolist()]})
    batch = [PROMPTS["p9"], PROMPT_SAME_LEN]
    for steps, block, cfg in ((8, 8, 0.0), (8, 4, 0.0)):
        x = gen.generate(model, torch.tensor(batch), attention_mask=torch.ones(2, len(batch[0]), dtype=torch.long), steps=steps, gen_length=GEN_LENGTH, block_length=block,
                         temperature=0.0, cfg_scale=cfg, remasking="low_confidence", mask_id=mask)
        cases.append({"name": f"batch_s{steps}_b{block}", "prompts": batch, "steps": steps, "gen_length": GEN_LENGTH,
                      "block_length": block, "cfg_scale": cfg, "tokens": x[:, len(batch[0]):].tolist()})
    return {"reference": "github.com/ML-GSAI/LLaDA generate.py on github.com/NVlabs/Fast-dLLM llada/model "
                         "(modeling_llada.py, no cache)",
            "seed": SEED, "head": head, "config": LLADA, "parameters": shapes,
            "logits": {"ids": canvas, **logit_summary(logits)}, "cases": cases}


def write(data: dict, out: Path) -> None:
    """cases.json with one case (and one parameter) a line: small diffs when a case changes."""
    out.mkdir(parents=True, exist_ok=True)
    head = {k: v for k, v in data.items() if k not in ("parameters", "cases", "logits")}
    lines = [f' {json.dumps(k)}: {json.dumps(v)},' for k, v in head.items()]
    lines.append(' "parameters": [\n' + ",\n".join("  " + json.dumps(p) for p in data["parameters"]) + "\n ],")
    lines.append(' "logits": {\n' + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in data["logits"].items())
                 + "\n },")
    lines.append(' "cases": [\n' + ",\n".join("  " + json.dumps(c) for c in data["cases"]) + "\n ]")
    (out / "cases.json").write_text("{\n" + "\n".join(lines) + "\n}\n")
    for c in data["cases"]:
        print(f"{out.name} {c['name']}: {c['tokens']}")


def run(build, out: Path, name: str) -> None:
    """`build(work)` -> a family's data in a scratch folder, written as `out/name/cases.json` (one
    thread, the seed set; the other families' scripts use it too)."""
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    work = Path(tempfile.mkdtemp(prefix=f"{name}-golden-"))
    try:
        write(build(work), out / name)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("fast_dllm", type=Path, help="a checkout of github.com/NVlabs/Fast-dLLM")
    ap.add_argument("llada", type=Path, help="a checkout of github.com/ML-GSAI/LLaDA")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "tests/golden")
    args = ap.parse_args()
    for need in (args.fast_dllm / "dream/model/modeling_dream.py", args.fast_dllm / "llada/model/modeling_llada.py",
                 args.llada / "generate.py"):
        if not need.exists():
            sys.exit(f"{need}: missing (see the usage line)")
    torch.set_num_threads(1)
    torch.manual_seed(SEED)
    work = Path(tempfile.mkdtemp(prefix="dream-llada-golden-"))
    try:
        write(dream(args.fast_dllm, work), args.out / "dream")
        write(llada(args.fast_dllm, args.llada, work), args.out / "llada")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
