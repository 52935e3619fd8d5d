"""Back-propagating a loss one timestep at a time (``partial_backward``) trains exactly as one
backward over the summed loss: the same metrics and the same adapter weights after a step."""

from __future__ import annotations

import asyncio
import copy
import sys
from dataclasses import replace

import pytest
import torch

from diffrl.algorithms.diffusion_dpo import DPOConfig
from diffrl.algorithms.diffusion_nft import NFTConfig
from diffrl.algorithms.flow_grpo import GRPOConfig, prepare
from diffrl.algorithms.registry import add_part, get_algorithm
from diffrl.rollout.engine import RolloutConfig, RolloutEngine
from diffrl.tasks import Prompt, PromptSet
from diffrl.tasks.shapes.prompts import split_prompts
from diffrl.types import ScoredBatch


def grpo_batch(model):
    engine = RolloutEngine(
        model,
        RolloutConfig(group_size=3, num_steps=4, sampler="sde", keep_latents=True),
        [],
        torch.device("cpu"),
    )
    texts = [Prompt(p.text) for p in split_prompts("train")[:2]]
    traj = asyncio.run(engine.generate(PromptSet(texts, model.family.tokenize).all(), seed=3))
    r = torch.linspace(0, 1, len(traj))
    return prepare(ScoredBatch(traj, r, {"r": r}, torch.ones(len(traj), dtype=torch.bool)),
                   GRPOConfig(kl_coef=0.04))  # fmt: skip


CASES = {
    "diffusion_nft": lambda model, tb: (NFTConfig(timesteps_per_sample=3, kl_coef=0.1), tb(6)),
    "diffusion_dpo": lambda model, tb: (DPOConfig(timesteps_per_pair=3), tb(6)),
    "flow_grpo": lambda model, tb: (GRPOConfig(kl_coef=0.04), grpo_batch(model)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_partial_backward_trains_as_one_backward(
    name, tiny_model, actor_factory, train_batch_factory
) -> None:
    algo = get_algorithm(name)
    assert algo.partial_backward
    algo_cfg, batch = CASES[name](tiny_model, train_batch_factory)
    results = []
    for variant in (algo, replace(algo, partial_backward=False)):
        torch.manual_seed(0)  # the same LoRA init
        model = copy.deepcopy(tiny_model)
        actor = actor_factory(model, algorithm=variant, algo_cfg=algo_cfg, micro_batch=4)
        actor.gen.manual_seed(7)
        grads = _grads_at_step(actor)
        before = [p.detach().clone() for p in actor.params]
        metrics = actor.train_step(batch)
        weights = [p.detach().clone() for p in actor.params]
        results.append((metrics, grads, weights, before))
    (m_part, g_part, w_part, _), (m_whole, g_whole, w_whole, before) = results
    assert m_part.keys() == m_whole.keys()
    for k in m_whole:
        assert m_part[k] == pytest.approx(m_whole[k], rel=1e-5, abs=1e-7), k
    # The gradients are the claim: the same sums in another order, so they agree to fp32
    # rounding of the largest terms (atol relative to the largest gradient).
    scale = max(float(g.abs().max()) for g in g_whole)
    assert scale > 0
    for a, b in zip(g_part, g_whole, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * scale)
    # AdamW's first step moves an element by lr g/(|g| + eps): where |g| is near eps (1e-8), a
    # rounding error in g moves the weight by up to lr/eps times that error (seen: 2.1e-7 on one
    # of 128 elements at lr 1e-2). So the weights are held to 1e-4 x lr, against a step that
    # moves them by up to lr.
    atol = 1e-4 * actor.cfg.lr
    for a, b in zip(w_part, w_whole, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=atol)
    moved = max(float((b - w0).abs().max()) for b, w0 in zip(w_whole, before, strict=True))
    assert moved > 100 * atol  # the step did train, far beyond the tolerance


def _grads_at_step(actor) -> list[torch.Tensor]:
    """Filled with a copy of every trained parameter's gradient as the optimizer steps."""
    seen: list[torch.Tensor] = []
    step = actor.opt.step

    def recording_step(*args, **kwargs):
        seen[:] = [p.grad.detach().clone() for p in actor.params]
        return step(*args, **kwargs)

    actor.opt.step = recording_step
    return seen


def test_add_part_hands_each_part_to_backward_and_detaches_it() -> None:
    w = torch.tensor(2.0, requires_grad=True)
    seen = []
    total = torch.zeros(())
    for k in (1.0, 3.0):
        total = add_part(total, k * w, lambda part: (seen.append(float(part)), part.backward()))
    assert seen == [2.0, 6.0] and float(total) == 8.0 and not total.requires_grad
    assert float(w.grad) == 4.0
    assert add_part(torch.zeros(()), w * 1.0, None).requires_grad


def test_host_reads_do_not_grow_with_micro_batches(
    tiny_model, actor_factory, train_batch_factory, monkeypatch
) -> None:
    """diffrl's update reads float values off the device a fixed number of times, however
    many micro-batches it runs: losses and metrics stay tensors until the step's one sync (what a
    GPU needs to queue micro-batches without stalling). Counted: reads of floating-point
    tensors made by diffrl's own code (index lists and torch's optimizer are not device reads)."""
    reads = {"n": 0}
    for name in ("item", "tolist", "__float__", "__bool__"):
        orig = getattr(torch.Tensor, name)

        def counted(self, *a, _orig=orig, **k):
            caller = sys._getframe(1).f_globals.get("__name__", "")
            if self.is_floating_point() and caller.startswith("diffrl."):
                reads["n"] += 1
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)
    batch = train_batch_factory(8)
    counts = []
    for micro in (8, 2):
        torch.manual_seed(0)
        actor = actor_factory(copy.deepcopy(tiny_model), micro_batch=micro)
        reads["n"] = 0
        actor.train_step(batch)
        counts.append(reads["n"])
    assert counts == [2, 2], counts  # the guard's (loss, grad norm), then the metrics
