"""Both data edges on TransferQueue under Ray (``run.backend=ray ray.channel=transferqueue``).

```
 RolloutHost ──samples (TQ)──▶ RewardHost ──scored (TQ)──▶ controller ──TrainBatch──▶ ActorHost
 PerSample: a record per row    score_ready: ready rows    collect: whole micro-   (a Ray call:
 as each micro-batch decodes    of one micro-batch per     batches, in rollout     prepare is
                                pool call                  order                   the controller's)
```

The trajectories never pass through the controller on their way to scoring: the rollout host
writes each sample into a TransferQueue channel that the reward host reads and scores, and the
reward host writes the scored samples into a second channel that the controller reads. What
remains on the controller: ``algorithm.prepare`` (advantages need a micro-batch's whole
groups), so the actor still receives its ``TrainBatch`` from the controller.

Each step makes two fresh channels, each with one producer and one consumer (the limit of
``TransferQueueChannel``), and deletes them at the end. The pieces are those of the local
path (``reward/edges.py``), so the rows and metrics are the local run's. The hosts run them
through ``Host.run_edge``, the one hook in ``backends/ray.py``.
"""

from __future__ import annotations

import uuid
from typing import Any

import torch

from diffrl.channel.transferqueue import TransferQueueChannel
from diffrl.errors import DiffrlError
from diffrl.reward.edges import Collected, OnPart, PerSample, collect, first_error, score_ready
from diffrl.types import PromptBatch, Trajectory, to_device

CPU = torch.device("cpu")


class _OnCPU:
    """A rollout's output channel that moves each trajectory to the host's memory first."""

    def __init__(self, out: Any) -> None:
        self.out = out

    async def put(self, traj: Trajectory, version: int) -> None:
        await self.out.put(to_device(traj, CPU), version)

    def close(self) -> None:
        self.out.close()


# --- run on the hosts (through Host.run_edge) ---------------------------------------------------


async def stream_samples(host: Any, which: str, prompts: PromptBatch, seed: int, kw: dict, out):
    """On the rollout host: the engine's micro-batches as one record per sample into ``out``
    (closed at the end, or when the rollout fails)."""
    try:
        host.check_received(prompts)
        await host.engines[which].stream(prompts, seed, _OnCPU(PerSample(out)), **kw)
    finally:
        out.close()


async def score_samples(host: Any, samples, out, cap: int) -> None:
    """On the reward host: scores what ``samples`` holds ready, into ``out`` (closed at the
    end, or when a scorer fails)."""
    await score_ready(samples, out, host.pool, cap)


# --- on the controller ------------------------------------------------------------------------


async def _result(ref) -> Any:
    """A remote call's result; a remote DiffrlError raised as itself."""
    import ray

    try:
        return await ref
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        raise (cause if isinstance(cause, DiffrlError) else e) from None


class TransferQueueEdges:
    """``RemoteRewards.edges``: one step's rollout -> reward -> controller over two
    TransferQueue channels (see the module docstring). Waits on the scored channel and on both
    hosts' calls; a failure of either host or of ``on_part`` cancels the other calls and
    raises the first error (a scorer's own, not the short stream it leaves)."""

    def __init__(self, reward_host: Any) -> None:
        self.reward_host = reward_host

    async def __call__(
        self,
        rollout: Any,
        prompts: PromptBatch,
        seed: int,
        kw: dict,
        on_part: OnPart | None,
        cap: int,
    ) -> Collected:
        import ray

        uid = uuid.uuid4().hex[:12]
        samples = TransferQueueChannel(f"diffrl-samples-{uid}")
        scored = TransferQueueChannel(f"diffrl-scored-{uid}")
        produce = rollout.host.run_edge.remote(
            stream_samples, rollout.which, prompts, seed, kw, samples
        )
        score = self.reward_host.run_edge.remote(score_samples, samples, scored, cap)
        try:
            *_, got = await first_error(_result(produce), _result(score), collect(scored, on_part))
            return got
        except BaseException:
            for ref in (produce, score):
                ray.cancel(ref)
            raise
        finally:
            samples.delete()
            scored.delete()
