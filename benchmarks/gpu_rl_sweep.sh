#!/usr/bin/env bash
# NFT hyper-parameter sweep on the default recipe (GPU, 4 runs at a time), to pick defaults
# that climb fastest per RL step. Usage: bash benchmarks/gpu_rl_sweep.sh OUTDIR STEPS
set -uo pipefail
OUTDIR=${1:?outdir}; STEPS=${2:-80}
export PYTHONUNBUFFERED=1
declare -A RUNS=(
  [p8]="data.prompts_per_step=8 run.steps=160"
  [p8_ema]="data.prompts_per_step=8 run.steps=160 algorithm.old_update=ema algorithm.old_ema=0.5"
  [p8_ema_all]="@benchmarks/recipes/shapes_nft_overall.yaml data.prompts_per_step=8 run.steps=160 algorithm.old_update=ema algorithm.old_ema=0.5"
  [p16_ema_all]="@benchmarks/recipes/shapes_nft_overall.yaml algorithm.old_update=ema algorithm.old_ema=0.5"
  [p8_r16]="data.prompts_per_step=8 run.steps=160 actor.lora.rank=16 actor.lora.alpha=16"
  [p8_lr7]="data.prompts_per_step=8 run.steps=160 actor.lr=7e-4"
  [p4]="data.prompts_per_step=4 run.steps=320"
  [p8g4]="data.prompts_per_step=8 rollout.group_size=4 run.steps=320"
)
i=0
for name in "${!RUNS[@]}"; do
  args="${RUNS[$name]}"; recipe=recipes/shapes_nft.yaml
  if [[ $args == @* ]]; then recipe=${args%% *}; recipe=${recipe#@}; args=${args#* }; fi
  python3 -m diffrl.cli train $recipe run.steps=$STEPS $args \
    run.device=cuda run.out_dir=/tmp/runs run.name=$name run.tensorboard=false data.eval_samples_per_prompt=4 run.eval_every=20 \
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
