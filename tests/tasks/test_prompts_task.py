"""The prompt-dataset task: a directory of train/test splits (.txt or .jsonl), its errors, and
its held-out eval over whatever scorers the run configures."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch

from diffrl.errors import ConfigError
from diffrl.tasks import EvalResult, Prompt, PromptSet, TaskConfig, build_task
from diffrl.tasks.prompts import PromptsTask
from diffrl.types import PromptBatch, ScoredBatch, Trajectory


def dataset(root: Path, **files: str) -> Path:
    """A dataset dir: dataset(tmp, train_txt="...", test_jsonl="...")."""
    root.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        stem, ext = name.rsplit("_", 1)
        (root / f"{stem}.{ext}").write_text(text)
    return root


def jsonl(*rows) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


def task(root: Path) -> PromptsTask:
    return build_task(TaskConfig(task="prompts", dataset=str(root)))


# --- reading splits ----------------------------------------------------------------------------


def test_txt_and_jsonl_splits(tmp_path) -> None:
    root = dataset(
        tmp_path / "d",
        train_txt="a red cat\n\n  a blue dog  \n",  # blank lines skipped, whitespace stripped
        test_jsonl=jsonl(
            {"prompt": "a tree", "negative_prompt": "blurry"},
            "",
            {"prompt": "a car", "image": "ref.png", "frames": ["f0.png", "f1.png"]},
        ),
    )
    t = task(root)
    assert isinstance(t, PromptsTask) and t.name == "prompts"
    assert t.prompts("train") == [Prompt("a red cat"), Prompt("a blue dog")]
    assert t.prompts("test") == [
        Prompt("a tree", negative_prompt="blurry"),
        Prompt("a car", image="ref.png", frames=("f0.png", "f1.png")),
    ]
    assert t.probe_data() is None  # no ground-truth images: the probe is skipped


def test_jsonl_train_and_txt_test(tmp_path) -> None:
    root = dataset(tmp_path / "d", train_jsonl=jsonl({"prompt": "x"}), test_txt="y\n")
    t = task(root)
    assert [p.text for p in t.prompts("train")] == ["x"]
    assert [p.text for p in t.prompts("test")] == ["y"]


def test_the_builtin_set_loads() -> None:
    t = build_task(TaskConfig(task="prompts", dataset="builtin:everyday"))
    train, test = t.prompts("train"), t.prompts("test")
    assert len(train) == 36 and len(test) == 12
    assert all(p.text for p in train + test)
    assert any(p.negative_prompt for p in test)
    assert not {p.text for p in train} & {p.text for p in test}  # held out means held out


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ('{"prompt": "ok"', "not valid JSON"),
        ('{"negative_prompt": "blurry"}', 'non-empty "prompt"'),
        ('{"prompt": ""}', 'non-empty "prompt"'),
        ('["a list"]', 'non-empty "prompt"'),
        ('{"prompt": "ok", "seed": 3}', r"unknown fields \['seed'\]"),
    ],
    ids=["bad_json", "no_prompt", "empty_prompt", "not_an_object", "unknown_field"],
)
def test_bad_jsonl_lines_name_the_file_and_line(tmp_path, line: str, match: str) -> None:
    test = jsonl({"prompt": "fine"}, "", line)  # the bad line is line 3 (blank lines count)
    root = dataset(tmp_path / "d", train_txt="a\n", test_jsonl=test)
    with pytest.raises(ConfigError, match=match) as err:
        task(root)
    assert f"{root / 'test.jsonl'}:3:" in str(err.value)


def test_missing_split_names_the_files_it_wants(tmp_path) -> None:
    root = dataset(tmp_path / "d", train_txt="a\n")
    with pytest.raises(ConfigError, match=r"missing test\.txt or test\.jsonl") as err:
        task(root)
    assert str(root) in str(err.value)


def test_both_files_of_a_split(tmp_path) -> None:
    root = dataset(tmp_path / "d", train_txt="a\n", train_jsonl=jsonl({"prompt": "a"}))
    with pytest.raises(ConfigError, match=r"both train\.txt and train\.jsonl") as err:
        task(root)
    assert str(root) in str(err.value)


def test_empty_split_and_missing_dir(tmp_path) -> None:
    root = dataset(tmp_path / "d", train_txt="\n\n", test_txt="b\n")
    with pytest.raises(ConfigError, match="train split holds no prompts"):
        task(root)
    with pytest.raises(ConfigError, match=r"data\.dataset.*no directory"):
        task(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match=r"data\.dataset.*no directory"):
        build_task(TaskConfig(task="prompts", dataset="builtin:nope"))
    with pytest.raises(ConfigError, match=r"data\.task.*'nope'"):
        build_task(TaskConfig(task="nope"))


def test_prompt_set_tokenizes_once_with_the_given_tokenizer(tiny_model) -> None:
    prompts = [Prompt("a red circle"), Prompt("two blue squares on the left")]
    ps = PromptSet(prompts, tiny_model.family.tokenize)
    batch = ps.batch([1, 0, 1])
    assert batch.texts == ("two blue squares on the left", "a red circle") + batch.texts[2:]
    assert batch.prompt_ids.tolist() == [1, 0, 1]
    torch.testing.assert_close(batch.input_ids, ps.input_ids[[1, 0, 1]])
    assert batch.ids_hash == (ps.hashes[1], ps.hashes[0], ps.hashes[1])
    with pytest.raises(ValueError, match="at least one prompt"):
        PromptSet([], tiny_model.family.tokenize)


# --- held-out eval -------------------------------------------------------------------------------


class FakeRewards:
    """A reward engine (diffrl.engines.RewardEngineProtocol) with fixed per-row scores."""

    def __init__(self, per_scorer: dict[str, list[float]], weights: dict[str, float]) -> None:
        self.per_scorer = {k: torch.tensor(v) for k, v in per_scorer.items()}
        self.weights = weights
        self.calls = 0

    def check_inputs(self, produced: set[str]) -> None:
        pass

    async def score(self, traj: Trajectory):
        self.calls += 1
        total = sum(self.weights[k] * v for k, v in self.per_scorer.items())
        valid = ~total.isnan()
        rewards = torch.where(valid, total, torch.zeros_like(total))
        return ScoredBatch(traj, rewards, self.per_scorer, valid), {}


def eval_traj(texts: list[str], g: int) -> Trajectory:
    n = len(texts) * g
    prompts = PromptBatch(
        texts=tuple(texts),
        input_ids=torch.ones(len(texts), 2, dtype=torch.long),
        ids_hash=tuple(texts),
        prompt_ids=torch.arange(len(texts)),
    ).repeat(g)
    image = torch.arange(n, dtype=torch.uint8).view(n, 1, 1, 1).expand(n, 4, 4, 3).clone()
    return Trajectory(
        prompts=prompts,
        group=torch.arange(len(texts)).repeat_interleave(g),
        seeds=torch.arange(n),
        x0=torch.zeros(n, 3, 4, 4),
        extra_fields={"image": image},
    )


def test_evaluate_reports_each_scorer_and_the_overall_reward(tmp_path) -> None:
    root = dataset(tmp_path / "d", train_txt="a\n", test_txt="p0\np1\n")
    nan = float("nan")
    rewards = FakeRewards(
        {"clip": [0.2, 0.4, 0.6, nan], "ocr": [1.0, 0.0, 1.0, 1.0]}, {"clip": 1.0, "ocr": 0.5}
    )
    result = asyncio.run(task(root).evaluate(eval_traj(["p0", "p1"], g=2), rewards))
    assert isinstance(result, EvalResult) and rewards.calls == 1
    # each scorer's mean over the samples it scored (NaN = missing, left out)
    assert result.metrics["eval/clip"] == pytest.approx(0.4)
    assert result.metrics["eval/ocr"] == pytest.approx(0.75)
    # the weighted reward's mean over valid samples: (0.7 + 0.4 + 1.1) / 3
    assert result.metrics["eval/overall"] == pytest.approx(2.2 / 3)
    assert set(result.metrics) == {"eval/clip", "eval/ocr", "eval/overall"}
    # the grid: the first sample of each prompt, captioned with its reward where it has one
    assert result.images.shape == (2, 4, 4, 3) and result.images[:, 0, 0, 0].tolist() == [0, 2]
    assert result.captions == ["p0 (0.700)", "p1 (1.100)"]
    assert result.ok == [None, None]


def test_evaluate_with_no_valid_sample_is_nan(tmp_path) -> None:
    root = dataset(tmp_path / "d", train_txt="a\n", test_txt="p0\n")
    nan = float("nan")
    rewards = FakeRewards({"clip": [nan, nan]}, {"clip": 1.0})
    result = asyncio.run(task(root).evaluate(eval_traj(["p0"], g=2), rewards))
    assert result.metrics["eval/clip"] != result.metrics["eval/clip"]  # NaN
    assert result.metrics["eval/overall"] != result.metrics["eval/overall"]
    assert result.captions == ["p0"]  # no reward to show
