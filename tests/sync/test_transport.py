"""The weight paths (``sync/transport.py``): an update crosses each of them bit for bit and a
real ``MergedLoraTarget`` accepts it; every kind of damage in transit raises ``SyncError``
before anything is applied, and a refused update leaves the receiver ready for the next one.

- object store: in-process (the handle is what Ray pickles);
- broadcast: a gloo weight group of 3 spawned processes (rank 0 sends, ranks 1 and 2 receive),
  built from a TCPStore and no default group; a receiver whose sender falls silent gets a
  timeout error, not a hang;
- ipc: a spawned process opens the shared-memory buffers; CUDA IPC the same way when a GPU is
  here.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from diffrl.sync.transport import (
    BroadcastReceiver,
    BroadcastSender,
    IpcReceiver,
    IpcSender,
    Manifest,
    ObjectStoreReceiver,
    ObjectStoreSender,
    Packed,
    open_group,
    pack,
    serve_rendezvous,
)
from diffrl.sync.weights import BasePrints, LoraDelta, MergedLoraTarget, SyncError, WeightUpdate

# not in sorted order: the manifest keeps the update's order (JSON sorts its dicts' keys)
SHAPES = {"l2": (6, 8), "l0": (12, 8), "l1": (8, 12)}
DEADLINE_S = 60.0


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict({n: nn.Linear(i, o, bias=False) for n, (o, i) in SHAPES.items()})


def update(version: int, seed: int) -> WeightUpdate:
    """A random LoRA update with the model's base prints; l1's factors in bfloat16, so the
    update travels as three buffers (bf16, fp32, fp64)."""
    g = torch.Generator().manual_seed(seed)
    deltas = {}
    for n, (o, i) in SHAPES.items():
        dtype = torch.bfloat16 if n == "l1" else torch.float32
        a, b = torch.randn(2, i, generator=g), torch.randn(o, 2, generator=g)
        deltas[n] = LoraDelta(a.to(dtype), b.to(dtype), 0.5)
    base = BasePrints.of({n: m.weight for n, m in model().items()})
    return WeightUpdate.build(version, "default", deltas, base)


def same(a: WeightUpdate, b: WeightUpdate) -> bool:
    """Bit for bit: every tensor equal with its dtype, every number equal."""
    eq = lambda x, y: x.dtype == y.dtype and torch.equal(x, y)  # noqa: E731
    return (
        (a.version, a.adapter, a.checksums, a.dtypes)
        == (b.version, b.adapter, b.checksums, b.dtypes)
        and list(a.deltas) == list(b.deltas)
        and all(
            eq(a.deltas[n].a, b.deltas[n].a)
            and eq(a.deltas[n].b, b.deltas[n].b)
            and a.deltas[n].scale == b.deltas[n].scale
            and eq(a.delta_rows[n], b.delta_rows[n])
            for n in a.deltas
        )
        and a.base is not None
        and b.base is not None
        and a.base.dtypes == b.base.dtypes
        and all(eq(a.base.rows[n], b.base.rows[n]) for n in a.base.rows)
    )


def on_device(u: WeightUpdate, device: str) -> WeightUpdate:
    deltas = {n: LoraDelta(d.a.to(device), d.b.to(device), d.scale) for n, d in u.deltas.items()}
    return dataclasses.replace(u, deltas=deltas)


def applied(u: WeightUpdate) -> dict[str, torch.Tensor]:
    """The weights a fresh MergedLoraTarget holds after applying ``u`` (raises if it refuses)."""
    m = model()
    MergedLoraTarget(m, list(SHAPES)).apply(u)
    return {n: layer.weight.detach().clone() for n, layer in m.items()}


# --- damage, one kind at a time ------------------------------------------------------------------


def _edit(packed: Packed, fn) -> Packed:
    raw = json.loads(packed.manifest)
    fn(raw)
    return Packed(json.dumps(raw), packed.buffers)


def _flip(packed: Packed) -> Packed:
    buffers = [b.clone() for b in packed.buffers]
    buffers[1].view(torch.uint8)[3] ^= 0x10  # one bit of one float
    return Packed(packed.manifest, buffers)


def _dtype_of(raw: dict, key: str, dtype: str) -> None:
    for t in raw["tensors"]:
        if t[0] == key:
            t[1] = dtype


def _shape_of(raw: dict, key: str) -> None:
    for t in raw["tensors"]:
        if t[0] == key:
            t[2] = t[2][::-1]


FAULTS = {
    "flipped byte": (_flip, "content digest"),
    "truncated buffer": (
        lambda p: Packed(p.manifest, [p.buffers[0], p.buffers[1][:-1], p.buffers[2]]),
        "do not match the manifest",
    ),
    "changed checksum": (
        lambda p: _edit(p, lambda r: r["checksums"].update(l0=r["checksums"]["l0"] + 1e-3)),
        "content digest",
    ),
    "wrong dtype": (
        lambda p: _edit(p, lambda r: _dtype_of(r, "a:l0", "torch.float16")),
        "l0: A is",
    ),
    "wrong shape": (lambda p: _edit(p, lambda r: _shape_of(r, "b:l2")), "l2: A"),
    "missing tensor": (
        lambda p: _edit(
            p, lambda r: r.update(tensors=[t for t in r["tensors"] if t[0] != "rows:l1"])
        ),
        r"missing \['rows:l1'\]",
    ),
    "reordered tensors": (
        lambda p: _edit(p, lambda r: r["tensors"].insert(0, r["tensors"].pop(3))),
        "out of order",
    ),
    "not json": (lambda p: Packed(p.manifest[:-7], p.buffers), "malformed weight manifest"),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_damage_in_transit_raises_and_the_next_update_lands(fault) -> None:
    damage, message = FAULTS[fault]
    sender, receiver = ObjectStoreSender(), ObjectStoreReceiver()
    first = update(1, seed=1)
    assert same(receiver.receive(sender.send(first)), first)
    with pytest.raises(SyncError, match=message):
        receiver.receive(damage(sender.send(update(2, seed=2))))
    good = update(3, seed=3)
    got = receiver.receive(sender.send(good))  # the refusal changed nothing
    assert same(got, good)
    want = applied(good)
    assert all(torch.equal(w, want[n]) for n, w in applied(got).items())


def test_out_of_order_updates_raise() -> None:
    sender, receiver = ObjectStoreSender(), ObjectStoreReceiver()
    v2 = sender.send(update(2, seed=2))
    receiver.receive(v2)
    with pytest.raises(SyncError, match="replayed or reordered"):
        receiver.receive(v2)  # the same send again
    with pytest.raises(SyncError, match="stale weight update v1 after v2"):
        receiver.receive(sender.send(update(1, seed=1)))
    early, late = sender.send(update(3, seed=3)), sender.send(update(4, seed=4))
    receiver.receive(late)
    with pytest.raises(SyncError, match="replayed or reordered"):
        receiver.receive(early)
    # one version sent twice (another adapter, eval_live) is two sends: both land
    again = update(4, seed=5)
    assert same(receiver.receive(sender.send(again)), again)


def test_a_receiver_that_finds_no_sender_times_out() -> None:
    store, port = serve_rendezvous(timeout_s=5.0)
    start = time.monotonic()
    with pytest.raises(SyncError, match=r"rank 1 of 2 could not join within 1 s"):
        open_group("127.0.0.1", port, rank=1, world=2, timeout_s=1.0)
    assert time.monotonic() - start < 10.0
    del store


# --- broadcast: 3 processes over gloo ------------------------------------------------------------


def _send_all(sender: BroadcastSender) -> None:
    """Rank 0's sends: two good updates, five damaged ones, a good one."""
    sender.send(update(1, seed=1))
    m2, b2 = pack(update(2, seed=2), sender.next_serial())
    sender.send_packed(m2.to_json(), b2)
    m, b = pack(update(3, seed=3), sender.next_serial())
    flipped = [x.clone() for x in b]
    flipped[0].view(torch.uint8)[1] ^= 1
    sender.send_packed(m.to_json(), flipped)
    sender.send(update(1, seed=1))  # a version going down
    sender.send_packed(m2.to_json(), b2)  # a replay
    m, b = pack(update(3, seed=3), sender.next_serial())
    raw = json.loads(m.to_json())
    _shape_of(raw, "b:l2")  # a wrong shape, the same buffer sizes
    sender.send_packed(json.dumps(raw), b)
    sender.send(update(3, seed=3))


def _receive_all(i: int, port: int, out: Path) -> None:
    torch.set_num_threads(1)
    rank = i + 1  # torch.multiprocessing numbers the spawned processes from 0
    group = open_group("127.0.0.1", port, rank, 3, "cpu", DEADLINE_S)
    assert not dist.is_initialized()  # a group of its own: no default group
    receiver = BroadcastReceiver(group)
    results = []
    for _ in range(7):
        try:
            got = receiver.receive()
        except SyncError as e:
            results.append(str(e))
            continue
        want = update(got.version, seed={1: 1, 2: 2, 3: 3}[got.version])
        merged, ref = applied(got), applied(want)
        results.append(same(got, want) and all(torch.equal(merged[n], ref[n]) for n in ref))
    group.timeout_s = 0.5  # the sender is alive and silent now
    start = time.monotonic()
    try:
        receiver.receive()
        results.append("no error")
    except SyncError as e:
        results.append(str(e))
    results.append(time.monotonic() - start)
    (out / f"rank{rank}.json").write_text(json.dumps(results))


@pytest.mark.skipif(not dist.is_gloo_available(), reason="no gloo in this torch build")
def test_broadcast_over_a_gloo_weight_group(tmp_path) -> None:
    """This process is rank 0 (the sender; it serves the store), two spawned ones receive."""
    store, port = serve_rendezvous(timeout_s=DEADLINE_S)
    ctx = mp.start_processes(
        _receive_all, args=(port, tmp_path), nprocs=2, join=False, start_method="spawn"
    )
    try:
        _send_all(BroadcastSender(open_group("127.0.0.1", port, 0, 3, "cpu", DEADLINE_S, store)))
        deadline = time.monotonic() + DEADLINE_S
        while not ctx.join(timeout=1.0):
            assert time.monotonic() < deadline, "receivers still running (a hang?)"
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
    for rank in (1, 2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r[0] is True and r[1] is True, r
        assert "content digest" in r[2], r
        assert "stale weight update v1 after v2" in r[3], r
        assert "replayed or reordered" in r[4], r
        assert "l2: A [2, 8] and B [2, 6] are not" in r[5], r
        assert r[6] is True, r  # still in step after four refusals
        assert "failed or timed out after 0.5 s" in r[7] and r[8] < 10.0, r


# --- ipc: another process opens the shared buffers -----------------------------------------------


def _ipc_child(device: str, handles, results) -> None:
    torch.set_num_threads(1)
    receiver = IpcReceiver(device)
    while (item := handles.get()) is not None:
        seed, handle = item
        try:
            got = receiver.receive(handle)
        except SyncError as e:
            results.put(str(e))
            continue
        want = update(got.version, seed)
        on = all(
            d.a.device.type == device and d.b.device.type == device for d in got.deltas.values()
        )
        got_cpu = on_device(got, "cpu")
        results.put(on and same(got_cpu, want) and bool(applied(got)))


def _ipc(device: str) -> list:
    ctx = mp.get_context("spawn")
    handles, results = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_ipc_child, args=(device, handles, results))
    child.start()
    try:
        sender = IpcSender()
        out = []

        def send(version: int, seed: int):
            u = on_device(update(version, seed), device)
            return sender.send(u)

        h1 = send(1, 1)
        handles.put((1, h1))
        out.append(results.get(timeout=DEADLINE_S))
        handles.put((1, h1))  # opened twice
        out.append(results.get(timeout=DEADLINE_S))
        h2 = send(2, 2)
        handles.put((2, h2))
        out.append(results.get(timeout=DEADLINE_S))
        bad = copy.copy(h2)
        object.__setattr__(bad, "manifest", h2.manifest.replace('"version": 2', '"version": 3'))
        handles.put((2, bad))
        out.append(results.get(timeout=DEADLINE_S))
        send(3, 3)  # frees update 1's buffers (and 2's): their handles are stale now
        handles.put((1, h1))
        out.append(results.get(timeout=DEADLINE_S))
        handles.put(None)
        child.join(DEADLINE_S)
        return out
    finally:
        if child.is_alive():
            child.terminate()


def _check_ipc(out: list, stale: str) -> None:
    assert out[0] is True, out
    assert "replayed or reordered" in out[1], out
    assert out[2] is True, out
    assert "content digest" in out[3], out  # a manifest edited in transit
    assert isinstance(out[4], str) and stale in out[4], out


def test_ipc_across_processes_on_the_cpu() -> None:
    # a freed shared-memory segment is gone: its handle cannot be opened
    _check_ipc(_ipc("cpu"), "cannot open the sender's shared buffers")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_ipc_across_processes() -> None:
    # a freed CUDA block may be reused or still hold the old bytes: refused either way
    _check_ipc(_ipc("cuda"), "")


def test_manifest_round_trips_through_json() -> None:
    m, _ = pack(update(7, seed=7), serial=3)
    again = Manifest.from_json(m.to_json())
    assert again == m and again.digest and again.serial == 3
