#!/usr/bin/env bash
# One device call for issue 40's recipes: random-weight CLAP + ImageBind written to local paths
# (benchmarks/random_av_rewards.py), then each recipe for 2 steps end to end on one H200 with
# that reward, eager (compile fails on the GPU image), a one-clip held-out eval of 2 ODE steps
# and no start-up probe (PROBE=on keeps it: its parity run costs an encode and ~1 minute):
#   bash benchmarks/gpu_h3_recipes_call.sh OUT [DEADLINE_S] [RECIPES]
#     RECIPES: any of h3_t2va_nft h3_fl2va_nft ltx2_t2va_nft (default "h3_t2va_nft"). By the
#     recipes' arithmetic one H3 recipe takes ~400 s of a call (build ~45 s, the 49 s encoder
#     round trip at the first eval and at each step, ~90 s of rollout and update a step), so
#     the two H3 recipes go in two calls until the encoder's visit is made fast; a recipe whose
#     turn comes with under 150 s of DEADLINE_S left is skipped, saying so.
#   Logs in OUT/<recipe>.log, GPU memory samples in OUT/<recipe>.mem, run directories (metrics,
#   config, samples; checkpoints removed, GBs) under OUT/runs; the end prints each run's rows.
# EXTRA="k=v ..." adds overrides to every run (e.g. a smaller step to fit a call).
# TINY=1 runs the same command lines on the CPU at tiny size (h3-avbench / ltx2-tiny, tiny
# reward weights): tests/controller/test_h3_recipes.py's check of this script's first stage,
# and a manual check of the whole (~1 minute a recipe on 2 cores).
set -uo pipefail
OUT=${1:?outdir}; DEADLINE=${2:-560}; RECIPES=${3:-h3_t2va_nft}
source "$(dirname "$0")/gpu_common.sh"
# gpu_common's DIFFRL drops main()'s exit status; this call reports it
DIFFRL=(python3 -c "import sys; from diffrl.cli import main; sys.exit(main())")
for recipe in $RECIPES; do  # refused before any work
  [[ $recipe =~ ^(h3_t2va_nft|h3_fl2va_nft|ltx2_t2va_nft)$ ]] \
    || { echo "unknown recipe $recipe (h3_t2va_nft | h3_fl2va_nft | ltx2_t2va_nft)"; exit 2; }
done
export PYTHONPATH=/tmp/site:$PWD
if ! python3 -c "import diffusers" 2>/dev/null; then  # the GPU image has none: the carried wheel
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
fi
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

# the reward weights stay off OUT (GBs at real size): only the logs and metrics come back
REWARD_DIR=/tmp/av_rewards${TINY:+_tiny}
EVAL=(data.eval_prompts=1 data.eval_samples_per_prompt=1 rollout.eval_num_steps=2)
COMMON=(run.steps=2 rollout.compile=false actor.compile=false run.resume=false
        "probe.mode=${PROBE:-off}" "${EVAL[@]}")
if [[ -n "${TINY:-}" ]]; then
  TINY_ALL=(model.dtype=float32 run.device=cpu data.prompts_per_step=2 rollout.group_size=2
            rollout.num_steps=2 run.tensorboard=false)
  SIZE_h3=(model.preset=h3-avbench model.weights=builtin:avbench_h3 model.height=0 model.width=0
           model.frames=0 "${TINY_ALL[@]}")
  SIZE_ltx2=(model.preset=ltx2-tiny model.frames=11 "${TINY_ALL[@]}")
else
  SIZE_h3=(); SIZE_ltx2=()
fi
REWARDS=$(python3 benchmarks/random_av_rewards.py "$REWARD_DIR" ${TINY:+--tiny} \
  2> "$OUT/rewards.log" | tee -a "$OUT/rewards.log" | tail -n 1)
if [[ $REWARDS != reward.scorers=* ]]; then
  echo "random_av_rewards failed:"; tail -n 5 "$OUT/rewards.log"; exit 1
fi
head -n 1 "$OUT/rewards.log"

for recipe in $RECIPES; do
  if [[ $recipe == h3_* ]]; then size=("${SIZE_h3[@]}"); else size=("${SIZE_ltx2[@]}"); fi
  left=$((DEADLINE - SECONDS - 5))
  if (( left < 150 )); then echo "$recipe: skipped, ${left}s of the deadline left"; continue; fi
  mem=""
  if command -v nvidia-smi > /dev/null; then  # the GPU's memory in use, twice a second
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$OUT/$recipe.mem" &
    mem=$!
  fi
  t0=$SECONDS
  timeout "$left" "${DIFFRL[@]}" train "recipes/$recipe.yaml" "${COMMON[@]}" "${size[@]}" \
    "run.out_dir=$OUT/runs" "$REWARDS" ${EXTRA:-} > "$OUT/$recipe.log" 2>&1
  rc=$?
  [[ -n $mem ]] && kill "$mem"
  echo "$recipe: exit $rc after $((SECONDS - t0)) s"  # 124: the deadline
  (( rc )) && grep -v "Warning\|warn(" "$OUT/$recipe.log" | tail -n 6
  rm -rf "$OUT/runs/$recipe/checkpoints"
done

# each run's rows: step, reward (joint and per scorer), seconds, memory
python3 - "$OUT" $RECIPES <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
keys = ("reward/mean", "reward/clap/mean", "reward/imagebind/mean", "actor/loss", "eval/overall",
        "perf/wall_s", "perf/score_wait_s", "perf/samples_per_s", "perf/host_peak_gb",
        "perf/tensor_gib_max", "time")
for recipe in sys.argv[2:]:
    path = out / "runs" / recipe / "metrics.jsonl"
    mem = out / f"{recipe}.mem"
    used = mem.read_text().split() if mem.exists() else []
    peak = max((int(x) for x in used if x.isdigit()), default=0)
    held = [l.strip() for l in (out / f"{recipe}.log").read_text().splitlines()
            if "held after the first update" in l] if (out / f"{recipe}.log").exists() else []
    print(f"{recipe}: gpu_peak_used_gib {peak / 1024:.1f}; {held[-1] if held else 'no update'}")
    for line in path.read_text().splitlines() if path.exists() else []:
        row = json.loads(line)
        print(json.dumps({"step": row["step"], **{k: round(row[k], 4) for k in keys if k in row}}))
PY
echo "done in ${SECONDS}s"
