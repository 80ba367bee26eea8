"""A released family's own reference code (SDAR's `block_diffusion_generate`, LLaDA2's and Fast-dLLM v2's
`generate`) on the same weights and prompts, in another interpreter: the rows that show clover gives its
authors' tokens and how much faster. Their code cannot be committed here, so the row reads the user's checkout (`--reference
DIR`, else the family's environment variable) and runs it in `--reference-python` (else
$CLOVER_REFERENCE_PYTHON, else this interpreter), one with the transformers it was written for; without a
checkout it is skipped with a note saying so.

The family's file (`sdar_reference.py`, `llada2_reference.py`, `fastdllm2_reference.py`: its shims, loader
and decode, nothing of clover) is loaded by path in a worker process (`base.WorkerRunner`), one per thread
count. Each row decodes one prompt at a time (SDAR's and LLaDA2's have no batching): its batch rows are the
batch's prompts in turn. A family whose code batches (its file has `decode_batch`: Fast-dLLM v2's `generate`
takes prompts of one length, in lockstep, no padding) adds the variant `reference-lockstep` when the batch's
prompts have one length, on the same worker: its own batch, one call. The options are the checkpoint's defaults, as clover's `diffusion` rows use them (block
size, steps = the block, threshold, mask, sub-block), greedy, no stop; its tokens are compared with clover `diffusion`'s."""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path

from .base import Engine, Runner, WorkerRunner, interpreter_with

HERE = Path(__file__).resolve().parent

WORKER = r"""
import importlib.util, json, sys, tempfile, time
from pathlib import Path
import torch
family_file, checkout, model_dir, threads = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(threads)
spec = importlib.util.spec_from_file_location("clover_reference", family_file)
ref = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ref)
handle = ref.load(checkout, model_dir, Path(tempfile.mkdtemp(prefix="clover-reference-")))
MARK = "CLOVER_PEERS "
print(MARK + json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    t0, c0 = time.perf_counter(), time.process_time()
    with torch.no_grad():
        if req.get("lockstep"):
            outs = ref.decode_batch(handle, req["prompts"], req["n"], **req["options"])
        else:
            outs = [ref.decode(handle, ids, req["n"], **req["options"]) for ids in req["prompts"]]
    print(MARK + json.dumps({"seconds": time.perf_counter() - t0, "cpu_seconds": time.process_time() - c0,
                             "token_ids": outs}), flush=True)
"""

VERSIONS = "import sys, torch, transformers; sys.stdout.write(transformers.__version__)"


class ReferenceRunner(WorkerRunner):
    variant = "reference"
    batches = True  # one prompt at a time: the batch's prompts in turn
    compare = "diffusion"

    def __init__(self, engine: str, cmd: list[str], n: int, options: dict) -> None:
        self.engine, self.what, self.n, self.options = engine, f"{engine} worker", n, options
        self.start(cmd, dict(os.environ))

    def _ask(self, prompts, n=None, **extra):
        r = self.ask({"prompts": prompts, "n": n or self.n, "options": self.options, **extra})
        self.cpu_seconds = r.get("cpu_seconds")
        return r

    def warm(self, ids):
        self._ask([ids], min(self.n, 2 * self.options["block"]))

    def one(self, ids):
        r = self._ask([ids])
        out = r["token_ids"][0]
        return out, len(out), r["seconds"]

    def many(self, prompts):
        r = self._ask(prompts)
        return sum(len(t) for t in r["token_ids"]), r["seconds"], r["token_ids"]


class LockstepRunner(Runner):
    """The family's own batch (`decode_batch`) on its in-turn runner's worker: the batch in one call."""

    variant = "reference-lockstep"
    single = False
    batches = True
    compare = "diffusion"

    def __init__(self, worker: ReferenceRunner) -> None:
        self.worker, self.engine = worker, worker.engine

    def _ask(self, prompts, n=None):
        r = self.worker._ask(prompts, n, lockstep=True)
        self.cpu_seconds = self.worker.cpu_seconds
        return r

    def warm(self, ids):
        self._ask(self.worker.batch, min(self.worker.n, 2 * self.worker.options["block"]))

    many = ReferenceRunner.many  # the same reply: (tokens, seconds, each row's ids)


class ReferenceEngine(Engine):
    """One family's reference; its row in `REFERENCES` names the family (`model_types`), its code's file
    here, the environment variable of its checkout and what that checkout is."""

    fails = "failed to start"
    causal = False
    model_types: tuple[str, ...] = ()
    family_file = ""
    env = ""
    checkout = ""

    @classmethod
    def find(cls, config, *, dtype, reference=None, reference_python=None, **_) -> dict:
        if config.model_type not in cls.model_types:
            return {"available": False, "note": f"not this model's family ({config.model_type})"}
        where = reference or os.environ.get(cls.env)
        if not where:
            return {"available": False, "note": f"no reference checkout: pass --reference DIR or set {cls.env} to "
                                                f"{cls.checkout} (its code cannot ship with clover)"}
        why = _family(cls.family_file).check_checkout(Path(where))
        if why:
            return {"available": False, "note": why}
        if dtype != "float32":
            return {"available": False, "note": f"the reference runs here in float32 only; this run is {dtype}"}
        python = reference_python or os.environ.get("CLOVER_REFERENCE_PYTHON") or sys.executable
        found = interpreter_with(python, VERSIONS, module="transformers", missing="torch and transformers not importable")
        if found["available"]:
            own = ("; its own batch, prompts of one length: variant reference-lockstep"
                   if hasattr(_family(cls.family_file), "decode_batch") else "")
            found.update(version=f"transformers {found['version']}", checkout=str(Path(where).resolve()),
                         note=f"decodes one prompt at a time (its batch rows: the batch's prompts in turn){own}")
        return found

    def runners(self, threads):
        st = self.setup
        c = st.config
        options = {"block": c.block_size, "steps": c.block_size, "threshold": c.threshold, "mask_id": c.mask_token_id}
        if c.sub_block:  # Fast-dLLM v2's sub-blocks
            options["sub_block"] = c.sub_block
        st.say(f"{self.name}: starting ({threads} threads)")
        cmd = [self.found["python"], "-c", WORKER, str(HERE / self.family_file), self.found["checkout"],
               str(st.src.resolve()), str(threads)]
        runner = ReferenceRunner(self.name, cmd, st.max_new_tokens, options)
        if not hasattr(_family(self.family_file), "decode_batch") or not st.batch_rounds or len(st.batch_ids) < 2:
            return [runner]
        if len({len(p) for p in st.batch_ids}) > 1:
            msg = "its own batch (reference-lockstep) takes prompts of one length: not run on these"
            if msg not in (self.found.get("note") or ""):
                self.found["note"] = "; ".join(x for x in (self.found.get("note"), msg) if x)
            return [runner]
        runner.batch = st.batch_ids
        return [runner, LockstepRunner(runner)]


@functools.cache
def _family(file: str):
    """The family's reference file as a module (it imports torch and the standard library only), loaded
    once: `find` and `runners` both ask it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"clover_reference_{Path(file).stem}", HERE / file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _reference(name: str, model_types: tuple[str, ...], family_file: str, env: str, checkout: str) -> type:
    return type(name.title().replace("-", ""), (ReferenceEngine,),
                dict(name=name, model_types=model_types, family_file=family_file, env=env, checkout=checkout))


# one row per family: its name, model_types, code file here, checkout variable and what that checkout is
REFERENCES = tuple(_reference(*row) for row in (
    ("sdar-reference", ("sdar",), "sdar_reference.py", "CLOVER_SDAR_REFERENCE", "a clone of github.com/JetAstra/SDAR"),
    ("llada2-reference", ("llada2_moe",), "llada2_reference.py", "CLOVER_LLADA2_REFERENCE",
     "a directory holding LLaDA2's modeling_llada2_moe.py and configuration_llada2_moe.py"),
    ("fastdllm2-reference", ("Fast_dLLM_Qwen",), "fastdllm2_reference.py", "CLOVER_FASTDLLM2_REFERENCE",
     "a directory holding Fast-dLLM v2's modeling.py and configuration.py"),
))
