#!/usr/bin/env bash
# Run many short `diffrl train` jobs side by side on one GPU and print each one's held-out
# accuracy curve. Each line of SPEC is `name recipe [key=value ...]`; `#` lines are skipped.
# A line may start with `after=FILE` to wait until FILE exists (at most until a minute before
# DEADLINE_S), e.g. a marker that a `diffrl pretrain` started beside it touches when done.
# Usage (device machine): bash benchmarks/gpu_runs.sh SPEC OUTLOG [PARALLEL] [DEADLINE_S]
set -uo pipefail
SPEC=${1:?spec file}; LOG=${2:?output log}; PAR=${3:-6}; DEADLINE=${4:-540}
export PYTHONUNBUFFERED=1
RUNS=/tmp/runs; mkdir -p $RUNS
start=$(date +%s)

launch() {  # name recipe overrides...
  local name=$1 recipe=$2; shift 2
  timeout $((DEADLINE - ($(date +%s) - start))) python3 -m diffrl.cli train "$recipe" "$@" \
    run.device=${DEVICE:-cuda} run.threads=1 run.out_dir=$RUNS run.name="$name" run.tensorboard=false \
    run.max_minutes=0 > $RUNS/$name.log 2>&1
}

names=()
echo "start $(date +%T)" >> "$LOG"
while read -r first rest; do
  [[ -z "$first" || "$first" == \#* ]] && continue
  if [[ "$first" == after=* ]]; then
    f=${first#after=}; read -r first rest <<< "$rest"
    while [[ ! -f "$f" ]] && (( $(date +%s) - start < DEADLINE - 60 )); do sleep 5; done
  fi
  while (( $(jobs -rp | wc -l) >= PAR )); do sleep 2; done
  # shellcheck disable=SC2086
  launch $first $rest &
  names+=("$first")
done < "$SPEC"
wait
echo "runs done $(date +%T)" >> "$LOG"

for name in "${names[@]}"; do
  python3 - "$RUNS/$name" "$name" <<'PY' | tee -a "$LOG"
import sys
from diffrl.controller.run_dir import read_metrics
rows, name = read_metrics(sys.argv[1]), sys.argv[2]
ev = [(r["step"], round(r["eval/overall"], 3)) for r in rows if "eval/overall" in r]
wall = max((r.get("perf/wall_s", 0) for r in rows), default=0)
print(name, ev, f"wall {wall:.0f}s")
live = [(r["step"], round(r["eval_live/overall"], 3)) for r in rows if "eval_live/overall" in r]
if live:  # run.eval_live with an EMA: the live weights' curve too
    print(name + ":live", live, f"wall {wall:.0f}s")
PY
  grep -iE "error|Traceback" "$RUNS/$name.log" | tail -2 | tee -a "$LOG"
done
