"""Contract 1: the declared time convention is converted at the model boundary and checked
by a probe against ground truth."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from diffrl.errors import ContractError
from diffrl.models.convention import VelocityModel, get_convention, probe_convention
from diffrl.models.registry import ModelConfig, load_model
from diffrl.tasks import TaskConfig, build_task


class SigmaOracle(nn.Module):
    """Knows the clean batch x0: in diffrl's convention x = x0 + sigma * (eps - x0), so the
    exact velocity is (x - x0) / sigma, with sigma the network's own time input."""

    def __init__(self, x0: Tensor) -> None:
        super().__init__()
        self.x0 = x0

    def forward(self, x: Tensor, t: Tensor, input_ids: Tensor) -> Tensor:
        return (x - self.x0) / t.view(-1, 1, 1, 1)


class DataProgressOracle(SigmaOracle):
    """The same oracle in the data-progress convention: time t = 1 - sigma, v = x0 - eps."""

    def forward(self, x: Tensor, t: Tensor, input_ids: Tensor) -> Tensor:
        return -(x - self.x0) / (1 - t).view(-1, 1, 1, 1)


class MirroredTimeOracle(SigmaOracle):
    """Right velocity sign, but reads its time input as 1 - sigma."""

    def forward(self, x: Tensor, t: Tensor, input_ids: Tensor) -> Tensor:
        return (x - self.x0) / (1 - t).view(-1, 1, 1, 1)


def batch(n: int = 6):
    g = torch.Generator().manual_seed(0)
    return torch.rand(n, 3, 8, 8, generator=g) * 2 - 1, torch.ones(n, 4, dtype=torch.long)


def test_velocity_model_converts_time_and_sign() -> None:
    seen = {}

    class Record(nn.Module):
        def forward(self, x, t, ids):
            seen["t"] = t.clone()
            return torch.full_like(x, 2.0)

    x, sigma, ids = torch.zeros(2, 3, 4, 4), torch.tensor([0.25, 0.5]), torch.ones(2, 3).long()
    for name, t_expected, value in (
        ("sigma", [0.25, 0.5], 2.0),
        ("sigma_x1000", [250.0, 500.0], 2.0),
        ("data_progress", [0.75, 0.5], -2.0),
    ):
        out = VelocityModel(Record(), name)(x, sigma, ids)
        assert seen["t"].tolist() == pytest.approx(t_expected), name
        assert (out == value).all(), name
    with pytest.raises(ContractError, match="unknown time convention 'nope'"):
        get_convention("nope")


def test_probe_accepts_the_right_declaration() -> None:
    x0, ids = batch()
    report = probe_convention(VelocityModel(SigmaOracle(x0), "sigma"), x0, ids)
    assert report.cosine == pytest.approx(1.0, abs=1e-5)
    assert report.conclusive and not report.flipped_time_better and report.reason == ""
    report = probe_convention(VelocityModel(DataProgressOracle(x0), "data_progress"), x0, ids)
    assert report.cosine == pytest.approx(1.0, abs=1e-5)


def test_probe_rejects_a_wrong_declaration() -> None:
    x0, ids = batch()
    with pytest.raises(ContractError, match="data_progress"):
        probe_convention(VelocityModel(SigmaOracle(x0), "data_progress"), x0, ids)
    with pytest.raises(ContractError, match="wrong way"):
        probe_convention(VelocityModel(DataProgressOracle(x0), "sigma"), x0, ids)


def test_probe_catches_mirrored_time_with_the_right_sign() -> None:
    x0, ids = batch()
    with pytest.raises(ContractError, match="1 - sigma"):
        probe_convention(VelocityModel(MirroredTimeOracle(x0), "sigma"), x0, ids)


def test_probe_is_inconclusive_for_an_untrained_model() -> None:
    class Zero(nn.Module):
        def forward(self, x, t, ids):
            return torch.zeros_like(x)

    x0, ids = batch()
    report = probe_convention(VelocityModel(Zero(), "data_progress"), x0, ids)
    assert not report.conclusive  # no raise, whatever was declared
    assert "untrained" in report.reason  # and it says why it could not decide


@pytest.mark.parametrize("base", ["builtin:shapes_dit", "builtin:shapes_dit_v2"])
def test_shipped_base_model_passes_its_probe(base: str) -> None:
    data = build_task(TaskConfig(task="shapes")).probe_data(n=8)
    model = load_model(ModelConfig(checkpoint=base))
    x0 = model.family.encode_pixels(data.pixels)  # pixel space: the rendered images themselves
    ids = model.family.tokenize(data.texts).input_ids
    report = probe_convention(model, x0, ids)
    assert report.conclusive and report.cosine > 0.5
    wrong = load_model(ModelConfig(checkpoint=base, convention="data_progress"))
    with pytest.raises(ContractError):
        probe_convention(wrong, x0, ids)


def test_probe_catches_a_time_scale_mis_declaration() -> None:
    """sigma vs 1000 sigma keeps the velocity's direction (cos > 0, the mirror check passes),
    so only refitting under the other conventions shows it; the error names the right one."""
    x0, ids = batch()
    with pytest.raises(ContractError, match="'sigma_x1000' fits the data worse.*'sigma'"):
        probe_convention(VelocityModel(SigmaOracle(x0), "sigma_x1000"), x0, ids)
    model = VelocityModel(SigmaOracle(x0), "sigma")
    assert probe_convention(model, x0, ids).conclusive
    assert model.convention.name == "sigma"  # the refit leaves the declaration in place
