"""N rollout replicas behind one dispatcher (``placement.rollout.replicas`` > 1 on the Ray
backend): ``RolloutReplicas`` is a ``RolloutEngineProtocol`` for the training rollout and one for
the held-out evaluator, over one ``ReplicaSet`` (each replica holds both engines, as one
``RolloutHost`` does). It imports no Ray: a replica is anything with the ``Replica`` methods
(``backends/ray.py``'s ``RayReplica`` over a host; in-process ones in the tests).

Same rows as one process. ``RolloutEngine.stream`` cuts its prompts into micro-batches of
``max_batch // G`` whole groups and gives micro-batch k's samples the seeds, group ids and SDE
window of the whole batch (``first_prompt``, the step seed, ``iteration``). The dispatcher
makes exactly those cuts and sends each to one replica as a batch of its own, with
``first_prompt`` moved to the cut's start and the same seed, iteration and keywords: the
replica's engine then samples it as one micro-batch, bit for bit the one-process engine's. The
replicas are built from one config and seed (same weights, same data stage: the controller
checks their prompt sets' token hashes agree), and every weight update goes to all of them.

Load: each replica samples one micro-batch at a time (a second one beside it would only share
its device); a free replica takes the next cut, so the cuts go to the replicas with the fewest
in flight. Trajectories enter the channel in cut order, whichever replica finishes first.

A replica that dies (its call raises one of ``died``: Ray's ``RayActorError``) is started again
on its own bundle (``restart``), given the last weight update of each engine (kept for this,
and checked by its receipt), and the cuts it lost are sampled again: the seeds fix them, so the
results do not change. A slot is replaced at most once per call; a replacement that fails to
start, or dies in the same call, fails the call with a DiffrlError naming the replica (the run
stops before its update: checkpoints untouched, ``run.resume=true`` continues).
``rollout/replaced`` counts the replacements since the run started.

What waits on what: ``stream`` and ``generate`` wait on the replicas' calls and on channel
back-pressure; ``load_weights``, ``receipt`` and a replacement outside a call block their
caller (the controller's thread), one thread per replica.
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import torch

from diffrl.channel import Channel
from diffrl.errors import ContractError, DiffrlError
from diffrl.rollout.engine import RolloutConfig
from diffrl.sync.receipt import SyncReceipt, check_receipt, sent
from diffrl.sync.weights import SyncError, SyncReport
from diffrl.types import PromptBatch, Trajectory


class Replica(Protocol):
    """One replica: both rollout engines (``which``: "rollout" or "evaluator") in one place."""

    async def generate(self, which: str, prompts: PromptBatch, seed: int, kw: dict) -> Trajectory:
        """``prompts`` (one micro-batch's worth) as one trajectory."""

    def load_weights(self, which: str, update: Any) -> SyncReport: ...

    def receipt(self, which: str) -> SyncReceipt: ...

    def offer(self, which: str, update: Any) -> None:
        """Applied at the replica's next denoising-step boundary (``run.async_sync=step``)."""

    def take_synced(self, which: str) -> dict[str, float]: ...


ENGINES = ("rollout", "evaluator")  # what each replica holds
# micro-batches one replica samples at once: a second beside the first would only share its
# device (and hold a second micro-batch's activations)
IN_FLIGHT = 1


def cuts(n: int, group_size: int, max_batch: int) -> list[tuple[int, int]]:
    """The [start, end) prompt ranges of ``RolloutEngine.stream``'s micro-batches."""
    per = max(1, max_batch // group_size)
    return [(k, min(k + per, n)) for k in range(0, n, per)]


class ReplicaSet:
    """The replicas, what each has in flight, and the last update of each engine.
    ``restart(i)`` builds replica i again (blocking) on its own resources."""

    def __init__(
        self,
        replicas: list[Replica],
        restart: Callable[[int], Replica],
        died: tuple[type[BaseException], ...],
        cfg: RolloutConfig,
    ) -> None:
        self.replicas, self.restart, self.died, self.cfg = list(replicas), restart, died, cfg
        self.inflight = [0] * len(replicas)
        self.lock = threading.Lock()  # one replacement at a time
        # slots being replaced, and the calls waiting for a slot: the training rollout and the
        # evaluator share the replicas, and may sample at once (async mode)
        self.fixing: collections.Counter[int] = collections.Counter()
        self.waiters: list[asyncio.Future] = []
        self.last: dict[str, Any] = {}  # which -> the last update sent (a replacement loads it)
        self.replaced = 0

    def __len__(self) -> int:
        return len(self.replicas)

    # --- a replacement ----------------------------------------------------------------------

    def replace(self, i: int, why: BaseException, dead: Replica) -> None:
        """Replica i again, holding the last update of each engine (checked by its receipt),
        unless another caller (the evaluator's, a sync) has replaced ``dead`` already;
        DiffrlError naming the replica when it cannot be."""
        with self.lock:
            if self.replicas[i] is dead:
                self._replace(i, why)

    def _replace(self, i: int, why: BaseException) -> None:
        try:
            rep = self.restart(i)
            for which, update in self.last.items():
                rep.load_weights(which, update)
                check_receipt(*sent(update), rep.receipt(which), f"rollout replica {i}'s {which}")
        except Exception as e:
            raise DiffrlError(
                f"rollout replica {i} died ({type(why).__name__}) and its replacement failed "
                f"too: {e}. The step stops before its update; the checkpoints are untouched "
                "(run.resume=true continues from the last)"
            ) from e
        self.replicas[i] = rep
        self.replaced += 1

    def each(self, call: Callable[[Replica], Any]) -> list[Any]:
        """``call`` on every replica at once (a thread each), a dead one replaced first and
        called again."""

        def one(i: int):
            rep = self.replicas[i]
            try:
                return call(rep)
            except self.died as e:
                self.replace(i, e, rep)
                return call(self.replicas[i])

        with ThreadPoolExecutor(len(self.replicas)) as pool:
            return list(pool.map(one, range(len(self.replicas))))

    # --- sampling -------------------------------------------------------------------------------

    async def run(self, which: str, prompts: PromptBatch, seed: int, kw: dict, emit) -> None:
        """Samples ``prompts`` as the one-process engine would, cut by cut over the replicas;
        awaits ``emit(traj)`` for each cut in order. Waits on the replicas' calls, on a
        replacement's thread and on ``emit``."""
        kw = dict(kw)
        first = kw.pop("first_prompt", 0)
        todo = cuts(len(prompts), kw.get("group_size") or self.cfg.group_size, self.cfg.max_batch)
        pending = collections.deque(range(len(todo)))  # cuts not handed out yet (or lost)
        done: dict[int, Trajectory] = {}  # finished cuts not emitted yet
        calls: dict[asyncio.Task, tuple[int, int, Replica]] = {}  # -> (slot, cut, replica)
        fixing: dict[asyncio.Task, int] = {}  # a replacement's thread -> its slot
        replaced: set[int] = set()  # slots replaced in this call (once each)
        emitted = 0
        try:
            while emitted < len(todo):
                while pending and (i := self._free()) is not None:
                    c, rep = pending.popleft(), self.replicas[i]
                    a, b = todo[c]
                    sub = prompts.select(torch.arange(a, b))
                    call = rep.generate(which, sub, seed, {**kw, "first_prompt": first + a})
                    calls[asyncio.create_task(call)] = (i, c, rep)
                    self.inflight[i] += 1
                freed = asyncio.get_running_loop().create_future()  # by another caller
                self.waiters.append(freed)
                finished, _ = await asyncio.wait(
                    [*calls, *fixing, freed], return_when="FIRST_COMPLETED"
                )
                freed.cancel()
                for t in finished:
                    if t is freed:
                        continue
                    if t in fixing:
                        self.fixing[fixing.pop(t)] -= 1
                        self._wake()
                        t.result()  # a failed replacement's DiffrlError stops the call
                        continue
                    i, c, rep = calls.pop(t)
                    self.inflight[i] = max(0, self.inflight[i] - 1)
                    self._wake()
                    err = t.exception()
                    if err is None:
                        done[c] = t.result()
                        continue
                    if not isinstance(err, self.died):
                        raise err
                    pending.appendleft(c)  # lost: sampled again, first
                    if self.fixing[i] > 0 or rep is not self.replicas[i]:
                        continue  # being replaced, or replaced by another call already
                    if i in replaced:
                        raise DiffrlError(
                            f"rollout replica {i} died again in the same call after its "
                            f"replacement ({type(err).__name__}: {err}). The step stops "
                            "before its update; the checkpoints are untouched "
                            "(run.resume=true continues from the last)"
                        ) from err
                    replaced.add(i)
                    fixing[asyncio.create_task(asyncio.to_thread(self.replace, i, err, rep))] = i
                    self.fixing[i] += 1
                while emitted in done:
                    await emit(done.pop(emitted))
                    emitted += 1
        finally:
            for t in calls:
                t.cancel()
            if calls or fixing:  # a replacement in its thread runs to its end: wait for it
                await asyncio.gather(*calls, *fixing, return_exceptions=True)
            for i, _, _ in calls.values():
                self.inflight[i] = max(0, self.inflight[i] - 1)
            for i in fixing.values():
                self.fixing[i] -= 1
            self._wake()

    def _wake(self) -> None:
        """A slot may be free now: every waiting caller looks again."""
        for f in self.waiters:
            if not f.done():
                f.set_result(None)
        self.waiters.clear()

    def _free(self) -> int | None:
        """The slot with the fewest calls in flight, if it has room for one more (IN_FLIGHT)
        and is not being replaced."""
        ready = [i for i in range(len(self)) if self.fixing[i] <= 0]
        i = min(ready, key=lambda j: self.inflight[j], default=None)
        return i if i is not None and self.inflight[i] < IN_FLIGHT else None


class RolloutReplicas:
    """One of the replicas' engines (``which``) as ``RolloutEngineProtocol``."""

    def __init__(self, replicas: ReplicaSet, which: str, produces: frozenset[str]) -> None:
        self.set, self.which, self._produces = replicas, which, produces
        self.version = 0

    @property
    def produces(self) -> frozenset[str]:
        return self._produces

    async def stream(
        self, prompts: PromptBatch, seed: int, channel: Channel, *, iteration: int = 0, **kw
    ) -> None:
        """Puts the cuts' trajectories into ``channel`` in order, then closes it."""

        async def emit(traj: Trajectory) -> None:
            await channel.put(traj, traj.policy_version)

        try:
            await self.set.run(self.which, prompts, seed, {**kw, "iteration": iteration}, emit)
        finally:
            channel.close()

    async def generate(self, prompts: PromptBatch, seed: int, **kw) -> Trajectory:
        parts: list[Trajectory] = []

        async def emit(traj: Trajectory) -> None:
            parts.append(traj)

        await self.set.run(self.which, prompts, seed, kw, emit)
        return Trajectory.concat(parts)

    def load_weights(self, update: Any) -> SyncReport:
        """``update`` to every replica; each must report its version."""
        self.set.last[self.which] = update  # first: a replica replaced meanwhile loads it
        reports = self.set.each(lambda r: r.load_weights(self.which, update))
        versions = [r.version for r in reports]
        if len(set(versions)) != 1:
            raise SyncError(
                f"rollout replicas report versions {versions} after one update: replica "
                f"{next(i for i, v in enumerate(versions) if v != versions[0])} differs"
            )
        self.version = versions[0]
        return reports[0]

    def receipt(self) -> SyncReceipt:
        """Replica 0's receipt, once every replica's agrees with it (SyncError naming the
        first that does not): the sender checks one receipt against what it sent."""
        receipts = self.set.each(lambda r: r.receipt(self.which))
        ref = receipts[0]
        for i, got in enumerate(receipts[1:], 1):
            agree_or_raise(ref, got, f"rollout replica {i}'s {self.which}")
        return ref

    def offer(self, update: Any) -> None:
        """``run.async_sync=step``: every replica applies ``update`` at its next denoising-step
        boundary (a replica between micro-batches, before its next one)."""
        self.set.last[self.which] = update  # a replica replaced meanwhile loads it
        self.set.each(lambda r: r.offer(self.which, update))

    def take_synced(self) -> dict[str, float]:
        """The ``sync/*`` of the offered updates the replicas applied (replica 0's)."""
        return self.set.each(lambda r: r.take_synced(self.which))[0]

    def step_metrics(self) -> dict[str, float]:
        return {"rollout/replaced": float(self.set.replaced)}


def agree_or_raise(ref: SyncReceipt, got: SyncReceipt, who: str) -> None:
    """SyncError unless ``got`` shows the weights ``ref`` shows: the same version and modules,
    each probe within the two receipts' rounding tolerances."""
    if got.version != ref.version:
        raise SyncError(f"{who} holds weights v{got.version}, replica 0 v{ref.version}")
    if set(got.held) != set(ref.held):
        diff = sorted(set(got.held) ^ set(ref.held))
        raise SyncError(f"{who}'s receipt names other modules than replica 0's: {diff[:5]}")
    for name in sorted(ref.held):
        err = (got.held[name] - ref.held[name]).abs()
        bad = (err > ref.tol[name] + got.tol[name]).nonzero()
        if len(bad):
            j = int(bad[0, 0])
            raise SyncError(
                f"{who} holds other weights than replica 0 after v{ref.version}: {name} "
                f"receipt {float(got.held[name][j]):.9g} vs {float(ref.held[name][j]):.9g} "
                f"(probe {j})"
            )


def check_same_prompts(ref: dict, got: dict, who: str) -> None:
    """Contract 3 across replicas: ``who``'s data stage (its host's ``info``) tokenized the
    train and held-out prompts to the same token (and condition) hashes as replica 0's."""
    for split in ("train", "eval_set"):
        a, b = ref[split], got[split]
        for field in ("hashes", "cond_hashes"):
            x, y = getattr(a, field), getattr(b, field)
            if x is None and y is None:
                continue
            if x is None or y is None or tuple(x) != tuple(y):
                rows = (
                    []
                    if x is None or y is None or len(x) != len(y)
                    else [i for i, (p, q) in enumerate(zip(x, y, strict=True)) if p != q]
                )
                raise ContractError(
                    f"token drift across rollout replicas: {who}'s {split} prompts have other "
                    f"{field} than replica 0's (rows {rows[:5] or 'all'}); every replica must "
                    "tokenize the same prompts to the same ids"
                )
