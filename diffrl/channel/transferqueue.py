"""A channel on TransferQueue (the Ray backend), behind the in-process channel's interface.

``TransferQueueChannel(name, capacity, max_staleness)`` behaves like ``Channel``: FIFO, ``put``
waits while ``capacity`` records are unconsumed, ``get`` raises ``StaleRecord`` for a record
more than ``max_staleness`` versions old and ``ChannelClosed`` once the channel is closed and
drained. The producer and the consumer may be different processes (Ray actors): the object
pickles as its name and settings, and each process attaches to the running TransferQueue on
first use. ``start_transferqueue`` starts TransferQueue once per Ray cluster.

One TransferQueue partition (``name``) holds one channel. Each record is one key,
``f"{seq:08d}"``, with its version in the key's tag (``{"v": version}``). Its tensors travel as
tensor fields (``t<i>_<dtype>``, e.g. ``t0_float32``) and the rest of the record as a pickle
in a uint8 field (``pickle``) that refers to them. ``close`` writes the next key with the tag
``{"eos": True}`` and no fields; it stays, so every later ``get`` and ``put`` sees it. A key
``channel`` holds the settings and marks the channel as created. The consumer reads the lowest
key once its tag is set (TransferQueue sets tags after the data is stored), then clears it.

``put_many`` writes several records' data untagged and then tags them in one call, so a
consumer sees them together; ``get_ready`` takes every ready record at once.

One producer and one consumer at a time: sequence numbers are the producer's own, and the
consumer claims a record by clearing it after reading, which two consumers could both do.
Both wait by polling the partition's key list (2 ms doubling to ``poll_s``).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import pickle
import threading
import time
from typing import Any

import torch

from diffrl.channel.local import ChannelClosed, Consumable, StaleRecord, check_fresh

__all__ = [
    "ChannelClosed",
    "ChannelNotFound",
    "StaleRecord",
    "TransferQueueChannel",
    "start_transferqueue",
    "stop_transferqueue",
]

HEADER = "channel"  # the key that marks a created channel and holds its settings
PICKLE_FIELD = "pickle"
POLL_MIN_S = 0.002


class ChannelNotFound(LookupError):
    """No TransferQueue partition of that name: a wrong name, or a deleted channel."""


def _quiet_defaults() -> None:
    """TransferQueue's put and get limit torch to ``TQ_NUM_THREADS`` threads (default 8) and log
    a warning on every call where that exceeds the physical cores. Cap the default at the core
    count, which is what TransferQueue then uses anyway, so the warning stays quiet. Effective
    only where this runs before ``transfer_queue`` is imported."""
    try:
        import psutil

        cores = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    except ImportError:
        cores = os.cpu_count() or 1
    os.environ.setdefault("TQ_NUM_THREADS", str(min(8, cores)))


_quiet_defaults()


# --- starting TransferQueue ------------------------------------------------------------------


class _WithCPUs:
    """An actor class whose ``.options()`` also sets ``num_cpus`` (TransferQueue hard-codes
    ``@ray.remote(num_cpus=1)`` on its controller and storage units and has no setting)."""

    def __init__(self, actor_cls: Any, num_cpus: float, env_vars: dict[str, str]) -> None:
        self._cls, self._num_cpus, self._env_vars = actor_cls, num_cpus, env_vars

    def options(self, **kw: Any) -> Any:
        env = kw.pop("runtime_env", None) or {}
        env = {**env, "env_vars": {**self._env_vars, **env.get("env_vars", {})}}
        return self._cls.options(num_cpus=self._num_cpus, runtime_env=env, **kw)


def start_transferqueue(
    num_storage_units: int = 1, num_cpus: float = 0.0, config: dict | None = None
) -> Any:
    """Start TransferQueue on the running Ray cluster (or attach if it runs already) and return
    its config. Call it once, in the driver, after ``ray.init``.

    TransferQueue starts one controller actor and ``num_storage_units`` SimpleStorage actors.
    Each is declared with ``num_cpus=1`` in TransferQueue, held for the actor's lifetime, so the
    default (two units) reserves 3 CPUs and never finishes starting on ``ray.init(num_cpus=2)``.
    Here each reserves ``num_cpus`` (default 0): they idle between requests, and the engines
    keep the cluster's CPUs. ``config`` is merged over TransferQueue's ``config.yaml``.
    """
    global _ATTACHED
    import ray

    if not ray.is_initialized():
        raise RuntimeError("start_transferqueue needs Ray: call ray.init() first")
    import transfer_queue as tq
    from omegaconf import OmegaConf
    from transfer_queue import interface
    from transfer_queue.storage.bootstrap import simple_storage_bootstrap as bootstrap

    running = _controller()
    if running is not None:  # started already (here or by another process): attach
        _attach()
        return ray.get(running.get_config.remote())
    conf = OmegaConf.merge(
        {
            "controller": {"polling_mode": False},
            "metrics": {"enabled": False},
            "backend": {
                "storage_backend": "SimpleStorage",
                "SimpleStorage": {"num_data_storage_units": num_storage_units},
            },
        },
        config or {},
    )
    env = {"TQ_NUM_THREADS": os.environ["TQ_NUM_THREADS"]}
    controller, storage = interface.TransferQueueController, bootstrap.SimpleStorageUnit
    interface.TransferQueueController = _WithCPUs(controller, num_cpus, env)
    bootstrap.SimpleStorageUnit = _WithCPUs(storage, num_cpus, env)
    try:
        with _ATTACH_LOCK, _torch_threads_kept():
            conf = tq.init(conf)
            _ATTACHED = True
            return conf
    finally:
        interface.TransferQueueController, bootstrap.SimpleStorageUnit = controller, storage


def stop_transferqueue() -> None:
    """Stop TransferQueue (its controller, and the storage units if this process started them).
    Only the driver should call it: ``transfer_queue.close`` kills the shared controller from
    any process, and processes attached to it are not told."""
    import transfer_queue as tq

    global _ATTACHED
    with _ATTACH_LOCK:
        tq.close()
        _ATTACHED = False


_ATTACHED = False
_ATTACH_LOCK = threading.Lock()


def _controller() -> Any:
    import ray

    try:
        return ray.get_actor("TransferQueueController", namespace="transfer_queue")
    except ValueError:
        return None


def _attach() -> Any:
    """``transfer_queue``, with this process's client attached (once), or a clear error."""
    global _ATTACHED
    import ray
    import transfer_queue as tq

    with _ATTACH_LOCK:
        if _ATTACHED:
            return tq
        if not ray.is_initialized():
            raise RuntimeError("TransferQueueChannel needs Ray: call ray.init() first")
        if _controller() is None:
            raise RuntimeError(
                "TransferQueue is not running on this Ray cluster: "
                "call diffrl.channel.transferqueue.start_transferqueue() first"
            )
        with _torch_threads_kept():
            tq.init()  # finds the controller and only makes this process's client
        _ATTACHED = True
        return tq


@contextlib.contextmanager
def _torch_threads_kept():
    """TransferQueue resets ``torch.set_num_threads`` to its import-time value after each put
    and get; keep the caller's."""
    n = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)


# --- records <-> fields ----------------------------------------------------------------------


def _is_plain_tensor(obj: Any) -> bool:
    return (
        type(obj) is torch.Tensor
        and obj.layout is torch.strided
        and not obj.is_nested
        and not obj.is_quantized
        and obj.device.type != "meta"
    )


class _Pickler(pickle.Pickler):
    """Pickles a record with its plain tensors pulled out (the same tensor once)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.tensors: list[torch.Tensor] = []
        self._seen: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> Any:
        if not _is_plain_tensor(obj):
            return None
        i = self._seen.get(id(obj))
        if i is None:
            i = self._seen[id(obj)] = len(self.tensors)
            self.tensors.append(obj)
        return (i, str(obj.device), obj.requires_grad)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, tensors: list[torch.Tensor]) -> None:
        super().__init__(file)
        self._tensors = tensors

    def persistent_load(self, pid: Any) -> torch.Tensor:
        i, device, requires_grad = pid
        t = self._tensors[i]
        if device != "cpu":
            t = t.to(device)
        return t.requires_grad_(True) if requires_grad else t


def _field_name(i: int, t: torch.Tensor) -> str:
    return f"t{i}_{str(t.dtype).removeprefix('torch.')}"  # TQ wants one dtype per field


def encode(record: Any) -> dict[str, torch.Tensor]:
    """A record as TransferQueue fields: its tensors, and the pickled rest as uint8."""
    buf = io.BytesIO()
    pickler = _Pickler(buf)
    pickler.dump(record)
    fields = {
        _field_name(i, t): t.detach().to("cpu").contiguous() for i, t in enumerate(pickler.tensors)
    }
    fields[PICKLE_FIELD] = torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)
    return fields


def decode(fields: Any) -> Any:
    """Inverse of ``encode``, from the one-row TensorDict that ``kv_batch_get`` returns."""
    row = {k: _first_row(v) for k, v in fields.items()}
    data = row.pop(PICKLE_FIELD).numpy().tobytes()
    tensors = [row[k] for k in sorted(row, key=lambda k: int(k[1:].split("_")[0]))]
    return _Unpickler(io.BytesIO(data), tensors).load()


def _first_row(x: torch.Tensor) -> torch.Tensor:
    # TQ returns a (1, ...) tensor, or a nested one when the field's shape varies in the partition
    return x.unbind()[0] if x.is_nested else x[0]


# --- the channel -----------------------------------------------------------------------------


def _seq_keys(entries: dict[str, dict]) -> list[tuple[int, str, dict]]:
    return sorted((int(k), k, tag) for k, tag in entries.items() if k.isdigit())


class TransferQueueChannel(Consumable):
    """``Channel`` on a TransferQueue partition; see the module docstring."""

    def __init__(
        self,
        name: str,
        capacity: int = 0,
        max_staleness: int | None = None,
        *,
        poll_s: float = 0.05,
        create: bool = True,
    ) -> None:
        if not name or name.isdigit() or name == HEADER:
            raise ValueError(f"bad channel name {name!r}")
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.name = name
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.poll_s = poll_s
        self._seq: int | None = None  # the producer's next key
        self._closed = False
        if create:
            self._create()

    @classmethod
    def attach(cls, name: str, *, poll_s: float = 0.05) -> TransferQueueChannel:
        """The channel ``name``, created elsewhere, with its settings."""
        tag = _list(_attach(), name).get(HEADER, {})
        return cls(
            name,
            tag.get("capacity", 0),
            tag.get("max_staleness"),
            poll_s=poll_s,
            create=False,
        )

    def _create(self) -> None:
        tq = _attach()
        if self.name in tq.kv_list(self.name):
            raise ValueError(
                f"channel {self.name!r} exists already (a TransferQueue partition of that name): "
                "give each channel a unique name, or use TransferQueueChannel.attach"
            )
        settings = {"capacity": self.capacity, "max_staleness": self.max_staleness}
        tq.kv_put(HEADER, self.name, tag={**settings, "created": time.time()})

    # pickled as its name and settings: a copy in another process attaches on first use
    def __getstate__(self) -> dict:
        keep = ("name", "capacity", "max_staleness", "poll_s")
        return {k: self.__dict__[k] for k in keep}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _seq=None, _closed=False)

    def __repr__(self) -> str:
        return (
            f"TransferQueueChannel({self.name!r}, capacity={self.capacity}, "
            f"max_staleness={self.max_staleness})"
        )

    async def _entries(self) -> dict[str, dict]:
        tq = _attach() if _ATTACHED else await asyncio.to_thread(_attach)
        return await _alist(tq, self.name)

    async def _wait(self, delay: float) -> float:
        await asyncio.sleep(delay)
        return min(delay * 2, self.poll_s)

    async def _room(self) -> tuple[list[tuple[int, str, dict]], int]:
        """Waits while the channel is at capacity; the keys queued now, and the next key."""
        if self._closed:
            raise ChannelClosed(f"put on a closed channel {self.name!r}")
        delay = POLL_MIN_S
        while True:
            keys = _seq_keys(await self._entries())
            if any("eos" in tag for _, _, tag in keys):
                self._closed = True
                raise ChannelClosed(f"put on a closed channel {self.name!r}")
            if self._seq is None:  # a new producer continues after what is queued
                self._seq = keys[-1][0] + 1 if keys else 0
            if not self.capacity or len(keys) < self.capacity:
                return keys, self._seq
            delay = await self._wait(delay)

    async def put(self, record: Any, version: int) -> None:
        fields = encode(record)
        keys, seq = await self._room()
        key = f"{seq:08d}"
        if any(k == key for _, k, _ in keys):
            raise RuntimeError(f"channel {self.name!r}: key {key} exists (two producers?)")
        self._seq = seq + 1
        tq = _attach()
        with _torch_threads_kept():
            await tq.async_kv_put(key, self.name, fields=fields, tag={"v": int(version)})

    async def put_many(self, records: list, version: int) -> None:
        """The records as consecutive keys that a consumer sees together: their data goes in
        first (untagged, so not yet ready), then one call tags them all. Waits for room for
        the first only (the rest may pass ``capacity``)."""
        if not records:
            return
        fields = [encode(r) for r in records]
        keys, seq = await self._room()
        names = [f"{seq + i:08d}" for i in range(len(records))]
        if set(names) & {k for _, k, _ in keys}:
            raise RuntimeError(f"channel {self.name!r}: key {names[0]} exists (two producers?)")
        self._seq = seq + len(records)
        tq = _attach()
        with _torch_threads_kept():
            await asyncio.gather(
                *(
                    tq.async_kv_put(k, self.name, fields=f)
                    for k, f in zip(names, fields, strict=True)
                )
            )
            await tq.async_kv_batch_put(names, self.name, tags=[{"v": int(version)}] * len(names))

    def close(self) -> None:
        """No more puts; consumers drain what is queued, then stop."""
        if self._closed:
            return
        tq = _attach()
        keys = _seq_keys(_list(tq, self.name))
        self._closed = True
        if any("eos" in tag for _, _, tag in keys):
            return  # closed elsewhere
        seq = max(self._seq or 0, keys[-1][0] + 1 if keys else 0)
        tq.kv_put(f"{seq:08d}", self.name, tag={"eos": True})
        self._seq = seq + 1

    async def get(self, current_version: int | None = None) -> Any:
        delay = POLL_MIN_S
        while True:
            keys = _seq_keys(await self._entries())
            if keys:
                _, key, tag = keys[0]
                if "eos" in tag:
                    raise ChannelClosed(f"channel {self.name!r} closed")
                if "v" in tag:  # set once the record's data is stored
                    break
            delay = await self._wait(delay)
        tq = _attach()
        with _torch_threads_kept():
            record = decode(await tq.async_kv_batch_get(key, self.name))
            await tq.async_kv_clear(key, self.name)
        version = tag["v"]
        check_fresh(version, current_version, self.max_staleness)
        return record

    async def get_ready(self, wait: bool = True, current_version: int | None = None) -> list:
        """Every record ready now, in order (waiting for one first when ``wait``), read
        together and cleared in one call; ``ChannelClosed`` once closed and drained."""
        delay = POLL_MIN_S
        while True:
            ready = []
            keys = _seq_keys(await self._entries())
            for _, key, tag in keys:
                if "v" not in tag:  # the close mark, or a record whose data is on its way
                    break
                ready.append((key, tag["v"]))
            if ready:
                break
            if keys and "eos" in keys[0][2]:
                raise ChannelClosed(f"channel {self.name!r} closed")
            if not wait:
                return []
            delay = await self._wait(delay)
        tq = _attach()
        with _torch_threads_kept():
            got = await asyncio.gather(*(tq.async_kv_batch_get(k, self.name) for k, _ in ready))
            await tq.async_kv_clear([k for k, _ in ready], self.name)
        for _, version in ready:
            check_fresh(version, current_version, self.max_staleness)
        return [decode(fields) for fields in got]

    def qsize(self) -> int:
        """Records put and not yet consumed (the close marker not counted)."""
        keys = _seq_keys(_list(_attach(), self.name))
        return sum(1 for _, _, tag in keys if "eos" not in tag)

    def delete(self) -> None:
        """Remove the channel and everything in it from TransferQueue."""
        tq = _attach()
        _list(tq, self.name)  # ChannelNotFound for a wrong name
        tq.get_client().clear_partition(self.name)


def _not_found(name: str) -> ChannelNotFound:
    return ChannelNotFound(
        f"no channel {name!r}: TransferQueue has no partition of that name "
        "(a wrong name, a deleted channel, or TransferQueue was restarted)"
    )


def _list(tq: Any, name: str) -> dict[str, dict]:
    entries = tq.kv_list(name).get(name)
    if entries is None or HEADER not in entries:
        raise _not_found(name)
    return entries


async def _alist(tq: Any, name: str) -> dict[str, dict]:
    entries = (await tq.async_kv_list(name)).get(name)
    if entries is None or HEADER not in entries:
        raise _not_found(name)
    return entries
