"""``model.attention``: the switch reaches each kind of call site, the start-up check compares
against SDPA math and can fail, and the backends that cannot run here refuse in one line."""

from __future__ import annotations

import copy

import pytest
import torch

from diffrl.errors import ConfigError, FieldError
from diffrl.models import attention as attn
from diffrl.models.registry import ModelConfig, load_model


def forward_ops(model, x, sigma, ids) -> tuple[set[str], torch.Tensor]:
    """The attention aten ops one forward of ``model`` runs, and its output."""
    out = []
    with torch.no_grad():
        ops = attn.attention_ops(lambda: out.append(model(x, sigma, ids)))
    return set(ops), out[0]


def inputs(model, n=2):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, *model.family.latent_shape(), generator=g)
    ids = model.family.null_ids()[None].repeat(n, 1)
    return x, torch.tensor([0.3, 0.8])[:n], ids


MATH = {"aten::_scaled_dot_product_attention_math"}
CPU_FLASH = {
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
}


def test_unknown_choice_names_the_key() -> None:
    with pytest.raises(FieldError, match="attention='fa3': must be one of"):
        ModelConfig(attention="fa3").validate()


@pytest.mark.parametrize(
    "cfg",
    [
        pytest.param({}, id="tiny_dit-direct"),  # diffrl's own SDPA call
        pytest.param({"preset": "sd35-tiny"}, id="sd3-joint-processor"),  # direct, diffusers
        pytest.param({"preset": "h3-tiny"}, id="h3-dispatcher"),  # diffusers' dispatcher
    ],
)
def test_the_switch_reaches_the_model_and_keeps_its_output(cfg, tiny_checkpoint) -> None:
    if not cfg:
        cfg = {"checkpoint": str(tiny_checkpoint)}
    model = load_model(ModelConfig(**cfg, attention="math"))
    rec = model.attention_record
    assert rec.used == "math" and rec.kernels == sorted(MATH) and rec.checks
    assert all(c.error <= attn.BOUNDS[torch.float32] for c in rec.checks)
    x, sigma, ids = inputs(model)
    # what actually runs in the model's forward, not only in the check, and in a deep copy of
    # it (the rollout's copies)
    ops, out = forward_ops(model, x, sigma, ids)
    assert ops == MATH
    assert forward_ops(copy.deepcopy(model), x, sigma, ids)[0] == MATH
    attn.apply(model, "sdpa")  # back to PyTorch's own choice: its CPU flash kernel
    ops, default = forward_ops(model, x, sigma, ids)
    assert ops == {"aten::_scaled_dot_product_flash_attention_for_cpu"}
    torch.testing.assert_close(out, default)


def packed_call(kind: str = "dispatch") -> attn.Call:
    """H3-style packing: two sequences (5 and 7 rows) in one, a block-diagonal key mask; in the
    diffusers dispatcher's (B, S, H, D) layout or SDPA's (B, H, S, D)."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 12, 2, 16, generator=g) for _ in range(3))
    if kind == "sdpa":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    seg = torch.tensor([0] * 5 + [1] * 7)
    mask = (seg[:, None] == seg[None, :])[None, None]  # (1, 1, 12, 12)
    return attn.Call(kind, q, k, v, {"attn_mask": mask})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flash_cpu_and_flex_match_math_on_a_packed_mask(dtype) -> None:
    (flash,) = attn.check_calls([packed_call("sdpa")], "flash", dtype)  # PyTorch's CPU flash
    assert flash.error <= attn.BOUNDS[dtype]
    if dtype == torch.bfloat16:  # the yardstick: SDPA math itself loses bits in bf16
        assert flash.math_error > 1e-4
    call = packed_call()
    (flex,) = attn.check_calls([call], "flex", dtype, backward=False)  # no flex backward on CPU
    assert flex.error <= attn.BOUNDS[dtype]
    # the mask matters: without it the answer differs by far more than the bound
    unmasked = attn.Call("dispatch", call.q, call.k, call.v, {})
    got = attn._fwd_bwd(unmasked, "flex", dtype, None)
    ref = attn._fwd_bwd(call, "math", torch.float64, None)
    assert attn._rel(got, ref) > 10 * attn.BOUNDS[dtype]


def test_a_backend_that_cannot_take_the_mask_is_refused() -> None:
    # diffusers' flash route (as PyTorch's flash on the GPU) takes no mask: H3's packed rows
    with pytest.raises(ConfigError, match=r"'flash' fails .*mask \(1, 1, 12, 12\) bool.*sdpa"):
        attn.check_calls([packed_call()], "flash", torch.float32)


def test_an_error_past_the_bound_is_refused(monkeypatch) -> None:
    monkeypatch.setitem(attn.BOUNDS, torch.float32, 1e-12)
    with pytest.raises(ConfigError, match=r"'model.attention' = 'flash': error .* exceeds the"):
        attn.check_calls([packed_call("sdpa")], "flash", torch.float32)


def test_flex_backward_on_the_cpu_is_refused_at_load(tiny_checkpoint) -> None:
    with pytest.raises(ConfigError, match="'flex' fails on this model's attention.*backward"):
        load_model(ModelConfig(checkpoint=str(tiny_checkpoint), attention="flex"))


@pytest.mark.parametrize(
    ("choice", "needs"),
    [
        ("cudnn", "needs a CUDA device"),
        ("efficient", "needs a CUDA device"),
        ("flash3", "needs FlashAttention-3 .*hopper"),
        ("flash4", "needs FlashAttention-4 .*pip install flash-attn-4"),
    ],
)
def test_what_cannot_run_here_is_one_line(choice, needs, tiny_checkpoint) -> None:
    if choice in attn.PACKAGES and attn._installed(attn.PACKAGES[choice][0]):
        pytest.skip(f"{choice}'s package is installed here")
    with pytest.raises(ConfigError, match=f"'model.attention' = '{choice}' {needs}") as e:
        load_model(ModelConfig(checkpoint=str(tiny_checkpoint), attention=choice))
    assert "\n" not in str(e.value)


def test_auto_on_the_cpu_is_sdpa_and_says_which_kernel(tiny_checkpoint) -> None:
    model = load_model(ModelConfig(checkpoint=str(tiny_checkpoint), attention="auto"))
    rec = model.attention_record
    assert rec.used == "sdpa" and rec.kernels == sorted(CPU_FLASH)
    assert "auto -> sdpa" in rec.line() and "flash_attention_for_cpu" in rec.line()
