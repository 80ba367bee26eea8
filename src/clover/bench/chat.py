"""`clover bench chat`: an instruction-tuned model on held-out questions with known answers, every
mode on the same weights, through the model's own chat template.

Questions (`clover.data.instructions.questions`: facts, arithmetic, lists, code asserts; none of
them ever in a training stream) are asked as one user turn; a reply is right when it contains an
accepted answer. It is `clover bench decode` on the `chat` workload (`bench.decode.run_decode`):
greedy, batch 1, one warm-up per mode, then every mode in turn on each question (interleaved, so
load on a shared machine hits all modes alike), decode's per-mode summary (tokens/forward, tokens/s
spread and aggregate, ratios to AR, AR's tokens kept or left) with the accuracy overall and per
kind as its quality (`quality.chat`). With
`llama_bench` (a llama.cpp `llama-bench` binary and the GGUF the model came from) llama.cpp's AR
decode speed on that file is measured in the same run, with the same thread count.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Callable, Iterable

from .decode import Item, Workload, options_label, run_decode

SCHEMA = "clover.bench.chat/2"
DEFAULT_MODES = "ar,diffusion,speculative"  # the baseline, the default mode, the lossless one


def chat_items(llm, questions: int, *, seed: int = 0) -> list[Item]:
    """`questions` held-out questions as the `chat` workload: one user turn through the model's chat
    template (token ids), the question kept as the item's task (its `check` scores the reply)."""
    from ..data.instructions import questions as held_out_questions

    if questions <= 0:
        raise ValueError(f"questions: must be a positive integer, got {questions}")
    return [Item("chat", llm.tokenizer.apply_chat_template([{"role": "user", "content": q.prompt}]),
                 " | ".join(q.answers), task=q) for q in held_out_questions(questions, seed=seed)]


def run_chat(llm, *, questions: int = 40, modes: Iterable[str] = DEFAULT_MODES.split(","), max_new_tokens: int = 128,
             block_size: int | None = None, threshold: float | None = None, seed: int = 0,
             progress: Callable[[str], None] | None = None) -> dict:
    """`clover bench decode` on the `chat` workload (the same protocol, summary and ratios; quality:
    `quality.chat` accuracy overall and per kind), plus the questions asked."""
    items = chat_items(llm, questions, seed=seed)
    result = run_decode(llm, Workload("chat", len(items), max_new_tokens, items=items), modes=modes,
                        block_size=block_size, threshold=threshold, progress=progress)
    return dict(result, schema=SCHEMA, seed=seed, questions=[it.task.__dict__ for it in items])


def llama_bench(binary: str | Path, gguf: str | Path, *, threads: int = 1, n: int = 48, reps: int = 3) -> dict:
    """llama.cpp's AR decode speed (tg N, no prompt) on `gguf`: `llama-bench -p 0 -n N -t T -r R -o json`."""
    cmd = [str(binary), "-m", str(gguf), "-p", "0", "-n", str(n), "-t", str(threads), "-r", str(reps), "-o", "json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"llama-bench failed: {r.stderr.strip().splitlines()[-1:]}")
    rows = json.loads(r.stdout)
    tg = next(x for x in rows if x.get("n_gen"))
    return {"engine": "llama.cpp", "tokens_per_second": tg["avg_ts"], "stddev": tg.get("stddev_ts"), "n_gen": tg["n_gen"],
            "threads": threads, "type": tg.get("model_type"), "command": " ".join(cmd)}


def same_as_ar(r: dict) -> float | None:
    """The share of questions on which a mode gave AR's tokens (lossless modes: `matches_ar`;
    threshold modes: 1 - the diverged share), None for AR itself."""
    if "matches_ar" in r:
        return r["matches_ar"]
    d = r.get("vs_ar", {}).get("divergence")
    return None if d is None else 1 - d["diverged"]


def ended(result: dict, mode: str) -> float:
    """The share of a mode's replies that ended on their own (EOS or a stop), not at the token cap."""
    runs = [r for r in result["runs"] if r["mode"] == mode]
    return sum(r["finish_reason"] != "length" for r in runs) / max(1, len(runs))


def markdown(result: dict) -> str:
    s = result["settings"]
    lines = [f"clover bench chat · {result['model']} · {s['prompts']} held-out questions · "
             f"up to {s['max_new_tokens']} new tokens · {options_label(s)}", "",
             "| mode | accuracy | by kind | tokens/forward | tokens/s | ×AR tok/s | = AR | ended |",
             "|---|---|---|---|---|---|---|---|"]
    for m, r in result["modes"].items():
        q = r["quality"]["chat"]
        kinds = ", ".join(f"{k} {v['accuracy']:.0%}" for k, v in q["by_kind"].items())
        vs = None if m == "ar" else r.get("vs_ar", {}).get("tokens_per_second")
        same = same_as_ar(r)
        lines.append(f"| {m} | {q['accuracy']:.1%} | {kinds} | {r['tokens_per_forward']:.2f} | "
                     f"{r['tokens_per_second']['aggregate']:.1f} | {'-' if vs is None else f'{vs:.2f}'} | "
                     f"{'-' if same is None else format(same, '.0%')} | {ended(result, m):.0%} |")
    if result.get("llama_cpp"):
        lc = result["llama_cpp"]
        ar = result["modes"]["ar"]["tokens_per_second"]["aggregate"]
        lines.append(f"| llama.cpp AR ({lc['type']}) | - | - | 1.00 | {lc['tokens_per_second']:.1f} | "
                     f"{lc['tokens_per_second'] / max(ar, 1e-9):.2f} | - | - |")
    return "\n".join(lines)
