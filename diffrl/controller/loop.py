"""``diffrl train``'s loop: builds the run's engines and runs them in the mode the config
names, sync (``controller/sync.py``, on-policy) or async (``controller/async_.py``, the
rollout ahead of the actor). The two modes share ``controller/step.py`` and neither imports
the other.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from diffrl.backends import build_engines
from diffrl.config import Config
from diffrl.controller.async_ import train_async
from diffrl.controller.run_start import RunStart, started
from diffrl.controller.sync import train_sync
from diffrl.resources import check_out_dir

MODES = {"sync": train_sync, "async": train_async}  # run.mode -> its loop


async def train(cfg: Config) -> Path:
    check_out_dir(cfg.run.out_dir)  # before a model loads, and before anything is written
    # lock and check the run directory before the engines are built: a second run in it, a
    # finished run or a refused resume answers at once, and nothing is written until the
    # engines (resources) and the checkpoint (``step.resume``) have been accepted too
    with started(cfg, os.environ.get("RANK", "0") == "0", None) as begun:
        if begun.finished:
            return begun.root
        return await _train(cfg, begun)


async def _train(cfg: Config, begun: RunStart) -> Path:
    parts = build_engines(cfg)
    if parts.bound is not None and parts.ranks.primary:  # once per run, before any work
        print(f"diffrl: {parts.bound.line()}", file=sys.stderr)
    if parts.etp and parts.ranks.primary:
        print(f"diffrl: {parts.etp}", file=sys.stderr)
    if parts.layout and parts.ranks.primary:
        print(f"diffrl: {parts.layout}", file=sys.stderr)
    try:
        return await MODES[cfg.run.mode](cfg, parts, begun)
    finally:  # scorer clients, remote engines: released however the run ends
        await parts.aclose()
