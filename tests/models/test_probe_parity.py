"""Contract 1's pipeline-parity probe on every tiny preset of every family with a reference
pipeline: the rollout's transformer inputs equal the family's own diffusers pipeline's, and a
wrong convention, a double shift, reversed time and a flipped velocity each raise."""

from __future__ import annotations

import pytest
import torch

from diffrl.errors import ContractError
from diffrl.models.convention import CONVENTIONS
from diffrl.models.probe import HasReferencePipeline, pipeline_parity
from diffrl.models.registry import FAMILIES, ModelConfig, load_model
from diffrl.rollout.samplers import euler_step, sigma_schedule

TINY = sorted(
    p
    for f in FAMILIES.values()
    if issubclass(f.family_class, HasReferencePipeline)
    for p in f.presets
    if "tiny" in p
)
SHIFT = 3.0


def test_every_diffusers_family_has_a_reference():
    diffusion = [n for n, f in FAMILIES.items() if not hasattr(f.family_class, "decode_text")]
    lacking = [n for n in diffusion if FAMILIES[n].presets and n not in _with_reference()]
    assert lacking == [], f"families without a reference pipeline: {lacking}"


def _with_reference() -> set[str]:
    return {n for n, f in FAMILIES.items() if issubclass(f.family_class, HasReferencePipeline)}


@pytest.fixture(scope="module", params=TINY)
def tiny(request):
    torch.manual_seed(0)
    return load_model(ModelConfig(preset=request.param), "cpu")


def _parity(model, schedule=sigma_schedule, step=euler_step):
    return pipeline_parity(model, schedule, step, 6, SHIFT, "a red circle")


def test_rollout_matches_pipeline(tiny):
    report = _parity(tiny)
    assert report.calls == 2 and report.worst < 1.0
    assert "hidden_states" in report.inputs and any("timestep" in n for n in report.inputs)


def _double_shift(n, shift):
    s = sigma_schedule(n, shift)
    return shift * s / (1 + (shift - 1) * s)


@pytest.mark.parametrize(
    "fault",
    ["double_shift", "reversed_time", "flipped_velocity"],
)
def test_injected_fault_raises(tiny, fault):
    schedule, step = sigma_schedule, euler_step
    if fault == "double_shift":
        schedule = _double_shift
    elif fault == "reversed_time":
        schedule = lambda n, s: sigma_schedule(n, s).flip(0)  # noqa: E731
    else:
        step = lambda x, v, a, b: euler_step(x, -v, a, b)  # noqa: E731
    with pytest.raises(ContractError, match="pipeline parity"):
        _parity(tiny, schedule, step)


@pytest.mark.parametrize("preset", TINY)
def test_bf16_step_direction(preset):
    """In bfloat16 over a 10-step grid a step is about one rounding of the latents, below the
    tolerance on their values: the steps' direction check still sees a flipped velocity, and
    passes the right one."""
    torch.manual_seed(0)
    model = load_model(ModelConfig(preset=preset, dtype="bfloat16"), "cpu")
    report = pipeline_parity(model, sigma_schedule, euler_step, 10, SHIFT, "a red circle")
    assert report.worst < 1.0
    flipped = lambda x, v, a, b: euler_step(x, -v, a, b)  # noqa: E731
    # caught by the direction check, or on the values where a step is larger (H3's audio rows)
    with pytest.raises(ContractError, match="against the pipeline's step|differs"):
        pipeline_parity(model, sigma_schedule, flipped, 10, SHIFT, "a red circle")


def test_wrong_convention_raises(tiny):
    declared = tiny.convention
    try:
        for name, conv in CONVENTIONS.items():
            if name == declared.name:
                continue
            tiny.convention = conv
            with pytest.raises(ContractError, match="pipeline parity"):
                _parity(tiny)
    finally:
        tiny.convention = declared


class _Flagged(torch.nn.Module):
    def forward(self, x, flag: bool = False, scale: float = 1.0):
        return x * scale


def _recorded(**kwargs):
    from diffrl.models.probe import recording

    net = _Flagged()
    with recording(net, 1) as seen:
        net(torch.ones(2), **kwargs)
    return seen


def test_an_input_at_its_default_equals_one_left_out():
    """A pipeline passing ``flag=False`` (forward's default) and diffrl leaving it out make the
    same call; a non-default value left out on one side is still a difference."""
    from diffrl.models.probe import compare_calls

    compare_calls(_recorded(flag=False, scale=1.0), _recorded(), 1e-4, "toy")
    with pytest.raises(ContractError, match="flag: pipeline passes True, diffrl passes False"):
        compare_calls(_recorded(flag=True), _recorded(), 1e-4, "toy")
    with pytest.raises(ContractError, match="scale: pipeline 2.0, diffrl 1.0"):
        compare_calls(_recorded(scale=2.0), _recorded(), 1e-4, "toy")


@pytest.mark.parametrize("preset", ["sd35-tiny", "h3-tiny"])
def test_bf16_another_text_encoding_raises(preset):
    """In bfloat16 tensors are judged by their relative rms difference: text states off by one
    token (a template or drop-index slip) still move the whole tensor."""
    torch.manual_seed(0)
    model = load_model(ModelConfig(preset=preset, dtype="bfloat16"), "cpu")
    own = model.net.encode_uncached

    def shifted(ids):
        out = own(ids)
        return (out[0].roll(1, dims=1), *out[1:])

    model.net.encode_uncached = shifted
    with pytest.raises(ContractError, match="encoder_hidden_states: rel rms"):
        pipeline_parity(model, sigma_schedule, euler_step, 10, SHIFT, "a red circle")
