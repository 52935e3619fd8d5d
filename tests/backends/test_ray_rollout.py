"""The rollout replicas' dispatcher (``backends/ray_rollout.py``), over in-process replicas (no
Ray): the same rows as one engine, cut for cut; a dead replica replaced and its cuts sampled
again; a replacement that fails too, receipts and versions that disagree, and prompt sets that
drift are errors naming the replica."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from diffrl.backends.ray_rollout import (
    ReplicaSet,
    RolloutReplicas,
    agree_or_raise,
    check_same_prompts,
    cuts,
)
from diffrl.channel import Channel
from diffrl.errors import ContractError, DiffrlError
from diffrl.rollout.engine import RolloutConfig, RolloutEngine
from diffrl.sync.receipt import SyncReceipt
from diffrl.sync.weights import SyncError, SyncReport
from diffrl.tasks import Prompt, PromptSet
from diffrl.tasks.shapes.prompts import split_prompts

CFG = RolloutConfig(
    group_size=3, num_steps=3, max_batch=6, sampler="sde", sde_window=1,
    sde_window_mode="random", keep_latents=True,
)  # fmt: skip


class Died(Exception):
    """Stands for Ray's RayActorError."""


class LocalReplica:
    """A replica in this process: its own engine over ``model``; raises Died at the calls
    numbered in ``die_at`` (1-based), before sampling."""

    def __init__(self, model, die_at=()) -> None:
        self.engine = RolloutEngine(model, CFG, [], torch.device("cpu"))
        self.calls, self.die_at, self.firsts = 0, set(die_at), []

    async def generate(self, which, prompts, seed, kw):
        self.calls += 1
        if self.calls in self.die_at:
            raise Died(f"killed at call {self.calls}")
        self.firsts.append(kw["first_prompt"])
        return await self.engine.generate(prompts, seed, **kw)


def replicas(model, *die_at, restart=None) -> RolloutReplicas:
    reps = [LocalReplica(model, d) for d in die_at]
    restart = restart or (lambda i: LocalReplica(model))
    return RolloutReplicas(ReplicaSet(reps, restart, (Died,), CFG), "rollout", frozenset())


def streamed(engine, prompts, **kw) -> list:
    async def go():
        channel = Channel()
        producer = asyncio.create_task(engine.stream(prompts, 11, channel, **kw))
        out = [t async for t in channel]
        await producer
        return out

    return asyncio.run(go())


def assert_same(a, b) -> None:
    """Every field of two records bit for bit (tensors with torch.equal)."""
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if dataclasses.is_dataclass(x):
            assert_same(x, y)
        elif isinstance(x, torch.Tensor):
            assert torch.equal(x, y), f.name
        elif isinstance(x, dict):
            assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x), f.name
        else:
            assert x == y, f.name


@pytest.fixture
def prompts(tiny_model):
    texts = [Prompt(p.text) for p in split_prompts("train")[:5]]
    return PromptSet(texts, tiny_model.family.tokenize).batch([4, 0, 3, 1, 2])


def test_cuts_are_the_engines_micro_batches() -> None:
    assert cuts(5, 3, 6) == [(0, 2), (2, 4), (4, 5)]
    assert cuts(2, 8, 4) == [(0, 1), (1, 2)]  # a group larger than max_batch: one prompt each


def test_replicas_give_the_one_engines_rows(tiny_model, prompts) -> None:
    """5 prompts, 2 a micro-batch: three cuts over two replicas, each a sub-batch with its own
    first_prompt; the SDE window is drawn per iteration and seed, the seeds and group ids
    offset by first_prompt, and every row equals the one engine's."""
    one = RolloutEngine(tiny_model, CFG, [], torch.device("cpu"))
    kw = dict(iteration=4, first_prompt=3)
    want = streamed(one, prompts, **kw)
    disp = replicas(tiny_model, (), ())
    got = streamed(disp, prompts, **kw)
    assert len(got) == len(want) == 3
    for a, b in zip(got, want, strict=True):
        assert_same(a, b)
    assert sorted(disp.set.replicas[0].firsts + disp.set.replicas[1].firsts) == [3, 5, 7]
    assert all(r.firsts for r in disp.set.replicas)  # both replicas sampled
    joined = asyncio.run(disp.generate(prompts, 11, **kw))
    assert torch.equal(joined.x0, torch.cat([t.x0 for t in want]))
    assert disp.step_metrics() == {"rollout/replaced": 0.0}


def test_a_dead_replica_is_replaced_and_its_cuts_sampled_again(tiny_model, prompts) -> None:
    one = RolloutEngine(tiny_model, CFG, [], torch.device("cpu"))
    want = streamed(one, prompts, iteration=1)
    disp = replicas(tiny_model, (), (1,))  # replica 1 dies at its first call: cut 1 is lost
    got = streamed(disp, prompts, iteration=1)
    for a, b in zip(got, want, strict=True):
        assert_same(a, b)
    assert disp.set.replaced == 1 and disp.step_metrics() == {"rollout/replaced": 1.0}
    assert disp.set.replicas[1].die_at == set() and disp.set.replicas[1].firsts  # the new one


def test_a_replacement_that_dies_too_fails_the_call(tiny_model, prompts) -> None:
    always = lambda i: LocalReplica(tiny_model, die_at=range(1, 9))  # noqa: E731
    disp = replicas(tiny_model, (), (1,), restart=always)
    with pytest.raises(DiffrlError, match=r"rollout replica 1 died again .*run\.resume=true"):
        streamed(disp, prompts)

    def cannot(i):
        raise RuntimeError("no room on bundle 1")

    disp = replicas(tiny_model, (), (1,), restart=cannot)
    with pytest.raises(DiffrlError, match=r"rollout replica 1 died \(Died\).*no room on bundle 1"):
        streamed(disp, prompts)


class FixedReplica:
    """Answers load_weights and receipt with what it is given."""

    def __init__(self, version: int, held: float) -> None:
        self.version, self.held = version, held

    def load_weights(self, which, update) -> SyncReport:
        return SyncReport(self.version, "default", 1, 1, 0.0)

    def receipt(self, which) -> SyncReceipt:
        one = torch.full((2,), self.held, dtype=torch.float64)
        return SyncReceipt(self.version, {"blk.q": one}, {"blk.q": torch.full((2,), 1e-9)})


def fixed(*reps) -> RolloutReplicas:
    return RolloutReplicas(ReplicaSet(list(reps), None, (Died,), CFG), "rollout", frozenset())


def test_weights_go_to_every_replica_and_must_agree() -> None:
    disp = fixed(FixedReplica(3, 0.5), FixedReplica(3, 0.5))
    assert disp.load_weights("update").version == 3 and disp.version == 3
    assert disp.set.last == {"rollout": "update"}  # what a replacement would load
    assert disp.receipt().version == 3
    with pytest.raises(SyncError, match=r"versions \[3, 2\] .* replica 1 differs"):
        fixed(FixedReplica(3, 0.5), FixedReplica(2, 0.5)).load_weights("update")
    with pytest.raises(
        SyncError, match=r"rollout replica 1's rollout holds other weights .*blk\.q"
    ):
        fixed(FixedReplica(3, 0.5), FixedReplica(3, 0.6)).receipt()
    with pytest.raises(SyncError, match="rollout replica 2's rollout holds weights v2"):
        fixed(FixedReplica(3, 0.5), FixedReplica(3, 0.5), FixedReplica(2, 0.5)).receipt()
    ref = FixedReplica(3, 0.5).receipt("rollout")
    agree_or_raise(ref, FixedReplica(3, 0.5 + 1e-9).receipt("rollout"), "r")  # within rounding


def test_prompt_sets_that_drift_across_replicas_are_a_contract_error(tiny_model) -> None:
    texts = [Prompt(p.text) for p in split_prompts("train")[:3]]
    a = PromptSet(texts, tiny_model.family.tokenize)
    other = [texts[0], Prompt(texts[1].text + " red"), texts[2]]
    b = PromptSet(other, tiny_model.family.tokenize)
    check_same_prompts({"train": a, "eval_set": a}, {"train": a, "eval_set": a}, "replica 1")
    with pytest.raises(ContractError, match=r"replica 1's eval_set prompts .* \(rows \[1\]\)"):
        check_same_prompts({"train": a, "eval_set": a}, {"train": a, "eval_set": b}, "replica 1")


class Sent:
    """A remote update handle: what was sent is asked of it (as ``RemoteWeights.sent``)."""

    def __init__(self, version: int, held: float) -> None:
        self.version, self.held = version, held

    def sent(self):
        return self.version, {"blk.q": torch.full((2,), self.held, dtype=torch.float64)}


class DeadReplica(FixedReplica):
    def load_weights(self, which, update):
        raise Died("gone")


def test_a_replacement_is_given_the_last_update_and_checked_by_its_receipt() -> None:
    """A replica found dead at a sync is replaced, loaded and checked; one whose receipt
    shows other weights than were sent fails, naming the replica."""
    disp = RolloutReplicas(
        ReplicaSet([FixedReplica(3, 0.5), DeadReplica(3, 0.5)], lambda i: FixedReplica(3, 0.5),
                   (Died,), CFG),
        "evaluator", frozenset(),
    )  # fmt: skip
    assert disp.load_weights(Sent(3, 0.5)).version == 3 and disp.set.replaced == 1
    disp = RolloutReplicas(
        ReplicaSet([FixedReplica(3, 0.5), DeadReplica(3, 0.5)], lambda i: FixedReplica(3, 0.7),
                   (Died,), CFG),
        "evaluator", frozenset(),
    )  # fmt: skip
    message = r"rollout replica 1 died \(Died\) and its replacement failed too: rollout replica"
    with pytest.raises(DiffrlError, match=message + r" 1's evaluator after update v3: blk\.q"):
        disp.load_weights(Sent(3, 0.5))


def test_two_callers_replace_a_dead_replica_once(tiny_model, prompts) -> None:
    """The training rollout and the evaluator share the replicas: both lose a call to the dead
    one, one replacement serves both, and both get the one engine's rows."""
    one = RolloutEngine(tiny_model, CFG, [], torch.device("cpu"))
    want = asyncio.run(one.generate(prompts, 11))
    rollout = replicas(tiny_model, (), (1,))
    evaluator = RolloutReplicas(rollout.set, "evaluator", frozenset())

    async def both():
        return await asyncio.gather(rollout.generate(prompts, 11), evaluator.generate(prompts, 11))

    for got in asyncio.run(both()):
        assert_same(got, want)
    assert rollout.set.replaced == 1
