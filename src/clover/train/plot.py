"""Training curves from run directories' `log.jsonl`.

    clover train plot RUN_DIR [RUN_DIR ...] [--out curves.png] [--chain] [--labels a,b] [--smooth 5]

Left panel: the training losses (AR next-token CE; the block-diffusion masked CE for stage-2 runs),
right panel: the held-out task metrics logged every `run.eval_every` steps (teacher-forced exact
match and the share of answer tokens at p >= threshold). The x axis is training tokens. With
`--chain` the runs are consecutive phases of one model (each started from the previous one's
checkpoint): their token counts are laid end to end and the phase boundaries marked. Losses are
drawn faint as logged and bold as a centred moving average over `smooth` records.

A resumed run can log a step twice (steps after the last checkpoint are redone); the later record
of a step wins.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

LOSS_KEYS = (("ar_loss", "AR loss"), ("diff_loss", "diffusion loss"))
EVAL_KEYS = (("exact_match", "exact match"), ("answer_tokens_p>=", "answer tokens at p >= "))


@dataclass
class RunLog:
    name: str
    train: list[dict] = field(default_factory=list)  # one record per logged step, sorted by step
    evals: list[dict] = field(default_factory=list)  # {"step", "tokens", **metrics}, sorted by step


def read_run_log(run_dir: str | Path) -> RunLog:
    """Parse `<run_dir>/log.jsonl` (or a log.jsonl path); the later record of a repeated step wins."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / "log.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no training log here; pass a run directory written by `clover train`")
    train: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(f"{path}:{n}: not a JSON record (a truncated write?): {line[:80]!r}") from None
        if "eval" in rec:
            evals[int(rec["step"])] = dict(rec["eval"])
        elif "step" in rec:
            train[int(rec["step"])] = rec
    rows = [train[s] for s in sorted(train)]
    per_token = _tokens_per_step(rows)
    ev = [{"step": s, "tokens": s * per_token, **evals[s]} for s in sorted(evals)]
    name = path.parent.name
    return RunLog(name=name, train=rows, evals=ev)


def _tokens_per_step(rows: list[dict]) -> float:
    for r in rows:
        if r.get("tokens") and r.get("step"):
            return r["tokens"] / r["step"]
    return 0.0


def _metric(rec: dict, key: str) -> tuple[str, float] | None:
    """(label suffix, value) of a metric; `answer_tokens_p>=` matches whatever threshold was logged."""
    for k, v in rec.items():
        if k == key or (key.endswith(">=") and k.startswith(key)):
            return k[len(key):], float(v)
    return None


def moving_average(values: list[float], window: int) -> list[float]:
    """Centred moving average; the window shrinks at the ends (window <= 1: the values unchanged)."""
    if window <= 1:
        return list(values)
    h = window // 2
    out = []
    for i in range(len(values)):
        part = values[max(0, i - h) : i + h + 1]
        out.append(sum(part) / len(part))
    return out


def plot_runs(runs: list[RunLog], path: str | Path, *, chain: bool = False, title: str | None = None,
              smooth: int = 5) -> Path:
    """Two panels (losses, held-out task metrics) against training tokens; a small PNG (dpi 100)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, (ax_l, ax_e) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=100)
    offset = 0.0
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, run in enumerate(runs):
        c = colors[i % len(colors)]
        xs = [offset + r.get("tokens", 0) for r in run.train]
        for (key, label), style in zip(LOSS_KEYS, ("-", "--")):
            pts = [(x, r[key]) for x, r in zip(xs, run.train) if key in r]
            if pts:
                x, y = zip(*pts)
                if smooth > 1:
                    ax_l.plot(x, y, style, color=c, lw=0.5, alpha=0.3)
                ax_l.plot(x, moving_average(list(y), smooth), style, color=c, lw=1.2, label=f"{run.name}: {label}")
        for (key, label), style in zip(EVAL_KEYS, ("-o", "--s")):
            pts = [(offset + e["tokens"], m) for e in run.evals if (m := _metric(e, key)) is not None]
            if pts:
                suffix = pts[0][1][0]
                ax_e.plot([x for x, _ in pts], [v for _, (_, v) in pts], style, color=c, ms=3, lw=1,
                          label=f"{run.name}: {label}{suffix}")
        if chain:
            end = offset + (run.train[-1].get("tokens", 0) if run.train else 0)
            if i < len(runs) - 1:
                for ax in (ax_l, ax_e):
                    ax.axvline(end, color="grey", lw=0.6, ls=":")
            offset = end
    ax_l.set_xlabel("training tokens" + (" (phases end to end)" if chain else ""))
    ax_l.set_ylabel("loss (nats/token)")
    ax_l.set_yscale("log")
    ax_l.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax_l.yaxis.set_major_formatter(ScalarFormatter())
    ax_l.yaxis.set_minor_formatter(NullFormatter())
    ax_e.set_xlabel("training tokens" + (" (phases end to end)" if chain else ""))
    ax_e.set_ylabel("held-out tasks (teacher-forced)")
    ax_e.set_ylim(0, 1)
    for ax in (ax_l, ax_e):
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=6, loc="best")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
