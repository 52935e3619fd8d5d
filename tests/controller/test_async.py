"""The async controller (``controller/async_.py``): max_staleness=0 is sync exactly; with
max_staleness=1 the rollout runs ahead of a slowed actor and no trained batch is older than
the bound; weights change only between rollout batches; the config keys and the bound."""

from __future__ import annotations

import asyncio
import time

import pytest
from tiny_runs import tiny_run

from diffrl.build import build
from diffrl.cli import main
from diffrl.config import load_config
from diffrl.controller.async_ import Clock, Rollout, Staleness, train_async
from diffrl.controller.loop import train
from diffrl.controller.run_dir import read_metrics
from diffrl.errors import ConfigError

RECIPE = "recipes/shapes_nft.yaml"
FAST = [
    "rollout.num_steps=2",
    "run.eval_every=2",
    "actor.lr=1e-2",
    # partial credit: with the default binary reward a random model's groups tie (r = 1/2
    # everywhere), the LoRA never moves, and every mode would trivially agree
    "reward.scorers=[{name: shapes, weight: 1.0, required: true, params: {mode: partial}}]",
]


async def owned(run, parts):
    """``run`` (a loop over ``parts``), then ``parts`` closed, as ``controller.loop.train`` does."""
    try:
        return await run
    finally:
        await parts.aclose()


def untimed(rows: list[dict]) -> list[dict]:
    drop = lambda k: k.startswith(("perf/", "async/")) or k == "time"  # noqa: E731
    return [{k: v for k, v in r.items() if not drop(k)} for r in rows]


@pytest.mark.parametrize(
    "extra",
    [
        [],  # the default recipe: EMA old, synced after every update
        ["algorithm.old_update=copy", "algorithm.old_every=2"],  # updates that do not sync
        ["run.async_sync=step"],  # updates offered mid-rollout (none is: the rollout is idle)
    ],
    ids=["ema", "copy_every_2", "midsync"],
)
def test_staleness_0_is_sync_bit_for_bit(tiny_checkpoint, tmp_path, extra):
    rows = {}
    for mode in ("sync", "async"):
        over = [*FAST, *extra, f"run.mode={mode}", "run.max_staleness=0"]
        cfg = load_config(RECIPE, tiny_run(tiny_checkpoint, tmp_path / mode, 3, *over))
        rows[mode] = read_metrics(asyncio.run(train(cfg)))  # train dispatches on run.mode
    assert [r["step"] for r in rows["sync"]] == [0, 1, 2, 3]
    assert any(r["actor/grad_norm"] > 0 for r in rows["sync"][1:])  # the weights do move
    assert untimed(rows["async"]) == untimed(rows["sync"])
    assert not any(k.startswith("async/") for r in rows["sync"] for k in r)
    for r in rows["async"][1:]:
        assert r["async/staleness"] == 0 and r["async/dropped"] == 0
        assert r["async/policy_version"] == r["step"] - 1
        assert r["async/produced"] >= r["step"] and 0 < r["async/kept_share"] <= 1
        if "algorithm.old_every=2" not in extra:  # the weights themselves synced every update
            assert r["async/step_staleness_mean"] == 0


def test_rollout_runs_ahead_within_the_bound(tiny_checkpoint, tmp_path):
    cfg = load_config(
        RECIPE,
        tiny_run(tiny_checkpoint, tmp_path, 4, *FAST, "run.mode=async", "run.max_staleness=1"),
    )
    parts = build(cfg)
    actor, rollout = parts.actor, parts.rollout
    trained_at, sampling, loads = [], [], []

    def slow_train_step(batch, _inner=actor.train_step):
        trained_at.append(actor.version)
        time.sleep(0.5)  # the rollout of the next iteration(s) runs meanwhile
        return _inner(batch)

    async def stream(*args, _inner=rollout.stream, **kw):
        sampling.append(True)
        try:
            await _inner(*args, **kw)
        finally:
            sampling.pop()

    def load_weights(update, _inner=rollout.load_weights):
        assert not sampling, "weights changed while the rollout was sampling"
        loads.append(update.version)
        return _inner(update)

    actor.train_step, rollout.stream, rollout.load_weights = slow_train_step, stream, load_weights
    rows = read_metrics(asyncio.run(owned(train_async(cfg, parts), parts)))[1:]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert trained_at == [0, 1, 2, 3]
    for r, version in zip(rows, trained_at, strict=True):
        produced_by = r["async/policy_version"]
        assert version - produced_by <= cfg.run.max_staleness, r["step"]
        assert r["async/staleness"] == version - produced_by
    assert max(r["async/staleness"] for r in rows) == 1  # it did run ahead
    assert rows[-1]["async/staleness_max"] == 1 and rows[-1]["async/dropped"] == 0
    assert loads == sorted(loads)  # versioned syncs only move forward
    assert (tmp_path / cfg.run.name / "checkpoints" / "latest").read_text().strip() == (
        "step_000004"
    )


def test_fixed_weights_do_not_depend_on_which_loop_runs_ahead(tiny_checkpoint, tmp_path):
    """``run.async_weights=fixed``: iteration i samples with update i-1's weights whether the
    actor or the rollout is the slow one, so the two runs' rows are the same, bit for bit
    (what ranks of a torchrun launch, each with its own timing, rely on)."""
    rows = []
    for slow in ("actor", "rollout"):
        over = [*FAST, "run.mode=async", "run.max_staleness=1", "run.async_weights=fixed"]
        cfg = load_config(RECIPE, tiny_run(tiny_checkpoint, tmp_path / slow, 3, *over))
        parts = build(cfg)
        actor, rollout = parts.actor, parts.rollout

        def slow_train_step(batch, _inner=actor.train_step, _slow=slow == "actor"):
            time.sleep(0.4 if _slow else 0.0)
            return _inner(batch)

        async def stream(*args, _inner=rollout.stream, _slow=slow == "rollout", **kw):
            await asyncio.sleep(0.4 if _slow else 0.0)
            await _inner(*args, **kw)

        actor.train_step, rollout.stream = slow_train_step, stream
        rows.append(read_metrics(asyncio.run(owned(train_async(cfg, parts), parts))))
    # how far the rollout ran ahead is timing's: the records it finished, the share trained
    timing = ("perf/", "async/produced", "async/kept_share")
    drop = lambda k: k.startswith(timing) or k == "time"  # noqa: E731
    a, b = ([{k: v for k, v in r.items() if not drop(k)} for r in run] for run in rows)
    assert a == b
    assert [r["async/policy_version"] for r in a[1:]] == [0, 0, 1]
    assert [r["async/staleness"] for r in a[1:]] == [0, 1, 1]
    assert any(k.startswith("sync/") for k in a[3])  # update 1's load, carried by its record


def record(version: int) -> Rollout:
    return Rollout(index=0, scored=None, metrics={}, version=version)


def test_the_bound_drops_or_keeps_and_counts():
    drop = Staleness(max_staleness=1, keep=False)
    assert drop.admit(record(4), actor_version=5)
    assert not drop.admit(record(3), actor_version=5)  # 2 versions old
    assert drop.metrics() == {
        "async/staleness": 1,
        "async/staleness_max": 1,
        "async/staleness_mean": 1.0,
        "async/dropped": 1,
    }
    keep = Staleness(max_staleness=0, keep=True)
    assert keep.admit(record(5), 5) and keep.admit(record(3), 5)
    assert keep.metrics()["async/staleness_max"] == 2 and keep.metrics()["async/dropped"] == 0


def test_the_gate():
    async def check():
        clock = Clock(updates=2, version=2, max_staleness=1, steps=5)
        assert [clock.may_start(i) for i in range(6)] == [True] * 4 + [False] * 2
        clock.dropped = 1  # iteration 4 now trains update 4, after 3 done
        assert clock.may_start(4) and not clock.may_start(5)
        zero = Clock(updates=2, version=2, max_staleness=0, steps=5)
        assert zero.may_start(2) and not zero.may_start(3)

    asyncio.run(check())


@pytest.mark.parametrize(
    ("override", "says"),
    [
        ("run.mode=asynk", "'run.mode'"),
        ("run.max_staleness=-1", "'run.max_staleness'"),
        ("run.stale=maybe", "'run.stale'"),
    ],
)
def test_config_errors(override, says):
    with pytest.raises(ConfigError, match=says):
        load_config(RECIPE, [override])


def test_stale_correct_needs_an_importance_ratio(tiny_checkpoint, tmp_path):
    """run.stale=correct keeps stale records for a loss with a ratio against the recorded
    log-probs (FlowGRPO); NFT has none and is refused before any work."""
    over = tiny_run(tiny_checkpoint, tmp_path, 1, *FAST, "run.mode=async", "run.stale=correct")
    with pytest.raises(ConfigError, match=r"'run.stale' = 'correct': diffusion_nft has no"):
        build(load_config(RECIPE, over))
    grpo = load_config("recipes/shapes_grpo.yaml", over)
    assert grpo.run.stale == "correct" and build(grpo).algorithm.needs_logprobs


def test_config_defaults():
    run = load_config(RECIPE).run
    assert (run.mode, run.max_staleness, run.stale) == ("sync", 1, "drop")


def test_resume_in_async_mode_as_in_sync(tiny_checkpoint, tmp_path):
    """2 steps, then resumed to 4 (checkpoints after every step): in async mode through the
    CLI, each step logged once, and with max_staleness=0 the same rows as sync's resume."""
    rows = {}
    for mode in ("sync", "async"):
        for steps in (2, 4):
            over = [*FAST, f"run.mode={mode}", "run.max_staleness=0", "run.save_every=1"]
            assert (
                main(["train", RECIPE, *tiny_run(tiny_checkpoint, tmp_path / mode, steps, *over)])
                == 0
            )
        rows[mode] = read_metrics(tmp_path / mode / "shapes_nft")
    assert [r["step"] for r in rows["async"]] == [0, 1, 2, 3, 4]
    assert untimed(rows["async"]) == untimed(rows["sync"])
    ckpt = tmp_path / "async" / "shapes_nft" / "checkpoints"
    assert (ckpt / "latest").read_text().strip() == "step_000004"


def test_a_failing_rollout_stops_the_run(tiny_checkpoint, tmp_path):
    cfg = load_config(RECIPE, tiny_run(tiny_checkpoint, tmp_path, 3, *FAST, "run.mode=async"))
    parts = build(cfg)

    async def stream(prompts, seed, channel, *, iteration=0, _inner=parts.rollout.stream, **kw):
        if iteration == 1:
            channel.close()
            raise RuntimeError("rollout host lost")
        await _inner(prompts, seed, channel, iteration=iteration, **kw)

    parts.rollout.stream = stream
    with pytest.raises(RuntimeError, match="rollout host lost"):  # raised, not a hang
        asyncio.run(asyncio.wait_for(owned(train_async(cfg, parts), parts), timeout=120))


def test_neither_loop_mode_imports_the_other():
    """sync and async share controller/step.py; controller/loop.py alone picks between them."""
    from test_import_boundaries import PKG, diffrl_imports

    sync_imports = diffrl_imports(PKG / "controller" / "sync.py")
    async_imports = diffrl_imports(PKG / "controller" / "async_.py")
    assert not any(m.startswith("diffrl.controller.async_") for m in sync_imports)
    assert not any(m.startswith("diffrl.controller.sync") for m in async_imports)
    assert {"diffrl.controller.step"} <= sync_imports & async_imports
