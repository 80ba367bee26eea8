"""Everything clover adds, on the released block-diffusion families: the OpenAI server with the official
client on a tiny SDAR (`sdar`), LLaDA2 (`llada2_moe`) and Fast-dLLM v2 (`Fast_dLLM_Qwen`) checkpoint — the chat template, the
stream of provisional blocks, tools and `response_format`, concurrent requests batched (the tokens of
each request alone) — and every mode a family cannot run refused in one line with a 4xx.

The checkpoints are the golden ones of tests/golden/{sdar,llada2,fastdllm2} (the families' real layouts and
tensor names), with the vocabulary widened to hold the byte tokenizer and its chat template (the new
embedding and head rows random)."""

from __future__ import annotations

import concurrent.futures
import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")

import clover  # noqa: E402
from test_serve import KEY, MODEL, LiveServer  # noqa: E402
from test_serve_tools import RF, SCHEMA, TOOLS, _call  # noqa: E402

GOLDEN = Path(__file__).parent / "golden"
FAMILIES = ("sdar", "llada2", "fastdllm2")


def chat_checkpoint(family: str, directory: Path, seed: int = 0) -> Path:
    """The golden checkpoint of `family` in its own layout, its vocabulary widened to the byte tokenizer
    (mask and EOS its special tokens); returns the directory."""
    from safetensors.torch import load_file, save_file

    from clover.tokenizer import write_byte_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    ids = write_byte_tokenizer(directory)
    vocab = max(ids.values()) + 1
    config = json.loads((GOLDEN / family / "checkpoint" / "config.json").read_text())
    old = config["vocab_size"]
    config.update(vocab_size=vocab, mask_token_id=ids["<|mask|>"], eos_token_id=ids["<|endoftext|>"],
                  pad_token_id=ids["<|pad|>"], max_position_embeddings=2048)  # room for the tools prompt
    weights = load_file(str(GOLDEN / family / "checkpoint" / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    for name, t in weights.items():
        if t.shape[0] == old and t.dim() == 2 and ("embed" in name or "lm_head" in name):
            wide = torch.randn(vocab, t.shape[1], generator=g) * t.std()
            wide[: old] = t
            weights[name] = wide.contiguous()
    save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    llm = clover.load(chat_checkpoint(request.param, tmp_path_factory.mktemp(request.param)))
    with LiveServer(llm, max_batch=8, max_queue=32, api_key=KEY) as server:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=120)
        yield request.param, llm, server, client


def test_chat_template_and_tokens_as_the_library(family):
    name, llm, server, client = family
    msgs = [{"role": "user", "content": "Say hi"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == len(llm.tokenizer.apply_chat_template(msgs))
    ref = llm.chat(msgs, max_new_tokens=12, ignore_eos=True)
    assert r.choices[0].message.content == ref.text and r.usage.completion_tokens == len(ref.token_ids)
    assert r.choices[0].finish_reason == ref.finish_reason  # the template's end of turn stops a chat answer
    chunks = list(client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0, stream=True,
                                                 extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text


def test_provisional_blocks_stream(family):
    name, llm, server, client = family
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 8, "temperature": 0, "stream": True, "ignore_eos": True,
            "stream_options": {"provisional": True}}
    with httpx.Client(base_url=server.base, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        lines = [json.loads(x[6:]) for x in http.post("/v1/completions", json=body).text.splitlines()
                 if x.startswith("data: {")]
    provisional = [x for x in lines if "provisional" in json.dumps(x)]
    assert provisional
    text = "".join(c["choices"][0].get("text", "") for c in lines if c.get("choices") and "provisional" not in json.dumps(c))
    assert text == llm.generate("abc", max_new_tokens=8, ignore_eos=True).text


@pytest.mark.parametrize("stream", [False, True])
def test_tools_and_response_format(family, stream):
    name, llm, server, client = family
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    msg, finish = _call(client, "diffusion", messages, stream, tools=TOOLS, tool_choice="required",
                        parallel_tool_calls=False, max_tokens=160)  # bytes: 4 a character
    assert finish == "tool_calls" and len(msg["tool_calls"]) == 1, msg
    call = msg["tool_calls"][0]
    spec = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}[call["function"]["name"]]
    jsonschema.validate(json.loads(call["function"]["arguments"]), spec)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "ok?"}], temperature=0,
                                       response_format=RF, max_tokens=40, stream=False)
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_concurrent_requests_batch_as_alone(family):
    name, llm, server, client = family
    prompts = ["alpha", "a much longer prompt here", "x", "def g(y): return"]
    kw = dict(model=MODEL, max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    server.scheduler.max_batch_seen = 0
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda p: client.completions.create(prompt=p, **kw).choices[0].text, prompts))
    assert server.scheduler.max_batch_seen > 1
    assert together == alone


@pytest.mark.parametrize("mode", ["ar", "speculative", "dflash"])
def test_modes_the_family_cannot_run_are_one_line_4xx(family, mode):
    name, llm, server, client = family
    with httpx.Client(base_url=server.base, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        r = http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4, "mode": mode})
        assert 400 <= r.status_code < 500, r.text
        message = r.json()["error"]["message"]
        assert "\n" not in message and mode in message, message
        assert r.json()["error"]["param"] == "mode" and r.json()["error"]["code"] == "invalid_value"
        assert http.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4}).status_code == 200


@pytest.fixture(scope="module")
def dream(tmp_path_factory):
    """The golden tiny Dream checkpoint (tests/golden/dream) with the byte tokenizer, served."""
    from safetensors.torch import save_file
    from test_canvas import _script, golden

    from clover.tokenizer import write_byte_tokenizer

    g = golden("dream")
    out = tmp_path_factory.mktemp("dream")
    weights = _script().tiny_parameters([(n, s) for n, s in g["parameters"]], g["seed"], g["head"],
                                        g["config"]["mask_token_id"])
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(g["config"]))
    write_byte_tokenizer(out)
    llm = clover.load(out)
    with LiveServer(llm, max_batch=8, max_queue=32, api_key=KEY) as server:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=120)
        yield llm, server, client


def test_dream_chat_is_the_library_canvas_and_refusals_are_one_line(dream):
    """A whole-sequence model served: the chat template, `max_tokens` the canvas and the real count;
    the modes it cannot run, and what its canvas mode does not obey (a grammar), refused in one line."""
    llm, server, client = dream
    msgs = [{"role": "user", "content": "Say hi"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0, extra_body={"steps": 4})
    ref = llm.chat(msgs, max_new_tokens=16, steps=4)
    assert r.usage.prompt_tokens == len(llm.tokenizer.apply_chat_template(msgs))
    assert r.choices[0].message.content == ref.text and r.usage.completion_tokens == len(ref.token_ids)
    with httpx.Client(base_url=server.base, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
        refused = [{"mode": m} for m in ("ar", "diffusion", "speculative")] + [
            {"response_format": RF}, {"tools": TOOLS, "tool_choice": "required"}]
        for extra in refused:
            body = {"model": MODEL, "messages": msgs, "max_tokens": 8, **extra}
            got = http.post("/v1/chat/completions", json=body)
            assert 400 <= got.status_code < 500, (extra, got.text)
            assert "\n" not in got.json()["error"]["message"], got.text
        assert http.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs, "max_tokens": 8}).status_code == 200


def test_playground_offers_the_modes_each_family_runs(family, dream):
    """`GET /v1/clover/modes` (the playground's list): SDAR and LLaDA2 decode in the diffusion modes,
    Dream in the canvas mode only."""
    for (llm, server, _), want in [(family[1:], {"diffusion", "naive"}), (dream, {"canvas"})]:
        with httpx.Client(base_url=server.base, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
            modes = http.get("/v1/clover/modes").json()
        assert {m["id"] for m in modes["data"] if m["available"]} == want
        assert modes["default"] in want
