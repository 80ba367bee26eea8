"""Generation options are checked in one typed place (`LIMITS`): the API, the CLI and the server refuse
the same values with a message naming the option, and the server's OpenAPI schema states the same
bounds."""

from __future__ import annotations

import math

import pytest

from clover.decoding.sampling import LIMITS, SEED_MAX, SamplingParams, make_generator

BAD = [
    ("temperature", math.nan), ("temperature", 1e308), ("temperature", -0.1), ("temperature", math.inf),
    ("presence_penalty", math.nan), ("presence_penalty", 3.0), ("eos_penalty", -math.inf), ("eos_penalty", 1e9),
    ("repetition_penalty", math.inf), ("repetition_penalty", 0.0), ("threshold", math.inf), ("threshold", 0.0),
    ("top_k", 10**9), ("top_k", -2), ("top_p", 0.0), ("top_p", 1.5), ("seed", SEED_MAX + 1), ("seed", -1),
    ("stop", ["x"] * 10_000), ("stop", ["y" * 1000]), ("stop_token_ids", [-1]), ("stop_token_ids", list(range(1000))),
    ("max_new_tokens", -1), ("max_new_tokens", True), ("max_new_tokens", 2.5), ("block_size", 0),
    ("block_size", 10**6), ("no_repeat_ngram_size", 10**6), ("expert_budget", 0), ("draft_length", 0),
    ("confidence", "loud"), ("ignore_eos", "yes"), ("temperature", "0.5"),
]


@pytest.mark.parametrize("name,value", BAD, ids=[f"{n}={str(v)[:12]}" for n, v in BAD])
def test_params_refuse_with_the_option_name(name, value):
    with pytest.raises(ValueError, match=rf"^{name}: "):
        SamplingParams.from_kwargs(**{name: value})


def test_params_accept_the_edges():
    for name, lim in LIMITS.items():
        for edge in (lim.ge, lim.le):
            if edge is not None and lim.kind in (int, float):
                p = SamplingParams.from_kwargs(**{name: lim.kind(edge)})
                assert getattr(p, name) == (max(0, edge) if name == "top_k" else edge)
    p = SamplingParams.from_kwargs(stop="\n", top_k=-1, seed=SEED_MAX)
    assert p.stop == ["\n"] and p.top_k == 0
    # seed + i for the i-th of n rows wraps instead of overflowing the generator
    assert make_generator(SEED_MAX + 3).initial_seed() == 2


def test_api_refuses_before_decoding(tiny_llm):
    with pytest.raises(ValueError, match="^seed: "):
        tiny_llm.generate("x", max_new_tokens=2, seed=2**64)
    with pytest.raises(ValueError, match="^stop_token_ids: .*outside the vocabulary"):
        tiny_llm.generate("x", max_new_tokens=2, stop_token_ids=[10**6])
    g = tiny_llm.generate("x", max_new_tokens=2, seed=SEED_MAX, temperature=0.7)
    assert len(g.token_ids) <= 2


@pytest.mark.parametrize("flags,name", [
    (["--temperature", "nan"], "temperature"), (["--seed", str(2**64)], "seed"), (["--top-k", "1000000000"], "top_k"),
    (["--threshold", "inf"], "threshold"), (["--eos-penalty=-inf"], "eos_penalty"),
])
def test_cli_refuses_with_the_option_name(capsys, tiny_dir, flags, name):
    from clover.cli import main

    assert main(["generate", "--model", str(tiny_dir), "-n", "2", *flags, "x"]) == 2
    err = capsys.readouterr().err
    assert name.replace("_", "-") in err or name in err


def test_schema_states_the_same_limits():
    pytest.importorskip("pydantic")
    from clover.serve.schemas import CompletionRequest

    props = CompletionRequest.model_json_schema()["properties"]
    alias = {"max_new_tokens": "max_tokens"}
    for name, lim in LIMITS.items():
        prop = props[alias.get(name, name)]
        variants = prop.get("anyOf", [prop])
        bounds = {k: v for var in variants for k, v in var.items() if k in ("minimum", "maximum", "exclusiveMinimum")}
        if lim.ge is not None and lim.kind is not list:
            assert bounds.get("minimum") == lim.ge, name
        if lim.gt is not None:
            assert bounds.get("exclusiveMinimum") == lim.gt, name
        if lim.le is not None and lim.kind is not list:
            assert bounds.get("maximum") == lim.le, name


@pytest.mark.parametrize("name,value", [
    ("temperature", 1e308), ("seed", 2**64), ("top_k", 10**9), ("threshold", 1e300), ("presence_penalty", 5),
    ("stop", ["x"] * 100), ("expert_budget", 0), ("eos_penalty", -1e300),
])
def test_server_refuses_with_param_and_code(tiny_llm, name, value):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from clover.serve import create_app

    with TestClient(create_app(tiny_llm, model_name="m")) as client:
        r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 2, name: value})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == name and err["code"], err
        # NaN is not JSON, but clients send it anyway
        r = client.post("/v1/completions", content=b'{"prompt": "x", "presence_penalty": NaN}',
                        headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"], r.text


@pytest.mark.parametrize("kw", [
    dict(top_p=5e-324, temperature=1.0), dict(repetition_penalty=5e-324), dict(presence_penalty=5e-324),
    dict(temperature=5e-324), dict(temperature=1e-30, top_k=3), dict(repetition_penalty=5e-324, temperature=0.7),
])
def test_extreme_valid_values_decode(tiny_llm, kw):
    """Values at the edge of the limits decode instead of producing NaN probabilities."""
    for mode in ("ar", "diffusion"):
        g = tiny_llm.generate([1, 2, 3], mode=mode, max_new_tokens=4, seed=0, **kw)
        assert len(g.token_ids) <= 4


@pytest.mark.parametrize("name, value", [("threshold", 3.0), ("threshold", 0.0), ("block_size", 0), ("policy", "nope")])
def test_config_defaults_are_checked_by_the_request_rule(tiny_llm, name, value):
    """A config.json default (threshold, block_size, policy) is refused exactly when the same value
    in a request is: one rule, `LIMITS`, with the same message."""
    import dataclasses

    from clover.config import ConfigError

    with pytest.raises(ValueError) as request:
        SamplingParams(**{name: value}).validate()
    with pytest.raises(ConfigError) as config:
        dataclasses.replace(tiny_llm.config, **{name: value})
    assert str(request.value) in str(config.value)
    dataclasses.replace(tiny_llm.config, threshold=LIMITS["threshold"].le)  # the largest a request takes
