"""Stock llama.cpp's `llama-diffusion-cli` beside clover's canvas mode on the same weights (opt-in:
CLOVER_SLOW=1 and `scripts/build-llama-cpp.sh`; skipped with the reason otherwise).

test_canvas.py's tiny Dream checkpoint, over the bundled model's vocabulary (so the
CLI's text compares), are converted with llama.cpp's own `convert_hf_to_gguf.py` and decoded by both
with the CLI's only deterministic setting, `--top-k 1` (its sampler always draws, `--temp 0`
included; top-k 1 leaves one candidate of probability 1, so every confidence ties and it unmasks left
to right). In one step the order cannot matter and the canvases agree; with more steps they agree
where clover breaks its tied confidences the same way (`top_k=1, canvas_ties="position"`; a near-tie
of two logits can still part them: docs/checkpoints.md). The CLI applies the chat template (chatml where the GGUF has none)
and prints the canvas as text without special tokens, so clover gets the templated prompt and its
text is decoded so. LLaDA is left out: on this vocabulary its one-step canvases differed (its
converted GGUF sets `add_bos_token` without a BOS id; not traced further), where over SmolLM2's
vocabulary they agreed (docs/experiments.md, 2026-12-06)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from clover.checkpoint import load_model
from clover.gguf.write import read_tokenizer
from clover.integrations.llama_port import llama_cache_dir

ROOT = Path(__file__).resolve().parents[1]
BUNDLED = ROOT / "src" / "clover" / "assets" / "clover-tiny"
CLI = llama_cache_dir() / "build" / "bin" / "llama-diffusion-cli"
PROMPTS = ("The capital of France is", "Once upon a time")
CANVAS = 48  # prompt (templated) + generated tokens: the CLI's -ub


def converter() -> Path | None:
    found = sorted(llama_cache_dir().glob("src/*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    return found[-1] if found else None


@pytest.fixture(scope="module", params=("dream",))
def pair(request, tmp_path_factory):
    """(family, the tiny checkpoint's directory, its GGUF by llama.cpp's converter)."""
    if not CLI.exists():
        pytest.skip(f"llama-diffusion-cli absent ({CLI} not found): run scripts/build-llama-cpp.sh")
    if converter() is None:
        pytest.skip(f"llama.cpp's convert_hf_to_gguf.py absent under {llama_cache_dir()}: run scripts/build-llama-cpp.sh")
    if importlib.util.find_spec("sentencepiece") is None:
        pytest.skip("llama.cpp's converter imports sentencepiece, which this environment lacks")
    from safetensors.torch import save_file
    from test_canvas import _script, golden

    family = request.param
    g, s = golden(family), _script()
    tok = json.loads((BUNDLED / "config.json").read_text())
    vocab, mask, eos = tok["vocab_size"], tok["mask_token_id"], tok["eos_token_id"]
    big = g["config"]["vocab_size"]
    shapes = [(n, [vocab if d == big else d for d in shape]) for n, shape in g["parameters"]]
    out = tmp_path_factory.mktemp(family) / "model"
    out.mkdir()
    weights = s.tiny_parameters(shapes, g["seed"], g["head"], mask)
    weights[g["head"]][eos] = 0.0  # a canvas without EOS: both print it whole
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    keys = {"vocab_size": vocab, "mask_token_id": mask, "eos_token_id": eos, "pad_token_id": eos, "bos_token_id": eos}
    (out / "config.json").write_text(json.dumps({**g["config"], **keys}))
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (out / name).write_bytes((BUNDLED / name).read_bytes())
    gguf = out.parent / f"{family}.gguf"
    # the bundled tokenizer's pre-tokenizer is not in the converter's hash list: name the one clover's
    # own GGUF export writes for it
    pre = read_tokenizer(BUNDLED, load_model(BUNDLED).config).pre
    wrapper = (f"import runpy, sys; sys.path[:0] = [{str(converter().parent)!r}, {str(converter().parent / 'gguf-py')!r}]\n"
               f"import conversion.base as b; b.TextModel.get_vocab_base_pre = lambda self, tokenizer: {pre!r}\n"
               f"sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")
    run = subprocess.run([sys.executable, "-c", wrapper, str(converter()), str(out), "--outfile", str(gguf), "--outtype", "f32"],
                         check=False, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    return family, out, gguf


def cli_text(family: str, gguf: Path, prompt: str, steps: int) -> str:
    """The CLI's canvas in the matching setting, run as scripts/diffusion-cli-compare.py runs it."""
    spec = importlib.util.spec_from_file_location("diffusion_cli_compare", ROOT / "scripts" / "diffusion-cli-compare.py")
    compare = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(compare)
    return compare.run_cli(CLI, gguf, prompt, steps, CANVAS, None, family == "dream")[0]


@pytest.mark.slow
def test_diffusion_cli_one_step_matches_canvas(pair):
    """One step: every position takes its argmax over the same logits, so the order the two unmask in
    (the CLI's ties, clover's confidences) cannot matter and the canvases are equal."""
    import clover

    family, directory, gguf = pair
    llm = clover.load(directory)
    for prompt in PROMPTS:
        chat = f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
        n = CANVAS - len(llm.tokenizer.encode(chat))
        got = llm.generate(chat, mode="canvas", steps=1, max_new_tokens=n, temperature=0, ignore_eos=True)
        text = llm.tokenizer.decode(got.token_ids, skip_special_tokens=True)
        assert text == cli_text(family, gguf, prompt, 1), (family, prompt)


@pytest.mark.slow
@pytest.mark.parametrize("steps", (4, 8))
def test_diffusion_cli_matching_setting(pair, steps):
    """Several steps in the setting where both should decode alike: the CLI's `--top-k 1` ties every
    confidence and its sort takes the leftmost masks; clover's `top_k=1, canvas_ties="position"` does
    the same, and the two schedules' counts agree (docs/checkpoints.md). A near-tie of two logits
    (ggml's float sums against torch's) can still part them; these prompts have none."""
    import clover

    family, directory, gguf = pair
    llm = clover.load(directory)
    for prompt in PROMPTS:
        chat = f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"
        n = CANVAS - len(llm.tokenizer.encode(chat))
        got = llm.generate(chat, mode="canvas", steps=steps, max_new_tokens=n, temperature=0, top_k=1,
                           canvas_ties="position", ignore_eos=True)
        text = llm.tokenizer.decode(got.token_ids, skip_special_tokens=True)
        assert text == cli_text(family, gguf, prompt, steps), (family, prompt, steps)
