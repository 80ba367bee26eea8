"""A Llama target in the GGUF export and in the llama.cpp port (arch `llama`, docs/llama-port.md).

Fast: `clover export-gguf` of a Llama model writes llama.cpp's own layout (the converter's names,
its per-head q/k row permutation, the denoise adapter left out) and `import-gguf` reads it back to
the same logits; a drafter whose target embeds the mask token with a vector of its own carries that
vector (`mask_embd`).

Slow (CLOVER_SLOW=1, and `PORT=1 scripts/build-llama-cpp.sh`; skipped with the reason otherwise):
- a tiny random Llama with a denoise adapter (its mask embedding moved off the row) and a tiny random
  drafter, both exported by clover: the port's AR greedy equals clover's, its dflash equals clover's
  dflash (drafts, tokens, forwards, accept lengths) and AR's tokens, alone and under --parallel (AR
  rows batched; dflash rows run alone there), in f32;
- clover-smol (`$CLOVER_MODELS/clover-smol` with its drafter, where pulled): clover's export equals
  the stock converter's GGUF tensor for tensor (where llama.cpp's converter is there), and on 8 held-out
  chat questions decoded to EOS the port's dflash equals its AR (f32 and q8_0), and in f32 its AR stock
  llama.cpp's but where stock llama.cpp's own logits are a near tie.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

import clover
from clover.integrations.llama_port import llama_cache_dir, port_args, port_binary
from test_llama_port import clover_dflash  # clover's dflash tokens and the drafts of each verify

gguf = pytest.importorskip("gguf")

TOKENS = 48
_g = torch.Generator().manual_seed(7)
PROMPTS = [torch.randint(3, 256, (n,), generator=_g).tolist() for n in (5, 9, 14, 23, 31, 40)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny Llama whose denoise adapter embeds the mask token with its own vector, and a random
    two-layer drafter for it (a reduced draft vocabulary too)."""
    from clover.checkpoint import save_drafter, save_model
    from clover.models.dflash import build_drafter, drafter_config_for
    from clover.tiny import build_tiny_checkpoint

    root = tmp_path_factory.mktemp("llama-port")
    d = build_tiny_checkpoint(root / "base", seed=5, init_std=0.15, dense=True, backbone="llama", rms_norm_eps=1e-5)
    llm = clover.load(d)
    m = llm.model
    m.attach_denoise_adapter(rank=4, targets=("q_proj", "v_proj"))
    with torch.no_grad():
        m.model.embed_tokens.mask_embedding.copy_(torch.randn(m.config.hidden_size, generator=torch.Generator().manual_seed(1)))
    save_model(m, root / "target")
    from clover.tokenizer import write_byte_tokenizer

    write_byte_tokenizer(root / "target")
    cfg = drafter_config_for(m.config, num_hidden_layers=2, block_size=8)
    drafter = save_drafter(build_drafter(cfg, seed=2), root / "drafter")
    # a draft vocabulary of the 4 tokens AR writes most on the prompts: drafts get accepted (and rolled back)
    outs = clover.load(root / "target").generate(PROMPTS, mode="ar", max_new_tokens=TOKENS, ignore_eos=True)
    common = Counter(t for g in outs for t in g.token_ids).most_common(4)
    vocab = drafter_config_for(m.config, num_hidden_layers=2, block_size=8, draft_vocab_size=len(common))
    small = build_drafter(vocab, seed=3)
    small.set_draft_vocab([t for t, _ in common])
    return {"target": root / "target", "drafter": drafter, "vocab_drafter": save_drafter(small, root / "vocab"), "root": root}


# ------------------------------------------------------------------------------ fast: the export
def test_llama_export_is_the_converters_layout_and_reads_back(tiny, tmp_path):
    from clover.checkpoint import load_model
    from clover.export.gguf import export_gguf
    from clover.gguf.names import permute_rows
    from clover.gguf_import import import_gguf

    r = export_gguf(tiny["target"], tmp_path / "m.gguf", dtype="f32", progress=False)
    assert r.arch == "llama" and r.sidecar is None
    reader = gguf.GGUFReader(r.path)
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    assert not any("adapter" in n or "lora" in n or "mask" in n for n in tensors)  # the denoise adapter stays out
    model = load_model(tiny["target"])
    sd, c = model.state_dict(), model.config
    for ours, theirs, heads in (("model.layers.1.self_attn.q_proj.weight", "blk.1.attn_q.weight", c.num_attention_heads),
                                ("model.layers.0.self_attn.k_proj.weight", "blk.0.attn_k.weight", c.num_key_value_heads)):
        want = permute_rows(sd[ours], heads).numpy()  # llama.cpp's convert_hf_to_gguf `permute`
        assert np.array_equal(tensors[theirs].reshape(want.shape), want)
    want = sd["model.layers.0.mlp.down_proj.weight"].numpy()
    assert np.array_equal(tensors["blk.0.ffn_down.weight"].reshape(want.shape), want)
    arch = lambda k: reader.fields[f"llama.{k}"].parts[-1].tolist()  # noqa: E731
    assert arch("block_count") == [c.num_hidden_layers] and arch("attention.head_count_kv") == [c.num_key_value_heads]
    back = import_gguf(r.path, tmp_path / "back", progress=False)
    assert back.model_type == "llama"
    x = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(0))
    keep = torch.arange(c.vocab_size) != c.mask_token_id  # clover holds the mask token's logit down; a plain llama does not
    with torch.no_grad():
        torch.testing.assert_close(load_model(tmp_path / "back")(x)[..., keep], model(x)[..., keep], atol=0, rtol=0)


def test_drafter_carries_the_targets_mask_vector(tiny, tmp_path):
    from clover.gguf.write import MASK_EMBD, export_drafter_gguf

    llm = clover.load(tiny["target"], drafter=tiny["drafter"])
    r = export_drafter_gguf(llm.drafter, tmp_path / "d.gguf", target=llm.model)
    got = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(r.path).tensors}
    want = llm.model.model.embed_tokens.mask_embedding.detach().numpy()
    assert np.array_equal(got[MASK_EMBD].reshape(want.shape), want)
    plain = export_drafter_gguf(llm.drafter, tmp_path / "plain.gguf")  # no target: no vector
    assert MASK_EMBD not in {t.name for t in gguf.GGUFReader(plain.path).tensors}


def test_port_refuses_a_mode_a_llama_target_lacks(tiny):
    """The port runs ar and dflash on a Llama target (modes_for): diffusion is refused in one line in Python,
    before any export or port process, though clover itself runs it (the denoise adapter)."""
    from clover.decoding.sampling import SamplingParams
    from clover.integrations.llama_port import generate, port_options

    llm = clover.load(tiny["target"])
    why = r"^mode: the llama.cpp port runs ar, dflash on a Llama target \(its denoise adapter is not ported\), got 'diffusion'$"
    with pytest.raises(ValueError, match=why):
        generate(llm, [5, 6, 7], "diffusion", {"max_new_tokens": 4})
    with pytest.raises(ValueError, match=why):
        port_options("diffusion", SamplingParams(max_new_tokens=4).validate(), config=llm.config)
    assert port_options("ar", SamplingParams(max_new_tokens=4).validate(), config=llm.config)["mode"] == "ar"


# ------------------------------------------------------------------------------ slow: the port
PORT = port_binary()


@pytest.fixture(scope="module")
def port():
    if not PORT.exists():
        pytest.skip(f"llama.cpp port absent ({PORT} not found): run PORT=1 scripts/build-llama-cpp.sh")
    return PORT


def port_run(gguf_path, prompts, mode, llm, drafter=None, parallel=1, **kw):
    from clover.integrations.llama_port import run

    params = llm.params(mode, dict(max_new_tokens=TOKENS, temperature=0.0) | kw)
    return run(gguf_path, prompts, port_args(mode, params, drafter=drafter), eos_ids=llm.eos_ids(), timeout=900,
               parallel=parallel)


@pytest.mark.slow
@pytest.mark.parametrize("which", ["drafter", "vocab_drafter"])
def test_port_llama_ar_and_dflash_match_clover(port, tiny, tmp_path, monkeypatch, which):
    from clover.export.gguf import export_gguf
    from clover.gguf.write import export_drafter_gguf

    torch.set_num_threads(1)
    llm = clover.load(tiny["target"], drafter=tiny[which], dtype="float32")
    target = export_gguf(tiny["target"], tmp_path / "t.gguf", dtype="f32", progress=False).path
    drafter = export_drafter_gguf(llm.drafter, tmp_path / "d.gguf", target=llm.model).path
    prompts = PROMPTS
    ar = port_run(target, prompts, "ar", llm, ignore_eos=True)
    ar_batched = port_run(target, prompts, "ar", llm, ignore_eos=True, parallel=3)
    df = port_run(target, prompts, "dflash", llm, drafter=drafter, ignore_eos=True)
    df_parallel = port_run(target, prompts, "dflash", llm, drafter=drafter, ignore_eos=True, parallel=3)
    batched = llm.generate(prompts, mode="dflash", max_new_tokens=TOKENS, temperature=0.0, ignore_eos=True)
    accepted = 0
    for i, ids in enumerate(prompts):
        ours = llm.generate(ids, mode="ar", max_new_tokens=TOKENS, temperature=0.0, ignore_eos=True).token_ids
        assert ar[i]["tokens"] == ours == ar_batched[i]["tokens"], i
        gen, drafts = clover_dflash(llm, ids, monkeypatch, ignore_eos=True, max_new_tokens=TOKENS)
        assert df[i]["tokens"] == gen.token_ids == ours == df_parallel[i]["tokens"] == batched[i].token_ids, i
        assert df[i]["drafts"] == drafts, i
        assert (df[i]["forwards"], df[i]["accept_lengths"]) == (gen.stats.forwards, gen.stats.accept_lengths), i
        accepted += sum(a - 1 for a in df[i]["accept_lengths"])
    assert sum(len(d) for r in df for d in r["drafts"]) > 0
    assert which == "drafter" or accepted > 0  # the common-token drafter's drafts are kept (and the rest rolled back)
    print(f"\n{which}: {accepted} draft tokens accepted over {len(prompts)} prompts (a random drafter)")


# ------------------------------------------------------------------------------ slow: clover-smol
def smol_dir() -> Path | None:
    d = Path(os.environ.get("CLOVER_MODELS") or Path.home() / ".cache" / "clover" / "models") / "clover-smol"
    return d if (d / "config.json").is_file() and (d / "dflash" / "config.json").is_file() else None


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["f32", "q8_0"])
def test_port_clover_smol_dflash_is_ar(port, tmp_path, dtype):
    """clover-smol and its shipped drafter, 8 held-out chat questions to EOS (cap 96): the port's dflash
    gives its AR's tokens on every question, and in f32 its AR stock llama.cpp's (clover-llama-probe) on
    the same GGUF but at a near tie of stock's own logits; clover's export is the stock converter's GGUF,
    tensor for tensor."""
    from clover.bench.chat import chat_items
    from clover.bench.peers.llama_cpp_dflash import _converter, convert
    from clover.export.gguf import export_gguf
    from clover.integrations.llama_port import export_drafter

    src = smol_dir()
    if src is None:
        pytest.skip("clover-smol is not pulled (`clover pull clover-smol`; $CLOVER_MODELS)")
    torch.set_num_threads(1)
    llm = clover.load(src, dtype="float32")
    target = export_gguf(src, tmp_path / "smol.gguf", dtype=dtype, progress=False).path
    drafter = export_drafter(llm, tmp_path, dtype=dtype)
    conv = _converter(llama_cache_dir())
    if conv is not None and dtype == "f32":
        from clover.bench.peers.base import write_hf_head
        from clover.models.llama import is_adapter_parameter

        hf = tmp_path / "hf"
        write_hf_head(src, hf, llm.config, dtype="float32")
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in llm.model.state_dict().items()
                   if not is_adapter_parameter(k) and k != "lm_head.weight"}, str(hf / "model.safetensors"))
        theirs = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(convert(str(conv), hf, tmp_path / "conv.gguf",
                                                                                  outtype="f32")).tensors}
        ours = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(target).tensors}
        assert ours.keys() == theirs.keys() and all(np.array_equal(ours[k], theirs[k]) for k in ours)
    prompts = [list(it.prompt) for it in chat_items(llm, 8)]
    n = 96
    ar = port_run(target, prompts, "ar", llm, max_new_tokens=n)
    df = port_run(target, prompts, "dflash", llm, drafter=drafter, max_new_tokens=n)
    probe = llama_cache_dir() / "bin" / "clover-llama-probe"
    same_as_stock = []
    for i, (a, d) in enumerate(zip(ar, df)):
        assert d["tokens"] == a["tokens"], i  # dflash is AR greedy, on every question
        if probe.exists():
            stock = probe_run(probe, target, "greedy", prompts[i], str(n)).split()
            stock = [int(x) for x in stock]
            stop = next((j for j, t in enumerate(stock) if t in llm.eos_ids()), len(stock))
            same_as_stock.append(a["tokens"] == stock[:stop])
            # f32: only where stock llama.cpp's own logits are a near tie (its kernels break it otherwise). q8_0: its
            # prefill sums the quantized products in another order (tinyBLAS) than the port's (vec_dot's), and the
            # activations' 8-bit rounding carries the difference on: not compared
            if dtype == "f32" and not same_as_stock[-1]:
                j = next(j for j, (x, y) in enumerate(zip(a["tokens"], stock)) if x != y)
                out = tmp_path / "logits.f32"
                probe_run(probe, target, "logits", prompts[i] + stock[:j], str(out))
                last = np.fromfile(out, dtype=np.float32).reshape(-1, llm.config.vocab_size)[-1]
                top2 = np.sort(last)[-2:]
                assert top2[1] - top2[0] < 1e-2, (i, j, top2)
    verifies = sum(len(d["accept_lengths"]) for d in df)
    print(f"\nclover-smol {dtype}: {sum(d['n_tokens'] for d in df)} tokens, {verifies} verifies; port AR = stock "
          f"llama.cpp AR on {sum(same_as_stock)} of {len(same_as_stock)}" + (" (the rest a near tie)" if dtype == "f32" else ""))


def probe_run(probe, gguf_path, mode, ids, *args) -> str:
    import subprocess

    return subprocess.run([str(probe), str(gguf_path), mode, *args], input=" ".join(map(str, ids)).encode(),
                          capture_output=True, env=dict(os.environ, CLOVER_PROBE_THREADS="1"), check=True).stdout.decode()


@pytest.mark.slow
def test_port_llama_q8_0_wide_head_and_dflash_is_ar(port, tiny, tmp_path):
    """q8_0: the wide kernel takes every matrix, the head of 264 rows too (its last 264 % 16 by
    ggml's vec_dot), with ggml's results bit for bit; the port's dflash gives its AR's tokens."""
    import json
    import subprocess

    from clover.export.gguf import export_gguf
    from clover.gguf.write import export_drafter_gguf

    llm = clover.load(tiny["target"], drafter=tiny["vocab_drafter"], dtype="float32")
    assert llm.config.vocab_size % 16
    target = export_gguf(tiny["target"], tmp_path / "t.gguf", dtype="q8_0", progress=False).path
    drafter = export_drafter_gguf(llm.drafter, tmp_path / "d.gguf", dtype="q8_0", target=llm.model).path
    out = subprocess.run([str(port), str(target), "--mode", "check-matmul", "--matmul", "wide"], capture_output=True, check=True)
    check = json.loads(out.stdout.decode())
    assert check["matrices"] == 7 * llm.config.num_hidden_layers + 1 and check["max_rel_diff"] == 0.0, check
    ar = port_run(target, PROMPTS, "ar", llm, ignore_eos=True)
    df = port_run(target, PROMPTS, "dflash", llm, drafter=drafter, ignore_eos=True)
    assert [r["tokens"] for r in df] == [r["tokens"] for r in ar]
    assert sum(a - 1 for r in df for a in r["accept_lengths"]) > 0
