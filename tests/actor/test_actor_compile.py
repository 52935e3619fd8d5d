"""actor.compile: the transformer's blocks, compiled after peft wraps them, give the eager
losses and gradients under every adapter the losses switch to (NFT's ``old``, the KL
reference with adapters disabled, the trained ``default``), and never fall back to eager at
dynamo's recompile limit."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from diffrl.algorithms.diffusion_nft import NFTConfig
from diffrl.algorithms.flow_grpo import GRPOConfig, prepare
from diffrl.algorithms.registry import get_algorithm
from diffrl.models import compile as C
from diffrl.rollout.engine import RolloutConfig, RolloutEngine
from diffrl.tasks import Prompt, PromptSet
from diffrl.tasks.shapes.prompts import split_prompts
from diffrl.types import ScoredBatch

# inductor's CPU code against eager, fp32: the same maths, fused and reordered
LOSS_TOL = dict(rtol=1e-5, atol=1e-6)
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module", autouse=True)
def inductor() -> None:
    if missing := C.cpu_toolchain():  # compile_blocks would leave the blocks eager
        pytest.skip(f"inductor needs a C++ compiler: {missing}")
    try:
        torch.compile(lambda x: x * 2 + 1)(torch.ones(3))
    except Exception as e:  # a toolchain inductor cannot use: skip, as without one
        pytest.skip(f"inductor cannot compile here: {type(e).__name__}: {e}")


def grpo_batch(model):
    """An SDE rollout with CFG of 2 prompts x 2, prepared for FlowGRPO."""
    cfg = RolloutConfig(group_size=2, num_steps=4, sampler="sde", keep_latents=True, cfg_scale=2.0)
    engine = RolloutEngine(model, cfg, [], torch.device("cpu"))
    texts = [Prompt(p.text) for p in split_prompts("train")[:2]]
    traj = asyncio.run(engine.generate(PromptSet(texts, model.family.tokenize).all(), seed=5))
    rewards = torch.tensor([0.0, 1.0, 0.3, 0.6])
    scored = ScoredBatch(traj, rewards, {"r": rewards}, torch.ones(4, dtype=torch.bool))
    return prepare(scored, GRPOConfig())


def eager_and_compiled(model, actor_factory, algorithm, algo_cfg):
    """Two actors over copies of ``model`` with the same adapters, ``default`` and ``old``
    made different (LoRA B drawn at random), so a compiled graph that ran a stale adapter
    would show in the loss."""
    kw = dict(algorithm=get_algorithm(algorithm), algo_cfg=algo_cfg)
    eager = actor_factory(copy.deepcopy(model), **kw)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in eager.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    compiled = actor_factory(copy.deepcopy(model), compile=True, **kw)
    compiled.model.load_state_dict(eager.model.state_dict())
    assert compiled.compiled == len(model.net.blocks) and eager.compiled == 0
    return eager, compiled


def loss_and_grads(actor, batch):
    actor.opt.zero_grad(set_to_none=True)
    value, _ = actor.algorithm.loss(actor, batch, actor.algo_cfg, torch.Generator().manual_seed(0))
    value.backward()
    return value.detach(), [p.grad.clone() for p in actor.params]


@pytest.mark.parametrize("algorithm", ["diffusion_nft", "flow_grpo"])
def test_compiled_actor_gives_the_eager_losses_and_gradients(
    algorithm, tiny_model, actor_factory, train_batch_factory
) -> None:
    if algorithm == "diffusion_nft":  # old (no grad), default, and the KL reference
        cfg = NFTConfig(timesteps_per_sample=2, kl_coef=0.5)
        batch = train_batch_factory(4)
    else:  # default and the KL reference, each a CFG forward of 2 x 4 rows
        cfg = GRPOConfig(timestep_fraction=0.5, kl_coef=0.5, clip_range=0.2)
        batch = grpo_batch(tiny_model)
    eager, compiled = eager_and_compiled(tiny_model, actor_factory, algorithm, cfg)
    torch._dynamo.reset()
    want = loss_and_grads(eager, batch)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for _ in range(2):  # the second pass runs the graphs the adapter switches compiled
            got = loss_and_grads(compiled, batch)
            torch.testing.assert_close(got[0], want[0], **LOSS_TOL)
            for g, w in zip(got[1], want[1], strict=True):
                torch.testing.assert_close(g, w, **GRAD_TOL)
    assert any(g.abs().sum() > 0 for g in want[1])
    # old/default/disabled x grad mode: more graphs than one, all compiled
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 3


@pytest.mark.skipif(not C.PER_CALL_LIMIT, reason="this torch.compile takes no recompile_limit")
def test_blocks_compile_with_their_own_recompile_limit(
    tiny_model, actor_factory, train_batch_factory, monkeypatch
) -> None:
    """NFT with a KL term compiles 4 graphs of the one block forward; a limit below that falls
    back to eager, which fail_on_recompile_limit_hit turns into an error here."""
    monkeypatch.setattr(C, "RECOMPILE_LIMIT", 2)
    cfg = NFTConfig(timesteps_per_sample=1, kl_coef=0.5)
    actor = actor_factory(
        copy.deepcopy(tiny_model), compile=True, algo_cfg=cfg,
        algorithm=get_algorithm("diffusion_nft"),
    )  # fmt: skip
    torch._dynamo.reset()
    with (
        torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=8),
        pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit),
    ):
        loss_and_grads(actor, train_batch_factory(4))


def test_an_older_torch_raises_the_process_wide_limit(tiny_model, monkeypatch) -> None:
    monkeypatch.setattr(C, "PER_CALL_LIMIT", False)
    with torch._dynamo.config.patch(recompile_limit=8):  # restored after
        C.compile_blocks(copy.deepcopy(tiny_model))
        assert torch._dynamo.config.recompile_limit == C.RECOMPILE_LIMIT


def test_a_net_without_block_lists_is_refused() -> None:
    model = torch.nn.Module()
    model.net = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="actor.compile: Sequential has no block lists"):
        C.compile_blocks(model, "actor.compile")
