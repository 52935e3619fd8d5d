"""SD3's tiny configuration (sd35-tiny at 32 px: 4x4 latents, dual attention in block 0), loaded
once for the rollout tests that share it (its random init takes seconds on a busy CPU). The
engines copy it, so tests never change it."""

from __future__ import annotations

from functools import cache

from diffrl.models.family import FamilyModel
from diffrl.models.registry import ModelConfig, load_model


@cache
def sd3_tiny() -> FamilyModel:
    return load_model(ModelConfig(family="sd3", preset="sd35-tiny", resolution=32), "cpu")
