#!/usr/bin/env bash
# Pre-train the tiny DiT on a GPU with snapshots, then run the default NFT recipe from a few
# snapshots, to pick a base model that is clearly imperfect yet leaves RL headroom.
# Usage (device machine): bash benchmarks/gpu_pretrain_sweep.sh OUTDIR [STEPS] [SNAPSHOTS] [RL_FROM]
set -uo pipefail
OUTDIR=${1:?outdir}; STEPS=${2:-4000}; SNAPS=${3:-[500,1000,2000,3000]}; RL_FROM=${4:-"1000 2000"}
export PYTHONUNBUFFERED=1
D=/tmp/sweep; mkdir -p $D
python3 -m diffrl.cli pretrain steps=$STEPS batch=128 "snapshots=$SNAPS" eval_samples=4 \
  device=cuda out=$D/shapes_dit.safetensors 2>&1 | tr '\r' '\n' | grep -v "^pretrain:" | tee -a $OUTDIR/sweep.log
for s in $RL_FROM; do
  python3 -m diffrl.cli train recipes/shapes_nft.yaml model.checkpoint=$D/shapes_dit_step$s.safetensors \
    run.device=cuda run.out_dir=/tmp/runs run.name=rl_from_$s run.tensorboard=false 2>&1 | tr '\r' '\n' | tail -2 | tee -a $OUTDIR/sweep.log
  python3 - <<PY | tee -a $OUTDIR/sweep.log
import json
rows=[json.loads(l) for l in open('/tmp/runs/rl_from_$s/metrics.jsonl')]
for r in rows:
    if 'eval/overall' in r: print('rl_from_$s', r['step'], round(r['eval/overall'],3), {k[5:]:round(v,2) for k,v in r.items() if k.startswith('eval/')})
print('rl_from_$s reward', [round(r.get('reward/mean',0),3) for r in rows[1::5]])
PY
  cp /tmp/runs/rl_from_$s/curves.png $OUTDIR/curves_$s.png
done
cp $D/*.safetensors $OUTDIR/ 2>/dev/null; ls -la $OUTDIR
