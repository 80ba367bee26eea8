"""Training checkpoints: safetensors + JSON only (never pickle).

A checkpoint is a directory `ckpt/step-00001234/` holding
- `config.json` + `model.safetensors` (fp32 master weights; the folder loads with `load_model`),
- `optimizer.safetensors`: every optimizer state tensor as `state.<param name>.<key>`,
- `rng-rank<r>.safetensors`: torch RNG states (global CPU generator and the training generator) as
  uint8 tensors, one file per data-parallel rank,
- `trainer.json`: step, tokens seen, optimizer param-group scalars, each rank's data-stream state
  and Python RNG state, the recipe. Written last; a directory without it is incomplete.
Directories are written under a temporary name and renamed, so a crash never leaves a
half-written `step-*` behind.

Under `run.parallel = "fsdp"` a checkpoint is a *distributed* one (`torch.distributed.checkpoint`,
DCP): every rank writes its own shards of the model and optimizer into `dcp/` (`*.distcp` plus a
`.metadata` index), so no rank ever holds the full state. `config.json`, the RNG files and
`trainer.json` (with `"format": "dcp"`) are as above; there is no `model.safetensors`, so
`clover train export CKPT OUT` (`load_dcp_model`) gathers the shards into a model directory. DCP
reshards on load: the model and optimizer load onto any number of ranks (or one process).
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from ..checkpoint import save_model

STATE_FILE = "trainer.json"
OPT_FILE = "optimizer.safetensors"
DCP_DIR = "dcp"


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


def list_checkpoints(ckpt_root: str | Path) -> list[Path]:
    root = Path(ckpt_root)
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step-*") if p.is_dir() and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def latest_checkpoint(ckpt_root: str | Path) -> Path | None:
    found = list_checkpoints(ckpt_root)
    return found[-1] if found else None


def optimizer_tensors(opt: torch.optim.Optimizer, names: dict[int, str]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Flatten `opt.state_dict()`: tensors keyed by parameter name, scalars to JSON."""
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for idx, st in sd["state"].items():
        pname = names[idx]
        for key, val in st.items():
            if torch.is_tensor(val):
                tensors[f"state.{pname}.{key}"] = val.detach().to("cpu", copy=True).contiguous()
            else:
                scalars.setdefault(pname, {})[key] = val
    groups = []
    for g in sd["param_groups"]:
        gg = {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items() if k != "params"}
        gg["params"] = [names[i] for i in g["params"]]
        groups.append(gg)
    return tensors, {"param_groups": groups, "scalars": scalars}


def load_optimizer(opt: torch.optim.Optimizer, names: dict[int, str], tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    index = {n: i for i, n in names.items()}
    state: dict[int, dict[str, Any]] = {}
    for key, t in tensors.items():
        assert key.startswith("state.")
        pname, field = key[len("state.") :].rsplit(".", 1)
        state.setdefault(index[pname], {})[field] = t
    for pname, sc in meta.get("scalars", {}).items():
        state.setdefault(index[pname], {}).update(sc)
    groups = []
    for g in meta["param_groups"]:
        gg = dict(g)
        gg["params"] = [index[n] for n in g["params"]]
        if "betas" in gg:
            gg["betas"] = tuple(gg["betas"])
        groups.append(gg)
    opt.load_state_dict({"state": state, "param_groups": groups})


def rng_tensors(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {"torch_cpu": torch.get_rng_state().clone(), "train_gen": gen.get_state().clone()}


def restore_rng(tensors: dict[str, torch.Tensor], gen: torch.Generator) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    gen.set_state(tensors["train_gen"])


def python_rng_state() -> list:
    v, internal, gauss = random.getstate()
    return [v, list(internal), gauss]


def restore_python_rng(state: list) -> None:
    v, internal, gauss = state
    random.setstate((v, tuple(internal), gauss))


def _publish(tmp: Path, final: Path, state: dict[str, Any], ckpt_root: Path, keep: int) -> Path:
    """Write the state file into the finished `tmp` dir, move it to `final` in one rename (a crash
    leaves the previous checkpoint whole), and drop all but the newest `keep` checkpoints."""
    (tmp / STATE_FILE).write_text(json.dumps(state, indent=1) + "\n")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    for old in list_checkpoints(ckpt_root)[:-keep] if keep > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def write_checkpoint(
    ckpt_root: Path,
    step: int,
    *,
    model,
    opt: torch.optim.Optimizer,
    names: dict[int, str],
    rank_states: list[dict[str, Any]],
    rng_by_rank: list[dict[str, torch.Tensor]],
    extra: dict[str, Any],
    keep: int,
) -> Path:
    """Single-process writer (rank 0, after gathering the per-rank pieces)."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / step_dir_name(step)
    tmp = ckpt_root / (".tmp-" + step_dir_name(step))
    if tmp.exists():
        shutil.rmtree(tmp)
    save_model(model, tmp)
    tensors, opt_meta = optimizer_tensors(opt, names)
    save_file(tensors, str(tmp / OPT_FILE), metadata={"format": "pt"})
    for r, rng in enumerate(rng_by_rank):
        save_file(rng, str(tmp / f"rng-rank{r}.safetensors"))
    state = {"step": step, "optimizer": opt_meta, "ranks": rank_states, **extra}
    return _publish(tmp, final, state, ckpt_root, keep)


def read_checkpoint(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(trainer.json, model tensors, optimizer tensors)."""
    state = json.loads((path / STATE_FILE).read_text())
    model = load_file(str(path / "model.safetensors"))
    opt = load_file(str(path / OPT_FILE))
    return state, model, opt


def read_rng(path: Path, rank: int) -> dict[str, torch.Tensor]:
    return load_file(str(path / f"rng-rank{rank}.safetensors"))


# --------------------------------------------------------------------------- distributed (DCP)
def checkpoint_format(path: str | Path) -> str:
    """"dcp" for a sharded checkpoint (run.parallel = "fsdp"), else "safetensors"."""
    return "dcp" if (Path(path) / DCP_DIR / ".metadata").is_file() else "safetensors"


def _dcp_state(model, opt: torch.optim.Optimizer | None) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if opt is None:
        return {"model": get_model_state_dict(model)}
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


def write_dcp_checkpoint(
    ckpt_root: Path,
    step: int,
    *,
    model,
    opt: torch.optim.Optimizer,
    main: bool,
    barrier,
    rank_states: list[dict[str, Any]] | None,
    rng_by_rank: list[dict[str, torch.Tensor]] | None,
    extra: dict[str, Any],
    keep: int,
) -> Path:
    """Collective: every rank calls it (its shards go to `dcp/`); rank 0 (`main`) writes the rest
    (`rank_states` / `rng_by_rank` gathered there) and renames the directory when all shards are in."""
    import torch.distributed.checkpoint as dcp

    final = ckpt_root / step_dir_name(step)
    tmp = ckpt_root / (".tmp-" + step_dir_name(step))
    if main:
        if tmp.exists():
            shutil.rmtree(tmp)
        (tmp / DCP_DIR).mkdir(parents=True)
    barrier()
    dcp.save(_dcp_state(model, opt), checkpoint_id=str(tmp / DCP_DIR), no_dist=not dist.is_initialized())
    barrier()
    if main:
        model.config.save(tmp)
        for r, rng in enumerate(rng_by_rank or []):
            save_file(rng, str(tmp / f"rng-rank{r}.safetensors"))
        state = {"step": step, "format": "dcp", "ranks": rank_states, **extra}
        _publish(tmp, final, state, ckpt_root, keep)
    barrier()
    return final


def read_dcp_checkpoint(path: Path, model, opt: torch.optim.Optimizer | None) -> dict[str, Any]:
    """Load the shards of `path` into `model` (and `opt`), sharded or not, on however many ranks
    this run has (DCP reshards); returns trainer.json. Collective under a process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict

    state = _dcp_state(model, opt)
    dcp.load(state, checkpoint_id=str(path / DCP_DIR), no_dist=not dist.is_initialized())
    if opt is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return json.loads((path / STATE_FILE).read_text())


def load_dcp_model(path: str | Path, dtype: torch.dtype = torch.float32):
    """A sharded (DCP) training checkpoint -> the full model in one process (for export)."""
    import torch.distributed.checkpoint as dcp

    from ..models import read_config
    from ..models import build_model

    path = Path(path)
    model = build_model(read_config(path), device="cpu", dtype=torch.float32)
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(path / DCP_DIR), no_dist=True)  # fills the tensors in place
    model.load_state_dict(state["model"], strict=True)
    model.tie_head()
    return model.to(dtype).eval()
