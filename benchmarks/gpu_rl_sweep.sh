#!/usr/bin/env bash
# NFT hyper-parameter sweep on the default recipe (GPU, 4 runs at a time), to pick defaults
# that climb fastest per RL step. Usage: bash benchmarks/gpu_rl_sweep.sh OUTDIR STEPS
set -uo pipefail
OUTDIR=${1:?outdir}; STEPS=${2:-80}
export PYTHONUNBUFFERED=1
declare -A RUNS=(
  [base_s1]="run.seed=1"
  [t4]="algorithm.timesteps_per_sample=4"
  [t4_lr5]="algorithm.timesteps_per_sample=4 actor.lr=5e-4"
  [kl_lr2]="algorithm.kl_coef=0.01 actor.lr=2e-3"
  [overall]="@benchmarks/recipes/shapes_nft_overall.yaml"
  [z1]="algorithm.adv_clip=1.0"
  [ema5]="algorithm.old_update=ema algorithm.old_ema=0.5"
  [g16p8]="rollout.group_size=16 data.prompts_per_step=8"
)
i=0
for name in "${!RUNS[@]}"; do
  args="${RUNS[$name]}"; recipe=recipes/shapes_nft.yaml
  if [[ $args == @* ]]; then recipe=${args#@}; args=""; fi
  python3 -m diffrl.cli train $recipe $args run.steps=$STEPS \
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
