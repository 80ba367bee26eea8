"""Fast-dLLM v2: clover over its reference `generate` at batch 1, against the multiply-add bound of an exact forward.

    python scripts/fastdllm2-bound.py [--figures docs/img/fastdllm2-bound.json] [--out docs/img/fastdllm2-bound.png]

The reference caches the prefix and runs the forwards clover runs (a block's first token is the commit's
argmax, so every block costs its denoising steps and one commit-only forward in both). What clover may skip
and still give the reference's logits is bounded: every block position's K/V at every layer is read by the
others (the block attends bidirectionally), so only the last layer's queries, output projection and MLP
and the LM head outside the positions a step reads can go. Per forward of 32 block positions:

- the reference computes every layer and the LM head at all 32;
- clover computes the first L-1 layers at all 32, the last layer's K/V at all 32, and its queries,
  output projection, MLP and the LM head only where logits are read: a sub-block of 8 at most in a
  denoising step (fewer as it fills), one position in a commit.

The bound is the ratio of the two multiply-add counts (projections, MLP and head; attention's score and
value products, which both compute, are left out: they are small at these lengths). Batching saves no
multiply-add (the rows' forwards are the same), so the bound is the same at any batch size.

The measured figures (the JSON: each model's config and the ratios of one interleaved `clover bench
peers` run, see docs/experiments.md; `packing`: clover ran on its packed weights, as `clover.load` does
from 256 MiB of large weights, and `*_packed`: a second run with `--pack on`) are drawn over the bound for
those models and for the released checkpoints' shapes (their config.json: Fast_dLLM_v2_1.5B is
Qwen2.5-1.5B, _7B Qwen2.5-7B). Packed weights make clover's GEMMs faster than the reference's MKL calls
at any row count, a gain the multiply-add bound does not count.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from clover.models.shapes import FIELDS

HERE = Path(__file__).resolve().parent
BLOCK = 32

# the released checkpoints' shapes (the 1.5B's from `clover.models.shapes`, the 7B's from its config.json)
RELEASED = {
    "Fast_dLLM_v2_1.5B": FIELDS["fast-dllm-v2-1.5b"],
    "Fast_dLLM_v2_7B": dict(hidden_size=3584, num_hidden_layers=28, intermediate_size=18944, num_attention_heads=28,
                            num_key_value_heads=4, vocab_size=152064),
}


def per_position(c: dict) -> tuple[int, int, int]:
    """Multiply-adds of one position through one layer: (K/V projections, the rest: q, o, MLP), and the LM head."""
    h = c["hidden_size"]
    d = h // c["num_attention_heads"]
    kv = 2 * h * c["num_key_value_heads"] * d
    rest = 2 * h * h + 3 * h * c["intermediate_size"]
    return kv, rest, h * c["vocab_size"]


def macs(c: dict, read: int | None) -> int:
    """Multiply-adds of one forward over a block of `BLOCK` positions: everything at every position
    (`read` None: the reference), or the last layer's queries/MLP and the head only at `read` positions."""
    kv, rest, head = per_position(c)
    L = c["num_hidden_layers"]
    if read is None:
        return BLOCK * (L * (kv + rest) + head)
    return BLOCK * ((L - 1) * (kv + rest) + kv) + read * (rest + head)


def bound(c: dict, read: int) -> float:
    return macs(c, None) / macs(c, read)


def label(c: dict) -> str:
    return f"h{c['hidden_size']}·{c['num_hidden_layers']}L·v{c['vocab_size'] // 1000 or c['vocab_size']}k"


def plot(figures: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    models = [(m["name"], m["config"], m) for m in figures["models"]] + [(k, v, None) for k, v in RELEASED.items()]
    models.sort(key=lambda t: macs(t[1], None))
    x = list(range(len(models)))
    fig, ax = plt.subplots(figsize=(6.4, 3.4), dpi=100)
    sub = figures.get("sub_block", 8)
    hi = [bound(c, 1) for _, c, _ in models]
    lo = [bound(c, sub) for _, c, _ in models]
    ax.bar(x, [h - 1 for h in hi], bottom=1, width=0.55, color="#dddddd", label="bound, 1 position read (commit)")
    ax.bar(x, [v - 1 for v in lo], bottom=1, width=0.55, color="#a9c4e4", label=f"bound, sub-block of {sub} read")
    for key, dx, mark, colour, text in (("b1_wall", -0.15, "o", "#c44e52", "measured, batch 1 (wall)"),
                                        ("b1_cpu", -0.05, "s", "#55a868", "measured, batch 1 (CPU s)"),
                                        ("b1_cpu_packed", 0.05, "D", "#dd8452", "measured, batch 1, packed weights (CPU s)"),
                                        ("b8_lockstep_cpu", 0.15, "^", "#8172b2", "measured, batch 8 vs its own batch (CPU s)")):
        pts = [(i + dx, m[key]) for i, (_, _, m) in enumerate(models) if m and m.get(key)]
        if pts:
            ax.scatter(*zip(*pts), marker=mark, color=colour, zorder=3, s=30, label=text)
    ax.axhline(2.0, color="#444444", lw=0.8, ls="--")
    ax.text(-0.4, 2.02, "issue 48's 2×", ha="left", va="bottom", fontsize=7)
    ax.axhline(1.0, color="#444444", lw=0.6)
    ax.set_xticks(x, [name if m is None else label(c) + ("\n(packed)" if m.get("packing") else "") for name, c, m in models],
                  fontsize=7)
    ax.set_ylabel("clover ÷ reference", fontsize=8)
    ax.set_ylim(0.6, 2.3)
    ax.tick_params(axis="y", labelsize=7)
    ax.set_title("Fast-dLLM v2: clover over its reference generate, exact tokens, 1 thread", fontsize=8.5)
    ax.legend(fontsize=6.5, loc="upper right", frameon=True, facecolor="white", edgecolor="none", framealpha=1)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--figures", type=Path, default=HERE.parent / "docs" / "img" / "fastdllm2-bound.json",
                    help="the measured figures (default: docs/img/fastdllm2-bound.json)")
    ap.add_argument("--out", type=Path, default=HERE.parent / "docs" / "img" / "fastdllm2-bound.png",
                    help="the plot (default: docs/img/fastdllm2-bound.png)")
    args = ap.parse_args()
    figures = json.loads(args.figures.read_text())
    sub = figures.get("sub_block", 8)
    rows = [(m["name"], m["config"]) for m in figures["models"]] + list(RELEASED.items())
    print(f"{'model':<28} {'reference MACs':>15} {'clover MACs (' + str(sub) + ' read)':>22} {'bound':>6} {'(1 read)':>8}")
    for name, c in rows:
        print(f"{name:<28} {macs(c, None) / 1e6:>13,.0f}M {macs(c, sub) / 1e6:>20,.0f}M {bound(c, sub):>6.2f} {bound(c, 1):>8.2f}")
    plot(figures, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
