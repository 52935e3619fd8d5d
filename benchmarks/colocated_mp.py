"""The actor and the rollout as two processes on one device, the weights over CUDA IPC after
every update, against today's one-process run: SD3.5-M DiffusionNFT or FlowGRPO epochs, time
and peak memory, in one script run. No Ray: the second process is a ``torch.multiprocessing``
spawn (the device image has no Ray; ``benchmarks/colocated_ipc.py`` is the Ray version).

    python benchmarks/colocated_mp.py --algo nft --epochs 3     # SD3.5-M, random weights, 1 GPU
    python benchmarks/colocated_mp.py --algo grpo --epochs 3
    python benchmarks/colocated_mp.py --tiny --epochs 2          # CPU smoke check (sd35-tiny)

On the device (diffusers travels as a wheel in ``.whl``, carried; from the repository root):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 && \
    timeout 580 python3 benchmarks/colocated_mp.py --algo nft --epochs 3

Variants, each in a process of its own (spawned from this one, so each one's peak memory is
its own):

- ``one_process``: the engines built by the factory as ``run.backend=local`` builds them
  (``build_engines``), every engine in one process, as ``diffrl train`` runs today.
- ``two_process``: a spawned child builds the rollout side (``build.rollout_side``: the data
  stage, the rollout and the evaluator over its own model copy) on the same device; the parent
  builds the actor side and the reward pool, as the Ray backend's hosts do
  (``backends/ray.py``). The parent draws each step's prompts from the child's tokenized set
  and sends the ``PromptBatch`` (its token hashes checked on arrival); the child streams each
  rollout micro-batch back on the CPU through a ``torch.multiprocessing`` queue (the tensors
  in shared memory), scored as each arrives. After each update the parent carries out the
  algorithm's weight plan: the export goes through the transport's IPC path
  (``sync/transport.py``: ``WeightSource``/``WeightSink``, a CUDA IPC handle on a GPU, a shared
  memory segment on the CPU), the child opens it, checks it and calls ``load_weights``, and
  the parent checks the child's receipt (``sync/receipt.py``: ``load_verified``).

Both variants run the same epoch: the weight sync before the first step, then per step the
controller's ``rollout_and_score`` (the rollout streamed into scoring), ``prepare``, one
``train_step``, and ``apply_plan`` (refresh ``old``, export, load, receipt). No prefetch of
the next step's rollout (``run.prefetch``), so the parts are timed one after another. Step 0 is
the warm-up; steps 1..N are timed, with the same seeds in both variants.

One JSON line per variant: ``s_per_epoch`` (mean of the timed epochs) and its parts
``rollout_s`` (sampling with scoring beside it; in ``two_process`` also the trip through the
queue), ``update_s`` (prepare and train), ``sync_s`` (weight plan, export, transport, load,
receipt); per process, the peak of ``torch.cuda.max_memory_allocated`` and
``max_memory_reserved`` read at the end (the CUDA context itself not included; "n/a" on the
CPU) and the host's peak RSS; the reward mean of every epoch, the warm-up's first. The two
variants sample with the same seeds from the same weights (the parent builds its actor from
the RNG state the child reached: ``two_process_engines``), so their rewards should agree; on
the CPU smoke check they do to the last digit. The reward is a weight-free scorer (JPEG
incompressibility), so nothing is downloaded. Not run in CI.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import time
import traceback
from statistics import mean
from typing import Any

import torch
import torch.multiprocessing as mp

from diffrl.backends import build_engines
from diffrl.bench.mfu import sync
from diffrl.build import (
    Engines,
    actor_side,
    actor_targets,
    check_config,
    rollout_side,
    setup_process,
)
from diffrl.channel import Channel
from diffrl.config import Config, load_config
from diffrl.controller.step import rollout_and_score
from diffrl.controller.sync import apply_plan
from diffrl.hostmem import peak_rss_bytes
from diffrl.models.registry import load_model
from diffrl.reward.pool import RewardPool, close_pool
from diffrl.sync.bound import check_bound
from diffrl.sync.receipt import SyncReceipt, load_verified
from diffrl.sync.transport import WeightSink, WeightSource
from diffrl.sync.weights import SyncReport, WeightUpdate
from diffrl.tasks import build_task, prompt_source
from diffrl.types import PromptBatch, check_token_hashes, to_device

RECIPES = {
    "nft": ("recipes/sd35_nft.yaml", ['model.path=""', "rollout.cfg_scale=1"]),
    "grpo": ("benchmarks/recipes/sd35m_grpo_epoch.yaml", []),
}
VARIANTS = ("one_process", "two_process")
CPU = torch.device("cpu")
REPLY_POLL_S = 2.0  # how often a waiting side checks that its peer is still alive


def overrides(args: argparse.Namespace) -> list[str]:
    over = [
        *RECIPES[args.algo][1],
        f"run.steps={args.epochs + 1}",  # the learning-rate horizon of a run this long
        "run.tensorboard=false",
        "probe.mode=off",  # start-up only, and not what is measured
        "reward.scorers=[{name: jpeg_incompressibility}]",
    ]
    if args.tiny:
        return over + [
            "model.preset=sd35-tiny", "model.resolution=64", "model.dtype=float32",
            "run.device=cpu", "data.prompts_per_step=2", "rollout.group_size=2",
            "rollout.num_steps=3", "rollout.max_batch=2", "actor.micro_batch=2",
        ]  # fmt: skip
    return over + ["model.preset=sd35-medium", "run.device=cuda"]


def load(args: argparse.Namespace) -> Config:
    return load_config(RECIPES[args.algo][0], overrides(args))


def peak_memory(device: torch.device) -> dict[str, Any]:
    """This process's peaks, read now (the end of its run)."""
    out: dict[str, Any] = {"host_peak_gb": round(peak_rss_bytes() / 1e9, 3)}
    if device.type != "cuda":
        return {**out, "max_allocated_mib": "n/a", "max_reserved_mib": "n/a"}
    mib = 2**20
    return {
        **out,
        "max_allocated_mib": round(torch.cuda.max_memory_allocated(device) / mib),
        "max_reserved_mib": round(torch.cuda.max_memory_reserved(device) / mib),
    }


def rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.random.get_rng_state(), cuda


def set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    torch.random.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def wait_reply(replies: Any, peer: Any, who: str) -> tuple[str, Any]:
    """The next (kind, value) from ``replies``; raises when ``peer`` died first or sent an
    error (its traceback)."""
    while True:
        try:
            kind, value = replies.get(timeout=REPLY_POLL_S)
        except queue.Empty:
            if not peer.is_alive():
                raise RuntimeError(f"the {who} process exited (code {peer.exitcode})") from None
            continue
        if kind == "error":
            raise RuntimeError(f"the {who} process failed:\n{value}")
        return kind, value


# --- the rollout's process ---------------------------------------------------------------------


def rollout_main(cfg: Config, requests: Any, replies: Any) -> None:
    """The child: builds the rollout side, then serves the parent's requests one at a time
    until "stop". Consumes (op, arg) from ``requests``; waits only on the parent's next
    request; each reply goes on ``replies`` (a stream's micro-batches as each is decoded)."""
    try:
        device = setup_process(cfg)
        side = rollout_side(cfg, device)
        sink = WeightSink("ipc", device)
    except Exception:
        replies.put(("error", traceback.format_exc()))
        return
    replies.put(("ready", {
        "train": side.train, "eval_set": side.eval_set, "probe": side.probe,
        "produces": frozenset(side.rollout.produces), "family": side.base.family.name,
        "bound": side.rollout.bound, "rng": rng_state(device),
    }))  # fmt: skip
    engine = side.rollout
    while True:
        op, arg = requests.get()
        try:
            if op == "stop":
                replies.put(("stopped", peak_memory(device)))
                return
            if op == "stream":
                asyncio.run(stream_parts(engine, *arg, replies))
            elif op == "load":  # the transport's checks, then the merge's own
                replies.put(("loaded", engine.load_weights(sink.receive("rollout", arg))))
            elif op == "receipt":
                replies.put(("receipt", engine.receipt()))
            else:
                raise ValueError(f"unknown request {op!r}")
        except Exception:
            replies.put(("error", traceback.format_exc()))


async def stream_parts(engine, prompts: PromptBatch, seed: int, kw: dict, replies) -> None:
    """The step's micro-batches onto ``replies`` on the CPU as each finishes, then "done"."""
    check_token_hashes(prompts, "the rollout process")  # contract 3, as a Ray host checks
    channel = Channel(capacity=1)
    producer = asyncio.create_task(engine.stream(prompts, seed, channel, **kw))
    async for traj in channel:
        replies.put(("part", to_device(traj, CPU)))
    await producer
    replies.put(("done", None))


class ChildRollout:
    """The child's rollout engine, as the controller's code calls a rollout
    (``RolloutEngineProtocol``'s stream, load_weights, receipt): requests one at a time."""

    def __init__(self, cfg: Config, device: torch.device) -> None:
        ctx = mp.get_context("spawn")
        self.requests, self.replies = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(
            target=rollout_main, args=(cfg, self.requests, self.replies), daemon=True
        )
        self.proc.start()
        self.weights = WeightSource("ipc", device)
        self.version = 0
        self.info: dict = {}

    def ready(self) -> dict:
        """What the child built (its tokenized prompts, probe, produced fields, bound
        modules), once it has."""
        self.info = self.call(None, None, "ready")
        return self.info

    def call(self, op: str | None, arg: Any, want: str) -> Any:
        """Request ``op`` (None: none, only the next reply) and return its reply's value."""
        if op is not None:
            self.requests.put((op, arg))
        kind, value = wait_reply(self.replies, self.proc, "rollout")
        assert kind == want, f"rollout process: {want!r} expected after {op!r}, got {kind!r}"
        return value

    @property
    def produces(self) -> frozenset[str]:
        return self.info["produces"]

    async def stream(self, prompts: PromptBatch, seed: int, channel, **kw) -> None:
        """Puts the child's micro-batches into ``channel`` as each arrives, then closes it.
        Waits (in a worker thread, so scoring goes on meanwhile) on the child's next reply;
        the child's "done" after its last micro-batch ends it, an error or its exit raises."""
        self.requests.put(("stream", (prompts, seed, kw)))
        try:
            while True:
                kind, traj = await asyncio.to_thread(wait_reply, self.replies, self.proc, "rollout")
                if kind == "done":
                    return
                await channel.put(traj, traj.policy_version)
        finally:
            channel.close()

    def load_weights(self, update: WeightUpdate) -> SyncReport:
        handle = self.weights.send(self.weights.stage(update))  # IPC: the buffers stay held
        report = self.call("load", handle, "loaded")
        self.version = report.version
        return report

    def receipt(self) -> SyncReceipt:
        return self.call("receipt", None, "receipt")

    def stop(self) -> dict:
        peaks = self.call("stop", None, "stopped")
        self.proc.join(timeout=60)
        return peaks


def two_process_engines(cfg: Config) -> tuple[Engines, ChildRollout]:
    """The parent's engines: the actor and the reward pool here, the rollout in the child.
    The child starts first, so the two load their models at the same time; the parent builds
    its actor once the child has built the rollout side, from the global RNG state the child
    reached there (that of one process at the same point: the same LoRA init)."""
    algorithm = check_config(cfg)
    device = setup_process(cfg)
    child = ChildRollout(cfg, device)
    try:
        base = load_model(cfg.model, device)  # the same weights: the same first draws
        info = child.ready()
        # the RNG where one process builds its actor: the rollout side draws in between (the
        # serving layout's fused Linears), and the LoRA init draws next
        set_rng_state(info["rng"], device)
        actor = actor_side(cfg, base, device)
        rewards = RewardPool(cfg.reward)
        rewards.check_inputs(produced=set(info["produces"]))
        bound = check_bound(actor_targets(cfg), info["family"], actor.bound, info["bound"])
    except BaseException:
        child.proc.kill()
        raise

    async def close() -> None:
        await close_pool(rewards)

    parts = Engines(
        cfg, device, build_task(cfg.data), prompt_source(info["train"], cfg.data, cfg.run.seed),
        info["eval_set"], child, child, rewards, actor, algorithm, info["probe"], close=close,
        bound=bound,
    )  # fmt: skip
    return parts, child


# --- the epochs --------------------------------------------------------------------------------


def run_epochs(parts: Engines, epochs: int) -> list[dict[str, float]]:
    """Step 0 (the warm-up) and steps 1..epochs, as the synchronous controller runs them
    (``controller/sync.py``, no prefetch); each step's parts timed."""
    cfg, dev = parts.cfg, parts.device
    plan_of = lambda k: parts.algorithm.weight_plan(k, cfg.algorithm)  # noqa: E731
    load_verified(parts.rollout, parts.actor.export_weights(plan_of(1).rollout_adapter))
    rows = []
    for step in range(epochs + 1):
        t0 = sync(dev)
        scored, r_metrics = asyncio.run(rollout_and_score(parts, step))
        t1 = sync(dev)
        parts.actor.train_step(parts.algorithm.prepare(scored, cfg.algorithm))
        t2 = sync(dev)
        s_metrics = apply_plan(parts, plan_of(step + 1))
        t3 = sync(dev)
        rows.append({
            "rollout_s": t1 - t0, "update_s": t2 - t1, "sync_s": t3 - t2, "epoch_s": t3 - t0,
            "reward": r_metrics["reward/mean"], "synced": s_metrics.get("sync/version", -1),
            "receipt_frac": s_metrics.get("sync/receipt_frac", float("nan")),
        })  # fmt: skip
    return rows


def run_variant(variant: str, args: argparse.Namespace, out: Any) -> None:
    """One variant in this (spawned) process; its report row onto ``out``."""
    try:
        cfg = load(args)
        child = None
        if variant == "one_process":
            parts = build_engines(cfg)
        else:
            parts, child = two_process_engines(cfg)
        start = time.perf_counter()
        rows = run_epochs(parts, args.epochs)
        total = time.perf_counter() - start
        peaks = {"main": peak_memory(parts.device)}
        if child is not None:
            peaks = {"actor (parent)": peaks["main"], "rollout (child)": child.stop()}
        asyncio.run(parts.aclose())
        timed = rows[1:]
        out.put(("row", {
            "run": variant, "algo": args.algo, "tiny": args.tiny, "epochs": len(timed),
            "s_per_epoch": round(mean(r["epoch_s"] for r in timed), 3),
            "rollout_s": round(mean(r["rollout_s"] for r in timed), 3),
            "update_s": round(mean(r["update_s"] for r in timed), 3),
            "sync_s": round(mean(r["sync_s"] for r in timed), 3),
            "warmup_epoch_s": round(rows[0]["epoch_s"], 3),
            "epochs_total_s": round(total, 2),
            "peak_memory": peaks,
            "synced_version": rows[-1]["synced"],
            "worst_receipt_frac": max(
                (r["receipt_frac"] for r in rows if r["synced"] >= 0), default=None
            ),
            "rewards": [round(r["reward"], 6) for r in rows],  # the warm-up's first
        }))  # fmt: skip
    except BaseException:
        out.put(("error", traceback.format_exc()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--algo", choices=sorted(RECIPES), default="nft")
    p.add_argument("--epochs", type=int, default=3, help="timed epochs after the warm-up")
    p.add_argument("--tiny", action="store_true", help="sd35-tiny on the CPU: a smoke check")
    p.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    args = p.parse_args()
    if args.epochs < 1:
        p.error(f"--epochs must be >= 1 (timed epochs after the warm-up), got {args.epochs}")
    ctx = mp.get_context("spawn")
    for variant in args.variants:
        start = time.time()
        out = ctx.Queue()
        proc = ctx.Process(target=run_variant, args=(variant, args, out))  # may spawn a child
        proc.start()
        try:
            _, row = wait_reply(out, proc, variant)
        except RuntimeError as e:  # report it and go on: the other variant's row still counts
            row = {"run": variant, "algo": args.algo, "error": str(e)[-3000:]}
        proc.join()
        print(json.dumps({**row, "total_s": round(time.time() - start, 1)}), flush=True)


if __name__ == "__main__":
    main()
