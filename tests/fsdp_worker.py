"""Run a list of training jobs in one torchrun process group (for tests/test_fsdp.py and the RSS figure).

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/fsdp_worker.py SPEC.json OUT.json

SPEC.json: {"jobs": [{"raw": <recipe dict>, "steps": N | null, "resume": bool | null, "reset_data": bool,
"gather_to": path | null}]}. OUT.json (rank 0): per job, every rank's {"losses", "step", "peak_rss_mb", "grad_norms",
"gain_grad_norms"}; "gather_to" saves the model's full state (gathered from the shards) as safetensors.
"""

from __future__ import annotations

import json
import resource
import sys


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def main(spec_path: str, out_path: str) -> None:
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from clover.train.recipes import recipe_from_dict
    from clover.train.trainer import Trainer

    spec = json.loads(open(spec_path).read())
    results, trainer = [], None
    for job in spec["jobs"]:
        if job.get("no_meta_start"):  # the whole model first, then shards (what a run without init does)
            from clover.train import parallel

            parallel.meta_start_reason = lambda recipe: "forced by the job"
        trainer = Trainer(recipe_from_dict(job["raw"]), resume=job.get("resume"), quiet=True,
                          reset_data=job.get("reset_data", False))
        rss_start = peak_rss_mb()  # after the model is built, loaded and sharded, before any step
        hist = trainer.train(steps=job.get("steps"))
        res = {"losses": [h["loss"] for h in hist], "step": trainer.step, "peak_rss_mb": peak_rss_mb(),
               "grad_norms": [h.get("grad_norm") for h in hist], "meta_start": getattr(trainer, "meta_start", None),
               "peak_rss_start_mb": rss_start, "gain_grad_norms": [h.get("gain_grad_norm") for h in hist]}
        if job.get("gather_to"):
            full = get_model_state_dict(trainer.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if trainer.dist.main:
                save_file({k: v.contiguous() for k, v in full.items()}, job["gather_to"])
        gathered = trainer.dist.gather(res)
        if trainer.dist.main:
            results.append(gathered)
    if trainer is not None:
        if trainer.dist.main:
            with open(out_path, "w") as f:
                json.dump(results, f)
        trainer.dist.barrier()
        trainer.close()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
