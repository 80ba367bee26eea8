"""SDAR's reference generate against clover on the same random SDAR checkpoint: same tokens, tokens/s.

    PYTHONPATH=src python scripts/sdar-bench.py PATH/TO/SDAR [--hidden 256 --layers 4 --vocab 4096]

Run it where the reference runs (scripts/sdar-golden.py: transformers 4.52.x, its shims), with this
repository's src on the path; clover needs nothing of transformers for this. One process, one thread,
interleaved repeats: per repeat the reference's `block_diffusion_generate` (greedy, its shims) on each
prompt in turn (it decodes one prompt at a time), then clover's `generate` on the same prompts, alone
(batch 1) and all together (batch 8). The tokens must be identical; the report is the median time of
each and the ratio.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent


def _golden_module():
    spec = importlib.util.spec_from_file_location("sdar_golden", HERE / "sdar-golden.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("checkout", type=Path, help="a checkout of github.com/JetAstra/SDAR")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--block", type=int, default=4)
    ap.add_argument("--gen", type=int, default=64, help="tokens per answer (the reference runs to its block grid's end)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--pack", choices=("auto", "on", "rows", "off"), default="auto",
                    help="clover.load's pack: oneDNN weight copies for forwards of several positions (auto: its default)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = _golden_module()
    work = Path(tempfile.mkdtemp(prefix="sdar-bench-"))
    modeling, generate = g.load_reference(args.checkout, work)
    heads = max(2, args.hidden // 64)
    g.TINY.update(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                  num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                  head_dim=64, mask_token_id=args.vocab - 1, block_size=args.block)
    ckpt = work / "checkpoint"
    ref = g.tiny_checkpoint(args.checkout, modeling, ckpt)
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(args.vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(ckpt / "tokenizer.json"))
    import clover

    llm = clover.load(ckpt, pack={"auto": None, "on": True, "rows": "rows", "off": False}[args.pack])
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, args.vocab - 1, (int(n),), generator=gen).tolist()
               for n in torch.randint(9, 40, (args.batch,), generator=gen)]
    B = args.block
    lengths = [-(-(len(p) + args.gen) // B) * B - len(p) for p in prompts]  # the reference's output lengths

    def reference(p, n):
        x = generate.block_diffusion_generate(ref, {"input_ids": torch.tensor([p])}, mask_id=args.vocab - 1,
                                              gen_length=args.gen, block_length=B, denoising_steps=B,
                                              remasking_strategy="low_confidence_dynamic", confidence_threshold=0.9)
        return x[0, len(p):].tolist()

    def ours(ps, ns):
        from clover.decoding.modes import resolve_params

        m = llm.mode(None)
        rows = []
        for p, n in zip(ps, ns):
            params = resolve_params(m, dict(max_new_tokens=n, block_size=B, ignore_eos=True), llm.config)
            rows.append(llm.row(p, params, None))
        for _ in llm._events(rows, m.spec(params)):
            pass
        return [list(r.tokens) for r in rows]

    times = {"reference": [], "clover b1": [], "clover b8": []}
    want = None
    with torch.no_grad():
        for rep in range(args.repeats + 1):  # the first is a warm-up
            t = time.perf_counter()
            got_ref = [reference(p, n) for p, n in zip(prompts, lengths)]
            t_ref = time.perf_counter() - t
            t = time.perf_counter()
            got_b1 = [ours([p], [n])[0] for p, n in zip(prompts, lengths)]
            t_b1 = time.perf_counter() - t
            t = time.perf_counter()
            got_b8 = ours(prompts, lengths)
            t_b8 = time.perf_counter() - t
            want = want or got_ref
            same = got_ref == want and got_b1 == want and got_b8 == want
            if not same:
                sys.exit(f"repeat {rep}: the tokens differ (reference vs clover alone {got_b1 == got_ref}, batched {got_b8 == got_ref})")
            if rep:
                times["reference"].append(t_ref)
                times["clover b1"].append(t_b1)
                times["clover b8"].append(t_b8)
    tokens = sum(lengths)
    med = {k: statistics.median(v) for k, v in times.items()}
    out = {"load": os.getloadavg()[0], "threads": torch.get_num_threads(), "tokens": tokens, "prompts": len(prompts),
           "model": dict(hidden=args.hidden, layers=args.layers, vocab=args.vocab, block=B), "pack": args.pack,
           **{f"{k} tok/s": round(tokens / v, 1) for k, v in med.items()},
           "clover b1 / reference": round(med["reference"] / med["clover b1"], 2),
           "clover b8 / reference": round(med["reference"] / med["clover b8"], 2)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
