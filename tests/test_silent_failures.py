"""The seed's three silent failures, each injected on purpose into a real run on every tiny
family preset, must stop the run before or at its first step with an error that names the
cause (issue 37's "done when"). Start-up faults are caught while the engines are built; the
others within the first step."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest
import torch
from sync_faults import family_faults, no_op_apply
from tiny_runs import tiny_run

from diffrl.build import build
from diffrl.config import load_config
from diffrl.controller.loop import train
from diffrl.controller.run_dir import read_metrics
from diffrl.controller.sync import train_sync
from diffrl.errors import ContractError
from diffrl.models.registry import FAMILIES
from diffrl.reward.edges import PerSample
from diffrl.sync.bound import BoundModuleError
from diffrl.sync.weights import Slot, SlotMap, SyncError
from diffrl.tasks.base import PromptSet
from diffrl.types import PromptBatch, Trajectory

pytest.importorskip("diffusers")

# preset -> the overrides that shrink it to a CPU test ("" = the tiny DiT, default recipe)
PRESETS: dict[str, list[str]] = {
    "tiny_dit": [],
    "sd35-tiny": [],
    "flux1-tiny": [],
    "qwen-image-tiny": ["model.resolution=32"],
    "wan-tiny": ["model.resolution=32", "model.frames=9"],
    "ltx2-tiny": ["model.resolution=32", "model.frames=9", "model.max_text_len=16"],
    "h3-tiny": [],
}
SHAPES_DIT = Path(__file__).resolve().parents[1] / "diffrl" / "assets" / "shapes_dit.safetensors"


# Autoregressive families sample tokens: no time convention (contract 1) and no denoising
# rollout to inject these faults into. Their sync and token contracts have their own tests
# (tests/rollout/test_ar_rollout.py, tests/models/families/test_qwen_omni.py).
AUTOREGRESSIVE = {"qwen_omni"}


def test_every_family_has_a_tiny_preset_here() -> None:
    covered = {"tiny_dit"} | {FAMILIES_OF[p] for p in PRESETS if p != "tiny_dit"}
    assert covered == set(FAMILIES) - AUTOREGRESSIVE


FAMILIES_OF = {p: f.name for f in FAMILIES.values() for p in f.presets}


def config(preset: str, out: Path, *extra: str):
    if preset == "tiny_dit":
        return load_config(None, [*tiny_run(SHAPES_DIT, out, 1), "probe.mode=on", *extra])
    return load_config(
        None,
        [
            f"model.preset={preset}",
            *PRESETS[preset],
            "data.task=prompts",
            "data.prompts_per_step=1",
            "data.eval_prompts=1",
            "data.eval_samples_per_prompt=1",
            "rollout.group_size=2",
            "rollout.num_steps=2",
            "rollout.eval_num_steps=2",
            "reward.scorers=[{name: jpeg_incompressibility}]",
            "run.steps=1",
            "run.eval_every=1",
            "run.tensorboard=false",
            f"run.out_dir={out}",
            "run.name=run",
            *extra,
        ],
    )


def wrong_convention(preset: str) -> str:
    native = FAMILIES[FAMILIES_OF.get(preset, "tiny_dit")].native_convention
    return "data_progress" if native != "data_progress" else "sigma"


# --- start-up faults: caught while the engines are built -------------------------------------


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_wrong_convention_stops_at_start_up(preset, tmp_path):
    cfg = config(preset, tmp_path, f"model.convention={wrong_convention(preset)}")
    with pytest.raises(ContractError, match="convention"):
        build(cfg)
    assert not (tmp_path / "run").exists()


def _swapped_layouts(model, slot_map: SlotMap) -> dict[str, SlotMap]:
    """The family's own serving layout with Q and K exchanged in the first fused weight, and
    the first split module's two shards exchanged. A family whose rollout keeps its trained
    layout (the tiny DiT's one fused qkv) gets the same faults written as a re-layout of that
    weight's rows: Q's rows written where K's belong, and the MLP's two halves swapped."""
    faults = {
        "swapped_shards" if what.endswith(" shards") else "swapped_qk": bad
        for what, bad in family_faults(slot_map).items()
    }
    names = dict(model.named_modules())
    trained = [n for n in names if n.endswith(tuple(model.family.lora_targets))]
    if "swapped_qk" not in faults:  # the layout keeps the fused qkv as trained (tiny DiT)
        qkv = next(n for n in trained if n.endswith("attn.qkv"))
        d = names[qkv].weight.shape[0] // 3
        faults["swapped_qk"] = SlotMap(
            {qkv: [Slot(qkv, slice(0, d), slice(d, 2 * d)), Slot(qkv, slice(d, 2 * d), slice(0, d)),
                   Slot(qkv, slice(2 * d, 3 * d), slice(2 * d, 3 * d))]}
        )  # fmt: skip
    if "swapped_shards" not in faults:  # no split module: split an MLP weight's rows in two
        up = next(n for n in trained if n not in slot_map.slots and ("mlp" in n or ".ff" in n))
        h = names[up].weight.shape[0] // 2
        halves = [Slot(up, slice(0, h), slice(h, 2 * h)), Slot(up, slice(h, 2 * h), slice(0, h))]
        faults["swapped_shards"] = SlotMap({**slot_map.slots, up: halves})
    return faults


@pytest.mark.parametrize("fault", ["swapped_qk", "swapped_shards"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_swapped_serving_layout_stops_at_start_up(preset, fault, tmp_path, monkeypatch):
    cfg = config(preset, tmp_path, "probe.mode=off")
    cls = FAMILIES[FAMILIES_OF.get(preset, "tiny_dit")].family_class
    own = cls.serving_layout

    def broken(self, model):
        return _swapped_layouts(model, own(self, model))[fault]

    monkeypatch.setattr(cls, "serving_layout", broken)
    with pytest.raises(SyncError, match="wrong place"):
        build(cfg)
    assert not (tmp_path / "run").exists()


def test_the_unbroken_runs_make_their_first_step(tmp_path):
    """The control: the same tiny configs, probes on, train their first step."""
    for preset in sorted(PRESETS):
        torch.manual_seed(0)
        root = asyncio.run(train(config(preset, tmp_path / preset)))
        first = read_metrics(root)[0]
        assert first["probe/skipped"] == 0.0
        if preset == "tiny_dit":  # no pipeline: its trained weights decide on the task's data
            assert first["probe/cosine"] > 0.5 and first["probe/parity_worst"] is None
        else:  # parity ran (NaN is written as null)
            assert 0.0 <= first["probe/parity_worst"] < 1.0


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_lora_bound_to_nothing_stops_at_start_up(preset, tmp_path):
    cfg = config(preset, tmp_path, "probe.mode=off", "actor.lora.targets=[attn.to_nothing]")
    with pytest.raises(BoundModuleError, match=r"attn\.to_nothing"):
        build(cfg)
    assert not (tmp_path / "run").exists()


# --- faults of the first step ---------------------------------------------------------------


def _run(cfg, parts, trained: list[int]) -> None:
    """Train ``parts`` under ``cfg``, appending to ``trained`` at each actor update."""
    step = parts.actor.train_step
    parts.actor.train_step = lambda batch: trained.append(1) or step(batch)

    async def go():
        try:
            await train_sync(cfg, parts)
        finally:
            await parts.aclose()

    try:
        asyncio.run(go())
    finally:
        parts.actor.train_step = step


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_rollout_left_on_base_weights_stops_at_the_first_sync(preset, tmp_path):
    """The rollout's merge a no-op (its version moves, its weights do not): the sync after
    update 1 (the first that carries a change; peft's B starts at 0) raises before step 2
    samples with base weights."""
    cfg = config(
        preset, tmp_path, "probe.mode=off", "run.steps=2", "actor.lr=1e-2", "algorithm.old_every=1"
    )
    parts = build(cfg)
    parts.rollout.target.apply = no_op_apply
    trained: list[int] = []
    with pytest.raises(SyncError, match="still on its base weights"):
        _run(cfg, parts, trained)
    assert len(trained) == 1  # stopped at the sync after update 1


def _one_id_changed(ids: torch.Tensor) -> torch.Tensor:
    out = ids.clone()
    out[-1, 0] = out[-1, 0] + 1  # as a tokenizer with another vocabulary would give
    return out


@pytest.mark.parametrize("where", ["rollout engine", "actor"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_a_retokenised_prompt_stops_the_first_step(preset, where, tmp_path, monkeypatch):
    """The data stage's ids changed on their way to the rollout (re-tokenised, the hashes
    kept), or in the channel between the rollout and the actor: the run stops at its first
    step, naming token drift and where, with nothing trained. (A changed conditioning frame,
    for the family that takes frames: tests/controller/test_av_fl2va_loop.py.)"""
    if where == "rollout engine":
        batch = PromptSet.batch

        def retokenised(self, index) -> PromptBatch:
            b = batch(self, index)
            return dataclasses.replace(b, input_ids=_one_id_changed(b.input_ids))

        monkeypatch.setattr(PromptSet, "batch", retokenised)
    else:
        put = PerSample.put  # the rollout -> reward edge, a micro-batch at a time

        async def drifting(self, record, version):
            if isinstance(record, Trajectory):
                ids = _one_id_changed(record.prompts.input_ids)
                prompts = dataclasses.replace(record.prompts, input_ids=ids)
                record = dataclasses.replace(record, prompts=prompts)
            await put(self, record, version)

        monkeypatch.setattr(PerSample, "put", drifting)
    cfg = config(preset, tmp_path, "probe.mode=off", "run.steps=2")
    with pytest.raises(ContractError, match=f"token drift at the {where}: input_ids"):
        asyncio.run(train(cfg))
    assert not list((tmp_path / "run" / "checkpoints").glob("step_*"))
