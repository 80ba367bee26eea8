"""The DFlash peers of `clover bench peers` (z-lab's package, transformers' DFlash assisted
generation, stock llama.cpp's draft-dflash): the drafter export stock llama.cpp's converter reads,
transformers' DFlash drafter class holding clover's drafter (same hidden states as clover's), the
llama.cpp runner's parsing (a fake binary in the real tool's output format), the rows' tokens per
verify, and the skips. No timing decides a test."""

import json
import stat
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

import clover
from clover.bench import peers
from clover.bench.peers.report import summarize
from clover.checkpoint import save_drafter
from clover.export import drafter as export_drafter
from clover.models import read_config
from clover.models.dflash import build_drafter, drafter_config_for
from clover.tiny import build_tiny_checkpoint


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return build_tiny_checkpoint(tmp_path_factory.mktemp("peers-dflash") / "target", seed=3, init_std=0.2)


def _drafter(config, vocab: int | None, seed: int = 1):
    d = build_drafter(drafter_config_for(config, num_hidden_layers=2, block_size=8, draft_vocab_size=vocab), seed=seed)
    if vocab:
        d.set_draft_vocab(torch.randperm(config.vocab_size, generator=torch.Generator().manual_seed(seed))[:vocab])
    return d.eval()


@pytest.fixture(scope="module")
def llm(target_dir, tmp_path_factory):
    base = clover.load(target_dir)
    d = save_drafter(_drafter(base.config, 64), tmp_path_factory.mktemp("drafter") / "d")
    return clover.load(target_dir, drafter=d)


def _tensors(path: Path) -> dict:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


# --------------------------------------------------------------- the export llama.cpp converts
def test_reduced_vocabulary_exports_as_dspark_with_its_head(llm, tmp_path):
    dr, target = llm.drafter, llm.model
    out = export_drafter.export_drafter_for_llama_cpp(dr, target, tmp_path / "x")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DSparkDraftModel"] and cfg["draft_vocab_size"] == 64
    assert cfg["sample_from_anchor"] is False and cfg["dflash_config"]["mask_token_id"] == dr.mask_token_id
    t = _tensors(out / "model.safetensors")
    torch.testing.assert_close(t["lm_head.weight"], target.lm_head.weight[dr.draft_ids].float())
    assert torch.equal(t["d2t"], dr.d2t) and t["d2t"].dtype == torch.int64  # EAGLE-3 offsets, as the converter reads
    assert "embed_tokens.weight" not in t  # this target embeds its mask token with its own row
    assert t["fc.weight"].dtype == torch.float32


def test_full_vocabulary_exports_as_dflash(llm, tmp_path):
    dr = _drafter(llm.config, None)
    out = export_drafter.export_drafter_for_llama_cpp(dr, llm.model, tmp_path / "x", dtype=torch.bfloat16)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and "draft_vocab_size" not in cfg
    t = _tensors(out / "model.safetensors")
    assert "lm_head.weight" not in t and "d2t" not in t and t["fc.weight"].dtype == torch.bfloat16


def test_own_mask_embedding_is_written_as_the_drafters_embedding(llm, tmp_path, monkeypatch):
    """A target that embeds its mask token with a vector of its own (clover's denoise adapter): the
    drafter carries the target's embedding with that row, the one it was trained reading."""
    vec = torch.full((llm.config.hidden_size,), 0.5)
    monkeypatch.setattr(export_drafter, "mask_embedding", lambda target, m: vec)
    out = export_drafter.export_drafter_for_llama_cpp(llm.drafter, llm.model, tmp_path / "x")
    emb = _tensors(out / "model.safetensors")["embed_tokens.weight"]
    m = llm.drafter.mask_token_id
    assert torch.equal(emb[m], vec)
    keep = torch.arange(emb.shape[0]) != m
    torch.testing.assert_close(emb[keep], llm.model.model.embed_tokens.weight[keep].float())


# ------------------------------------------------------- transformers' DFlash drafter class
def test_transformers_assistant_equals_clovers_drafter(llm):
    from clover.bench.peers.hf_dflash import _find, assistant_for

    if not _find()["available"]:
        pytest.skip(_find()["note"])
    m, dr = llm.model, llm.drafter
    asst = assistant_for(dr, torch.float32)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
    hidden = dict.fromkeys(dr.target_layer_ids)
    with torch.no_grad():
        m(ids, hidden_out=hidden)
        ctx = dr.context_features(hidden, m)
        for a in (5, 17):
            block = torch.full((1, 1, 8), dr.mask_token_id)
            block[0, 0, 0] = ids[0, a]
            emb = dr.embed(block, m)
            want = dr.forward_train(ctx, torch.tensor([[a]]), emb)[0, 0]
            got = asst(noise_embeds=emb[:, 0], context_hidden_states=ctx[:, :a],
                       position_ids=torch.arange(a + 8)[None], attention_mask=None).last_hidden_state[0]
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------- rows and skips
def test_tokens_per_verify_only_on_drafting_rows():
    run = lambda engine, variant, item, acc: {"engine": engine, "variant": variant, "threads": 1, "batch": 1,
                                               "item": item, "tokens": 6, "seconds": 1.0, "tokens_per_second": 6.0,
                                               "token_ids": [1] * 6, "accept_lengths": acc}
    rows = summarize([run("clover", "ar", 0, None), run("clover", "dflash", 0, [2, 4]), run("clover", "ar", 1, None),
                      run("clover", "dflash", 1, [1, 1, 1, 3])])
    by = {r["variant"]: r for r in rows}
    assert by["dflash"]["tokens_per_verify"] == pytest.approx(2.0) and "tokens_per_verify" not in by["ar"]


def _exe(path: Path, body: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_speculative_simple_output_is_parsed(llm, tmp_path):
    """llama-speculative-simple's stdout (the prompt echoed, then the answer) and stderr statistics,
    as the real tool prints them: the answer's tokens, seconds and tokens per verify."""
    from clover.bench.peers.llama_cpp_dflash import SpecDFlashRunner

    ids = llm.encode_prompt("x = ")
    answer = llm.tokenizer.decode(llm.encode_prompt("y = 1"), skip_special_tokens=False)
    prompt = llm.tokenizer.decode(ids, skip_special_tokens=False)
    (tmp_path / "out.txt").write_text("\n\n" + prompt + answer + "\n\n\n\n")
    (tmp_path / "err.txt").write_text("decoded    9 tokens in    0.500 seconds, speed: 18.0 t/s\n"
                                      "n_draft   = 7\nn_predict = 9\nn_drafted = 14\nn_accept  = 6\n")
    exe = _exe(tmp_path / "llama-speculative-simple", f"cat {tmp_path / 'out.txt'}; cat {tmp_path / 'err.txt'} >&2\n")
    r = SpecDFlashRunner(str(exe), tmp_path / "t.gguf", tmp_path / "d.gguf", llm, 1, 16, 7, tmp_path, to_eos=True)
    out, n, s = r.one(ids)
    assert llm.tokenizer.decode(out, skip_special_tokens=False) == answer and n == len(out)
    assert s == pytest.approx(0.5) and sum(r.accepts) / len(r.accepts) == pytest.approx(3.0)  # 9 tokens, 3 verifies


def test_dflash_peers_skip_with_notes(target_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("CLOVER_DFLASH_PYTHON", str(tmp_path / "no-python"))
    found = peers.discover(read_config(target_dir), llama_dir=tmp_path)
    assert not found["z-lab dflash"]["available"] and "no such interpreter" in found["z-lab dflash"]["note"]
    assert not found["llama.cpp-dflash"]["available"] and "llama-speculative-simple" in found["llama.cpp-dflash"]["note"]
    # a model without a drafter: each DFlash peer is skipped at prepare, saying so
    monkeypatch.delenv("CLOVER_DFLASH_PYTHON")
    r = peers.run_peers(target_dir, prompt_texts=["x = "], max_new_tokens=2, threads=(1,), batch_rounds=0, modes=["ar"],
                        engines=["clover", "transformers-dflash"], workdir=tmp_path)
    e = r["engines"]["transformers-dflash"]
    assert not e["available"] and "no DFlash drafter" in e["note"], e


def test_worker_speaks_the_runners_protocol():
    from clover.bench.peers import base, dflash_worker

    assert dflash_worker.MARK == base.WORKER_MARK  # the worker runs without clover: its own copy must agree
