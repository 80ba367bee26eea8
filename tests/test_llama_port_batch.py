"""Rows in one forward: `llama-clover --parallel N` (docs/llama-port.md, "Rows in one forward").

Slow (CLOVER_SLOW=1, and `PORT=1 scripts/build-llama-cpp.sh`; skipped with the reason otherwise), on
the bundled model exported in f32, requests of different prompt lengths and lengths (EOS on, so rows
finish at different times) sent at once to one `--json` process:
- batched rows (ar greedy and sampled, diffusion with the model's defaults and sampled) give the
  same tokens as the same requests decoded one by one (`--parallel 1`), and the rows did share
  forwards (the done line's batch_rows); more requests than slots join as rows leave;
- greedy batched rows equal clover's engine (ar; diffusion, forward count included);
- speculative rows batch (each row's rollback its own): the same tokens, forwards and accept lengths
  as one by one, tokens = AR greedy; rows with block expert sharing (each row's budget and rank) too;
- a request the batch does not take (dflash) among batched rows runs alone between batches, with its
  own tokens (= AR greedy); a cancelled row stops and the others go on;
- `clover serve --engine llama.cpp` with concurrent rows batched in the port answers as the torch engine.
"""

from __future__ import annotations

import pytest

from test_llama_port import drafter_f32, llm, mixed_prompts, options, port  # noqa: F401  (drafter_f32, llm, port: fixtures)

LENGTHS = (40, 17, 33, 9, 28, 40, 22, 12)  # max_new_tokens per request: rows end at different forwards


def decode(gguf, llm, requests: list[dict], parallel: int, drafter=None) -> list[dict]:
    """All `requests` sent at once to one `--json` process with `--parallel`; each one's done line."""
    from clover.integrations.llama_port import PortProcess

    with PortProcess(gguf, eos_ids=llm.eos_ids(), parallel=parallel, drafter=drafter) as proc:
        ids = [proc.send(r) for r in requests]
        done = {}
        while len(done) < len(ids):
            ev = proc.event()
            assert ev["event"] != "error", ev
            if ev["event"] == "done":
                done[ev["id"]] = ev
    return [done[i] for i in ids]


def requests_for(llm, mode: str, n: int = 8, **kw) -> list[dict]:
    prompts = mixed_prompts(llm, n)
    return [{"prompt": p, **options(llm, mode, max_new_tokens=LENGTHS[i % len(LENGTHS)], **kw)} for i, p in enumerate(prompts)]


def check_batched(gguf, llm, reqs, parallel: int) -> list[dict]:
    one = decode(gguf, llm, reqs, 1)
    many = decode(gguf, llm, reqs, parallel)
    assert [d["tokens"] for d in many] == [d["tokens"] for d in one]
    assert [d["finish"] for d in many] == [d["finish"] for d in one]
    assert "batch_rows" not in one[0]
    assert sum(d["batch_rows"] for d in many) / len(many) > 2  # the rows shared forwards
    return many


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_batched_rows_equal_rows_one_by_one_and_clover(port, bundled_f32, llm, mode):
    """Greedy: 8 rows in one forward (8 slots) = one by one = clover's engine (diffusion: the same
    forwards per row too)."""
    reqs = requests_for(llm, mode, temperature=0.0)
    many = check_batched(bundled_f32, llm, reqs, 8)
    for r, d in zip(reqs, many):
        ours = llm.generate(r["prompt"], mode=mode, temperature=0.0, max_new_tokens=r["max_new_tokens"])
        assert d["tokens"] == ours.token_ids
        if mode == "diffusion":
            assert d["forwards"] == ours.stats.forwards


@pytest.mark.slow
@pytest.mark.parametrize("mode, kw", [("ar", dict(temperature=0.8, top_p=0.9)), ("diffusion", dict(temperature=1.0))])
def test_batched_sampled_rows_equal_rows_one_by_one(port, bundled_f32, llm, mode, kw):
    """Sampled rows (a seed each): each row's draws are its own, batched or not."""
    reqs = [dict(r, seed=100 + i) for i, r in enumerate(requests_for(llm, mode, **kw))]
    check_batched(bundled_f32, llm, reqs, 8)


@pytest.mark.slow
def test_rows_join_as_rows_leave(port, bundled_f32, llm):
    """12 requests on 4 slots (continuous batching) and two with prompts of 64+ tokens (their prefill
    in a forward of its own, ggml's tiled attention path): every row = one by one; diffusion and ar
    rows share forwards."""
    reqs = requests_for(llm, "diffusion", n=6, temperature=0.0) + requests_for(llm, "ar", n=6, temperature=0.0)
    long = sum((r["prompt"] for r in reqs[:5]), [])
    assert len(long) >= 64
    reqs[3:3] = [dict(reqs[0], prompt=long), dict(reqs[7], prompt=long[-70:])]
    check_batched(bundled_f32, llm, reqs, 4)


@pytest.mark.slow
@pytest.mark.parametrize("draft", [None, 3])
def test_batched_speculative_rows(port, bundled_f32, llm, draft):
    """Speculative rows in one forward (the fixed draft of the model's block, and draft 3; the adaptive
    draft, speculative's default, runs alone between batches): tokens, forwards and accept lengths =
    one by one; tokens = AR greedy."""
    kw = {"block_size": llm.config.block_size} if draft is None else {"draft_length": draft}
    reqs = requests_for(llm, "speculative", **kw)
    many = check_batched(bundled_f32, llm, reqs, 8)
    one = decode(bundled_f32, llm, reqs, 1)
    assert [(d["forwards"], d["accept_lengths"]) for d in many] == [(d["forwards"], d["accept_lengths"]) for d in one]
    ar = decode(bundled_f32, llm, [{**r, "mode": "ar"} for r in reqs], 8)
    assert [d["tokens"] for d in many] == [d["tokens"] for d in ar]


@pytest.mark.slow
def test_batched_rows_with_expert_sharing(port, bundled_f32, llm):
    """Rows sharing the block's experts, each with its own budget and rank (diffusion budget 4 by the
    sum, 3 by the max; speculative draft 3 budget 2), among rows that share none: = one by one, and
    the sharing changed the diffusion rows' tokens."""
    reqs = (requests_for(llm, "diffusion", n=4, temperature=0.0, expert_budget=4)
            + requests_for(llm, "diffusion", n=4, temperature=0.0, expert_budget=3, expert_rank="max")
            + requests_for(llm, "speculative", n=4, draft_length=3, expert_budget=2)
            + requests_for(llm, "diffusion", n=4, temperature=0.0))
    check_batched(bundled_f32, llm, reqs, 8)
    plain = decode(bundled_f32, llm, [{**r, "expert_budget": None} for r in reqs[:8]], 8)
    assert [d["tokens"] for d in plain] != [d["tokens"] for d in decode(bundled_f32, llm, reqs[:8], 8)]


@pytest.mark.slow
def test_unbatched_modes_and_cancel_among_batched_rows(port, bundled_f32, drafter_f32, llm):
    """A dflash request among ar rows runs alone between batches: its tokens = ar greedy; a cancelled
    row stops with finish "abort" while the others go on to the same tokens as alone."""
    from clover.integrations.llama_port import PortProcess

    reqs = requests_for(llm, "ar", n=4, temperature=0.0)
    spec = {"prompt": reqs[1]["prompt"], **options(llm, "dflash", drafter=drafter_f32, max_new_tokens=reqs[1]["max_new_tokens"])}
    alone = decode(bundled_f32, llm, reqs, 1)
    with PortProcess(bundled_f32, eos_ids=llm.eos_ids(), parallel=4, drafter=drafter_f32) as proc:
        long = proc.send({"prompt": [5, 6, 7], "mode": "ar", "max_new_tokens": 4000, "ignore_eos": True, "stream": True})
        ids = [proc.send(r) for r in reqs[:2]] + [proc.send(spec)] + [proc.send(r) for r in reqs[2:]]
        done, cancelled = {}, False
        while len(done) < len(ids) + 1:
            ev = proc.event()
            assert ev["event"] != "error", ev
            if ev["event"] == "commit" and ev["id"] == long and not cancelled:
                proc.cancel(long)
                cancelled = True
            if ev["event"] == "done":
                done[ev["id"]] = ev
    assert done[long]["finish"] == "abort" and done[long]["n_tokens"] < 4000
    got = [done[i] for i in ids]
    assert [d["tokens"] for d in got[:2] + got[3:]] == [d["tokens"] for d in alone]
    assert got[2]["tokens"] == alone[1]["tokens"] and "batch_rows" not in got[2]


@pytest.mark.slow
def test_serve_batches_concurrent_rows_in_the_port(port, bundled_f32, llm, monkeypatch):
    """`clover serve --engine llama.cpp`: a request of 6 prompts (6 rows in flight) answers as the torch
    engine does, and the port decoded the rows together."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from clover.integrations.llama_port import PortLLM, PortProcess
    from clover.serve import create_app

    seen = []
    event = PortProcess.event

    def recording(self):
        ev = event(self)
        seen.append(ev)
        return ev

    monkeypatch.setattr(PortProcess, "event", recording)
    served = PortLLM(llm, bundled_f32, parallel=8)
    prompts = ["def add(a, b):", "assert sorted([9, 2, 5]) == ", "import os\n", "def f(x):", "class A:", "x = [1, 2"]
    try:
        with TestClient(create_app(llm, model_name="m")) as a, TestClient(create_app(served, model_name="m")) as b:
            for mode in ("ar", "diffusion"):
                body = {"model": "m", "prompt": prompts, "max_tokens": 24, "temperature": 0, "mode": mode}
                ra, rb = a.post("/v1/completions", json=body), b.post("/v1/completions", json=body)
                assert ra.status_code == rb.status_code == 200, rb.text
                assert [(c["text"], c["finish_reason"]) for c in ra.json()["choices"]] == \
                    [(c["text"], c["finish_reason"]) for c in rb.json()["choices"]]
                assert ra.json()["usage"] == rb.json()["usage"]
    finally:
        served.close()
    done = [ev for ev in seen if ev["event"] == "done"]
    assert len(done) == 12 and max(ev["batch_rows"] for ev in done) > 3
