"""Helpers for scorer tests: a trajectory carrying only the prompts and media a scorer reads."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
import torch
from torch import Tensor

from diffrl.types import PromptBatch, Trajectory


def build_media_traj(texts: Sequence[str], **fields: Tensor) -> Trajectory:
    """A Trajectory of ``len(texts)`` samples with the given extra fields (e.g. image=...).

    Token ids and latents are placeholders: scorers read only ``prompts.texts`` and
    ``extra_fields``, so these tests need neither a tokenizer nor a model.
    """
    n = len(texts)
    prompts = PromptBatch(
        texts=tuple(texts),
        input_ids=torch.zeros(n, 1, dtype=torch.long),
        ids_hash=tuple("0" for _ in range(n)),
        prompt_ids=torch.arange(n),
    )
    return Trajectory(
        prompts=prompts,
        group=torch.arange(n),
        seeds=torch.arange(n),
        x0=torch.zeros(n, 3, 4, 4),
        sigmas=torch.linspace(1, 0, 2),
        policy_version=0,
        extra_fields=dict(fields),
    )


@pytest.fixture
def media_traj() -> Callable[..., Trajectory]:
    """``media_traj(texts, image=..., audio=..., video=...)`` -> Trajectory."""
    return build_media_traj
