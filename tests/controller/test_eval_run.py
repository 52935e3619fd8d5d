"""`diffrl eval RUN_DIR` scores a trained run's newest checkpoint with the run's own config
(it used to report the directory missing, or "no 'arch' metadata"), also when the run was
trained with more threads than this machine has cores."""

from __future__ import annotations

import asyncio
import os

from tiny_runs import tiny_run

from diffrl.cli import main
from diffrl.config import load_config
from diffrl.controller.loop import train
from diffrl.controller.run_dir import read_metrics


def test_eval_of_a_trained_run_matches_its_last_eval(tiny_checkpoint, tmp_path, capsys):
    cfg = load_config(
        "recipes/shapes_nft.yaml",
        tiny_run(tiny_checkpoint, tmp_path, 2, "rollout.num_steps=2", "run.eval_every=2"),
    )
    root = asyncio.run(train(cfg))
    last = [r for r in read_metrics(root) if "eval/overall" in r][-1]
    # as trained on a machine with more cores than this one (train refuses more threads than
    # cores): eval caps them here instead of refusing the run's own config
    saved = root / "config.yaml"
    saved.write_text(
        saved.read_text().replace("threads: 0", f"threads: {4 * (os.cpu_count() or 1)}")
    )
    capsys.readouterr()
    assert main(["eval", str(root)]) == 0
    printed = dict(line.split() for line in capsys.readouterr().out.strip().splitlines())
    assert float(printed["step"]) == 2
    assert abs(float(printed["eval/overall"]) - last["eval/overall"]) < 1e-3


def test_eval_of_a_directory_that_is_no_run_is_a_clear_error(tmp_path, capsys):
    assert main(["eval", str(tmp_path)]) == 2
    assert "not a diffrl run directory" in capsys.readouterr().err
