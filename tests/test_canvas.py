"""Whole-sequence diffusion models (Dream, LLaDA) against their reference code: tiny random checkpoints
in each family's real layout (config.json keys, tensor names, vocabulary, mask token), rebuilt from the
seed and shapes in tests/golden/{dream,llada}/cases.json (scripts/dream-llada-golden.py wrote them by
running NVlabs/Fast-dLLM's modeling code and the authors' decoding), give the reference's
full-sequence logits and, in the canvas mode, the reference's greedy tokens on every case, alone and
batched."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from clover.checkpoint import load_model
from clover.config import ConfigError
from clover.decoding import get_mode
from clover.decoding.base import RowState
from clover.decoding.modes import resolve_params
from clover.models import config_from_dict

ROOT = Path(__file__).resolve().parents[1]
FAMILIES = ("dream", "llada")
ALG = {"entropy": "entropy", "maskgit_plus": "prob", "topk_margin": "margin"}  # Dream's alg -> clover's confidence


def _script():
    spec = importlib.util.spec_from_file_location("dream_llada_golden", ROOT / "scripts" / "dream-llada-golden.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def golden(family: str) -> dict:
    return json.loads((ROOT / "tests" / "golden" / family / "cases.json").read_text())


def golden_checkpoint(name: str, out: Path) -> dict:
    """The golden data of `name` (tests/golden/NAME), its tiny checkpoint rebuilt in `out` from the seed
    and shapes it records (the golden scripts' `tiny_parameters`)."""
    g = golden(name)
    shapes = [(n, shape) for n, shape in g["parameters"]]
    weights = _script().tiny_parameters(shapes, g["seed"], g["head"], g["config"]["mask_token_id"])
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(g["config"]))
    return g


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(family, its golden data, the tiny checkpoint's directory, the model loaded by clover)."""
    out = tmp_path_factory.mktemp(request.param)
    g = golden_checkpoint(request.param, out)
    return request.param, g, out, load_model(out)


def options(family: str, case: dict) -> dict:
    sampled = {k: case[k] for k in ("temperature", "top_p", "seed") if k in case}
    if family == "dream":
        return dict(max_new_tokens=case["max_new_tokens"], steps=case["steps"], confidence=ALG[case["alg"]], **sampled)
    return dict(max_new_tokens=case["gen_length"], steps=case["steps"], block_size=case["block_length"],
                cfg_scale=case["cfg_scale"], **sampled)


def decode(model, prompts: list[list[int]], opts: list[dict]) -> list[list[int]]:
    """The canvas mode's tokens for each prompt (each with its options), all in one engine: the whole
    canvas after the prompt (ignore_eos, as the reference returns it)."""
    mode = get_mode("canvas")
    params = [resolve_params(mode, {**o, "ignore_eos": True}, model.config) for o in opts]
    engine = mode.spec(params[0]).make_engine(model, mask_id=model.config.mask_token_id, pad_id=0)
    rows = [RowState(prompt=list(p), params=q, eos_ids=set(model.config.eos_token_ids)) for p, q in zip(prompts, params)]
    for r in rows:
        engine.add(r)
    for _ in engine.run():
        pass
    return [r.tokens for r in rows]


def test_config_reads_the_family(family):
    name, g, _, model = family
    c = model.config
    assert type(model).__name__ == {"dream": "DreamModel", "llada": "LLaDAModelLM"}[name]
    assert c.mask_token_id == g["config"]["mask_token_id"] and c.vocab_size == g["config"]["vocab_size"]
    assert c.commit_attention == "full" and c.logit_shift == (1 if name == "dream" else 0)
    assert get_mode(c.default_mode).name == "canvas"
    assert config_from_dict(json.loads(json.dumps(c.to_dict()))) == c  # writes its family's keys back


def test_logits_match_reference(family):
    _, g, _, model = family
    ref = g["logits"]
    with torch.no_grad():
        logits = model(torch.tensor([ref["ids"]]))[0]
    cols = len(ref["columns"][0])
    torch.testing.assert_close(logits[:, :cols], torch.tensor(ref["columns"]), atol=1e-4, rtol=1e-4)
    assert logits.argmax(-1).tolist() == ref["argmax"]
    torch.testing.assert_close(logits.max(-1).values, torch.tensor(ref["max"]), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits.logsumexp(-1), torch.tensor(ref["logsumexp"]), atol=1e-4, rtol=1e-4)


def test_tokens_match_reference_alone(family):
    name, g, _, model = family
    for case in g["cases"]:
        for prompt, expected in zip(case["prompts"], case["tokens"]):
            assert decode(model, [prompt], [options(name, case)]) == [expected], case["name"]


def test_tokens_match_reference_batched(family):
    """Every case's rows in one engine (prompts of different lengths, different steps, schedules and
    guidance side by side): each row gives the reference's tokens."""
    name, g, _, model = family
    prompts, opts, expected = [], [], []
    for case in g["cases"]:
        for prompt, tokens in zip(case["prompts"], case["tokens"]):
            prompts.append(prompt)
            opts.append(options(name, case))
            expected.append(tokens)
    assert decode(model, prompts, opts) == expected


def test_canvas_refusals(family):
    name, _, _, model = family
    mode = get_mode("canvas")
    with pytest.raises(ValueError, match="^steps: "):
        resolve_params(mode, {"max_new_tokens": 8, "steps": 9}, model.config)
    if name == "llada":
        with pytest.raises(ValueError, match="^steps: .*multiple of the number of blocks"):
            decode(model, [[5, 6]], [dict(max_new_tokens=16, steps=5, block_size=8)])


def test_llada_refuses_what_it_does_not_build():
    raw = dict(golden("llada")["config"])
    with pytest.raises(ConfigError, match="alibi"):
        config_from_dict({**raw, "alibi": True})
    with pytest.raises(ConfigError, match="block_type"):
        config_from_dict({**raw, "block_type": "sequential"})


def test_llm_decodes_with_the_canvas_mode_by_default(family, tiny_llm):
    """`clover.load` of a whole-sequence checkpoint: the canvas mode is its default and its only mode
    (the others need a commit); a Clover checkpoint is not offered it."""
    import clover
    from clover.tokenizer import write_byte_tokenizer

    name, g, path, _ = family
    write_byte_tokenizer(path)
    llm = clover.load(path)
    assert llm.mode_available("canvas") and not llm.mode_available("ar") and not llm.mode_available("diffusion")
    assert not tiny_llm.mode_available("canvas")
    case = g["cases"][0]
    out = llm.generate(case["prompts"][0], **options(name, case), ignore_eos=True)
    assert out.token_ids == case["tokens"][0] and out.stats.forwards == case["steps"]


def test_prefix_cache_reads_what_the_full_forward_computed(family):
    """Fast-dLLM's caches on a whole-sequence model: the refresh (the canvas's prefix as the commit
    part, the rest as the block, attention both ways; or the whole canvas committed) gives the full
    forward's logits, and a step reading the kept K/V (the prefix's; every position's but the
    block's) gives them again while the canvas is unchanged."""
    _, g, _, model = family
    x = torch.tensor([g["logits"]["ids"]])
    a = len(x[0]) // 2
    with torch.no_grad():
        full = model(x)
        cache = model.make_cache(1, x.shape[1])
        out = model.step(cache, commit_ids=x[:, :a], denoise_ids=x[:, a:])
        torch.testing.assert_close(out.denoise_logits, full[:, a:], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.commit_logits, full[:, a - 1], atol=1e-5, rtol=1e-5)
        again = model.step(cache, denoise_ids=x[:, a:])
        torch.testing.assert_close(again.denoise_logits, full[:, a:], atol=1e-5, rtol=1e-5)
        # the dual cache: every position's K/V kept but the block's, the block run alone at its positions
        b = a + 4
        cache = model.make_cache(1, x.shape[1])
        out = model.step(cache, commit_ids=x, all_logits=True)
        torch.testing.assert_close(out.commit_logits, full, atol=1e-5, rtol=1e-5)
        cache.drop_span(0, a, b)
        block = model.step(cache, denoise_ids=x[:, a:b], denoise_start=torch.tensor([a]))
        torch.testing.assert_close(block.denoise_logits, full[:, a:b], atol=1e-4, rtol=1e-4)  # keys reordered


def test_fast_dllm_options_batched_as_alone(family):
    """LLaDA with the prefix or dual cache and threshold parallel decoding (approximate: their agreement with
    the exact mode is reported, not asserted): every position decoded, and a row in a batch (rows at
    different blocks and refreshes in one forward) decodes as it does alone. Dream refuses the cache."""
    name, g, _, model = family
    if name == "dream":
        with pytest.raises(ValueError, match="^canvas_cache: "):
            decode(model, [[5, 6]], [dict(max_new_tokens=4, canvas_cache="prefix")])
        return
    cases = [c for c in g["cases"] if not c["cfg_scale"] and len(c["prompts"]) == 1 and c["block_length"] < c["gen_length"]
             and "seed" not in c]  # several blocks: refreshes at different steps
    prompts = [c["prompts"][0] for c in cases]
    for extra in ({"canvas_cache": "prefix"}, {"canvas_cache": "dual", "canvas_threshold": 0.5}):
        opts = [{**options(name, c), **extra} for c in cases]
        alone = [decode(model, [p], [o])[0] for p, o in zip(prompts, opts)]
        assert decode(model, prompts, opts) == alone
        assert all(model.config.mask_token_id not in t for t in alone)


def test_served_canvas_streams_and_stops_at_eos(family, tmp_path):
    """The OpenAI server on a whole-sequence checkpoint: `max_tokens` is the canvas, the answer ends
    at the first EOS the canvas holds (`finish_reason` stop, the real count in `usage`), and a stream
    with `stream_options.provisional` carries the canvas after every step before the text."""
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    import clover
    from clover.tokenizer import write_byte_tokenizer
    from test_serve import KEY, MODEL, LiveServer

    name, g, path, _ = family
    case = g["cases"][0]
    tokens = case["tokens"][0]
    eos_at = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])  # this copy's EOS: first seen there
    config = {**g["config"], "eos_token_id": tokens[eos_at]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    write_byte_tokenizer(tmp_path)
    llm = clover.load(tmp_path)
    opts = {k: v for k, v in options(name, case).items() if k != "max_new_tokens"}
    expected = llm.generate(case["prompts"][0], max_new_tokens=len(tokens), **opts)
    assert expected.token_ids == tokens[:eos_at] and expected.finish_reason == "stop"
    with LiveServer(llm, api_key=KEY) as server:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key=KEY, max_retries=0, timeout=60)
        r = client.completions.create(model=MODEL, prompt=case["prompts"][0], max_tokens=len(tokens), temperature=0,
                                      extra_body=opts)
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == eos_at
        body = {"model": MODEL, "prompt": case["prompts"][0], "max_tokens": len(tokens), "temperature": 0, "stream": True,
                "stream_options": {"provisional": True}, **opts}
        with httpx.Client(base_url=server.base, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as http:
            lines = [json.loads(x[6:]) for x in http.post("/v1/completions", json=body).text.splitlines()
                     if x.startswith("data: {")]
        # the openai client's own stream: the canvas after every step (the `clover` extension chunks, kept in
        # the client's objects), then the text, which ends at the EOS
        stream = client.completions.create(model=MODEL, prompt=case["prompts"][0], max_tokens=len(tokens), temperature=0,
                                           stream=True, extra_body={**opts, "stream_options": {"provisional": True,
                                                                                               "include_usage": True}})
        chunks = list(stream)
    provisional = [x for x in lines if "provisional" in json.dumps(x)]
    assert len(provisional) == case["steps"]
    steps = [c.model_extra["clover"] for c in chunks if (c.model_extra or {}).get("clover", {}).get("event") == "provisional"]
    assert len(steps) == case["steps"] and [s["step"] for s in steps] == sorted(s["step"] for s in steps)
    text = "".join(ch.text for c in chunks for ch in c.choices)
    assert text == r.choices[0].text and [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == ["stop"]
    assert [c.usage.completion_tokens for c in chunks if c.usage] == [eos_at]


def test_fast_selection_equals_the_slow_one():
    """The canvas's fast kernels against the obviously-correct ones: `top_values` gives torch.topk's
    values and indices (rows without ties), and `greedy_confidence` (the top-k read off the k + 1
    largest logits) gives `canvas_confidence`'s tokens and confidences, ties at the k-th logit and
    at the top included (those rows go the slow way)."""
    from clover.decoding.canvas import canvas_confidence, greedy_confidence, top_values

    gen = torch.Generator().manual_seed(0)
    for V in (1000, 4096, 49216, 151936):
        x = torch.randn(12, V, generator=gen) * 3
        x[3, 7] = x[3, 9] = x[3].max() + 1  # the top tied
        third = x[5].topk(3).values[-1]
        x[5, (x[5] < third).nonzero()[0, 0]] = third  # the third and fourth tied
        for k in (2, 51):
            a, b = torch.topk(x, k), top_values(x, k)
            assert torch.equal(a.values, b[0])
            assert torch.equal(a.indices[[0, 1, 2, 4]], b[1][[0, 1, 2, 4]])
        for kind in ("prob", "margin", "entropy"):
            for top_k in (0, 1, 3, 50):
                assert greedy_confidence(x[:0], kind, top_k)[1].shape == (0,)  # no candidates left in the block
                slow, fast = canvas_confidence(x, kind, top_k), greedy_confidence(x, kind, top_k)
                assert torch.equal(slow[1], fast[1]), (V, kind, top_k)
                torch.testing.assert_close(slow[0], fast[0], atol=1e-6, rtol=1e-6)


def test_head_only_where_read(family):
    """`logits_at`: the head run on a few positions of a batch gives the full forward's logits there."""
    _, g, _, model = family
    x = torch.tensor([g["logits"]["ids"]] * 2)
    at = torch.tensor([0, 3, x.shape[1] + 1, 2 * x.shape[1] - 1])
    with torch.no_grad():
        full = model(x).reshape(2 * x.shape[1], -1)
        torch.testing.assert_close(model(x, logits_at=at), full[at], atol=1e-6, rtol=1e-6)


def test_position_ties_unmask_left_to_right(family):
    """`canvas_ties="position"` with `top_k=1` (every confidence 1, llama.cpp's CLI's only deterministic
    setting): each step unmasks the leftmost masked positions, so the steps a canvas's positions were
    decoded at never decrease left to right."""
    name, _, _, model = family
    mode = get_mode("canvas")
    opts = dict(max_new_tokens=16, steps=8, top_k=1, canvas_ties="position", ignore_eos=True)
    if name == "llada":
        opts["block_size"] = 16
    q = resolve_params(mode, opts, model.config)
    engine = mode.spec(q).make_engine(model, mask_id=model.config.mask_token_id, pad_id=0)
    row = RowState(prompt=[5, 6, 7], params=q, eos_ids=set(model.config.eos_token_ids))
    engine.add(row)
    for _ in engine.run():
        pass
    assert len(row.tokens) == 16 and row.steps == sorted(row.steps) and len(set(row.steps)) > 1


def test_llada_steps_past_a_blocks_masks(family):
    """A block with fewer masks than steps (LLaDA's last, short block) runs its remaining steps with
    nothing to read: every position decoded, the forwards the schedule's."""
    name, _, _, model = family
    if name != "llada":
        return
    for extra in ({}, {"top_k": 1, "canvas_ties": "position"}):
        tokens = decode(model, [[5, 6, 7]], [dict(max_new_tokens=18, block_size=8, steps=18, **extra)])[0]
        assert len(tokens) == 18 and model.config.mask_token_id not in tokens
