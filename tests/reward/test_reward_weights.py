"""Rewards that would train nothing (issue 41, findings 4 and 5): weights that are not finite,
too large or all zero are refused with the config; a score checked as the float32 reward it
becomes (a float64 1e300 is finite until the cast makes it inf) is the scorer's non-finite score,
never a NaN loss."""

from __future__ import annotations

import pytest
import torch
from test_reward_pool import make_traj, pool, score

from diffrl.cli import main
from diffrl.config import load_config
from diffrl.errors import ConfigError
from diffrl.reward.pool import MAX_WEIGHT, RewardFailure, ScorerConfig
from diffrl.reward.scorer import ScoreResult, register_scorer

RECIPE = "recipes/shapes_nft.yaml"


class Float64Scorer:
    """Scores as a float64 tensor, as a scorer computing in numpy or Python floats may."""

    needs = frozenset({"image"})

    def __init__(self, values) -> None:
        self.name, self.values = "test_weights_f64", list(values)

    async def score(self, traj) -> ScoreResult:
        scores = torch.tensor(self.values, dtype=torch.float64)
        return ScoreResult(scores, torch.ones(len(scores), dtype=torch.bool))


register_scorer("test_weights_f64")(Float64Scorer)


@pytest.mark.parametrize("weight", ["inf", "-.inf", "nan", "1e300", "-2e6"])
def test_a_weight_that_is_not_finite_or_bounded_is_refused_with_the_config(weight) -> None:
    with pytest.raises(ConfigError, match=r"weight.*finite number with \|weight\| <= 1e\+06"):
        load_config(RECIPE, [f"reward.scorers=[{{name: shapes, weight: {weight}}}]"])
    ScorerConfig(weight=MAX_WEIGHT).validate()  # the bound itself is allowed
    ScorerConfig(weight=-MAX_WEIGHT).validate()


def test_all_weights_zero_is_refused() -> None:
    scorers = (
        "reward.scorers=[{name: shapes, weight: 0}, {name: jpeg_incompressibility, weight: 0}]"
    )
    with pytest.raises(ConfigError, match="at least one scorer needs a non-zero weight"):
        load_config(RECIPE, [scorers])


@pytest.mark.parametrize(
    "override",
    ["reward.scorers=[{name: shapes, weight: 1e300}]", "rollout.group_size=1"],
)
def test_the_cli_refuses_before_writing_anything(override, tmp_path, capsys) -> None:
    """The real ``diffrl train``: exit status 2, one line, no run directory."""
    assert main(["train", RECIPE, f"run.out_dir={tmp_path}", override]) == 2
    err = capsys.readouterr().err
    assert "diffrl: error:" in err and "Traceback" not in err
    assert override.split("=")[0].split(".")[-1] in err  # names the key
    assert list(tmp_path.iterdir()) == []


def test_a_float64_score_that_overflows_float32_is_the_scorers_nonfinite_score() -> None:
    values = [1.0, 1e300, 2.0, 3.0]  # finite as float64, inf as the float32 reward
    with pytest.raises(RewardFailure, match=r"'test_weights_f64' returned 1 missing/NaN") as e:
        score(pool(ScorerConfig("test_weights_f64", params={"values": values})))
    assert "1e+300 x weight 1 is not finite in float32" in str(e.value)
    # optional: its sample is marked missing, as a NaN score is, and the rest are trained on
    batch, _ = score(
        pool(
            ScorerConfig("test_pool_fixed"),
            ScorerConfig("test_weights_f64", required=False, params={"values": values}),
        )
    )
    assert batch.valid.tolist() == [True, False, True, True]
    assert torch.isfinite(batch.rewards[batch.valid]).all()
    assert batch.rewards[~batch.valid].isnan().all()


def test_a_score_whose_weighted_value_overflows_is_marked_too() -> None:
    values = [1.0, 1e33, 2.0, 3.0]  # finite in float32; x 1e6 is not
    with pytest.raises(RewardFailure, match="1e\\+33 x weight 1e\\+06 is not finite"):
        score(pool(ScorerConfig("test_weights_f64", weight=1e6, params={"values": values})))


def test_a_sum_of_scores_that_overflows_is_an_error_naming_the_weights() -> None:
    big = {"values": [3e38, 1.0, 1.0, 1.0]}  # each fits float32, their sum does not
    p = pool(
        ScorerConfig("test_weights_f64", params=big),
        ScorerConfig("test_weights_f64", params=big, label="again"),
    )
    with pytest.raises(RewardFailure, match="weighted sum of the scores overflows float32"):
        score(p, make_traj())
