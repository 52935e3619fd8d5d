#!/usr/bin/env bash
# NFT hyper-parameter sweep on the default recipe (GPU, 4 runs at a time), to pick defaults
# that climb fastest per RL step. Usage: bash benchmarks/gpu_rl_sweep.sh OUTDIR STEPS
set -uo pipefail
OUTDIR=${1:?outdir}; STEPS=${2:-80}
export PYTHONUNBUFFERED=1
declare -A RUNS=(
  [base]="actor.lr=1e-3"
  [lr2]="actor.lr=2e-3"
  [lr4]="actor.lr=4e-3"
  [lr2_z1]="actor.lr=2e-3 algorithm.adv_clip=1.0"
  [lr2_t1]="actor.lr=2e-3 algorithm.timesteps_per_sample=1"
  [lr4_z1]="actor.lr=4e-3 algorithm.adv_clip=1.0"
  [lr2_uni]="actor.lr=2e-3 algorithm.weighting=uniform"
  [lr2_o1]="actor.lr=2e-3 algorithm.old_every=1"
)
i=0
for name in "${!RUNS[@]}"; do
  python3 -m diffrl.cli train recipes/shapes_nft.yaml ${RUNS[$name]} run.steps=$STEPS \
    run.device=cuda run.out_dir=/tmp/runs run.name=$name run.tensorboard=false data.eval_samples_per_prompt=4 \
    > /tmp/$name.log 2>&1 &
  i=$((i+1)); if (( i % 4 == 0 )); then wait; fi
done
wait
for name in "${!RUNS[@]}"; do
  python3 - <<PY | tee -a $OUTDIR/rl_sweep.log
import json
rows=[json.loads(l) for l in open('/tmp/runs/$name/metrics.jsonl')]
ev=[(r['step'], round(r['eval/overall'],3)) for r in rows if 'eval/overall' in r]
print('$name', "${RUNS[$name]}", ev)
PY
  tail -c 600 /tmp/$name.log | grep -i error
done
