"""`clover bench peers` on the released families: the reference's row (its own generate function, from the
user's checkout, in another interpreter) gives clover's tokens on the same tiny weights and prompts, and
without a checkout it is skipped with a note saying why; the autoregressive peers say they cannot decode
these models. The reference's own run is opt-in: set CLOVER_SDAR_REFERENCE (a clone of JetAstra/SDAR) or
CLOVER_LLADA2_REFERENCE (LLaDA2's two remote-code files) and CLOVER_REFERENCE_PYTHON (an interpreter with
the transformers each needs: SDAR 4.52.x, LLaDA2 >= 4.56)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from clover.bench.peers import run_peers
from test_sdar import _word_tokenizer

GOLDEN = Path(__file__).parent / "golden"
ENV = {"sdar": "CLOVER_SDAR_REFERENCE", "llada2": "CLOVER_LLADA2_REFERENCE"}
PROMPTS = ["t5 t17 t33 t60 t9", "t8 t90 t14 t3 t77 t51 t26 t119 t40 t66 t12", "t30 t7 t84"]


def golden_dir(family: str, tmp_path: Path) -> Path:
    d = tmp_path / family
    shutil.copytree(GOLDEN / family / "checkpoint", d)
    _word_tokenizer(d, 128)
    return d


@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_reference_row_without_a_checkout_is_skipped_with_why(family, tmp_path, monkeypatch):
    monkeypatch.delenv(ENV[family], raising=False)
    name = f"{family}-reference"
    r = run_peers(golden_dir(family, tmp_path), prompt_texts=PROMPTS[:1], max_new_tokens=8, threads=[1], batch=2,
                  engines=["clover", "transformers", name])
    e = r["engines"]
    assert not e[name]["available"] and ENV[family] in e[name]["note"] and "--reference" in e[name]["note"]
    assert not e["transformers"]["available"] and "decodes autoregressively" in e["transformers"]["note"]
    assert {row["engine"] for row in r["rows"]} == {"clover"} and "ar" in r["settings"]["skipped_modes"]
    assert {row["variant"] for row in r["rows"]} == {"diffusion"}


@pytest.mark.parametrize("family", ["sdar", "llada2"])
def test_reference_row_gives_clovers_tokens(family, tmp_path):
    """The reference's own generate function on the same weights and prompts: identical tokens, batch 1
    and the batch's prompts in turn (tokens/s beside clover's; never asserted)."""
    if not (os.environ.get(ENV[family]) and os.environ.get("CLOVER_REFERENCE_PYTHON")):
        pytest.skip(f"set {ENV[family]} and CLOVER_REFERENCE_PYTHON to run the reference")
    name = f"{family}-reference"
    n = 32 if family == "llada2" else 16  # LLaDA2's generate caps its steps at the length: a whole block of 32
    r = run_peers(golden_dir(family, tmp_path), prompt_texts=PROMPTS, max_new_tokens=n, threads=[1], batch=3,
                  engines=["clover", name])
    assert r["engines"][name]["available"], r["engines"][name]
    rows = {(row["engine"], row["batch"]): row for row in r["rows"]}
    assert rows[(name, 1)]["matches_clover_mode"] == 1.0 and rows[(name, 1)]["compared_with"] == "diffusion"
    assert rows[(name, 1)]["samples"] == len(PROMPTS) and rows[(name, 3)]["clover_speedup"] is not None
