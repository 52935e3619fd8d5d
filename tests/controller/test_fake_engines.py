"""The synchronous loop (diffrl.controller.sync, run by diffrl.controller.loop) against fake
engines that implement only the Protocols of diffrl.engines: it carries out each algorithm's
weight plan (which adapter the rollout samples with, when ``old`` refreshes, when weights
sync), and it starts step k+1's rollout during update k exactly when the plan says update k
leaves the rollout's weights alone."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

import diffrl.controller.loop as loop
from diffrl.algorithms.registry import get_algorithm
from diffrl.build import Engines
from diffrl.channel import Channel
from diffrl.config import load_config
from diffrl.controller.run_dir import read_metrics
from diffrl.engines import ActorEngineProtocol, RewardEngineProtocol, RolloutEngineProtocol
from diffrl.models.family import TokenBatch, hash_rows
from diffrl.models.probe import ProbeResult
from diffrl.sync.receipt import SyncReceipt, expected_of
from diffrl.sync.weights import LoraDelta, SyncError, SyncReport, WeightUpdate
from diffrl.tasks import EvalResult, Prompt, PromptSet, PromptSource
from diffrl.types import (
    PromptBatch,
    ScoredBatch,
    StepSpec,
    TrainBatch,
    Trajectory,
    concat_rows,
)

# how long an update waits for step k+1's prompts to be asked for: a prefetch asks at once
# (while the update runs); without one they cannot be asked for until the update returns
WAIT_S = 0.5
STEPS_T = 2  # sampler steps of the fake trajectories


def tokenize(texts: list[str]) -> TokenBatch:
    ids = torch.tensor([[2 + len(t), 2 + sum(map(ord, t)) % 50] for t in texts])
    return TokenBatch(ids, ids != 0, hash_rows(ids))


class FakePrompts:
    """The training prompt source; records which steps' prompts were asked for."""

    def __init__(self, prompt_set: PromptSet, per_step: int) -> None:
        self.source = PromptSource(prompt_set, per_step, seed=0)
        self.asked: list[int] = []

    @property
    def first(self) -> int:
        return self.source.first

    def at(self, step: int) -> PromptBatch:
        self.asked.append(step)
        return self.source.at(step)

    def __getattr__(self, name: str):  # observe, state_dict, ...: the real source's
        return getattr(self.source, name)


class FakeRollout:
    """Streams one micro-batch per prompt; records the weights each stream sampled with."""

    def __init__(self, group_size: int) -> None:
        self.g, self.version, self.weights = group_size, 0, None
        self.loads: list[tuple[str, int, float]] = []  # (adapter, version, source of weights)
        self.streams: list[tuple[int, int, float | None]] = []  # (iteration, version, source)

    @property
    def produces(self) -> frozenset[str]:
        return frozenset({"image"})

    def load_weights(self, update: WeightUpdate) -> SyncReport:
        if update.version < self.version:
            raise SyncError(f"stale weight update v{update.version} < current v{self.version}")
        self.version, self.weights = update.version, float(update.deltas["w"].a)
        self.loads.append((update.adapter, update.version, self.weights))
        self.held = expected_of(update)  # it holds what it loaded
        return SyncReport(update.version, update.adapter, 1, 1, 0.0)

    def receipt(self) -> SyncReceipt:
        zero = {k: torch.zeros_like(v) for k, v in self.held.items()}
        return SyncReceipt(self.version, self.held, zero)

    async def stream(
        self, prompts: PromptBatch, seed: int, channel: Channel, *, iteration: int = 0, **kw
    ) -> None:
        self.streams.append((iteration, self.version, self.weights))
        g = kw.get("group_size") or self.g
        try:
            for k in range(len(prompts)):
                traj = fake_traj(prompts.select(torch.tensor([k])).repeat(g), k, seed, self.version)
                await channel.put(traj, traj.policy_version)
                await asyncio.sleep(0)  # a micro-batch's worth of work: let scoring run
        finally:
            channel.close()

    async def generate(self, prompts: PromptBatch, seed: int, **kw) -> Trajectory:
        channel = Channel()
        producer = asyncio.create_task(self.stream(prompts, seed, channel, **kw))
        parts = [t async for t in channel]
        await producer
        return Trajectory.concat(parts)


def fake_traj(prompts: PromptBatch, group: int, seed: int, version: int) -> Trajectory:
    n, shape = len(prompts), (3, 4, 4)
    seeds = torch.arange(n) + seed * 100 + group * 10
    latents = torch.randn((n, STEPS_T + 1, *shape), generator=torch.Generator().manual_seed(seed))
    return Trajectory(
        prompts=prompts,
        group=torch.full((n,), group),
        seeds=seeds,
        x0=latents[:, -1],
        sigmas=torch.linspace(1, 0, STEPS_T + 1),
        policy_version=version,
        latents=latents,
        log_probs=torch.zeros(n, STEPS_T),
        sde_mask=torch.tensor([True, False]),
        step_spec=StepSpec("flow_grpo", 0.7, 1.0, (1, 0)),
        extra_fields={"image": torch.zeros((n, 4, 4, 3), dtype=torch.uint8)},
    )


class FakeRewards:
    def check_inputs(self, produced: set[str]) -> None:
        assert "image" in produced

    def observe_step(self, scored: ScoredBatch) -> None:
        pass

    async def score(self, traj: Trajectory) -> tuple[ScoredBatch, dict[str, float]]:
        rewards = (traj.seeds % 3).float()  # differs within a group: non-zero advantages
        valid = torch.ones(len(traj), dtype=torch.bool)
        return ScoredBatch(traj, rewards, {"fake": rewards}, valid), {"fake/calls": 1.0}


class FakeActor:
    """Counts updates; ``old`` remembers which version it was last copied from; an update waits
    (a little) for the next step's prompts to be asked for, and records whether they were."""

    def __init__(self, prompts: FakePrompts, steps: int) -> None:
        self.prompts, self.steps = prompts, steps
        self.version, self.old_source = 0, 0.0
        self.refreshes: list[tuple[int, float]] = []  # (version, decay)
        self.prefetched: dict[int, bool] = {}  # loop step -> next step's prompts asked for
        self.parts: list[TrainBatch] = []  # the streamed step's parts so far

    @property
    def eval_adapter(self) -> str:
        return "default"

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        assert isinstance(batch, TrainBatch) and len(batch) > 0
        step = self.version  # the loop's 0-based step
        if step + 1 < self.steps:
            deadline = time.monotonic() + WAIT_S
            while step + 1 not in self.prompts.asked and time.monotonic() < deadline:
                time.sleep(0.005)
            self.prefetched[step] = step + 1 in self.prompts.asked
        self.version += 1
        return {"actor/loss": 0.0}

    # run.stream_train's path: the step's parts, joined, are one train_step
    def begin_stream(self, expected_rows: int) -> None:
        self.parts = []

    def train_part(self, part: TrainBatch) -> None:
        self.parts.append(part)

    def end_stream(self) -> dict[str, float]:
        return self.train_step(concat_rows(self.parts))

    def update_old(self, decay: float) -> None:
        self.refreshes.append((self.version, decay))
        self.old_source = decay * self.old_source + (1 - decay) * self.version

    def export_weights(self, adapter: str = "default") -> WeightUpdate:
        source = self.old_source if adapter == "old" else float(self.version)
        delta = LoraDelta(torch.tensor([[source]]), torch.ones(1, 1), 1.0)
        return WeightUpdate.build(self.version, adapter, {"w": delta})

    def adapter_tensors(self) -> dict:
        return {"w": torch.tensor([float(self.version)])}

    def state_dict(self) -> dict:
        return {"version": self.version, "nonfinite": 0}

    def load_state(self, adapters: dict, state: dict) -> None:
        self.version = int(state["version"])


class FakeTask:
    name = "fake"

    def prompts(self, split: str) -> list[Prompt]:
        return [Prompt(f"{split} prompt {i}") for i in range(3)]

    async def evaluate(self, traj: Trajectory, rewards) -> EvalResult:
        n = len(set(traj.prompts.prompt_ids.tolist()))
        images = np.zeros((n, 4, 4, 3), dtype=np.uint8)
        return EvalResult({"eval/overall": 0.5}, images, ["p"] * n, [None] * n)

    def probe_data(self, n: int = 16):
        return None


def run_loop(monkeypatch, tmp_path, recipe: str, steps: int, *overrides: str):
    cfg = load_config(
        recipe,
        [
            f"run.steps={steps}",
            "run.eval_every=100",
            "run.save_every=100",
            "run.max_minutes=0",
            "run.resume=false",
            "run.tensorboard=false",
            f"run.out_dir={tmp_path}",
            "run.name=fake",
            "data.prompts_per_step=2",
            "rollout.group_size=2",
            *overrides,
        ],
    )
    task = FakeTask()
    prompts = FakePrompts(PromptSet(task.prompts("train"), tokenize), cfg.data.prompts_per_step)
    parts = Engines(
        cfg=cfg,
        device=torch.device("cpu"),
        task=task,
        prompts=prompts,
        eval_set=PromptSet(task.prompts("test"), tokenize),
        rollout=FakeRollout(cfg.rollout.group_size),
        evaluator=FakeRollout(1),
        rewards=FakeRewards(),
        actor=FakeActor(prompts, steps),
        algorithm=get_algorithm(cfg.algorithm.name),
        probe=ProbeResult(skipped=True),
    )
    assert isinstance(parts.rollout, RolloutEngineProtocol)
    assert isinstance(parts.evaluator, RolloutEngineProtocol)
    assert isinstance(parts.rewards, RewardEngineProtocol)
    assert isinstance(parts.actor, ActorEngineProtocol)
    monkeypatch.setattr(
        loop, "build_engines", lambda c: parts if c is cfg else pytest.fail("other cfg")
    )
    root = asyncio.run(loop.train(cfg))
    return parts, read_metrics(root)


def synced_steps(rows: list[dict]) -> list[int]:
    return [r["step"] for r in rows if "sync/version" in r]


@pytest.mark.parametrize("prefetch", [True, False])
def test_nft_copy_syncs_every_old_every_steps_and_prefetches_between(
    monkeypatch, tmp_path, prefetch: bool
) -> None:
    parts, rows = run_loop(
        monkeypatch,
        tmp_path,
        "recipes/shapes_nft.yaml",
        4,
        "algorithm.old_update=copy",
        "algorithm.old_every=2",
        f"run.prefetch={str(prefetch).lower()}",
    )
    rollout, actor = parts.rollout, parts.actor
    assert actor.version == 4
    # old <- default after updates 2 and 4, and only then is it synced (refreshed first)
    assert actor.refreshes == [(2, 0.0), (4, 0.0)]
    assert rollout.loads == [("old", 0, 0.0), ("old", 2, 2.0), ("old", 4, 4.0)]
    assert synced_steps(rows) == [2, 4]
    # every step sampled with the weights of the last sync: prefetching changes nothing
    assert rollout.streams == [(0, 0, 0.0), (1, 0, 0.0), (2, 2, 2.0), (3, 2, 2.0)]
    # step k+1 starts during update k iff update k does not sync (k = 0-based loop step)
    assert actor.prefetched == {0: prefetch, 1: False, 2: prefetch}
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert all(r["fake/calls"] == 1.0 for r in rows[1:])  # scorer metrics reach the log


def test_grpo_syncs_the_current_policy_after_every_update_and_never_prefetches(
    monkeypatch, tmp_path
) -> None:
    parts, rows = run_loop(
        monkeypatch, tmp_path, "recipes/shapes_grpo.yaml", 3, "run.prefetch=true"
    )
    rollout, actor = parts.rollout, parts.actor
    assert actor.version == 3 and actor.refreshes == []
    assert rollout.loads == [("default", v, float(v)) for v in range(4)]
    assert synced_steps(rows) == [1, 2, 3]
    assert rollout.streams == [(k, k, float(k)) for k in range(3)]  # on-policy
    assert actor.prefetched == {0: False, 1: False}
    # held-out eval at the start and the end, each with the eval adapter's latest weights
    assert [v for _, v, _ in parts.evaluator.loads] == [0, 3]
