"""Training recipes: one TOML (or JSON) file describing a run.

A recipe has a few top-level keys and one table per concern::

    name = "clover-tiny-ar"      # run name; default output dir <run root>/<name> (see [run].out)
    stage = "ar"                 # "ar" (next-token pretraining) | "diffusion" (AR -> Clover conversion)
                                 # | "drafter" (a DFlash drafter for the frozen target `init`)
    seed = 0
    init = ""                    # optional model to start from: a model or checkpoint directory, or a
                                 # run directory (= its newest checkpoint), e.g. "${runs}/clover-tiny-ar"

    [model]      # CloverConfig fields (config.json keys), used when `init` is empty
    [data]       # tokenizer, seq_len, batch_size (global, split over ranks), task_fraction, ...
    [[data.sources]]  # kind ("text" | "jsonl" | "datasets" | "stdlib"), path, weight, field, split
                 # (clover.data.sources; none: the stdlib)
    [optim]      # lr, betas, weight_decay, eps, grad_clip, aux_loss_coef, steps, warmup_steps, schedule, ...
    [adapter]    # rank, alpha, targets: train a denoise adapter only (llama backbones; rank 0 = off)
    [diffusion]  # block_sizes, ar_weight, complementary, min_mask_ratio, certainty_weight,
                 # certainty_temperature, shared_block_size (stage "diffusion" only)
    [dflash]     # block_size, layers, target_layer_ids, intermediate_size, anchors, decay, kl_weight,
                 # init (a drafter directory to continue) (stage "drafter" only)
    [run]        # out, threads, log_every, ckpt_every_s, ckpt_every_steps, keep, progress, eval_every,
                 # eval_tasks, autocast ("none" | "bf16" | "auto"), device ("auto" | "cpu" | "cuda"),
                 # parallel ("ddp" | "fsdp"), fsdp_mixed_precision ("none" | "bf16"), fsdp_cpu_offload,
                 # activation_checkpointing

Paths (`init`, `data.tokenizer`, `data.cache_dir`, `run.out`): `${runs}` stands for the run root
(`runs_root()`: `$CLOVER_RUNS`, else `${XDG_CACHE_HOME:-~/.cache}/clover/runs`), `${models}` for the
named models' root (`clover pull`; `$CLOVER_MODELS`, else `.../clover/models`) and a leading `~` for
the home directory. Relative `init` and `data.tokenizer` paths are resolved against the recipe file's
directory first, then the current working directory. Unknown keys are an error (typos should not pass
silently).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomllib
from ..paths import user_cache

STAGES = ("ar", "diffusion", "drafter")
SCHEDULES = ("cosine", "wsd", "constant")
DEVICES = ("auto", "cpu", "cuda")
PARALLEL = ("ddp", "fsdp")  # full replicas + one all-reduce | FSDP2 shards + DCP checkpoints (train/parallel.py)
RUNS_ENV = "CLOVER_RUNS"  # overrides the run root
RUNS_VAR = "${runs}"  # in a recipe path: the run root


def runs_root() -> Path:
    """Where run directories go by default: `$CLOVER_RUNS`, else `${XDG_CACHE_HOME:-~/.cache}/clover/runs`."""
    return user_cache("runs", env=RUNS_ENV)


MODELS_VAR = "${models}"  # in a recipe path: the named models' root (`clover.named.models_root`)


def expand_path(p: str) -> str:
    """`${runs}` -> the run root, `${models}` -> the named models' root, a leading `~` -> the home
    directory; anything else unchanged."""
    if RUNS_VAR in p:
        p = p.replace(RUNS_VAR, str(runs_root()))
    if MODELS_VAR in p:
        from ..named import models_root

        p = p.replace(MODELS_VAR, str(models_root()))
    return os.path.expanduser(p)


class RecipeError(ValueError):
    """A recipe file that does not describe a run."""


@dataclass
class DataSpec:
    tokenizer: str = "build/tokenizer"
    seq_len: int = 256
    batch_size: int = 16  # global batch (sequences per optimizer step, summed over ranks)
    task_fraction: float = 0.6
    seed: int | None = None  # data-stream seed (default: the recipe seed); rank r reads seed*1000 + r
    cache_dir: str | None = None
    max_files: int | None = None  # first N stdlib files only (tests)
    task_weights: dict[str, float] = field(default_factory=dict)  # per-kind sampling weights (default 1 each)
    distill_fraction: float = 0.0  # share of documents from the self-distillation set (AR greedy of `init`)
    distill_tasks: int = 4000  # task prompts in that set
    distill_code: int = 200  # function headers in that set
    distill_chat: int = 0  # instructions in that set, written with the model's chat template (clover.data.instructions)
    distill_chat_tokens: int = 48  # longest AR answer to one of them
    distill_code_tokens: int = 96  # longest AR continuation of a function header
    distill_task_tokens: int = 0  # 0: a task's AR answer up to the end of its line; N: N tokens, past the line
    distill_task_line: bool | None = None  # a task's answer stops at its line's end, at most distill_task_tokens
    # tokens (default: the line where distill_task_tokens is 0, with the set's own cap of 24 tokens)
    distill_batch: int = 16  # prompts decoded together while the set is built (AR is memory-bound: wider is cheaper)
    # [[data.sources]]: local text files, JSON Lines, saved `datasets`, the stdlib, mixed by weight
    # (clover.data.sources); empty = the stdlib (+ the tasks, as task_fraction says)
    sources: tuple[dict, ...] = ()


@dataclass
class AdapterSpec:
    """Train a denoise adapter instead of the whole model (`clover.models.llama`): low-rank factors
    on `targets`, active on the denoise positions only, plus the mask embedding; 0 = off."""

    rank: int = 0
    alpha: float = 0.0  # 0: 2 x rank
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class OptimSpec:
    lr: float = 2.5e-3
    min_lr_ratio: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    grad_accum: int = 1  # micro-batches per optimizer step: each rank's rows are split in this many forwards
    aux_loss_coef: float = 0.01
    steps: int = 1000
    warmup_steps: int = 100
    schedule: str = "cosine"
    decay_fraction: float = 0.2  # "wsd": length of the final linear decay, as a fraction of steps


@dataclass
class DiffusionSpec:
    block_sizes: tuple[int, ...] = (8, 16, 32, 64)
    ar_weight: float = 0.5
    complementary: bool = True
    min_mask_ratio: float = 1e-3  # t ~ U(min_mask_ratio, 1]
    certainty_weight: float = 0.0  # entropy minimisation on masked positions already predicted right
    certainty_temperature: float = 0.5  # the temperature that entropy is measured at
    shared_block_size: bool = False  # one block size per micro-batch, the same on all ranks (always so under FSDP)


@dataclass
class DFlashSpec:
    """Stage "drafter": a DFlash drafter (`clover.models.dflash`) trained for the frozen target `init`
    on the target's own greedy outputs (`data.distill_fraction`), `train.losses.dflash_step_loss`."""

    block_size: int = 16  # the anchor + block_size - 1 drafts
    layers: int = 1  # draft layers
    target_layer_ids: tuple[int, ...] = ()  # () = spread over the target as in the published drafters
    intermediate_size: int = 0  # 0 = 4 x hidden
    anchors: int = 16  # random anchors (blocks) per sequence
    decay: float = 7.0  # position k of a block weighs exp(-(k-1)/decay) (the paper's gamma for block 16)
    kl_weight: float = 0.5  # KL to the target's distribution; the rest is CE on its argmax
    init: str = ""  # a drafter directory to start from
    kl_top_k: int = 0  # 0: the target runs every step, KL over the whole (draft) vocabulary; K: its outputs on
    #                    each document are computed once and kept (`losses.TargetMemo`), KL over its top K tokens
    draft_vocab: int = 0  # 0: draft over the target's whole vocabulary; N: over the N tokens most frequent in the
    #                       distillation set (`DFlashConfig.draft_vocab_size`: a smaller head for a small target)


@dataclass
class RunSpec:
    out: str | None = None
    threads: int = 2
    log_every: int = 10
    ckpt_every_s: float = 300.0
    ckpt_every_steps: int = 0  # 0 = time-based only
    keep: int = 2
    progress: bool = True
    eval_every: int = 0  # steps; 0 = off. Held-out task-answer metrics (teacher-forced) to log.jsonl
    eval_tasks: int = 100
    autocast: str = "none"  # "bf16": matmuls in bfloat16 under torch.autocast (fp32 master weights and loss);
    # "auto": bf16 where the device multiplies bf16 natively (CUDA, CPUs with AVX-512 BF16/AMX), else none
    device: str = "auto"  # "auto" (CUDA when available), "cpu" or "cuda"; under torchrun rank r takes cuda:LOCAL_RANK
    parallel: str = "ddp"  # "ddp": every rank holds the full model; "fsdp": FSDP2 shards (params, grads, optimizer)
    fsdp_mixed_precision: str = "none"  # "bf16": FSDP gathers and computes in bf16, reduces gradients in fp32
    fsdp_cpu_offload: bool = False  # FSDP shards, gradients and optimizer state in CPU memory (CUDA runs)
    activation_checkpointing: bool = False  # recompute each decoder layer in backward (either mode)


@dataclass
class Recipe:
    name: str = "run"
    stage: str = "ar"
    seed: int = 0
    init: str = ""
    model: dict[str, Any] = field(default_factory=dict)
    data: DataSpec = field(default_factory=DataSpec)
    optim: OptimSpec = field(default_factory=OptimSpec)
    diffusion: DiffusionSpec = field(default_factory=DiffusionSpec)
    adapter: AdapterSpec = field(default_factory=AdapterSpec)
    dflash: DFlashSpec = field(default_factory=DFlashSpec)
    run: RunSpec = field(default_factory=RunSpec)
    source: str | None = None  # the file it came from (not a recipe key)

    def validate(self) -> None:
        if self.stage not in STAGES:
            raise RecipeError(f"stage must be one of {STAGES}, got {self.stage!r}")
        if self.optim.schedule not in SCHEDULES:
            raise RecipeError(f"optim.schedule must be one of {SCHEDULES}, got {self.optim.schedule!r}")
        if not self.init and not self.model:
            raise RecipeError("a recipe needs either `init` (a model directory) or a [model] table")
        if self.optim.steps <= 0:
            raise RecipeError("optim.steps must be positive")
        if self.data.seq_len < 2 or self.data.batch_size < 1:
            raise RecipeError("data.seq_len must be >= 2 and data.batch_size >= 1")
        if not 0.0 <= self.data.distill_fraction <= 1.0:
            raise RecipeError(f"data.distill_fraction must be in [0, 1], got {self.data.distill_fraction}")
        if self.data.distill_task_tokens < 0:
            raise RecipeError(f"data.distill_task_tokens must be >= 0 (0: the answer line), got {self.data.distill_task_tokens}")
        if self.data.distill_fraction and not self.init:
            raise RecipeError("data.distill_fraction needs `init`: the set is the init model's own AR greedy output")
        if self.optim.grad_accum < 1 or self.data.batch_size % self.optim.grad_accum:
            raise RecipeError(
                f"optim.grad_accum ({self.optim.grad_accum}) must be >= 1 and divide data.batch_size ({self.data.batch_size})"
            )
        try:
            from ..data.tasks import check_task_weights

            check_task_weights(self.data.task_weights)
        except ValueError as e:
            raise RecipeError(f"data.task_weights: {e}") from None
        if self.run.autocast not in ("none", "bf16", "auto"):
            raise RecipeError(f"run.autocast must be 'none', 'bf16' or 'auto', not {self.run.autocast!r}")
        if self.run.device not in DEVICES:
            raise RecipeError(f"run.device must be one of {DEVICES}, not {self.run.device!r}")
        if self.run.parallel not in PARALLEL:
            raise RecipeError(f"run.parallel must be one of {PARALLEL}, not {self.run.parallel!r}")
        if self.run.fsdp_mixed_precision not in ("none", "bf16"):
            raise RecipeError(f"run.fsdp_mixed_precision must be 'none' or 'bf16', not {self.run.fsdp_mixed_precision!r}")
        if self.run.parallel != "fsdp" and (self.run.fsdp_mixed_precision != "none" or self.run.fsdp_cpu_offload):
            raise RecipeError("run.fsdp_mixed_precision / run.fsdp_cpu_offload need run.parallel = 'fsdp'")
        if self.stage == "drafter":
            f = self.dflash
            if not self.init:
                raise RecipeError("stage 'drafter' needs `init`: the target model the drafter is trained for")
            if f.block_size < 2 or f.layers < 1 or f.anchors < 1 or f.decay <= 0 or not 0 <= f.kl_weight <= 1:
                raise RecipeError("dflash: block_size must be >= 2, layers and anchors >= 1, decay > 0, kl_weight in [0, 1]")
            if f.kl_top_k < 0:
                raise RecipeError(f"dflash.kl_top_k must be >= 0 (0: the exact KL, the target run every step), got {f.kl_top_k}")
            if f.draft_vocab < 0:
                raise RecipeError(f"dflash.draft_vocab must be >= 0 (0: the target's whole vocabulary), got {f.draft_vocab}")
            if self.data.seq_len <= f.block_size:
                raise RecipeError(f"data.seq_len ({self.data.seq_len}) must exceed dflash.block_size ({f.block_size})")
        if self.stage == "diffusion":
            if not (self.diffusion.certainty_weight >= 0 and self.diffusion.certainty_temperature > 0):
                raise RecipeError("diffusion.certainty_weight must be >= 0 and diffusion.certainty_temperature > 0")
            for b in self.diffusion.block_sizes:
                if b < 1 or self.data.seq_len % b:
                    raise RecipeError(f"block size {b} must divide data.seq_len ({self.data.seq_len})")

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("source")
        return d

    @property
    def out_dir(self) -> Path:
        return Path(expand_path(self.run.out)) if self.run.out else runs_root() / self.name


def _build(cls, raw: dict[str, Any], where: str):
    if not isinstance(raw, dict):
        raise RecipeError(f"[{where}] must be a table")
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise RecipeError(f"unknown key(s) in [{where}]: {', '.join(unknown)}; known: {', '.join(sorted(names))}")
    kw = {}
    for k, v in raw.items():
        if isinstance(v, list):
            v = tuple(v)
        kw[k] = v
    return cls(**kw)


def recipe_from_dict(raw: dict[str, Any], *, base: Path | None = None, source: str | None = None) -> Recipe:
    raw = dict(raw)
    sub = {
        "data": DataSpec,
        "optim": OptimSpec,
        "diffusion": DiffusionSpec,
        "adapter": AdapterSpec,
        "dflash": DFlashSpec,
        "run": RunSpec,
    }
    kw: dict[str, Any] = {}
    for key, cls in sub.items():
        kw[key] = _build(cls, raw.pop(key, {}), key)
    model = raw.pop("model", {})
    if not isinstance(model, dict):
        raise RecipeError("[model] must be a table")
    top = {f.name for f in dataclasses.fields(Recipe)} - set(sub) - {"model", "source"}
    unknown = sorted(set(raw) - top)
    if unknown:
        raise RecipeError(f"unknown top-level key(s): {', '.join(unknown)}")
    r = Recipe(model=dict(model), source=source, **kw, **raw)
    r.data.tokenizer = expand_path(r.data.tokenizer)
    if r.data.cache_dir:
        r.data.cache_dir = expand_path(r.data.cache_dir)
    if r.run.out:
        r.run.out = expand_path(r.run.out)
    if r.init:
        r.init = expand_path(r.init)
    if r.data.sources:
        from ..data.sources import SourceError, parse_sources

        try:
            r.data.sources = tuple(src.as_dict() for src in parse_sources(r.data.sources, base=base))
        except SourceError as e:
            raise RecipeError(str(e)) from None
    if base is not None:
        r.data.tokenizer = _resolve(r.data.tokenizer, base)
        if r.init:
            r.init = _resolve(r.init, base)
    if r.dflash.init:
        r.dflash.init = expand_path(r.dflash.init)
        if base is not None:
            r.dflash.init = _resolve(r.dflash.init, base)
    if r.init:
        r.init = _newest_checkpoint_of_run(r.init)
    r.validate()
    return r


def _newest_checkpoint_of_run(init: str) -> str:
    """A run directory (no config.json, but ckpt/ or recipe.json) stands for its newest checkpoint."""
    d = Path(init)
    if not d.is_dir() or (d / "config.json").is_file():
        return init
    if not (d / "ckpt").is_dir() and not (d / "recipe.json").is_file():
        return init
    from .checkpointing import latest_checkpoint

    latest = latest_checkpoint(d / "ckpt")
    if latest is None:
        raise RecipeError(f"init: {d} is a run directory without a finished checkpoint under {d / 'ckpt'}")
    return str(latest)


def _resolve(p: str, base: Path) -> str:
    path = Path(p)
    if path.is_absolute():
        return str(path)
    for root in (base, Path.cwd()):
        if (root / path).exists():
            return str((root / path).resolve())
    return p


def load_recipe(path: str | Path, overrides: dict[str, Any] | None = None) -> Recipe:
    """Read a .toml or .json recipe; `overrides` maps dotted keys ("optim.steps") to values."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"{path}: no such recipe file")
    text = path.read_text()
    if path.suffix == ".json":
        raw = json.loads(text)
    else:
        raw = tomllib.loads(text)
    for key, value in (overrides or {}).items():
        apply_override(raw, key, value)
    return recipe_from_dict(raw, base=path.resolve().parent, source=str(path))


def load_run(path: str | Path, overrides: dict[str, Any] | None = None) -> Recipe:
    """A recipe file, or a run directory's recipe.json (the run continues in that directory);
    `overrides` as in `load_recipe`."""
    path = Path(path)
    if not path.is_dir():
        return load_recipe(path, overrides)
    raw = json.loads((path / "recipe.json").read_text())
    raw.setdefault("run", {})["out"] = raw.get("run", {}).get("out") or str(path)
    for key, value in (overrides or {}).items():
        apply_override(raw, key, value)
    return recipe_from_dict(raw, source=str(path / "recipe.json"))


def apply_override(raw: dict[str, Any], dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    d = raw
    for p in parts[:-1]:
        d = d.setdefault(p, {})
    d[parts[-1]] = value
