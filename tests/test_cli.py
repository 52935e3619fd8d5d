"""The command line as a new user meets it (issue 41, findings 11, 15 and 16): a preset brings
its own geometry, a geometry the model cannot take is one line naming the key, a missing extra
is an install hint, flags and overrides mix, ``train --help`` lists the keys, a recipe is found
by its name, and a tiny-preset run labels its bar, stops at its wall budget with a message and
exports a LoRA file others can read."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
import sys

import pytest
from omegaconf import OmegaConf

from diffrl.cli import main
from diffrl.config import Config, load_config
from diffrl.extras import install_hint
from diffrl.models.registry import preset_takes_over

SMOKE = [  # tiny overrides on top of a recipe's README smoke command (model.preset=...-tiny)
    "reward.scorers=[{name: jpeg_incompressibility}]",
    "data.prompts_per_step=2",
    "rollout.group_size=2",
    "rollout.num_steps=2",
    "rollout.eval_num_steps=2",
    "data.eval_prompts=2",
    "probe.mode=off",
    "run.tensorboard=false",
]


def test_a_preset_on_the_command_line_brings_its_geometry() -> None:
    # the recipe's resolution: 512 (and wan's 480 px x 33 frames) were written for the real model
    sd35 = load_config("recipes/sd35_nft.yaml", ["model.preset=sd35-tiny"]).model
    assert (sd35.resolution, sd35.frames, sd35.preset) == (0, 0, "sd35-tiny")
    wan = load_config("recipes/wan_nft.yaml", ["model.preset=wan-tiny"]).model
    assert (wan.resolution, wan.frames) == (0, 0)
    # an explicit override wins over the preset, and the recipe keeps its own without a preset
    over = ["model.preset=wan-tiny", "model.frames=5"]
    assert load_config("recipes/wan_nft.yaml", over).model.frames == 5
    assert load_config("recipes/wan_nft.yaml").model.resolution == 480
    # a real-size preset stands for the recipe's own model: the recipe's geometry holds
    real = load_config("recipes/sd35_nft.yaml", ["model.preset=sd35-medium"]).model
    assert real.resolution == 512
    # and so does what a recipe gives for its own tiny preset, named again on the command line
    recipe = OmegaConf.create({"model": {"preset": "sd35-tiny", "resolution": 64}})
    cli = OmegaConf.from_dotlist(["model.preset=sd35-tiny"])
    assert preset_takes_over(recipe, cli).model.resolution == 64


@pytest.mark.parametrize(
    "recipe, preset, key, value, allowed",
    [
        ("sd35_nft", "sd35-tiny", "resolution", 512, "multiple of 16 from 16 to 256"),
        ("wan_nft", "wan-tiny", "resolution", 2048, "multiple of 16 from 16 to 1024"),
        ("wan_nft", "wan-tiny", "frames", 6, "1 + a multiple of 4"),
    ],
)
def test_a_geometry_the_model_cannot_take_is_one_line(
    recipe, preset, key, value, allowed, tmp_path, capsys
) -> None:
    pytest.importorskip("diffusers")
    argv = [f"recipes/{recipe}.yaml", f"model.preset={preset}", f"model.{key}={value}"]
    assert main(["train", *argv, f"run.out_dir={tmp_path}", *SMOKE]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"diffrl: error: config key 'model.{key}' = {value}: ") and allowed in err


def test_a_missing_extra_is_an_install_hint(monkeypatch, tmp_path, capsys) -> None:
    pytest.importorskip("diffusers")
    for name in [n for n in sys.modules if n == "diffusers" or n.startswith("diffusers.")]:
        monkeypatch.setitem(sys.modules, name, None)  # `import diffusers...` now fails
    monkeypatch.setitem(sys.modules, "diffusers", None)
    hint = "diffusers (not installed here): pip install -e '.[models]'"
    assert main(["plan", "sd35_nft", "model.preset=sd35-tiny"]) == 2
    assert capsys.readouterr().err.strip() == f"diffrl: error: diffrl plan needs {hint}"
    out = tmp_path / "runs"
    assert main(["train", "sd35_nft", "model.preset=sd35-tiny", f"run.out_dir={out}"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(f"needs {hint}")
    # any other missing module is a bug, and keeps its traceback
    assert install_hint(ModuleNotFoundError("x", name="numpyy")) is None


def test_overrides_after_flags_help_and_recipe_names(monkeypatch, capsys) -> None:
    import diffrl.bench.mfu as mfu

    seen = {}

    class Result:
        def rows(self) -> dict:
            return {}

    def bench(kind, cfg, repeats, baseline, profile):  # what the command line handed over
        seen.update(kind=kind, threads=cfg.run.threads, repeats=repeats, algo=cfg.algorithm.name)
        return Result()

    monkeypatch.setattr(mfu, "bench", bench)
    assert main(["bench", "rollout", "--repeats", "1", "run.threads=1"]) == 0
    assert seen == dict(kind="rollout", threads=1, repeats=1, algo="diffusion_nft")
    assert main(["bench", "rollout", "--repeats", "2", "shapes_grpo", "run.threads=1"]) == 0
    assert seen["algo"] == "flow_grpo" and seen["repeats"] == 2  # the name finds recipes/*.yaml
    with pytest.raises(SystemExit):  # a flag it does not know is still refused
        main(["bench", "rollout", "--repeats", "1", "--bogus"])
    capsys.readouterr()
    # a missing recipe: the recipes there, not a hint about YAML list syntax
    assert main(["train", "shapes_nope"]) == 2
    err = capsys.readouterr().err
    assert "recipe 'shapes_nope' not found" in err and "shapes_grpo, " in err and "list" not in err
    with pytest.raises(SystemExit) as done:
        main(["train", "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    root = Config()
    for f in dataclasses.fields(root):  # every section, with every key and where it is documented
        assert f"  {f.name}: documented in diffrl/" in out
        for key in dataclasses.fields(getattr(root, f.name)):
            assert f" {key.name} " in f" {out.replace(chr(10), ' ')} "


def test_tiny_preset_run_as_the_readme_gives_it(tmp_path, capsys) -> None:
    """wan_nft with wan-tiny, as README says (no geometry given): its first step is seconds
    (the recipe's 480 px x 33 frames took minutes); a wall budget spent after step 1 of 2 says so;
    the bar names the prompts task's reward mean; the exported LoRA is 0644 under umask 022."""
    pytest.importorskip("diffusers")
    argv = ["recipes/wan_nft.yaml", "model.preset=wan-tiny", "run.steps=2", *SMOKE]
    assert main(["train", *argv, f"run.out_dir={tmp_path}", "run.max_minutes=1e-6"]) == 0
    err = capsys.readouterr().err
    assert "stopped after step 1 of 2: run.max_minutes=1e-06 is spent" in err
    assert re.search(r"1/2 \[[0-9:]+, stopped early", err)  # where it stopped, with no ETA
    assert "eval_reward=" in err and "eval_acc" not in err
    root = tmp_path / "wan_nft"
    rows = [json.loads(line) for line in (root / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1]
    model = load_config(root / "config.yaml").model  # the preset's geometry, not the recipe's
    assert (model.preset, model.resolution, model.frames) == ("wan-tiny", 0, 0)
    old = os.umask(0o022)
    try:
        assert main(["export", str(root), "--out", str(tmp_path / "lora")]) == 0
    finally:
        os.umask(old)
    mode = stat.S_IMODE((tmp_path / "lora" / "pytorch_lora_weights.safetensors").stat().st_mode)
    assert mode == 0o644 and not list((tmp_path / "lora").glob(".*"))
