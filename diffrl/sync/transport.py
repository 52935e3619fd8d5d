"""How a ``WeightUpdate`` travels from the actor to the rollout replicas: three paths behind one
interface (a sender's ``send(update) -> handle``, a receiver's ``receive(handle) ->
WeightUpdate``), each checked the same way before anything is applied.

- **broadcast**: a dedicated process group, not the default one (the actor's own group keeps
  its default group for FSDP; the rollout replicas are other processes). Rank 0 is the sender
  (actor rank 0), ranks 1..N the replicas; it is built straight from a ``TCPStore``
  (``serve_rendezvous`` on the sender, ``open_group`` on every rank), gloo on CPU tensors and
  NCCL on CUDA. A send is a length-prefixed manifest (JSON as uint8) and then one flat buffer
  per dtype: a few collectives per update, not one per tensor.
- **ipc**: the sender packs the update into one buffer per dtype and shares each: a CUDA IPC
  handle (``reduce_tensor``) for a CUDA buffer, a ``file_system`` shared-memory segment for a
  CPU one (a named file any process can open; ``reduce_tensor``'s CPU path hands Ray's
  pickler the storage itself, which it would copy by value). The handle is small and picklable.
  **Lifetime**: the sender keeps the shared buffers alive until it shares the next update, and
  the receiver copies out of them before it returns; so a handle must be opened before the
  sender's next ``send`` (the controller loads each update before it exports the next one to
  the same receiver).
- **object_store**: the packed buffers themselves, pickled by whoever carries the handle (Ray's
  object store), so the CPU fallback gets the same checks.

Every path ends in ``unpack``, which raises ``SyncError`` before anything is applied when
- the manifest is malformed: a field missing or of the wrong type, tensors missing, extra or
  out of order, a dtype or shape that does not fit the trained module's factors and prints;
- the buffers do not match the manifest (count, dtype, size);
- the content digest differs: blake2b over every tensor's raw bytes in manifest order and over
  the manifest's own fields (scales, checksums, names), so a torn, truncated, reordered or
  flipped payload is caught;
- the update is out of order: each sender numbers its sends (``serial``), and a receiver
  refuses a serial that does not increase over the last one it took (a replayed or reordered
  send), and a policy version below the last one it took (a stale update). The same version
  may arrive twice on purpose: the evaluator loads "old" and then "default" at one version
  (``run.eval_live``), so the strict order is on the transport's own serials.

The rollout's ``load_weights`` then runs its own checks (``MergedLoraTarget``: checksums, row
prints against the slot map); the transport's checks are about the wire, not the mapping.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from diffrl.sync.weights import PROBES, BasePrints, LoraDelta, SyncError, WeightUpdate

MAX_MANIFEST_BYTES = 1 << 28  # a manifest length past this is a group out of step, not a model
DIGEST_BYTES = 16


# --- the manifest ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    """What a receiver needs to allocate, unpack, check and rebuild an update. ``tensors``
    lists (key, dtype, shape) in wire order: per trained module (in ``names`` order) its
    ``a:``, ``b:`` and ``rows:`` tensors, then ``base:`` per module of ``base_dtypes``."""

    version: int
    serial: int  # the sender's own count of sends: strictly increasing per receiver
    adapter: str
    names: tuple[str, ...]
    scales: dict[str, float]
    checksums: dict[str, float]
    dtypes: dict[str, str]  # name -> the A/B export dtype
    base_dtypes: dict[str, str] | None  # None: the update carries no base prints
    tensors: tuple[tuple[str, str, tuple[int, ...]], ...]
    digest: str = ""  # hex blake2b; "" while it is being computed

    def fields(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "serial": self.serial,
            "adapter": self.adapter,
            "names": list(self.names),
            "scales": self.scales,
            "checksums": self.checksums,
            "dtypes": self.dtypes,
            "base_dtypes": self.base_dtypes,
            "tensors": [[k, d, list(s)] for k, d, s in self.tensors],
        }

    def to_json(self) -> str:
        return json.dumps({**self.fields(), "digest": self.digest}, sort_keys=True)

    @staticmethod
    def from_json(text: str) -> Manifest:
        """Parses; checks only what the buffers' sizes need (``check_manifest`` does the rest)."""
        try:
            raw = json.loads(text)
            m = Manifest(
                version=raw["version"],
                serial=raw["serial"],
                adapter=raw["adapter"],
                names=tuple(raw["names"]),
                scales=raw["scales"],
                checksums=raw["checksums"],
                dtypes=raw["dtypes"],
                base_dtypes=raw["base_dtypes"],
                tensors=tuple((k, d, tuple(s)) for k, d, s in raw["tensors"]),
                digest=raw["digest"],
            )
        except (ValueError, KeyError, TypeError) as e:
            raise SyncError(f"malformed weight manifest: {type(e).__name__}: {e}") from None
        buffer_sizes(m)
        return m


def _dtype(name: Any, what: str) -> torch.dtype:
    d = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
    if not isinstance(d, torch.dtype):
        raise SyncError(f"malformed weight manifest: {what} has dtype {name!r}, not a torch dtype")
    return d


def _numel(shape: tuple[int, ...], what: str) -> int:
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in shape):
        raise SyncError(f"malformed weight manifest: {what} has shape {list(shape)}")
    n = 1
    for s in shape:
        n *= s
    return n


def buffer_sizes(m: Manifest) -> list[tuple[torch.dtype, int]]:
    """(dtype, elements) of each flat buffer, in the order they travel: one per dtype, in the
    order each dtype first appears in ``m.tensors``."""
    sizes: dict[torch.dtype, int] = {}
    for key, dtype, shape in m.tensors:
        d = _dtype(dtype, repr(key))
        sizes[d] = sizes.get(d, 0) + _numel(shape, repr(key))
    return list(sizes.items())


def _expected_keys(m: Manifest) -> list[str]:
    keys = [f"{kind}:{n}" for n in m.names for kind in ("a", "b", "rows")]
    return keys + ([f"base:{n}" for n in m.names] if m.base_dtypes is not None else [])


def check_manifest(m: Manifest) -> None:
    """Raise SyncError unless the manifest describes a whole, consistent update: the tensors
    are exactly each trained module's factors and prints (and base prints), in order, with
    A (r, in) and B (out, r) in the export dtype and prints (out, PROBES) float64."""

    def bad(why: str) -> SyncError:
        return SyncError(f"malformed weight manifest (v{m.version!r}, serial {m.serial!r}): {why}")

    for field_, kind in (("version", int), ("serial", int), ("adapter", str), ("digest", str)):
        if not isinstance(getattr(m, field_), kind) or isinstance(getattr(m, field_), bool):
            raise bad(f"{field_} = {getattr(m, field_)!r} is not a {kind.__name__}")
    if len(set(m.names)) != len(m.names) or not all(isinstance(n, str) for n in m.names):
        raise bad(f"module names are not distinct strings: {list(m.names)[:5]}")
    for what, table in (("scales", m.scales), ("checksums", m.checksums), ("dtypes", m.dtypes)):
        if not isinstance(table, dict) or sorted(table) != sorted(m.names):
            got = sorted(table) if isinstance(table, dict) else table
            raise bad(f"{what} cover {got!r:.200}, not the {len(m.names)} modules named")
    for n in m.names:
        if not isinstance(m.scales[n], (int, float)) or not isinstance(
            m.checksums[n], (int, float)
        ):
            raise bad(f"{n}: scale {m.scales[n]!r} / checksum {m.checksums[n]!r} not numbers")
    if m.base_dtypes is not None and sorted(m.base_dtypes) != sorted(m.names):
        raise bad(f"base prints for {sorted(m.base_dtypes)[:5]}, not the modules named")
    keys = [k for k, _, _ in m.tensors]
    want = _expected_keys(m)
    if keys != want:
        missing = sorted(set(want) - set(keys))[:5]
        extra = sorted(set(keys) - set(want))[:5]
        raise bad(
            f"tensors {len(keys)} listed, {len(want)} expected (missing {missing}, unexpected "
            f"{extra}, or out of order)"
        )
    spec = {k: (_dtype(d, k), s) for k, d, s in m.tensors}
    f64 = torch.float64
    for n in m.names:
        export = _dtype(m.dtypes[n], f"dtypes[{n!r}]")
        (da, sa), (db, sb), (dr, sr) = spec[f"a:{n}"], spec[f"b:{n}"], spec[f"rows:{n}"]
        if da != export or db != export:
            raise bad(f"{n}: A is {da}, B is {db}; the export dtype is {export}")
        if len(sa) != 2 or len(sb) != 2 or sa[0] != sb[1]:
            raise bad(f"{n}: A {list(sa)} and B {list(sb)} are not (r, in) and (out, r)")
        if dr != f64 or tuple(sr) != (sb[0], PROBES):
            raise bad(f"{n}: row prints {dr} {list(sr)}, expected float64 {[sb[0], PROBES]}")
        if m.base_dtypes is not None:
            _dtype(m.base_dtypes[n], f"base_dtypes[{n!r}]")
            db_, sbase = spec[f"base:{n}"]
            if db_ != f64 or tuple(sbase) != (sb[0], PROBES):
                raise bad(f"{n}: base prints {db_} {list(sbase)}, expected {[sb[0], PROBES]}")


def _hash(m: Manifest, tensors: Sequence[Tensor]) -> str:
    """blake2b over the manifest's fields and every tensor's raw bytes, in manifest order."""
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    h.update(json.dumps(m.fields(), sort_keys=True).encode())
    for t in tensors:
        h.update(t.detach().reshape(-1).cpu().view(torch.uint8).numpy().data)
    return h.hexdigest()


# --- packing and unpacking ---------------------------------------------------------------------


def _tensors_of(update: WeightUpdate) -> list[tuple[str, Tensor]]:
    out: list[tuple[str, Tensor]] = []
    for n, d in update.deltas.items():
        if n not in update.delta_rows:
            raise SyncError(f"weight update v{update.version}: no row prints for {n}")
        out += [(f"a:{n}", d.a), (f"b:{n}", d.b), (f"rows:{n}", update.delta_rows[n])]
    if update.base is not None:
        out += [(f"base:{n}", update.base.rows[n]) for n in update.deltas]
    return out


def pack(
    update: WeightUpdate, serial: int, device: torch.device | str | None = None
) -> tuple[Manifest, list[Tensor]]:
    """(manifest with its digest, one flat buffer per dtype on ``device``: the factors' device
    when None)."""
    tensors = _tensors_of(update)
    names = tuple(update.deltas)
    base = update.base
    m = Manifest(
        version=update.version,
        serial=serial,
        adapter=update.adapter,
        names=names,
        scales={n: float(update.deltas[n].scale) for n in names},
        checksums={n: float(update.checksums[n]) for n in names},
        dtypes={n: str(update.dtypes.get(n, update.deltas[n].a.dtype)) for n in names},
        base_dtypes=None if base is None else {n: str(base.dtypes[n]) for n in names},
        tensors=tuple((k, str(t.dtype), tuple(t.shape)) for k, t in tensors),
    )
    m = _with_digest(m, [t for _, t in tensors])
    if device is None:
        device = tensors[0][1].device if tensors else torch.device("cpu")
    groups: dict[torch.dtype, list[Tensor]] = {}
    for _, t in tensors:
        groups.setdefault(t.dtype, []).append(t.detach().reshape(-1).to(device))
    buffers = [torch.cat(ts) for ts in groups.values()]
    return m, buffers


def _with_digest(m: Manifest, tensors: Sequence[Tensor]) -> Manifest:
    return Manifest(**{**m.__dict__, "digest": _hash(m, tensors)})


@dataclass
class Order:
    """A receiver's last (serial, version): what the next update must come after."""

    serial: int = -1
    version: int = -1

    def check(self, m: Manifest) -> None:
        if m.serial <= self.serial:
            raise SyncError(
                f"weight update v{m.version} (send {m.serial}) arrived after send "
                f"{self.serial}: replayed or reordered in transit"
            )
        if m.version < self.version:
            raise SyncError(
                f"stale weight update v{m.version} after v{self.version} (send {m.serial}): "
                "versions must not go down"
            )


def unpack(
    m: Manifest, buffers: Sequence[Tensor], order: Order, device: torch.device | str | None = None
) -> WeightUpdate:
    """The update the sender packed, every check passed (see the module docstring), and
    ``order`` advanced. Factors land on ``device`` (the buffers' device when None), prints on
    the CPU, as ``WeightUpdate.build`` makes them."""
    check_manifest(m)
    sizes = buffer_sizes(m)
    got = [(b.dtype, b.numel()) for b in buffers]
    if got != sizes or any(b.dim() != 1 for b in buffers):
        raise SyncError(
            f"weight update v{m.version}: buffers {[(str(d), n) for d, n in got]} do not match "
            f"the manifest's {[(str(d), n) for d, n in sizes]} (truncated or torn)"
        )
    at = {b.dtype: 0 for b in buffers}
    by_dtype = {b.dtype: b for b in buffers}
    tensors: dict[str, Tensor] = {}
    for key, dtype, shape in m.tensors:
        d = _dtype(dtype, key)
        n = _numel(shape, key)
        tensors[key] = by_dtype[d][at[d] : at[d] + n].view(shape)
        at[d] += n
    digest = _hash(m, list(tensors.values()))
    if digest != m.digest:
        raise SyncError(
            f"weight update v{m.version} (send {m.serial}): content digest {digest} differs from "
            f"the sender's {m.digest}: the payload changed in transit"
        )
    order.check(m)
    dev = torch.device(device) if device is not None else None

    def place(t: Tensor) -> Tensor:
        return t.clone() if dev is None or dev == t.device else t.to(dev)

    cpu = torch.device("cpu")
    deltas = {
        n: LoraDelta(place(tensors[f"a:{n}"]), place(tensors[f"b:{n}"]), m.scales[n])
        for n in m.names
    }
    rows = {n: tensors[f"rows:{n}"].to(cpu, copy=True) for n in m.names}
    base = None
    if m.base_dtypes is not None:
        base = BasePrints(
            {n: tensors[f"base:{n}"].to(cpu, copy=True) for n in m.names},
            {n: _dtype(d, n) for n, d in m.base_dtypes.items()},
        )
    dtypes = {n: _dtype(m.dtypes[n], n) for n in m.names}
    order.serial, order.version = m.serial, m.version
    return WeightUpdate(m.version, m.adapter, deltas, dict(m.checksums), rows, dtypes, base)


# --- the interface -----------------------------------------------------------------------------


class Sender:
    """Numbers its sends; ``send(update)`` returns the handle a receiver takes."""

    def __init__(self) -> None:
        self.serial = 0

    def next_serial(self) -> int:
        self.serial += 1
        return self.serial

    def send(self, update: WeightUpdate) -> Any:
        raise NotImplementedError


class Receiver:
    """``receive(handle)`` rebuilds and checks the update; keeps the order it has seen."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = device
        self.order = Order()

    def receive(self, handle: Any) -> WeightUpdate:
        raise NotImplementedError


@dataclass(frozen=True)
class Packed:
    """The object-store handle: the manifest and its buffers, pickled by the carrier."""

    manifest: str
    buffers: list[Tensor]


class ObjectStoreSender(Sender):
    def send(self, update: WeightUpdate) -> Packed:
        m, buffers = pack(update, self.next_serial(), "cpu")
        return Packed(m.to_json(), buffers)


class ObjectStoreReceiver(Receiver):
    def receive(self, handle: Packed) -> WeightUpdate:
        return unpack(Manifest.from_json(handle.manifest), handle.buffers, self.order, self.device)


# --- ipc ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class IpcHandle:
    """The manifest and, per flat buffer, how to open it in another process: ("cuda", the
    ``reduce_tensor`` rebuild function and its arguments) or ("shm", dtype, elements, the
    shared-memory manager's handle, the segment's name, its bytes)."""

    manifest: str
    buffers: list[tuple]


class IpcSender(Sender):
    """Shares each update's buffers with other processes on this host; keeps the last
    update's buffers alive (``held``) until the next ``send`` (module docstring: lifetime)."""

    def __init__(self) -> None:
        super().__init__()
        self.held: list[Tensor] = []

    def send(self, update: WeightUpdate) -> IpcHandle:
        from torch.multiprocessing.reductions import reduce_tensor

        m, buffers = pack(update, self.next_serial())
        handles: list[tuple] = []
        for b in buffers:
            if b.is_cuda:
                handles.append(("cuda", *reduce_tensor(b)))
            else:
                storage = b.untyped_storage()
                manager, name, nbytes = storage._share_filename_cpu_()  # moves it to shm
                handles.append(("shm", str(b.dtype), b.numel(), manager, name, nbytes))
        self.held = buffers  # the previous update's buffers are freed now
        return IpcHandle(m.to_json(), handles)


def open_buffer(h: tuple) -> Tensor:
    """A sender's shared buffer, mapped into this process (no copy)."""
    if h[0] == "cuda":
        rebuild, args = h[1], h[2]
        return rebuild(*args)
    _, dtype, numel, manager, name, nbytes = h
    storage = torch.UntypedStorage._new_shared_filename_cpu(manager, name, nbytes)
    d = _dtype(dtype, "an ipc buffer")
    return torch.empty(0, dtype=d).set_(storage, 0, (numel,), (1,))


class IpcReceiver(Receiver):
    def receive(self, handle: IpcHandle) -> WeightUpdate:
        m = Manifest.from_json(handle.manifest)
        if len(handle.buffers) != len(buffer_sizes(m)):
            raise SyncError(
                f"weight update v{m.version}: {len(handle.buffers)} shared buffers, the "
                f"manifest lists {len(buffer_sizes(m))}"
            )
        try:
            shared = [open_buffer(h) for h in handle.buffers]
        except (RuntimeError, OSError, ValueError, TypeError) as e:
            raise SyncError(
                f"weight update v{m.version} (send {m.serial}): cannot open the sender's shared "
                f"buffers ({e}); it shares the next update's before this one was opened, or it "
                "exited"
            ) from None
        # copied out at once: the sender reuses its buffers at its next send
        dev = torch.device(self.device) if self.device is not None else None
        buffers = [b.to(dev or b.device, copy=True) for b in shared]
        del shared
        return unpack(m, buffers, self.order, self.device)


# --- broadcast over a dedicated process group --------------------------------------------------

STORE_PREFIX = "diffrl-weights"


def serve_rendezvous(
    host: str = "127.0.0.1", timeout_s: float = 300.0, port: int = 0
) -> tuple[dist.TCPStore, int]:
    """The sender's side of the rendezvous: a TCPStore on ``port``, by default a free one the
    OS picks (no race between picking and binding); returns it and the port to hand to the
    receivers."""
    store = dist.TCPStore(
        host, port, None, is_master=True, timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )  # fmt: skip
    return store, store.port


@dataclass
class WeightGroup:
    """A process group of its own: rank 0 the sender, 1..N the receivers; ``device`` is where
    its tensors live (CPU: gloo, CUDA: NCCL)."""

    pg: Any
    rank: int
    world: int
    device: torch.device
    timeout_s: float
    store: Any = None  # kept alive: the sender's TCPStore serves the group's keys

    @property
    def backend(self) -> str:
        return "gloo" if self.device.type == "cpu" else "nccl"

    def broadcast(self, t: Tensor, what: str) -> None:
        try:
            self.pg.broadcast(t, 0, timedelta(seconds=self.timeout_s)).wait()
        except RuntimeError as e:  # DistBackendError too: timeouts, a peer gone
            raise SyncError(
                f"weight broadcast ({what}, rank {self.rank} of {self.world}, {self.backend}): "
                f"failed or timed out after {self.timeout_s:g} s: {str(e)[:300]}; a peer has "
                "died or stopped taking part, and the group is out of step (build a new one)"
            ) from None


def open_group(
    host: str,
    port: int,
    rank: int,
    world: int,
    device: torch.device | str = "cpu",
    timeout_s: float = 300.0,
    store: Any = None,
) -> WeightGroup:
    """Join the weight group (every rank calls it at once; it returns when all have joined).
    Rank 0 passes the store from ``serve_rendezvous``; the others connect to ``host:port``.
    Built from the store directly, so it neither needs nor touches the default group."""
    device = torch.device(device)
    timeout = timedelta(seconds=timeout_s)
    try:
        if store is None:
            store = dist.TCPStore(host, port, None, is_master=False, timeout=timeout)
        prefixed = dist.PrefixStore(STORE_PREFIX, store)
        pg: Any
        if device.type == "cpu":
            pg = dist.ProcessGroupGloo(prefixed, rank, world, timeout)
        else:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            torch.cuda.set_device(device)
            pg = dist.ProcessGroupNCCL(prefixed, rank, world, opts)
    except RuntimeError as e:
        raise SyncError(
            f"weight group at {host}:{port}: rank {rank} of {world} could not join within "
            f"{timeout_s:g} s: {str(e)[:300]}"
        ) from None
    return WeightGroup(pg, rank, world, device, timeout_s, store)


class BroadcastSender(Sender):
    """Rank 0 of a ``WeightGroup``; ``send`` returns the manifest (JSON) it broadcast."""

    def __init__(self, group: WeightGroup) -> None:
        super().__init__()
        if group.rank != 0:
            raise SyncError(f"the weight sender is rank 0 of its group, not rank {group.rank}")
        self.group = group

    def send(self, update: WeightUpdate) -> str:
        m, buffers = pack(update, self.next_serial(), self.group.device)
        self.send_packed(m.to_json(), buffers)
        return m.to_json()

    def send_packed(self, manifest: str, buffers: Sequence[Tensor]) -> None:
        g, dev = self.group, self.group.device
        raw = manifest.encode()
        g.broadcast(torch.tensor([len(raw)], dtype=torch.int64, device=dev), "manifest length")
        g.broadcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(dev), "manifest")
        for i, b in enumerate(buffers):
            g.broadcast(b.to(dev).contiguous(), f"buffer {i} ({b.dtype})")


class BroadcastReceiver(Receiver):
    """Ranks 1..N of a ``WeightGroup``. ``receive`` takes every collective the sender's
    manifest announces before it checks anything, so a refused update leaves the group in
    step; only a manifest whose buffers cannot be sized leaves it out of step."""

    def __init__(self, group: WeightGroup, device: torch.device | str | None = None) -> None:
        super().__init__(device)
        if group.rank == 0:
            raise SyncError("rank 0 of the weight group is the sender; receivers are 1..N")
        self.group = group

    def receive(self, handle: Any = None) -> WeightUpdate:
        g, dev = self.group, self.group.device
        length = torch.zeros(1, dtype=torch.int64, device=dev)
        g.broadcast(length, "manifest length")
        n = int(length.item())
        if not 0 < n <= MAX_MANIFEST_BYTES:
            raise SyncError(f"weight manifest of {n} bytes announced: the group is out of step")
        raw = torch.empty(n, dtype=torch.uint8, device=dev)
        g.broadcast(raw, "manifest")
        try:
            m = Manifest.from_json(bytes(raw.cpu().numpy()).decode("utf-8", errors="replace"))
        except SyncError as e:
            raise SyncError(
                f"{e} (the buffers that follow cannot be sized: the weight group is out of step)"
            ) from None
        buffers = [torch.empty(k, dtype=d, device=dev) for d, k in buffer_sizes(m)]
        for i, b in enumerate(buffers):
            g.broadcast(b, f"buffer {i} ({b.dtype})")
        return unpack(m, buffers, self.order, self.device)


# --- one end of a path each: what a backend's hosts hold -----------------------------------------

PATHS = ("object_store", "broadcast", "ipc")
STAGED = 8  # exports a WeightSource holds unsent (async runs export ahead of the load)


class WeightSource:
    """The actor's end of a weight path. ``stage(update)`` runs at export and returns what the
    controller carries: the object-store handle itself, or (broadcast, ipc) a key to the update
    kept here; ``send(key)`` runs when a receiver loads it: the IPC handle, or the broadcast
    itself (which waits for every receiver). The newest ``STAGED`` unsent exports are kept; an
    export the run never loads (an async run's skipped one) is dropped after them."""

    def __init__(self, path: str, device: torch.device, timeout_s: float = 300.0) -> None:
        if path not in PATHS:
            raise SyncError(f"weight path {path!r}: one of {list(PATHS)}")
        self.path, self.device, self.timeout_s = path, device, timeout_s
        self.sender: Sender | None = None  # broadcast: made at the first send
        if path == "object_store":
            self.sender = ObjectStoreSender()
        elif path == "ipc":
            self.sender = IpcSender()
        self.staged: dict[int, WeightUpdate] = {}
        self.exports = 0
        self.store: Any = None
        self.world = 0

    def rendezvous(self, host: str, world: int) -> int:
        """Broadcast: serve the weight group's store on ``host`` (a free port, returned) for
        rank 0 (here) and ``world - 1`` receivers; the group forms at the first send."""
        self.store, port = serve_rendezvous(host, self.timeout_s)
        self.host, self.world = host, world
        return port

    def stage(self, update: WeightUpdate) -> Any:
        if self.path == "object_store":
            assert self.sender is not None
            return self.sender.send(update)
        self.exports += 1
        self.staged[self.exports] = update
        for old in sorted(self.staged)[:-STAGED]:
            del self.staged[old]
        return self.exports

    def send(self, key: int) -> Any:
        update = self.staged.pop(key, None)
        if update is None:
            raise SyncError(
                f"weight export {key} is no longer held by the actor (only the newest {STAGED} "
                "unsent exports are): it was loaded already, or more exports came after it"
            )
        if self.sender is None:  # broadcast: the group forms at the first send
            if self.store is None:
                raise SyncError("broadcast weight path: no rendezvous served before the send")
            group = open_group(self.host, 0, 0, self.world, self.device, self.timeout_s, self.store)
            self.sender = BroadcastSender(group)
        return self.sender.send(update)


class WeightSink:
    """A rollout process's end: one receiver (and so one order) per engine it holds (the
    training rollout and the evaluator), sharing the broadcast group."""

    def __init__(self, path: str, device: torch.device, timeout_s: float = 300.0) -> None:
        if path not in PATHS:
            raise SyncError(f"weight path {path!r}: one of {list(PATHS)}")
        self.path, self.device, self.timeout_s = path, device, timeout_s
        self.receivers: dict[str, Receiver] = {}
        self.peer: tuple[str, int, int, int] | None = None
        self.group: WeightGroup | None = None

    def join(self, host: str, port: int, rank: int, world: int) -> None:
        """Broadcast: where the sender's store is and this process's rank; the group forms at
        the first receive (the sender's first send)."""
        self.peer = (host, port, rank, world)

    def receive(self, engine: str, handle: Any) -> WeightUpdate:
        receiver = self.receivers.get(engine)
        if receiver is None:
            if self.path == "broadcast":
                if self.group is None:
                    if self.peer is None:
                        raise SyncError("broadcast weight path: this receiver joined no group")
                    host, port, rank, world = self.peer
                    self.group = open_group(host, port, rank, world, self.device, self.timeout_s)
                receiver = BroadcastReceiver(self.group, self.device)
            elif self.path == "ipc":
                receiver = IpcReceiver(self.device)
            else:
                receiver = ObjectStoreReceiver(self.device)
            self.receivers[engine] = receiver
        return receiver.receive(handle)
