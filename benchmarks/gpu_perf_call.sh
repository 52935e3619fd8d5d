#!/usr/bin/env bash
# One device call for the performance issue: `diffrl bench` rollout / train on a real-size
# SD3.5-Medium (random weights, the NFT recipe with a rule reward), then the continuous-batching
# stream with the rollout's blocks compiled, against the diffusers pipeline in the same process.
# Usage (device machine): bash benchmarks/gpu_perf_call.sh OUTDIR [REQUESTS]
set -uo pipefail
OUT=${1:?outdir}; N=${2:-128}
export PYTHONUNBUFFERED=1
SD35=(recipes/sd35_nft.yaml 'model.path=""' model.preset=sd35-medium run.device=cuda
      'reward.scorers=[{name: jpeg_incompressibility}]')
for kind in rollout train; do
  timeout 200 python3 -c "from diffrl.cli import main; main()" bench $kind "${SD35[@]}" \
    --repeats 2 2>&1 | grep "^bench/" | sed "s/^/$kind /" | tee -a "$OUT/bench.txt"
done
timeout 330 python3 benchmarks/continuous_batching.py --requests "$N" --compile --warm-passes 1 \
  --modes scheduler diffusers --out "$OUT/cb_compiled.jsonl" 2>&1 | grep -v "Warn\|warn\|float32" \
  | tail -5
