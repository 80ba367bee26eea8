"""An agent loop through `clover serve`: the openai-agents SDK (over the official openai client,
Chat Completions) drives a multi-step task with three tools — read a file, search text, run a
Python expression in a sandboxed subprocess with a timeout — in every mode, and every call it
receives is well-formed (parsed by the SDK, arguments valid for the tool). Prints the median
wall-clock per task per mode (the seed's metric; the bundled model is tiny, so the figure is the
engine's, not an agent's skill). Slow: opt in with --runslow; needs `pip install openai-agents`."""

from __future__ import annotations

import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated, Literal

import pytest

pytestmark = pytest.mark.slow
Field = pytest.importorskip("pydantic").Field  # module level: the tools' annotations are read from here

TASKS = [
    "What number is in data.txt? Add 6*7 to it.",
    "Find the word 'clover' in notes.txt and count the lines.",
    "Compute the sum of the numbers in data.txt.",
]


def _tools(root: Path, calls: list):
    from agents import function_tool

    @function_tool
    def read_file(name: Literal["data.txt", "notes.txt"]) -> str:
        """Read a file of the task's folder."""
        calls.append(("read_file", name))
        return (root / name).read_text()

    @function_tool
    def search_text(name: Literal["data.txt", "notes.txt"], pattern: Annotated[str, Field(max_length=12)]) -> str:
        """The lines of a file that contain `pattern`."""
        calls.append(("search_text", name, pattern))
        return "\n".join(line for line in (root / name).read_text().splitlines() if pattern in line) or "(none)"

    @function_tool
    def run_python(expression: Annotated[str, Field(max_length=24)]) -> str:
        """Evaluate a Python expression in a sandboxed subprocess (isolated, 5 s timeout)."""
        calls.append(("run_python", expression))
        try:
            out = subprocess.run([sys.executable, "-I", "-c", f"print(eval({expression!r}, {{'__builtins__': {{}}}}))"],
                                 capture_output=True, text=True, timeout=5, cwd=root)
        except subprocess.TimeoutExpired:
            return "timed out"
        return (out.stdout or out.stderr).strip()[-200:]

    return [read_file, search_text, run_python]


def test_agent_loop_every_mode(tmp_path):
    agents = pytest.importorskip("agents", reason="pip install openai-agents")
    from openai import AsyncOpenAI
    from test_serve import LiveServer

    import clover

    (tmp_path / "data.txt").write_text("35\n7\n")
    (tmp_path / "notes.txt").write_text("a clover leaf\nthree lines\nclover again\n")
    agents.set_tracing_disabled(True)
    times: dict[str, list[float]] = {}
    steps: list[list] = []
    with LiveServer(clover.load(), max_batch=4, max_queue=8) as srv:
        client = AsyncOpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0, timeout=300)
        model = agents.OpenAIChatCompletionsModel(model="tiny", openai_client=client)
        for mode in ("ar", "diffusion", "speculative"):
            for task in TASKS:
                calls: list = []
                agent = agents.Agent(
                    name="worker", instructions="Use the tools to answer.", model=model, tools=_tools(tmp_path, calls),
                    model_settings=agents.ModelSettings(temperature=0, tool_choice="required", parallel_tool_calls=False,
                                                        max_tokens=96, extra_body={"mode": mode}),
                    reset_tool_choice=False, tool_use_behavior=agents.StopAtTools(stop_at_tool_names=["run_python"]))
                t0 = time.perf_counter()
                try:
                    agents.Runner.run_sync(agent, task, max_turns=4)
                except agents.exceptions.MaxTurnsExceeded:
                    pass  # a tiny model need not finish; every call it made is still checked below
                times.setdefault(mode, []).append(time.perf_counter() - t0)
                # every model turn was a tool call the SDK parsed and validated, then ran: the run
                # ended at run_python or after its 4 turns, each one a call
                assert calls and (calls[-1][0] == "run_python" or len(calls) == 4), (mode, task, calls)
                steps.append(calls)
    assert any(len(c) >= 2 for c in steps), steps  # multi-step runs
    assert len({c[0] for run in steps for c in run}) >= 2, steps  # more than one tool used
    for mode, ts in times.items():
        print(f"agent loop · {mode}: median {statistics.median(ts):.2f} s per task over {len(ts)} tasks")
