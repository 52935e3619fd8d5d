"""recipes/omni_shapes_ppo.yaml trains the autoregressive omni family end to end through the
real CLI: the shipped ShapesQA base, the AR rollout, the shapes_qa reward, Omni-PPO, weight
sync, held-out eval and checkpoints, in two tiny steps."""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file

from diffrl.cli import main
from diffrl.config import REPO_ROOT
from diffrl.controller.run_dir import read_metrics


def test_two_steps_through_the_cli(tmp_path: Path) -> None:
    rc = main(
        [
            "train",
            str(REPO_ROOT / "recipes" / "omni_shapes_ppo.yaml"),
            "run.steps=2",
            "run.eval_every=2",
            "run.save_every=2",
            "data.prompts_per_step=2",
            "rollout.group_size=2",
            "data.eval_prompts=2",
            f"run.out_dir={tmp_path}",
            "run.tensorboard=false",
        ]
    )
    assert rc == 0
    root = tmp_path / "omni_shapes_ppo"
    rows = read_metrics(root)
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["probe/skipped"] == 1.0  # contract 1 does not apply, and says so
    assert all("eval/overall" in rows[i] for i in (0, 2))
    trained = [r for r in rows[1:] if "ppo/clip_frac" in r]
    assert trained and all("reward/shapes_qa/mean" in r for r in rows[1:])
    assert any(r["ppo/tokens"] > 0 for r in trained)
    assert all(r["sync/receipt_frac"] < 1 for r in rows[1:])  # every sync verified
    (ckpt,) = sorted((root / "checkpoints").glob("step_*"))[-1:]
    adapters = load_file(str(next(ckpt.glob("*.safetensors"))))
    assert any("lora_B" in k and v.abs().sum() > 0 for k, v in adapters.items())  # it learnt
