#!/usr/bin/env bash
# One device call: where the time goes, on a real-size SD3.5-Medium (random weights, bf16,
# 512 px, a rule reward), and what CUDA graphs buy at batch 1.
#
#   bash benchmarks/gpu_profile_call.sh OUTDIR [PARTS]
#     PARTS (default "batch1 train"), any of:
#     batch1  `diffrl bench rollout` of 8 one-image requests (CFG 4.5, 10 steps, decode), one at a
#             time (rollout.max_batch=1), compiled blocks and rollout.cuda_graphs, against the
#             plain loop (eager, one prompt per call, encoded every call) in the same process;
#             then the same without graphs (--no-baseline); profiles of both.
#     train   `diffrl bench train` of the FlowGRPO epoch recipe (benchmarks/recipes/
#             sd35m_grpo_epoch.yaml) on 2 prompts x 8 images, actor.compile, with a profile.
#     trainN  the same with actor.micro_batch=N (the recipe's is 4), e.g. train8.
#     ckpt    the same update with actor.activation_checkpointing=true (its cost: compare with
#             train's seconds).
#     batch16 `diffrl bench rollout` of the SD3.5 NFT recipe (8 prompts x 8 images, CFG 4.5,
#             16 images = 32 rows per forward), compiled + cuda_graphs, against the plain loop:
#             the rollout MFU at batch >= 8.
#     equiv   benchmarks/graphs_equivalence.py: the same seeds' latents with and without
#             rollout.cuda_graphs (sd35-tiny and sd35-medium).
#     Rows in OUTDIR/bench.txt, profiles in OUTDIR/profile_*.txt, logs OUTDIR/*.log. The parts
#     share one deadline (DEADLINE, default 560 s).
#
# DRY_RUN=1 runs the same command lines on the CPU with the sd35-tiny preset (no graphs: they
# need CUDA).
set -uo pipefail
OUT=${1:?outdir}; PARTS=${2:-"batch1 train"}; DEADLINE=${DEADLINE:-560}
source "$(dirname "$0")/gpu_common.sh"
if [[ -n "${DRY_RUN:-}" ]]; then
  SIZE=(model.preset=sd35-tiny model.resolution=64 run.device=cpu rollout.num_steps=3)
  GRAPHS=()
fi

run() {  # NAME ARGS...: one bench command under what is left of the deadline
  local name=$1; shift
  local left=$((DEADLINE - SECONDS))
  if (( left < 30 )); then echo "$name: skipped, ${left}s left"; return; fi
  timeout "$left" "${DIFFRL[@]}" bench "$@" --profile "$OUT/profile_$name.txt" > "$OUT/$name.log" 2>&1
  local rc=$?
  grep "^bench/" "$OUT/$name.log" | sed "s/^/$name /" | tee -a "$OUT/bench.txt"
  (( rc )) && { echo "$name: exit $rc at ${SECONDS}s"; grep -v "float32\|^bench/" "$OUT/$name.log" | tail -6; }
  [[ -f "$OUT/profile_$name.txt" ]] && head -12 "$OUT/profile_$name.txt"
}

for part in $PARTS; do
  case $part in
    batch1)
      ONE=(recipes/sd35_nft.yaml 'model.path=""' model.preset=sd35-medium "$REWARD" "${SIZE[@]}"
           data.prompts_per_step=4 rollout.group_size=2 rollout.max_batch=1 rollout.compile=true)
      run batch1_graphs rollout "${ONE[@]}" "${GRAPHS[@]}" --repeats 2
      run batch1_compiled rollout "${ONE[@]}" --repeats 2 --no-baseline
      ;;
    train|train[0-9]*)
      GRPO=(benchmarks/recipes/sd35m_grpo_epoch.yaml "$REWARD" "${SIZE[@]}" data.prompts_per_step=2
            actor.compile=true rollout.compile=true)
      [[ $part != train ]] && GRPO+=(actor.micro_batch=${part#train})
      [[ -n "${DRY_RUN:-}" ]] && GRPO+=(model.preset=sd35-tiny model.resolution=64 rollout.group_size=2)
      run "grpo_$part" train "${GRPO[@]}" --repeats 1 --no-baseline
      ;;
    ckpt)
      GRPO=(benchmarks/recipes/sd35m_grpo_epoch.yaml "$REWARD" "${SIZE[@]}" data.prompts_per_step=2
            actor.compile=true rollout.compile=true actor.activation_checkpointing=true)
      [[ -n "${DRY_RUN:-}" ]] && GRPO+=(model.preset=sd35-tiny model.resolution=64 rollout.group_size=2)
      run grpo_train_ckpt train "${GRPO[@]}" --repeats 1 --no-baseline
      ;;
    batch16)
      B16=(recipes/sd35_nft.yaml 'model.path=""' model.preset=sd35-medium "$REWARD" "${SIZE[@]}"
           rollout.compile=true "${GRAPHS[@]}")
      [[ -n "${DRY_RUN:-}" ]] && B16+=(data.prompts_per_step=2 rollout.group_size=2)
      run batch16 rollout "${B16[@]}" --repeats 2
      ;;
    equiv)
      [[ -n "${DRY_RUN:-}" ]] && { echo "equiv: needs CUDA"; continue; }
      timeout $((DEADLINE - SECONDS)) python3 benchmarks/graphs_equivalence.py \
        2>&1 | grep "^{" | tee "$OUT/graphs_equivalence.jsonl"
      ;;
    *) echo "unknown part $part (batch1 | train | trainN | ckpt | batch16 | equiv)"; exit 2 ;;
  esac
done
echo "done in ${SECONDS}s"
