"""The actor as a torch.distributed group of Ray workers (``placement.actor.replicas`` = N > 1
with ``run.backend=ray``): the Ray backend and torchrun-style sharding combined.

Each ``ActorWorker`` is one Ray actor. Worker 0 picks a free port on its node; every worker
then sets the environment a torchrun launch gives a rank (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``; on a GPU, the one
device Ray gave it) and builds its actor exactly as a torchrun rank does: ``launch.start``
with the run's ``parallel`` section as the layout (gloo on CPU, nccl on CUDA), then
``actor_side`` over its own copy of the model. No rollout and no scorer on these workers: the
rollout host samples every prompt of a step and the controller prepares the whole batch.

``RemoteActorGroup`` is what the controller holds (``ActorEngineProtocol``). Every call runs
on all workers at once (SPMD: the collectives are inside: FSDP2's gathers, the gradient
all-reduce, TP gathers in an export or a checkpoint) and returns rank 0's result, after
checking that the ranks agree where they must (the policy version). ``train_step`` gives each
data-parallel rank the rows a torchrun rank would hold: its contiguous share of the step's
prompt groups (``PromptSource.first``: rank k holds prompts k*P/dp .. (k+1)*P/dp - 1, and their
G samples); the tp and sp ranks of one data-parallel rank get the same rows. So the update is
the one a torchrun launch with the same layout makes on the same samples. The samples
themselves are the one-process run's (one rollout), so rewards equal the local backend's bit
for bit, and the step's metrics are merged by ``Ranks.mean``'s rule (``merge_rank_metrics``):
every metric equals a torchrun launch's of the same layout bit for bit (tested with 2 gloo
ranks). Against the one-process update it differs in the last bits (rel 1e-4): the
one-process actor sums every row's gradient in one pass, each rank here sums its own rows
and the ranks' sums are all-reduced (docs/parallel.md).

What waits on what: each call blocks its caller until every worker has answered, or raises the
first error any worker raised (a worker that fails while its peers wait in a collective stops
the run with its own error; the backend then kills the group). Calls go out to the workers
under one lock, so every worker receives them in the same order.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
from typing import Any

import torch

from diffrl.backends.ray import ActorHost, RemoteWeights, _cause, _ray, import_plugins
from diffrl.build import actor_side, setup_process
from diffrl.config import Config
from diffrl.errors import ConfigError, ContractError, DiffrlError
from diffrl.models.registry import load_model
from diffrl.parallel.launch import merge_rank_metrics
from diffrl.parallel.launch import start as start_ranks
from diffrl.types import TrainBatch


def check_group(cfg: Config) -> None:
    """What an actor group inside Ray does not run, refused before anything is placed."""
    n, par = cfg.placement.actor.replicas, cfg.parallel
    if par.etp > 1:
        raise ConfigError(
            f"config key 'parallel.etp' = {par.etp} with placement.actor.replicas={n}: the "
            "text encoders' sharded start-up (shard them over the etp group, encode every "
            "prompt, seal the cache) is made by the rollout side, which the actor workers do "
            "not hold; set parallel.etp=1 (or run under torchrun with run.backend=local)"
        )
    if par.tp > 1 and par.rollout == "sharded":
        raise ConfigError(
            f"config key 'parallel.rollout' = 'sharded' with parallel.tp={par.tp} and "
            f"placement.actor.replicas={n}: a sharded rollout samples on the actor's tp group, "
            "and under Ray the rollout is its own host with a whole copy, synced with the "
            "gathered LoRA; set parallel.rollout=replicated"
        )
    if cfg.actor.minibatches != 1:
        raise ConfigError(
            f"config key 'actor.minibatches' = {cfg.actor.minibatches} with "
            f"placement.actor.replicas={n}: the ranks take one optimizer step per RL step "
            "together; set actor.minibatches=1"
        )


def worker_options(cfg: Config) -> list[dict]:
    """Ray actor options, one per worker: ``placement.actor``'s cpus and gpus each (the
    backend's ``_check_fits`` counted them, replicas included). The placement step (placement
    groups for every pool) replaces this with its own list."""
    pool = cfg.placement.actor
    return [{"num_cpus": pool.cpus, "num_gpus": pool.gpus}] * pool.replicas


class ActorWorker(ActorHost):
    """One rank of the actor group: an ``ActorHost`` whose build waits for ``join`` (the
    group's address is known only once worker 0 has picked its port)."""

    def __init__(self, cfg: Config, threads: int, rank: int, world: int) -> None:
        self.cfg, self.threads, self.rank, self.world = cfg, threads, rank, world

    def address(self) -> tuple[str, int]:
        """This node's address and a port free on it (worker 0: the group's rendezvous)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return _ray().util.get_node_ip_address(), port

    def join(self, master: tuple[str, int], local_rank: int, local_world: int) -> dict:
        """Set a torchrun rank's environment, join the group and build the actor; this rank's
        place in the layout. A DiffrlError while building is raised (the controller raises
        the first one any worker raised)."""
        cfg = self.cfg
        os.environ.update(
            RANK=str(self.rank), WORLD_SIZE=str(self.world), LOCAL_RANK=str(local_rank),
            LOCAL_WORLD_SIZE=str(local_world), MASTER_ADDR=master[0], MASTER_PORT=str(master[1]),
        )  # fmt: skip
        gpus = _ray().get_gpu_ids()
        if gpus:  # Ray made its GPU the only one this process sees
            cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, device="cuda:0"))
        import_plugins(cfg.ray.imports)
        self.ranks = start_ranks(cfg, actor_group=True)
        device = setup_process(cfg, self.threads)
        self.actor = actor_side(cfg, load_model(cfg.model, device), device, self.ranks)
        self.device = device  # where its end of the weight path stages (rank 0)
        return {
            "rank": self.rank,
            "dp_rank": self.ranks.dp_rank,
            "dp_size": self.ranks.dp_size,
            "device": str(device),
            **self.describe(),
        }

    def diagnostics(self, batch: TrainBatch) -> dict[str, float]:
        """The algorithm's diagnostics on the whole batch's first micro-batch, as the one-process
        actor runs them (``Lockstep`` has none: a rank without rows could not join the
        forward). Every rank runs the same rows, so the FSDP2 gathers stay in step."""
        if not len(batch) or self.actor.algorithm.diagnostics is None:
            return {}
        return self.actor._diagnostics(batch)

    def train_rows(self, batch: TrainBatch, mine: torch.Tensor) -> tuple[dict, int]:
        """One RL update on rows ``mine`` of the step's whole batch (the diagnostics on the
        whole batch's first rows first, as in one process)."""
        self.check_received(batch)
        out = self.diagnostics(batch)
        out.update(self.actor.train_step(batch.select(mine)))
        return out, self.actor.version

    def export_weights(self, adapter: str):
        """Rank 0 stages the export on the group's weight path (``open_weights``); the others
        take part in the export (a collective under tp) and keep nothing."""
        if self.rank == 0:
            return super().export_weights(adapter)
        self.actor.export_weights(adapter)
        return None, None

    def adapter_tensors(self) -> dict | None:
        tensors = super().adapter_tensors()
        return tensors if self.rank == 0 else None

    def state_dict(self) -> dict | None:
        state = super().state_dict()
        return state if self.rank == 0 else None


def get_all(refs: list) -> list:
    """Every worker's answer, in rank order; the first error any worker raises is raised as
    soon as it comes (its peers may be waiting for it in a collective)."""
    ray = _ray()
    pending, done = list(refs), {}
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        try:
            done[ready[0]] = ray.get(ready[0])
        except ray.exceptions.RayTaskError as e:
            raise _cause(e) from None
    return [done[r] for r in refs]


def start_group(cfg: Config, threads: int, options: list[dict], started: list):
    """Starts the group's workers (each appended to ``started`` as soon as it exists, so the
    caller can kill them) and their builds; returns a function that waits for the builds and
    gives the controller's proxy (the builds overlap the other hosts')."""
    ray = _ray()
    world = len(options)
    cls = ray.remote(ActorWorker)
    workers = []
    for rank, opts in enumerate(options):
        workers.append(cls.options(**opts, max_concurrency=1).remote(cfg, threads, rank, world))
        started.append(workers[-1])
    nodes = get_all([w.address.remote() for w in workers])  # (node ip, a free port) each
    ips = [ip for ip, _ in nodes]
    local = [ips[:r].count(ips[r]) for r in range(world)]  # LOCAL_RANK: order on its node
    joins = [w.join.remote(nodes[0], local[r], ips.count(ips[r])) for r, w in enumerate(workers)]
    return lambda: RemoteActorGroup(workers, get_all(joins), cfg.data.prompts_per_step)


class RemoteActorGroup:
    """The actor group, as ``ActorEngineProtocol``: every call on every worker, rank 0's
    result. ``version`` is the ranks' (equal) version after the last call that changes it."""

    def __init__(self, workers: list, infos: list[dict], prompts_per_step: int) -> None:
        self.workers, self.prompts = workers, prompts_per_step
        self.dp_rank = [i["dp_rank"] for i in infos]
        self.dp_size = infos[0]["dp_size"]
        self.version = self._agree("version", [i["version"] for i in infos])
        self._eval_adapter = infos[0]["eval_adapter"]
        self.bound = infos[0]["bound"]
        self.lock = threading.Lock()
        self.parts: list[list[TrainBatch]] = []  # streamed: each dp rank's parts not yet sent
        self.diagnosed, self.diag = False, {}
        self.weights = "object_store"  # the path rank 0 sends on (build_ray connects it)

    @property
    def eval_adapter(self) -> str:
        return self._eval_adapter

    def _call(self, method: str, *args, each=None) -> list:
        """``method`` on every worker (``each(rank)``: that worker's own arguments), answers
        in rank order. Sent under the lock: every worker gets the calls in one order."""
        with self.lock:
            refs = [
                getattr(w, method).remote(*(args if each is None else each(r)))
                for r, w in enumerate(self.workers)
            ]
        return get_all(refs)

    def _agree(self, what: str, values: list) -> Any:
        if any(v != values[0] for v in values):
            raise ContractError(
                f"the actor group's ranks disagree on their {what}: {values} (rank order); "
                "they must take every update together"
            )
        return values[0]

    def rows(self, batch: TrainBatch, dp_rank: int) -> torch.Tensor:
        """The row indices a torchrun launch's data-parallel rank ``dp_rank`` holds: those of
        its contiguous share of the step's prompt groups (``TrainBatch.group`` is the prompt's
        place in the step)."""
        if batch.group is None:
            raise DiffrlError("the actor group splits a batch by prompt group: it has none")
        per = self.prompts // self.dp_size
        group = batch.group.cpu()
        if len(group) and int(group.max()) >= self.prompts:
            raise DiffrlError(
                f"a train batch has prompt group {int(group.max())}, and a step has "
                f"{self.prompts} prompts (data.prompts_per_step)"
            )
        lo = dp_rank * per
        return ((group >= lo) & (group < lo + per)).nonzero().squeeze(1)

    def _merge(self, answers: list[dict]) -> dict[str, float]:
        """The step's metrics as a torchrun launch of the same layout reports them
        (``Ranks.mean``'s rule: the float64 mean over ranks, "*_max" the largest)."""
        return merge_rank_metrics(answers)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        ref = _ray().put(batch)  # once: every worker reads it from the object store
        answers = self._call("train_rows", each=lambda r: (ref, self.rows(batch, self.dp_rank[r])))
        self.version = self._agree("version", [v for _, v in answers])
        return self._merge([m for m, _ in answers])

    def begin_stream(self, expected_rows: int) -> None:
        self._call("begin_stream", expected_rows)
        self.parts = [[] for _ in range(self.dp_size)]
        self.diagnosed, self.diag = False, {}

    def train_part(self, part: TrainBatch) -> None:
        """Each dp rank's rows of ``part`` join its queue; every round in which each dp rank
        has a part is trained (the k-th part of every rank together, as under torchrun). The
        diagnostics run on the first part with rows, as the one-process actor's do."""
        if not self.diagnosed and len(part):
            self.diagnosed = True
            self.diag = self._call("diagnostics", _ray().put(part))[0]
        for k in range(self.dp_size):
            mine = self.rows(part, k)
            if len(mine):
                self.parts[k].append(part.select(mine))
        while all(self.parts):
            self._round([q.pop(0) for q in self.parts])

    def _round(self, parts: list[TrainBatch]) -> None:
        self._call("train_part", each=lambda r: (parts[self.dp_rank[r]],))

    def end_stream(self) -> dict[str, float]:
        """The parts some dp ranks still hold are trained (the others make the round with an
        empty part: their spare row, as a torchrun rank short of parts does); then the step."""
        while any(self.parts):
            empty = next(q[0] for q in self.parts if q).select(torch.arange(0))
            self._round([q.pop(0) if q else empty for q in self.parts])
        answers = self._call("end_stream")
        self.version = self._agree("version", [v for _, v in answers])
        return {**self.diag, **self._merge([m for m, _ in answers])}

    def update_old(self, decay: float) -> None:
        self._call("update_old", decay)

    def export_weights(self, adapter: str = "default") -> RemoteWeights:
        with self.lock:  # the update stays in the object store; the rollout host fetches it
            calls = [w.export_weights.options(num_returns=2) for w in self.workers]
            refs = [c.remote(adapter) for c in calls]  # (handle, sent) each
        get_all([r[0] for r in refs[1:]])  # the other ranks' part of the collective, and errors
        return RemoteWeights(refs[0][0], refs[0][1], self.weights, self.workers[0])

    def adapter_tensors(self) -> dict:
        return self._call("adapter_tensors")[0]

    def state_dict(self) -> dict:
        return self._call("state_dict")[0]

    def load_state(self, adapters: dict, state: dict) -> None:
        ray = _ray()
        a, s = ray.put(adapters), ray.put(state)
        self.version = self._agree("version", self._call("load_state", a, s))
