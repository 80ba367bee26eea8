"""The peers run: one warm-up per runner, then every prompt through each runner in turn, then the batch rounds."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Callable, Iterable

from ..common import config_summary, machine, max_rss_bytes, set_threads
from ...kernels.packed import packing
from .base import GGUF_TYPES, SCHEMA, Engine, Runner, Setup, llama_cpp_dir
from .registry import ENGINES, check_engines, discover
from .report import summarize


def load_prompts(n: int) -> list[str]:
    from ..decode import load_items

    return [it.prompt for it in load_items("tasks", n)]


def _measure(runners: list[Runner], ids: list[list[int]], batch_ids: list[list[int]], batch_rounds: int, t: int,
             failed: Callable[[Runner, Exception], None], say: Callable[[str], None]) -> list[dict]:
    """One thread count: a warm-up per runner, every prompt through each runner in turn, then the
    batch rounds of the runners that batch. A runner that raises is dropped (`failed`)."""
    def record(r: Runner, batch: int, item: int, tokens: int, s: float, out) -> dict:
        return {"engine": r.engine, "variant": r.variant, "threads": t, "batch": batch, "item": item, "tokens": tokens,
                "seconds": s, "tokens_per_second": tokens / s if s > 0 else 0.0, "token_ids": out,
                "accept_lengths": r.accepts if batch == 1 else None, "compare": r.compare, "cpu_seconds": r.cpu_seconds}

    def attempt(r: Runner, fn):
        r.cpu_seconds = None
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - an engine that breaks mid-run is dropped; the others go on
            failed(r, e)
            return None

    runs = []
    for r in list(runners):
        say(f"{t} threads: warming up {r.engine} {r.variant}")
        attempt(r, lambda: r.warm(ids[0]))
    for i, p in enumerate(ids):
        for r in [r for r in runners if r.single]:
            r.accepts = None
            got = attempt(r, lambda: r.one(p))
            if got is not None:
                out, tokens, s = got
                runs.append(record(r, 1, i, tokens, s, out))
        say(f"{t} threads: prompt {i + 1}/{len(ids)}")
    for k in range(batch_rounds):
        for r in [r for r in runners if r.batches]:
            got = attempt(r, lambda: r.many(batch_ids))
            if got is not None:  # (tokens, seconds[, each row's ids])
                runs.append(record(r, len(batch_ids), k, got[0], got[1], got[2] if len(got) > 2 else None))
        say(f"{t} threads: batch {len(batch_ids)} round {k + 1}/{batch_rounds}")
    return runs


def run_peers(
    model_dir: str | Path,
    *,
    prompts: int = 8,
    prompt_texts: list[str] | None = None,
    max_new_tokens: int = 64,
    threads: Iterable[int] = (1, 2),
    batch: int = 16,
    batch_rounds: int = 1,
    dtype: str = "float32",
    modes: Iterable[str] | None = None,
    engines: Iterable[str] | None = None,
    llama_dir: str | Path | None = None,
    vllm_python: str | None = None,
    reference: str | Path | None = None,
    reference_python: str | None = None,
    workdir: str | Path | None = None,
    progress: Callable[[str], None] | None = None,
    model_note: str | None = None,
    compiled: bool = False,
    questions: int = 0,
    to_eos: bool = False,
    gguf_type: str | None = None,
    pack: bool | str | None = None,
) -> dict:
    """The peers benchmark; returns the JSON-ready result (schema `SCHEMA`). `compiled` adds clover's
    AR, diffusion and speculative modes with `compile="static"` (variants `ar+static`, ...; warmed up, so compile
    time is not in the timings). `questions` > 0: the prompts are that many held-out chat questions through the
    model's chat template (`bench.chat.chat_items`) instead of task prompts; `to_eos`: each answer is decoded to
    its EOS (capped at `max_new_tokens`) instead of exactly `max_new_tokens` tokens.
    `reference` / `reference_python`: a released family's reference checkout and the interpreter that runs it
    (`reference.py`). `gguf_type`: the weights of the GGUF engines (llama.cpp, its DFlash, the port), e.g.
    q8_0 (`GGUF_TYPES`; default: `dtype`'s); clover and transformers stay in `dtype`. `pack`: clover's eager
    weights, as `clover.load`'s `pack` (None: its default, which packs from 256 MiB of large weights, so a
    small test model runs plain where a released checkpoint of the same family is packed; True: oneDNN's
    copies; "rows": the row kernel alone; False: plain); `settings["clover_packing"]` says what it got."""
    import clover

    from ...decoding import get_mode, mode_names

    threads = list(dict.fromkeys(threads))
    for t in threads:
        if t <= 0:
            raise ValueError(f"threads: must be positive integers, got {t}")
    if max_new_tokens <= 0 or batch <= 0 or batch_rounds < 0:
        raise ValueError("max_new_tokens and batch must be positive, batch_rounds >= 0")
    check_engines(engines)
    if gguf_type is not None and gguf_type not in GGUF_TYPES:
        raise ValueError(f"gguf_type: must be one of {', '.join(GGUF_TYPES)}, got {gguf_type!r}")
    src = Path(model_dir)
    say = progress or (lambda msg: None)
    llm = clover.load(src, dtype=dtype, pack=pack)
    static_llm = None
    if compiled:
        say("clover: compile=static")
        static_llm = clover.load(src, dtype=dtype, compile="static", compile_batch=batch)  # batch sizes up to the bench's
    cfg = llm.config
    found = discover(cfg, dtype=dtype, engines=engines, llama_dir=llama_dir, vllm_python=vllm_python,
                     reference=reference, reference_python=reference_python)
    wanted_modes = [get_mode(m) for m in (mode_names() if modes is None else modes)]
    skipped_modes = [m.name for m in wanted_modes if not llm.mode_available(m)]  # AR-only, or a family's own
    run_modes = [m.name for m in wanted_modes if m.name not in skipped_modes]
    if "naive" in run_modes and modes is None:
        run_modes.remove("naive")  # the uncached reference: a benchmark of its own (bench decode)
        skipped_modes.append("naive")
    if questions > 0:
        from ..chat import chat_items

        items = chat_items(llm, questions)
        texts, ids = [it.task.prompt for it in items], [list(it.prompt) for it in items]
    else:
        texts = prompt_texts if prompt_texts is not None else load_prompts(prompts)
        ids = [llm.encode_prompt(p) for p in texts]
    batch_ids = [ids[i % len(ids)] for i in range(batch)]

    tmp = None
    if workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="clover-peers-")
        workdir = tmp.name
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    setup = Setup(src, llm, static_llm, dtype, work, max_new_tokens, run_modes, batch_ids, batch_rounds,
                  n_ctx=max(len(p) for p in ids) + max_new_tokens + 64,
                  llama_dir=Path(llama_dir) if llama_dir else llama_cpp_dir(), vllm_python=vllm_python, say=say,
                  to_eos=to_eos, reference=Path(reference) if reference else None,
                  reference_python=reference_python, gguf_type=gguf_type)

    def note(name: str, msg: str) -> None:
        found[name]["note"] = "; ".join(x for x in (found[name].get("note"), msg) if x)

    # -- shared, thread-independent preparation: an engine that cannot be readied is skipped, not fatal
    ready: list[Engine] = []
    for name, cls in ENGINES.items():
        if not found[name]["available"]:
            continue
        eng = cls(setup, found[name])
        try:
            eng.prepare()
        except Exception as e:  # noqa: BLE001
            found[name].update(available=False, note=f"{eng.fails}: {type(e).__name__}: {e}"[:300])
            continue
        ready.append(eng)

    runs: list[dict] = []
    for t in threads:
        set_threads(t)
        runners: list[Runner] = []
        for eng in list(ready):
            try:
                runners += eng.runners(t)
            except Exception as e:  # noqa: BLE001 - e.g. a worker that does not start
                found[eng.name].update(available=False, note=f"{eng.fails}: {e}"[:500])
                ready.remove(eng)

        def failed(r: Runner, e: Exception) -> None:
            note(r.engine, f"{r.variant} failed at {t} threads: {type(e).__name__}: {e}"[:400])
            runners.remove(r)
            r.close()

        try:
            runs += _measure(runners, ids, batch_ids, batch_rounds, t, failed, say)
        finally:
            for r in runners:
                r.close()
    if tmp is not None:
        tmp.cleanup()
        for name in ("llama.cpp", "llama-clover"):
            if found[name].get("gguf"):
                found[name]["gguf"] = None  # was temporary

    return {
        "schema": SCHEMA,
        "model": str(src),
        "model_note": model_note,
        "config": config_summary(cfg, dtype),
        "settings": {
            "prompts": len(ids), "max_new_tokens": max_new_tokens, "threads": threads, "batch": batch,
            "batch_rounds": batch_rounds, "modes": run_modes, "skipped_modes": skipped_modes, "greedy": True,
            "fixed_length": not to_eos, "to_eos": to_eos, "chat_questions": questions, "interleaved": True,
            "gguf_type": setup.gguf, "prompt_tokens": [len(p) for p in ids], "clover_packing": packing(llm.model),
        },
        "engines": found,
        "machine": machine(),
        "max_rss_bytes": max_rss_bytes(),
        "rows": summarize(runs),
        "prompts": texts,
        "runs": runs,
    }
