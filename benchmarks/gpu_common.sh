# Sourced by benchmarks/gpu_*_call.sh (after OUT is set): the settings every device call shares.
export PYTHONUNBUFFERED=1
mkdir -p "$OUT"
# the CLI without an installed entry point (the device image runs the working tree)
DIFFRL=(python3 -c "from diffrl.cli import main; main()")
REWARD='reward.scorers=[{name: jpeg_incompressibility}]'  # a rule reward: no reward weights
SIZE=(run.device=cuda)
GRAPHS=(rollout.cuda_graphs=true)
