"""What the DFlash peers run on a transformers target outside clover's own code: `set_mask_row` (also
called in-process by the transformers-dflash row), and, run as a script in an interpreter with z-lab's
`dflash` package, the z-lab worker (`zlab_dflash.ZlabRunner`):

    python dflash_worker.py TARGET_DIR DRAFTER_DIR DTYPE THREADS WITH_D2T

It imports nothing from clover (that interpreter need not have it): torch, safetensors, transformers
and `dflash` only. Requests on stdin, one JSON object a line ({"ids", "n", "stop"}); answers on stdout
lines starting with `MARK` (`base.WORKER_MARK`): first {"ready": true}, then per request the seconds of
the `dflash_generate` call, its tokens and its acceptance lengths."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

MARK = "CLOVER_PEERS "
MASK_FILE = "mask-embedding.safetensors"  # beside the target: the vector its mask token is embedded with


def set_mask_row(model, directory) -> None:
    """Untie `model`'s (a transformers model's) head from its input embedding and set the mask
    token's input row to `directory`'s `MASK_FILE` vector (a no-op without the file): the drafter
    reads that row for a block's masks; the head, and so AR, is unchanged."""
    from safetensors import safe_open

    path = Path(directory) / MASK_FILE
    if not path.is_file():
        return
    with safe_open(str(path), "pt") as f:
        vec, mask_id = f.get_tensor("embedding"), int(f.metadata()["mask_token_id"])
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    if head is not None and head.weight is emb.weight:
        head.weight = torch.nn.Parameter(emb.weight.detach().clone(), requires_grad=False)
    with torch.no_grad():
        emb.weight[mask_id] = vec.to(emb.weight.dtype)


def _restrict_to_d2t(draft, draft_dir: str) -> None:
    """The drafter's `compute_logits` scores only its own draft vocabulary (`d2t`), as clover's does."""
    from safetensors import safe_open

    with safe_open(str(Path(draft_dir) / "model.safetensors"), "pt") as f:
        d2t = f.get_tensor("d2t")
    keep = torch.arange(d2t.numel()) + d2t
    plain = draft.compute_logits

    def compute_logits(hidden, head):
        logits = plain(hidden, head)
        out = torch.full_like(logits, float("-inf"))
        out[..., keep] = logits[..., keep]
        return out

    draft.compute_logits = compute_logits


def main(argv: list[str]) -> None:
    import dflash.model
    from dflash.model import DFlashDraftModel, dflash_generate
    from transformers import AutoModelForCausalLM

    target_dir, draft_dir, dtype, threads, with_d2t = argv[0], argv[1], argv[2], int(argv[3]), argv[4] == "1"
    dflash.model._cuda_time = time.perf_counter  # its stats clock synchronises CUDA; on the CPU a plain clock
    torch.set_num_threads(threads)
    dt = getattr(torch, dtype)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dt).eval()
    set_mask_row(target, target_dir)
    draft = DFlashDraftModel.from_pretrained(draft_dir, dtype=dt).eval()
    if with_d2t:
        _restrict_to_d2t(draft, draft_dir)
    print(MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        x = torch.tensor([req["ids"]])
        with torch.inference_mode():
            t0 = time.perf_counter()
            r = dflash_generate(draft, target, x, req["n"], req["stop"], temperature=0.0, return_stats=True)
            s = time.perf_counter() - t0
        out = r.output_ids[0, x.shape[1]:].tolist()
        print(MARK + json.dumps({"seconds": s, "token_ids": out, "accepts": [int(a) for a in r.acceptance_lengths]}),
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
