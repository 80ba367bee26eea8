"""Regenerate tests/golden/speculators/: a tiny random DFlash drafter in the vLLM `speculators` layout
(saved by speculators' own `save_pretrained`), the verifier weights it borrows (embedding, LM head:
speculators never stores them for a full-vocabulary drafter), and the draft logits speculators'
`DFlashDraftModel._backbone_forward` gives for fixed random target hidden states and anchors (float32).

Run it with speculators installed -- not clover's environment: in a scratch venv with torch and
transformers, `pip install speculators==0.9.0 --no-deps`, then `python scripts/speculators-golden.py`.
(Its 0.9.0 wheel imports `hs_connectors`, its training-data transport, which the forward never uses; a
stub module of that name with classes `FileTransfer` and `HiddenStatesTransfer` on the path will do.)
Eager attention (the float mask), one thread; about 170 KB. (In float64 the reference still agrees with
clover only to ~3e-7: its RMSNorms and RoPE compute in float32 whatever the model's dtype.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file
from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
from transformers import Qwen3Config

OUT = Path(__file__).resolve().parent.parent / "tests" / "golden" / "speculators"
TARGET_LAYERS = 4  # the verifier's depth; aux ids name hidden_states[i] (0: the embedding output)
DRAFT = dict(vocab_size=264, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=256,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
AUX_IDS = [1, 3]
BLOCK, MASK_ID, SEQ, ANCHORS = 4, 258, 14, 3
SEED = 4321


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.manual_seed(SEED)
    tl = Qwen3Config(**DRAFT)
    tl._attn_implementation = "eager"  # noqa: SLF001 - the reference's float-mask path (flex needs compile)
    config = DFlashSpeculatorConfig(transformer_layer_config=tl, draft_vocab_size=DRAFT["vocab_size"],
                                    block_size=BLOCK, aux_hidden_state_layer_ids=AUX_IDS, mask_token_id=MASK_ID)
    model = DFlashDraftModel(config).eval()
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            r = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.1 * r if "norm" in name else 0.1 * r)
        model.verifier_lm_head.weight.copy_(model.lm_head.weight)
    model.save_pretrained(str(args.out / "drafter"))  # float32
    (args.out / "drafter" / "config.py").unlink()  # a copy of speculators' source (auto_map); not ours to ship
    H, n = DRAFT["hidden_size"], len(AUX_IDS)
    hidden = torch.randn(1, SEQ, n * H, generator=gen)
    ids = torch.randint(0, 256, (1, SEQ), generator=gen)
    last = torch.randn(1, SEQ, H, generator=gen)  # the verifier's last layer: only its training targets read it

    torch.manual_seed(SEED + 1)  # its anchors are drawn with torch's global generator
    with torch.no_grad():
        _, logits, _, _, idx = model._backbone_forward(  # noqa: SLF001
            hidden, ids, torch.ones(1, SEQ, dtype=torch.long), last, torch.zeros(1, SEQ, dtype=torch.long),
            max_anchors=ANCHORS)
    logits, anchors = logits.reshape(ANCHORS, BLOCK, -1).contiguous(), idx.view(ANCHORS, BLOCK)[:, 0].contiguous()
    save_file({"embed_tokens.weight": model.embed_tokens.weight.detach().contiguous(),
               "lm_head.weight": model.lm_head.weight.detach().contiguous()}, str(args.out / "verifier.safetensors"))
    save_file({"hidden_states": hidden, "input_ids": ids, "anchors": anchors,
               "logits": logits},
              str(args.out / "golden.safetensors"))
    (args.out / "golden.json").write_text(json.dumps({"target_layers": TARGET_LAYERS, "seed": SEED}, indent=1) + "\n")
    print(f"wrote {args.out}: anchors {anchors.tolist()}")


if __name__ == "__main__":
    main()
