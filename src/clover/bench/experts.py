"""`clover bench experts`: the block expert sharing ablation.

Diffusion decoding with the block's tokens restricted to a shared set of `expert_budget` experts
(off, 4k, 3k, 2k, k for top-k routing), ranked by the sum of the block's router probabilities or by
their maximum (`expert_rank`, LLaDA2.2's block routing), on the same held-out prompts, interleaved per prompt, with
AR as the baseline: experts touched per MoE layer per forward, tokens/forward, tokens/s, quality.
"""

from __future__ import annotations

from typing import Callable

from .common import machine
from .decode import Workload, interleaved, summarize

SCHEMA = "clover.bench.experts/1"


def budgets(k: int, num_experts: int) -> list[int | None]:
    """off, 4k, 3k, 2k, k — dropping budgets that do not restrict anything (>= num_experts)."""
    out: list[int | None] = [None]
    for m in (4 * k, 3 * k, 2 * k, k):
        if m < num_experts and m not in out:
            out.append(m)
    return out


def run_experts(llm, work: Workload = Workload(), *, progress: Callable[[str], None] | None = None,
                ranks: tuple[str, ...] = ("sum", "max")) -> dict:
    c = llm.config
    if c.mask_token_id is None:
        raise ValueError("this is a plain AR checkpoint (no mask token): block expert sharing applies to diffusion")
    if not c.has_experts:
        raise ValueError("this model's MLP is dense: block expert sharing needs a mixture-of-experts backbone")
    items = work.load()
    configs = [{"label": "ar", "mode": "ar", "expert_budget": None, "expert_rank": "sum"}]
    for m in budgets(c.num_experts_per_tok, c.num_experts):
        for rank in ((None,) if m is None else ranks):
            configs.append({"label": "off" if m is None else f"budget {m} ({rank})", "mode": "diffusion",
                            "expert_budget": m, "expert_rank": rank or "sum"})
    base = work.kwargs()

    def kw(cfg: dict) -> dict:
        return dict(base, expert_budget=cfg["expert_budget"], expert_rank=cfg["expert_rank"])

    runs = interleaved(llm, items, configs, kw, warm_tokens=8, keep_text=False, progress=progress)
    summary = summarize(runs, [cfg["label"] for cfg in configs], key="label")
    return {"schema": SCHEMA, "model": str(llm.path), "machine": machine(llm.model.device),
            "settings": {**work.settings(items), "num_experts": c.num_experts, "top_k": c.num_experts_per_tok},
            "configs": configs, "summary": summary}


def experts_markdown(result: dict) -> str:
    lines = ["| routing | experts touched / layer / forward | tokens/forward | tokens/s | vs AR tokens/s | quality |",
             "|---|---:|---:|---:|---:|---|"]
    for cfg in result["configs"]:
        s = result["summary"][cfg["label"]]
        q = s["quality"]
        qual = (f"exact match {q['tasks']['exact_match']:.1%}" if "tasks" in q else
                f"parse {q['code']['parse_rate']:.1%}, similarity {q['code']['edit_similarity']:.3f}" if "code" in q else "-")
        et = f"{s['experts_touched']:.2f}" if s["experts_touched"] is not None else "-"
        ratio = s.get("vs_ar", {}).get("tokens_per_second")
        lines.append(f"| {cfg['label']} | {et} | {s['tokens_per_forward']:.2f} | {s['tokens_per_second']['aggregate']:.1f} | "
                     f"{ratio:.2f}x | {qual} |" if ratio else f"| {cfg['label']} | {et} | {s['tokens_per_forward']:.2f} | "
                     f"{s['tokens_per_second']['aggregate']:.1f} | - | {qual} |")
    return "\n".join(lines)
