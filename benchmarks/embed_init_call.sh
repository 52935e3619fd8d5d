#!/usr/bin/env bash
# One device call: pre-train tiny-DiT bases with a small token-embedding init beside the RL
# proxy runs of benchmarks/sweeps/2026-12-02-colour-binding/embed_init.txt, which start from
# each base as soon as it is written; each base's colour-binding buckets go to
# OUT/logs/binding_<base>.md.
# The first call ran two bases beside the shipped base's runs, every process on all 16 cores:
# the pre-training crawled at 15 steps/s and missed the deadline. So one base now, on 4 threads.
# Usage (device machine): bash benchmarks/embed_init_call.sh OUT DEADLINE_S [SPEC]
set -uo pipefail
OUT=${1:?output dir}; DEADLINE=${2:-540}; SPEC=${3:-benchmarks/sweeps/2026-12-02-colour-binding/embed_init.txt}
mkdir -p /tmp/bases "$OUT/logs"
base() {  # name text_embed_std snapshots
  python3 -m diffrl.cli pretrain steps=9000 "snapshots=$3" text_embed_std="$2" device=cuda threads=4 \
    out=/tmp/bases/$1.safetensors > "$OUT/logs/pretrain_$1.log" 2>&1
  touch /tmp/bases/$1.done
  for f in /tmp/bases/$1*.safetensors; do
    { echo "### $(basename "$f")"; python3 benchmarks/colour_binding.py "$f" --device cuda; } \
      > "$OUT/logs/binding_$(basename "$f" .safetensors).md" 2>&1
  done
  cp /tmp/bases/$1*.safetensors "$OUT/"
}
base e002 0.02 "[7500]" &
bash benchmarks/gpu_runs.sh "$SPEC" "$OUT/log" 8 "$DEADLINE"
wait
grep -h "steps=" "$OUT"/logs/pretrain_*.log | tail -5 >> "$OUT/log"
