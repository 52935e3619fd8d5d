"""actor.lora_compute: on a bf16 model the LoRA factors compute in bf16 while fp32 masters hold
their values of record (optimizer steps, old/EMA blends, export, checkpoints); an fp32 model,
or lora_compute=float32, keeps peft's fp32 factors. Checked on the tiny DiT in bf16 on a CPU."""

from __future__ import annotations

import copy

import torch
from tiny_models import make_actor, make_tiny_model, make_train_batch

# bf16 factors against fp32 ones on the same bf16 base: the LoRA branch rounded to 8 bits
LOSS_RTOL = 2e-2


def bf16_model():
    return make_tiny_model(0).to(torch.bfloat16)


def lora_weights(actor, adapter="default"):
    return {n: p for n, p in actor.model.named_parameters() if "lora_" in n and f".{adapter}." in n}


def test_bf16_model_computes_in_bf16_with_fp32_masters():
    actor = make_actor(bf16_model(), ema_decay=0.9)
    assert actor.masters, "a bf16 model under lora_compute=auto keeps fp32 masters"
    for adapter in ("default", "old", "ema"):
        for n, w in lora_weights(actor, adapter).items():
            assert w.dtype == torch.bfloat16, n
            m = actor.masters[w]
            assert m.dtype == torch.float32 and torch.equal(m.to(torch.bfloat16), w)
    assert all(p.dtype == torch.float32 for p in actor.params)  # the optimizer steps masters
    fp32 = make_actor(make_tiny_model(0))
    assert not fp32.masters and all(p.dtype == torch.float32 for p in fp32.params)
    explicit = make_actor(bf16_model(), lora_compute="float32")
    assert not explicit.masters
    assert all(w.dtype == torch.float32 for w in lora_weights(explicit).values())


def test_gradients_accumulate_in_fp32_and_the_step_updates_both_copies():
    actor = make_actor(bf16_model(), micro_batch=2, ema_decay=0.9)
    before = {n: actor.masters[w].clone() for n, w in lora_weights(actor).items()}
    seen = []
    real_update = actor._update

    def spy(total, metrics):
        seen.extend(p.grad for p in actor.params)
        return real_update(total, metrics)

    actor._update = spy
    m = actor.train_step(make_train_batch(4))
    assert m["actor/grad_norm"] > 0 and "actor/skipped_nonfinite" not in m
    assert seen and all(g is not None and g.dtype == torch.float32 for g in seen)
    for n, w in lora_weights(actor).items():
        master = actor.masters[w]
        assert w.grad is None  # moved into the master's gradient by the hook
        assert torch.equal(master.to(torch.bfloat16), w), n  # the factors follow the masters
    moved = [not torch.equal(actor.masters[w], before[n]) for n, w in lora_weights(actor).items()]
    assert any(moved)
    # the EMA blends the fp32 masters, and its bf16 factors follow
    for w in lora_weights(actor, "ema").values():
        assert torch.equal(actor.masters[w].to(torch.bfloat16), w)


def test_bf16_loss_is_close_to_fp32_factors_and_export_reads_masters():
    model = bf16_model()
    fast = make_actor(copy.deepcopy(model))
    plain = make_actor(copy.deepcopy(model), lora_compute="float32")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a non-zero adapter, the same fp32 values in both
        for (n, p), (_, q) in zip(
            fast.model.named_parameters(), plain.model.named_parameters(), strict=True
        ):
            if "lora_" in n:
                v = torch.randn(p.shape, generator=g) * 0.1
                q.copy_(v)
                fast.masters.get(p, p).copy_(v)
        fast._sync_from_masters()
    batch = make_train_batch(4)
    losses = []
    for actor in (fast, plain):
        gen = torch.Generator().manual_seed(7)
        mb = batch.select(torch.arange(4))
        with torch.no_grad():
            loss, _ = actor.algorithm.loss(actor, mb, actor.algo_cfg, gen)
        losses.append(float(loss))
    assert abs(losses[0] - losses[1]) <= LOSS_RTOL * abs(losses[1])
    a, b = fast.export_weights(), plain.export_weights()
    for name, d in a.deltas.items():  # the fp32 masters, exactly the fp32 actor's factors
        assert d.a.dtype == torch.float32
        torch.testing.assert_close(d.a, b.deltas[name].a, rtol=0, atol=0)
        torch.testing.assert_close(d.b, b.deltas[name].b, rtol=0, atol=0)


def test_checkpoint_round_trip_keeps_the_fp32_masters():
    actor = make_actor(bf16_model(), micro_batch=2)
    actor.train_step(make_train_batch(4))
    saved, state = actor.adapter_tensors(), actor.state_dict()
    assert all(t.dtype == torch.float32 for t in saved.values())
    fresh = make_actor(bf16_model(), micro_batch=2)
    fresh.load_state(saved, state)
    for n, w in lora_weights(fresh).items():
        torch.testing.assert_close(fresh.masters[w], saved[n], rtol=0, atol=0)
        assert torch.equal(fresh.masters[w].to(torch.bfloat16), w)
    # both continue identically
    a = actor.train_step(make_train_batch(4, seed=1))
    b = fresh.train_step(make_train_batch(4, seed=1))
    assert a["actor/loss"] == b["actor/loss"]
