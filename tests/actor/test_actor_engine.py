"""The actor: LoRA adapters 'default' (trained) and 'old' (frozen), the token-drift contract,
non-finite steps."""

from __future__ import annotations

import copy
import io
import types

import pytest
import torch

from diffrl.actor.engine import NonFiniteLoss
from diffrl.errors import ContractError, DiffrlError
from diffrl.types import TrainBatch


def lora_weights(actor, adapter: str) -> dict[str, torch.Tensor]:
    out = {}
    for name, layer in actor.layers.items():
        out[name + ".A"] = layer.lora_A[adapter].weight.detach().clone()
        out[name + ".B"] = layer.lora_B[adapter].weight.detach().clone()
    return out


def probe(batch: TrainBatch):
    x = torch.randn(batch.x0.shape, generator=torch.Generator().manual_seed(3))
    return x, torch.linspace(0.1, 0.9, len(batch)), batch.input_ids


def test_adapters_start_identical_and_inactive(
    tiny_model, actor_factory, train_batch_factory
) -> None:
    base = copy.deepcopy(tiny_model)
    actor = actor_factory(tiny_model)
    d, o = lora_weights(actor, "default"), lora_weights(actor, "old")
    for k in d:
        assert torch.equal(d[k], o[k]), k
        if k.endswith(".B"):
            assert not d[k].any()  # B == 0: the adapters start as the base model
    assert any(d[k].abs().sum() > 0 for k in d if k.endswith(".A"))
    x, sigma, ids = probe(train_batch_factory(3))
    with torch.no_grad():
        ref = base(x, sigma, ids)
        for adapter in ("default", "old", None):
            torch.testing.assert_close(actor.velocity(x, sigma, ids, adapter=adapter), ref)
    # only 'default' is trainable
    names = {n for n, p in actor.model.named_parameters() if p.requires_grad}
    assert names and all(".default." in n for n in names)
    assert sum(p.numel() for p in actor.params) == sum(v.numel() for v in d.values())


def test_train_step_changes_only_default(tiny_model, actor_factory, train_batch_factory) -> None:
    base = copy.deepcopy(tiny_model)
    actor = actor_factory(tiny_model)
    old0, default0 = lora_weights(actor, "old"), lora_weights(actor, "default")
    base_params = {
        n: p.detach().clone() for n, p in actor.model.named_parameters() if "lora_" not in n
    }
    metrics = actor.train_step(train_batch_factory(4))
    assert actor.version == 1
    assert metrics["actor/grad_norm"] > 0 and torch.isfinite(torch.tensor(metrics["actor/loss"]))
    old1, default1 = lora_weights(actor, "old"), lora_weights(actor, "default")
    for k in old0:
        assert torch.equal(old0[k], old1[k]), k
    changed = sorted(k for k in default0 if not torch.equal(default0[k], default1[k]))
    # B starts at 0, so the first step's gradient reaches only B (dL/dA = B^T ... = 0)
    assert changed == sorted(k for k in default0 if k.endswith(".B"))
    for n, p in actor.model.named_parameters():
        if "lora_" not in n:
            assert torch.equal(p, base_params[n]), n
    x, sigma, ids = probe(train_batch_factory(3))
    with torch.no_grad():
        v_base = base(x, sigma, ids)
        torch.testing.assert_close(actor.velocity(x, sigma, ids, adapter="old"), v_base)
        assert (actor.velocity(x, sigma, ids, adapter="default") - v_base).abs().max() > 1e-5
        # adapter=None is the base model with LoRA disabled, also after training
        torch.testing.assert_close(actor.velocity(x, sigma, ids, adapter=None), v_base)
    actor.train_step(train_batch_factory(4, seed=1))
    default2 = lora_weights(actor, "default")
    assert all(not torch.equal(default2[k], default1[k]) for k in default1)  # now A moves too
    # the 'old' forward does not leave 'old' trainable or 'default' inactive
    assert all(".default." in n for n, p in actor.model.named_parameters() if p.requires_grad)


def mse_algorithm():
    """A deterministic per-sample-mean loss (no noise draws)."""

    def loss(policy, batch, cfg, gen):
        sigma = torch.full((len(batch),), 0.5)
        v = policy.velocity(batch.x0, sigma, batch.input_ids)
        per = (v - batch.x0).pow(2).flatten(1).mean(1) * batch.optimality
        return per.mean(), {"mse/n": float(len(batch))}

    return types.SimpleNamespace(loss=loss, diagnostics=None, partial_backward=False)


def test_micro_batches_accumulate_to_the_full_batch_gradient(
    tiny_model, actor_factory, train_batch_factory
) -> None:
    batch = train_batch_factory(5)
    whole = actor_factory(
        copy.deepcopy(tiny_model), micro_batch=64, algorithm=mse_algorithm(), lr=1e-3
    )
    parts = actor_factory(
        copy.deepcopy(tiny_model), micro_batch=2, algorithm=mse_algorithm(), lr=1e-3
    )
    parts.model.load_state_dict(whole.model.state_dict())  # peft draws A randomly per model
    for _ in range(2):  # two steps, so A (not only B) gets gradient
        m_whole, m_parts = whole.train_step(batch), parts.train_step(batch)
        assert m_parts["actor/loss"] == pytest.approx(m_whole["actor/loss"], rel=1e-5)
        assert m_parts["actor/grad_norm"] == pytest.approx(m_whole["actor/grad_norm"], rel=1e-4)
        # compare gradients, not post-Adam weights: Adam divides by sqrt(v), so float
        # summation-order noise on a near-zero gradient element can move that weight by ~lr
        # the absolute bound scales with the largest gradient of any factor: a factor whose
        # gradient cancels to ~1e-6 of the others' still sums terms of their size (seen on the
        # CI VM: 2.8e-10 apart where that factor's own largest element was 5.4e-6)
        scale = max(float(g.grad.abs().max()) for g in whole.params)
        for gp, gw in zip(parts.params, whole.params, strict=True):
            torch.testing.assert_close(gp.grad, gw.grad, rtol=1e-4, atol=1e-6 * scale)
    # metrics are sample-weighted means over micro-batches: (2*2 + 2*2 + 1*1) / 5
    assert m_parts["mse/n"] == pytest.approx(9 / 5)
    assert m_whole["mse/n"] == pytest.approx(5.0)
    # weights: Adam's first step is lr * sign(g) for every element, so an element whose
    # gradient is float noise may step the other way; all but a handful must agree tightly
    whole_t = whole.adapter_tensors()
    for k, v in parts.adapter_tensors().items():
        close = torch.isclose(v, whole_t[k], rtol=1e-4, atol=1e-6)
        assert (~close).sum() <= max(2, v.numel() // 1000), k


def test_update_old_copy_and_average(tiny_model, actor_factory, train_batch_factory) -> None:
    actor = actor_factory(tiny_model)
    actor.train_step(train_batch_factory(4))
    old0, default = lora_weights(actor, "old"), lora_weights(actor, "default")
    actor.update_old(decay=0.5)
    half = lora_weights(actor, "old")
    for k in old0:
        torch.testing.assert_close(half[k], 0.5 * old0[k] + 0.5 * default[k])
    actor.update_old(decay=0.0)
    copied = lora_weights(actor, "old")
    for k in old0:
        assert torch.equal(copied[k], default[k]), k
    assert lora_weights(actor, "default").keys() == default.keys()
    for k, v in lora_weights(actor, "default").items():
        assert torch.equal(v, default[k])  # update_old never touches 'default'


def test_token_drift_raises(tiny_model, actor_factory, train_batch_factory) -> None:
    actor = actor_factory(tiny_model)
    batch = train_batch_factory(4)
    ids = batch.input_ids.clone()
    ids[2, 0] = (ids[2, 0] + 1) % 10 + 2  # ids changed after the data stage hashed them
    drifted = TrainBatch(
        input_ids=ids,
        ids_hash=batch.ids_hash,
        x0=batch.x0,
        optimality=batch.optimality,
        seeds=batch.seeds,
    )
    before = lora_weights(actor, "default")
    with pytest.raises(ContractError, match=r"rows \[2\]"):
        actor.train_step(drifted)
    assert actor.version == 0
    for k, v in lora_weights(actor, "default").items():
        assert torch.equal(v, before[k])


def test_empty_batch_is_skipped(tiny_model, actor_factory, train_batch_factory) -> None:
    actor = actor_factory(tiny_model)
    b = train_batch_factory(4)
    empty = TrainBatch(
        input_ids=b.input_ids[:0],
        ids_hash=(),
        x0=b.x0[:0],
        optimality=b.optimality[:0],
        seeds=b.seeds[:0],
    )
    assert actor.train_step(empty) == {"actor/skipped_empty": 1.0}
    assert actor.version == 0


def nan_algorithm():
    """An algorithm whose loss is NaN (but still connected to the trainable parameters)."""

    def loss(policy, batch, cfg, gen):
        v = policy.velocity(batch.x0, torch.full((len(batch),), 0.5), batch.input_ids)
        return v.mean() * float("nan"), {}

    return types.SimpleNamespace(loss=loss, diagnostics=None, partial_backward=False)


def test_nonfinite_steps_are_skipped_then_raise(
    tiny_model, actor_factory, train_batch_factory
) -> None:
    actor = actor_factory(tiny_model, algorithm=nan_algorithm(), max_nonfinite_steps=3)
    batch = train_batch_factory(2)
    before = lora_weights(actor, "default")
    for i in range(2):
        m = actor.train_step(batch)
        assert m["actor/skipped_nonfinite"] == 1.0
        assert actor.nonfinite == i + 1
    assert actor.version == 0
    for k, v in lora_weights(actor, "default").items():
        assert torch.equal(v, before[k]), k  # no update was applied
    with pytest.raises(NonFiniteLoss, match="3 steps"):
        actor.train_step(batch)


def test_a_finite_step_resets_the_nonfinite_count(
    tiny_model, actor_factory, train_batch_factory
) -> None:
    actor = actor_factory(tiny_model, max_nonfinite_steps=2)
    good, bad = actor.algorithm, nan_algorithm()
    batch = train_batch_factory(2)
    actor.algorithm = bad
    actor.train_step(batch)
    actor.algorithm = good
    actor.train_step(batch)
    assert actor.nonfinite == 0 and actor.version == 1
    actor.algorithm = bad
    actor.train_step(batch)  # 1 in a row again: no raise
    with pytest.raises(NonFiniteLoss):
        actor.train_step(batch)


def test_state_round_trip(tiny_model, actor_factory, train_batch_factory) -> None:
    batch = train_batch_factory(4)
    actor = actor_factory(copy.deepcopy(tiny_model))
    actor.train_step(batch)
    tensors = actor.adapter_tensors()
    buf = io.BytesIO()  # as a checkpoint does: plain tensors and numbers, weights_only load
    torch.save(actor.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf, weights_only=True)
    assert any(".old." in n for n in tensors) and any(".default." in n for n in tensors)
    other = actor_factory(copy.deepcopy(tiny_model))
    other.load_state(tensors, state)
    assert other.version == 1
    for k, v in other.adapter_tensors().items():
        assert torch.equal(v, tensors[k]), k
    # the next step is identical (same optimizer moments and same training-noise RNG)
    actor.train_step(batch)
    other.train_step(batch)
    for k, v in other.adapter_tensors().items():
        torch.testing.assert_close(v, actor.adapter_tensors()[k], rtol=0, atol=1e-6)
    with pytest.raises(DiffrlError, match="lacks adapter tensors"):
        other.load_state({k: v for k, v in tensors.items() if "lora_B" not in k}, state)


def test_unknown_lora_target_raises(tiny_model) -> None:
    from diffrl.actor.engine import ActorConfig, ActorEngine
    from diffrl.algorithms.diffusion_nft import NFTConfig
    from diffrl.algorithms.registry import get_algorithm

    def build(targets):
        ActorEngine(
            copy.deepcopy(tiny_model),
            ActorConfig(),
            targets,
            get_algorithm("diffusion_nft"),
            NFTConfig(),
            torch.device("cpu"),
        )

    with pytest.raises(ValueError, match="attn.nope"):  # peft: nothing matched at all
        build(["attn.nope"])
    with pytest.raises(DiffrlError, match=r"\['attn.nope'\] matched no module"):
        build(["attn.qkv", "attn.nope"])  # one matches: diffrl names the one that does not


def test_ema_adapter_averages_the_iterates(tiny_model, actor_factory, train_batch_factory) -> None:
    """ema_decay d: a plain mean of the iterates for the first 1/(1-d) steps, then an EMA; the
    ema adapter stays frozen, held-out eval reads it, and a checkpoint round-trips it."""
    batch = train_batch_factory(4)
    actor = actor_factory(copy.deepcopy(tiny_model), ema_decay=0.6)
    assert (
        actor.eval_adapter == "ema"
        and actor_factory(copy.deepcopy(tiny_model)).eval_adapter == "default"
    )
    iterates = [lora_weights(actor, "default")]
    ema = lora_weights(actor, "ema")
    for k in ema:
        assert torch.equal(ema[k], iterates[0][k]), k
    for step in range(1, 5):
        actor.train_step(batch)
        iterates.append(lora_weights(actor, "default"))
        d = min(0.6, step / (step + 1))  # 1/2, 2/3 -> 0.6, 0.6, 0.6
        ema = {k: d * ema[k] + (1 - d) * iterates[-1][k] for k in ema}
        if step == 1:  # the mean of the first two iterates
            for k in ema:
                torch.testing.assert_close(ema[k], (iterates[0][k] + iterates[1][k]) / 2)
    got = lora_weights(actor, "ema")
    for k in ema:
        torch.testing.assert_close(got[k], ema[k], rtol=1e-5, atol=1e-7)
    assert not torch.equal(got[k], iterates[-1][k])
    assert all(".default." in n for n, p in actor.model.named_parameters() if p.requires_grad)
    exported = actor.export_weights("ema")
    assert exported.adapter == "ema" and set(exported.deltas) == set(actor.layers)
    other = actor_factory(copy.deepcopy(tiny_model), ema_decay=0.6)
    other.load_state(actor.adapter_tensors(), actor.state_dict())
    for k, v in lora_weights(other, "ema").items():
        assert torch.equal(v, got[k]), k


def test_ema_decay_out_of_range_is_a_config_error() -> None:
    from diffrl.config import load_config
    from diffrl.errors import ConfigError

    for bad in ("1.0", "-0.1"):
        with pytest.raises(ConfigError, match=r"actor\.ema_decay.*\[0, 1\)"):
            load_config("recipes/shapes_grpo_fast.yaml", [f"actor.ema_decay={bad}"])


def test_resume_switching_the_ema_on_or_off(tiny_model, actor_factory, train_batch_factory) -> None:
    """A checkpoint without an EMA resumed with one starts the average at the resumed weights;
    one with an EMA resumed without it drops it. Either way the trained weights come back."""
    batch = train_batch_factory(4)
    plain = actor_factory(copy.deepcopy(tiny_model))
    plain.train_step(batch)
    with_ema = actor_factory(copy.deepcopy(tiny_model), ema_decay=0.9)
    with_ema.load_state(plain.adapter_tensors(), plain.state_dict())
    trained = lora_weights(plain, "default")
    for k, v in lora_weights(with_ema, "ema").items():
        assert torch.equal(v, trained[k]), k
    for k, v in lora_weights(with_ema, "default").items():
        assert torch.equal(v, trained[k]), k
    with_ema.train_step(batch)
    again = actor_factory(copy.deepcopy(tiny_model))
    again.load_state(with_ema.adapter_tensors(), with_ema.state_dict())
    assert again.version == 2
    for k, v in lora_weights(again, "default").items():
        assert torch.equal(v, lora_weights(with_ema, "default")[k]), k


def test_lr_schedules_against_their_formulas() -> None:
    import math

    from diffrl.actor.engine import ActorConfig, lr_factor

    const = ActorConfig(lr_warmup=3)
    assert [lr_factor(const, k) for k in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    lin = ActorConfig(lr_schedule="linear", lr_horizon=10, lr_end=0.2)
    assert lr_factor(lin, 0) == 1.0 and lr_factor(lin, 10) == lr_factor(lin, 99) == 0.2
    assert math.isclose(lr_factor(lin, 5), 0.2 + 0.8 * 0.5)
    cos = ActorConfig(lr_schedule="cosine", lr_horizon=12, lr_warmup=2)
    assert lr_factor(cos, 0) == 1 / 3 and lr_factor(cos, 2) == 1.0
    for k in range(2, 15):  # the decay runs over the 10 steps after the warm-up
        want = 0.5 * (1 + math.cos(math.pi * min(1.0, (k - 2) / 10)))
        assert math.isclose(lr_factor(cos, k), want, abs_tol=1e-12), k


def test_the_scheduled_lr_is_applied_and_resumes_exactly(
    tiny_model, actor_factory, train_batch_factory
) -> None:
    batch = train_batch_factory(4)
    kw = dict(lr_schedule="cosine", lr_horizon=4)
    actor = actor_factory(copy.deepcopy(tiny_model), **kw)
    lr = actor.cfg.lr
    lrs = [actor.train_step(batch)["actor/lr"] for _ in range(2)]
    assert lrs == [pytest.approx(lr * f) for f in (1.0, 0.5 * (1 + 2**-0.5))]
    assert actor.opt.param_groups[0]["lr"] == pytest.approx(lrs[1])
    other = actor_factory(copy.deepcopy(tiny_model), **kw)
    other.load_state(actor.adapter_tensors(), actor.state_dict())
    assert other.train_step(batch)["actor/lr"] == actor.train_step(batch)["actor/lr"]
    assert other.train_step(batch)["actor/lr"] == pytest.approx(lr * 0.5 * (1 - 2**-0.5))


def test_lr_schedule_config_errors() -> None:
    from diffrl.build import actor_with_horizon
    from diffrl.config import load_config
    from diffrl.errors import ConfigError

    recipe = "recipes/shapes_grpo_fast.yaml"
    for bad, match in (
        ("actor.lr_schedule=step", r"actor\.lr_schedule.*constant"),
        ("actor.lr_end=1.5", r"actor\.lr_end.*\[0, 1\]"),
        ("actor.lr_warmup=-1", r"actor\.lr_warmup"),
    ):
        with pytest.raises(ConfigError, match=match):
            load_config(recipe, [bad])
    with pytest.raises(ConfigError, match=r"actor\.lr_warmup.*< lr_horizon = 5"):
        load_config(recipe, ["actor.lr_schedule=cosine", "actor.lr_horizon=5", "actor.lr_warmup=5"])
    cfg = load_config(recipe, ["actor.lr_schedule=cosine", "run.steps=50", "actor.minibatches=2"])
    assert actor_with_horizon(cfg).lr_horizon == 100  # 0 = the whole run, in optimizer steps
    cfg = load_config(recipe, ["actor.lr_schedule=linear", "run.steps=3", "actor.lr_warmup=6"])
    with pytest.raises(ConfigError, match=r"actor\.lr_warmup.*run\.steps x actor\.minibatches"):
        actor_with_horizon(cfg)
    assert actor_with_horizon(load_config(recipe)).lr_horizon == 0  # constant: left alone
