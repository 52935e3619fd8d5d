#!/usr/bin/env bash
# One device call for the omni issue: AV base pre-trainings (one per audio loss weight, side by
# side through gpu_pretrain_parallel.sh: each is Python-bound and leaves the GPU mostly idle)
# beside the real-size H3 / LTX-2 benchmark, which runs alone in its own process.
# Usage (device machine): bash benchmarks/gpu_omni_call.sh OUTDIR DEADLINE_S "AUDIO_WEIGHTS" [STEPS]
set -uo pipefail
OUT=${1:?outdir}; DEADLINE=${2:-560}; WEIGHTS=${3:-"10 30"}; STEPS=${4:-3000}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
specs=""
for w in $WEIGHTS; do
  specs+="avbench_h3_aw$w:task=avbench;steps=$STEPS;schedule_steps=$STEPS;batch=256;chunk=128;"
  specs+="warmup=100;eval_samples=4;audio_weight=$w;snapshots=[$((STEPS * 2 / 3)),$((STEPS * 5 / 6))] "
done
bash "$(dirname "$0")/gpu_pretrain_parallel.sh" "$OUT" "$DEADLINE" "$specs" > "$OUT/pretrain.log" 2>&1 &
if [[ -n "${REAL_SIZE:-}" ]]; then
  timeout $((DEADLINE - 10)) python3 benchmarks/real_size_omni.py --presets $REAL_SIZE \
    --out "$OUT/real_size_omni.jsonl" > "$OUT/real_size_omni.log" 2>&1
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv >> "$OUT/real_size_omni.log"
fi
wait
tail -n 3 "$OUT"/*.log
