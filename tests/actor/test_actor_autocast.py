"""actor.autocast=bfloat16: the policy's forwards compute under bf16 autocast on an fp32 model,
each velocity comes back in the model's dtype, and the parameters, their gradients and the
optimizer state stay fp32. The tiny DiT keeps attention in fp32 under autocast on the CPU
(torch's CPU flash-attention backward is slow in bf16). Checked on the tiny DiT on a CPU."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny_models import make_actor, make_tiny_model, make_train_batch

from diffrl.config import ConfigError, load_config

# bf16 matmuls (8-bit mantissa) against fp32 ones, on a velocity of unit scale
VELOCITY_ATOL = 5e-2
LOSS_RTOL = 2e-2


def nonzero_lora(*actors) -> None:
    """The same random, non-zero adapter values in every actor (a fresh B is zero)."""
    g = torch.Generator().manual_seed(1)
    named = [dict(a.model.named_parameters()) for a in actors]
    with torch.no_grad():
        for n, p in named[0].items():
            if "lora_" in n:
                v = torch.randn(p.shape, generator=g) * 0.1
                for params in named:
                    params[n].copy_(v)


def test_config_accepts_bfloat16_and_names_a_bad_value():
    assert load_config(None, ["actor.autocast=bfloat16"]).actor.autocast == "bfloat16"
    with pytest.raises(ConfigError, match="actor.autocast"):
        load_config(None, ["actor.autocast=float16"])


def test_velocity_is_close_to_fp32_and_comes_back_in_the_model_dtype():
    model = make_tiny_model(0)
    fast = make_actor(copy.deepcopy(model), autocast="bfloat16")
    plain = make_actor(copy.deepcopy(model))
    nonzero_lora(fast, plain)
    batch = make_train_batch(4)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(batch.x0.shape, generator=g)
    sigma = torch.rand(len(batch), generator=g)
    for adapter in ("default", "old", None):
        with torch.no_grad():
            a = fast.velocity(x, sigma, batch.input_ids, adapter=adapter)
            b = plain.velocity(x, sigma, batch.input_ids, adapter=adapter)
        assert a.dtype == torch.float32
        assert not torch.equal(a, b), "the forward must really have run in bf16"
        torch.testing.assert_close(a, b, rtol=0, atol=VELOCITY_ATOL)


def test_training_under_autocast_keeps_fp32_state_and_tracks_the_fp32_loss():
    model = make_tiny_model(0)
    fast = make_actor(copy.deepcopy(model), autocast="bfloat16", micro_batch=2)
    plain = make_actor(copy.deepcopy(model), micro_batch=2)
    nonzero_lora(fast, plain)
    before = {n: p.detach().clone() for n, p in fast.model.named_parameters() if ".default." in n}
    a = fast.train_step(make_train_batch(4))
    b = plain.train_step(make_train_batch(4))
    assert "actor/skipped_nonfinite" not in a and a["actor/grad_norm"] > 0
    assert abs(a["actor/loss"] - b["actor/loss"]) <= LOSS_RTOL * abs(b["actor/loss"])
    assert all(p.dtype == torch.float32 for p in fast.params)
    for state in fast.opt.state.values():
        assert all(t.dtype == torch.float32 for t in state.values() if t.ndim)
    after = dict(fast.model.named_parameters())
    assert any(not torch.equal(after[n], v) for n, v in before.items()), "no parameter moved"
    assert all(torch.isfinite(after[n]).all() for n in before)


def test_tiny_dit_attention_stays_fp32_under_cpu_autocast(monkeypatch):
    model = make_tiny_model(0).net
    seen = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append(q.dtype)
        return real(q, k, v, **kw)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    x = torch.randn(2, 3, 32, 32)
    ids = torch.randint(1, 10, (2, 6))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, torch.rand(2), ids)
    assert out.dtype == torch.bfloat16  # the blocks' matmuls did run in bf16
    assert seen and all(d == torch.float32 for d in seen)
