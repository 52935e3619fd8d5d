"""Write random-weight reward models for the CLAP + ImageBind recipes and print the override
that points a run at them (nothing is downloaded):

    python benchmarks/random_av_rewards.py OUT           # real size: ClapModel's default config,
                                                         # imagebind_huge's AV towers (bfloat16)
    python benchmarks/random_av_rewards.py OUT --tiny    # tiny configs (float32), for the CPU

OUT/clap is a ``save_pretrained`` directory (``ClapModel`` + a processor whose byte-level
tokenizer is built here); OUT/imagebind_{huge,tiny}.pth is a state dict under Meta's
``imagebind_huge`` parameter names (the vision and audio towers the reward reads). The last line
printed is the ``reward.scorers=[...]`` override (weights 0.5 / 0.5, each scorer on the run's
device); pass it in single quotes, it holds ``${run.device}``. The writers live in
``diffrl/reward/random_weights.py`` (shared with benchmarks/av_reward.py).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from diffrl.reward.random_weights import scorers_override, write_av_rewards


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="folder to write into (created)")
    p.add_argument("--tiny", action="store_true", help="tiny configs, float32 (CPU tests)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    # the random init runs on the GPU when there is one (the huge towers are ~0.7 B values)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    paths = write_av_rewards(Path(args.out), args.tiny, device)
    size = sum(f.stat().st_size for f in Path(args.out).rglob("*") if f.is_file()) / 2**30
    print(f"wrote {paths['clap']} and {paths['imagebind']} ({size:.2f} GiB) in "
          f"{time.perf_counter() - t0:.1f} s", flush=True)  # fmt: skip
    override = scorers_override(paths, args.tiny)
    print(override, flush=True)
    return override


if __name__ == "__main__":
    main()
