"""The Ray backend (``run.backend=ray``, ``backends/ray.py``) on a local Ray instance with 2
CPUs: the default recipe gives the same metrics as the local backend at the same seed; so do
resume, async mode and the TransferQueue channel on a tiny run; pools that do not fit, a host
that fails to build, and Ray missing are clear errors that leave nothing behind."""

from __future__ import annotations

import asyncio
import dataclasses
import sys

import pytest
from ray_runs import PARTIAL, RECIPE, all_released, local_ray, run, untimed  # noqa: F401
from tiny_runs import tiny_run

from diffrl.backends import build_engines
from diffrl.cli import main
from diffrl.config import load_config
from diffrl.errors import ConfigError, ContractError, DiffrlError

ray = pytest.importorskip("ray")

CPU_POOLS = ["placement.rollout.cpus=0", "placement.actor.cpus=0"]  # 2 replicas + actor fit


def test_default_recipe_on_two_replicas_equals_local_and_survives_a_killed_one(
    tmp_path, monkeypatch
):
    """The issue's check, `diffrl train run.backend=ray placement.rollout.replicas=2
    run.steps=3` on the default recipe: two rollout replicas behind one dispatcher give the
    local backend's rows bit for bit. In step 2, replica 1 is killed as it is handed its
    micro-batch (after it sampled others, in step 1 and the evals): it is replaced on its
    bundle and given the weights the rollout holds (trained ones by then: NFT samples with an
    EMA of the policy), the lost micro-batch is sampled again (by the replacement: replica 0 is
    held until it is up), and the rows still equal local's."""
    from diffrl.backends.ray import RayReplica

    generate, init, killed, made = RayReplica.generate, RayReplica.__init__, [], []

    async def kill_one(self, which, prompts, seed, kw):
        # a step's micro-batches alternate between the replicas; kill the one handed the second
        step2 = which == "rollout" and kw["iteration"] == 1
        if step2 and kw["first_prompt"] > 0 and not killed:
            killed.append(self.host)
            ray.kill(self.host)
        out = await generate(self, which, prompts, seed, kw)
        while step2 and kw["first_prompt"] == 0 and len(made) < 3:  # the replacement is up
            await asyncio.sleep(0.05)
        return out

    monkeypatch.setattr(RayReplica, "generate", kill_one)
    monkeypatch.setattr(RayReplica, "__init__", lambda self, h: init(self, h) or made.append(h))
    common = ["run.steps=3", "run.tensorboard=false"]
    local = run([*common, f"run.out_dir={tmp_path / 'local'}"])
    over = ["run.backend=ray", "placement.rollout.replicas=2", *CPU_POOLS]
    rows = run([*common, f"run.out_dir={tmp_path / 'ray'}", *over])
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    assert killed and [r.get("rollout/replaced") for r in rows] == [None, 0.0, 1.0, 1.0]
    same = untimed([{k: v for k, v in r.items() if k != "rollout/replaced"} for r in rows])
    assert same == untimed(local)
    assert "eval/overall" in rows[-1] and rows[-1]["actor/grad_norm"] > 0
    assert all_released()


def tiny(checkpoint, out, steps, *extra):
    over = ["rollout.num_steps=2", "actor.lr=1e-2", "run.eval_every=1", PARTIAL]  # eval each step
    return tiny_run(checkpoint, out, steps, *over, *extra)


def test_resume_async_and_transferqueue_on_ray_equal_local(
    tiny_checkpoint, tmp_path, monkeypatch, capsys
):
    local = run(tiny(tiny_checkpoint, tmp_path / "local", 3), RECIPE)
    assert any(r.get("actor/grad_norm", 0) > 0 for r in local[1:])  # the weights do move
    # stopped after 2 steps, resumed to 3: the checkpoint round-trips through the actor host
    ray_dir = tmp_path / "ray"
    run(tiny(tiny_checkpoint, ray_dir, 2, "run.backend=ray"), RECIPE)
    resumed = run(tiny(tiny_checkpoint, ray_dir, 3, "run.backend=ray"), RECIPE)
    assert untimed(resumed) == untimed(local)
    # `diffrl eval` of the Ray-trained run builds its engines on Ray again, prints the newest
    # checkpoint's eval and closes the remote reward pool (it raised AttributeError there)
    capsys.readouterr()
    assert main(["eval", str(ray_dir / "shapes_nft")]) == 0
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    printed = dict(w for w in lines if len(w) == 2)  # not the Ray workers' own log lines
    assert float(printed["step"]) == 3
    assert abs(float(printed["eval/overall"]) - local[-1]["eval/overall"]) < 1e-3
    # async mode at max_staleness 0 is sync's schedule, on remote engines too
    over = ["run.backend=ray", "run.mode=async", "run.max_staleness=0"]
    asynced = run(tiny(tiny_checkpoint, tmp_path / "async", 3, *over), RECIPE)
    drop_async = lambda rows: [
        {k: v for k, v in r.items() if not k.startswith("async/")} for r in rows
    ]  # noqa: E731, E501
    assert drop_async(untimed(asynced)) == untimed(local)
    # both edges on TransferQueue: rollout host -> reward host -> controller, per sample;
    # no trajectory reaches the controller on its way to scoring (the proxy's stream is unused)
    pytest.importorskip("transfer_queue")
    from diffrl.backends.ray import RemoteRollout

    def not_here(*a, **kw):
        raise AssertionError("a training rollout streamed through the controller")

    monkeypatch.setattr(RemoteRollout, "stream", not_here)
    over = ["run.backend=ray", "ray.channel=transferqueue"]
    tq = run(tiny(tiny_checkpoint, tmp_path / "tq", 3, *over), RECIPE)
    assert untimed(tq) == untimed(local)
    assert all(r["perf/score_calls"] >= 1 for r in tq[1:])
    assert all_released()


def test_pools_that_do_not_fit_are_a_config_error(tiny_checkpoint, tmp_path):
    cfg = load_config(
        RECIPE, tiny(tiny_checkpoint, tmp_path, 1, "run.backend=ray", "placement.actor.cpus=8")
    )
    with pytest.raises(ConfigError, match=r"placement.actor.cpus=8.*Ray cluster has 2"):
        build_engines(cfg)
    assert all_released()


def test_a_host_that_fails_to_build_raises_its_own_error(tiny_checkpoint, tmp_path):
    missing = tmp_path / "missing.safetensors"
    over = tiny(tiny_checkpoint, tmp_path, 1, "run.backend=ray", f"model.checkpoint={missing}")
    with pytest.raises(DiffrlError, match="missing.safetensors") as info:
        build_engines(load_config(RECIPE, over))
    assert not isinstance(info.value, ray.exceptions.RayError)  # the host's error, unwrapped
    assert all_released()


def test_ray_not_installed_is_a_config_error(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    cfg = load_config(RECIPE, tiny(tiny_checkpoint, tmp_path, 1, "run.backend=ray"))
    with pytest.raises(ConfigError, match=r"pip install -e '\.\[ray\]'"):
        build_engines(cfg)


def _one_id_changed(record, row: int):
    ids = record.input_ids.clone()
    ids[row, 0] += 1
    return dataclasses.replace(record, input_ids=ids)


@pytest.mark.parametrize("host", ["rollout", "actor"])
def test_a_host_refuses_ids_changed_on_the_way(host, tiny_checkpoint, tmp_path, monkeypatch):
    """Contract 3 on each Ray host: the controller's record reaches the host with one id
    changed (the data stage's hashes kept); the host re-hashes what Ray delivered and stops the
    run before its engine sees it, naming itself and the row."""
    from diffrl.backends.ray import RemoteActor, RemoteRollout

    if host == "actor":
        send = RemoteActor.train_step
        monkeypatch.setattr(
            RemoteActor, "train_step", lambda self, b: send(self, _one_id_changed(b, 1))
        )
        part = RemoteActor.train_part
        monkeypatch.setattr(
            RemoteActor, "train_part", lambda self, b: part(self, _one_id_changed(b, 1))
        )
    else:
        generate, stream = RemoteRollout.generate, RemoteRollout.stream
        monkeypatch.setattr(
            RemoteRollout,
            "generate",
            lambda self, p, seed, **kw: generate(self, _one_id_changed(p, 1), seed, **kw),
        )
        monkeypatch.setattr(
            RemoteRollout,
            "stream",
            lambda self, p, seed, ch, **kw: stream(self, _one_id_changed(p, 1), seed, ch, **kw),
        )
    message = rf"token drift at the Ray {host} host \(pid \d+\): input_ids of rows \[1\]"
    with pytest.raises(ContractError, match=message):
        run(tiny(tiny_checkpoint, tmp_path, 1, "run.backend=ray"))
    assert all_released()


def test_weights_by_broadcast_and_ipc_equal_local(tiny_checkpoint, tmp_path):
    """placement.weights on CPU pools: a gloo weight group of the actor host and the rollout
    host (the rollout and the evaluator both load through it), and shared-memory IPC handles,
    carry the local run's updates (and so the object store's: the default recipe's test)."""
    rows = {
        path: untimed(
            run(
                tiny(
                    tiny_checkpoint,
                    tmp_path / path,
                    1,
                    *([] if path == "local" else ["run.backend=ray", f"placement.weights={path}"]),
                ),
                RECIPE,
            )
        )  # fmt: skip
        for path in ("local", "broadcast", "ipc")
    }
    assert rows["local"][-1]["sync/version"] == 1 and "eval/overall" in rows["ipc"][-1]
    assert rows["broadcast"] == rows["local"] == rows["ipc"]
    assert all_released()


def test_weight_paths_resolve_where_the_hosts_are_or_refuse():
    """auto picks by where the hosts landed (node, GPU); a path that cannot run there is a
    ConfigError naming the key (the GPU cases with made-up UUIDs: CI has no GPU)."""
    from diffrl.backends.ray import _check_built, weight_path

    cfg = lambda *o: load_config(RECIPE, ["run.backend=ray", *o])  # noqa: E731
    cpu, gpu0, gpu1, far = ("n1", ""), ("n1", "GPU-0"), ("n1", "GPU-1"), ("n2", "")
    assert weight_path(cfg(), cpu, cpu) == "object_store"
    assert weight_path(cfg(), gpu0, gpu1) == "broadcast"
    assert weight_path(cfg(), gpu0, gpu0) == "ipc"  # fractional pools on one GPU
    assert weight_path(cfg("placement.weights=broadcast"), cpu, cpu) == "broadcast"  # gloo
    refused = [
        ("ipc", cpu, far, "different nodes"),
        ("ipc", gpu0, gpu1, "CUDA IPC needs the actor and the rollout on one GPU"),
        ("broadcast", gpu0, gpu0, "NCCL cannot run two ranks on one GPU"),
    ]
    for path, actor, rollout, message in refused:
        with pytest.raises(ConfigError, match=f"placement.weights' = '{path}'.*{message}"):
            weight_path(cfg(f"placement.weights={path}"), actor, rollout)
    with pytest.raises(ConfigError, match="both on GPUs"):
        _check_built(cfg("placement.weights=broadcast", "placement.actor.gpus=1"))


# --- placement and rollout replicas (backends/ray_placement.py, backends/ray_rollout.py) ------


def test_placement_groups_colocated_and_a_timeout(monkeypatch):
    """Colocated: rollout replica i and actor worker i on bundle i of one group, each with its
    own share; a pool that fits the cluster but not what is free now times out clearly."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from diffrl.backends.ray_placement import place
    from diffrl.placement import PlacementConfig, PoolConfig

    half = PoolConfig(cpus=0.5)
    p = place(PlacementConfig(rollout=half, actor=half, colocate=True), timeout=10)
    try:
        assert len(p.groups) == 1 and p.groups[0].bundle_specs == [{"CPU": 1.0}]
        for opts in (p.rollout[0], p.actor[0]):
            assert opts["num_cpus"] == 0.5
            assert opts["scheduling_strategy"].placement_group == p.groups[0]
            assert opts["scheduling_strategy"].placement_group_bundle_index == 0
        assert p.reward == {"num_cpus": 0, "num_gpus": 0}
    finally:
        p.remove()
    hold = placement_group([{"CPU": 2.0}])
    ray.get(hold.ready())
    try:
        with pytest.raises(ConfigError, match=r"rollout: 1 x \{'CPU': 1.0\}.*within 1 s"):
            place(PlacementConfig(), timeout=1)
    finally:
        remove_placement_group(hold)
    assert all_released()
