"""docs/walkthrough.md runs as written: its bash block (convert -> train on local JSON Lines and
text files -> export -> evaluate -> generate) in an empty directory, `clover` being this checkout's
command. Slow (a few minutes on a loaded CPU): opt in with --runslow or CLOVER_SLOW=1."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "walkthrough.md"


def script() -> str:
    blocks = re.findall(r"```bash\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 1, "docs/walkthrough.md should hold one bash block (the walkthrough)"
    return blocks[0]


def test_walkthrough_is_one_script_of_real_commands():
    from clover.cli import COMMANDS

    text = script()
    used = set(re.findall(r"^clover ([a-z-]+)", text, flags=re.M))
    assert used and used <= set(COMMANDS), used - set(COMMANDS)


@pytest.mark.slow
def test_walkthrough_runs_as_written(tmp_path):
    prelude = f'set -euo pipefail\nclover() {{ "{sys.executable}" -m clover "$@"; }}\npython3() {{ "{sys.executable}" "$@"; }}\n'
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"), OMP_NUM_THREADS="1")
    env.pop("CLOVER_MODEL", None)
    p = subprocess.run(["bash", "-c", prelude + script()], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=1500)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert (tmp_path / "my-model" / "config.json").is_file()
    assert "| diffusion |" in p.stdout  # the eval table
    assert "[diffusion]" in p.stderr  # the generation's stats line
