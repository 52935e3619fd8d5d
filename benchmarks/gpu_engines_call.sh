#!/usr/bin/env bash
# Device calls for issue 39 ("Engines on their own devices") on one H200:
#   bash benchmarks/gpu_engines_call.sh OUT colocated ALGO STEPS   # benchmarks/colocated_ipc.py
#   bash benchmarks/gpu_engines_call.sh OUT midsync STALENESS STEPS  # benchmarks/async_midsync.py
# The image has no Ray: a cp312 Ray 2.60 wheel without its Java jars and libraries diffrl does
# not use (rllib, data, serve, tune, train, llm), with jsonschema's wheels, travels in .whl/
# beside diffusers (carry: [".whl"]). Rows in OUT/*.jsonl, logs in OUT/*.log.
set -uo pipefail
OUT=${1:?outdir}; WHAT=${2:?colocated|midsync}; ARG=${3:-nft}; STEPS=${4:-4}
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case $WHAT in
  colocated)
    timeout ${LIMIT:-540} python3 benchmarks/colocated_ipc.py --algo "$ARG" --steps "$STEPS" \
      > "$OUT/colocated_$ARG.log" 2>&1
    grep '^{' "$OUT/colocated_$ARG.log" | tee -a "$OUT/colocated.jsonl"
    tail -5 "$OUT/colocated_$ARG.log" ;;
  midsync)
    timeout ${LIMIT:-540} python3 benchmarks/async_midsync.py --steps "$STEPS" \
      --staleness "$ARG" --out "$OUT/midsync" > "$OUT/midsync_$ARG.log" 2>&1
    grep '^{' "$OUT/midsync_$ARG.log" | tee -a "$OUT/midsync.jsonl"
    tail -5 "$OUT/midsync_$ARG.log" ;;
esac
