#!/usr/bin/env bash
# One device call: several `diffrl pretrain` runs side by side, one process each (the AV base's
# pre-training is Python-bound and leaves the GPU mostly idle), each stopped at the deadline.
# Every snapshot is saved and scored (held-out metrics in the file's metadata), so a run the
# deadline cuts short still leaves its last snapshot; OUTDIR/00_scores.jsonl gathers every
# snapshot's metadata.
# Usage (device machine): bash benchmarks/gpu_pretrain_parallel.sh OUTDIR DEADLINE_S "NAME:k=v;k=v ..."
# e.g. "cont:init=builtin:avbench_h3;lr=5e-4;snapshots=[1000,2000] aw3:init=builtin:avbench_h3;audio_weight=3"
set -uo pipefail
OUT=${1:?outdir}; DEADLINE=${2:-540}; SPECS=${3:?specs}
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
for spec in $SPECS; do
  name=${spec%%:*}; IFS=';' read -r -a over <<< "${spec#*:}"
  timeout "$DEADLINE" python3 -c "from diffrl.cli import main; main()" pretrain device=cuda \
    "${over[@]}" out="$OUT/$name.safetensors" 2>&1 | tr '\r' '\n' | awk 'NR % 25 == 1 || !/it\/s/' \
    > "$OUT/$name.log" &
done
wait
# every snapshot's held-out scores from its metadata, in one file that sorts first: the device
# returns a limited number of files, and the score lines share a line with tqdm's in the logs
python3 - "$OUT" <<'PY'
import json, pathlib, sys
from safetensors import safe_open
out = pathlib.Path(sys.argv[1])
with open(out / "00_scores.jsonl", "w") as f:
    for path in sorted(out.glob("*.safetensors")):
        with safe_open(str(path), "pt") as st:
            f.write(json.dumps({"file": path.name, **st.metadata()}) + "\n")
PY
cat "$OUT/00_scores.jsonl"
