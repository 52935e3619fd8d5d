"""The channel on TransferQueue (``channel/transferqueue.py``) on a local 2-CPU Ray: records
round-trip exactly and in order, across processes; close after drain; the staleness bound;
back-pressure; clear errors for a missing TransferQueue, a wrong name and a closed channel;
consumed records leave TransferQueue."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import pickle
import sys
import time

import pytest
import torch

ray = pytest.importorskip("ray")
tq = pytest.importorskip("transfer_queue")

from diffrl.channel.transferqueue import (  # noqa: E402
    ChannelClosed,
    ChannelNotFound,
    StaleRecord,
    TransferQueueChannel,
    start_transferqueue,
    stop_transferqueue,
)
from diffrl.types import PromptBatch, StepSpec, Trajectory  # noqa: E402

# the actor below travels by value: Ray workers cannot import this test module by name
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

_names = itertools.count()


def fresh_name() -> str:
    return f"test_tq_{next(_names)}_{time.monotonic_ns()}"


def run(coro, timeout: float = 20.0):
    return asyncio.run(asyncio.wait_for(coro, timeout=timeout))


@pytest.fixture(scope="module")
def ray_cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    stop_transferqueue()
    ray.shutdown()


@pytest.fixture(scope="module")
def transferqueue(ray_cluster):
    start_transferqueue(num_storage_units=1)
    # the controller and the storage unit reserve no CPU: the engines keep both
    assert ray.available_resources().get("CPU") == 2.0


def make_traj(i: int, n: int = 2, *, latents: bool = False, image: bool = True) -> Trajectory:
    g = torch.Generator().manual_seed(i)
    prompts = PromptBatch(
        texts=tuple(f"prompt {i}.{k}" for k in range(n)),
        input_ids=torch.randint(0, 50, (n, 6), generator=g),
        ids_hash=tuple(f"h{i}{k}" for k in range(n)),
        prompt_ids=torch.arange(n),
    )
    extra = {"image": torch.randint(0, 256, (n, 8, 8, 3), dtype=torch.uint8, generator=g)}
    return Trajectory(
        prompts=prompts,
        group=torch.arange(n),
        seeds=torch.arange(n) + 100 * i,
        x0=torch.randn(n, 3, 8 + i, 8, generator=g),  # shapes differ between records
        sigmas=torch.linspace(1, 0, 4),
        policy_version=i,
        latents=torch.randn(n, 4, 3, 8, 8, generator=g).to(torch.bfloat16) if latents else None,
        log_probs=torch.randn(n, 3, generator=g, dtype=torch.float64),
        sde_mask=torch.tensor([True, False, True]),
        step_spec=StepSpec("flow_grpo", 0.7, 1.0, (0, 1, 2)),
        extra_fields=extra if image else {},
    )


def same(a, b) -> bool:
    """Exact equality, tensors included (dtype, shape, values)."""
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(
            same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a)
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def test_needs_a_running_transferqueue(ray_cluster):
    with pytest.raises(RuntimeError, match="start_transferqueue"):
        TransferQueueChannel(fresh_name())


def test_fifo_round_trip_is_exact(transferqueue):
    shared = torch.arange(5.0)
    records = [
        make_traj(0, latents=True),
        {"a": shared, "b": shared, "texts": ["x", "y"], "n": 3, "empty": torch.zeros(0, 4)},
        make_traj(1, n=3, image=False),
        ("plain", 1.5, None),
        make_traj(2, latents=True),
    ]

    async def go():
        ch = TransferQueueChannel(fresh_name())
        for v, r in enumerate(records):
            await ch.put(r, version=v)
        assert ch.qsize() == len(records)
        got = [await ch.get() for _ in records]
        assert ch.qsize() == 0
        # one at a time: TransferQueue reuses a cleared record's slot for the next one, which
        # has other tensors (other fields); none of the old fields may come back with it
        one_by_one = []
        for v, r in enumerate(records):
            await ch.put(r, version=v)
            one_by_one.append(await ch.get())
        return ch, got, one_by_one

    ch, got, one_by_one = run(go())
    assert all(same(r, g) for r, g in zip(records, got, strict=True))
    assert all(same(r, g) for r, g in zip(records, one_by_one, strict=True))
    assert got[1]["a"] is got[1]["b"]  # one tensor referenced twice stays one tensor
    assert torch.get_num_threads() == 1  # TransferQueue's thread limit does not leak
    keys = tq.kv_list(ch.name)[ch.name]
    assert list(keys) == ["channel"]  # consumed records are cleared from TransferQueue


@ray.remote(num_cpus=1)
class Producer:
    async def run(self, channel: TransferQueueChannel, n: int) -> int:
        for i in range(n):
            await channel.put(make_traj(i, latents=i % 2 == 0), version=i)
        channel.close()
        return n


def test_producer_in_an_actor_consumer_here(transferqueue):
    ch = TransferQueueChannel(fresh_name(), capacity=2, max_staleness=1)
    assert len(pickle.dumps(ch)) < 300  # the actor receives the name and settings only
    producer = Producer.remote()
    done = producer.run.remote(ch, 6)

    async def go():
        deadline = time.monotonic() + 15
        while ch.qsize() < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)
        assert ch.qsize() == 2  # back-pressure across processes: the actor waits at capacity
        assert ray.wait([done], timeout=0)[0] == []  # still putting
        got, version = [], 0
        while True:
            try:
                got.append(await ch.get(current_version=version))
            except ChannelClosed:
                return got
            version += 1

    got = run(go())
    assert ray.get(done) == 6
    assert all(same(g, make_traj(i, latents=i % 2 == 0)) for i, g in enumerate(got))
    assert len(got) == 6
    assert list(tq.kv_list(ch.name)[ch.name]) == ["channel", "00000006"]  # header, close mark
    ray.kill(producer)


def test_close_is_seen_after_the_queue_drains(transferqueue):
    async def go():
        ch = TransferQueueChannel(fresh_name())
        for i in range(3):
            await ch.put(i, 0)
        ch.close()
        assert ch.qsize() == 3
        got = [r async for r in ch]
        with pytest.raises(ChannelClosed):
            await ch.get()  # still closed for a later consumer
        with pytest.raises(ChannelClosed, match="closed channel"):
            await ch.put(99, 0)
        ch.close()  # idempotent
        copy = pickle.loads(pickle.dumps(ch))  # another process's view: sees the close mark
        with pytest.raises(ChannelClosed, match="closed channel"):
            await copy.put(99, 0)
        with pytest.raises(ChannelClosed):
            await copy.get()
        return got

    assert run(go()) == [0, 1, 2]


def test_a_stale_record_raises_and_is_dropped(transferqueue):
    async def go():
        ch = TransferQueueChannel(fresh_name(), max_staleness=1)
        for v in (0, 2, 3):
            await ch.put(f"v{v}", v)
        with pytest.raises(StaleRecord, match="3 versions old"):
            await ch.get(current_version=3)
        return [await ch.get(current_version=3), await ch.get(current_version=3)]

    assert run(go()) == ["v2", "v3"]


def test_put_waits_at_capacity_until_a_get(transferqueue):
    async def go():
        ch = TransferQueueChannel(fresh_name(), capacity=2)
        await ch.put("a", 0)
        await ch.put("b", 0)
        blocked = asyncio.create_task(ch.put("c", 0))
        await asyncio.sleep(0.3)
        assert not blocked.done() and ch.qsize() == 2
        assert await ch.get() == "a"
        await asyncio.wait_for(blocked, timeout=5)
        assert ch.qsize() == 2
        return [await ch.get(), await ch.get()]

    assert run(go()) == ["b", "c"]


def test_start_again_attaches_to_the_running_one(transferqueue):
    conf = start_transferqueue(num_storage_units=3)  # ignored: it runs already
    assert conf.backend.SimpleStorage.num_data_storage_units == 1


def test_wrong_or_deleted_channels_are_clear_errors(transferqueue):
    with pytest.raises(ChannelNotFound, match="no channel 'nope'"):
        TransferQueueChannel.attach("nope")
    with pytest.raises(ValueError, match="bad channel name"):
        TransferQueueChannel("123")

    name = fresh_name()
    ch = TransferQueueChannel(name, capacity=3, max_staleness=2)
    with pytest.raises(ValueError, match="exists already"):
        TransferQueueChannel(name)
    other = TransferQueueChannel.attach(name)  # the settings travel with the channel
    assert (other.capacity, other.max_staleness) == (3, 2)

    async def go():
        await ch.put(torch.ones(2), 0)
        ch.delete()
        with pytest.raises(ChannelNotFound):
            await other.get()
        with pytest.raises(ChannelNotFound):
            await ch.put(torch.ones(2), 0)

    run(go())
    assert ch.name not in tq.kv_list()


def test_put_many_and_get_ready_move_records_together(transferqueue):
    """``put_many`` writes consecutive keys that turn ready together (tagged in one call after
    their data); ``get_ready`` takes every ready record at once, in order, exactly."""
    records = [make_traj(i, latents=i == 1) for i in range(3)]

    async def go():
        ch = TransferQueueChannel(fresh_name(), max_staleness=0)
        assert await ch.get_ready(wait=False) == []
        await ch.put_many(records[:2], version=4)
        await ch.put("last", version=4)
        got = await ch.get_ready()
        waiting = asyncio.create_task(ch.get_ready())  # waits for the next put
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await ch.put_many([records[2]], version=4)
        later = await asyncio.wait_for(waiting, 5)
        ch.close()
        with pytest.raises(ChannelClosed):
            await ch.get_ready()
        await ch.put_many([], version=0)  # nothing to put: not even a closed channel's error
        with pytest.raises(ChannelClosed, match="closed channel"):
            await ch.put_many(["x"], version=0)
        ch2 = TransferQueueChannel(fresh_name(), max_staleness=0)
        await ch2.put_many(["old"], version=1)
        with pytest.raises(StaleRecord):
            await ch2.get_ready(current_version=2)
        return got, later, ch

    got, later, ch = run(go())
    assert len(got) == 3 and all(same(r, g) for r, g in zip(records[:2], got, strict=False))
    assert got[2] == "last" and len(later) == 1 and same(later[0], records[2])
    assert list(tq.kv_list(ch.name)[ch.name]) == ["channel", "00000004"]  # all consumed


# --- both data edges on TransferQueue (backends/ray_edges.py), on fake hosts -------------------


class GroupScorer:
    """Scores a row by its seed; raises on a batch holding seed ``fail``."""

    needs = frozenset({"image"})
    name = "test_tq_edges"

    def __init__(self, fail: int = -1) -> None:
        self.fail = fail

    async def score(self, traj):
        from diffrl.reward.scorer import ScoreResult

        if (traj.seeds == self.fail).any():
            raise ValueError(f"cannot score seed {self.fail}")
        s = traj.seeds.float() / 7
        return ScoreResult(s, torch.ones(len(s), dtype=torch.bool), {"rows": float(len(s))})


class FakeRollout:
    async def stream(self, prompts, seed, channel, **kw) -> None:
        try:
            for k in range(3):  # micro-batches of 2 rows, one group each
                await channel.put(dataclasses.replace(make_traj(k), group=torch.full((2,), k)), 0)
        finally:
            channel.close()


def pool(fail: int = -1):
    from diffrl.reward.pool import RewardConfig, RewardPool, ScorerConfig
    from diffrl.reward.scorer import register_scorer

    register_scorer("test_tq_edges")(GroupScorer)
    return RewardPool(RewardConfig([ScorerConfig("test_tq_edges", params={"fail": fail})]))


@ray.remote(num_cpus=0)
class EdgeHosts:
    """A rollout host and a reward host in one process, as ``ray_edges`` sees them."""

    def __init__(self) -> None:
        self.engines, self.pool = {"rollout": FakeRollout()}, pool()

    def fail_on(self, seed: int) -> None:
        self.pool = pool(seed)

    def check_received(self, prompts) -> None:
        pass

    async def run_edge(self, fn, *args):
        return await fn(self, *args)


def test_both_edges_on_transferqueue_equal_the_local_edges_and_fail_cleanly(transferqueue):
    """Rollout host -> reward host -> here over two TransferQueue channels gives the local
    path's micro-batches and metrics exactly; a scorer failing on one sample stops the step
    with its own error (no hang); the step's channels are deleted either way."""
    import types

    from diffrl.backends.ray_edges import TransferQueueEdges
    from diffrl.reward.edges import run_local
    from diffrl.reward.pool import RewardFailure

    local = run(run_local(lambda ch: FakeRollout().stream(None, 0, ch), pool()))
    hosts = EdgeHosts.remote()
    handed = []

    async def on_part(part):
        handed.append(part)

    rollout = types.SimpleNamespace(host=hosts, which="rollout")
    got = run(TransferQueueEdges(hosts)(rollout, None, 0, {}, on_part, 0), timeout=60)
    assert len(got.parts) == len(handed) == 3
    assert all(same(a, b) for a, b in zip(local.parts, got.parts, strict=True))
    untimed = lambda m: {k: v for k, v in m.items() if k != "perf/score_wait_s"}  # noqa: E731
    assert untimed(got.metrics()) == untimed(local.metrics())
    ray.get(hosts.fail_on.remote(201))
    with pytest.raises(RewardFailure, match="cannot score seed 201"):
        run(TransferQueueEdges(hosts)(rollout, None, 0, {}, None, 0), timeout=60)
    assert not [p for p in tq.kv_list() if p.startswith(("diffrl-samples", "diffrl-scored"))]
    ray.kill(hosts)
