#!/usr/bin/env bash
# Device calls for issue 39 ("Engines on their own devices") on one H200:
#   bash benchmarks/gpu_engines_call.sh OUT colocated ALGO STEPS   # benchmarks/colocated_mp.py
#   bash benchmarks/gpu_engines_call.sh OUT midsync STALENESS STEPS  # benchmarks/async_midsync.py
# Arguments after the fourth go to the script (e.g. --set key=value ...).
# The image has no Ray, and a stripped Ray wheel (42 MB) with the working tree passes the
# 64 MiB carry limit, so the colocated measurement is benchmarks/colocated_mp.py (two processes
# by torch.multiprocessing, weights over sync/transport.py's CUDA IPC path), not the Ray backend.
# Rows in OUT/*.jsonl, logs in OUT/*.log.
set -uo pipefail
OUT=${1:?outdir}; WHAT=${2:?colocated|midsync}; ARG=${3:-nft}; STEPS=${4:-4}; shift 4; EXTRA=("$@")
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
case $WHAT in
  colocated)
    timeout ${LIMIT:-540} python3 benchmarks/colocated_mp.py --algo "$ARG" --epochs "$STEPS" "${EXTRA[@]}" \
      > "$OUT/colocated_$ARG.log" 2>&1
    grep '^{' "$OUT/colocated_$ARG.log" | tee -a "$OUT/colocated.jsonl"
    tail -5 "$OUT/colocated_$ARG.log" ;;
  midsync)
    timeout ${LIMIT:-540} python3 benchmarks/async_midsync.py --steps "$STEPS" \
      --staleness "$ARG" --out "$OUT/midsync" "${EXTRA[@]}" > "$OUT/midsync_$ARG.log" 2>&1
    grep '^{' "$OUT/midsync_$ARG.log" | tee -a "$OUT/midsync.jsonl"
    tail -5 "$OUT/midsync_$ARG.log" ;;
esac
