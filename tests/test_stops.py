"""Where an output ends and why: every mode agrees on text, tokens and finish_reason for the same
tokens, and no stop string is ever left in the text, through the API (generate and stream) and the
server (streamed and not).

The stop strings are taken from the model's own free-running output, so they land where it matters:
spanning token boundaries, on the last allowed token, and inside a speculative draft or a diffusion
block that commits many tokens at once."""

from __future__ import annotations

import json

import pytest

import clover
from clover.decoding.base import held_back

PROMPTS = [
    "assert [x * 2 for x in [4, 8]] == ",
    "assert sorted([31, 7, 19]) == ",
    "def add(a, b):\n",
    "assert max([3, 9, 2]) == ",
    "assert len('hello') == ",
    "for i in range(3):\n",
]
K_MAX = 14


@pytest.fixture(scope="module")
def llm():
    return clover.load()  # the bundled model: real text, multi-token drafts and blocks


@pytest.fixture(scope="module")
def cases(llm):
    """(max_new_tokens, stop strings) pairs derived from AR's free-running output."""
    free = llm.generate(PROMPTS, mode="ar", max_new_tokens=K_MAX)
    dec = llm.tokenizer.decode
    spans, lasts = [], []
    for g in free:
        ids = g.token_ids
        bounds = [len(dec(ids[:j])) for j in range(1, len(ids))]
        text = g.text
        for j, b in enumerate(bounds):
            if 0 < b < len(text) and j % 3 == 1:  # two characters across a token boundary
                spans.append(text[b - 1 : b + 1])
        if len(ids) >= 6:
            lasts.append((6, dec(ids[:6])[-1:]))  # the last allowed token's last character
    out = [(K_MAX, ["\n"]), (8, ["\n"]), (K_MAX, ["]", ")"]), (K_MAX, ["16]"])]
    for i in range(0, min(len(spans), 12), 3):
        out.append((K_MAX, spans[i : i + 3]))
    for k, s in lasts[:3]:
        out.append((k, [s]))
    for k in (5, 9):
        out.append((k, [s for s in spans[:2]] + ["\n"]))
    return [(k, [s for s in stop if s]) for k, stop in out if any(stop)]


def _check_no_stop(gens, stop):
    for g in gens:
        assert not any(s in g.text for s in stop), (g.text, stop)
        if g.finish_reason == "length":
            assert len(g.token_ids) > 0


def _key(g):
    return g.text, g.token_ids, g.finish_reason


def test_ar_equals_speculative_and_diffusion_equals_naive(llm, cases):
    assert len(cases) >= 10
    checked = 0
    for k, stop in cases:
        kw = dict(max_new_tokens=k, stop=stop)
        ar = llm.generate(PROMPTS, mode="ar", **kw)
        sp = llm.generate(PROMPTS, mode="speculative", **kw)
        df = llm.generate(PROMPTS, mode="diffusion", **kw)
        nv = llm.generate(PROMPTS, mode="naive", **kw)
        for a, s in zip(ar, sp):
            assert _key(s) == _key(a), (k, stop)
        for d, n in zip(df, nv):
            assert _key(n) == _key(d), (k, stop)
        for gens in (ar, sp, df, nv):
            _check_no_stop(gens, stop)
        checked += 1
    # the cases do reach both endings
    reasons = {g.finish_reason for k, stop in cases[:4] for g in llm.generate(PROMPTS, mode="ar", max_new_tokens=k, stop=stop)}
    assert {"stop", "length"} <= reasons


@pytest.mark.parametrize("mode", ["ar", "speculative", "diffusion", "naive"])
def test_stream_is_the_final_text(llm, cases, mode):
    """Concatenated stream deltas == the final text; no delta ever shows a stop string (or the start
    of one that the final text drops)."""
    for k, stop in cases[::3]:
        for prompt in PROMPTS[:3]:
            events = list(llm.stream(prompt, mode=mode, max_new_tokens=k, stop=stop))
            final = events[-1].generation
            text = "".join(e.text for e in events if e.kind == "block")
            assert text == final.text, (mode, k, stop, prompt)
            assert [t for e in events if e.kind == "block" for t in e.token_ids] == final.token_ids
            ref = llm.generate(prompt, mode=mode, max_new_tokens=k, stop=stop)
            assert _key(final) == _key(ref)


def test_finish_reason_when_the_stop_string_completes_on_the_last_allowed_token(llm):
    """The case found by probing: AR stops on "\\n" as its 8th token; a mode that accepts 8+ tokens
    at once used to report `length` and leave the "\\n" in the text."""
    p = "assert [x * 2 for x in [4, 8]] == "
    ar = llm.generate(p, mode="ar", max_new_tokens=8, stop=["\n"])
    assert ar.finish_reason == "stop" and "\n" not in ar.text
    for mode in ("speculative", "diffusion", "naive"):
        g = llm.generate(p, mode=mode, max_new_tokens=8, stop=["\n"])
        assert _key(g) == _key(ar), mode


def test_row_accept_applies_the_first_ending():
    from clover.decoding.base import RowState
    from clover.decoding.sampling import SamplingParams

    dec = lambda ids: "".join(chr(97 + t) for t in ids)  # noqa: E731 - token t is one letter
    def row(**kw):
        return RowState([0], SamplingParams(**kw).validate(), {25}, decode=dec)

    # a stop string completed inside a multi-token commit beats the length limit it also hits
    r = row(max_new_tokens=3, stop=["bc"])
    assert r.accept([0, 1, 2, 3], [1] * 4) == [0, 1, 2]
    assert (r.finish_reason, r.text(), r.stop_token) == ("stop", "a", None)
    # ... and an EOS that comes after it (the EOS is never reached)
    r = row(max_new_tokens=10, stop=["bc"])
    r.accept([0, 1, 2, 25, 4], [1] * 5)
    assert (r.finish_reason, r.tokens, r.stop_token) == ("stop", [0, 1, 2], None)
    # an EOS before the stop string ends the row first
    r = row(max_new_tokens=10, stop=["bc"])
    r.accept([0, 25, 1, 2], [1] * 4)
    assert (r.finish_reason, r.tokens, r.stop_token) == ("stop", [0], 25)
    # an EOS beyond the length limit is never seen
    r = row(max_new_tokens=2)
    r.accept([0, 1, 25], [1] * 3)
    assert (r.finish_reason, r.tokens, r.stop_token) == ("length", [0, 1], None)
    # token by token gives the same
    r = row(max_new_tokens=3, stop=["bc"])
    for t in (0, 1, 2):
        r.accept([t], [1])
    assert (r.finish_reason, r.tokens, r.text()) == ("stop", [0, 1, 2], "a")


def test_held_back_never_emits_a_possible_stop_start():
    assert held_back("abc\n", ["\n\n"]) == 3
    assert held_back("abc", ["cd"]) == 2
    assert held_back("ab\ufffd", []) == 2
    assert held_back("abc", ["x"]) == 3


def test_server_agrees_with_the_api(llm, cases):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from clover.serve import create_app

    app = create_app(llm, model_name="m", max_batch=8)
    with TestClient(app) as client:
        for k, stop in cases[1::4]:
            for mode in ("ar", "speculative", "diffusion"):
                ref = llm.generate(PROMPTS[:4], mode=mode, max_new_tokens=k, stop=stop)
                body = {"prompt": PROMPTS[:4], "max_tokens": k, "stop": stop, "mode": mode, "temperature": 0}
                r = client.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                got = sorted(r.json()["choices"], key=lambda c: c["index"])
                assert [(c["text"], c["finish_reason"]) for c in got] == [(g.text, g.finish_reason) for g in ref]
                texts, reasons = [""] * 4, [None] * 4
                with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
                    for line in s.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        for c in json.loads(line[6:])["choices"]:
                            texts[c["index"]] += c["text"]
                            reasons[c["index"]] = c["finish_reason"] or reasons[c["index"]]
                assert list(zip(texts, reasons)) == [(g.text, g.finish_reason) for g in ref], (mode, k, stop)
