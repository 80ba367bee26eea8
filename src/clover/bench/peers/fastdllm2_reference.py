"""Fast-dLLM v2's reference decoding (`Fast_dLLM_QwenForCausalLM.generate` in its checkpoints' remote code,
`modeling.py` + `configuration.py` of Efficient-Large-Model/Fast_dLLM_v2_1.5B or _7B) from a user's
directory holding those two files, the code the `fastdllm2-reference` row of `clover bench peers` and
scripts/fastdllm2-golden.py run. Its code cannot ship with clover: this file loads it from that directory,
in an interpreter with the transformers it was saved with (4.53.1), and imports nothing of clover (the
peers worker and the golden script load it by path).

No shim: on a CPU its inference path attends through transformers' SDPA, and greedy decoding is its
`temperature=0` (the default); the flex-attention training path is never called.
"""

from __future__ import annotations

import importlib
import json
import shutil
import sys
from pathlib import Path

import torch

FILES = ("configuration.py", "modeling.py")


def check_checkout(src: Path) -> str | None:
    """Why `src` does not hold Fast-dLLM v2's remote code (one line), or None."""
    missing = [f for f in FILES if not (src / f).is_file()]
    return f"{src}: no {', '.join(missing)} (Fast-dLLM v2's remote code)" if missing else None


def load_reference(src: Path, work: Path):
    """(its configuration module, its modeling module), imported as a package (modeling.py imports
    `.configuration`)."""
    pkg = work / "fastdllm_ref"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in FILES:
        shutil.copy(src / name, pkg / name)
    sys.path.insert(0, str(work))
    return importlib.import_module("fastdllm_ref.configuration"), importlib.import_module("fastdllm_ref.modeling")


def build(configuration, modeling, raw: dict):
    """Its Fast_dLLM_QwenForCausalLM for config.json `raw` (float32, SDPA), weights as initialised."""
    cfg = configuration.Fast_dLLM_QwenConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "auto_map")})
    cfg._attn_implementation = "sdpa"
    return modeling.Fast_dLLM_QwenForCausalLM(cfg).eval()


def load(src: Path, model_dir: Path, work: Path):
    """The reference model holding `model_dir`'s weights, float32."""
    from safetensors.torch import load_file

    configuration, modeling = load_reference(src, work)
    raw = json.loads((model_dir / "config.json").read_text())
    raw["torch_dtype"] = "float32"
    model = build(configuration, modeling, raw)
    state = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        state.update(load_file(str(f)))
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=not raw.get("tie_word_embeddings"))
    return model


def generate(model, ids: list[int], max_new_tokens: int, *, block: int, sub_block: int, threshold: float, mask_id: int,
             stop_token: int) -> list[int]:
    """Its `generate` on one prompt (greedy): the tokens after the prompt, its stop token included."""
    x = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, mask_id=mask_id, threshold=threshold,
                       small_block_size=sub_block, block_size=block, stop_token=stop_token)
    return x[0, len(ids):].tolist()


def _blocks(length: int, n: int, block: int) -> int:
    """The fewest blocks `generate` must decode for `n` tokens after a prompt of `length`: it decodes
    `max_new_tokens // block` blocks of the absolute grid and the last commit's argmax after them (k blocks
    give k*block - r + 1 tokens, r the prompt's length mod block)."""
    r = length % block
    return max(1, -(-(n + r - 1) // block))


def decode(model, ids: list[int], n: int, *, block: int, steps: int, threshold: float, mask_id: int,
           sub_block: int | None = None) -> list[int]:
    """Its first `n` tokens on one prompt, greedy, with no stop (asked for the fewest blocks that give `n`)."""
    return decode_batch(model, [ids], n, block=block, steps=steps, threshold=threshold, mask_id=mask_id,
                        sub_block=sub_block)[0]


def decode_batch(model, prompts: list[list[int]], n: int, *, block: int, steps: int, threshold: float, mask_id: int,
                 sub_block: int | None = None) -> list[list[int]]:
    """Its own batch: one `generate` call on prompts of one length (its input is one [B, L] tensor, no
    padding), the rows in lockstep (a sub-block ends when every row has decoded its own; a row that is
    done waits unchanged), greedy, no stop: each row's first `n` tokens."""
    length = len(prompts[0])
    if any(len(p) != length for p in prompts):
        raise ValueError("Fast-dLLM v2's generate batches prompts of one length only")
    x = model.generate(torch.tensor(prompts), max_new_tokens=_blocks(length, n, block) * block, mask_id=mask_id,
                       threshold=threshold, small_block_size=sub_block or block, block_size=block, stop_token=-1)
    return x[:, length:length + n].tolist()
