"""The actor as a torch.distributed group of Ray workers (``placement.actor.replicas=2``,
``backends/ray_actor_group.py``) on a local Ray instance with 2 CPUs and gloo: a tiny run
reports every metric as a torchrun launch of the same layout does, bit for bit (rewards and
evals also the one-process run's); async mode keeps its bound; a worker that fails to build
stops the run with its own error; each data-parallel rank gets a torchrun rank's rows, whole
batches and streamed parts alike; the layouts the group does not run are refused."""

from __future__ import annotations

import asyncio
import dataclasses
import os

import pytest
import torch
from gloo_ranks import free_port, run_ranks
from ray_runs import PARTIAL, RECIPE, all_released, local_ray, run, untimed  # noqa: F401
from tiny_runs import tiny_run

from diffrl.backends import build_engines
from diffrl.config import load_config
from diffrl.controller.run_dir import read_metrics
from diffrl.errors import ConfigError, ContractError, DiffrlError

ray = pytest.importorskip("ray")

UPDATE = ("actor/loss", "actor/grad_norm")
GROUP = ["run.backend=ray", "placement.actor.replicas=2", "placement.actor.cpus=0"]


def tiny(checkpoint, out, steps, *extra):
    # shared_noise: a row's training draws follow its prompt group, not the rank or the
    # micro-batch that trains it (as in the torchrun dp tests)
    # one thread: the one-process run runs in this process, whose thread count an earlier
    # test may have set
    over = ["rollout.num_steps=2", "actor.lr=1e-2", "run.eval_every=1", PARTIAL, "run.threads=1"]
    return tiny_run(checkpoint, out, steps, *over, "algorithm.shared_noise=true", *extra)


def _torchrun_rank(rank: int, world: int, port: int, over: list[str]) -> None:
    """One rank of ``torchrun --nproc-per-node 2 -m diffrl.cli train`` on the local backend."""
    from diffrl.build import build
    from diffrl.controller.sync import train_sync

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )  # fmt: skip
    cfg = load_config(RECIPE, over)
    parts = build(cfg)
    asyncio.run(train_sync(cfg, parts))
    asyncio.run(parts.aclose())


def test_a_group_of_two_trains_as_the_local_backend(tiny_checkpoint, tmp_path):
    """Staleness 0 (sync), against the local backend: every metric of the group (losses,
    grad norms, rewards, evals, sync receipts) equals bit for bit a torchrun launch of the
    same layout (2 gloo ranks, data parallel), and its rewards and evals equal the
    one-process run's. A micro-batch of the rollout is one prompt group
    (``rollout.max_batch`` = group size), so the torchrun ranks' rollouts cut their shares
    as the one rollout host cuts the step. (The one-process update differs in the last bits:
    it sums every row's gradient in one pass, the ranks sum their own and all-reduce.) Async
    at max_staleness=1 stays within its bound on the group."""
    mb = "rollout.max_batch=4"  # tiny_run's group size
    torchrun_dir = tmp_path / "torchrun"
    over = tiny(tiny_checkpoint, torchrun_dir, 2, mb)
    run_ranks(_torchrun_rank, 2, (2, free_port(), over), 180.0)
    torchrun = read_metrics(torchrun_dir / "shapes_nft")
    group = run(tiny(tiny_checkpoint, tmp_path / "group", 2, mb, *GROUP), RECIPE)
    local = run(tiny(tiny_checkpoint, tmp_path / "local", 2, mb), RECIPE)
    assert [r["step"] for r in group] == [0, 1, 2]
    assert untimed(group) == untimed(torchrun)
    for one, two in zip(local, group, strict=True):
        # step 2's update is on weights one Adam step old, whose normalised first step turns
        # rounding-level gradient differences into lr-sized ones (docs/parallel.md)
        rel = 1e-4 if one["step"] < 2 else 5e-3
        for k in one:
            if k.startswith(("reward/", "eval/")):
                assert two[k] == one[k], k
            elif k in UPDATE:
                assert two[k] == pytest.approx(one[k], rel=rel), (one["step"], k)
    assert group[2]["actor/grad_norm"] > 0
    over = [*GROUP, "run.mode=async", "run.max_staleness=1"]
    asynced = run(tiny(tiny_checkpoint, tmp_path / "async", 2, *over), RECIPE)
    assert [r["step"] for r in asynced] == [0, 1, 2]
    assert max(r["async/staleness_max"] for r in asynced[1:]) <= 1
    assert asynced[-1]["actor/grad_norm"] > 0
    assert all_released()


def test_rank_metrics_merge_as_torchrun_reduces_them():
    """The group's metric merge is ``Ranks.mean``'s rule: a float64 mean, "*_max" the largest."""
    from diffrl.parallel.launch import merge_rank_metrics

    a = {"actor/loss": 1.0000001, "check/logp_gap_max": 0.5, "nft/r_mean": 0.25}
    b = {"actor/loss": 1.0000002, "check/logp_gap_max": 0.75, "nft/r_mean": 0.25}
    out = merge_rank_metrics([a, b])
    assert out == {"actor/loss": (1.0000001 + 1.0000002) / 2, "check/logp_gap_max": 0.75,
                   "nft/r_mean": 0.25}  # fmt: skip


def test_a_worker_that_fails_to_build_raises_its_own_error(tiny_checkpoint, tmp_path):
    """Rank 1 fails while rank 0 waits for it in the rendezvous: the run stops with rank 1's
    error at once, and the group is gone."""
    plugin = tmp_path / "rank1_fails.py"
    plugin.write_text(
        "import os\nfrom diffrl.errors import DiffrlError\n"
        "if os.environ.get('RANK') == '1':\n    raise DiffrlError('rank 1 cannot build')\n"
    )
    from diffrl.backends.ray_actor_group import start_group, worker_options

    over = tiny(tiny_checkpoint, tmp_path, 1, *GROUP, f"ray.imports=[{plugin}]")
    cfg = load_config(RECIPE, over)
    started: list = []  # the group alone: build_ray kills them as these lines do
    try:
        with pytest.raises(DiffrlError, match="rank 1 cannot build") as info:
            start_group(cfg, 1, worker_options(cfg), started)()
    finally:
        for worker in started:
            ray.kill(worker)
    assert len(started) == 2 and not isinstance(info.value, ray.exceptions.RayError)


def test_a_group_that_does_not_fit_is_a_config_error(tiny_checkpoint, tmp_path):
    """Each worker takes the pool's cpus: 2 workers of 1 CPU beside the rollout's 1 do not fit
    2 CPUs (unchecked, the second worker would wait for a CPU forever)."""
    over = ["run.backend=ray", "placement.actor.replicas=2", "placement.actor.cpus=1"]
    cfg = load_config(RECIPE, tiny(tiny_checkpoint, tmp_path, 1, *over))
    with pytest.raises(ConfigError, match=r"ask for 3 CPU.*placement.actor.cpus=1 x 2 replicas"):
        build_engines(cfg)
    assert all_released()


@pytest.mark.parametrize(
    "extra, key",
    [
        (["parallel.etp=2"], "parallel.etp"),
        (["parallel.tp=2"], "parallel.rollout"),
        (["actor.minibatches=2"], "actor.minibatches"),
    ],
)
def test_what_a_group_does_not_run_is_refused(extra, key, tiny_checkpoint, tmp_path):
    from diffrl.backends.ray_actor_group import check_group

    cfg = load_config(RECIPE, tiny(tiny_checkpoint, tmp_path, 1, *GROUP, *extra))
    with pytest.raises(ConfigError, match=rf"'{key}'"):
        check_group(cfg)


# --- the proxy's split and rounds, against recorded calls (no workers) ---------------------


class Recorded:
    """A ``RemoteActorGroup`` over 2 data-parallel ranks whose calls are recorded."""

    def __new__(cls, prompts: int, versions=(0, 0)):
        from diffrl.backends.ray_actor_group import RemoteActorGroup

        infos = [
            {"dp_rank": r, "dp_size": 2, "version": v, "eval_adapter": "default", "bound": None}
            for r, v in enumerate(versions)
        ]
        group = RemoteActorGroup([None, None], infos, prompts)
        group.calls = []

        def call(method, *args, each=None):
            group.calls.append((method, [args if each is None else each(r) for r in range(2)]))
            return [(({}, 1) if method == "end_stream" else {}) for _ in range(2)]

        group._call = call
        return group


def batch_of(groups: list[int], per: int = 2):
    """A train batch of ``per`` rows for each prompt of the step in ``groups``."""
    from tiny_models import make_train_batch

    group = torch.tensor(groups).repeat_interleave(per)
    return dataclasses.replace(make_train_batch(len(group)), group=group)


def test_each_dp_rank_gets_its_torchrun_slice():
    group = Recorded(prompts=4)
    batch = batch_of([0, 1, 2, 3])  # 2 rows per prompt; rank 0 holds prompts 0-1
    assert group.rows(batch, 0).tolist() == [0, 1, 2, 3]
    assert group.rows(batch, 1).tolist() == [4, 5, 6, 7]
    filtered = batch.select(torch.tensor([0, 1, 6, 7]))  # prompts 1 and 2 dropped
    assert group.rows(filtered, 0).tolist() == [0, 1]
    assert group.rows(filtered, 1).tolist() == [2, 3]
    with pytest.raises(DiffrlError, match="prompt group 5"):
        group.rows(batch_of([5]), 0)


def test_streamed_parts_train_in_rounds_as_torchrun_ranks_do():
    """Parts arrive prompt by prompt (rank 0's two, then rank 1's two): each round trains the
    k-th part of every rank together; one rank's leftovers meet an empty part."""
    group = Recorded(prompts=4)
    group.begin_stream(8)
    for p in range(4):
        group.train_part(batch_of([p]))
    rounds = [c for c in group.calls if c[0] == "train_part"]
    groups = [[a[0].group.unique().tolist() for a in args] for _, args in rounds]
    assert groups == [[[0], [2]], [[1], [3]]]
    assert [c[0] for c in group.calls].count("diagnostics") == 1  # on the first part only
    group.calls.clear()
    group.begin_stream(8)
    group.train_part(batch_of([0, 1]))  # rank 1's prompts filtered out
    group.end_stream()
    ((_, args),) = [c for c in group.calls if c[0] == "train_part"]
    assert len(args[0][0]) == 4 and len(args[1][0]) == 0


def test_ranks_that_disagree_on_their_version_are_a_contract_error():
    with pytest.raises(ContractError, match=r"disagree on their version: \[0, 1\]"):
        Recorded(prompts=2, versions=(0, 1))
