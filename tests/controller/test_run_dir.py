"""The run directory: strict-JSON metrics, torn lines, and a name that stays inside out_dir."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from diffrl.config import RunConfig, load_config
from diffrl.controller.run_dir import RunDir, read_metrics
from diffrl.errors import ConfigError, FieldError


def strict_rows(path) -> list[dict]:
    """Rows as a strict JSON reader sees them (Python's json accepts Infinity/NaN)."""

    def refuse(token):
        raise ValueError(f"{token} is not JSON")

    return [json.loads(ln, parse_constant=refuse) for ln in path.read_text().splitlines()]


def test_nonfinite_metrics_are_written_as_null(tmp_path) -> None:
    run = RunDir(tmp_path, tensorboard=False)
    run.log(1, {"reward/mean": float("inf"), "actor/loss": float("nan"), "ok": np.float32(0.5)})
    run.log(2, {"reward/mean": -float("inf"), "count": np.int64(3), "note": "text"})
    rows = strict_rows(tmp_path / "metrics.jsonl")
    assert rows[0]["reward/mean"] is None and rows[0]["actor/loss"] is None
    assert rows[0]["ok"] == 0.5
    assert rows[1]["reward/mean"] is None and rows[1]["count"] == 3.0
    assert rows[1]["note"] == "text"


def test_a_torn_last_line_is_skipped_and_dropped_on_resume(tmp_path, caplog) -> None:
    run = RunDir(tmp_path, tensorboard=False)
    for step in (0, 1, 2):
        run.log(step, {"reward/mean": 0.1 * step})
    with run.metrics_path.open("a") as f:
        f.write('{"step": 3, "time": 17.0, "rew')  # killed mid-write
    with caplog.at_level(logging.WARNING):
        assert [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2]
        run.truncate_after(1)  # resume from the step-1 checkpoint
    assert "not JSON" in caplog.text and "[4]" in caplog.text
    run.log(2, {"reward/mean": 0.25})
    assert [r["step"] for r in strict_rows(run.metrics_path)] == [0, 1, 2]
    assert read_metrics(tmp_path)[-1]["reward/mean"] == 0.25
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_truncate_after_minus_one_starts_a_fresh_file(tmp_path) -> None:
    run = RunDir(tmp_path, tensorboard=False)
    run.log(0, {"a": 1.0})
    run.truncate_after(-1)
    assert read_metrics(tmp_path) == []


@pytest.mark.parametrize("name", [".", "..", "../up", "a/b"])
def test_run_name_must_stay_inside_out_dir(name) -> None:
    with pytest.raises(ConfigError, match="run.name"):
        load_config(None, [f"run.name={name}"])


@pytest.mark.parametrize("name", ["", "a\\b", "x\0y", "/abs"])
def test_run_name_must_be_a_plain_name(name) -> None:
    with pytest.raises(FieldError, match="plain directory name"):
        RunConfig(name=name).validate()


@pytest.mark.parametrize("name", ["shapes_nft", "run-2.v1", "..hidden_but_plain"])
def test_plain_run_names_pass(name) -> None:
    assert load_config(None, [f"run.name={name}"]).run.name == name


def test_grid_shows_every_prompt_with_whole_captions(tmp_path):
    """The eval grid holds one tile per held-out prompt (all 52, colour attribution included)
    and captions wrap in word order without dropping words."""
    import textwrap

    import numpy as np
    from PIL import Image

    from diffrl.controller.run_dir import RunDir
    from diffrl.tasks.shapes.prompts import split_prompts

    texts = [p.text for p in split_prompts("eval")]
    run = RunDir(tmp_path / "run", tensorboard=False)
    images = np.zeros((len(texts), 32, 32, 3), dtype=np.uint8)
    path = run.save_grid(0, images, texts, [True] * len(texts), cols=8, tile=96)
    width, height = Image.open(path).size
    assert width == 8 * (96 + 8)
    rows = -(-len(texts) // 8)
    assert len(texts) == 52 and rows == 7 and height >= rows * (96 + 12)
    for t in texts:  # the wrap RunDir uses keeps every word, in order
        assert " ".join(textwrap.wrap(t, 96 // 6)) == t
