"""Resource checks before a run writes anything (diffrl/resources.py), and the config values
refused or accepted at load (seed, threads, autocast, YAML tags)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

from diffrl import resources
from diffrl.config import MAX_SEED, load_config
from diffrl.errors import ConfigError
from diffrl.resources import check_lora_rank, check_out_dir, check_step_rows

RECIPE = "recipes/shapes_nft.yaml"


def test_step_rows_fit_up_to_the_byte() -> None:
    # 4 x 8 rows of 3x4x4 float32 = 32 x 192 B = 6144 B
    check_step_rows(4, 8, (3, 4, 4), 4, memory=6144)
    with pytest.raises(ConfigError, match=r"4 x 8 = 32 samples a step.*6.0 KiB, more than"):
        check_step_rows(4, 8, (3, 4, 4), 4, memory=6143)


def test_lora_rank_is_bounded_by_the_widest_target() -> None:
    widths = {"attn.qkv": (32, 96), "mlp.fc1": (32, 128), "proj": (16, 8)}
    check_lora_rank(32, widths)
    bound = r"'actor.lora.rank' = 33: must be <= 32, .*\(attn.qkv: 32 -> 96"
    with pytest.raises(ConfigError, match=bound):
        check_lora_rank(33, widths)
    check_lora_rank(10**6, {})  # no Linear target: nothing to bound (the bind check names it)


def test_model_fits_reads_the_loaded_model(tiny_model) -> None:
    cfg = load_config(RECIPE, ["actor.lora.rank=33"])
    targets = [n for n, m in tiny_model.named_modules() if isinstance(m, torch.nn.Linear)]
    with pytest.raises(ConfigError, match="actor.lora.rank"):
        resources.check_model_fits(cfg, tiny_model, targets, "cpu")
    resources.check_model_fits(load_config(RECIPE), tiny_model, targets, "cpu")


def test_out_dir_on_a_kernel_filesystem_or_under_a_file(tmp_path) -> None:
    if resources.filesystem_type(Path("/proc")) != "proc":
        pytest.skip("no /proc mount table here")
    with pytest.raises(ConfigError, match="proc filesystem"):
        check_out_dir("/proc/self/runs")
    (tmp_path / "f").write_text("")
    with pytest.raises(ConfigError, match="is not a directory"):
        check_out_dir(str(tmp_path / "f" / "runs"))
    check_out_dir(str(tmp_path / "not" / "yet"))  # created later, by the run
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]  # the probe left nothing


def test_out_dir_where_no_file_can_be_created(tmp_path, monkeypatch) -> None:
    def refuse(**kw):  # root ignores directory modes, so the refusal is injected
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.raises(ConfigError, match=r"cannot create files in .* \(Permission denied\)"):
        check_out_dir(str(tmp_path))


def test_seed_bounds() -> None:
    assert load_config(RECIPE, [f"run.seed={MAX_SEED}"]).run.seed == MAX_SEED
    assert load_config(RECIPE, ["run.seed=0"]).run.seed == 0
    for bad in (-1, MAX_SEED + 1):
        with pytest.raises(ConfigError, match=r"'run.seed' = .*must be in \[0, 4294967295\]"):
            load_config(RECIPE, [f"run.seed={bad}"])


def test_threads_up_to_the_cores() -> None:
    cores = os.cpu_count() or 1
    assert load_config(RECIPE, [f"run.threads={cores}"]).run.threads == cores
    with pytest.raises(ConfigError, match=f"'run.threads' = {cores + 1}: must be in"):
        load_config(RECIPE, [f"run.threads={cores + 1}"])


def test_autocast_off_as_yaml_reads_it(tmp_path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("actor:\n  autocast: off\n")  # YAML 1.1: false
    assert load_config(recipe).actor.autocast == "off"
    assert load_config(RECIPE, ["actor.autocast=off"]).actor.autocast == "off"
    assert load_config(RECIPE, ["actor.autocast=bfloat16"]).actor.autocast == "bfloat16"
    with pytest.raises(ConfigError, match="actor.autocast"):
        load_config(RECIPE, ["actor.autocast=on"])  # true is not a precision


def test_yaml_errors_are_one_line(tmp_path) -> None:
    recipe = tmp_path / "r.yaml"
    recipe.write_text("run:\n  name: !!python/object/apply:os.getcwd []\n")
    with pytest.raises(ConfigError) as e:
        load_config(recipe)
    assert "\n" not in str(e.value) and "python/object/apply" in str(e.value)
    with pytest.raises(ConfigError) as e:
        load_config(RECIPE, ["run.seed=abc"])  # OmegaConf adds key and type lines
    assert "\n" not in str(e.value) and "'run.seed'" in str(e.value)


def test_a_weights_file_that_is_not_safetensors(tiny_model, tmp_path) -> None:
    from diffrl.models.registry import load_weights

    bogus = tmp_path / "w.safetensors"
    bogus.write_text("root:x:0:0:root:/root:/bin/bash\n")  # /etc/passwd's first line
    with pytest.raises(ConfigError, match=r"'model.weights' = .*not a .safetensors file"):
        load_weights(tiny_model, str(bogus))


def test_step_rows_are_split_over_data_parallel_ranks() -> None:
    check_step_rows(4, 8, (3, 4, 4), 4, memory=3072, ranks=2)  # 16 rows a rank
    with pytest.raises(ConfigError, match="over 2 data-parallel ranks.*need 3.0 KiB a rank"):
        check_step_rows(4, 8, (3, 4, 4), 4, memory=3071, ranks=2)
