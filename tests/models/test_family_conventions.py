"""Contract 1 on real families: the data-progress adapter (t = 1 - sigma, velocity flipped, as
MiniMax-H3's DiT expects) wrapped around a real diffusers family, the start-up probe on every
family (conclusive on a trained SD3 class, inconclusive with a reason on random weights), and a
wrong declaration stopping the run before training."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from diffrl.build import build, reconstruction_probe
from diffrl.config import load_config
from diffrl.errors import ContractError
from diffrl.models.family import FamilyModel
from diffrl.models.registry import ModelConfig, load_model
from diffrl.tasks import TaskConfig, build_task

pytest.importorskip("diffusers")


class DataProgressNet(nn.Module):
    """A diffusers family's native net presented in the data-progress convention: it reads
    t = 1 - sigma and returns the data-ward velocity x0 - eps (what an H3-style DiT does)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner  # native sigma_x1000: timestep = 1000 sigma, output eps - x0

    def forward(self, x, t, input_ids):
        return -self.inner(x, 1000.0 * (1.0 - t), input_ids)


@pytest.fixture(scope="module")
def trained_sd3() -> FamilyModel:
    """The shipped ShapesBench base on a real SD3Transformer2DModel (trained, so the probe
    can decide)."""
    return load_model(ModelConfig(preset="sd3-shapes", weights="builtin:shapes_sd3"))


def test_data_progress_adapter_wraps_a_real_family(trained_sd3):
    fam = trained_sd3.family
    wrapped = FamilyModel(DataProgressNet(trained_sd3.net), fam, "data_progress")
    g = torch.Generator().manual_seed(0)
    x = torch.randn((3, *fam.latent_shape()), generator=g)
    sigma = torch.tensor([0.2, 0.5, 0.9])
    ids = fam.tokenize(["a red circle", "two blue squares", "a green triangle"]).input_ids
    with torch.no_grad():
        torch.testing.assert_close(wrapped(x, sigma, ids), trained_sd3(x, sigma, ids))


def test_probe_is_conclusive_on_a_trained_family_and_catches_wrong_declarations(trained_sd3):
    task = build_task(TaskConfig(task="shapes"))
    report = reconstruction_probe(task, trained_sd3)
    assert report.conclusive and report.cosine > 0.5 and not report.flipped_time_better
    net, fam = trained_sd3.net, trained_sd3.family
    # the adapter declared right passes; the same network declared natively fails loudly
    assert reconstruction_probe(
        task, FamilyModel(DataProgressNet(net), fam, "data_progress")
    ).conclusive
    with pytest.raises(ContractError, match="data_progress|sigma_x1000"):
        reconstruction_probe(task, FamilyModel(DataProgressNet(net), fam, "sigma_x1000"))
    with pytest.raises(ContractError, match="wrong way|1 - sigma"):
        reconstruction_probe(task, FamilyModel(net, fam, "data_progress"))


@pytest.mark.parametrize("preset", ["sd35-tiny", "flux1-tiny", "qwen-image-tiny", "wan-tiny"])
def test_probe_on_random_weights_says_why_it_is_inconclusive(preset):
    torch.manual_seed(0)
    model = load_model(ModelConfig(preset=preset))
    report = reconstruction_probe(build_task(TaskConfig(task="shapes")), model)
    assert not report.conclusive and "random or untrained" in report.reason


def test_wrong_declaration_stops_the_run_before_training(tmp_path):
    cfg = load_config(
        "recipes/shapes_sd3_nft.yaml",
        ["model.convention=data_progress", f"run.out_dir={tmp_path}", "run.tensorboard=false"],
    )
    with pytest.raises(ContractError, match="data_progress"):
        build(cfg)
    assert not (tmp_path / "shapes_sd3_nft").exists()  # nothing was trained or written
