"""``rollout.engine=scheduler``: a training step's rollout through request-level continuous
batching (``diffrl/rollout/scheduler.py``) instead of fixed micro-batches.

Each prompt's G samples are one request carrying the whole plan the micro-batch engine would
run for them: its rows' seeds, the step's sigma schedule and SDE mask, and the group's noise
(``RolloutEngine.noise``: the initial state and every step's noise, shared-init, antithetic
and tree noise applied within the group), drawn when the request is admitted. Requests are
admitted between two denoising steps as soon as the token budget has room, so a finishing
group's slot is refilled at once rather than at the next micro-batch; each request that
finishes is decoded and put on the channel at once (whole groups; those that finish in the
same forward together, so with the default budget the parts are the micro-batch engine's), and
the reward pool (``reward/edges.py``) starts scoring it while the others still denoise.

The trajectories equal the micro-batch engine's, row for row, up to the float noise of matmuls
over other batch sizes (tests/rollout/test_scheduled_rollout.py states the tolerance): same
latents, per-step log-probs, SDE mask, step versions (an offered update is applied between two
forwards), seeds and group ids. Groups arrive in the order they finish (prompt order when
every request has the same step count).
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import torch
from torch import Tensor

from diffrl.channel import Channel
from diffrl.rollout.samplers import coarse_tail, sigma_schedule, tree_noise_blocks
from diffrl.rollout.scheduler import ContinuousBatcher, Finished, Request, tokens
from diffrl.types import PromptBatch, StepSpec, Trajectory, check_token_hashes


class RolloutEngine(Protocol):
    """What of ``rollout.engine.RolloutEngine`` this module reads (it imports this one)."""

    family: Any
    cfg: Any  # its RolloutConfig

    def batcher(
        self, token_budget: int, max_wait_s: float = 0.0, packed: bool | None = None
    ) -> ContinuousBatcher: ...
    def noise(
        self, seeds: Tensor, g: int, mask: Tensor, t_steps: int, shape: tuple[int, ...] = ()
    ) -> tuple[Tensor, list[int]]: ...
    def step_spec(self) -> StepSpec: ...
    def sde_mask(self, sampler: str, num_steps: int, iteration: int, seed: int) -> Tensor: ...
    def modality_split(self) -> tuple[int, int] | None: ...


async def stream_scheduled(
    engine: RolloutEngine,
    prompts: PromptBatch,
    seeds: Tensor,
    g: int,
    first_prompt: int,
    sigmas: Tensor,
    mask: Tensor,
    channel: Channel,
) -> None:
    """Consumes ``prompts`` (n), their (n*G,) ``seeds``, the step's ``sigmas`` (T+1,) and SDE
    ``mask`` (T,); puts each prompt's ``Trajectory`` on ``channel`` as its request finishes
    (the groups that finish in one forward as one trajectory).
    Waits only on the worker thread (one forward per hop) and on channel back-pressure; the
    caller closes the channel."""
    batch = prompts.repeat(g)
    check_token_hashes(batch, "the rollout engine")  # contract 3, as the micro-batch engine
    shape = tuple(engine.family.latent_shape())
    budget = engine.cfg.token_budget or engine.cfg.max_batch * tokens(shape)
    batcher = engine.batcher(token_budget=budget)
    for k in range(len(prompts)):
        rows = slice(k * g, (k + 1) * g)
        cond = None if batch.cond is None else batch.cond[rows]
        ids = batch.input_ids[k * g]
        batcher.submit(training_request(engine, ids, seeds[rows], shape, sigmas, mask, cond, k))
    while not batcher.idle:
        finished = await asyncio.to_thread(batcher.step)
        # the groups one forward finished go on together (one part per shape and schedule):
        # none waits for another, and a scorer still batches them in one call
        parts: dict[tuple, list[Trajectory]] = {}
        for done in finished:
            key = (done.request.shape, done.request.num_steps)
            parts.setdefault(key, []).append(trajectory(engine, prompts, done, first_prompt))
        for part in parts.values():
            traj = Trajectory.concat(part)
            await channel.put(traj, traj.policy_version)


def training_request(
    engine: RolloutEngine,
    ids: Tensor,
    seeds: Tensor,
    shape: tuple[int, ...],
    sigmas: Tensor,
    mask: Tensor,
    cond: Tensor | None = None,
    rid: int = -1,
) -> Request:
    """One group's request as the training rollout samples it: ``ids`` (L,), ``seeds`` (G,),
    a sample's latent ``shape``, the ``sigmas`` (T+1,) and SDE ``mask`` (T,) it steps by, its
    noise drawn when admitted (``RolloutEngine.noise``), latents kept as ``rollout.keep_latents``
    says, and the runs of bitwise copies the micro-batch engine forwards once (DanceGRPO's
    shared initial noise, a tree's branches)."""
    g, t_steps = len(seeds), len(sigmas) - 1
    after = [1] * t_steps  # a tree's runs of shared noise after each SDE step
    if engine.cfg.tree_noise:
        steps = mask.nonzero().flatten().tolist()
        for i, run in zip(steps, tree_noise_blocks(mask, g), strict=True):
            after[i] = run

    def draw() -> Tensor:  # (G, T+1, *S), in the worker thread
        return engine.noise(seeds, g, mask, t_steps, shape)[0]

    return Request(
        ids, seeds, shape, t_steps, cond, rid=rid, sigmas=sigmas, sde_mask=mask, noise=draw,
        keep_latents=engine.cfg.keep_latents, copies=g if engine.cfg.shared_init_noise else 1,
        after=tuple(after),
    )  # fmt: skip


def trajectory(
    engine: RolloutEngine, prompts: PromptBatch, done: Finished, first_prompt: int
) -> Trajectory:
    """The finished request ``done`` (prompt ``rid`` of ``prompts``) as a one-group
    trajectory, the fields as the micro-batch engine fills them."""
    req, k = done.request, done.request.rid
    g = len(req.seeds)
    assert req.sigmas is not None and req.sde_mask is not None, "set by stream_scheduled"
    return Trajectory(
        prompts=prompts.select(torch.tensor([k])).repeat(g),
        group=torch.full((g,), first_prompt + k, dtype=torch.int64),
        seeds=req.seeds,
        x0=done.x0,
        sigmas=req.sigmas,
        policy_version=done.step_versions[0],  # the first step's: the oldest
        latents=done.latents,
        log_probs=done.log_probs,
        sde_mask=req.sde_mask,
        step_spec=engine.step_spec(),
        step_versions=torch.tensor(done.step_versions, dtype=torch.int64).expand(g, -1).clone(),
        extra_fields=done.media,
        modality_split=engine.modality_split(),
        modality_log_probs=done.modality_log_probs,
    )


def step_plan(
    engine: RolloutEngine, num_steps: int, sampler: str, iteration: int = 0, seed: int = 0
) -> tuple[Tensor, Tensor]:
    """(sigmas (T+1,), SDE mask (T,)) of a rollout of ``num_steps`` as ``RolloutEngine.stream``
    plans a step's (its window, its ODE tail): for requests of several step counts."""
    mask = engine.sde_mask(sampler, num_steps, iteration, seed)
    c = engine.cfg
    return coarse_tail(sigma_schedule(len(mask), c.shift), mask, c.ode_tail_steps, c.shift)
