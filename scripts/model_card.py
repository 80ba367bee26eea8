"""Write the bundled model's card (README.md next to its weights) from the recipes and eval output.

    python scripts/model_card.py src/clover/assets/clover-tiny build/figures/eval.md [NOTES_MD] [PHASE5_TEXT] [LATER_PHASE]...

PHASE5_TEXT ends phase 5's entry (its length and time); each LATER_PHASE is one more numbered entry.
"""

import json
import sys
from pathlib import Path

root = Path(__file__).resolve().parents[1]
model_dir, eval_md = Path(sys.argv[1]), Path(sys.argv[2])
cfg = json.loads((model_dir / "config.json").read_text())
size = sum(p.stat().st_size for p in model_dir.rglob("*") if p.is_file() and p.name != "README.md")
sys.path.insert(0, str(root / "src"))
from clover.config import CloverConfig  # noqa: E402

counts = CloverConfig.from_dict(cfg).parameter_counts()
notes = Path(sys.argv[3]).read_text() if len(sys.argv) > 3 else ""
PHASE5 = sys.argv[4] if len(sys.argv) > 4 else "see docs/training.md"
LATER = sys.argv[5:]
NUMBERS = ["Five", "Six", "Seven", "Eight", "Nine"]
later_md = "".join(f"{i}. {text}\n" for i, text in enumerate(LATER, start=6))
card = f"""# clover-tiny

The default model bundled with clover: a {counts['total'] / 1e6:.1f}M-parameter ({counts['active'] / 1e6:.1f}M active)
Qwen3.5-MoE-architecture model converted to a Clover block-diffusion model, trained from scratch on this
repository's CPU (2 cores). It exists so that every command runs offline on a fresh clone and so that speed
and quality figures have a trained model behind them. It is a small model: expect toy quality.

| | |
|---|---|
| architecture | {cfg['num_hidden_layers']} layers ({cfg['layer_types'].count('linear_attention')} Gated DeltaNet, {cfg['layer_types'].count('full_attention')} gated attention, 3:1), hidden {cfg['hidden_size']}, attention {cfg['num_attention_heads']}/{cfg['num_key_value_heads']} heads × {cfg['head_dim']}, GDN {cfg['linear_num_key_heads']}/{cfg['linear_num_value_heads']} heads × {cfg['linear_key_head_dim']}, {cfg['num_experts']} experts top-{cfg['num_experts_per_tok']} (moe {cfg['moe_intermediate_size']}) + shared expert {cfg['shared_expert_intermediate_size']} |
| vocabulary | {cfg['vocab_size']} (byte-level BPE, digits split, special tokens `<|endoftext|>` 0, `<|pad|>` 1, `<|mask|>` 2, ChatML) |
| diffusion defaults | block {cfg['block_size']}, threshold {cfg['threshold']} |
| stored | bfloat16 safetensors, {size / 2**20:.1f} MiB with the tokenizer (loaded in fp32 on CPU by default) |
| context used in training | 256 tokens |

## Training (recipes in `recipes/`)

- Data: the Python standard library of the training interpreter (CPython 3.11; tests, idlelib and
  generated tables excluded; 2% of files held out by a hash of the path) and seeded verifiable
  code-shaped tasks (`assert sorted([31, 7, 19]) == [7, 19, 31]`, 15 kinds; held-out by seed).

{NUMBERS[len(LATER)]} phases, each resumable, each a recipe (`clover train RECIPE`; the `init` of each is the last
checkpoint of the one before):

1. `recipes/clover-tiny-ar.toml` — AR next-token pretraining from scratch, seq 256 × batch 8, 60% task
   tokens, AdamW lr 2e-3, router load-balancing loss; 1572 steps (3.2M tokens, ~56 min, 1 core).
2. `recipes/clover-tiny-diffusion.toml` — first block-diffusion conversion (what v0 shipped after 370
   steps); continued to 640 steps (~75 min, 1 core).
3. `recipes/clover-tiny-ar-tasks.toml` — AR again on a task-heavy mix (90% task tokens; from step 593 the
   five arithmetic kinds drawn 3x as often), 2 ranks × 8 × 256, bf16 autocast, lr 1.5e-3; 1250 steps
   (5.1M tokens, ~40 min on 2 cores). AR steps cost a third of a diffusion step per token, so the skills
   are learned here.
4. `recipes/clover-tiny-diffusion-tasks.toml` — block diffusion on the same mix: clean + noisy streams,
   complementary masks (both copies behind one clean stream), block sizes {{8, 16, 32, 64}}, masked-token
   CE (shift-by-one) + 0.5 × AR loss + router loss, lr 1e-3 with a linear decay over the last 30%,
   Clover's gains clipped separately; 740 steps (3.0M tokens, ~83 min on 2 cores). This was v1.
5. `recipes/clover-tiny-diffusion-tasks-cont.toml` — stage 2 continued from v1 with a fresh optimizer
   (lr 1e-3, linear decay over the last 30%), a new data seed, the task generators of version 2 (a
   quarter of the lists hold single digits: v1 sorted none of them right) and a mix that draws the
   kinds still being learned (set_len, index: 3x; mul, double, len, reversed, slice_rev, sorted_desc,
   dict_get: 2x) instead of add/sub/sum at 3x (still near 0% after 2000+ steps); {PHASE5}.
{later_md}{notes}
## Evaluation (`clover eval`, this machine, one run)

{eval_md.read_text()}

Reproduce: `clover eval --model src/clover/assets/clover-tiny` (tables above), `scripts/ship-clover-tiny.sh`
(every figure in the docs).
"""
(model_dir / "README.md").write_text(card)
print(f"wrote {model_dir / 'README.md'}")
