#!/usr/bin/env bash
# Export the last stage-2 checkpoint as the bundled model and produce every figure the docs quote.
# Usage: scripts/ship-clover-tiny.sh [RUN_DIR]   (default: the last phase's run, $RUNS/clover-tiny-diffusion-tasks-cont)
# Two lanes run side by side, THREADS (default 1) torch threads each: lane 1 is `clover eval` (the
# model card's tables), lane 2 the benchmark figures. On a 2-core machine that beats one lane with 2
# threads (small matrices; OpenMP threads waiting on each other).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${CLOVER_RUNS:-${XDG_CACHE_HOME:-$HOME/.cache}/clover/runs}
RUN=${1:-$RUNS/clover-tiny-diffusion-tasks-cont}
TOKENIZER=${TOKENIZER:-$RUNS/clover-tiny-ar/tokenizer}
OUT=src/clover/assets/clover-tiny
FIG=build/figures
BIN=.venv/bin
mkdir -p "$FIG" docs/img
CKPT=$(ls -d "$RUN"/ckpt/step-* | tail -1)
echo "== export $CKPT -> $OUT"
rm -rf "$OUT"
$BIN/clover train export "$CKPT" "$OUT" --dtype bfloat16 --tokenizer "$TOKENIZER"
du -sh "$OUT"
export OMP_NUM_THREADS=${THREADS:-1}
echo "== eval (lane 1, in the background; log in $FIG/eval.log)"
$BIN/clover eval --model "$OUT" --threads "${THREADS:-1}" --task-prompts "${TASKS:-100}" --code-prompts "${CODE:-16}" \
  --json "$FIG/eval.json" > "$FIG/eval.md" 2> "$FIG/eval.log" &
EVAL_PID=$!
if [ "${SKIP_DECODE:-0}" != 1 ]; then
echo "== bench decode (tasks)"
$BIN/clover bench decode --model "$OUT" --workload tasks --prompts "${BENCH:-24}" --stop-newline -n 32 --threads "${THREADS:-1}" \
  --json "$FIG/decode-tasks.json" | tee "$FIG/decode-tasks.txt"
echo "== bench decode (code)"
$BIN/clover bench decode --model "$OUT" --workload code --prompts "${BENCH_CODE:-8}" -n 64 --threads "${THREADS:-1}" \
  --json "$FIG/decode-code.json" | tee "$FIG/decode-code.txt"
fi
echo "== bench sweep"
$BIN/clover bench sweep --model "$OUT" --workload tasks --prompts "${SMALL:-16}" --stop-newline -n 32 --threads "${THREADS:-1}" \
  --confidences prob,margin,entropy \
  --plot docs/img/sweep-tasks.png --json "$FIG/sweep.json" | tee "$FIG/sweep.txt"
echo "== bench experts"
$BIN/clover bench experts --model "$OUT" --workload tasks --prompts "${SMALL:-16}" --stop-newline -n 32 --threads "${THREADS:-1}" \
  --json "$FIG/experts-tasks.json" | tee "$FIG/experts-tasks.md"
$BIN/clover bench experts --model "$OUT" --workload code --prompts "${SMALL_CODE:-6}" -n 64 --threads "${THREADS:-1}" \
  --json "$FIG/experts-code.json" | tee "$FIG/experts-code.md"
echo "== quantization"
HELDOUT=$($BIN/python -c "from clover.data.corpus import stdlib_files; print(stdlib_files('heldout')[0])")
$BIN/clover bench quant "$OUT" --variants fp32 bf16 int8 int4 int4-g32 --threads "${THREADS:-1}" \
  --text-file "$HELDOUT" | tee "$FIG/quant.md"
echo "== timeline picture"
$BIN/clover generate 'assert sorted([31, 7, 19, 4, 88, 23]) == ' --model "$OUT" --max-new-tokens 32 --timeline docs/img/timeline.png > /dev/null
$BIN/clover generate 'def fibonacci(n):' --model "$OUT" --max-new-tokens 64 --timeline docs/img/timeline-code.png > /dev/null
echo "== waiting for the eval"
wait $EVAL_PID
cat "$FIG/eval.md"
echo "done: figures in $FIG"
