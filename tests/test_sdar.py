"""SDAR / TraDo (`model_type` "sdar") against its reference: the golden data of tests/golden/sdar/, made by
scripts/sdar-golden.py running JetAstra/SDAR's own generate.py and modeling_sdar.py on a tiny random
checkpoint saved in SDAR's layout (which is what clover loads here): full-sequence logits (the
block-causal prefill), the logits of every cached denoising step, and greedy block decoding (prompts
ending inside and at the end of a block, blocks 4 and 8, alone and batched): identical tokens and
denoising forwards per block."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import clover
from clover.config import BlockSemantics
from clover.models import config_from_dict

GOLDEN = Path(__file__).parent / "golden" / "sdar"
CASES = json.loads((GOLDEN / "cases.json").read_text())
TENSORS = load_file(str(GOLDEN / "golden.safetensors"))
# float32 logits against the reference's float32: 3e-5. The tiny model's peaked head (which makes the threshold
# act) gives logits up to ~40, where float32's spacing is 4e-6; the reference's own float32 logits lie 2.6e-5
# from its float64 ones. In float64 clover and the reference agree to 1e-10 (`test_full_sequence_logits`).
TOL = dict(atol=3e-5, rtol=0)


def _word_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer over the tiny vocabulary ("t0" ... ): the prompts here are token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(directory / "tokenizer.json"))


def load_golden(tmp_path_factory, golden: Path):
    """The golden checkpoint of a family, copied with a word-level tokenizer, loaded."""
    d = tmp_path_factory.mktemp(golden.name)
    for f in (golden / "checkpoint").iterdir():
        shutil.copy(f, d / f.name)
    _word_tokenizer(d, 128)
    return clover.load(d)


@pytest.fixture(scope="module")
def sdar(tmp_path_factory):
    return load_golden(tmp_path_factory, GOLDEN)


def test_reads_the_sdar_layout_with_its_authors_defaults(sdar):
    c = sdar.config
    assert type(c).__name__ == "Qwen3Config" and c.model_type == "sdar" and not c.is_clover
    assert (c.block_size, c.mask_token_id, c.threshold) == (4, 127, 0.9)
    assert sdar.default_mode == "diffusion"
    assert c.semantics == BlockSemantics(logit_shift=0, block_grid="absolute", commit_attention="block")
    raw = c.to_dict()  # written back as SDAR's own keys
    assert raw["architectures"] == ["SDARForCausalLM"] and (raw["block_size"], raw["mask_token_id"]) == (4, 127)
    assert config_from_dict(json.loads(json.dumps(raw))) == c


@pytest.mark.parametrize("block", [4, 8])
def test_full_sequence_logits(sdar, block):
    """The prompt prefill: one commit of the whole sequence, block-causal on the absolute grid."""
    ids = torch.tensor([CASES["full_sequence"]])
    m = sdar.model
    with torch.no_grad():
        out = m.step(m.make_cache(1, ids.shape[1]), commit_ids=ids, all_logits=True, commit_block=block)
        torch.testing.assert_close(out.commit_logits[0], TENSORS[f"full_b{block}"], **TOL)
        m64 = copy.deepcopy(m).double()
        out = m64.step(m64.make_cache(1, ids.shape[1]), commit_ids=ids, all_logits=True, commit_block=block)
    torch.testing.assert_close(out.commit_logits[0], TENSORS[f"full64_b{block}"], atol=1e-10, rtol=0)


@pytest.mark.parametrize("block", [4, 8])
def test_cached_step_logits(sdar, block):
    """Every denoising forward of the reference's generation, replayed through the cache: a commit
    (the prefill, a finished block) rides with the next denoising forward, as the engine runs them."""
    case = next(c for c in CASES["cases"] if c["name"] == f"p11_b{block}")
    m = sdar.model
    cache = m.make_cache(1, 64)
    pending = None
    with torch.no_grad():
        for j, fwd in enumerate(case["forwards"]):
            ids = torch.tensor([fwd["ids"]])
            if fwd["commit"]:
                pending = ids
                continue
            out = m.step(cache, commit_ids=pending, denoise_ids=ids, commit_block=block)
            pending = None
            torch.testing.assert_close(out.denoise_logits[0], TENSORS[f"step_p11_b{block}_{j}"], **TOL)


def _generate(llm, cases, **options):
    """The cases decoded together in one batch, each to its reference's output length (its blocks
    run to the end of the grid), with the checkpoint's defaults and `options`."""
    from clover.decoding.modes import resolve_params

    m = llm.mode(None)
    rows, spec = [], None
    for c in cases:
        params = resolve_params(m, dict(max_new_tokens=len(c["tokens"]), block_size=c["block_length"], **options),
                                llm.config)
        spec = m.spec(params)
        rows.append(llm.row(c["prompt"], params, None))
    for _ in llm._events(rows, spec):
        pass
    return [llm.result(r) for r in rows]


@pytest.mark.parametrize("name", [c["name"] for c in CASES["cases"]])
def test_greedy_block_decoding_alone(sdar, name):
    case = next(c for c in CASES["cases"] if c["name"] == name)
    (g,) = _generate(sdar, [case])
    assert g.token_ids == case["tokens"]
    assert g.stats.block_steps == case["denoise_forwards_per_block"]
    assert g.stats.forwards == sum(case["denoise_forwards_per_block"])  # each commit rides with a denoising step


@pytest.mark.parametrize("block", [4, 8])
def test_greedy_block_decoding_batched(sdar, block):
    """Every prompt of a block size in one batch (the reference decodes one at a time)."""
    cases = [c for c in CASES["cases"] if c["block_length"] == block]
    assert len(cases) >= 2
    for g, c in zip(_generate(sdar, cases), cases):
        assert g.token_ids == c["tokens"] and g.stats.block_steps == c["denoise_forwards_per_block"], c["name"]


@pytest.mark.parametrize("block", [4, 8])
def test_naive_recomputation_gives_the_same_tokens(sdar, block):
    """mode="naive" rebuilds the committed sequence every forward (block-causal, the same grid)."""
    for c in CASES["cases"]:
        if c["block_length"] == block:
            g = sdar.generate(c["prompt"], mode="naive", max_new_tokens=len(c["tokens"]), block_size=block)
            assert g.token_ids == c["tokens"] and g.stats.block_steps == c["denoise_forwards_per_block"], c["name"]


def assert_causal_modes_refused(llm, refusal: str) -> None:
    """AR and self-speculation and the plain forward, each refused in one line on a model that commits
    block-causally (`refusal`: the pattern of the modes' error). (`compile` is no longer refused: the
    static steps commit block-causally too, tests/test_released_compile.py.)"""
    from clover.config import ConfigError

    for mode in ("ar", "speculative"):
        with pytest.raises(ConfigError, match=refusal) as e:
            llm.generate([5, 6, 7], mode=mode, max_new_tokens=4)
        assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="^commit_attention='block': not implemented in the plain forward"):
        llm.model(torch.tensor([[5, 6, 7]]))


def test_modes_that_need_a_causal_commit_are_refused_in_one_line(sdar):
    """AR and self-speculation verify causally, which SDAR's block-causal commit is not."""
    assert_causal_modes_refused(sdar, r"^logit_shift=0: not implemented in \w+")


def test_sdar_moe_decodes_alike_cached_naive_and_batched(tmp_path):
    """SDAR-30B-A3B's kind (`sdar_moe`: Qwen3-MoE under SDAR's semantics), tiny and random: its own
    modeling file is not public code, so no golden data; the cached engine equals the recomputed one
    and a batch equals its rows alone."""
    from clover.checkpoint import save_model
    from clover.models import build_model

    raw = json.loads((GOLDEN / "checkpoint" / "config.json").read_text())
    raw.update(model_type="sdar_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)
    config = config_from_dict(raw)
    assert type(config).__name__ == "Qwen3MoeConfig" and config.semantics == BlockSemantics(
        logit_shift=0, block_grid="absolute", commit_attention="block")
    model = build_model(config, device="cpu")
    model.init_weights(seed=0, std=0.5)
    save_model(model, tmp_path)
    _word_tokenizer(tmp_path, 128)
    llm = clover.load(tmp_path)
    prompts = [c["prompt"] for c in CASES["cases"] if c["block_length"] == 4]
    kw = dict(max_new_tokens=12, block_size=4, ignore_eos=True)
    alone = [llm.generate(p, **kw) for p in prompts]
    batched = llm.generate(prompts, **kw)
    naive = [llm.generate(p, mode="naive", **kw) for p in prompts]
    for a, b, n in zip(alone, batched, naive):
        assert a.token_ids == b.token_ids == n.token_ids and len(a.token_ids) == 12
        assert a.stats.block_steps == b.stats.block_steps == n.stats.block_steps
    # block expert sharing (the denoise block routes within 3 of the 4 experts): alone == batched
    shared = [llm.generate(p, expert_budget=3, **kw) for p in prompts]
    assert [g.token_ids for g in shared] == [g.token_ids for g in llm.generate(prompts, expert_budget=3, **kw)]


@pytest.mark.parametrize("kind", ["sdar", "sdar_moe"])
def test_live_forward_equals_the_full_forward(sdar, kind):
    """Eagerly SDAR's layers (Qwen3, and Qwen3-MoE for `sdar_moe`) compute only what a forward needs
    (`core.Live`: no batch padding, the last layer's queries, output projection and MLP/MoE only where
    logits are read): every output the step returns or writes equals the full forward's (the cache up
    to each row's length: past it, the full forward's batch padding)."""
    from clover.models import build_model

    model = sdar.model
    if kind == "sdar_moe":
        raw = json.loads((GOLDEN / "checkpoint" / "config.json").read_text())
        raw.update(model_type="sdar_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True)
        model = build_model(config_from_dict(raw), device="cpu")
        model.init_weights(seed=0, std=0.5)
    assert model.live_positions
    mask = sdar.config.mask_token_id

    def steps(live: bool):
        saved, model.live_positions = model.live_positions, live
        try:
            g = torch.Generator().manual_seed(5)
            blk = torch.full((2, 4), mask)
            blk[0, :2], blk[1, 3] = torch.tensor([50, 60]), 99
            need = blk == mask
            with torch.inference_mode():
                cache = model.make_cache(2, 64)
                first = model.step(cache, commit_ids=torch.randint(3, 120, (2, 8), generator=g),
                                   n_commit=torch.tensor([8, 5]), commit_block=4)
                out = model.step(cache, commit_ids=torch.randint(3, 120, (2, 4), generator=g),
                                 n_commit=torch.tensor([4, 3]), denoise_ids=blk, denoise_need=need, commit_block=4)
                alone = model.step(cache, denoise_ids=blk, denoise_need=need, commit_block=4)
            return (first, out, alone), need, cache
        finally:
            model.live_positions = saved

    (full, need, full_cache), (live, _, live_cache) = steps(False), steps(True)
    for a, b in zip(live, full):
        if b.commit_logits is not None:
            torch.testing.assert_close(a.commit_logits, b.commit_logits, **TOL)
        if b.denoise_logits is not None:
            torch.testing.assert_close(a.denoise_logits[need], b.denoise_logits[need], **TOL)
    for a, b in zip(live_cache.layers, full_cache.layers):
        for x, y in zip(a.tensors(), b.tensors()):  # [B, H_kv, capacity, D]; rows of 12 and 8 tokens
            for row, n in enumerate((12, 8)):
                torch.testing.assert_close(x[row, :, :n], y[row, :, :n], **TOL)


@pytest.mark.parametrize("skips", [dict(skip_decoded=True), dict(skip_window=True)], ids=lambda d: "+".join(d))
def test_skips_keep_batched_equal_to_one_by_one(sdar, skips, monkeypatch):
    """The approximate per-request skips run on SDAR now that its layers take `Live` (`skip_decoded`
    needs them): decoded positions are frozen, and a batch's rows equal each alone."""
    model, frozen = sdar.model, []
    step = model.step

    def spy(cache, **kw):
        if kw.get("denoise_frozen") is not None:
            frozen.append(int(kw["denoise_frozen"].sum()))
        return step(cache, **kw)

    monkeypatch.setattr(model, "step", spy)
    prompts = [c["prompt"] for c in CASES["cases"] if c["block_length"] == 8]
    kw = dict(max_new_tokens=16, block_size=8, ignore_eos=True, **skips)
    batch = sdar.generate(prompts, **kw)
    for p, got in zip(prompts, batch):
        alone = sdar.generate(p, **kw)
        assert got.token_ids == alone.token_ids and got.stats.block_steps == alone.stats.block_steps
    assert (sum(frozen) > 0) == ("skip_decoded" in skips)


def test_info_names_the_family_and_its_decoding(sdar, capsys):
    from clover.cli import main

    assert main(["info", str(sdar.path)]) == 0
    out = capsys.readouterr().out
    for needle in ("(sdar)", "block size       4", "threshold        0.9", "mask token       127",
                   "block semantics  logit_shift=0, block_grid=absolute, commit_attention=block"):
        assert needle in out, needle


def test_max_new_tokens_cuts_the_output_not_the_block(sdar):
    """The reference decodes whole blocks; a length limit inside a block cuts the output after, so the
    tokens are the reference's first ones and the last block takes the reference's steps."""
    for c in CASES["cases"]:
        n = len(c["tokens"]) - 2  # inside the last block (of 4 or 8)
        g = sdar.generate(c["prompt"], max_new_tokens=n, block_size=c["block_length"])
        assert g.token_ids == c["tokens"][:n] and g.finish_reason == "length", c["name"]
        assert g.stats.block_steps == c["denoise_forwards_per_block"], c["name"]
