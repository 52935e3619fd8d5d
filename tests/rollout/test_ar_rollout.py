"""The autoregressive rollout: batched KV-cache sampling whose recorded log-probs are the actor's,
records the channel carries as they are, and weight sync from the actor (contract 2)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from diffrl.actor.engine import ActorConfig, ActorEngine, AdapterConfig
from diffrl.algorithms.diffusion_nft import NFTConfig
from diffrl.algorithms.registry import get_algorithm
from diffrl.channel.transferqueue import decode, encode
from diffrl.engines import RolloutEngineProtocol
from diffrl.errors import ConfigError
from diffrl.models.families.qwen_omni import LORA_TARGETS
from diffrl.models.family import NO_TOKEN
from diffrl.models.registry import ModelConfig, load_model
from diffrl.rollout.ar import ARRolloutEngine
from diffrl.rollout.engine import RolloutConfig
from diffrl.sync.receipt import load_verified
from diffrl.tasks.base import Prompt, PromptSet
from diffrl.types import Trajectory, bytes_to_text

CPU = torch.device("cpu")
QUESTIONS = ["<image> how many shapes are there ?", "<image> what colour is the circle ?"]


@pytest.fixture(scope="module")
def omni():
    torch.manual_seed(0)
    return load_model(ModelConfig(preset="qwen-omni-tiny"), CPU)


def _prompts(model) -> PromptSet:
    images = np.zeros((2, 32, 32, 3), np.uint8)
    images[0, 4:12, 4:12] = (220, 40, 40)
    images[1, 20:28, 8:16] = (50, 90, 235)
    cond = model.family.encode_conditions([{"image": i} for i in images])
    return PromptSet([Prompt(q) for q in QUESTIONS], model.family.tokenize, cond)


def _targets(model) -> list[str]:
    return [n for n, _ in model.named_modules() if n.endswith(LORA_TARGETS)]


def test_completions_stream_with_their_log_probs(omni) -> None:
    cfg = RolloutConfig(group_size=3, num_steps=5, sampler="sde", max_batch=3)
    engine = ARRolloutEngine(omni, cfg, _targets(omni), CPU)
    assert isinstance(engine, RolloutEngineProtocol)
    prompts = _prompts(omni)
    traj = asyncio.run(engine.generate(prompts.all(), seed=7))  # two micro-batches, joined
    assert traj.x0.shape == traj.log_probs.shape == (6, 5) and traj.x0.dtype == torch.int64
    assert traj.group.tolist() == [0, 0, 0, 1, 1, 1] and bool(traj.sde_mask.all())
    assert traj.step_spec.kind == "token" and traj.step_spec.noise_level == 1.0
    assert traj.extra_fields["image"].shape == (6, 32, 32, 3)
    assert bytes_to_text(traj.extra_fields["text"]) == omni.family.decode_text(traj.x0)
    # the rollout's recorded log-probs are the training forward's on the same tokens
    batch = prompts.all().repeat(3)
    again = omni(traj.x0, 1.0, batch.input_ids, batch.cond)
    torch.testing.assert_close(again, traj.log_probs, atol=1e-5, rtol=0)
    assert ((traj.log_probs == 0) == (traj.x0 == NO_TOKEN)).all()
    # a record crosses the TransferQueue channel as it is
    back = decode({k: v[None] for k, v in encode(traj).items()})  # one TQ row
    assert isinstance(back, Trajectory) and torch.equal(back.x0, traj.x0)
    # greedy decoding (the held-out eval's "ode" sampler) takes the argmax: no seed matters
    a = asyncio.run(engine.generate(prompts.all(), seed=1, sampler="ode", group_size=1))
    b = asyncio.run(engine.generate(prompts.all(), seed=2, sampler="ode", group_size=1))
    assert torch.equal(a.x0, b.x0) and not bool(a.sde_mask.any())


def test_weight_sync_from_the_actor(omni) -> None:
    import copy

    base = copy.deepcopy(omni)
    cfg = RolloutConfig(group_size=2, num_steps=4, sampler="sde")
    engine = ARRolloutEngine(base, cfg, _targets(base), CPU)
    actor = ActorEngine(
        base, ActorConfig(lora=AdapterConfig(rank=2, alpha=2.0)), list(LORA_TARGETS),
        get_algorithm("diffusion_nft"), NFTConfig(), CPU,  # any: only its adapters are used
    )  # fmt: skip
    with torch.no_grad():
        for n, p in actor.model.named_parameters():
            if "lora_B.default" in n:
                p.normal_(0, 0.3)
    actor.version = 1
    metrics = load_verified(engine, actor.export_weights())
    assert metrics["sync/receipt_frac"] < 1.0 and engine.version == 1  # verified
    prompts = _prompts(omni).all()
    traj = asyncio.run(engine.generate(prompts, seed=3))
    batch = prompts.repeat(2)
    with torch.no_grad():
        trained = actor.token_log_probs(traj.x0, 1.0, batch.input_ids, cond=batch.cond)
        reference = actor.token_log_probs(traj.x0, 1.0, batch.input_ids, None, batch.cond)
    torch.testing.assert_close(trained, traj.log_probs, atol=1e-5, rtol=0)
    assert not torch.allclose(reference, traj.log_probs, atol=1e-3)


def test_diffusion_only_settings_are_refused(omni) -> None:
    with pytest.raises(ConfigError, match="share_base"):
        ARRolloutEngine(omni, RolloutConfig(share_base=True), _targets(omni), CPU, lora_rank=4)
    with pytest.raises(ConfigError, match="cfg_scale"):
        ARRolloutEngine(omni, RolloutConfig(cfg_scale=2.0), _targets(omni), CPU)
