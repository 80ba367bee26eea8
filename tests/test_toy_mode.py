"""Adding a decoding mode takes one file and one `register(...)` line: this module is that file. The
toy mode is AR greedy under its own name and batching key; the CLI, the API, the server and bench
accept it as soon as it is registered, and forget it once it is unregistered."""

from __future__ import annotations

import json

import pytest

from clover.decoding.ar import AREngine
from clover.decoding.modes import EngineSpec, Mode, mode_names, register, unregister


class Toy(Mode):
    name = "toy"
    summary = "AR greedy under another name: one token per forward, the argmax of the last position"

    def __init__(self) -> None:
        self.built: list = []  # the options of every request resolved, to see which front end reached it

    def spec(self, params, provisional=False) -> EngineSpec:
        self.built.append(params)  # every front end resolves a request's options to its spec here
        return EngineSpec(self)  # its own batch: a spec carries its mode

    def make_engine(self, model, spec, *, mask_id, pad_id):
        return AREngine(model, pad_id=pad_id)


@pytest.fixture()
def toy():
    mode = register(Toy())  # the one registry line
    try:
        yield mode
    finally:
        unregister("toy")


PROMPT = "def f(x):"
N = 6


def test_api(toy, tiny_llm):
    g = tiny_llm.generate(PROMPT, mode="toy", max_new_tokens=N)
    assert toy.built and g.token_ids == tiny_llm.generate(PROMPT, mode="ar", max_new_tokens=N).token_ids
    assert g.stats.forwards == len(g.token_ids)


def test_cli(toy, tiny_dir, capsys):
    from clover.cli import main

    assert main(["generate", PROMPT, "--model", str(tiny_dir), "--mode", "toy", "-n", str(N), "--json",
                 "--policy", "factor", "--sub-block", "4"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["mode"] == "toy" and len(out["token_ids"]) <= N
    assert toy.built[-1].policy == "factor" and toy.built[-1].sub_block == 4  # the new flags reach the engine


def test_server(toy, tiny_llm):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from clover.serve import create_app

    body = {"prompt": PROMPT, "max_tokens": N, "temperature": 0, "mode": "toy", "policy": "entropy", "entropy_budget": 0.5,
            "fallback": "leftmost", "sub_block": 2, "low_threshold": 0.25, "factor": 3.0}
    with TestClient(create_app(tiny_llm, model_name="m")) as client:
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == tiny_llm.generate(PROMPT, mode="ar", max_new_tokens=N).text
        p = toy.built[-1]  # every generation option of the request reaches the engine
        assert (p.policy, p.entropy_budget, p.fallback, p.sub_block, p.low_threshold, p.factor) == \
            ("entropy", 0.5, "leftmost", 2, 0.25, 3.0)
        assert "toy" in client.get("/openapi.json").json()["components"]["schemas"]["CompletionRequest"]["properties"]["mode"]["anyOf"][0]["enum"]


def test_bench(toy, tiny_llm):
    from clover.bench.decode import Workload, run_decode

    result = run_decode(tiny_llm, Workload("tasks", prompts=1, max_new_tokens=4), modes=["ar", "toy"], warmup=False)
    assert set(result["modes"]) == {"ar", "toy"}
    runs = {r["mode"]: r for r in result["runs"]}
    assert runs["toy"]["token_ids"] == runs["ar"]["token_ids"]


def test_unregistered_mode_is_refused_everywhere(tiny_llm, tiny_dir, capsys):
    assert "toy" not in mode_names()
    with pytest.raises(ValueError, match="mode"):
        tiny_llm.generate(PROMPT, mode="toy", max_new_tokens=2)
    from clover.cli import main

    with pytest.raises(SystemExit):  # argparse: not among the --mode choices
        main(["generate", PROMPT, "--model", str(tiny_dir), "--mode", "toy"])
    assert "invalid choice: 'toy'" in capsys.readouterr().err
