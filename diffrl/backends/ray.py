"""The Ray backend (``run.backend=ray``): the rollout, reward and actor engines run as Ray
actors on the ``placement`` section's pools (placement groups, ``backends/ray_placement.py``),
behind the engine Protocols the controller is written against (``diffrl.engines``). The
controller is the same file in both backends; only this factory differs.

Three kinds of host, one process each:
- ``RolloutHost`` loads the model, runs the data stage (tokenize once, contract 3) and the
  start-up probe, and holds the two rollout engines: the training rollout and the held-out
  evaluator. The controller gets the tokenized prompt sets from it. With
  ``placement.rollout.replicas`` > 1 there is one per replica, behind one dispatcher
  (``backends/ray_rollout.py``; replica 0 runs the probe).
- ``RewardHost`` holds the scorer pool.
- ``ActorHost`` loads the model and holds the actor engine.

Every host seeds and sets its threads as the one-process run does (``setup_process``), and
builds its engines in the same order, so a run gives the same metrics as the local backend
at the same seed (``tests/backends/test_ray.py``).

Records: a rollout's micro-batches stream to the controller through Ray's object store (a
streaming generator) or through TransferQueue (``ray.channel``), and leave the host on the
CPU. Weights take the path ``placement.weights`` names (``weight_path``; ``sync/transport.py``):
``export_weights`` stages the update on the actor host and returns a small handle; at
``load_weights`` the rollout host fetches it from the object store, opens the actor's IPC
handles, or takes the actor host's broadcast over a weight group of their own. The tensors
never pass through the controller, and every path is checked before anything is applied.

What waits on what: the proxies' ``train_step`` and ``load_weights`` block their caller (the
controller runs the update in a worker thread, as with the local actor); ``stream``, ``generate``
and ``score`` are awaited on the controller's event loop.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import logging
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from diffrl.backends.ray_placement import ROLES, Placed, place
from diffrl.backends.ray_rollout import (
    ENGINES,
    ReplicaSet,
    RolloutReplicas,
    check_same_prompts,
)
from diffrl.build import (
    Engines,
    actor_side,
    actor_targets,
    check_config,
    rollout_side,
    setup_process,
)
from diffrl.channel import Channel
from diffrl.config import Config
from diffrl.errors import ConfigError, DiffrlError
from diffrl.models.registry import load_model
from diffrl.reward.pool import RewardPool, close_pool
from diffrl.sync.bound import check_bound
from diffrl.sync.receipt import SyncReceipt, expected_of
from diffrl.sync.transport import WeightSink, WeightSource
from diffrl.sync.weights import SyncReport
from diffrl.tasks import build_task, prompt_source
from diffrl.types import (
    PromptBatch,
    ScoredBatch,
    TrainBatch,
    Trajectory,
    check_token_hashes,
    to_device,
)

log = logging.getLogger(__name__)
CPU = torch.device("cpu")


def _ray():
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "config key 'run.backend' = 'ray': Ray is not installed here; "
            "pip install -e '.[ray]' (or set run.backend=local)"
        ) from None
    return ray


def import_plugins(names: list[str]) -> None:
    """Import each module or .py file (``ray.imports``) for its registrations."""
    for name in names:
        if not name.endswith(".py"):
            importlib.import_module(name)
            continue
        path = Path(name).resolve()
        spec = importlib.util.spec_from_file_location(f"diffrl_plugin_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)


# --- the hosts: one Ray actor each ----------------------------------------------------------


class Host:
    """A host keeps a DiffrlError raised while it builds its engines and raises it from
    ``info``, the controller's first call: the run stops with the error's own message, not an
    actor death."""

    error: DiffrlError | None = None
    role = "engine"

    def __init__(self, cfg: Config, threads: int, **kw) -> None:
        try:
            import_plugins(cfg.ray.imports)
            self.build(cfg, threads, **kw)
        except DiffrlError as e:
            self.error = e

    def build(self, cfg: Config, threads: int, **kw) -> None:
        raise NotImplementedError

    def info(self) -> dict:
        if self.error is not None:
            raise self.error
        return self.describe()

    def describe(self) -> dict:
        return {}

    async def run_edge(self, fn, *args):
        """``fn(self, *args)``: a data edge's part on this host (``backends/ray_edges.py``)."""
        return await fn(self, *args)

    def check_received(self, record: PromptBatch | TrainBatch) -> None:
        """Contract 3 on a record as it arrives from the controller (serialised through Ray):
        its ids and conditions re-hashed against the hashes that travel with it."""
        check_token_hashes(record, f"the Ray {self.role} host (pid {os.getpid()})")


class RolloutHost(Host):
    role = "rollout"

    def build(self, cfg: Config, threads: int, probe: bool = True) -> None:
        device = setup_process(cfg, threads)
        side = rollout_side(cfg, device, probe=probe)
        self.side = side
        self.engines = {"rollout": side.rollout, "evaluator": side.evaluator}
        self.device = device

    def describe(self) -> dict:
        s = self.side
        return {
            "train": s.train,
            "eval_set": s.eval_set,
            "probe": s.probe,
            "produces": frozenset(s.rollout.produces),
            "family": s.base.family.name,
            "bound": s.rollout.bound,
        }

    async def stream(self, which: str, prompts: PromptBatch, seed: int, kw: dict):
        """Yields the engine's micro-batches as they finish, on the CPU."""
        self.check_received(prompts)
        channel = Channel(capacity=1)
        producer = asyncio.create_task(self.engines[which].stream(prompts, seed, channel, **kw))
        async for traj in channel:
            yield to_device(traj, CPU)
        await producer

    async def generate(self, which: str, prompts: PromptBatch, seed: int, kw: dict):
        self.check_received(prompts)
        return to_device(await self.engines[which].generate(prompts, seed, **kw), CPU)

    async def load_weights(self, which: str, handle: Any) -> SyncReport:
        # runs on the host's event loop between batches: the controller never syncs mid-batch.
        # The transport's checks first (a broadcast receive blocks until the actor sends)
        return self.engines[which].load_weights(self.weights.receive(which, handle))

    def where(self) -> tuple[str, str]:
        return _where(self.device)

    def open_weights(self, path: str, host: str, port: int, rank: int, world: int) -> None:
        """This host's end of the weight path (broadcast: rank ``rank`` of the group whose
        store the actor host serves at ``host:port``; it forms at the first sync)."""
        self.weights = WeightSink(path, self.device, WEIGHT_TIMEOUT_S)
        self.weights.join(host, port, rank, world)

    async def receipt(self, which: str) -> SyncReceipt:
        return self.engines[which].receipt()

    async def offer(self, which: str, handle: Any) -> None:
        # served while a stream samples (an async actor): applied at the next step boundary,
        # after the transport's checks (the object-store path: a send-free handle)
        self.engines[which].offer(self.weights.receive(which, handle))

    async def take_synced(self, which: str) -> dict[str, float]:
        return self.engines[which].take_synced()


class RewardHost(Host):
    def build(self, cfg: Config, threads: int) -> None:
        setup_process(cfg, threads)
        self.pool = RewardPool(cfg.reward)

    def describe(self) -> dict:
        return {"groupwise": self.pool.groupwise}  # whole groups per call (reward/edges.py)

    async def score(self, traj: Trajectory):
        return await self.pool.score(traj)

    async def check_inputs(self, produced: set[str]) -> None:
        self.pool.check_inputs(produced)

    async def observe_step(self, scored: ScoredBatch) -> None:
        self.pool.observe_step(scored)

    async def close(self) -> None:
        if self.error is None:
            await close_pool(self.pool)


class ActorHost(Host):
    role = "actor"

    def build(self, cfg: Config, threads: int) -> None:
        device = setup_process(cfg, threads)
        self.actor = actor_side(cfg, load_model(cfg.model, device), device)
        self.device = device

    def describe(self) -> dict:
        return {
            "version": self.actor.version,
            "eval_adapter": self.actor.eval_adapter,
            "bound": self.actor.bound,
        }

    def train_step(self, batch: TrainBatch) -> tuple[dict[str, float], int]:
        self.check_received(batch)
        return self.actor.train_step(batch), self.actor.version

    def begin_stream(self, expected_rows: int) -> None:
        self.actor.begin_stream(expected_rows)

    def train_part(self, part: TrainBatch) -> None:
        self.check_received(part)
        self.actor.train_part(part)

    def end_stream(self) -> tuple[dict[str, float], int]:
        return self.actor.end_stream(), self.actor.version

    def update_old(self, decay: float) -> None:
        self.actor.update_old(decay)

    def export_weights(self, adapter: str) -> tuple[Any, tuple[int, dict]]:
        """The object-store handle, or (broadcast, ipc) the key ``send_weights`` takes; and
        the export's version and expected receipt (small: the controller checks the
        rollout's receipt against it without fetching the update). One call returns both (two
        object refs), so the receipt describes this export whatever order Ray runs calls in."""
        update = self.actor.export_weights(adapter)
        sent = (update.version, expected_of(update))  # what its receipt must show
        return self.weights.stage(update), sent

    def send_weights(self, key: int) -> Any:
        """An export on its way: the IPC handle, or the broadcast (returns once every receiver
        took it)."""
        return self.weights.send(key)

    def where(self) -> tuple[str, str]:
        return _where(self.device)

    def open_weights(self, path: str, world: int) -> tuple[str, int]:
        """This host's end of the weight path; (address, port) of the weight group's store
        (broadcast: served here on a free port, for rank 0 and ``world - 1`` receivers)."""
        self.weights = WeightSource(path, self.device, WEIGHT_TIMEOUT_S)
        host = _ray().util.get_node_ip_address()
        return host, self.weights.rendezvous(host, world) if path == "broadcast" else 0

    def adapter_tensors(self) -> dict:
        return self.actor.adapter_tensors()

    def state_dict(self) -> dict:
        return self.actor.state_dict()

    def load_state(self, adapters: dict, state: dict) -> int:
        self.actor.load_state(adapters, state)
        return self.actor.version


# --- the proxies the controller holds ---------------------------------------------------------


def _get(ref):
    """``ray.get`` that raises a remote DiffrlError as itself (a clear message, no remote
    traceback around it); other remote errors keep Ray's report."""
    ray = _ray()
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        raise _cause(e) from None


def _cause(e):
    cause = getattr(e, "cause", None)
    return cause if isinstance(cause, DiffrlError) else e


async def _await(ref):
    ray = _ray()
    try:
        return await ref
    except ray.exceptions.RayTaskError as e:
        raise _cause(e) from None


@dataclass(frozen=True)
class RemoteWeights:
    """An export of the remote actor (what its ``export_weights`` returns): the object-store
    handle, or the key to the update it holds (broadcast, ipc); the rollout host gets the
    tensors itself."""

    ref: Any
    sent_ref: Any = None  # (version, expected receipt), computed by the actor host
    path: str = "object_store"
    actor: Any = None  # the actor host, which sends a staged export (broadcast, ipc)

    def sent(self) -> tuple[int, dict]:
        return _get(self.sent_ref)


class RemoteRollout:
    """A rollout engine on a ``RolloutHost`` (``which``: the training rollout or the
    evaluator), as ``RolloutEngineProtocol``. Its micro-batches reach the controller as a Ray
    streaming generator; with ``ray.channel=transferqueue`` a step's samples take the
    TransferQueue edges instead (``backends/ray_edges.py``), past this proxy."""

    def __init__(self, host, which: str, produces: frozenset[str]) -> None:
        self.host, self.which, self._produces = host, which, produces
        self.version = 0

    @property
    def produces(self) -> frozenset[str]:
        return self._produces

    async def stream(
        self, prompts: PromptBatch, seed: int, channel: Channel, *, iteration: int = 0, **kw
    ) -> None:
        """Puts the host's micro-batches into ``channel`` as each arrives, then closes it."""
        kw = {**kw, "iteration": iteration}
        try:
            gen = self.host.stream.options(num_returns="streaming").remote(
                self.which, prompts, seed, kw
            )
            async for ref in gen:
                traj = await _await(ref)
                await channel.put(traj, traj.policy_version)
        finally:
            channel.close()

    async def generate(self, prompts: PromptBatch, seed: int, **kw) -> Trajectory:
        return await _await(self.host.generate.remote(self.which, prompts, seed, kw))

    def load_weights(self, update) -> SyncReport:
        if isinstance(update, RemoteWeights) and update.path != "object_store":
            report = _send_and_load(update, self.host, self.which)
        else:
            arg = update.ref if isinstance(update, RemoteWeights) else update
            report = _get(self.host.load_weights.remote(self.which, arg))
        self.version = report.version
        return report

    def receipt(self) -> SyncReceipt:
        return _get(self.host.receipt.remote(self.which))

    def offer(self, update) -> None:  # run.async_sync=step (RolloutEngine.offer)
        if isinstance(update, RemoteWeights) and update.path != "object_store":
            raise ConfigError(
                f"config key 'placement.weights' resolved to {update.path!r}: run.async_sync=step "
                "offers weights to a sampling rollout host, which takes them through the object "
                "store only; set placement.weights=object_store (or run.async_sync=batch)"
            )
        _get(self.host.offer.remote(self.which, getattr(update, "ref", update)))

    def take_synced(self) -> dict[str, float]:
        return _get(self.host.take_synced.remote(self.which))


def _send_and_load(update: RemoteWeights, host, which: str) -> SyncReport:
    """A staged export sent and loaded. IPC: the actor's handle is the load's argument (Ray
    passes it on). Broadcast: send and receive run at once (a collective); whichever side
    fails first raises its own error, not its peer's timeout."""
    sending = update.actor.send_weights.remote(update.ref)
    if update.path == "ipc":
        return _get(host.load_weights.remote(which, sending))
    loading = host.load_weights.remote(which, None)
    first, _ = _ray().wait([sending, loading], num_returns=1)
    _get(first[0])
    _get(sending)
    return _get(loading)


class RayReplica:
    """A ``RolloutHost`` as one of several rollout replicas (``backends/ray_rollout.py``'s
    ``Replica``)."""

    def __init__(self, host) -> None:
        self.host = host

    async def generate(self, which: str, prompts: PromptBatch, seed: int, kw: dict) -> Trajectory:
        return await _await(self.host.generate.remote(which, prompts, seed, kw))

    def load_weights(self, which: str, update) -> SyncReport:
        arg = update.ref if isinstance(update, RemoteWeights) else update
        return _get(self.host.load_weights.remote(which, arg))

    def receipt(self, which: str) -> SyncReceipt:
        return _get(self.host.receipt.remote(which))

    def offer(self, which: str, update) -> None:  # run.async_sync=step
        _get(self.host.offer.remote(which, getattr(update, "ref", update)))

    def take_synced(self, which: str) -> dict[str, float]:
        return _get(self.host.take_synced.remote(which))


class RemoteRewards:
    """The scorer pool on a ``RewardHost``, as ``RewardEngineProtocol``."""

    edges: Any = None  # one step's rollout -> reward -> controller, when not through here

    def __init__(self, host, groupwise: bool = False) -> None:
        self.host = host
        self.groupwise = groupwise  # the pool's: its calls must hold whole groups

    async def score(self, traj: Trajectory) -> tuple[ScoredBatch, dict[str, float]]:
        return await _await(self.host.score.remote(traj))

    def check_inputs(self, produced: set[str]) -> None:
        _get(self.host.check_inputs.remote(set(produced)))

    def observe_step(self, scored: ScoredBatch) -> None:
        _get(self.host.observe_step.remote(scored))


class RemoteActor:
    """The actor engine on an ``ActorHost``, as ``ActorEngineProtocol``. ``version`` is the
    host's after the last call that changes it."""

    def __init__(self, host, weights: str = "object_store") -> None:
        self.host, self.weights = host, weights
        info = _get(host.info.remote())
        self.version, self._eval_adapter = info["version"], info["eval_adapter"]
        self.bound = info["bound"]  # the modules its adapter is on (the bound-module gate)

    @property
    def eval_adapter(self) -> str:
        return self._eval_adapter

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        metrics, self.version = _get(self.host.train_step.remote(batch))
        return metrics

    def begin_stream(self, expected_rows: int) -> None:
        _get(self.host.begin_stream.remote(expected_rows))

    def train_part(self, part: TrainBatch) -> None:
        _get(self.host.train_part.remote(part))

    def end_stream(self) -> dict[str, float]:
        metrics, self.version = _get(self.host.end_stream.remote())
        return metrics

    def update_old(self, decay: float) -> None:
        _get(self.host.update_old.remote(decay))

    def export_weights(self, adapter: str = "default") -> RemoteWeights:
        # the host runs one call at a time, in order: sent() describes this export
        ref, sent = self.host.export_weights.options(num_returns=2).remote(adapter)
        return RemoteWeights(ref, sent, self.weights, self.host)

    def adapter_tensors(self) -> dict:
        return _get(self.host.adapter_tensors.remote())

    def state_dict(self) -> dict:
        return _get(self.host.state_dict.remote())

    def load_state(self, adapters: dict, state: dict) -> None:
        self.version = _get(self.host.load_state.remote(adapters, state))


# --- the factory --------------------------------------------------------------------------------


def _check_built(cfg: Config) -> None:
    """What of the ``placement`` section this backend carries out today."""
    p = cfg.placement
    if p.rollout.replicas > 1 and cfg.ray.channel != "object_store":
        raise ConfigError(
            f"config keys 'placement.rollout.replicas' = {p.rollout.replicas}, 'ray.channel' = "
            f"{cfg.ray.channel!r}: several rollout replicas send their micro-batches through "
            "the object store only yet; set ray.channel=object_store or one replica"
        )
    if p.rollout.replicas > 1 and p.weights not in ("auto", "object_store"):
        raise ConfigError(
            f"config keys 'placement.weights' = {p.weights!r}, 'placement.rollout.replicas' = "
            f"{p.rollout.replicas}: several rollout replicas take weights through the object "
            "store only yet (a broadcast to N replicas and IPC per replica are not built); set "
            "placement.weights=object_store (or auto) or one replica"
        )
    if p.weights == "broadcast" and (p.actor.gpus > 0) != (p.rollout.gpus > 0):
        raise ConfigError(
            f"config key 'placement.weights' = {p.weights!r}: a broadcast needs the actor and "
            f"the rollout both on GPUs (NCCL) or both on CPUs (gloo); placement.actor.gpus="
            f"{p.actor.gpus:g}, placement.rollout.gpus={p.rollout.gpus:g}"
        )


# how long a weight group waits for a peer (joining, or one send) before it raises
WEIGHT_TIMEOUT_S = 300.0


def _where(device: torch.device) -> tuple[str, str]:
    """(Ray node, GPU UUID or "" on the CPU) of a host's device."""
    gpu = str(torch.cuda.get_device_properties(device).uuid) if device.type == "cuda" else ""
    return _ray().get_runtime_context().get_node_id(), gpu


def weight_path(cfg: Config, actor: tuple[str, str], rollout: tuple[str, str]) -> str:
    """``placement.weights`` resolved for hosts placed at ``actor`` and ``rollout`` (node,
    GPU): ``auto`` is IPC when they share a GPU (fractional pools can land on one), a
    broadcast (NCCL) when both are on GPUs apart, else the object store. A path that cannot
    run where they are is a ConfigError."""
    p, key = cfg.placement, f"config key 'placement.weights' = {cfg.placement.weights!r}"
    one_gpu = actor == rollout and actor[1] != ""
    path = p.weights
    if path == "auto":
        path = ("ipc" if one_gpu else "broadcast") if actor[1] and rollout[1] else "object_store"
    if path == "ipc" and actor[0] != rollout[0]:
        why = "the actor and the rollout run on different nodes; IPC handles open only there"
        raise ConfigError(f"{key}: {why} (use broadcast)")
    if path == "ipc" and (actor[1] or rollout[1]) and not one_gpu:
        gpus = f"{actor[1] or 'none'} and {rollout[1] or 'none'}"
        raise ConfigError(f"{key}: CUDA IPC needs the actor and the rollout on one GPU: {gpus}")
    if path == "broadcast" and one_gpu:
        why = f"the actor and the rollout share GPU {actor[1]}, and NCCL cannot run two ranks"
        raise ConfigError(f"{key}: {why} on one GPU; use ipc (or auto)")
    return path


def _connect_weights(cfg: Config, actor_host, rollout_hosts: list) -> str:
    """Each host's end of the weight path; returns the path. Broadcast: the actor host serves
    the group's store on a free port, the rollout host (rank 1 of 2) learns where; the group
    forms at the first sync. Several replicas take the object store (``_check_built`` refuses
    another path for them)."""
    where = _get(actor_host.where.remote())
    path = weight_path(cfg, where, _get(rollout_hosts[0].where.remote()))
    if len(rollout_hosts) > 1:
        path = "object_store"
    world = 1 + len(rollout_hosts)
    host, port = _get(actor_host.open_weights.remote(path, world))
    for rank, h in enumerate(rollout_hosts, 1):
        _get(h.open_weights.remote(path, host, port, rank, world))
    return path


def _start_ray(cfg: Config) -> bool:
    """Connects to (or starts) Ray; True when this run started it (and so stops it)."""
    ray = _ray()
    if ray.is_initialized():
        return False
    kw: dict[str, Any] = {"include_dashboard": False, "logging_level": logging.WARNING}
    if cfg.ray.address:
        kw["address"] = cfg.ray.address
    elif cfg.ray.num_cpus:
        kw["num_cpus"] = cfg.ray.num_cpus
    else:  # all cores, or as many logical CPUs as the pools ask for (they share the cores)
        asks = sum(
            getattr(cfg.placement, r).replicas * getattr(cfg.placement, r).cpus for r in ROLES
        )
        kw["num_cpus"] = max(os.cpu_count() or 1, math.ceil(asks))
    ray.init(**kw)
    return True


def _start_transferqueue() -> bool:
    """TransferQueue on this Ray cluster; True when this run started it (and so stops it)."""
    if importlib.util.find_spec("transfer_queue") is None:
        raise ConfigError(
            "config key 'ray.channel' = 'transferqueue': TransferQueue is not installed here; "
            "pip install -e '.[ray]' (or set ray.channel=object_store)"
        )
    from diffrl.channel.transferqueue import _controller, start_transferqueue

    running = _controller() is not None
    start_transferqueue()
    return not running


def build_ray(cfg: Config, start_group=None) -> Engines:
    """The run's engines as Ray actors, behind the local engines' Protocols. ``start_group``
    (``backends/ray_actor_group.start_group``, handed in by ``backends.build_engines``, which
    checks the group's layout first) starts the actor as a group when
    ``placement.actor.replicas`` > 1; ray_actor_group builds on this module's hosts, so this
    module does not import it."""
    algorithm = check_config(cfg)
    ray = _ray()
    started = _start_ray(cfg)
    actors: list = []
    placed: Placed | None = None

    def host(cls, opts: dict, threads: int, **kw):
        handle = ray.remote(cls).options(**opts).remote(cfg, threads, **kw)
        actors.append(handle)
        return handle

    async def close() -> None:
        try:
            await _await(rewards_host.close.remote())
        finally:
            shutdown()

    tq_started = False

    def shutdown() -> None:
        for a in actors:
            ray.kill(a)
        if placed is not None:
            placed.remove()
        if tq_started:
            from diffrl.channel.transferqueue import stop_transferqueue

            stop_transferqueue()
        if started:
            ray.shutdown()

    try:
        _check_built(cfg)
        placed = place(cfg.placement, cfg.ray.place_timeout_s)
        if cfg.ray.channel == "transferqueue":
            tq_started = _start_transferqueue()
        # the threads a local run would use, unless run.threads says: the same numerics
        threads = cfg.run.threads or torch.get_num_threads()
        device = setup_process(cfg)  # the controller's own draws (prompt order) match local
        # replica 0 runs the start-up probe; the others load the same model and config, so its
        # result stands for them (and a replacement starts sooner)
        rollout_hosts = [
            host(RolloutHost, opts, threads, probe=i == 0) for i, opts in enumerate(placed.rollout)
        ]
        rewards_host = host(RewardHost, placed.reward, threads)
        group_actor = None
        if cfg.placement.actor.replicas > 1:  # a torch.distributed group of Ray workers
            if start_group is None:
                raise ConfigError(
                    f"config key 'placement.actor.replicas' = {cfg.placement.actor.replicas}: "
                    "an actor group is started through diffrl.backends.build_engines"
                )
            # the group's builds first: a worker's error ends the run while its peers wait
            group_actor = start_group(cfg, threads, placed.actor, actors)()
        else:
            actor_host = host(ActorHost, {**placed.actor[0], "max_concurrency": 1}, threads)
        info = _get(rollout_hosts[0].info.remote())
        for i, h in enumerate(rollout_hosts[1:], 1):  # contract 3 across replicas
            check_same_prompts(info, _get(h.info.remote()), f"rollout replica {i}")
        rewards = RemoteRewards(rewards_host, _get(rewards_host.info.remote())["groupwise"])
        if cfg.ray.channel == "transferqueue":  # both edges on TransferQueue, past the controller
            from diffrl.backends.ray_edges import TransferQueueEdges

            rewards.edges = TransferQueueEdges(rewards_host)
        rewards.check_inputs(produced=set(info["produces"]))
        if group_actor is not None:  # rank 0 holds the group's end of the weight path
            group_actor.weights = _connect_weights(cfg, group_actor.workers[0], rollout_hosts)
        actor = group_actor or RemoteActor(
            actor_host, _connect_weights(cfg, actor_host, rollout_hosts)
        )
        # the bound-module gate across hosts: the actor's adapter and the rollout's copy
        bound = check_bound(actor_targets(cfg), info["family"], actor.bound, info["bound"])
        rollout, evaluator = rollout_engines(
            cfg,
            rollout_hosts,
            info,
            lambda i: _sink(host(RolloutHost, placed.rollout[i], threads, probe=False)),
        )
    except BaseException:
        shutdown()
        raise
    return Engines(
        cfg,
        device,
        build_task(cfg.data),
        prompt_source(info["train"], cfg.data, cfg.run.seed),
        info["eval_set"],
        rollout,
        evaluator,
        rewards,
        actor,
        algorithm,
        info["probe"],
        close=close,
        bound=bound,
    )


def _sink(rollout_host):
    """A replacement replica's end of the weight path (several replicas: the object store)."""
    _get(rollout_host.open_weights.remote("object_store", "", 0, 1, 2))
    return rollout_host


def rollout_engines(cfg: Config, hosts: list, info: dict, start) -> tuple:
    """The training rollout and the evaluator: on the one host, or (several replicas) behind
    one dispatcher each over the same replicas; ``start(i)`` starts replica i again."""
    if len(hosts) == 1:
        return tuple(RemoteRollout(hosts[0], w, info["produces"]) for w in ENGINES)
    ray = _ray()

    def restart(i: int) -> RayReplica:
        ray.kill(replicas.replicas[i].host)  # dead; or hung, and then its bundle is freed
        handle = start(i)
        check_same_prompts(info, _get(handle.info.remote()), f"rollout replica {i}")
        return RayReplica(handle)

    died = (ray.exceptions.RayActorError,)
    replicas = ReplicaSet([RayReplica(h) for h in hosts], restart, died, cfg.rollout)
    return tuple(RolloutReplicas(replicas, w, info["produces"]) for w in ENGINES)
