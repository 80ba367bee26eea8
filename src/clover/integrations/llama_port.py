"""Drive `llama-clover`, the llama.cpp/ggml port of Clover's decoding (ports/llama.cpp,
docs/llama-port.md), from Python.

The port is a separate program built by `PORT=1 scripts/build-llama-cpp.sh` into the llama.cpp cache
dir. It reads a GGUF export (`clover export-gguf`, plus its `.clover.gguf` sidecar) and prompts as
token ids, one per line, and prints one JSON line per prompt: the generated ids and the statistics
(forwards, tokens per forward, seconds). Tokenization stays on the Python side, so inputs are exactly
clover's.

Only what the port implements is passed through: greedy decoding; the `threshold`, `entropy` and
`factor` acceptance rules with the `prob` confidence; EOS, ignore_eos, stop token ids and the length
limit. `port_args` raises ValueError naming any other option that is set.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np

from ..decoding.base import trim_at_stop

MODES = ("ar", "diffusion", "speculative")
POLICIES = ("threshold", "entropy", "factor")


def llama_cache_dir() -> Path:
    """The cache dir of scripts/build-llama-cpp.sh."""
    env = os.environ.get("CLOVER_LLAMA_CPP_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "clover" / "llama.cpp"


def port_binary() -> Path:
    return llama_cache_dir() / "bin" / "llama-clover"


def require_port() -> Path:
    b = port_binary()
    if not b.exists():
        raise FileNotFoundError(f"llama-clover not built ({b} not found): run PORT=1 scripts/build-llama-cpp.sh")
    return b


def port_args(mode: str, params) -> list[str]:
    """`SamplingParams` (with the model's defaults filled in, `LLM.params`) -> llama-clover flags."""
    if mode not in MODES:
        raise ValueError(f"mode: the llama.cpp port runs {', '.join(MODES)}, got {mode!r}")
    unsupported = {
        "temperature": params.temperature != 0.0,
        "repetition_penalty": params.repetition_penalty != 1.0,
        "presence_penalty": bool(params.presence_penalty),
        "eos_penalty": bool(params.eos_penalty),
        "no_repeat_ngram_size": bool(params.no_repeat_ngram_size),
        "sub_block": params.sub_block is not None and params.sub_block < (params.block_size or 0),
        "expert_budget": params.expert_budget is not None,
        "confidence": params.confidence != "prob",
        "policy": mode == "diffusion" and params.policy not in POLICIES,
    }
    bad = [k for k, v in unsupported.items() if v]
    if bad:
        raise ValueError(f"{bad[0]}: not supported by the llama.cpp port (greedy; policies {', '.join(POLICIES)}; "
                         "no penalties, sub-blocks or expert budget)")
    a = ["--mode", mode, "-n", str(params.max_new_tokens)]
    if params.ignore_eos:
        a.append("--ignore-eos")
    if params.stop_token_ids:
        a += ["--stop-ids", ",".join(map(str, params.stop_token_ids))]
    for s in params.stop or ():
        a += ["--stop", s]
    if mode in ("diffusion", "speculative") and params.block_size:
        a += ["--block", str(params.block_size)]
    if mode == "speculative" and params.draft_length:
        a += ["--draft", str(params.draft_length)]
    if mode == "diffusion":
        a += ["--policy", params.policy, "--threshold", repr(float(params.threshold)),
              "--entropy-budget", repr(float(params.entropy_budget)), "--factor", repr(float(params.factor)),
              "--fallback", params.fallback]
    return a


def run(gguf: str | os.PathLike, prompts: list[list[int]], args: list[str], *, eos_ids=None, threads: int = 1,
        binary: str | os.PathLike | None = None, timeout: float | None = None) -> list[dict]:
    """Run llama-clover on `prompts` (token ids) with flags `args` (`port_args`); one dict per prompt:
    tokens, n_tokens, forwards, tokens_per_forward, seconds, tokens_per_second, finish, block_steps,
    forced_steps, accept_lengths. `eos_ids` overrides the GGUF's EOS id."""
    cmd = [str(binary or require_port()), str(gguf), *args, "--threads", str(threads)]
    if eos_ids:
        cmd += ["--eos", ",".join(map(str, eos_ids))]
    stdin = "".join(" ".join(map(str, p)) + "\n" for p in prompts)
    r = subprocess.run(cmd, input=stdin.encode(), capture_output=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"llama-clover failed ({r.returncode}): {r.stderr.decode()[-2000:]}")
    out = [json.loads(line) for line in r.stdout.decode().splitlines() if line.strip()]
    if len(out) != len(prompts):
        raise RuntimeError(f"llama-clover answered {len(out)} of {len(prompts)} prompts")
    return out


def forward_logits(gguf: str | os.PathLike, commit: list[int], block: list[int], out: str | os.PathLike, *,
                   threads: int = 1, binary: str | os.PathLike | None = None) -> np.ndarray:
    """One port forward from an empty cache: `commit` committed, `block` denoised. Returns f32 logits
    [len(commit) + len(block), V]: every commit position, then every block position."""
    cmd = [str(binary or require_port()), str(gguf), "--mode", "forward", "--out", str(out), "--threads", str(threads)]
    stdin = " ".join(map(str, commit)) + "\n" + " ".join(map(str, block)) + "\n"
    r = subprocess.run(cmd, input=stdin.encode(), capture_output=True)
    if r.returncode != 0:
        raise RuntimeError(f"llama-clover failed ({r.returncode}): {r.stderr.decode()[-2000:]}")
    info = json.loads(r.stdout.decode())
    return np.fromfile(out, dtype=np.float32).reshape(info["rows"], info["vocab"])


def generate(llm, prompt, mode, kwargs: dict, *, gguf: str | os.PathLike | None = None, threads: int = 1) -> dict:
    """One prompt through the port with the options of `clover generate` (`kwargs`, the model's
    defaults filled in as `LLM.generate` does). Without `gguf` the model is exported (f32) to a
    temporary file first. Returns {text, token_ids, finish_reason, stats}."""
    import tempfile

    mode = llm.mode(mode)
    params = llm.params(mode, kwargs)
    ids = llm.encode_prompt(prompt)
    llm.check_length(len(ids), params, mode)
    args = port_args(mode.name, params)
    eos = llm.eos_ids()
    with tempfile.TemporaryDirectory() as tmp:
        if gguf is None:
            from ..export.gguf import export_gguf

            gguf = Path(tmp) / "model.gguf"
            export_gguf(llm.path, gguf, dtype="f32", progress=False)
        r = run(gguf, [ids], args, eos_ids=sorted(eos), threads=threads)[0]
    stats = {k: r[k] for k in ("forwards", "tokens_per_forward", "seconds", "tokens_per_second", "block_steps",
                               "forced_steps", "accept_lengths")}
    stats.update(prompt_tokens=len(ids), tokens=r["n_tokens"])
    text = llm.tokenizer.decode(r["tokens"])
    if r["finish"] == "stop":
        text = trim_at_stop(text, params.stop)
    return {"text": text, "token_ids": r["tokens"], "finish_reason": r["finish"], "stats": stats}
