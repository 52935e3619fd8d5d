"""Shared fixtures: a tiny random TinyDiT (saved as a checkpoint the configs can point at)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import make_actor, make_tiny_model, make_train_batch, tiny_lora_names

from diffrl.models.families.tiny_dit import save_model
from diffrl.models.family import FamilyModel
from diffrl.tasks.shapes.tokenizer import WordTokenizer

# The models here are tiny: one intra-op thread is much faster than fighting over cores.
torch.set_num_threads(1)


@pytest.fixture
def tiny_model() -> FamilyModel:
    return make_tiny_model(0)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved tiny random model; point ``model.checkpoint`` at it."""
    path = tmp_path_factory.mktemp("tiny_model") / "tiny_dit.safetensors"
    save_model(make_tiny_model(0), path)
    return path


@pytest.fixture(scope="session")
def tok() -> WordTokenizer:
    return WordTokenizer()


@pytest.fixture
def actor_factory():
    return make_actor


@pytest.fixture
def train_batch_factory():
    return make_train_batch


@pytest.fixture
def lora_names():
    return tiny_lora_names
