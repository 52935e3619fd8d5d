"""Checkpoints: atomic writes, a 'latest' pointer, pruning."""

from __future__ import annotations

import torch

from diffrl.actor.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint


def payload(step: int):
    g = torch.Generator().manual_seed(step)
    adapters = {
        "layer.lora_A.default.weight": torch.randn(4, 8, generator=g),
        "layer.lora_B.default.weight": torch.randn(8, 4, generator=g).t(),
    }  # non-contig
    actor_state = {
        "version": step,
        "gen": torch.Generator().manual_seed(1).get_state(),
        "optimizer": {
            "state": {0: {"exp_avg": torch.ones(3) * step}},
            "param_groups": [{"lr": 0.1, "params": [0]}],
        },
    }
    return adapters, actor_state, {"step": step, "wall_s": 1.5 * step}


def test_round_trip(tmp_path) -> None:
    adapters, actor_state, ctrl = payload(3)
    path = save_checkpoint(tmp_path, 3, adapters, actor_state, ctrl)
    assert path == tmp_path / "step_000003"
    assert latest_checkpoint(tmp_path) == path
    a2, s2, c2 = load_checkpoint(path)
    assert a2.keys() == adapters.keys()
    for k in adapters:
        assert torch.equal(a2[k], adapters[k])
    assert s2["version"] == 3 and torch.equal(s2["gen"], actor_state["gen"])
    assert torch.equal(s2["optimizer"]["state"][0]["exp_avg"], torch.ones(3) * 3)
    assert c2 == {"step": 3, "wall_s": 4.5}


def test_no_checkpoint(tmp_path) -> None:
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(tmp_path / "does_not_exist") is None


def test_leftover_tmp_from_a_kill_does_not_break_latest(tmp_path) -> None:
    save_checkpoint(tmp_path, 1, *payload(1))
    # simulate a kill while writing step 2: a half-written temp dir and a stray pointer temp
    tmp = tmp_path / ".tmp_step_000002"
    tmp.mkdir()
    (tmp / "adapters.safetensors").write_bytes(b"\x00garbage")
    (tmp_path / ".latest.tmp").write_text("step_000002")
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000001"
    assert load_checkpoint(latest_checkpoint(tmp_path))[2]["step"] == 1
    # the next save of step 2 replaces the leftovers cleanly
    path = save_checkpoint(tmp_path, 2, *payload(2))
    assert latest_checkpoint(tmp_path) == path
    assert load_checkpoint(path)[2]["step"] == 2
    assert not tmp.exists()


def test_latest_pointing_at_an_incomplete_dir_is_ignored(tmp_path) -> None:
    save_checkpoint(tmp_path, 1, *payload(1))
    (tmp_path / "step_000001" / "controller.json").unlink()
    assert latest_checkpoint(tmp_path) is None


def test_keep_prunes_oldest(tmp_path) -> None:
    for step in (1, 2, 3, 4):
        save_checkpoint(tmp_path, step, *payload(step), keep=2)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_000003", "step_000004"]
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000004"
    save_checkpoint(tmp_path, 5, *payload(5), keep=3)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == [
        "step_000003",
        "step_000004",
        "step_000005",
    ]


def test_resaving_a_step_overwrites_it(tmp_path) -> None:
    save_checkpoint(tmp_path, 2, *payload(2))
    adapters, state, _ = payload(7)
    save_checkpoint(tmp_path, 2, adapters, state, {"step": 2, "wall_s": 99.0})
    a, _, c = load_checkpoint(tmp_path / "step_000002")
    assert c["wall_s"] == 99.0
    assert torch.equal(a["layer.lora_A.default.weight"], adapters["layer.lora_A.default.weight"])


def test_pruning_never_deletes_the_checkpoint_just_written(tmp_path) -> None:
    for step in (4, 5):  # left by an earlier run in this directory
        save_checkpoint(tmp_path, step, *payload(step), keep=2)
    path = save_checkpoint(tmp_path, 1, *payload(1), keep=2)  # a fresh run's first save
    assert path.exists()
    assert latest_checkpoint(tmp_path) == path
