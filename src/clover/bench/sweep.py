"""`clover bench sweep`: how diffusion decoding trades speed for quality.

One-dimensional sweeps over the same held-out prompts, interleaved per prompt like `decode`:
the confidence threshold at the default block size, the block size at the default threshold and,
when asked, the confidence measure (max probability, margin, entropy) at both defaults, plus the AR
baseline, and the acceptance policies asked for (`--policies`). Each configuration reports tokens/forward, tokens/s and quality (exact match
on tasks; parse rate and edit similarity on code); `plot_sweep` draws the speed/quality curves.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable

from ..decoding.sampling import CONFIDENCE_KINDS, LIMITS
from .common import machine, max_rss_bytes
from .decode import Workload, interleaved, summarize

SCHEMA = "clover.bench.sweep/1"
DEFAULT_THRESHOLDS = (0.5, 0.7, 0.8, 0.9, 0.95, 0.99)
DEFAULT_BLOCK_SIZES = (4, 8, 16, 32, 64)
DEFAULT_CONFIDENCE = "prob"


POLICY_PARAM = {"threshold": "threshold", "factor": "factor", "hierarchy": "low_threshold", "entropy": "entropy_budget"}


def parse_policy(spec: str) -> dict:
    """`POLICY[:VALUE][/subN][/leftmost]` -> decoding options, e.g. `factor:1`, `entropy:0.5/sub8`,
    `threshold/leftmost`; VALUE sets the rule's own parameter (threshold, factor, low_threshold,
    entropy_budget)."""
    from ..decoding.sampling import SamplingParams

    head, *mods = spec.split("/")
    name, _, value = head.partition(":")
    if name not in POLICY_PARAM:
        raise ValueError(f"policies: unknown policy {name!r} in {spec!r}; choose from {', '.join(POLICY_PARAM)}")
    kw: dict = {"policy": name}
    if value:
        try:
            kw[POLICY_PARAM[name]] = float(value)
        except ValueError:
            raise ValueError(f"policies: {spec!r}: {value!r} is not a number") from None
    for m in mods:
        if m == "leftmost":
            kw["fallback"] = "leftmost"
        elif m.startswith("sub") and m[3:].isdigit():
            kw["sub_block"] = int(m[3:])
        else:
            raise ValueError(f"policies: {spec!r}: unknown modifier {m!r} (use subN or leftmost)")
    SamplingParams.from_kwargs(**kw)  # the options' own limits
    return kw


def configurations(thresholds: Iterable[float], block_sizes: Iterable[int], block_size: int, threshold: float,
                   confidences: Iterable[str] = (), policies: Iterable[str] = ()) -> list[dict]:
    """AR, then threshold sweep (at `block_size`), block sweep (at `threshold`), then the other
    confidence measures at both; every other point uses max probability. The point two sweeps share
    is measured once."""
    out = [{"label": "ar", "mode": "ar", "block_size": None, "threshold": None, "sweep": "baseline"}]
    seen = set()
    for t in thresholds:
        LIMITS["threshold"].check("thresholds", t)
        out.append({"label": f"B{block_size}/t{t:g}", "mode": "diffusion", "block_size": block_size, "threshold": t, "sweep": "threshold"})
        seen.add((block_size, t))
    for b in block_sizes:
        LIMITS["block_size"].check("block sizes", b)
        if (b, threshold) in seen:
            for c in out:
                if c["block_size"] == b and c["threshold"] == threshold:
                    c["sweep"] = "both"
            continue
        out.append({"label": f"B{b}/t{threshold:g}", "mode": "diffusion", "block_size": b, "threshold": threshold, "sweep": "block"})
    for c in dict.fromkeys(confidences):
        if c not in CONFIDENCE_KINDS:
            raise ValueError(f"confidences: must be among {', '.join(CONFIDENCE_KINDS)}, got {c!r}")
        if c != DEFAULT_CONFIDENCE:
            out.append({"label": f"B{block_size}/t{threshold:g}/{c}", "mode": "diffusion", "block_size": block_size,
                        "threshold": threshold, "confidence": c, "sweep": "confidence"})
    for spec in dict.fromkeys(policies):
        kw = parse_policy(spec)
        t = kw.pop("threshold", threshold)
        out.append({"label": f"B{block_size}/{spec}", "mode": "diffusion", "block_size": block_size,
                    "threshold": t, "options": kw, "sweep": "policy"})
    return out


def run_sweep(llm, work: Workload = Workload(), *, thresholds: Iterable[float] = DEFAULT_THRESHOLDS,
              block_sizes: Iterable[int] = DEFAULT_BLOCK_SIZES, block_size: int | None = None,
              threshold: float | None = None, confidences: Iterable[str] = (), policies: Iterable[str] = (),
              progress: Callable[[str], None] | None = None, model_note: str | None = None) -> dict:
    if llm.config.mask_token_id is None:
        raise ValueError("this is a plain AR checkpoint (no mask token): there is no diffusion mode to sweep")
    block_size = block_size or llm.config.block_size
    threshold = threshold or llm.config.threshold
    if not llm.mode_available("diffusion"):
        raise ValueError(llm.mode("diffusion").refusal(llm.config))
    configs = configurations(thresholds, block_sizes, block_size, threshold, confidences, policies)
    configs = [c for c in configs if llm.mode_available(c["mode"])]  # SDAR, LLaDA2: no AR baseline
    items = work.load()

    def kwargs(c: dict) -> dict:
        kw = work.kwargs(c["block_size"], c["threshold"])
        if "confidence" in c:
            kw = dict(kw, confidence=c["confidence"])
        return dict(kw, **c.get("options", {}))

    # warm-up: one short generation per distinct block size (and AR)
    runs = interleaved(llm, items, configs, kwargs, warm=lambda c: c["sweep"] in ("baseline", "block", "both"),
                       warm_tokens=min(work.max_new_tokens, 16), keep_text=False, progress=progress)
    labels = [c["label"] for c in configs]
    summary = summarize(runs, labels, key="label")
    points = []
    for c in configs:
        s = summary[c["label"]]
        keep = ("tokens_per_forward", "forced_share", "ms_per_forward", "forwards", "tokens", "quality")
        points.append(dict(c, **{k: s[k] for k in keep},
                           tokens_per_second=s["tokens_per_second"]["median"],
                           speedup=s.get("vs_ar", {}).get("tokens_per_second")))
    return {
        "schema": SCHEMA,
        "model": str(llm.path),
        "model_note": model_note,
        "settings": {**work.settings(items), "block_size": block_size, "threshold": threshold,
                     "thresholds": list(thresholds), "block_sizes": list(block_sizes),
                     "confidences": [DEFAULT_CONFIDENCE] + [c["confidence"] for c in configs if "confidence" in c],
                     "policies": list(dict.fromkeys(policies)), "greedy": True, "batch_size": 1},
        "machine": machine(llm.model.device),
        "max_rss_bytes": max_rss_bytes(),
        "points": points,
        "runs": runs,
    }


def quality_value(q: dict) -> tuple[float | None, str]:
    """The quality number a curve plots: exact match on tasks, else edit similarity on code."""
    if "tasks" in q:
        return q["tasks"]["exact_match"], "exact match (tasks)"
    if "code" in q:
        return q["code"]["edit_similarity"], "edit similarity (code)"
    return None, "quality"


def sweep_table(result: dict):
    from rich.table import Table

    from .decode import fmt, quality_text

    s = result["settings"]
    t = Table(title=f"clover bench sweep · {result['model']} · {s['workload']} × {s['prompts']} prompts · "
                    f"{s['max_new_tokens']} new tokens", title_justify="left")
    for col in ("config", "sweep", "tok/fwd", "forced", "tok/s", "×AR", "ms/fwd", "quality"):
        t.add_column(col, justify="left" if col in ("config", "sweep", "quality") else "right")
    for p in result["points"]:
        t.add_row(p["label"], p["sweep"], f"{p['tokens_per_forward']:.2f}", fmt(p["forced_share"], ".0%"),
                  f"{p['tokens_per_second']:.1f}",
                  "-" if p["speedup"] is None else f"{p['speedup']:.2f}", f"{p['ms_per_forward']:.1f}",
                  quality_text(p["quality"]))
    return t


def plot_sweep(result: dict, path) -> str:
    """Two panels — quality vs tokens/forward and quality vs tokens/s — with one curve per sweep
    (points labelled by the swept value) and the AR point. Small PNG (dpi 100)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pts = result["points"]
    _, ylabel = quality_value(pts[0]["quality"])
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), dpi=100)
    series = (
        ("threshold", "#4c72b0", "o", lambda p: f"{p['threshold']:g}"),
        ("block", "#dd8452", "s", lambda p: f"B{p['block_size']}"),
    )
    for ax, xkey, xlabel in zip(axes, ("tokens_per_forward", "tokens_per_second"), ("tokens / forward", "tokens / s (median)")):
        for sweep, colour, marker, lab in series:
            ps = [p for p in pts if p["sweep"] in (sweep, "both")]
            ps.sort(key=lambda p: p["threshold"] if sweep == "threshold" else p["block_size"])
            xs = [p[xkey] for p in ps]
            ys = [quality_value(p["quality"])[0] for p in ps]
            ax.plot(xs, ys, marker=marker, color=colour, label=f"{sweep} sweep", lw=1, ms=4)
            for p, x, y in zip(ps, xs, ys):
                ax.annotate(lab(p), (x, y), textcoords="offset points", xytext=(3, 3), fontsize=6, color=colour)
        conf = [p for p in pts if p["sweep"] == "confidence"]
        if conf:
            xs, ys = [p[xkey] for p in conf], [quality_value(p["quality"])[0] for p in conf]
            ax.scatter(xs, ys, marker="^", s=24, color="#55a868", label="confidence measure", zorder=3)
            for p, x, y in zip(conf, xs, ys):
                ax.annotate(p["confidence"], (x, y), textcoords="offset points", xytext=(3, -8), fontsize=6, color="#55a868")
        pol = [p for p in pts if p["sweep"] == "policy"]
        if pol:
            xs, ys = [p[xkey] for p in pol], [quality_value(p["quality"])[0] for p in pol]
            ax.scatter(xs, ys, marker="D", s=18, color="#c44e52", label="policy", zorder=3)
            for p, x, y in zip(pol, xs, ys):
                ax.annotate(p["label"].split("/", 1)[1], (x, y), textcoords="offset points", xytext=(3, -8),
                            fontsize=6, color="#c44e52")
        ar = [p for p in pts if p["mode"] == "ar"]
        if ar:
            ax.scatter([ar[0][xkey]], [quality_value(ar[0]["quality"])[0]], marker="*", s=60, color="k", label="AR", zorder=3)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    note = result.get("model_note")
    fig.suptitle(f"{Path(result['model']).name}{' (' + note + ')' if note else ''} · {result['settings']['workload']} · "
                 f"{result['machine']['device']}, {result['machine']['torch_threads']} threads", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)
