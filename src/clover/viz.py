"""Pictures of block-diffusion decoding: which token was decoded at which denoise step.

Everything here takes plain data — token strings, the step at which each token was decoded
(`Generation.decode_steps`), the block size — so the CLI, the benchmarks and the evals can share it.

- `timeline_blocks(...)`: split a generation into blocks with their forwards and tokens/forward;
- `render_timeline(path, ...)`: a PNG (matplotlib, Agg) or a self-contained HTML page, by suffix;
- `LiveView`: a rich terminal view of the block being denoised (fed by `LLM.stream` events).

Heavy imports (matplotlib, rich) happen inside the functions that need them.
"""

from __future__ import annotations

import html
import time
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

MASK_GLYPH = "░"

# Anchors of the viridis colour map (dark purple -> yellow); interpolated so the HTML page, the
# PNG and the terminal view colour a step the same way without needing matplotlib.
_ANCHORS = [
    (0.267, 0.005, 0.329),
    (0.283, 0.141, 0.458),
    (0.254, 0.265, 0.530),
    (0.207, 0.372, 0.553),
    (0.164, 0.471, 0.558),
    (0.128, 0.567, 0.551),
    (0.135, 0.659, 0.518),
    (0.267, 0.749, 0.441),
    (0.478, 0.821, 0.318),
    (0.741, 0.873, 0.150),
    (0.993, 0.906, 0.144),
]


def step_rgb(step: int, max_step: int) -> tuple[float, float, float]:
    """Colour of denoise step `step` (1-based) on a scale of 1..max_step, as RGB in [0, 1]."""
    frac = 0.0 if max_step <= 1 else (min(max(step, 1), max_step) - 1) / (max_step - 1)
    pos = frac * (len(_ANCHORS) - 1)
    i = min(int(pos), len(_ANCHORS) - 2)
    t = pos - i
    a, b = _ANCHORS[i], _ANCHORS[i + 1]
    return tuple(x + (y - x) * t for x, y in zip(a, b))  # type: ignore[return-value]


def step_colour(step: int, max_step: int) -> str:
    """The same colour as '#rrggbb'."""
    return "#" + "".join(f"{round(c * 255):02x}" for c in step_rgb(step, max_step))


def text_colour_on(rgb: Sequence[float]) -> str:
    """Black or white, whichever reads better on background `rgb`."""
    r, g, b = rgb
    return "#000000" if 0.299 * r + 0.587 * g + 0.114 * b > 0.55 else "#ffffff"


def visible(token: str) -> str:
    """A token's text made printable for a single cell: whitespace and control bytes become
    glyphs (space '␣', newline '↵', tab '⇥', other controls '·')."""
    out = []
    for ch in token:
        if ch == " ":
            out.append("␣")
        elif ch == "\n":
            out.append("↵")
        elif ch == "\t":
            out.append("⇥")
        elif unicodedata.category(ch) in ("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"):
            out.append("·")
        else:
            out.append(ch)
    return "".join(out) or "∅"


def printable_text(text: str) -> str:
    """Running text safe to print in a terminal: keeps newlines and tabs, replaces other control
    characters (a random model emits arbitrary bytes) with '·'."""
    return "".join(
        ch if ch in "\n\t" or unicodedata.category(ch) not in ("Cc", "Cf", "Cs", "Co", "Cn") else "·" for ch in text
    )


# ----------------------------------------------------------------------------------- timeline
@dataclass
class TimelineBlock:
    index: int
    tokens: list[str]
    steps: list[int]
    forwards: int  # denoise steps spent on the block (AR: one per token)
    forced: list[bool]  # per token: committed below the threshold (a forced step)

    @property
    def tokens_per_forward(self) -> float:
        return len(self.tokens) / self.forwards if self.forwards else 0.0


def timeline_blocks(
    tokens: Sequence[str],
    steps: Sequence[int],
    block_size: int,
    forwards_per_block: Sequence[int] | None = None,
    forced: Sequence[int] = (),
) -> list[TimelineBlock]:
    """Split a generation into consecutive blocks of `block_size` tokens.

    `forwards_per_block[b]` (e.g. `GenerationStats.block_steps`) is the number of forwards block b
    cost; when missing, the largest step inside the block is used (the step at which the block
    completed, for diffusion decoding). `forced` (e.g. `Generation.forced_tokens`) holds the indices
    of tokens committed below the threshold; the pictures outline them."""
    if block_size <= 0:
        raise ValueError(f"block_size: must be a positive integer, got {block_size!r}")
    if len(tokens) != len(steps):
        raise ValueError(f"tokens ({len(tokens)}) and steps ({len(steps)}) must have the same length")
    forced = set(forced)
    blocks = []
    for b, start in enumerate(range(0, len(tokens), block_size)):
        toks = [str(t) for t in tokens[start : start + block_size]]
        st = [int(s) for s in steps[start : start + block_size]]
        if forwards_per_block is not None and b < len(forwards_per_block):
            fw = int(forwards_per_block[b])
        else:
            fw = max(st) if st else 0
        flags = [start + i in forced for i in range(len(toks))]
        blocks.append(TimelineBlock(b, toks, st, max(fw, 1), flags))
    return blocks


def _summary(blocks: list[TimelineBlock]) -> str:
    n = sum(len(b.tokens) for b in blocks)
    f = sum(b.forwards for b in blocks)
    k = sum(sum(b.forced) for b in blocks)
    return (f"{n} tokens · {len(blocks)} blocks · {f} forwards · {n / f if f else 0:.2f} tokens/forward"
            + (f" · {k} forced (outlined)" if k else ""))


def render_timeline(
    path: str | Path,
    tokens: Sequence[str],
    steps: Sequence[int],
    block_size: int,
    *,
    forwards_per_block: Sequence[int] | None = None,
    forced: Sequence[int] = (),
    title: str | None = None,
) -> Path:
    """Write the timeline to `path`: HTML when the suffix is .html/.htm, otherwise an image in the
    format matplotlib infers from the suffix (PNG, SVG, PDF)."""
    path = Path(path)
    blocks = timeline_blocks(tokens, steps, block_size, forwards_per_block, forced)
    if path.suffix.lower() in (".html", ".htm"):
        path.write_text(timeline_html(blocks, block_size, title=title), encoding="utf-8")
    else:
        timeline_figure(blocks, block_size, title=title, path=path)
    return path


def timeline_html(blocks: list[TimelineBlock], block_size: int, *, title: str | None = None) -> str:
    """A self-contained HTML page (inline CSS, no scripts): one row per block, each token a cell
    coloured by the step that decoded it (hover for details)."""
    max_step = max((s for b in blocks for s in b.steps), default=1)
    esc = html.escape
    rows = []
    for b in blocks:
        cells = []
        for pos, (tok, st, forced) in enumerate(zip(b.tokens, b.steps, b.forced)):
            rgb = step_rgb(st, max_step)
            cells.append(
                f'<span class="tok{" forced" if forced else ""}" style="background:{step_colour(st, max_step)};'
                f'color:{text_colour_on(rgb)}" title="block {b.index} · position {pos} · step {st}'
                f'{" · forced (below the threshold)" if forced else ""} · {esc(repr(tok), quote=True)}">{esc(visible(tok))}</span>'
            )
        rows.append(
            f'<div class="row"><span class="label">block {b.index}</span><span class="toks">{"".join(cells)}</span>'
            f'<span class="tpf">{b.forwards} fwd · {b.tokens_per_forward:.2f} tok/fwd</span></div>'
        )
    legend = "".join(
        f'<span class="tok" style="background:{step_colour(s, max_step)};color:{text_colour_on(step_rgb(s, max_step))}">{s}</span>'
        for s in range(1, max_step + 1)
    )
    heading = esc(title or "Denoising timeline")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{heading}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 1.5em; background: #fafafa; color: #222; }}
h1 {{ font-size: 1.2em; margin-bottom: 0.2em; }}
.summary {{ color: #555; margin-bottom: 1em; }}
.row {{ display: flex; align-items: center; margin: 2px 0; }}
.label {{ width: 5.5em; color: #666; font-size: 0.85em; flex: none; }}
.toks {{ display: flex; flex-wrap: wrap; }}
.tok {{ font-family: ui-monospace, monospace; font-size: 0.85em; padding: 1px 3px; margin: 1px;
        border-radius: 3px; white-space: pre; min-width: 0.8em; text-align: center; }}
.forced {{ outline: 2px solid #d62728; outline-offset: -2px; }}
.tpf {{ margin-left: 1em; color: #444; font-size: 0.85em; flex: none; }}
.legend {{ margin-top: 1em; font-size: 0.85em; color: #555; }}
</style>
</head>
<body>
<h1>{heading}</h1>
<div class="summary">{esc(_summary(blocks))} · block size {block_size}</div>
{chr(10).join(rows)}
<div class="legend">denoise step: {legend}</div>
</body>
</html>
"""


def timeline_figure(
    blocks: list[TimelineBlock],
    block_size: int,
    *,
    title: str | None = None,
    path: str | Path | None = None,
    dpi: int = 100,
    max_columns: int = 64,
):
    """A matplotlib figure of the timeline; saved to `path` when given (Agg backend, no display).
    Returns the figure (closed once saved)."""
    import warnings

    import matplotlib

    if path is not None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Rectangle

    cols = max(1, min(block_size, max_columns))
    # a long block wraps onto several lines of `cols` cells
    lines: list[tuple[TimelineBlock, int]] = []
    for b in blocks:
        for start in range(0, max(len(b.tokens), 1), cols):
            lines.append((b, start))
    n_lines = max(len(lines), 1)
    max_step = max((s for b in blocks for s in b.steps), default=1)
    cell_w, cell_h = 0.32, 0.3
    fig_w = min(2.2 + cols * cell_w + 1.6, 24)
    fig_h = min(1.2 + n_lines * cell_h, 60)
    fig, ax = plt.subplots(figsize=(fig_w, fig_h), dpi=dpi)
    ax.set_xlim(0, cols)
    ax.set_ylim(n_lines, 0)
    ax.set_axis_off()
    font = max(4.0, min(8.0, 220 / cols))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # missing glyphs for odd bytes
        for y, (b, start) in enumerate(lines):
            cells = zip(b.tokens[start : start + cols], b.steps[start : start + cols], b.forced[start : start + cols])
            for x, (tok, st, forced) in enumerate(cells):
                rgb = step_rgb(st, max_step)
                ax.add_patch(Rectangle((x + 0.04, y + 0.06), 0.92, 0.88, facecolor=rgb,
                                       edgecolor="#d62728" if forced else "none", linewidth=1.5 if forced else 0))
                label = visible(tok)
                if len(label) > 4:
                    label = label[:3] + "…"
                ax.text(x + 0.5, y + 0.52, label, ha="center", va="center", fontsize=font,
                        color=text_colour_on(rgb), family="monospace", parse_math=False)
            if start == 0:
                ax.text(-0.2, y + 0.5, f"block {b.index}", ha="right", va="center", fontsize=7, color="#555")
                ax.text(cols + 0.2, y + 0.5, f"{b.tokens_per_forward:.2f} tok/fwd", ha="left", va="center",
                        fontsize=7, color="#333")
        head = (title + "\n" if title else "") + _summary(blocks)
        ax.set_title(head, fontsize=8, loc="left")
        if max_step > 1:
            cmap = ListedColormap([step_rgb(s, max_step) for s in range(1, max_step + 1)])
            sm = matplotlib.cm.ScalarMappable(cmap=cmap, norm=matplotlib.colors.Normalize(0.5, max_step + 0.5))
            cbar = fig.colorbar(sm, ax=ax, orientation="horizontal", fraction=0.04, pad=0.02, aspect=50)
            cbar.set_label("denoise step", fontsize=7)
            cbar.ax.tick_params(labelsize=6)
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=dpi)
            plt.close(fig)
    return fig


# ---------------------------------------------------------------------------------- live view
class LiveView:
    """A rich terminal view of decoding: committed text on top, the block being denoised below
    (masked positions as '░', decoded tokens coloured by the step that accepted them), and running
    stats. Feed it `LLM.stream(..., provisional=True)` events through `update(event)`.

    Use as a context manager; `step_delay` (seconds) slows each provisional frame for demos."""

    def __init__(
        self,
        token_text: Callable[[int], str],
        block_size: int,
        *,
        console=None,
        title: str = "clover",
        step_delay: float = 0.0,
        max_text_lines: int = 12,
    ) -> None:
        from rich.console import Console

        self.token_text = token_text
        self.block_size = block_size
        self.console = console or Console()
        self.title = title
        self.step_delay = step_delay
        self.max_text_lines = max_text_lines
        self.committed = ""
        self.block_tokens: list = []
        self.block_steps: list[int] = []
        self.block = 0
        self.step = 0
        self.forwards = 0
        self.tokens = 0
        self.started = time.perf_counter()
        self.final = None
        self._provisional_seen = False
        self._live = None

    def __enter__(self) -> "LiveView":
        from rich.live import Live

        self.started = time.perf_counter()
        self._live = Live(self._render(), console=self.console, refresh_per_second=20, transient=False)
        self._live.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.update(self._render(), refresh=True)
            self._live.__exit__(*exc)
            self._live = None

    def update(self, event) -> None:
        """Take one StreamEvent ("provisional", "block" or "done")."""
        if event.kind == "provisional":
            self._provisional_seen = True
            self.forwards += 1
            self.block, self.step = event.block, event.step
            self.block_tokens, self.block_steps = list(event.token_ids), list(event.steps)
        elif event.kind == "block":
            self.committed += event.text
            self.tokens += len(event.token_ids)
            if not self._provisional_seen:  # AR: one forward per committed token
                self.forwards += len(event.token_ids)
            self.block_tokens, self.block_steps = [], []
        elif event.kind == "done":
            self.final = event.generation
            self.block_tokens, self.block_steps = [], []
        if self._live is not None:
            self._live.update(self._render(), refresh=event.kind == "provisional" or self.step_delay > 0)
        if event.kind == "provisional" and self.step_delay > 0:
            time.sleep(self.step_delay)

    # ------------------------------------------------------------------ rendering
    def _render(self):
        from rich.console import Group
        from rich.panel import Panel
        from rich.text import Text

        lines = printable_text(self.committed).split("\n")
        shown = "\n".join(lines[-self.max_text_lines :])
        parts = [Panel(Text(shown or " "), title=self.title, title_align="left", border_style="dim")]
        if self.block_tokens:
            row = Text()
            for tok, st in zip(self.block_tokens, self.block_steps):
                if tok is None:
                    row.append(MASK_GLYPH, style="grey50")
                else:
                    rgb = step_rgb(st, self.block_size)
                    row.append(visible(self.token_text(tok)), style=f"{text_colour_on(rgb)} on {step_colour(st, self.block_size)}")
                row.append(" ")
            masked = sum(t is None for t in self.block_tokens)
            parts.append(
                Panel(row, title=f"block {self.block} · step {self.step} · {masked} masked", title_align="left", border_style="cyan")
            )
        parts.append(Text(self._stats_line(), style="bold"))
        return Group(*parts)

    def _stats_line(self) -> str:
        if self.final is not None:
            s = self.final.stats
            return stats_line(s.tokens, s.forwards, s.seconds, self.final.finish_reason)
        return stats_line(self.tokens, self.forwards, time.perf_counter() - self.started)


def stats_line(tokens: int, forwards: int, seconds: float, finish_reason: str | None = None) -> str:
    """'64 tokens · 12 forwards · 5.33 tokens/forward · 120.4 tokens/s' (+ the finish reason)."""
    tpf = tokens / forwards if forwards else 0.0
    tps = tokens / seconds if seconds > 0 else 0.0
    line = f"{tokens} tokens · {forwards} forwards · {tpf:.2f} tokens/forward · {tps:.1f} tokens/s"
    return line + (f" · {finish_reason}" if finish_reason else "")
