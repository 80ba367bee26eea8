"""A plain `clover generate` loads only what it uses: no torch._dynamo (the compiler stack, ~2-3 s
to import) and no transformers (~1.7 s) for an eager run, nor clover's grammar, quantized loader or
DFlash drafter (the bundled model's drafter is loaded for `--mode dflash` alone); the tokenizer it
uses instead encodes and decodes exactly as transformers' fast tokenizer of the same files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUNDLED = REPO / "src" / "clover" / "assets" / "clover-tiny"

PROBE = """
import sys
from clover import cli
rc = cli.main(sys.argv[1:])
heavy = [m for m in ("torch._dynamo", "transformers", "matplotlib", "fastapi", "clover.grammar", "clover.quant.loader",
                     "clover.models.dflash") if m in sys.modules]
print("\\nIMPORTED=" + ",".join(heavy), file=sys.stderr)
sys.exit(rc)
"""


def _imported(*argv: str) -> tuple[list[str], subprocess.CompletedProcess]:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1")
    env.pop("CLOVER_MODEL", None)
    p = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    line = [x for x in p.stderr.splitlines() if x.startswith("IMPORTED=")][-1]
    return [m for m in line.split("=", 1)[1].split(",") if m], p


@pytest.mark.parametrize("mode", ["ar", "diffusion"])
def test_eager_generate_imports_no_compiler_and_no_transformers(mode):
    heavy, p = _imported("generate", "assert sorted([9, 2, 5]) == ", "-n", "8", "--mode", mode)
    assert heavy == [], f"an eager `clover generate --mode {mode}` imported {heavy}"
    assert p.stdout.strip()  # and it generated


def test_generate_dflash_loads_the_bundled_drafter():
    heavy, p = _imported("generate", "assert sorted([9, 2, 5]) == ", "-n", "8", "--mode", "dflash", "--json")
    assert "clover.models.dflash" in heavy and json.loads(p.stdout)["token_ids"]


def test_tiny_model_load_imports_neither(tmp_path):
    from clover.tiny import build_tiny_checkpoint

    d = build_tiny_checkpoint(tmp_path / "tiny")
    heavy, _ = _imported("generate", "hello", "--model", str(d), "-n", "4", "--mode", "ar", "--json")
    assert heavy == []


TEXTS = ["assert sorted([9, 2, 5]) == [2, 5, 9]", "def f(x):\n    return x  # ünïcode ✓ 日本", "  leading  spaces\t\n",
         "<|mask|><|endoftext|>a<|im_start|>user\nhi<|im_end|>", "", "\x00\x7f", "😀" * 3]


def _tokenizer_dirs(tmp_path):
    from clover.tokenizer import write_byte_tokenizer

    write_byte_tokenizer(tmp_path / "bytes")
    return [BUNDLED, tmp_path / "bytes"]


def test_tokenizer_matches_transformers(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from clover.tokenizer import Tokenizer

    for d in _tokenizer_dirs(tmp_path):
        tok = Tokenizer.from_dir(d)
        ref = PreTrainedTokenizerFast.from_pretrained(str(d), local_files_only=True)
        assert tok.vocab_size == len(ref)
        assert (tok.eos_token_id, tok.pad_token_id, tok.mask_token_id) == (ref.eos_token_id, ref.pad_token_id,
                                                                          ref.mask_token_id)
        for text in TEXTS:
            ids = tok.encode(text)
            assert ids == ref.encode(text, add_special_tokens=False), (d, text)
            for skip in (False, True):
                assert tok.decode(ids, skip_special_tokens=skip) == ref.decode(
                    ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False), (d, text, skip)
        assert tok.hf.chat_template == ref.chat_template  # the transformers tokenizer, on first use


def test_tokenizer_config_names_win_over_the_map(tmp_path):
    """tokenizer_config.json's special-token names override special_tokens_map.json's, as in transformers;
    either may write a name as {"content": ...} (older tokenizer_config.json files do)."""
    from clover.tokenizer import Tokenizer, write_byte_tokenizer

    ids = write_byte_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["eos_token"] = {"content": "<|im_end|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.eos_token_id == ids["<|im_end|>"]


EXIT_PROBE = """
import atexit, sys
atexit.register(lambda: print("ATEXIT-RAN", file=sys.stderr))
from clover.cli import entry
sys.argv = ["clover", *sys.argv[1:]]
entry()
print("NOT-REACHED")
"""


@pytest.mark.parametrize("argv,rc", [(["generate", "assert sorted([9, 2, 5]) == ", "-n", "8", "--mode", "ar", "--json"], 0),
                                     (["generate", "x", "--model", "/nonexistent-clover-dir"], 2)])
def test_entry_exits_fast_with_output_flushed_and_atexit_run(argv, rc):
    """`clover` (cli.entry) skips the interpreter's teardown: the piped (block-buffered) stdout still
    arrives whole, atexit handlers still run, the exit status is main's, and nothing after entry() runs."""
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1")
    env.pop("CLOVER_MODEL", None)
    p = subprocess.run([sys.executable, "-c", EXIT_PROBE, *argv], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == rc, p.stderr
    assert "ATEXIT-RAN" in p.stderr and "NOT-REACHED" not in p.stdout
    if rc == 0:
        assert len(json.loads(p.stdout)["token_ids"]) == 8
    else:
        assert "clover generate: error:" in p.stderr
