"""What a forward costs, and the block width that pays (`block_size="auto"`).

**The cost curve.** A forward's time against the number of positions it carries, per kind:
- `commit`: n tokens appended causally (n = 1 is the AR step);
- `denoise`: one block of n positions denoised against the cache;
- `verify`: speculative decoding's forward, a draft of n committed causally with every logit plus the
  next draft of n denoised (2n positions), and the cache rolled back to half the draft after it (a
  partial accept, as most verifies end);
- `block`: a finished block of n committed fused with the next block's first denoise step (2n
  positions), what the diffusion engine runs once per block;
- `step` (`STEP_KIND`): not a bare forward but speculative decoding's whole step as it runs, drafting
  n (n = 1: its AR step), timed by `speculative.step_curve` for draft "auto" (`DraftPolicy`); any
  engine's step is timed by one harness, `time_steps` (dflash's `iteration_curve` too).
Measured on this machine at batch 1 and under batch (`time_forward`, `measure_curve`; `clover bench
cost` runs the full sweep) and kept per model shape, dtype and machine in the user cache
(`$XDG_CACHE_HOME/clover/cost/`, JSON), eager and compiled apart. A cache file that cannot be read
is reported (a warning) and measured again.

**The width choice.** A model trained on several block sizes (`config.block_sizes`, block-size
calibration) decodes exactly at any of them, and a narrow block costs less per forward but commits
fewer tokens. With `block_size="auto"` the diffusion engine picks, whenever every row stands at a
block boundary, the trained width `w` that maximises the expected tokens per second

    sum over rows of tpf_row(w)  /  cost(w)

- `tpf_row(w) = min(w, remaining, 1 + s_row * (prior(w) - 1))`: the prior is the model's measured
  tokens per forward at each width (`config.block_tokens_per_forward`, written with the model card;
  w/8 capped at 4 when absent), and `s_row` scales its gain by how this row has gone so far (tokens
  committed beyond one per forward, against what the prior expected; 8 forwards' worth of prior);
- `cost(w)`: the curve's denoise forward at w positions, and once per block its `block` forward at w
  (without one measured, a denoise forward of 2w positions).
Width 1 is among the choices: a block of one position is the AR step (its token is predicted by the
commit part, so it is AR's token), at one token per forward and the cost of the commit forward of
one position. So when the AR step wins (a compiled forward, a batch large enough for the denoise
forward to turn compute-bound), auto decodes as AR.
The choice depends only on the committed tokens and the cost table, so a run with a given table is
reproducible; `WidthChoice` records each decision and why (the expected tokens/s per width).
"""

from __future__ import annotations

import hashlib
import json
import platform
import statistics
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
from ..paths import user_cache
from .base import RowState, grad_free_call
from .sampling import SamplingParams

KINDS = ("commit", "denoise", "verify", "block")  # the bare forwards `time_forward` times
STEP_KIND = "step"  # speculative's step as it runs, drafting n (1: its AR step): `speculative.step_curve`
POSITIONS = (1, 2, 4, 8, 16, 32, 64)
SCHEMA = "clover.cost/1"
AR_WIDTH = 1  # the width-1 block: the AR step (block_size="auto" may choose it)
BATCH_BUCKETS = (1, 2, 4, 8, 16)  # the batch sizes a draft choice measures its forwards at
AUTO_MAX_WIDTH = 64  # block_size="auto" picks among the trained widths up to this
CALIBRATION_REPEAT = 8  # timed forwards per point of a quick calibration (the fastest is kept)
PRIOR_PSEUDO_FORWARDS = 8.0  # how many forwards' worth of evidence the prior tokens-per-forward carries


# ------------------------------------------------------------------------------ identity
def cost_root() -> Path:
    """Where forward costs are kept: `$CLOVER_COST`, else `${XDG_CACHE_HOME:-~/.cache}/clover/cost`."""
    return user_cache("cost", env="CLOVER_COST")


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def compiled_kind(model) -> str:
    return "compiled" if model.compiled else "eager"


def cost_key(model, variant: str | None = None) -> dict:
    """What a forward's cost depends on: the model's shapes and dtype, eager or compiled, the device
    and the machine (CPU, threads, torch), and whether its weights are packed for forwards of several
    positions (`clover.kernels.packed`: True for oneDNN copies, "rows" for the row kernel alone; only
    then in the key, so the curves of unpacked models keep their keys) and served by the row kernel
    (its ISA)."""
    from ..kernels.packed import packing, row_kernel
    from ..kernels.rows import isa

    c = model.config
    shape = {k: getattr(c, k, None) for k in (
        "model_type", "backbone", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
        "linear_value_head_dim", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
        "shared_expert_intermediate_size", "intermediate_size", "layer_types")}
    dev = model.device
    packs = packing(model)
    return {
        **({"packed": True if packs == "onednn" else packs} if packs else {}),
        **({"row_kernel": isa()} if packs and row_kernel() else {}),
        "model": shape,
        "dtype": str(model.dtype).replace("torch.", ""),
        "variant": variant or compiled_kind(model),
        "device": str(dev),
        "machine": torch.cuda.get_device_name(dev) if dev.type == "cuda" else _cpu_name(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


def cost_path(key: dict) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return cost_root() / f"{key['variant']}-{digest}.json"


# ------------------------------------------------------------------------------ the curve
@dataclass
class CostCurve:
    """seconds[kind][batch][positions], measured; `seconds()` interpolates between the points."""

    seconds_by: dict = field(default_factory=dict)  # kind -> batch -> positions -> seconds
    key: dict = field(default_factory=dict)

    def add(self, kind: str, batch: int, positions: int, seconds: float) -> None:
        self.seconds_by.setdefault(kind, {}).setdefault(int(batch), {})[int(positions)] = float(seconds)

    def merge(self, other: "CostCurve") -> "CostCurve":
        """Add every point of `other` (its points replace this curve's at the same place); returns self."""
        for kind, by_batch in other.seconds_by.items():
            for b, pts in by_batch.items():
                for p, sec in pts.items():
                    self.add(kind, b, p, sec)
        return self

    def has(self, kind: str, batch: int | None = None) -> bool:
        """Whether forwards of `kind` were measured (at `batch` rows, when given)."""
        by_batch = self.seconds_by.get(kind) or {}
        return bool(by_batch) if batch is None else bool(by_batch.get(int(batch)))

    def seconds(self, kind: str, batch: int, positions: int) -> float:
        """A forward of `kind` at `batch` rows and `positions` per row: linear between the measured
        positions (and past the last two); a batch that was not measured reads the nearest measured
        batch at the same total number of positions."""
        by_batch = self.seconds_by.get(kind)
        if not by_batch:
            raise KeyError(f"cost curve: no {kind!r} forwards measured")
        if batch in by_batch:
            pts, n = by_batch[batch], positions
        else:
            b0 = min(by_batch, key=lambda b: (abs(b - batch), b))
            pts, n = by_batch[b0], positions * batch / b0
        xs = sorted(pts)
        if len(xs) == 1:
            return pts[xs[0]] * max(n, 1) / xs[0] if n > xs[0] else pts[xs[0]]
        if n <= xs[0]:
            return pts[xs[0]]
        for lo, hi in zip(xs, xs[1:]):
            if n <= hi:
                return pts[lo] + (pts[hi] - pts[lo]) * (n - lo) / (hi - lo)
        lo, hi = xs[-2], xs[-1]
        return pts[hi] + (pts[hi] - pts[lo]) * (n - hi) / (hi - lo)

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "key": self.key,
                "seconds": {k: {str(b): {str(p): s for p, s in sorted(pts.items())} for b, pts in sorted(bb.items())}
                            for k, bb in self.seconds_by.items()}}

    @classmethod
    def from_dict(cls, d: dict) -> "CostCurve":
        if d.get("schema") != SCHEMA:
            raise ValueError(f"cost curve: schema {d.get('schema')!r}, expected {SCHEMA!r}")
        curve = cls(key=d.get("key", {}))
        for kind, bb in d["seconds"].items():
            for b, pts in bb.items():
                for p, s in pts.items():
                    curve.add(kind, int(b), int(p), float(s))
        return curve


def load_curve(model) -> CostCurve | None:
    """The cached curve for this model shape, variant and machine, or None (none cached; a file that
    cannot be read: a warning saying so, and None, so that the caller measures again)."""
    path = cost_path(cost_key(model))
    try:
        text = path.read_text()
    except OSError:
        return None
    try:
        return CostCurve.from_dict(json.loads(text))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        import warnings

        warnings.warn(f"{path}: unreadable cost curve ({type(e).__name__}: {e}); measuring it again", stacklevel=2)
        return None


def save_curve(model, curve: CostCurve, variant: str | None = None) -> Path:
    """Merge `curve` into the cached one (new points replace old ones) and write it."""
    key = cost_key(model, variant)
    path = cost_path(key)
    try:
        merged = CostCurve.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # none, or unreadable: written anew
        merged = CostCurve()
    merged.merge(curve)
    merged.key = key
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(merged.to_dict(), indent=1) + "\n")
    tmp.replace(path)
    return path


# ------------------------------------------------------------------------------ measuring
def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@grad_free_call
def time_forward(model, kind: str, batch: int, positions: int, *, prefix: int = 64, repeat: int = 5,
                 warmup: int = 1, mask_id: int | None = None, expert_budget: int | None = None) -> list[float]:
    """Seconds of `repeat` forwards of `kind` (`KINDS`) with `batch` rows of `positions` each, after a
    committed prefix of `prefix` tokens (after `warmup` untimed forwards, where a compiled model
    compiles). The cache is put back after each forward (its lengths; the states' values do not
    change the cost). `expert_budget`: the denoise block's experts shared (block expert sharing)."""
    if kind not in KINDS:
        raise ValueError(f"kind: must be one of {', '.join(KINDS)}, got {kind!r}")
    dev = model.device
    vocab = model.config.vocab_size
    mask = mask_id if mask_id is not None else (model.config.mask_token_id or 0)
    gen = torch.Generator().manual_seed(0)
    cache = model.make_cache(batch, prefix + 2 * positions + 2)
    model.step(cache, commit_ids=torch.randint(3, vocab, (batch, prefix), generator=gen).to(dev))
    ids = torch.randint(3, vocab, (batch, positions), generator=gen).to(dev)
    block = torch.full((batch, positions), mask, dtype=torch.long, device=dev)
    start = cache.lengths.clone()
    kw = dict(expert_budget=expert_budget)

    def once() -> None:
        if kind == "commit":
            model.step(cache, commit_ids=ids)
        elif kind == "denoise":
            model.step(cache, denoise_ids=block, **kw)
        elif kind == "block":
            model.step(cache, commit_ids=ids, denoise_ids=block, **kw)
        else:  # as a verify runs: then rolled back to half its draft (a partial accept, the common case)
            snap = cache.start_recording()
            model.step(cache, commit_ids=ids, denoise_ids=block, all_logits=True, **kw)
            cache.rollback(snap, [positions // 2] * batch)
        cache.lengths.copy_(start)

    for _ in range(warmup):
        once()
    out = []
    for _ in range(repeat):
        _sync(dev)
        t0 = time.perf_counter()
        once()
        _sync(dev)
        out.append(time.perf_counter() - t0)
    return out


def measure_curve(model, *, kinds=KINDS, batches=(1,), positions=POSITIONS, repeat: int = 5, prefix: int = 64,
                  progress=None, expert_budget: int | None = None, stat=statistics.median) -> CostCurve:
    """The median (`stat`) of `repeat` forwards at every (kind, batch, positions)."""
    curve = CostCurve(key=cost_key(model))
    todo = [(k, b, p) for b in batches for k in kinds for p in positions]
    for i, (k, b, p) in enumerate(todo):
        if progress:
            progress(i, len(todo), f"{k} batch {b} x {p}")
        curve.add(k, b, p, stat(time_forward(model, k, b, p, repeat=repeat, prefix=prefix, expert_budget=expert_budget)))
    if progress:
        progress(len(todo), len(todo), "done")
    return curve


def batch_bucket(batch: int) -> int:
    """The batch size whose measured forwards stand for `batch` rows: the next power of two, up to
    `BATCH_BUCKETS[-1]` (larger batches read it per position)."""
    return next((b for b in BATCH_BUCKETS if b >= batch), BATCH_BUCKETS[-1])


def curve_for(model, widths) -> CostCurve:
    """The cached curve when it covers the denoise forward, the block commit and the AR step; else a
    quick calibration (the denoise and block forwards at each width and the AR step; batch 1, the
    fastest of 8 timed forwards each: on a shared machine another process only adds time), cached
    for the next time."""
    curve = load_curve(model)
    if curve is not None and curve.has("denoise") and curve.has("block") and curve.has("commit"):
        return curve
    pts = sorted({w for w in widths if w > AR_WIDTH})
    fresh = measure_curve(model, kinds=("denoise", "block"), batches=(1,), positions=pts, repeat=CALIBRATION_REPEAT,
                          stat=min)
    fresh.add("commit", 1, 1, min(time_forward(model, "commit", 1, 1, repeat=CALIBRATION_REPEAT)))
    try:
        save_curve(model, fresh)
    except OSError:  # a read-only cache: the choice still works for this process
        return fresh
    return load_curve(model) or fresh


# ------------------------------------------------------------------------------ the choice
def trained_widths(config) -> tuple[int, ...]:
    """The block sizes the model was trained on (`config.block_sizes`), else its one block size."""
    sizes = getattr(config, "block_sizes", None) or [config.block_size]
    kept = sorted({int(s) for s in sizes if int(s) <= AUTO_MAX_WIDTH})
    return tuple(kept) or (min(int(config.block_size), AUTO_MAX_WIDTH),)


def draft_widths(config) -> tuple[int, ...]:
    """The draft lengths speculative draft "auto" chooses among: the AR step and the trained widths."""
    return (AR_WIDTH,) + tuple(w for w in trained_widths(config) if w > AR_WIDTH)


def card_tokens_per_forward(config, width: int) -> float | None:
    """The model card's tokens per forward at `width` (`config.block_tokens_per_forward`), or None."""
    table = getattr(config, "block_tokens_per_forward", None) or {}
    v = table.get(str(width), table.get(width)) if isinstance(table, dict) else None
    return None if v is None else float(v)


def prior_tokens_per_forward(config, widths) -> dict[int, float]:
    """Tokens per forward expected at each width before a row has decoded anything."""
    out = {}
    for w in widths:
        v = card_tokens_per_forward(config, w)
        out[w] = v if v is not None else min(4.0, max(1.0, w / 8))
    return out


@dataclass
class WidthChoice:
    """One decision: the width chosen, the batch it was for, and the expected tokens/s per width."""

    width: int
    batch: int
    expected: dict  # width -> expected tokens/s
    forward: int = 0  # the engine forward it applied from

    def why(self) -> str:
        parts = ", ".join(f"{w}: {v:.0f}" for w, v in sorted(self.expected.items()))
        return f"width {self.width} for {self.batch} row(s) (expected tokens/s {parts})"


class WidthPolicy:
    """Chooses a trained width from the cost curve and each row's tokens per forward so far."""

    def __init__(self, widths, prior: dict[int, float], curve: CostCurve) -> None:
        self.widths = tuple(sorted(widths))
        self.prior = {w: float(prior[w]) for w in self.widths}
        self.curve = curve

    @classmethod
    def for_model(cls, model, curve: CostCurve | None = None) -> "WidthPolicy":
        """The trained widths and the AR step (width 1), the model's prior, the measured curve."""
        widths = (AR_WIDTH,) + tuple(w for w in trained_widths(model.config) if w > AR_WIDTH)
        prior = prior_tokens_per_forward(model.config, widths) | {AR_WIDTH: 1.0}
        return cls(widths, prior, curve or curve_for(model, widths))

    def row_scale(self, tokens: int, forwards: int, expected_gain: float) -> float:
        """s_row: the row's observed gain over one token per forward against the prior's."""
        k = PRIOR_PSEUDO_FORWARDS
        gains = [p - 1 for w, p in self.prior.items() if w > AR_WIDTH] or [0.0]
        mean_gain = sum(gains) / len(gains)
        return max(0.0, (k * mean_gain + (tokens - forwards)) / (k * mean_gain + expected_gain)) if (
            k * mean_gain + expected_gain) > 0 else 1.0

    def tokens_per_forward(self, w: int, scale: float, remaining: int) -> float:
        return max(1.0, min(float(w), float(max(remaining, 1)), 1.0 + scale * (self.prior[w] - 1.0)))

    def forward_seconds(self, w: int, batch: int, tpf: float) -> float:
        if w == AR_WIDTH and self.curve.has("commit"):
            return self.curve.seconds("commit", batch, 1)  # the AR step
        blocks_per_forward = min(1.0, tpf / w)
        commit = (self.curve.seconds("block", batch, w) if self.curve.has("block")
                  else self.curve.seconds("denoise", batch, 2 * w))
        return (1 - blocks_per_forward) * self.curve.seconds("denoise", batch, w) + blocks_per_forward * commit

    def choose(self, rows: list[tuple[float, int]]) -> WidthChoice:
        """rows: (s_row, remaining tokens) per row -> the width with the most expected tokens/s
        (ties: the narrower)."""
        B = max(1, len(rows))
        expected = {}
        for w in self.widths:
            tpf = [self.tokens_per_forward(w, s, rem) for s, rem in rows] or [1.0]
            expected[w] = sum(tpf) / self.forward_seconds(w, B, sum(tpf) / len(tpf))
        best = max(self.widths, key=lambda w: (expected[w], -w))
        return WidthChoice(best, B, expected)


class DraftPolicy:
    """Speculative decoding's draft length (`block_size="auto"` in mode speculative): the width D
    with the most expected tokens per second, a verify forward of a draft of D keeping
    1 + a + ... + a^(D-1) tokens for a row whose draft tokens are kept at rate a (its own so far,
    after a prior worth `PRIOR_N` verifies: the rate at which a draft of the model's block size keeps
    the model card's tokens per forward at that width (`config.block_tokens_per_forward`, what
    diffusion commits per forward there), else `PRIOR_RATE`), over what a forward drafting D costs
    at this batch size. Width 1 (`AR_WIDTH`, where the curve has the AR step) is a draft of one: no
    denoise block, one token per forward at the cost of the AR step, so where AR wins (a batch
    large enough for the verify to turn compute-bound) the choice is AR.
    `calibrate(batch)`: a curve with the forwards at that batch, asked for at each batch bucket
    (`batch_bucket`) the curve has not measured and merged into it; None: the curve as given.
    `kind`: the curve's kind read per width ("verify", width 1 read as the "commit" forward of one;
    `STEP_KIND`: every width, 1 included, timed as the step runs)."""

    PRIOR_RATE = 0.5
    PRIOR_N = 4.0

    def __init__(self, widths, curve: CostCurve, calibrate=None, prior_rate: float | None = None,
                 kind: str = "verify") -> None:
        self.widths = tuple(sorted(widths))
        self.curve = curve
        self.calibrate = calibrate
        self.kind = kind
        self.prior_rate = self.PRIOR_RATE if prior_rate is None else prior_rate

    @classmethod
    def for_model(cls, model, measure) -> "DraftPolicy":
        """The AR step and the trained widths (`draft_widths`), over `measure(widths, batch)` (a
        CostCurve: the `STEP_KIND` at each width at that batch; batch 1 at once, every other batch
        bucket when first met) and the model card's prior."""
        widths = draft_widths(model.config)
        w = int(model.config.block_size)
        tpf = card_tokens_per_forward(model.config, w)
        return cls(widths, measure(widths, 1), lambda batch: measure(widths, batch),
                   prior_rate=None if tpf is None else cls.rate_keeping(tpf, w), kind=STEP_KIND)

    @staticmethod
    def rate_keeping(tokens: float, D: int) -> float:
        """The acceptance rate at which a draft of D keeps `tokens` per verify on average."""
        lo, hi = 0.0, 1.0
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if DraftPolicy.expected_tokens(D, mid, 1 << 30) < tokens else (lo, mid)
        return (lo + hi) / 2

    def seconds(self, D: int, batch: int) -> float:
        """A forward that drafts D (verifying the drafts before) at `batch` rows: between two batch
        buckets, linear in the batch between their costs (per position, the larger bucket's cost
        would be overrated and the smaller's underrated)."""
        lo = max((b for b in BATCH_BUCKETS if b <= batch), default=1)
        hi = batch_bucket(batch)
        for b in {lo, hi}:
            if self.calibrate is not None and not self.curve.has(self.kind, b):
                self.curve.merge(self.calibrate(b))
        ar_commit = self.kind == "verify" and D == AR_WIDTH and self.curve.has("commit")
        kind, n = ("commit", 1) if ar_commit else (self.kind, D)
        if lo == hi or batch > hi or not (self.curve.has(kind, lo) and self.curve.has(kind, hi)):
            return self.curve.seconds(kind, batch, n)
        a, b = self.curve.seconds(kind, lo, n), self.curve.seconds(kind, hi, n)
        return a + (b - a) * (batch - lo) / (hi - lo)

    def acceptance(self, kept: int, rejected: int) -> float:
        """The row's rate of keeping a draft token: kept tokens over kept + rejected ones."""
        k = self.PRIOR_N
        return (k * self.prior_rate + kept) / (k + kept + rejected)

    @staticmethod
    def expected_tokens(D: int, rate: float, remaining: int) -> float:
        e = float(D) if rate >= 1 else (1 - rate ** D) / (1 - rate)
        return max(1.0, min(e, float(max(remaining, 1))))

    def tokens_per_forward(self, D: int, rate: float, remaining: int, horizon: float | None = None) -> float:
        """What a row keeps per forward drafting D: `expected_tokens` per verify; with `horizon` (the
        row has no draft in flight: the forwards before took AR's step) the first forward drafting D
        keeps only AR's token and the draft pays from the next one on, so the gain is spread over the
        `horizon` tokens the row is expected to have left: h tokens in 1 + (h - 1) / e forwards."""
        e = self.expected_tokens(D, rate, remaining)
        if horizon is None or D == AR_WIDTH:
            return e
        h = max(1.0, min(float(horizon), float(max(remaining, 1))))
        return h / (1.0 + (h - 1.0) / e)

    def choose(self, rows: list[tuple]) -> WidthChoice:
        """rows: (acceptance rate, remaining tokens[, horizon]) per row (`tokens_per_forward`) -> the
        draft length with the most expected tokens per second (ties: the shorter)."""
        B = max(1, len(rows))
        rows = [tuple(r) + (None,) * (3 - len(r)) for r in rows] or [(self.prior_rate, 1 << 30, None)]
        expected = {D: sum(self.tokens_per_forward(D, a, rem, h) for a, rem, h in rows) / self.seconds(D, B)
                    for D in self.widths}
        best = max(self.widths, key=lambda D: (expected[D], -D))
        return WidthChoice(best, B, expected)


def memo(store: weakref.WeakKeyDictionary, *owners) -> dict:
    """The per-process memo in `store` of what `owners` (a model, then whatever else the entries
    depend on, a drafter) cost: weak keys all the way, so an owner collected (its id reused) takes
    its entries with it."""
    d = store
    for o in owners[:-1]:
        d = d.setdefault(o, weakref.WeakKeyDictionary())
    return d.setdefault(owners[-1], {})


def time_steps(make_engine, widths, batch: int, *, vocab_size: int, budget, repeat: int, passes: int = 1,
               prompt_len: int = 32) -> dict[int, float]:
    """What a step of the engine `make_engine(w)` costs as it runs at each width in `widths` with
    `batch` rows decoding random prompts (`budget(w)` new tokens each, room for every step taken):
    the steps timed in rounds across the widths after two untimed ones (the prefill; a compiled model
    compiles there), the median of each of `passes` passes of `repeat` rounds, the cheapest pass
    kept, then no width dearer than a wider one. The rounds spread load that comes and goes on a
    shared machine over every width, and the median keeps what a step pays as it varies (a rollback
    after one, none after the next); a burst of another process's load seldom spans two passes, and
    a step does not get cheaper for carrying more positions. The one cost harness for any engine
    (`speculative.step_curve`, `dflash.iteration_curve`)."""
    gen = torch.Generator().manual_seed(0)
    engines = {}
    for w in widths:
        engine = make_engine(w)
        for _ in range(batch):
            prompt = torch.randint(3, vocab_size, (prompt_len,), generator=gen).tolist()
            engine.add(RowState(prompt, SamplingParams(max_new_tokens=budget(w), ignore_eos=True), set()))
        engine.step()  # the prefill
        engine.step()
        engines[w] = engine
    best = {w: float("inf") for w in widths}
    for _ in range(passes):
        seconds = {w: [] for w in widths}
        for _ in range(repeat):
            for w, engine in engines.items():
                t0 = time.perf_counter()
                engine.step()
                seconds[w].append(time.perf_counter() - t0)
        best = {w: min(best[w], statistics.median(seconds[w])) for w in widths}
    out, dearest = {}, float("inf")
    for w in sorted(widths, reverse=True):
        dearest = min(dearest, best[w])
        out[w] = dearest
    return out
