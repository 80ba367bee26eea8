"""`clover eval` runs end to end on a tiny model and reports both regimes."""

import json

from clover import cli


def test_eval_tiny(tiny_dir, tmp_path, capsys):
    out = tmp_path / "eval.json"
    rc = cli.main(["eval", "--model", str(tiny_dir), "--task-prompts", "2", "--code-prompts", "1",
                   "--max-new-tokens", "8", "--no-sweep", "--modes", "ar,diffusion", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "**Tasks**" in text and "**Code**" in text and "perplexity" in text
    assert "**Tasks by kind**" in text and "| diffusion tok/fwd |" in text
    res = json.loads(out.read_text())
    assert set(res["tasks"]["modes"]) == {"ar", "diffusion"}
    tf = res["teacher_forced"]
    assert tf["ar_perplexity"] > 1 and 0 <= tf["masked_accuracy"] <= 1
