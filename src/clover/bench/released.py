"""`clover bench released`: the released block-diffusion families at their checkpoints' full shapes,
random weights, on a GPU: what `scripts/gpu-check.sh` runs on a lent machine.

For each family (`FAMILIES`, shapes from `clover.models.shapes`) the model is built on the meta device
and materialised on the device in the run's dtype with a seeded normal init drawn there
(`build_random_model(on_device=True)`: no host copy, so a 16B model never touches the CPU), the LM
head's row of the mask token at zero (a trained model never predicts it). Then:
- the memory plan (`quant.sizes.memory_plan`: weights + K/V at the run's context and batch) beside the
  measured CUDA peak (`torch.cuda.max_memory_allocated`) after the build and after the batch;
- greedy decoding with the family's own defaults (its default mode, block, threshold, sub-block),
  `new_tokens` per row with no stop (`ignore_eos`): every row alone (batch 1) and all rows in one
  batch, each timed: tokens/s, forwards, tokens per forward;
- on the device, in float32 where it fits (`check_dtype_for`; the model rebuilt from the same seed),
  `check_tokens` a row: the batch's tokens equal each row's alone, and the cached engine's tokens equal
  the recomputing one's (`naive`) on the first prompt.
The larger shapes (`PLANNED`: SDAR-30B-A3B, LLaDA2.0-flash) get their memory plan only.

Random weights make the logits nearly flat, so in bf16 a rounding difference between a batched and
an alone forward flips near-tied argmaxes (six of eight rows parted on the tiny SDAR in bf16 on the
CPU): the timed bf16 run's batched-vs-alone agreement is recorded as information (`agreement`), and
the checks run in float32, where a parting is a bug; a check that parts says where (the first
differing token).

`tiny=True` runs the same code at a tiny shape of each family on the CPU (seconds; the test keeps the
GPU path from rotting): only the device, the dtype and the peak-memory reading differ."""

from __future__ import annotations

import gc
import tempfile
import time
from typing import Callable

import torch

from .common import config_summary, machine, timed

SCHEMA = "clover.bench.released/1"
FAMILIES = ("sdar-1.7b", "fast-dllm-v2-1.5b", "llada2-mini")  # built and decoded, cheapest first
PLANNED = ("sdar-30b-a3b", "llada2-flash")  # memory plan only
# every family's sizes shrunk (keys a family does not read are dropped by its config class)
TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=128, num_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2,
            moe_intermediate_size=32, max_position_embeddings=4096, mask_token_id=511, eos_token_id=510,
            torch_dtype="float32")
PROMPT_LENGTHS = (5, 12, 31, 32, 40, 57, 64, 77)  # ending inside and at the end of blocks of 4 and 32
SEED = 0


def family_config(name: str, tiny: bool = False):
    """The family's full-size config (`clover.models.shapes`), or its tiny variant."""
    from ..models import config_from_dict
    from ..models.shapes import FIELDS

    if name not in FIELDS:
        raise ValueError(f"family: {name!r} is not one of {', '.join(FIELDS)}")
    return config_from_dict(dict(FIELDS[name], **(TINY if tiny else {})), source=f"clover.models.shapes {name}")


def plan_for(config, *, context: int, batch: int, elem: int) -> dict:
    """`memory_plan` at the run's dtype: weights (the bf16 figure scaled to `elem` bytes) + K/V."""
    from ..quant.sizes import memory_plan

    plan = memory_plan(config, context=context, batch=batch, kv_elem=elem)
    bf16 = plan["precisions"]["bf16"]
    weights = bf16["weights_bytes"] * elem // 2
    return {"parameters": plan["parameters"], "context": context, "batch": batch,
            "weights_bytes": weights, "kv_bytes": bf16["kv_bytes"], "total_bytes": weights + bf16["kv_bytes"],
            "precisions": plan["precisions"]}


def random_llm(config, *, device: str, dtype: torch.dtype, seed: int = SEED):
    """An `LLM` over random weights materialised on `device` (a byte tokenizer: the text is not read)."""
    from ..api import LLM
    from ..tokenizer import Tokenizer, write_byte_tokenizer
    from .roofline import build_random_model

    model = build_random_model(config, dtype=dtype, device=device, seed=seed, on_device=True)
    with torch.no_grad():
        model.lm_head.weight[config.mask_token_id] = 0.0
    with tempfile.TemporaryDirectory() as d:
        write_byte_tokenizer(d)
        tok = Tokenizer.from_dir(d, eos_token_id=config.eos_token_ids[0] if config.eos_token_ids else None,
                                 mask_token_id=config.mask_token_id)
    return LLM(model, tok)


def prompts(config, batch: int, seed: int = SEED) -> list[list[int]]:
    """`batch` prompts of `PROMPT_LENGTHS` (in turn) of random ordinary tokens."""
    gen = torch.Generator().manual_seed(seed)
    high = min(100_000, config.vocab_size - 16)  # below the special tokens (mask, EOS) of every family
    return [torch.randint(0, high, (PROMPT_LENGTHS[i % len(PROMPT_LENGTHS)],), generator=gen).tolist()
            for i in range(batch)]


def _peak(device) -> int | None:
    return torch.cuda.max_memory_allocated(device) if torch.device(device).type == "cuda" else None


def _reset_peak(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _timed_generate(llm, ids, **kw):
    """(`llm.generate` with no stop, seconds)."""
    return timed(lambda: llm.generate(ids, ignore_eos=True, **kw), llm.model.device)


def _speed(gens, seconds: float) -> dict:
    tokens = sum(g.stats.tokens for g in gens)
    forwards = sum(g.stats.forwards for g in gens)
    return {"rows": len(gens), "tokens": tokens, "forwards": forwards, "seconds": seconds,
            "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
            "tokens_per_forward": tokens / forwards if forwards else 0.0}


def _same(a: list[int], b: list[int]) -> dict:
    """Whether two token lists agree, and where they first part."""
    first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))
    return {"identical": first is None, "first_difference": first}


def _free(device) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def check_dtype_for(config, device, dtype: torch.dtype, *, context: int, batch: int) -> torch.dtype:
    """float32 for the checks where its weights and cache fit (a CPU; on a GPU its free memory plus
    what this process holds now, the timed model it frees first, with a tenth to spare), else the
    run's dtype: in bf16 a rounding difference flips near-tied argmaxes of random weights (six of
    eight rows parted on the tiny SDAR on the CPU), so only float32 tells a bug."""
    if torch.device(device).type != "cuda":
        return torch.float32
    need = plan_for(config, context=context, batch=batch, elem=4)["total_bytes"]
    room = torch.cuda.mem_get_info(torch.device(device))[0] + torch.cuda.memory_allocated(torch.device(device))
    return torch.float32 if need < 0.9 * room else dtype


def _decode_rows(llm, ids, new_tokens: int):
    """Each row alone, then all together: (alone, seconds alone, together, seconds together)."""
    alone, seconds = [], 0.0
    for row in ids:
        g, s = _timed_generate(llm, row, max_new_tokens=new_tokens)
        alone.append(g)
        seconds += s
    together, s = _timed_generate(llm, ids, max_new_tokens=new_tokens)
    return alone, seconds, together, s


def run_family(name: str, *, tiny: bool = False, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
               batch: int = 8, new_tokens: int = 64, check_tokens: int = 16,
               report: Callable[[dict], None] | None = None) -> dict:
    """One family's record (see the module docstring); `report(record)` after every phase, so a run
    stopped by a timeout still leaves what it measured."""
    config = family_config(name, tiny)
    elem = torch.finfo(dtype).bits // 8
    ids = prompts(config, batch)
    context = max(map(len, ids)) + new_tokens + config.block_size
    rec = {"family": name, "shape": "tiny" if tiny else "full", "model_type": config.model_type,
           "config": config_summary(config, str(dtype).removeprefix("torch.")),
           "defaults": {"block_size": config.block_size, "threshold": config.threshold, "sub_block": config.sub_block,
                        "mask_token_id": config.mask_token_id},
           "plan": plan_for(config, context=context, batch=batch, elem=elem), "measured": {}, "checks": {}}
    say = report or (lambda r: None)

    def done(phase: str) -> None:
        rec["phase"] = phase
        say(rec)

    done("planned")
    _reset_peak(device)
    llm, rec["measured"]["build_seconds"] = timed(lambda: random_llm(config, device=device, dtype=dtype), device)
    rec["mode"] = llm.default_mode
    rec["measured"]["weights_peak_bytes"] = _peak(device)
    done("built")
    try:  # the timed run, in the run's dtype
        _timed_generate(llm, ids[0], max_new_tokens=min(new_tokens, config.block_size))  # warm-up: kernels, allocator
        _reset_peak(device)
        alone, s1, together, s = _decode_rows(llm, ids, new_tokens)
        rec["batch1"], rec["batch"] = _speed(alone, s1), _speed(together, s)
        rec["measured"]["batch_peak_bytes"] = _peak(device)  # the rows alone peak below the batch
        rows = [_same(a.token_ids, b.token_ids) for a, b in zip(alone, together)]
        rec["agreement"] = {"dtype": rec["config"]["dtype"], "rows_identical": sum(r["identical"] for r in rows),
                            "rows": rows}  # information: in bf16, rounding may part them
        done(f"batch 1 and {batch}")
        check = check_dtype_for(config, device, dtype, context=context, batch=batch)
        if check != dtype:
            llm = None
            _free(device)
            try:
                llm = random_llm(config, device=device, dtype=check)
            except torch.cuda.OutOfMemoryError:  # the plan's tenth to spare was not enough: check in the run's dtype
                _free(device)
                check, llm = dtype, random_llm(config, device=device, dtype=dtype)
        checked_in = str(check).removeprefix("torch.")
        alone, _, together, _ = _decode_rows(llm, ids, check_tokens)
        rows = [_same(a.token_ids, b.token_ids) for a, b in zip(alone, together)]
        rec["checks"]["batched_equals_alone"] = {"ok": all(r["identical"] for r in rows), "dtype": checked_in,
                                                 "tokens": check_tokens, "rows": rows}
        naive, s = _timed_generate(llm, ids[0], max_new_tokens=check_tokens, mode="naive")
        rec["checks"]["cached_equals_naive"] = {"ok": alone[0].token_ids == naive.token_ids, "dtype": checked_in,
                                                "tokens": check_tokens, "seconds": s,
                                                **_same(alone[0].token_ids, naive.token_ids)}
        done("checked")
    finally:
        llm = None
        _free(device)
    return rec


def plan_only(name: str, *, batch: int, context: int, elem: int = 2, device_bytes: int | None = None) -> dict:
    """A family too large to build and decode in the check's time: its memory plan (the model on the
    meta device), and whether it fits `device_bytes` (the GPU's memory; None: not asked)."""
    config = family_config(name)
    plan = plan_for(config, context=context, batch=batch, elem=elem)
    return {"family": name, "shape": "full", "model_type": config.model_type, "skipped": "memory plan only",
            "config": config_summary(config, "bfloat16"), "plan": plan, "device_bytes": device_bytes,
            "fits": None if device_bytes is None else plan["total_bytes"] <= device_bytes}


def run_released(*, families=FAMILIES, planned=PLANNED, tiny: bool = False, device: str = "cuda",
                 dtype: torch.dtype = torch.bfloat16, batch: int = 8, new_tokens: int = 64, check_tokens: int = 16,
                 report: Callable[[dict], None] | None = None,
                 progress: Callable[[str], None] | None = None) -> dict:
    """The plans of `planned` (first: they take seconds), then every family in `families`
    (`run_family`); `report(result)` after every phase (the caller writes the JSON), `progress(line)`
    after every phase of a family and with its row of the table at its end."""
    for n in (*families, *planned):
        family_config(n)  # an unknown name: one line before anything is built
    result = {"schema": SCHEMA, "machine": machine(device), "tiny": tiny, "batch": batch, "new_tokens": new_tokens,
              "check_tokens": check_tokens, "families": []}
    say = report or (lambda r: None)
    tell = progress or (lambda line: None)
    context = max(PROMPT_LENGTHS) + new_tokens + 32
    cuda = torch.device(device).type == "cuda"
    total = torch.cuda.get_device_properties(torch.device(device)).total_memory if cuda else None
    result["families"] += [plan_only(n, batch=batch, context=context, device_bytes=total) for n in planned]
    say(result)
    t0 = time.perf_counter()
    for name in families:
        result["families"].append({"family": name})

        def phase(rec: dict, i: int = len(result["families"]) - 1) -> None:
            result["families"][i] = rec
            say(result)
            tell(f"{rec['family']}: {rec['phase']} ({time.perf_counter() - t0:.0f} s)")

        rec = run_family(name, tiny=tiny, device=device, dtype=dtype, batch=batch, new_tokens=new_tokens,
                         check_tokens=check_tokens, report=phase)
        tell(table_row(rec))
    return result


def all_checks_pass(result: dict) -> bool:
    return all(c["ok"] for f in result["families"] for c in f.get("checks", {}).values())


def _gb(n) -> str:
    return "-" if n is None else f"{n / 1e9:.2f}"


HEADER = ("| family | params | plan GB (w+kv) | peak GB (weights / batch) | b1 tok/s | b{B} tok/s | row forwards b1 / b{B} "
          "| tok/fwd | batched = alone | cached = naive |")


def table_row(f: dict) -> str:
    p, m = f["plan"], f.get("measured", {})
    n = f["config"]["parameters"]["total"]
    params = f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.2f}M"
    if f.get("skipped"):
        fits = "" if f.get("fits") is None else f" (fits in {_gb(f['device_bytes'])} GB: {'yes' if f['fits'] else 'no'})"
        return f"| {f['family']} | {params} | {_gb(p['total_bytes'])} | {f['skipped']}{fits} | | | | | | |"
    b1, bb, c = f.get("batch1", {}), f.get("batch", {}), f.get("checks", {})

    def ok(name):
        r = c.get(name)
        if r is None:
            return "not run"
        return ("yes" if r["ok"] else "NO") + f" ({r['dtype']})"

    agree = f.get("agreement")
    shown = "" if agree is None else f"; {agree['dtype']} {agree['rows_identical']}/{len(agree['rows'])}"

    def num(d, k, fmt):
        return format(d[k], fmt) if k in d else "-"

    return (f"| {f['family']} | {params} | {_gb(p['total_bytes'])} | {_gb(m.get('weights_peak_bytes'))} / "
            f"{_gb(m.get('batch_peak_bytes'))} | {num(b1, 'tokens_per_second', '.1f')} | {num(bb, 'tokens_per_second', '.1f')} | "
            f"{num(b1, 'forwards', 'd')} / {num(bb, 'forwards', 'd')} | {num(bb, 'tokens_per_forward', '.2f')} | "
            f"{ok('batched_equals_alone')}{shown} | {ok('cached_equals_naive')} |")


def released_table(result: dict) -> str:
    b = result["batch"]
    head = HEADER.replace("{B}", str(b))
    title = (f"released families, random weights, {'tiny shapes' if result['tiny'] else 'full shapes'}, "
             f"{result['machine'].get('gpu') or result['machine']['cpu']}: {result['new_tokens']} new tokens a row, "
             f"batch 1 (each row alone) and {b}")
    lines = [title, head, "|" + "---|" * (head.count("|") - 1)]
    lines += [table_row(f) for f in result["families"] if "plan" in f]
    return "\n".join(lines)
