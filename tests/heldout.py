"""Held-out prompts and text for the cross-engine checks (GGUF/llama.cpp, vLLM): task prompts and
`def` headers the training data never held, and a run of held-out code as token ids."""

from __future__ import annotations


def held_out_prompts(n: int) -> list[str]:
    from clover.data.corpus import heldout_functions
    from clover.data.tasks import heldout_tasks

    tasks = [t.prompt for t in heldout_tasks(n // 2)]
    return tasks + [h for h, _ in heldout_functions(n - len(tasks), seed=0)]


def held_out_text(tokenizer, n_tokens: int) -> list[int]:
    from clover.data.corpus import heldout_functions

    ids: list[int] = []
    for h, b in heldout_functions(40, seed=1):
        ids += tokenizer.encode(h + b)
        if len(ids) >= n_tokens:
            return ids[:n_tokens]
    raise AssertionError("not enough held-out text")
