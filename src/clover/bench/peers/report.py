"""The peers result as rows, a table, Markdown and a plot."""

from __future__ import annotations

import math
from pathlib import Path

from ..common import spread
from .base import GGUF_DTYPES, STATIC_SUFFIX


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (engine, variant, threads, batch), in first-seen order, with ratios to clover AR
    at batch 1 and the same thread count."""
    keys = list(dict.fromkeys((r["engine"], r["variant"], r["threads"], r["batch"]) for r in runs))
    ar = {}
    for r in runs:
        if r["engine"] == "clover" and r["variant"] == "ar" and r["batch"] == 1:
            ar.setdefault(r["threads"], {})[r["item"]] = r
    rows = []
    for engine, variant, threads, batch in keys:
        rs = [r for r in runs if (r["engine"], r["variant"], r["threads"], r["batch"]) == (engine, variant, threads, batch)]
        tokens, seconds = sum(r["tokens"] for r in rs), sum(r["seconds"] for r in rs)
        row = {"engine": engine, "variant": variant, "threads": threads, "batch": batch, "samples": len(rs),
               "tokens": tokens, "seconds": seconds,
               "tokens_per_second": dict(spread([r["tokens_per_second"] for r in rs]),
                                         aggregate=tokens / seconds if seconds > 0 else 0.0),
               "vs_clover_ar": None, "vs_clover_ar_paired_median": None, "matches_clover_ar": None,
               "matches_clover_mode": None}
        accepts = [a for r in rs for a in (r.get("accept_lengths") or ())]
        if accepts and all(r.get("accept_lengths") for r in rs):  # a drafting row: tokens kept per verify
            row["tokens_per_verify"] = sum(accepts) / len(accepts)
        compare = rs[0].get("compare")
        if compare:  # a family's reference: clover's mode at the same threads and batch, over this
            row.update(compared_with=compare, clover_speedup=None, clover_speedup_cpu=None)
            mine = [r for r in runs if r["engine"] == "clover" and r["variant"] == compare
                    and r["threads"] == threads and r["batch"] == batch]
            m_tok, m_sec = sum(r["tokens"] for r in mine), sum(r["seconds"] for r in mine)
            if m_sec > 0 and seconds > 0 and tokens:
                row["clover_speedup"] = (m_tok / m_sec) / (tokens / seconds)
            cpu, m_cpu = (sum(r.get("cpu_seconds") or 0.0 for r in x) for x in (rs, mine))
            if all(r.get("cpu_seconds") is not None for r in rs + mine) and cpu > 0 and m_cpu > 0 and tokens:
                # the same ratio in CPU seconds: what another process on a shared core does not move
                row["clover_speedup_cpu"] = (m_tok / m_cpu) / (tokens / cpu)
            if batch > 1:  # each round's rows against clover's same round, where both kept them
                ref = {r["item"]: r["token_ids"] for r in mine if r["token_ids"] is not None}
                same = [a == b for r in rs if r["token_ids"] is not None and r["item"] in ref
                        for a, b in zip(r["token_ids"], ref[r["item"]])]
                row["matches_clover_mode"] = sum(same) / len(same) if same else None
        base = ar.get(threads)
        if base:
            b_tok = sum(r["tokens"] for r in base.values())
            b_sec = sum(r["seconds"] for r in base.values())
            if b_sec > 0 and b_tok:
                row["vs_clover_ar"] = row["tokens_per_second"]["aggregate"] / (b_tok / b_sec)
            if batch == 1:
                paired = [r["tokens_per_second"] / base[r["item"]]["tokens_per_second"] for r in rs
                          if r["item"] in base and base[r["item"]]["tokens_per_second"] > 0]
                row["vs_clover_ar_paired_median"] = spread(paired)["median"]
                same = [r["token_ids"] == base[r["item"]]["token_ids"] for r in rs
                        if r["token_ids"] is not None and r["item"] in base]
                row["matches_clover_ar"] = sum(same) / len(same) if same else None
        if batch == 1:  # the port, compiled steps or a reference: against clover's engine in that mode
            mode = compare or variant.removesuffix(STATIC_SUFFIX)
            if engine == "llama-clover" or mode != variant:
                ref = {r["item"]: r["token_ids"] for r in runs if r["engine"] == "clover" and r["variant"] == mode
                       and r["threads"] == threads and r["batch"] == 1}
                same = [r["token_ids"] == ref[r["item"]] for r in rs if r["item"] in ref]
                row["matches_clover_mode"] = sum(same) / len(same) if same else None
        rows.append(row)
    return rows


# ---------------------------------------------------------------------------------- output
def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def peers_title(result: dict) -> str:
    s, c = result["settings"], result["config"]
    note = f" ({result['model_note']})" if result.get("model_note") else ""
    params = c["parameters"].get("total") if isinstance(c["parameters"], dict) else None
    size = f" · {params / 1e6:.1f}M params" if params else ""
    gguf = f" (GGUF engines {s['gguf_type']})" if s.get("gguf_type") and s["gguf_type"] != GGUF_DTYPES.get(c["dtype"]) else ""
    return (f"clover bench peers · {Path(result['model']).name}{note}{size} · {c['dtype']}{gguf} · {s['prompts']} prompts × "
            f"{s['max_new_tokens']} new tokens ({'each to EOS' if s.get('to_eos') else 'fixed length'}, greedy)")


def peers_table(result: dict):
    """A rich Table: one line per engine configuration, skipped engines in the caption."""
    from rich.table import Table

    t = Table(title=peers_title(result), title_justify="left", caption=skip_notes(result) or None, caption_justify="left")
    for col in ("engine", "variant", "threads", "batch", "tok/s median", "IQR", "aggregate", "×clover ar", "=AR",
                "tok/verify"):
        t.add_column(col, justify="left" if col in ("engine", "variant") else "right")
    for r in result["rows"]:
        tps = r["tokens_per_second"]
        t.add_row(r["engine"], r["variant"], str(r["threads"]), str(r["batch"]), _f(tps["median"], ".1f"),
                  f"{_f(tps['q1'], '.1f')}–{_f(tps['q3'], '.1f')}", _f(tps["aggregate"], ".1f"),
                  _f(r["vs_clover_ar"], ".2f"), _f(r["matches_clover_ar"], ".0%"), _f(r.get("tokens_per_verify"), ".2f"))
    return t


def skip_notes(result: dict) -> str:
    lines = []
    for name, e in result["engines"].items():
        if e.get("note"):
            lines.append(f"{name}: {'skipped — ' if not e['available'] else ''}{e['note']}")
    for r in result["rows"]:
        if r.get("matches_clover_mode") is not None:
            mode = r.get("compared_with") or r["variant"].removesuffix(STATIC_SUFFIX)
            at = f", batch {r['batch']}" if r["batch"] > 1 else ""
            lines.append(f"{r['engine']} {r['variant']} ({r['threads']} thread{'s' if r['threads'] > 1 else ''}{at}): "
                         f"same tokens as clover {mode} on {r['matches_clover_mode']:.0%} of prompts")
        if r.get("clover_speedup") is not None:
            lines.append(f"{r['engine']} {r['variant']} ({r['threads']} thread{'s' if r['threads'] > 1 else ''}, batch "
                         f"{r['batch']}): clover {r['compared_with']} {r['clover_speedup']:.2f}x its tokens/s"
                         + (f" ({r['clover_speedup_cpu']:.2f}x in CPU seconds)" if r.get("clover_speedup_cpu") else ""))
    if result["settings"].get("skipped_modes"):
        lines.append(f"clover modes left out: {', '.join(result['settings']['skipped_modes'])}")
    return "\n".join(lines)


def peers_markdown(result: dict) -> str:
    """The table as Markdown (for docs/benchmarks.md)."""
    out = ["| engine | variant | threads | batch | tok/s median (IQR) | aggregate | × clover ar | = AR | tok/verify |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        tps = r["tokens_per_second"]
        out.append(f"| {r['engine']} | {r['variant']} | {r['threads']} | {r['batch']} | {_f(tps['median'], ',.1f')} "
                   f"({_f(tps['q1'], ',.0f')}–{_f(tps['q3'], ',.0f')}) | {_f(tps['aggregate'], ',.1f')} | "
                   f"{_f(r['vs_clover_ar'], '.2f')} | {_f(r['matches_clover_ar'], '.0%')} | "
                   f"{_f(r.get('tokens_per_verify'), '.2f')} |")
    return "\n".join(out)


def plot_peers(result: dict, path) -> str:
    """Horizontal bars of tokens/s (median, IQR whiskers; log scale: the engines differ tenfold), one
    bar per thread count, batch 1 on the left and batch `batch` on the right. Small PNG (dpi 100)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = result["rows"]
    threads = result["settings"]["threads"]
    colours = ["#4c72b0", "#dd8452", "#55a868", "#c44e52"]
    panels = [(1, "batch 1")] + ([(result["settings"]["batch"], f"batch {result['settings']['batch']} (aggregate)")]
                                 if any(r["batch"] != 1 for r in rows) else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 0.5 + 0.42 * max(3, len(rows) // len(threads))),
                             dpi=100, squeeze=False)
    for ax, (b, title) in zip(axes[0], panels):
        labels = list(dict.fromkeys(f"{r['engine']} · {r['variant']}" for r in rows if r["batch"] == b))
        h = 0.8 / len(threads)
        lows = []
        for j, t in enumerate(threads):
            for i, lab in enumerate(labels):
                r = next((r for r in rows if r["batch"] == b and r["threads"] == t
                          and f"{r['engine']} · {r['variant']}" == lab), None)
                if r is None:
                    continue
                tps = r["tokens_per_second"]
                x = tps["median"] if b == 1 else tps["aggregate"]
                err = [[max(0.0, x - tps["q1"])], [max(0.0, tps["q3"] - x)]] if b == 1 and tps["n"] > 1 else None
                ax.barh(i + (j - (len(threads) - 1) / 2) * h, x, height=h, xerr=err, color=colours[j % len(colours)],
                        capsize=2, label=f"{t} thread{'s' if t > 1 else ''}" if i == 0 else None)
                right = x + (err[1][0] if err else 0.0)
                label = f" {x:,.0f}" if x >= 10 else f" {x:.1f}" if x >= 1 else f" {x:.2f}"
                ax.text(right, i + (j - (len(threads) - 1) / 2) * h, label, va="center", fontsize=6)
                lows.append(x)
        if lows:  # log bars start at a power of ten below the slowest
            ax.set_xlim(left=10 ** math.floor(math.log10(max(min(lows), 1e-3)) - 0.3))
        ax.set_yticks(range(len(labels)))
        ax.set_yticklabels(labels, fontsize=7)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(NullFormatter())  # after set_xscale, which resets the formatters
        ax.set_xlabel("tokens / s" + (" (median, IQR)" if b == 1 else ""), fontsize=7)
        ax.tick_params(axis="x", labelsize=7)
        ax.set_title(title, fontsize=8)
        ax.grid(axis="x", alpha=0.3, which="both")
    axes[0][0].legend(fontsize=6, loc="lower right")
    fig.suptitle(peers_title(result).replace("clover bench peers · ", ""), fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return str(path)
