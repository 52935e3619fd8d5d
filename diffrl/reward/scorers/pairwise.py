"""Pairwise preferences within a group, turned into rewards: Pref-GRPO's win rates.

Pref-GRPO (Wang et al. 2025, "Pref-GRPO: Pairwise Preference Reward-based GRPO for Stable
Text-to-Image Reinforcement Learning", arXiv:2508.20751) compares the G images of one prompt
pairwise with a preference model and rewards each by its win rate,

    w_i = 1/(G-1) * sum_{j != i} P(x_i > x_j),

which GRPO then normalises in the group as any reward. A pointwise reward's small score gaps,
blown up by the group's std ("illusory advantage"), become at most one rank apart here.

``pairwise_rank`` takes the preference from a pointwise judge, any per-sample scorer (the
ShapesBench verifier, ``pickscore``, an ``http`` reward): x_i beats x_j when its
score is higher, a tie is half a win (diffrl's choice), so w_i is the sample's rank in its
group scaled to [0, 1] ("rank-based PickScore"). ``vlm_pairwise`` (in vlm.py) asks a VLM
judge A-vs-B.

What the paper's reference does that diffrl does differently: its judge is a trained pairwise
preference model (UnifiedReward-Think) asked about each pair; ``pairwise_rank`` derives every
pair's preference from one pointwise score per sample (G judge calls, not G(G-1)/2), which is
exact for a judge whose preferences are those of a score; ``vlm_pairwise`` asks a general VLM
served over the OpenAI API, by default about each pair in both orders so that a leaning to
one position cancels (the reference's order handling was not checked here).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from diffrl.reward.scorer import ScoreResult, build_scorer, is_group_scorer, register_scorer
from diffrl.types import Trajectory


def win_rates(wins: Tensor, games: Tensor) -> Tensor:
    """wins (G, G): wins[i, j] = how often i beat j (ties count half to each); games (G, G):
    how often i and j were compared (symmetric). -> (G,) w_i = sum_j wins[i, j] / sum_j
    games[i, j]; NaN for a sample never compared, 0.5 for a group of one (no rival: neutral)."""
    if len(wins) == 1:
        return torch.full((1,), 0.5)
    played = games.sum(dim=1)
    return torch.where(played > 0, wins.sum(dim=1) / played.clamp(min=1), float("nan")).float()


def score_preferences(scores: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """(wins, games) of every pair of valid samples judged by their scores (higher wins,
    equal is half a win each); an invalid sample plays no game."""
    s = scores.double()
    wins = (s[:, None] > s[None, :]).double() + 0.5 * (s[:, None] == s[None, :]).double()
    games = (valid[:, None] & valid[None, :]).double()
    games.fill_diagonal_(0)
    return wins * games, games


@register_scorer("pairwise_rank")
class PairwiseRankScorer:
    """Pref-GRPO win rates from a pointwise judge: params ``judge`` (a registered per-sample
    scorer's name, e.g. ``shapes``) and ``judge_params`` (its params). Needs what the judge
    needs; the judge's metrics are passed on under ``judge/``."""

    groupwise = True

    def __init__(self, judge: str = "", judge_params: dict[str, Any] | None = None) -> None:
        if not judge:
            raise ValueError(
                "scorer 'pairwise_rank' needs params.judge: the name of a per-sample scorer "
                "whose scores decide each pair (e.g. shapes, clip, http)"
            )
        self.judge = build_scorer(judge, dict(judge_params or {}))
        if is_group_scorer(self.judge):
            raise ValueError(
                f"params.judge={judge!r} is a group scorer; pairwise_rank needs a per-sample one"
            )
        self.name = "pairwise_rank"
        self.needs = self.judge.needs

    async def score_group(self, traj: Trajectory) -> ScoreResult:
        judged = await self.judge.score(traj)  # type: ignore[union-attr]
        ok = judged.valid & torch.isfinite(judged.scores)
        rates = win_rates(*score_preferences(judged.scores, ok))
        rates = torch.where(ok, rates, float("nan"))
        metrics = {f"judge/{k}": v for k, v in judged.metrics.items()}
        return ScoreResult(rates, torch.isfinite(rates), metrics)

    async def close(self) -> None:
        close = getattr(self.judge, "close", None)
        if close is not None:
            result = close()
            if hasattr(result, "__await__"):
                await result
