#!/usr/bin/env bash
# One device call for the performance issue, on a real-size SD3.5-Medium (random weights, bf16,
# 512 px, a rule reward in place of PickScore), against the diffusers loop in the same process.
#
#   bash benchmarks/gpu_perf_call.sh OUTDIR [ALGOS] [REPEATS]
#     `diffrl bench epoch` for each of ALGOS (default "grpo nft"): FlowGRPO at the issue's
#     settings (benchmarks/recipes/sd35m_grpo_epoch.yaml) and DiffusionNFT (recipes/sd35_nft.yaml
#     with a CFG-free rollout), for each of MODES (default "compiled"): "compiled" =
#     rollout.compile=true actor.compile=true rollout.cuda_graphs=true against the diffusers-loop
#     baseline in the same process (the baseline is eager either way); "eager" = diffrl's
#     engines eager, also against the baseline. `speedup` is the baseline's seconds over diffrl's.
#     REPEATS (default 2) timed epochs after the warm-up. OVER_grpo / OVER_nft (space-separated
#     key=value) add overrides to one algorithm's command, e.g. OVER_grpo=actor.micro_batch=8.
#     Rows in OUTDIR/bench_epoch.txt, logs in OUTDIR/epoch_*.log. The commands share one
#     deadline (DEADLINE, default 570 s): each gets what the ones before it left. Measured on
#     one H200 (2026-12-01, fifth session): both algorithms at REPEATS 1, compiled against the
#     baseline, took 456-476 s in one call (`... OUTDIR "grpo nft" 1`); with MODES="eager
#     compiled", one algorithm per call.
#   bash benchmarks/gpu_perf_call.sh OUTDIR REQUESTS
#     the earlier call: `diffrl bench` rollout / train on the NFT recipe, then the continuous-
#     batching stream of REQUESTS requests with the rollout's blocks compiled.
#
# DRY_RUN=1 runs the same command lines on the CPU with the sd35-tiny preset (64 px, 2 prompts
# x 2 images, 3 steps): every one parses and runs, in a few minutes on 2 cores.
set -uo pipefail
OUT=${1:?outdir}; ALGOS=${2:-"grpo nft"}; REPEATS=${3:-2}; DEADLINE=${DEADLINE:-570}
source "$(dirname "$0")/gpu_common.sh"
if [[ -n "${DRY_RUN:-}" ]]; then
  GRAPHS=()
  SIZE=(model.preset=sd35-tiny model.resolution=64 run.device=cpu data.prompts_per_step=2
        rollout.group_size=2 rollout.num_steps=3 actor.micro_batch=2)
fi

if [[ "$ALGOS" =~ ^[0-9]+$ ]]; then  # the earlier call: bench rollout/train, then the stream
  N=$ALGOS
  SD35=(recipes/sd35_nft.yaml 'model.path=""' model.preset=sd35-medium "$REWARD" "${SIZE[@]}")
  for kind in rollout train; do
    timeout 200 "${DIFFRL[@]}" bench $kind "${SD35[@]}" --repeats 2 2>&1 | grep "^bench/" \
      | sed "s/^/$kind /" | tee -a "$OUT/bench.txt"
  done
  [[ -n "${DRY_RUN:-}" ]] && exit 0  # the stream has no CPU-sized mode
  timeout 330 python3 benchmarks/continuous_batching.py --requests "$N" --compile \
    --warm-passes 1 --modes scheduler diffusers --out "$OUT/cb_compiled.jsonl" 2>&1 \
    | grep -v "Warn\|warn\|float32" | tail -5
  exit 0
fi

GRPO=(benchmarks/recipes/sd35m_grpo_epoch.yaml)
NFT=(recipes/sd35_nft.yaml 'model.path=""' model.preset=sd35-medium rollout.cfg_scale=1)

for algo in $ALGOS; do
  case $algo in
    grpo) ARGS=("${GRPO[@]}") ;;
    nft) ARGS=("${NFT[@]}") ;;
    *) echo "unknown algorithm $algo (grpo | nft)"; exit 2 ;;
  esac
  for mode in ${MODES:-compiled}; do
    left=$((DEADLINE - SECONDS))
    if (( left < 30 )); then echo "$algo $mode: skipped, ${left}s of the deadline left"; continue; fi
    over=(); flags=()
    [[ $mode == compiled ]] && over=(rollout.compile=true actor.compile=true "${GRAPHS[@]}")
    log="$OUT/epoch_${algo}_$mode.log"
    extra=()  # OVER_grpo / OVER_nft: that algorithm's extra overrides, e.g. actor.micro_batch=8
    var="OVER_$algo"; read -ra extra <<< "${!var:-}"
    timeout "$left" "${DIFFRL[@]}" bench epoch "${ARGS[@]}" "$REWARD" "${SIZE[@]}" "${over[@]}" "${extra[@]}" \
      --repeats "$REPEATS" "${flags[@]}" > "$log" 2>&1
    rc=$?
    grep "^bench/" "$log" | sed "s/^/$algo $mode /" | tee -a "$OUT/bench_epoch.txt"
    if (( rc )); then  # 124: the deadline
      echo "$algo $mode: exit $rc at ${SECONDS}s"; grep -v "float32\|^bench/" "$log" | tail -4
    fi
  done
done
echo "done in ${SECONDS}s"
