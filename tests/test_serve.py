"""The OpenAI-compatible server: a real uvicorn server on 127.0.0.1 and the official client."""

from __future__ import annotations

import concurrent.futures
import socket
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
import httpx  # noqa: E402
import torch  # noqa: E402

KEY = "test-key"
MODEL = "tiny"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, llm, graceful: float | None = 10, **kwargs) -> None:
        from clover.serve import create_app
        from clover.serve.app import uvicorn_server

        self.app = create_app(llm, model_name=MODEL, **kwargs)
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn_server(self.app, host="127.0.0.1", port=self.port, log_level="warning", graceful=graceful)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    @property
    def scheduler(self):
        return self.app.state.scheduler


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    import clover
    from clover.tiny import build_tiny_checkpoint

    return clover.load(build_tiny_checkpoint(tmp_path_factory.mktemp("serve") / "model", seed=0))


@pytest.fixture(scope="module")
def server(llm):
    with LiveServer(llm, max_batch=8, max_queue=16, api_key=KEY) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as c:
        yield c


GREEDY = dict(temperature=0, extra_body={"ignore_eos": True})


# ----------------------------------------------------------------------------------- basics
def test_models_health_tokenize(http, llm):
    assert http.get("/health").json()["status"] == "ok"
    models = http.get("/v1/models").json()
    assert models["data"][0]["id"] == MODEL
    r = http.post("/tokenize", json={"prompt": "héllo"}).json()
    assert r["tokens"] == llm.tokenizer.encode("héllo") and r["count"] == len(r["tokens"])
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json()["prompt"] == "héllo"
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_completion_matches_library_and_stream(client, llm, mode):
    body = {"mode": mode, "ignore_eos": True}
    r = client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=12, temperature=0, extra_body=body)
    ref = llm.generate("def f(x):", mode=mode, max_new_tokens=12, ignore_eos=True)
    assert r.choices[0].text == ref.text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(llm.tokenizer.encode("def f(x):"))
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12
    chunks = list(client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=12, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=body))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == r.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12


def test_chat_and_chat_stream(client, llm):
    msgs = [{"role": "user", "content": "Say hi"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, **GREEDY)
    assert r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(llm.tokenizer.apply_chat_template(msgs))
    assert 0 <= r.usage.completion_tokens <= 10 and r.choices[0].finish_reason in ("stop", "length")
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, stream=True, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_n_and_stop_and_prompt_lists(client, llm):
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=8, n=3, temperature=1.0, seed=7,
                                  extra_body={"mode": "ar", "ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 24
    again = client.completions.create(model=MODEL, prompt="abc", max_tokens=8, n=3, temperature=1.0, seed=7,
                                      extra_body={"mode": "ar", "ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # seed + i per choice: reproducible
    # stop strings: cut at the first occurrence of a stop string taken from the greedy output
    body = {"mode": "ar", "ignore_eos": True}
    text = client.completions.create(model=MODEL, prompt="xyz", max_tokens=16, temperature=0, extra_body=body).choices[0].text
    # an ASCII stop string (the engine's stop-string cut counts characters of decoded token prefixes,
    # which a multi-byte character split across byte tokens throws off)
    stop = next(ch for ch in text[2:] if ch.isascii() and ch.isprintable())
    cut = client.completions.create(model=MODEL, prompt="xyz", max_tokens=16, temperature=0, stop=[stop], extra_body=body)
    assert cut.choices[0].text == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="xyz", max_tokens=16, temperature=0, stop=[stop], stream=True, extra_body=body))
    assert streamed == cut.choices[0].text
    # several prompts, as strings and as token ids
    ids = llm.tokenizer.encode("hello")
    multi = client.completions.create(model=MODEL, prompt=[ids, ids], max_tokens=4, **GREEDY)
    assert len(multi.choices) == 2 and multi.choices[0].text == multi.choices[1].text
    strs = client.completions.create(model=MODEL, prompt=["hello", "world"], max_tokens=4, **GREEDY)
    assert strs.choices[0].text == multi.choices[0].text and strs.usage.prompt_tokens == 10


def test_loglikelihood_echo(http, llm):
    """lm-eval's local-completions loglikelihood request: prompt as token ids, echo, logprobs=1."""
    ids = llm.tokenizer.encode("The quick brown fox")
    n = len(ids)
    with torch.inference_mode():
        ref = torch.log_softmax(llm.model(torch.tensor([ids]))[0].float(), -1)  # [n, V]
    want = ref[torch.arange(n - 1), torch.tensor(ids[1:])]
    for max_tokens in (0, 1):
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": ids, "echo": True, "logprobs": 1,
                                                "max_tokens": max_tokens, "temperature": 0})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        lp = choice["logprobs"]
        assert choice["text"].startswith(llm.tokenizer.decode(ids))
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert len(lp["token_logprobs"]) == len(lp["tokens"]) == len(lp["text_offset"]) == n + max_tokens
        torch.testing.assert_close(torch.tensor(lp["token_logprobs"][1:n]), want)
        for tok_lp, top in zip(lp["token_logprobs"][1:n], lp["top_logprobs"][1:n]):
            assert len(top) == 1 and max(top.values()) >= tok_lp - 1e-6  # lm-eval's is_greedy check works
        if max_tokens:  # greedy: the generated token is the argmax after the prompt (EOS included)
            assert lp["token_logprobs"][-1] == pytest.approx(ref[-1].max().item(), abs=1e-5)


# ------------------------------------------------------------------------------------ errors
def test_errors_then_still_serving(server, http, client):
    bad_key = httpx.post(server.base + "/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer no"})
    assert bad_key.status_code == 401 and bad_key.json()["error"]["type"] == "authentication_error"
    assert httpx.get(server.base + "/v1/models").status_code == 401
    unknown = http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
    for field, value in [("temperature", -1), ("top_p", 2), ("max_tokens", -3), ("n", 0), ("mode", "telepathy")]:
        r = http.post("/v1/completions", json={"prompt": "x", field: value})
        assert r.status_code == 400, (field, r.text)
        err = r.json()["error"]
        assert err["param"] == field and set(err) == {"message", "type", "param", "code"}
    r = http.post("/v1/completions", json={"prompt": "x", "confidence": "prob", "threshold": 0.0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "threshold"
    r = http.post("/v1/completions", json={"prompt": [999999]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = http.post("/v1/completions", json={"prompt": "x"})  # no model field: the served one
    assert r.status_code == 200
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="x" * 5000, max_tokens=4)
    assert e.value.code == "context_length_exceeded"
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x" * 5000}], "max_tokens": 4})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert http.post("/v1/chat/completions", json={"messages": []}).json()["error"]["param"] == "messages"
    ok = client.completions.create(model=MODEL, prompt="still here", max_tokens=3, **GREEDY)
    assert ok.usage.completion_tokens == 3


def test_metrics(http):
    text = http.get("/metrics").text
    for name in ("clover_requests_total", "clover_prompt_tokens_total", "clover_completion_tokens_total",
                 "clover_tokens_per_forward", "clover_time_to_first_token_seconds", "clover_request_latency_seconds",
                 "clover_queue_depth", "clover_batch_size", "clover_forced_step_share"):
        assert name in text, name
    assert 'status="401"' in text and 'status="200"' in text


def _metric(text: str, name: str) -> float:
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith(name + " ")))


def test_forced_step_share_metric(http, client):
    before = http.get("/metrics").text
    # threshold above 1: no position can pass, so every denoise step of the row is forced (share 1)
    client.completions.create(model=MODEL, prompt="abc", max_tokens=6, temperature=0,
                              extra_body={"mode": "diffusion", "threshold": 1.5, "ignore_eos": True})
    client.completions.create(model=MODEL, prompt="abc", max_tokens=6, temperature=0,
                              extra_body={"mode": "ar", "ignore_eos": True})  # AR rows are not observed
    after = http.get("/metrics").text
    assert _metric(after, "clover_forced_step_share_count") == _metric(before, "clover_forced_step_share_count") + 1
    assert _metric(after, "clover_forced_step_share_sum") == pytest.approx(_metric(before, "clover_forced_step_share_sum") + 1)


def test_speculative_auto_gives_ar_text_and_reports_its_draft_widths(http, client):
    """Served speculative with block_size "auto" (the adaptive draft, its width per forward, the
    AR step among the choices): AR's text, and the choice in the auto-width metrics."""
    kw = dict(model=MODEL, prompt="def f(x):", max_tokens=10, temperature=0)
    ar = client.completions.create(**kw, extra_body={"mode": "ar", "ignore_eos": True})
    sp = client.completions.create(**kw, extra_body={"mode": "speculative", "block_size": "auto", "ignore_eos": True})
    assert sp.choices[0].text == ar.choices[0].text and sp.usage.completion_tokens == 10
    after = http.get("/metrics").text
    assert 'clover_auto_expected_tokens_per_second{width="1"}' in after and _metric(after, "clover_auto_width") >= 1


def test_auto_width_metrics(http, client, monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the calibration's cost curve goes here
    before = http.get("/metrics").text
    out = client.completions.create(model=MODEL, prompt="abc", max_tokens=6, temperature=0,
                                    extra_body={"mode": "diffusion", "block_size": "auto", "ignore_eos": True})
    assert out.usage.completion_tokens == 6
    after = http.get("/metrics").text
    assert "clover_block_width_blocks_total" in after and "clover_auto_expected_tokens_per_second{" in after
    assert _metric(after, "clover_auto_width") > 0 and after != before
    bad = http.post("/v1/completions", json={"model": MODEL, "prompt": "abc", "block_size": "wide"},
                    headers={"Authorization": f"Bearer {KEY}"})
    assert bad.status_code == 400 or bad.status_code == 422


# ---------------------------------------------------------------------------------- batching
@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_concurrent_requests_batch_and_match(server, client, mode):
    prompts = ["alpha", "a much longer prompt here", "x", "def g(y): return"]
    kw = dict(model=MODEL, max_tokens=24, temperature=0, extra_body={"mode": mode, "ignore_eos": True})
    alone = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    before = server.scheduler.max_batch_seen
    server.scheduler.max_batch_seen = 0
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda p: client.completions.create(prompt=p, **kw).choices[0].text, prompts))
    assert server.scheduler.max_batch_seen > 1
    server.scheduler.max_batch_seen = max(before, server.scheduler.max_batch_seen)
    assert together == alone


def test_mixed_groups_alternate(client):
    kws = [dict(extra_body={"mode": "ar", "ignore_eos": True}), dict(extra_body={"mode": "diffusion", "ignore_eos": True}),
           dict(extra_body={"mode": "diffusion", "block_size": 4, "ignore_eos": True})]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda k: client.completions.create(model=MODEL, prompt="mix", max_tokens=8, temperature=0, **k), kws))
    assert all(o.usage.completion_tokens == 8 for o in outs)


# ------------------------------------------------------------------ capacity, cancellation
def test_queue_full_429_and_cancel(llm):
    with LiveServer(llm, max_batch=1, max_queue=0) as s:
        c = openai.OpenAI(base_url=s.base + "/v1", api_key="none", max_retries=0, timeout=60)
        slow = {"model": MODEL, "prompt": "slow", "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "mode": "ar",
                "stream": True}
        with httpx.Client(base_url=s.base, timeout=60) as h:
            with h.stream("POST", "/v1/completions", json=slow) as resp:
                assert resp.status_code == 200
                lines = resp.iter_lines()
                next(line for line in lines if line.startswith("data:"))  # the row is running
                r = h.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                assert r.status_code == 429 and r.headers["retry-after"]
                assert r.json()["error"]["code"] == "queue_full"
                with pytest.raises(openai.RateLimitError):
                    c.completions.create(model=MODEL, prompt="x", max_tokens=2)
            # the client went away mid-stream: its row is cancelled and the slot frees up
            deadline = time.monotonic() + 20
            while s.scheduler.stats()["running"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert s.scheduler.stats()["running"] == 0
            ok = c.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0)
            assert ok.usage.completion_tokens >= 0 and ok.choices[0].finish_reason in ("stop", "length")
            # a non-streamed request whose client gives up is cancelled too
            with pytest.raises(httpx.TimeoutException):
                h.post("/v1/completions", json={**slow, "stream": False}, timeout=0.5)
            deadline = time.monotonic() + 20
            while s.scheduler.stats()["running"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert s.scheduler.stats()["running"] == 0


def test_shutdown_aborts_in_flight(llm):
    s = LiveServer(llm, graceful=0.5, max_batch=2, max_queue=2, drain_timeout=0.2).__enter__()
    result = {}

    def long_request():
        try:
            result["r"] = httpx.post(s.base + "/v1/completions", json={
                "prompt": "long", "max_tokens": 3500, "temperature": 0, "ignore_eos": True, "mode": "ar"}, timeout=60)
        except Exception as e:  # noqa: BLE001
            result["e"] = e

    t = threading.Thread(target=long_request)
    t.start()
    deadline = time.monotonic() + 20
    while not s.scheduler.stats()["running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    start = time.monotonic()
    s.__exit__(None, None, None)
    t.join(timeout=30)
    assert time.monotonic() - start < 25 and not s.thread.is_alive()
    assert s.scheduler.thread is None  # the engine thread has ended
    assert "r" in result, result  # answered (finish_reason "abort") rather than left hanging
    assert result["r"].status_code == 200
    assert result["r"].json()["choices"][0]["finish_reason"] == "abort"
