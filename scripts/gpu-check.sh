#!/usr/bin/env bash
# The prepared check for a lent CUDA machine (one short run, ~7 minutes on an H100; estimates, not
# measurements: no GPU has run this script yet):
#   1. the GPU-only tests (tests/test_cuda.py): GDN kernels vs the naive reference, the bundled
#      model's logits and greedy AR / diffusion / speculative decoding on CUDA vs the CPU, training
#      steps on CUDA whose checkpoint resumes on the CPU (cut at 300 s);
#   2. the decode benchmark of the bundled model on CUDA (tasks, every mode, bf16 and fp32; each cut
#      at 120 s); steps 1 and 2: ~5 min together (this script's estimate before step 3, on an H200);
#   3. the released families at their checkpoints' full shapes, random weights drawn on the GPU
#      (`clover bench released`, docs/kernels.md): the memory plans of SDAR-30B-A3B and LLaDA2.0-flash
#      (~5 s, on meta); then SDAR-1.7B-Chat and Fast_dLLM_v2_1.5B (~15 s each: ~40-60 forwards a row
#      at ~10-15 ms, launch-bound) and LLaDA2.0-mini (16B: ~80 s; on CUDA its routed experts run
#      through the host loop, ~20-60 touched a layer at ~8 launches each: ~0.05-0.1 s a forward),
#      each: the memory plan beside the CUDA peak, 32 tokens a row in bf16 for each of 8 rows alone and
#      the 8 batched (tokens/s), then rebuilt in float32 (65 GB for LLaDA2.0-mini) for batched == alone
#      and cached == naive at 16 tokens; ~2 min with the start (cut at 240 s; the JSON is rewritten
#      after every phase, so a cut run keeps what it measured).          $OUT/released.{json,txt}
# Everything lands in $OUT (the device tool's folder) or ./gpu-check.
#
# The machine's image has torch, transformers, tokenizers, safetensors, pytest, matplotlib, rich and
# tqdm but not flash-linear-attention; to test the fla path, fetch its wheels here first
# (`python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl
#  flash-linear-attention fla-core`, with .whl listed in .git/info/exclude) and carry `.whl`: they
# are installed below when present. Without them the torch kernels run on CUDA.
set -uo pipefail
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
    python3 -c "import fla; print('fla', getattr(fla, '__version__', '?'))" 2>/dev/null || echo "fla: not installed (torch kernels on CUDA)"
} 2>&1 | tee "$OUT/env.txt"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1 | tee "$OUT/pytest.txt"
rc=${PIPESTATUS[0]}
for dtype in bfloat16 float32; do
    timeout 120 python3 -m clover bench decode --device cuda --dtype "$dtype" --workload tasks --prompts 16 \
        --stop-newline -n 32 --json "$OUT/decode-$dtype.json" 2>&1 | tail -n 20 | tee "$OUT/bench-$dtype.txt"
done
timeout 240 python3 -m clover bench released -n 32 --json "$OUT/released.json" 2>&1 | tee "$OUT/released.txt"
released=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] && rc=$released
exit "$rc"
