"""SDAR / TraDo (`model_type` "sdar") against its reference: the golden data of tests/golden/sdar/, made by
scripts/sdar-golden.py running JetAstra/SDAR's own generate.py and modeling_sdar.py on a tiny random
checkpoint saved in SDAR's layout (which is what clover loads here): full-sequence logits (the
block-causal prefill) and the logits of every cached denoising step."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import clover
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


@pytest.fixture(scope="module")
def sdar(tmp_path_factory):
    d = tmp_path_factory.mktemp("sdar")
    for f in (GOLDEN / "checkpoint").iterdir():
        shutil.copy(f, d / f.name)
    _word_tokenizer(d, 128)
    return clover.load(d)


def test_reads_the_sdar_layout_with_its_authors_defaults(sdar):
    c = sdar.config
    assert type(c).__name__ == "Qwen3Config" and c.model_type == "sdar" and not c.is_clover
    assert (c.block_size, c.mask_token_id, c.threshold) == (4, 127, 0.9)
    assert sdar.default_mode == "diffusion"
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
