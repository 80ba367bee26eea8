"""The training loop: stage "ar" (next-token pretraining) and stage "diffusion" (AR -> Clover).

Data-parallel: run under `torchrun --nproc_per_node N`; ranks join a process group (gloo on CPU,
nccl with rank r on cuda:LOCAL_RANK when `run.device` resolves to CUDA), each reads its own data
stream (seed + rank) with `batch_size / N` rows, and gradients are averaged with one flattened
all-reduce per step before clipping. (An explicit all-reduce rather than the DDP wrapper:
stage 2 calls `forward_block_diffusion`, which a wrapper would not see, and MoE experts or Clover
parameters that receive no tokens simply contribute zeros.)

Sharded: with `run.parallel = "fsdp"` the model is split with FSDP2 (`parallel.py`): each rank
holds 1/N of the parameters, gradients and optimizer state, and checkpoints are distributed (DCP,
`checkpointing.write_dcp_checkpoint`). Losses, accumulation, the router loss and the separately
clipped Clover gains are the same code in both modes.

Resume is exact: model, optimizer, each rank's data-stream position and RNG states are restored,
so an interrupted run continues with the same losses as an uninterrupted one. A checkpoint written
by another number of ranks is refused unless `--reset-data` (the per-rank streams and RNG states
cannot be remapped; the weights and optimizer can, and are).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import load_model
from ..models import config_from_dict
from ..models import build_model, parameter_counts
from ..models.clover import convert_model
from ..models.layers import CLOVER_PARAMETERS, is_clover_parameter
from ..tokenizer import MASK_TOKEN, copy_tokenizer_files
from . import checkpointing as ck
from . import parallel
from .dist import Dist, resolve_device  # noqa: F401  (resolve_device: imported from here by callers)
from .losses import TargetMemo, ar_step_loss, dflash_step_loss, diffusion_step_loss
from ..data.sources import parse_sources
from .recipes import Recipe



def lr_at(step: int, recipe: Recipe) -> float:
    """Learning rate for optimizer step `step` (0-based)."""
    o = recipe.optim
    if o.warmup_steps and step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    floor = o.lr * o.min_lr_ratio
    if o.schedule == "constant":
        return o.lr
    if o.schedule == "wsd":
        decay = max(1, int(o.steps * o.decay_fraction))
        start = o.steps - decay
        if step < start:
            return o.lr
        frac = min(1.0, (step - start + 1) / decay)
        return o.lr + (floor - o.lr) * frac
    span = max(1, o.steps - o.warmup_steps)
    frac = min(1.0, (step - o.warmup_steps) / span)
    return floor + 0.5 * (o.lr - floor) * (1.0 + math.cos(math.pi * frac))


# --------------------------------------------------------------------------- model / data
def build_or_load_model(recipe: Recipe, tokenizer_ids: dict[str, int]):
    if recipe.init:
        if ck.checkpoint_format(recipe.init) == "dcp":  # a sharded (FSDP) checkpoint of a previous phase
            model = ck.load_dcp_model(recipe.init, dtype=torch.float32)
        else:
            model = load_model(recipe.init, dtype=torch.float32)
        cfg = model.config
        if recipe.stage == "diffusion" and not cfg.is_clover:
            model = to_clover(model, tokenizer_ids.get(MASK_TOKEN))
        model.train()
        return model
    fields = dict(recipe.model)
    fields.setdefault("eos_token_id", tokenizer_ids.get("<|endoftext|>"))
    fields.setdefault("pad_token_id", tokenizer_ids.get("<|pad|>"))
    if fields.get("model_type", "clover") == "clover":
        fields.setdefault("model_type", "clover")
        fields.setdefault("mask_token_id", tokenizer_ids.get(MASK_TOKEN))
    cfg = config_from_dict(fields, source=f"recipe {recipe.source or recipe.name} [model]")
    model = build_model(cfg, device="cpu", dtype=torch.float32)
    model.init_weights(seed=recipe.seed)
    model.train()
    return model


def build_drafter_for(recipe: Recipe, target, distill=None, tokenizer: str | None = None):
    """Stage "drafter": the drafter to train (from `dflash.init`, or new with random weights) for `target`;
    a new one with `dflash.draft_vocab` drafts over the tokens most frequent in `distill` (read with `tokenizer`)."""
    from ..checkpoint import load_drafter
    from ..models.dflash import build_drafter, drafter_config_for

    f = recipe.dflash
    if f.init:
        drafter = load_drafter(f.init, target, dtype=torch.float32)
    else:
        cfg = drafter_config_for(target.config, target_layer_ids=list(f.target_layer_ids) or None,
                                 num_hidden_layers=f.layers, intermediate_size=f.intermediate_size or None,
                                 block_size=f.block_size, draft_vocab_size=f.draft_vocab or None)
        drafter = build_drafter(cfg, seed=recipe.seed)
        if f.draft_vocab:
            from ..data.distill import frequent_tokens

            drafter.set_draft_vocab(frequent_tokens(distill, tokenizer, f.draft_vocab, target.config.vocab_size))
    drafter.train()
    return drafter


def to_clover(model, mask_token_id: int | None):
    """An AR model (either backbone) -> a clover model with the Clover parameters at their initial values."""
    if mask_token_id is None:
        raise ValueError("stage 'diffusion' from an AR model needs <|mask|> in the tokenizer, and this one has none: "
                         "run `clover convert AR_DIR CLOVER_DIR` first (it adds the token and the Clover parameters) "
                         "and set init = CLOVER_DIR")
    return convert_model(model, mask_token_id)


def make_stream(recipe: Recipe, rank: int, world: int, tokenizer: str, distill=None, *, verbose: bool = False):
    from ..data.mix import PackedStream

    if recipe.data.batch_size % (world * recipe.optim.grad_accum):
        raise ValueError(
            f"data.batch_size {recipe.data.batch_size} is not divisible by {world} ranks x "
            f"optim.grad_accum {recipe.optim.grad_accum}"
        )
    return PackedStream(
        tokenizer,
        "train",
        seq_len=recipe.data.seq_len,
        batch_size=recipe.data.batch_size // world,
        task_fraction=recipe.data.task_fraction,
        seed=(recipe.seed if recipe.data.seed is None else recipe.data.seed) * 1000 + rank,
        cache_dir=recipe.data.cache_dir,
        max_files=recipe.data.max_files,
        task_weights=recipe.data.task_weights,
        distill=distill,
        distill_fraction=recipe.data.distill_fraction,
        sources=parse_sources(recipe.data.sources) or None,
        verbose=verbose,
    )


def tokenizer_special_ids(path: str) -> dict[str, int]:
    from ..data.tokenizer import load_tokenizer

    tok = load_tokenizer(path)
    return {t: tok.token_to_id(t) for t in ("<|endoftext|>", "<|pad|>", MASK_TOKEN) if tok.token_to_id(t) is not None}


# the per-head gains among Clover's parameters (not the conv weight)
CLOVER_GAIN_PARAMS = tuple(n for n in CLOVER_PARAMETERS if not n.endswith(".weight"))


def param_groups(model, weight_decay: float) -> tuple[list[dict], list[torch.nn.Parameter], dict[int, str]]:
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append((n, p))
    groups = [
        {"params": [p for _, p in decay], "weight_decay": weight_decay},
        {"params": [p for _, p in no_decay], "weight_decay": 0.0},
    ]
    ordered = decay + no_decay
    names = {i: n for i, (n, _) in enumerate(ordered)}
    return groups, [p for _, p in ordered], names


# --------------------------------------------------------------------------- trainer
def resolve_autocast(setting: str, device: torch.device) -> tuple[bool, str | None]:
    """`run.autocast` -> (bf16 autocast on?, a note for the log). "auto" turns it on only where the
    device multiplies bf16 natively (`clover.precision`); an explicit "bf16" is honoured, with a
    warning where it is slow (measured on an AVX2 CPU: a stage-2 step 7-10x slower than float32)."""
    from ..precision import cpu_capability, native_half_matmul

    native = native_half_matmul(torch.bfloat16, device.type)
    where = f"this CPU ({cpu_capability()})" if device.type == "cpu" else str(device)
    if setting == "auto":
        return native, None if native else f"autocast auto -> none: {where} has no native bf16 matmul; training in float32"
    if setting == "bf16" and not native:
        return True, (f"warning: run.autocast = 'bf16' on {where}, which has no native bf16 matmul: steps run several "
                      "times slower than float32; use 'auto' or 'none'")
    return setting == "bf16", None


class Trainer:
    def __init__(self, recipe: Recipe, *, resume: bool | None = None, quiet: bool = False, reset_data: bool = False) -> None:
        self.recipe = recipe
        self.reset_data = reset_data
        self.dist = Dist(recipe.run.device)
        self.device = self.dist.device
        self.quiet = quiet
        # a status line per setup phase, and bars where the work is countable: a first run spends
        # minutes before its first step (the data cache, the model, torch's compiler for AdamW)
        self.announce = self.dist.main and recipe.run.progress and not quiet
        torch.set_num_threads(max(1, recipe.run.threads))
        torch.manual_seed(recipe.seed)
        self.out = recipe.out_dir
        self.ckpt_root = self.out / "ckpt"
        latest = ck.latest_checkpoint(self.ckpt_root)
        if resume is True and latest is None:
            raise FileNotFoundError(f"--resume: no checkpoint under {self.ckpt_root}")
        self.resume_from = latest if resume is not False else None
        if self.dist.main:
            self.out.mkdir(parents=True, exist_ok=True)
        self.dist.barrier()
        self._say(f"tokenizer: {recipe.data.tokenizer}")
        self.tokenizer = self._tokenizer_dir()
        ids = tokenizer_special_ids(self.tokenizer)
        self.sharded = recipe.run.parallel == "fsdp" and self.dist.active
        # FSDP from a model directory: built on meta, sharded, then each rank reads only its shards
        self.meta_start = self.sharded and parallel.meta_start_reason(recipe) is None
        self._say(f"model: loading {recipe.init}" if recipe.init else
                  f"model: building the recipe's [model] (seed {recipe.seed})")
        if self.meta_start:
            self.model, meta_extra = parallel.build_on_meta(recipe, ids.get("<|mask|>"))
        else:
            self.model = build_or_load_model(recipe, ids).to(self.device)
        self.target = None
        distill = None
        if recipe.stage == "drafter":  # the loaded model is the frozen target; the drafter is trained
            self.target = self.model.eval().requires_grad_(False)
            distill = self._distill_set()  # first: a draft vocabulary is counted on the target's outputs
            self._say("drafter: " + (f"loading {recipe.dflash.init}" if recipe.dflash.init else "building a new one"))
            self.model = build_drafter_for(recipe, self.target, distill, self.tokenizer).to(self.device)
        cfg = self.model.config
        if recipe.stage == "drafter":
            pass
        elif recipe.stage == "ar":
            for n, p in self.model.named_parameters():  # unused in commit mode
                if is_clover_parameter(n):
                    p.requires_grad_(False)
        else:
            if not cfg.is_clover or cfg.mask_token_id is None:
                raise ValueError("stage 'diffusion' needs a clover model with mask_token_id")
            if not hasattr(self.model, "forward_block_diffusion"):
                raise RuntimeError("this model has no forward_block_diffusion(clean_ids, noisy_ids, block_size)")
        if recipe.stage != "drafter":
            distill = self._distill_set()  # built from the full model, before it is sharded
        if recipe.adapter.rank:
            self._attach_adapter()
        if recipe.run.activation_checkpointing:
            parallel.apply_activation_checkpointing(self.model)
        if self.sharded:
            parallel.shard_model(self.model, device=self.device, mixed_precision=recipe.run.fsdp_mixed_precision,
                                 cpu_offload=recipe.run.fsdp_cpu_offload)
            if self.meta_start:
                parallel.load_shards(self.model, recipe.init, meta_extra, device=self.device)
        o = recipe.optim
        self._say("optimizer: AdamW")
        groups, self.params, self.names = param_groups(self.model, o.weight_decay)
        self.opt = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, foreach=True)
        if recipe.stage == "drafter":  # the target's greedy outputs, each in its own context
            from ..data.distill import DistillRows

            if distill is None:
                raise ValueError("stage 'drafter' trains on the target's own greedy outputs: set data.distill_fraction = 1")
            self.stream = DistillRows(distill, self.tokenizer, seq_len=recipe.data.seq_len,
                                      batch_size=recipe.data.batch_size // self.dist.world,
                                      seed=(recipe.seed if recipe.data.seed is None else recipe.data.seed) * 1000 + self.dist.rank,
                                      task_fraction=recipe.data.task_fraction, pad_id=ids.get("<|pad|>", 0),
                                      min_len=recipe.dflash.block_size + 1, tail=recipe.dflash.block_size - 1)
        else:
            self._say("data: " + (", ".join(s.label for s in parse_sources(recipe.data.sources)) or "the stdlib")
                      + f" and tasks ({recipe.data.task_fraction:g} of rows)")
            self.stream = make_stream(recipe, self.dist.rank, self.dist.world, self.tokenizer, distill,
                                      verbose=self.announce)
        self.memo = TargetMemo(recipe.dflash.kl_top_k) if recipe.stage == "drafter" and recipe.dflash.kl_top_k else None
        self.gen = torch.Generator().manual_seed(recipe.seed * 7919 + 17 + self.dist.rank)
        # stage 2 under FSDP: one forward per micro-batch, the same on every rank, so each micro-batch
        # takes one block size from a generator all ranks share (the masks still come from `gen`)
        shared = recipe.stage == "diffusion" and (recipe.diffusion.shared_block_size or recipe.run.parallel == "fsdp")
        self.size_gen = torch.Generator().manual_seed(recipe.seed * 7919 + 4243) if shared else None
        self.autocast, self.autocast_note = resolve_autocast(recipe.run.autocast, self.device)
        self.step = 0
        self.tokens = 0
        self.elapsed = 0.0
        if self.resume_from is not None:
            self._say(f"checkpoint: resuming from {self.resume_from}")
            self._load(self.resume_from)
        self.losses: list[float] = []

    # -- setup helpers
    def _say(self, line: str) -> None:
        """One status line of the setup (rank 0, stderr; not with `--quiet` or `run.progress = false`)."""
        if self.announce:
            print(f"clover train: {line}", file=sys.stderr, flush=True)

    def _distill_set(self):
        """The run's self-distillation set (built once, by rank 0, from the init model), or None."""
        d = self.recipe.data
        if not d.distill_fraction:
            return None
        from ..data.distill import ensure_distill_set, load_distill_set

        def teacher():  # the weights this run starts from, decoding in AR mode
            from ..api import LLM
            from ..tokenizer import Tokenizer

            model = self.target if self.target is not None else self.model
            cfg = model.config
            tok = Tokenizer.from_dir(self.tokenizer, eos_token_id=cfg.eos_token_ids[0] if cfg.eos_token_ids else None,
                                     mask_token_id=cfg.mask_token_id)
            return LLM(model, tok, Path(self.recipe.init))

        path = self.out / "distill"
        if self.dist.main:
            was_training = self.model.training
            self.model.eval()
            ensure_distill_set(path, teacher, n_tasks=d.distill_tasks, n_code=d.distill_code, n_chat=d.distill_chat,
                               chat_tokens=d.distill_chat_tokens, code_tokens=d.distill_code_tokens,
                               batch_size=d.distill_batch,
                               task_line=not d.distill_task_tokens if d.distill_task_line is None else d.distill_task_line,
                               **({"task_tokens": d.distill_task_tokens} if d.distill_task_tokens else {}),
                               seed=self.recipe.seed, progress=not self.quiet)
            self.model.train(was_training)
        self.dist.barrier()
        return load_distill_set(path)

    def _attach_adapter(self) -> None:
        """`[adapter]`: only the denoise adapter trains (attached fresh unless `init` has one)."""
        a, m = self.recipe.adapter, self.model
        if self.recipe.stage != "diffusion" or not hasattr(m, "attach_denoise_adapter"):
            raise ValueError("[adapter] needs stage 'diffusion' and a backbone with a denoise adapter (llama)")
        if m.config.denoise_adapter:
            from ..models.llama import is_adapter_parameter

            for n, p in m.named_parameters():
                p.requires_grad_(is_adapter_parameter(n))
        else:
            m.attach_denoise_adapter(a.rank, a.alpha or None, tuple(a.targets), seed=self.recipe.seed)
        m.train()

    def _tokenizer_dir(self) -> str:
        """Copy the tokenizer into the run directory once, so the run is self-contained."""
        src = Path(self.recipe.data.tokenizer)
        dst = self.out / "tokenizer"
        if self.dist.main and not (dst / "tokenizer.json").is_file():
            if not (src / "tokenizer.json").is_file():
                raise FileNotFoundError(
                    f"tokenizer {src} not found; set data.tokenizer to a model directory (the bundled model's: "
                    f"src/clover/assets/clover-tiny) or build one with `clover train tokenizer {src} --vocab-size 4096`"
                )
            dst.mkdir(parents=True, exist_ok=True)
            copy_tokenizer_files(src, dst)  # a model directory as the source: its weights stay behind
        self.dist.barrier()
        return str(dst)

    def _load(self, path: Path) -> None:
        fmt = ck.checkpoint_format(path)
        want = "dcp" if self.recipe.run.parallel == "fsdp" else "safetensors"
        if fmt != want:
            raise ValueError(
                f"{path} is a {fmt} checkpoint and this run has run.parallel = {self.recipe.run.parallel!r}; resume it "
                f"with run.parallel = {'fsdp' if fmt == 'dcp' else 'ddp'} (or export it and start a new run with init = the export)"
            )
        state = json.loads((path / ck.STATE_FILE).read_text())
        saved_world = state.get("world_size", 1)
        same_world = saved_world == self.dist.world
        if not same_world and not self.reset_data:
            raise ValueError(
                f"{path} was written by {saved_world} ranks; this run has {self.dist.world}. The weights and optimizer "
                f"state would load on any number of ranks, but each rank's data-stream position and RNG state cannot be "
                f"mapped onto another world size: resume on {saved_world} ranks, or pass --reset-data to continue with "
                f"fresh data streams (weights, optimizer, step and token count kept)"
            )
        if fmt == "dcp":
            ck.read_dcp_checkpoint(path, self.model, self.opt)
        else:
            _, model_t, opt_t = ck.read_checkpoint(path)
            tied = self.model.config.tie_word_embeddings  # a tied lm_head is not stored (save_model)
            missing, unexpected = self.model.load_state_dict(model_t, strict=False)
            missing = [k for k in missing if not (tied and k == "lm_head.weight")]
            if missing or unexpected:
                raise ValueError(f"{path}: checkpoint does not match the model: missing {missing[:3]}, "
                                 f"unexpected {list(unexpected)[:3]}")
            ck.load_optimizer(self.opt, self.names, opt_t, state["optimizer"])
        if self.reset_data:  # a deliberate change of the data (e.g. an annealing mix): the new stream starts fresh
            self._log_text(f"data stream reset: {self.stream.state_dict()['config']}")
        else:
            self.stream.load_state_dict(state["ranks"][self.dist.rank]["stream"])
        if same_world:
            ck.restore_python_rng(state["ranks"][self.dist.rank]["python_rng"])
            rngs = ck.read_rng(path, self.dist.rank)
            ck.restore_rng(rngs, self.gen)
            if self.size_gen is not None and "block_size_gen" in rngs:
                self.size_gen.set_state(rngs["block_size_gen"])
        self.step = int(state["step"])
        self.tokens = int(state.get("tokens", 0))
        self.elapsed = float(state.get("elapsed_s", 0.0))
        self._log_text(f"resumed from {path} at step {self.step}")

    def save(self) -> Path | None:
        mine = {"stream": self.stream.state_dict(), "python_rng": ck.python_rng_state()}
        rngs = ck.rng_tensors(self.gen)
        if self.size_gen is not None:
            rngs["block_size_gen"] = self.size_gen.get_state().clone()
        gathered = self.dist.gather((mine, rngs))
        extra = {"tokens": self.tokens, "elapsed_s": self.elapsed, "world_size": self.dist.world,
                 "recipe": self.recipe.to_dict()}
        if self.recipe.run.parallel == "fsdp":  # every rank writes its shards
            path = ck.write_dcp_checkpoint(
                self.ckpt_root, self.step, model=self.model, opt=self.opt, main=self.dist.main, barrier=self.dist.barrier,
                rank_states=[g[0] for g in gathered], rng_by_rank=[g[1] for g in gathered], extra=extra,
                keep=self.recipe.run.keep,
            )
            self._log_text(f"checkpoint {path}")
            return path
        path = None
        if self.dist.main:
            path = ck.write_checkpoint(
                self.ckpt_root,
                self.step,
                model=self.model,
                opt=self.opt,
                names=self.names,
                rank_states=[g[0] for g in gathered],
                rng_by_rank=[g[1] for g in gathered],
                extra=extra,
                keep=self.recipe.run.keep,
            )
            self._log_text(f"checkpoint {path}")
        self.dist.barrier()
        return path

    # -- logging
    def _log_text(self, line: str) -> None:
        if not self.dist.main:
            return
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        with open(self.out / "train.log", "a") as f:
            f.write(f"{stamp} {line}\n")

    def _log_json(self, rec: dict[str, Any]) -> None:
        if not self.dist.main:
            return
        with open(self.out / "log.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")

    # -- one optimizer step
    def _loss(self, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        r, cfg = self.recipe, self.model.config
        top_k = cfg.num_experts_per_tok if cfg.has_experts else 0  # the router's aux loss; none without experts
        if r.stage == "drafter":
            f = r.dflash
            loss, stats = dflash_step_loss(self.model, self.target, ids, self.gen, anchors=f.anchors, decay=f.decay,
                                           kl_weight=f.kl_weight, pad_id=self.stream.pad_id, memo=self.memo)
        elif r.stage == "ar":
            loss, stats = ar_step_loss(self.model, ids, aux_coef=r.optim.aux_loss_coef, top_k=top_k)
        else:
            d = r.diffusion
            loss, stats = diffusion_step_loss(
                self.model, ids, self.gen,
                mask_token_id=cfg.mask_token_id, block_sizes=tuple(d.block_sizes), ar_weight=d.ar_weight,
                aux_coef=r.optim.aux_loss_coef, top_k=top_k,
                complementary=d.complementary, min_mask_ratio=d.min_mask_ratio,
                certainty_weight=d.certainty_weight, certainty_temperature=d.certainty_temperature,
                block_size_gen=self.size_gen,
            )
        return loss, stats

    def train_step(self, ids: torch.Tensor) -> dict[str, float]:
        """One optimizer step on this rank's rows `ids`, in `optim.grad_accum` micro-batches (each
        micro-batch's loss is its own mean, so the step minimises the mean of the micro-batch means:
        for the AR loss exactly the full-batch mean)."""
        r = self.recipe
        lr = lr_at(self.step, r)
        for g in self.opt.param_groups:
            g["lr"] = lr
        n = r.optim.grad_accum
        stats: dict[str, float] = {}
        for i, mb in enumerate(ids.chunk(n)):
            parallel.set_gradient_sync(self.model, i == n - 1)  # FSDP: reduce-scatter once, after the last
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
                loss, st = self._loss(mb)
            (loss / n).backward()
            for k, v in st.items():  # counts add up, losses average
                stats[k] = stats.get(k, 0.0) + (v if k == "masked" else v / n)
        if not self.sharded:
            self.dist.all_reduce_grads(self.params)
        clip = parallel.clip_grad_norm_ if self.sharded else torch.nn.utils.clip_grad_norm_  # sharded: global norm
        gn = None
        if r.optim.grad_clip > 0:
            # Clover's zero-initialised gains see gradients orders of magnitude above the rest (the
            # GDN output norm amplifies them while the prefix readout is small): clipped together,
            # they would scale every other update down to nothing, so each family is clipped alone.
            is_gain = [self.names[i].rsplit(".", 1)[-1] in CLOVER_GAIN_PARAMS for i in range(len(self.params))]
            new = [p for p, g in zip(self.params, is_gain) if g]
            base = [p for p, g in zip(self.params, is_gain) if not g]
            gn = clip(base, r.optim.grad_clip)
            if new:
                stats["gain_grad_norm"] = float(clip(new, r.optim.grad_clip))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        stats["lr"] = lr
        if gn is not None:
            stats["grad_norm"] = float(gn)
        return stats

    def train(self, steps: int | None = None) -> list[dict[str, float]]:
        """Run until `steps` (default recipe.optim.steps); returns the per-step stats of this call."""
        r = self.recipe
        total = steps if steps is not None else r.optim.steps
        if self.dist.main:  # the recipe as run now (with overrides), so `clover train <out>` continues it
            (self.out / "recipe.json").write_text(json.dumps(r.to_dict(), indent=2) + "\n")
        if self.dist.main and self.step == 0:
            if self.target is not None:
                n = sum(p.numel() for p in self.model.parameters())
                pc = {"total": n, "active": n}
            else:
                pc = parameter_counts(self.model.config)
            self._log_text(
                f"start {r.name} stage={r.stage} world={self.dist.world} params total={pc['total']} active={pc['active']} "
                f"bf16_MB={pc['total'] * 2 / 1e6:.2f} steps={total} autocast={'bf16' if self.autocast else 'none'}"
            )
            if self.autocast_note:
                self._log_text(self.autocast_note)
        bar = None
        if self.dist.main and r.run.progress and not self.quiet:
            from tqdm import tqdm

            bar = tqdm(total=total, initial=self.step, desc=r.name, dynamic_ncols=True, file=sys.stderr)
        history: list[dict[str, float]] = []
        last_ckpt = time.time()
        window: list[dict[str, float]] = []
        t_window = time.time()
        tok_window = 0
        while self.step < total:
            t0 = time.time()
            ids = self.stream.next_batch().to(self.device, non_blocking=True)
            stats = self.train_step(ids)
            self.step += 1
            step_tokens = ids.numel() * self.dist.world  # a drafter's rows end at the batch's longest
            self.tokens += step_tokens
            tok_window += step_tokens
            self.elapsed += time.time() - t0
            history.append(stats)
            window.append(stats)
            if self.step % r.run.log_every == 0 or self.step == total:
                mean = {k: sum(s[k] for s in window) / len(window) for k in window[0] if k not in ("lr",)}
                mean = self.dist.mean(mean)
                dt = max(time.time() - t_window, 1e-9)
                rec = {"step": self.step, "tokens": self.tokens, "lr": stats["lr"], **mean,
                       "tokens_per_s": tok_window / dt, "elapsed_s": round(self.elapsed, 1)}
                self._log_json(rec)
                self._log_text(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in rec.items()))
                if bar is not None:
                    bar.set_postfix(loss=f"{mean['loss']:.3f}", tok_s=f"{rec['tokens_per_s']:.0f}")
                window, tok_window, t_window = [], 0, time.time()
            if r.run.eval_every and self.step % r.run.eval_every == 0:
                self.evaluate()
            if bar is not None:
                bar.update(1)
            due = (r.run.ckpt_every_steps and self.step % r.run.ckpt_every_steps == 0) or (
                r.run.ckpt_every_s and time.time() - last_ckpt >= r.run.ckpt_every_s
            )
            if self.dist.flag(bool(due)) and self.step < total:
                self.save()
                last_ckpt = time.time()
        if bar is not None:
            bar.close()
        if self.step >= total and (self.resume_from is None or history):
            self.save()
        return history

    def evaluate(self) -> dict[str, Any] | None:
        """Held-out task-answer metrics on rank 0 (teacher-forced AR), logged as {"step", "eval"}.
        Sharded, every rank runs the same forwards (each gathers the layers); rank 0 logs."""
        out = None
        if self.dist.main or self.sharded:
            from .evaluate import task_answer_metrics

            self.model.eval()
            out = task_answer_metrics(self.model, self.tokenizer, n_tasks=self.recipe.run.eval_tasks,
                                      threshold=self.model.config.threshold)
            self.model.train()
            if not self.dist.main:
                out = None
        if out is not None:
            self._log_json({"step": self.step, "eval": out})
            self._log_text(f"eval step={self.step} " + json.dumps({k: v for k, v in out.items() if k != "exact_by_kind"}))
        self.dist.barrier()
        return out

    def close(self) -> None:
        self.dist.close()


def export_model(ckpt: str | Path, out: str | Path, *, dtype: str = "bfloat16", tokenizer: str | Path | None = None) -> Path:
    """A training checkpoint (or any model dir) -> a model directory in `dtype` with the tokenizer.
    A sharded (FSDP / DCP) checkpoint is gathered into one model in this process."""
    from ..checkpoint import parse_dtype, save_model

    ckpt, out = Path(ckpt), Path(out)
    if _is_drafter(ckpt):  # a stage "drafter" checkpoint: the drafter in its published layout
        from ..checkpoint import load_drafter, save_drafter

        save_drafter(load_drafter(ckpt, dtype=torch.float32), out, dtype=dtype)
        return out
    if ck.checkpoint_format(ckpt) == "dcp":
        model = ck.load_dcp_model(ckpt, dtype=torch.float32)
    else:
        model = load_model(ckpt, dtype=torch.float32)
    model.to(parse_dtype(dtype))
    model.config.torch_dtype = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(dtype, dtype)
    save_model(model, out)
    tok = Path(tokenizer) if tokenizer else None
    if tok is None:
        for cand in (ckpt.parent.parent / "tokenizer", ckpt / "tokenizer"):
            if (cand / "tokenizer.json").is_file():
                tok = cand
                break
    if tok is not None:  # only the tokenizer's files: a model directory's weights must not replace the export
        copy_tokenizer_files(tok, out)
    return out


def _is_drafter(path: Path) -> bool:
    try:
        return "DFlashDraftModel" in json.loads((path / "config.json").read_text()).get("architectures", [])
    except (OSError, ValueError, AttributeError):
        return False
