"""`clover export-hf`: a Clover checkpoint as a transformers directory (trust_remote_code).

The remote code is generated from clover's own modules at export time (`clover.export.hf`); these
tests check that it is exactly that (the bundle is clover's source with only relative import lines
rewritten, follows a change to the source, imports only torch and transformers) and that it behaves
exactly as clover does: every transformers-side check runs in a subprocess started with
`python -I -S` and only site-packages on `sys.path`, where `import clover` fails (asserted there),
and is compared with clover's results computed here.

Default suite: a random tiny model (denoise branch perturbed so block diffusion exercises it) and
the bundled model — logits (atol 1e-5), `generate(do_sample=False)` = clover AR token for token,
`diffusion_generate` = clover's diffusion engine token for token with the same forwards,
speculative = AR, a left-padded batch; a 3-step Trainer fine-tune (plain, and LoRA when peft is
installed; skipped without accelerate). Opt-in (CLOVER_SLOW=1): lm-eval's `hf` backend on the
exported bundled model.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import clover
from clover.export.hf import ENTRY_MODULES, HEADER, BundleError, bundle_sources, export_hf, flat_name, module_file

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "clover"
BUNDLED = PACKAGE / "assets" / "clover-tiny"
ATOL = 1e-5
IMPORT_LINE = re.compile(r"^\s*from\s+\.+[\w.]*\s+import\b")

PROMPTS_TINY = [[72, 101, 108, 108, 111], [100, 101, 102, 32, 102, 40, 120, 41, 58, 10, 32, 32], [65]]
PROMPTS_BUNDLED_TEXT = ["def fibonacci(n):", "import numpy as np\nx = "]
NEW_TOKENS = 32


# ----------------------------------------------------------------------------- the bundle
def _source_lines(flat_file: str, text: str) -> tuple[list[str], list[str]]:
    header, body = text.split("\n", 1)
    source = re.search(r"from (\S+)\. Do not edit", header).group(1)
    return body.splitlines(), (ROOT / "src" / source).read_text().splitlines()


def test_bundle_is_clover_source_with_only_imports_rewritten():
    bundle = bundle_sources()
    assert set(ENTRY_MODULES.values()) <= {n[:-3] for n in bundle}
    for name, text in bundle.items():
        assert text.startswith(HEADER.split("{")[0])
        got, src = _source_lines(name, text)
        assert len(got) == len(src), name
        changed = [(a, b) for a, b in zip(got, src) if a != b]
        for new, old in changed:  # only relative imports differ, and they name a flat sibling
            assert IMPORT_LINE.match(new) and IMPORT_LINE.match(old), (name, new, old)
            target = re.match(r"^\s*from\s+\.(\w+)\s+import", new).group(1)
            assert target + ".py" in bundle, (name, new)
        # no relative import left that transformers' loader could not follow
        for line in got:
            if IMPORT_LINE.match(line):
                assert re.match(r"^\s*from\s+\.\w+\s+import", line), (name, line)


def test_bundle_holds_every_module_transformers_copies(tmp_path):
    """transformers copies the files named by the modeling/configuration files' relative imports,
    recursively: exactly the bundle."""
    from transformers.dynamic_module_utils import get_imports, get_relative_import_files

    bundle = bundle_sources()
    for name, text in bundle.items():
        (tmp_path / name).write_text(text)
    needed = {Path(p).name for entry in ENTRY_MODULES.values()
              for p in get_relative_import_files(str(tmp_path / f"{entry}.py"))}
    assert needed | {f"{e}.py" for e in ENTRY_MODULES.values()} == set(bundle)
    allowed = set(sys.stdlib_module_names) | {"torch", "transformers"}
    for name in bundle:
        assert set(get_imports(tmp_path / name)) <= allowed, name


def test_bundle_follows_the_source(tmp_path):
    """Generated at export time from the package it is given: a change to clover's source is in
    the next export, and an import the bundle cannot carry stops it."""
    copy = tmp_path / "clover"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("assets", "__pycache__", "static"))
    layers = copy / "models" / "layers.py"
    layers.write_text(layers.read_text() + "\nDRIFT_MARKER = 1\n")
    assert "DRIFT_MARKER = 1" in bundle_sources(copy)["clover_models_layers.py"]
    assert "DRIFT_MARKER" not in bundle_sources()["clover_models_layers.py"]
    layers.write_text(layers.read_text() + "import safetensors\n")
    with pytest.raises(BundleError, match="safetensors"):
        bundle_sources(copy)
    layers.write_text(layers.read_text().replace("import safetensors\n", "from .. import tokenizer\n"))
    with pytest.raises(BundleError, match="cannot be bundled"):
        bundle_sources(copy)


def test_bundle_covers_every_backbone():
    """The exported model picks the backbone class the registry picks, for every backbone."""
    from clover.integrations.hf_modeling import backbone_class
    from clover.models import TEXT_MODEL_TYPES, model_class
    from clover.tiny import tiny_config

    for base, arch in TEXT_MODEL_TYPES.items():
        cfg = tiny_config(backbone=base, dense=base not in ("qwen3_5_moe_text", "qwen3_moe", "sdar_moe", "llada2_moe",
                                                              "lladamoe", "rnd1"))
        assert cfg.base_model_type == base
        assert backbone_class(cfg) is model_class(cfg) is arch.model_class


def test_flat_names_are_unique():
    mods = [".".join(("clover",) + p.relative_to(PACKAGE).with_suffix("").parts) for p in PACKAGE.rglob("*.py")]
    mods = [m.removesuffix(".__init__") for m in mods if m != "clover.__init__"]
    names = [flat_name(m) for m in mods]
    assert len(names) == len(set(names))
    assert all(module_file(m) is not None for m in mods)


# ----------------------------------------------------------------------------- models
def _random_tiny(directory: Path, *, dense: bool = False) -> Path:
    """A random tiny Clover checkpoint in fp32 whose denoise branch is not at its zero start."""
    from clover.checkpoint import save_model
    from clover.models import build_model
    from clover.tiny import tiny_config
    from clover.tokenizer import write_byte_tokenizer

    config = tiny_config(dense=dense)
    model = build_model(config, device="cpu", dtype=torch.float32)
    model.init_weights(seed=3, std=0.08)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("block_gain_a", "block_gain_b", "conv1d_right.weight")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    config.torch_dtype = "float32"
    save_model(model, directory)
    write_byte_tokenizer(directory)
    return directory


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    base = tmp_path_factory.mktemp("hf_export")
    src = _random_tiny(base / "tiny-src")
    out = {"tiny": export_hf(src, base / "tiny-hf").path, "bundled": export_hf(BUNDLED, base / "bundled-hf").path}
    out["tiny_src"] = src
    return out


def test_export_layout(exports):
    dst = exports["bundled"]
    names = {p.name for p in dst.iterdir()}
    assert {"config.json", "generation_config.json", "configuration_clover.py", "modeling_clover.py",
            "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_clover.CloverForCausalLM"
    assert cfg["model_type"] == "clover" and cfg["mask_token_id"] == 2
    # the remote code is what the source gives now (an export is never a stale copy)
    for name, text in bundle_sources().items():
        assert (dst / name).read_text() == text, name
    # still a clover checkpoint, with the same weights
    a, b = clover.load(BUNDLED, dtype="float32").model, clover.load(dst, dtype="float32").model
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb and torch.equal(va, vb)


def test_export_refuses(tmp_path):
    from clover.cli import main
    from clover.tiny import build_tiny_checkpoint

    ar = build_tiny_checkpoint(tmp_path / "ar", clover=False)
    assert main(["export-hf", str(ar), str(tmp_path / "out")]) == 2  # plain AR: convert first
    assert main(["export-hf", str(BUNDLED), str(tmp_path / "out")]) == 0
    assert main(["export-hf", str(BUNDLED), str(tmp_path / "out")]) == 2  # exists
    assert main(["export-hf", str(BUNDLED), str(tmp_path / "out"), "--overwrite"]) == 0
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("x")
    assert main(["export-hf", str(BUNDLED), str(tmp_path / "other"), "--overwrite"]) == 2  # not an export
    assert (tmp_path / "other" / "keep.txt").exists()


# ------------------------------------------------------------------------ isolated runs
WORKER = r'''
import importlib.util, json, sys
spec = json.loads(sys.argv[1])
sys.path[:0] = spec["site"]
assert importlib.util.find_spec("clover") is None, "clover must not be importable here"
try:
    import clover  # noqa: F401
except ImportError:
    pass
else:
    raise AssertionError("import clover succeeded")
import torch
torch.set_num_threads(spec["threads"])  # as in the test process: the same matmul blocking, the same bits
from transformers import AutoModelForCausalLM, AutoTokenizer

path, out = spec["model"], {}
model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32).eval()
out["class"] = type(model).__module__ + "." + type(model).__name__
tok = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
prompts = spec["prompts"] if spec["prompts"] is not None else [tok(t)["input_ids"] for t in spec["texts"]]
out["prompts"] = prompts
N = spec["max_new_tokens"]
with torch.no_grad():
    out["logits"] = [model(torch.tensor([p])).logits[0] for p in prompts]
    # a left-padded batch, as generate() gets from a tokenizer padding on the left
    T = max(map(len, prompts))
    ids = torch.full((len(prompts), T), 0, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):] = torch.tensor(p)
        mask[i, T - len(p):] = 1
    out["logits_left_padded"] = model(ids, attention_mask=mask).logits
    out["generate"] = [model.generate(torch.tensor([p]), max_new_tokens=N, do_sample=False)[0, len(p):].tolist()
                       for p in prompts]
    out["generate_batch"] = model.generate(ids, attention_mask=mask, max_new_tokens=N, do_sample=False)[:, T:].tolist()
    out["sampled"] = model.generate(torch.tensor([prompts[0]]), max_new_tokens=8, do_sample=True, top_p=0.9)[0].tolist()
    for mode in ("diffusion", "speculative", "ar"):
        res = [model.diffusion_generate(torch.tensor([p]), max_new_tokens=N, mode=mode, return_dict_in_generate=True)
               for p in prompts]
        out[mode] = [r.sequences[0, len(p):].tolist() for r, p in zip(res, prompts)]
        out[mode + "_forwards"] = [r.forwards[0] for r in res]
    # several blocks (the fused commit) and several tokens per step (a low threshold)
    res = [model.diffusion_generate(torch.tensor([p]), max_new_tokens=N, block_size=8, threshold=0.02,
                                    return_dict_in_generate=True) for p in prompts]
    out["diffusion_b8"] = [r.sequences[0, len(p):].tolist() for r, p in zip(res, prompts)]
    out["diffusion_b8_forwards"] = [r.forwards[0] for r in res]
    b = model.diffusion_generate(ids, attention_mask=mask, max_new_tokens=N, return_dict_in_generate=True)
    out["diffusion_batch"] = b.sequences[:, T:].tolist()
    out["diffusion_batch_forwards"] = b.forwards
    out["pad"] = model.generation_config.pad_token_id
torch.save(out, spec["out"])
'''

TRAIN_WORKER = r'''
import importlib.util, json, sys
spec = json.loads(sys.argv[1])
sys.path[:0] = spec["site"]
assert importlib.util.find_spec("clover") is None, "clover must not be importable here"
import torch
torch.manual_seed(0)
torch.set_num_threads(spec["threads"])
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

path, out = spec["model"], {}
g = torch.Generator().manual_seed(1)
data = [{"input_ids": x, "labels": x.clone()} for x in torch.randint(3, 250, (8, 32), generator=g)]
batch = {"input_ids": torch.stack([d["input_ids"] for d in data]), "labels": torch.stack([d["labels"] for d in data])}

def loss_of(model):
    model.eval()
    with torch.no_grad():
        return float(model(**batch).loss)

def train(model, lr, name):
    args = TrainingArguments(output_dir=spec["tmp"] + "/" + name, max_steps=3, per_device_train_batch_size=8,
                             learning_rate=lr, lr_scheduler_type="constant", report_to=[], save_strategy="no",
                             logging_steps=1, use_cpu=True, disable_tqdm=True, seed=0)
    before = loss_of(model)
    Trainer(model=model, args=args, train_dataset=data).train()
    out[name] = [before, loss_of(model)]

train(AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32), 3e-3, "plain")
if importlib.util.find_spec("peft") is not None:
    from peft import LoraConfig, get_peft_model
    base = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True, dtype=torch.float32)
    lora = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "in_proj_qkv", "out_proj"]))
    out["lora_trainable"] = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    train(lora, 1e-2, "lora")
json.dump(out, open(spec["out"], "w"))
'''


def _site_dirs() -> list[str]:
    """site-packages only: the editable install's path file (src/) is not processed under -S."""
    dirs = [d for d in site.getsitepackages() if Path(d).is_dir()]
    assert not any(Path(d).resolve() == (ROOT / "src").resolve() for d in dirs)
    return dirs


def run_isolated(script: str, spec: dict, tmp: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG", "TMPDIR")}
    env.update(HF_HOME=str(tmp / "hf_home"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="2")
    spec = dict(spec, site=_site_dirs(), threads=torch.get_num_threads())
    (tmp / "worker.py").write_text(script)
    proc = subprocess.run([sys.executable, "-I", "-S", str(tmp / "worker.py"), json.dumps(spec)], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture(scope="module")
def isolated(exports, tmp_path_factory):
    """The transformers-side results, per model, from one isolated subprocess each."""
    results = {}

    def get(which: str) -> dict:
        if which not in results:
            tmp = tmp_path_factory.mktemp(f"iso-{which}")
            spec = {"model": str(exports[which]), "out": str(tmp / "out.pt"), "max_new_tokens": NEW_TOKENS,
                    "prompts": PROMPTS_TINY if which == "tiny" else None,
                    "texts": PROMPTS_BUNDLED_TEXT}
            run_isolated(WORKER, spec, tmp)
            results[which] = torch.load(tmp / "out.pt", weights_only=True)  # tensors, ints, strings: no pickle
        return results[which]

    return get


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[:i]
    return tokens


@pytest.mark.parametrize("which", ["tiny", "bundled"])
def test_transformers_equals_clover(which, exports, isolated):
    res = isolated(which)
    assert res["class"].endswith("modeling_clover.CloverForCausalLM")
    llm = clover.load(exports["tiny_src"] if which == "tiny" else BUNDLED, dtype="float32")
    eos = set(llm.config.eos_token_ids)
    prompts = res["prompts"]
    report = {}
    with torch.no_grad():
        worst = 0.0
        for p, got in zip(prompts, res["logits"]):
            ref = llm.model(torch.tensor([p]))[0]
            torch.testing.assert_close(got, ref, atol=ATOL, rtol=0)
            worst = max(worst, float((got - ref).abs().max()))
        T = max(map(len, prompts))
        for i, p in enumerate(prompts):  # left padding: the valid positions equal the row alone (padding
            # lengthens the attention sums, so fp32 rounding moves large logits by a few ulps: rtol too)
            torch.testing.assert_close(res["logits_left_padded"][i, T - len(p):], res["logits"][i], atol=ATOL, rtol=1e-5)
    report["max_abs_logit_diff"] = worst
    N = NEW_TOKENS
    same = 0
    for i, p in enumerate(prompts):
        ar = llm.generate(p, mode="ar", max_new_tokens=N)
        diff = llm.generate(p, mode="diffusion", max_new_tokens=N)
        assert _until_eos(res["generate"][i], eos) == ar.token_ids
        assert _until_eos(res["generate_batch"][i], eos) == ar.token_ids
        assert _until_eos(res["ar"][i], eos | {res["pad"]}) == ar.token_ids
        assert _until_eos(res["speculative"][i], eos | {res["pad"]}) == ar.token_ids
        assert res["diffusion"][i][: len(diff.token_ids)] == diff.token_ids
        assert all(t == res["pad"] for t in res["diffusion"][i][len(diff.token_ids):])
        assert res["diffusion_forwards"][i] == diff.stats.forwards
        assert res["ar_forwards"][i] == ar.stats.forwards
        b8 = llm.generate(p, mode="diffusion", max_new_tokens=N, block_size=8, threshold=0.02)
        assert res["diffusion_b8"][i][: len(b8.token_ids)] == b8.token_ids
        assert res["diffusion_b8_forwards"][i] == b8.stats.forwards
        report.setdefault("b8_tokens_per_forward", []).append(round(len(b8.token_ids) / b8.stats.forwards, 2))
        same += len(ar.token_ids) + len(diff.token_ids) + len(b8.token_ids)
    batch = llm.generate(prompts, mode="diffusion", max_new_tokens=N)
    for i, g in enumerate(batch):
        assert res["diffusion_batch"][i][: len(g.token_ids)] == g.token_ids
        assert res["diffusion_batch_forwards"][i] == g.stats.forwards
    assert len(res["sampled"]) > len(prompts[0])
    assert max(report["b8_tokens_per_forward"]) > 1.5  # the multi-token steps were exercised
    report["tokens_compared"] = same
    report["diffusion_forwards"] = res["diffusion_forwards"]
    print(which, report)


def test_trainer_finetune_lowers_the_loss(exports, tmp_path):
    if importlib.util.find_spec("accelerate") is None:
        pytest.skip("transformers' Trainer needs accelerate: pip install accelerate (peft for the LoRA run)")
    run_isolated(TRAIN_WORKER, {"model": str(exports["tiny"]), "out": str(tmp_path / "out.json"), "tmp": str(tmp_path)},
                 tmp_path)
    out = json.loads((tmp_path / "out.json").read_text())
    before, after = out["plain"]
    assert after < before, out
    if "lora" in out:
        assert out["lora"][1] < out["lora"][0], out
        assert 0 < out["lora_trainable"]
    print(out)


LM_EVAL_TASK = """
task: clover_local_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{prompt}}}}"
doc_to_target: 0
doc_to_choice: "{{{{choices}}}}"
metric_list:
  - metric: acc
"""

LM_EVAL_WORKER = r'''
import importlib.util, json, sys
spec = json.loads(sys.argv[1])
sys.path[:0] = spec["site"]
assert importlib.util.find_spec("clover") is None, "clover must not be importable here"
import lm_eval
from lm_eval.tasks import TaskManager
res = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={spec['model']},trust_remote_code=True,dtype=float32",
                              tasks=["clover_local_ll"], task_manager=TaskManager(include_path=spec["tasks"]),
                              device="cpu", batch_size=2)
json.dump({k: v for k, v in res["results"]["clover_local_ll"].items() if isinstance(v, (int, float))}, open(spec["out"], "w"))
'''


@pytest.mark.slow  # lm-eval on the exported bundled model: opt in with CLOVER_SLOW=1 (needs lm-eval)
def test_lm_eval_hf_backend(exports, tmp_path):
    if importlib.util.find_spec("lm_eval") is None:
        pytest.skip("lm-eval is not installed: pip install lm-eval")
    rows = [
        {"prompt": "def add(a, b):\n    return", "choices": [" a + b", " a - b * 7"]},
        {"prompt": "import numpy as", "choices": [" np", " zzz"]},
        {"prompt": "for i in range(10):\n   ", "choices": [" print(i)", " }}}"]},
        {"prompt": "The capital of France is", "choices": [" Paris", " 42"]},
    ]
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    data = tasks / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tasks / "clover_local_ll.yaml").write_text(LM_EVAL_TASK.format(data=data))
    run_isolated(LM_EVAL_WORKER, {"model": str(exports["bundled"]), "tasks": str(tasks), "out": str(tmp_path / "out.json")},
                 tmp_path, timeout=900)
    out = json.loads((tmp_path / "out.json").read_text())
    assert 0.0 <= out["acc,none"] <= 1.0
    print(out)


# ------------------------------------------------------------------- quantized (torchao)
TORCHAO_WORKER = r'''
import importlib.util, json, sys, warnings
spec = json.loads(sys.argv[1])
sys.path[:0] = spec["site"]
assert importlib.util.find_spec("clover") is None, "clover must not be importable here"
warnings.filterwarnings("ignore")
import torch
torch.set_num_threads(spec["threads"])
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained(spec["model"], trust_remote_code=True, dtype=torch.float32).eval()
w = dict(model.named_parameters())
out = {"types": {n: type(w[n]).__name__ for n in spec["names"]},
       "qdata": {n: w[n].qdata for n in spec["names"]}, "scale": {n: w[n].scale for n in spec["names"]}}
with torch.no_grad():
    out["generate"] = [model.generate(torch.tensor([p]), max_new_tokens=spec["n"], min_new_tokens=spec["n"],
                                      do_sample=False)[0, len(p):].tolist() for p in spec["prompts"]]
    for mode in ("diffusion", "speculative", "ar"):  # clover's engines on the torchao weights
        res = [model.diffusion_generate(torch.tensor([p]), max_new_tokens=spec["n"], mode=mode, ignore_eos=True,
                                        return_dict_in_generate=True) for p in spec["prompts"][:spec["modes_on"]]]
        out[mode] = [r.sequences[0, len(p):].tolist() for r, p in zip(res, spec["prompts"])]
        out[mode + "_forwards"] = [r.forwards[0] for r in res]
torch.save(out, spec["out"])
'''


def test_decoding_runs_without_inference_mode_on_tensor_subclass_weights():
    """clover decodes under `torch.inference_mode()`, except where a weight is a tensor subclass (torchao's
    Int8Tensor cannot select one expert from an inference tensor): there under `torch.no_grad()`."""
    from clover.decoding.base import grad_free

    class Wrapped(torch.Tensor):
        pass

    plain, wrapped = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)
    wrapped.register_buffer("codes", torch.zeros(2).as_subclass(Wrapped))
    with grad_free(plain):
        assert torch.is_inference_mode_enabled()
    with grad_free(wrapped):
        assert not torch.is_inference_mode_enabled() and not torch.is_grad_enabled()


def test_int8_export_loads_in_transformers_token_for_token(tmp_path, monkeypatch):
    """`clover quantize --bits 8` then `clover export-hf`: transformers loads the INT8 weights through its
    own torchao quantizer (torchao Int8Tensor, clover's codes and scales bit for bit); its greedy
    `generate` and `diffusion_generate` (modes diffusion, speculative, ar) equal clover's quantized
    engine token for token (the engine's exact fp32 path), diffusion with the same forwards."""
    if importlib.util.find_spec("torchao") is None:
        pytest.skip("torchao is not installed: pip install 'clover-dlm[torchao]'")
    from safetensors.torch import load_file

    from clover.cli import main
    from clover.quant import ops
    from heldout import held_out_prompts

    q8, q4, hf = tmp_path / "q8", tmp_path / "q4", tmp_path / "q8-hf"
    assert main(["quantize", str(BUNDLED), str(q8), "--bits", "8", "--no-progress"]) == 0
    assert main(["export-hf", str(q8), str(hf)]) == 0
    qc = json.loads((hf / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "torchao" and qc["quant_type"]["default"]["_type"] == "Int8WeightOnlyConfig"
    names = ["model.layers.0.linear_attn.in_proj_qkv.weight", "model.layers.0.mlp.experts.gate_up_proj",
             "model.layers.3.self_attn.o_proj.weight"]
    monkeypatch.setattr(ops, "FP32_VIA_BF16", False)
    llm = clover.load(q8, dtype="float32")
    prompts = [llm.tokenizer.encode(p) for p in held_out_prompts(8)]
    # transformers' generate on all 8 prompts; clover's three engines on the first 4 (torchao's tensor
    # subclass dispatch makes every op slow on a CPU)
    spec = {"model": str(hf), "out": str(tmp_path / "out.pt"), "names": names, "prompts": prompts, "n": NEW_TOKENS,
            "modes_on": 4}
    run_isolated(TORCHAO_WORKER, spec, tmp_path)
    res = torch.load(tmp_path / "out.pt", weights_only=True)
    src = load_file(str(q8 / "model.safetensors"))
    for n in names:
        base = n.removesuffix(".weight")
        assert res["types"][n] == "Int8Tensor"
        assert torch.equal(res["qdata"][n], src[base + ".qweight"])
        assert torch.equal(res["scale"][n].flatten(), src[base + ".scales"].flatten())
    assert len(res["ar"]) == len(res["diffusion"]) == 4
    for i, ids in enumerate(prompts):
        ar = llm.generate(ids, mode="ar", max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0)
        assert res["generate"][i] == ar.token_ids
        if i >= 4:
            continue
        diff = llm.generate(ids, mode="diffusion", max_new_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.0)
        assert res["ar"][i] == res["speculative"][i] == ar.token_ids
        assert res["diffusion"][i] == diff.token_ids
        assert res["diffusion_forwards"][i] == diff.stats.forwards
    # INT4: refused in one line (torchao holds clover's INT4 only in CUDA-kernel tensors)
    assert main(["quantize", str(BUNDLED), str(q4), "--bits", "4", "--no-progress"]) == 0
    assert main(["export-hf", str(q4), str(tmp_path / "q4-hf")]) == 2
    assert not (tmp_path / "q4-hf").exists()
