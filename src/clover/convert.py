"""Turn a Qwen3.5 or Qwen3.5/3.6-MoE checkpoint into a Clover one (`clover convert SRC DST`).

Shard by shard (never the whole model in memory): keys are mapped to the text-model layout by the
architecture's key layout (`model.language_model.*` -> `model.*`; vision and MTP weights dropped),
the mask token is added (an unused id of a padded vocabulary when there is one, otherwise the
vocabulary grows by one row: embedding = mean embedding, lm_head row = 0), and Clover's new
parameters are written at their initial values (`clover.models.clover`: the config change and the
new tensors are defined there once, for checkpoints and for models in memory alike), so commit mode
is unchanged and denoise mode starts from the AR model's prefix readout.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from .config import CloverConfig
from .models import read_config
from .models import build_model
from .models.clover import clover_config, clover_parameters
from .tokenizer import MASK_TOKEN, copy_tokenizer_files
from .weights import INDEX_FILE, CheckpointError, iter_tensors, shard_files, write_safetensors

EXTRA_SHARD = "model-clover-extra.safetensors"


def convert_to_clover(
    src: str | Path,
    dst: str | Path,
    *,
    block_size: int = 32,
    threshold: float = 0.95,
    progress: bool = True,
) -> CloverConfig:
    from tqdm import tqdm
    from transformers import PreTrainedTokenizerFast

    src, dst = Path(src), Path(dst)
    config = read_config(src)
    if config.is_clover:
        raise ValueError(f"{src} is already a Clover checkpoint (model_type 'clover'); nothing to convert")
    if src.resolve() == dst.resolve():
        raise ValueError("destination must differ from the source directory")
    if not (src / "tokenizer.json").exists():
        raise CheckpointError(f"{src}: no tokenizer.json; the mask token has to be added to the tokenizer")
    dst.mkdir(parents=True, exist_ok=True)
    tok = PreTrainedTokenizerFast.from_pretrained(str(src), local_files_only=True)

    # -- the mask token
    grow = 0
    vocab = tok.get_vocab()
    if MASK_TOKEN in vocab:
        mask_id = vocab[MASK_TOKEN]
    else:
        mask_id = len(tok)
        tok.add_special_tokens({"mask_token": MASK_TOKEN})
        if mask_id >= config.vocab_size:
            grow = mask_id + 1 - config.vocab_size
    if tok.mask_token is None:
        tok.mask_token = MASK_TOKEN
    new_config = clover_config(config, mask_id, vocab_size=config.vocab_size + grow, block_size=block_size, threshold=threshold)
    layout = build_model(config, device="meta").key_layout

    # -- weights, shard by shard
    weight_map: dict[str, str] = {}
    total = 0
    shards = shard_files(src)
    for path in tqdm(shards, desc="convert", unit="shard", disable=not progress):
        out: dict[str, torch.Tensor] = {}
        for key, t in iter_tensors(path, None):
            name = layout.name(key)
            if name is None:
                continue
            if grow and name in ("model.embed_tokens.weight", "lm_head.weight"):
                extra = t.float().mean(0, keepdim=True) if name.startswith("model.embed") else torch.zeros(1, t.shape[1])
                t = torch.cat([t, extra.to(t.dtype).expand(grow, -1)], dim=0)
            out[name] = t.contiguous()
        fname = path.name if len(shards) > 1 else "model.safetensors"
        write_safetensors(out, dst / fname, metadata={"format": "pt"})
        weight_map.update({k: fname for k in out})
        total += sum(t.numel() * t.element_size() for t in out.values())
    dtype = next(iter(out.values())).dtype if out else torch.float32
    extra = clover_parameters(new_config, dtype)
    write_safetensors(extra, dst / EXTRA_SHARD, metadata={"format": "pt"})
    weight_map.update({k: EXTRA_SHARD for k in extra})
    total += sum(t.numel() * t.element_size() for t in extra.values())
    (dst / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    new_config.save(dst)
    copy_tokenizer_files(src, dst, overwrite=False)
    if (src / "generation_config.json").exists() and not (dst / "generation_config.json").exists():
        shutil.copy(src / "generation_config.json", dst / "generation_config.json")
    tok.save_pretrained(str(dst))
    return new_config
