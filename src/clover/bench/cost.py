"""`clover bench cost`: what a forward costs against the number of positions it carries.

For each variant (eager, and with `compiled=True` the model compiled), each batch size and each kind
of forward (`commit`, `denoise`, `verify`: `clover.decoding.width`), the median time of a few
forwards at 1, 2, 4, ... 64 positions after a committed prefix, interleaved by nothing but measured
one point after another (each point is a median, so short bursts of background load fall out).
The curve of each variant is merged into the user cache (`clover.decoding.width.cost_path`), where
`block_size="auto"` reads it. Reported per point: ms per forward, ms per position, and the forward's
cost in AR steps (`r`: the commit forward of 1 position at the same batch and variant). With
`expert_budget` the denoise block's tokens share that many experts (block expert sharing; the commit
part routes freely), and the curve is not cached (`block_size="auto"` reads the unshared one).
"""

from __future__ import annotations

from ..decoding.width import KINDS, POSITIONS, compiled_kind, measure_curve, save_curve
from .common import machine, shape_summary

SCHEMA = "clover.bench.cost/1"


def run_cost(llm, *, kinds=KINDS, batches=(1, 16), positions=POSITIONS, repeat: int = 5, prefix: int = 64,
             eager: bool = True, compiled: bool = False, save: bool = True, progress=None,
             expert_budget: int | None = None) -> dict:
    """Measure every (variant, kind, batch, positions); the rows and where each curve was cached."""
    for k in kinds:
        if k not in KINDS:
            raise ValueError(f"kinds: unknown kind {k!r}; choose from {', '.join(KINDS)}")
    if not eager and not compiled:
        raise ValueError("bench cost: nothing to measure (neither eager nor compiled)")
    model = llm.model
    if expert_budget is not None:
        c = model.config
        if not getattr(c, "num_experts", 0) or not (c.num_experts_per_tok <= expert_budget <= c.num_experts):
            raise ValueError(f"expert_budget: must lie in [experts per token, experts] of a mixture-of-experts model "
                             f"({getattr(c, 'num_experts_per_tok', 0)}..{getattr(c, 'num_experts', 0)}), got {expert_budget}")
        save = False
    variants = (["eager"] if eager else []) + (["compiled"] if compiled else [])
    if eager and compiled_kind(model) == "compiled":  # noqa: SIM102
        raise ValueError("bench cost: the model is already compiled; load it eager to measure both")
    rows, cached = [], {}
    for variant in variants:
        if variant == "compiled" and compiled_kind(model) != "compiled":
            from ..models.compile import compile_model

            compile_model(model)
        tell = (lambda i, n, what, v=variant: progress(f"{v}: {what} ({i}/{n})")) if progress else None
        curve = measure_curve(model, kinds=kinds, batches=batches, positions=positions, repeat=repeat,
                              prefix=prefix, progress=tell, expert_budget=expert_budget)
        if save:
            cached[variant] = str(save_curve(model, curve, variant))
        for kind in kinds:
            for b in batches:
                base = curve.seconds_by.get("commit", {}).get(b, {}).get(1)
                for p in positions:
                    s = curve.seconds_by[kind][b][p]
                    rows.append({"variant": variant, "kind": kind, "batch": b, "positions": p,
                                 "forward_positions": 2 * p if kind in ("verify", "block") else p,
                                 "ms": s * 1e3, "ms_per_position": s * 1e3 / (b * p),
                                 "ar_steps": s / base if base else None})
    return {"schema": SCHEMA, "model": str(llm.path), "shapes": shape_summary(model.config),
            "dtype": str(model.dtype).replace("torch.", ""), "machine": machine(model.device),
            "settings": {"kinds": list(kinds), "batches": list(batches), "positions": list(positions),
                         "repeat": repeat, "prefix": prefix, "variants": variants, "expert_budget": expert_budget},
            "rows": rows, "cached": cached}


def cost_table(result: dict):
    """A rich Table: one row per (variant, kind, batch), one column per position count (ms, and the
    forward in AR steps)."""
    from rich.table import Table

    s = result["settings"]
    m = result["machine"]
    sharing = "" if s.get("expert_budget") is None else f"expert budget {s['expert_budget']} · "
    t = Table(title=f"clover bench cost · {result['model']} · {result['dtype']} · {m['device']} "
                    f"({m['torch_threads']} threads, load {m.get('load_average', ['?'])[0]}) · "
                    f"{sharing}ms per forward "
                    f"(× an AR step)", title_justify="left")
    for col in ("variant", "kind", "batch", *[str(p) for p in s["positions"]]):
        t.add_column(col, justify="left" if col in ("variant", "kind") else "right")
    groups: dict = {}
    for r in result["rows"]:
        groups.setdefault((r["variant"], r["kind"], r["batch"]), {})[r["positions"]] = r
    for (variant, kind, b), pts in groups.items():
        cells = []
        for p in s["positions"]:
            r = pts[p]
            cells.append(f"{r['ms']:.1f}" + (f" ({r['ar_steps']:.1f}×)" if r["ar_steps"] is not None else ""))
        t.add_row(variant, kind, str(b), *cells)
    return t


def plot_cost(result: dict, path) -> str | None:
    """ms per forward against positions (log-log), one line per (variant, kind, batch); None (and
    one line on stderr) without matplotlib."""
    import sys
    from pathlib import Path

    try:
        import matplotlib
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)", file=sys.stderr)
        return None
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    groups: dict = {}
    for r in result["rows"]:
        groups.setdefault((r["variant"], r["kind"], r["batch"]), []).append(r)
    batches = result["settings"]["batches"]
    fig, axes = plt.subplots(1, len(batches), figsize=(4 * len(batches), 3), dpi=90, squeeze=False)
    colours = {"commit": "#4c72b0", "denoise": "#55a868", "verify": "#c44e52"}
    for ax, b in zip(axes[0], batches):
        for (variant, kind, bb), rs in groups.items():
            if bb != b:
                continue
            ax.plot([r["positions"] for r in rs], [r["ms"] for r in rs], marker="o", ms=3,
                    color=colours.get(kind), ls="-" if variant == "eager" else "--", label=f"{kind} ({variant})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("positions per row")
        ax.set_ylabel("ms per forward")
        ax.set_title(f"batch {b}", fontsize=8)
        ax.legend(fontsize=6)
    fig.suptitle(f"{Path(result['model']).name} · {result['machine']['device']} "
                 f"({result['machine']['torch_threads']} threads)", fontsize=8)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return str(out)
