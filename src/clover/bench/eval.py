"""`clover eval`: the evaluation of a Clover checkpoint, all modes on the same weights in one run,
one table per regime.

- tasks: held-out verifiable task prompts, greedy, the answer is the generated line (compared as a
  literal, never executed): exact match, tokens/forward, tokens/s for AR, diffusion, naive (and
  speculative), plus a threshold sweep of diffusion;
- code: held-out stdlib files — AR perplexity (teacher-forced) and diffusion masked-token accuracy
  (blocks masked at t ~ U(0,1], the training layout); bodies generated from held-out `def` headers by
  each mode — parse rate, edit similarity, tokens/forward, tokens/s.

Generation runs reuse the benchmark harness (`clover.bench.decode`), so the numbers are comparable.
`run_eval(llm, ...)` returns the JSON-ready result and `markdown(result)` its tables; the command
line is `clover eval` (`clover.cli.eval`).
"""

from __future__ import annotations

import math

import torch

from .decode import Workload, fmt, load_items, run_decode
from ..config import BlockSemantics
from ..decoding import get_mode, mode_names
from .sweep import run_sweep


@torch.inference_mode()
def teacher_forced(llm, *, files: int = 8, seq_len: int = 256, block_size: int = 32, seed: int = 0, max_seqs: int = 64) -> dict:
    """AR perplexity and next-token accuracy on held-out stdlib text; diffusion masked-token accuracy
    (and the share of masked tokens predicted with p >= threshold) with the training layout."""
    from ..data.corpus import read_text, stdlib_files

    paths = stdlib_files("heldout")[:files]
    ids: list[int] = []
    for p in paths:
        text = read_text(p)
        if text:
            ids += llm.tokenizer.encode(text) + [llm.tokenizer.eos_token_id]
    seq_len -= seq_len % block_size
    n = min(max_seqs, len(ids) // seq_len)
    if n == 0:
        raise ValueError("not enough held-out text for one sequence")
    x = torch.tensor(ids[: n * seq_len]).view(n, seq_len)
    g = torch.Generator().manual_seed(seed)
    nll = correct = count = 0.0
    m_correct = m_conf = m_count = 0.0
    thr = llm.config.threshold
    mask_id = llm.config.mask_token_id
    for i in range(n):
        seq = x[i : i + 1]
        if mask_id is None:
            logits = llm.model(seq)
        else:
            t = torch.rand(1, seq_len // block_size, 1, generator=g).clamp_min(1e-3)
            masked = (torch.rand(1, seq_len // block_size, block_size, generator=g) < t).view(1, seq_len)
            noisy = seq.masked_fill(masked, mask_id)
            logits, noisy_logits = llm.model.forward_block_diffusion(seq, noisy, block_size)
            # shift-by-one: block position 0 is predicted by the clean stream just before the block
            pred = noisy_logits.clone()
            starts = torch.arange(0, seq_len, block_size)
            pred[:, starts[1:]] = logits[:, starts[1:] - 1]
            tgt_pos = masked[0].nonzero().squeeze(-1)
            tgt_pos = tgt_pos[tgt_pos > 0]
            src_pos = torch.where(tgt_pos % block_size == 0, tgt_pos, tgt_pos - 1)
            probs = pred[0, src_pos].float().softmax(-1)
            tgt = seq[0, tgt_pos]
            m_correct += (probs.argmax(-1) == tgt).sum().item()
            m_conf += (probs.max(-1).values >= thr).sum().item()
            m_count += len(tgt_pos)
        lp = logits[0, :-1].float().log_softmax(-1)
        tgt = seq[0, 1:]
        nll += -lp.gather(-1, tgt[:, None]).sum().item()
        correct += (lp.argmax(-1) == tgt).sum().item()
        count += len(tgt)
    out = {"sequences": n, "seq_len": seq_len, "ar_perplexity": math.exp(nll / count), "ar_accuracy": correct / count}
    if m_count:
        out.update(masked_accuracy=m_correct / m_count, masked_confident=m_conf / m_count, masked_tokens=int(m_count))
    return out


def run_eval(llm, *, task_prompts: int = 100, code_prompts: int = 20, max_new_tokens: int = 64, sweep: bool = True,
             modes=None, progress=None) -> dict:
    modes = [m for m in (mode_names() if modes is None else modes) if llm.mode_available(m)]
    result: dict = {"model": str(llm.path)}
    tasks = load_items("tasks", task_prompts)
    result["tasks"] = run_decode(llm, Workload("tasks", max_new_tokens=32, stop_newline=True, items=tasks), modes=modes,
                                 progress=progress)
    if sweep and llm.config.mask_token_id is not None and llm.mode_available("diffusion"):
        result["tasks_sweep"] = run_sweep(llm, Workload("tasks", max_new_tokens=32, stop_newline=True,
                                                        items=tasks[: max(8, task_prompts // 4)]),
                                          block_sizes=(8, 16, 32, 64), progress=progress)
    code = load_items("code", code_prompts)
    result["code"] = run_decode(llm, Workload("code", max_new_tokens=max_new_tokens, items=code), modes=modes,
                                progress=progress)
    if llm.config.semantics == BlockSemantics():
        result["teacher_forced"] = teacher_forced(llm, block_size=llm.config.block_size)
    else:  # the causal forward and Clover's training layout: neither is this model's (SDAR, LLaDA2, Dream, LLaDA)
        result["teacher_forced"] = {"skipped": f"{llm.config.model_type}'s forward is not a causal, shifted one: "
                                               "no AR perplexity or Clover training-layout accuracy"}
    for key in ("tasks", "code"):  # keep the JSON small: per-run texts are in the bench output if needed
        for r in result[key]["runs"]:
            r.pop("token_ids", None)
    return result


def markdown(result: dict) -> str:
    lines = []
    t = result["tasks"]["modes"]
    lines.append(f"**Tasks** ({result['tasks']['settings']['prompts']} held-out prompts, greedy, answer = first line)\n")
    lines.append("| mode | exact match | tokens/forward | forced steps | tokens/s | vs AR tokens/s |")
    lines.append("|---|---:|---:|---:|---:|---:|")
    for m, s in t.items():
        em = s["quality"].get("tasks", {}).get("exact_match")
        ratio = s.get("vs_ar", {}).get("tokens_per_second")
        lines.append(f"| {m} | {em:.1%} | {s['tokens_per_forward']:.2f} | {fmt(s['forced_share'], '.0%')} | "
                     f"{s['tokens_per_second']['aggregate']:.1f} | {fmt(ratio, '.2f')}{'x' if ratio is not None else ''} |")
    for m, s in t.items():
        d = s.get("vs_ar", {}).get("divergence")
        if d and d["diverged"] and not get_mode(m).reference:  # a lossless mode repeats its reference's tokens
            lines.append(f"\n{m}: output differs from AR's on {d['diverged']:.0%} of the prompts; in "
                         f"{d['first_at_forced_commit']:.0%} of those the first differing token was a forced commit "
                         "(a step where no position reached the threshold).")
    kinds = next(iter(t.values()), {}).get("quality", {}).get("tasks", {}).get("by_kind")
    if kinds:
        lines.append("\n**Tasks by kind** (exact match per mode; tokens/forward of the parallel modes)\n")
        par = [m for m in t if m != "ar"]
        lines.append("| kind | n | " + " | ".join(f"{m} EM" for m in t) + "".join(f" | {m} tok/fwd" for m in par) + " |")
        lines.append("|---|---:|" + "---:|" * (len(t) + len(par)))
        for k in kinds:
            row = [k, str(kinds[k]["n"])]
            row += [f"{t[m]['quality']['tasks']['by_kind'][k]['exact_match']:.0%}" for m in t]
            row += [f"{t[m]['quality']['tasks']['by_kind'][k]['tokens_per_forward']:.2f}" for m in par]
            lines.append("| " + " | ".join(row) + " |")
    if "tasks_sweep" in result:
        lines.append("\n**Diffusion sweep on tasks** (threshold at the default block size; block size at the default threshold)\n")
        lines.append("| configuration | exact match | tokens/forward | forced steps | tokens/s |")
        lines.append("|---|---:|---:|---:|---:|")
        for p in result["tasks_sweep"]["points"]:
            em = p["quality"].get("tasks", {}).get("exact_match")
            lines.append(f"| {p['label']} | {em:.1%} | {p['tokens_per_forward']:.2f} | {fmt(p['forced_share'], '.0%')} | "
                         f"{p['tokens_per_second']:.1f} |")
    c = result["code"]["modes"]
    lines.append(f"\n**Code** ({result['code']['settings']['prompts']} held-out `def` headers, "
                 f"{result['code']['settings']['max_new_tokens']} new tokens)\n")
    lines.append("| mode | parse rate | edit similarity | tokens/forward | tokens/s |")
    lines.append("|---|---:|---:|---:|---:|")
    for m, s in c.items():
        q = s["quality"].get("code", {})
        lines.append(f"| {m} | {q.get('parse_rate', 0):.1%} | {q.get('edit_similarity', 0):.3f} | "
                     f"{s['tokens_per_forward']:.2f} | {s['tokens_per_second']['aggregate']:.1f} |")
    tf = result["teacher_forced"]
    if "skipped" in tf:
        return "\n".join(lines + [f"\nHeld-out stdlib text: skipped ({tf['skipped']})"])
    lines.append(f"\nHeld-out stdlib text ({tf['sequences']} x {tf['seq_len']} tokens): AR perplexity "
                 f"{tf['ar_perplexity']:.2f}, next-token accuracy {tf['ar_accuracy']:.1%}"
                 + (f"; diffusion masked-token accuracy {tf['masked_accuracy']:.1%}, masked tokens at p >= threshold "
                    f"{tf['masked_confident']:.1%}" if "masked_accuracy" in tf else ""))
    return "\n".join(lines)

