"""``diffrl plan`` for the audio-video families beyond H3's FL2VA (diffrl/parallel/plan.py):
LTX-2's two token streams against autograd's saved tensors of its real block and against what
one H200 measured, the tokens both families plan for each task's conditions (T2VA, I2AV,
FL2VA, Ref2VA) against those their nets build.

Calibration (one H200, bf16, random weights, 2026-12-01; ``python benchmarks/real_size_omni.py
--presets ltx2``, log in benchmarks/sweeps/2026-12-01-real-size-families/): LTX-2 T2VA at real
size (18.88 B), 121 frames of 512 x 512 + audio, 2 clips (2 prompts x 1, here 1 x 2), 4 ODE
steps, then one DiffusionNFT LoRA r=32 step, one timestep per sample, micro-batch 1,
checkpointing, one copy of the DiT (``share_model``), Gemma-3-12B on the GPU: peaks
(``torch.cuda.max_memory_allocated``) 70.25 GiB in the encode, 70.18 in the rollout, 73.02 in
the step. The plan says 69.2 (-1.5%; it encodes 1 prompt where the run encoded 2, 0.45 GiB
each), 69.8 (-0.5%) and 74.3 (+1.7%).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("diffusers")

from diffrl.models.families import ltx2  # noqa: E402
from diffrl.models.families.ltx2 import ltx2_rope, ltx2_text_token, ltx2_token  # noqa: E402
from diffrl.models.memory import Widths  # noqa: E402

LTX2_MEASURED_GIB = {"encode": 70.25, "rollout": 70.18, "train": 73.02}
LTX2_CALIBRATION = [
    "data.prompts_per_step=1",  # the measured 2 clips, as 1 prompt x 2 (a group of one trains
    "rollout.group_size=2",  # nothing); the recipe's own rollout.max_batch=2 batches them
    "actor.micro_batch=1",
    "algorithm.timesteps_per_sample=1",
    "rollout.share_base=false",  # the measured run held one copy (share_model), no factors
]


def test_ltx2_plan_matches_the_h200() -> None:
    from diffrl.config import load_config
    from diffrl.parallel.plan import PlanOptions, plan

    cfg = load_config("recipes/ltx2_t2va_nft.yaml", LTX2_CALIBRATION)
    p = plan(cfg, PlanOptions(share_rollout=True, eval_copy=False))  # one copy, no evaluator
    assert "4,096 video (0 keyframe) + 126 audio tokens, 1024 text" in p.title
    for phase, gib in LTX2_MEASURED_GIB.items():
        assert abs(p.phase(phase) / gib - 1) < 0.03, (phase, p.table())
    assert p.peak[0] == "train"


def _ltx2_block_saved(per_token_t: bool, n: tuple[int, int, int], rank: int) -> int:
    """Bytes autograd keeps for one forward of the tiny preset's block under peft LoRA on the
    family's targets (fp32 adapters), weights left out. The block is the model's own, called by
    the model's own forward (its RoPE tables, adaLN tables and masks as the model makes them);
    its inputs require grad, as every block's but the first do in training."""
    from diffusers import LTX2VideoTransformer3DModel
    from peft import LoraConfig, get_peft_model

    frames, side, n_audio, n_text = 3, 5, n[1], n[2]
    cfg = {**ltx2.PRESETS["ltx2-tiny"]["transformer"], "num_layers": 1}
    torch.manual_seed(0)
    tf = LTX2VideoTransformer3DModel(**cfg).to(torch.bfloat16)
    model = get_peft_model(tf, LoraConfig(r=rank, target_modules=list(ltx2.LORA_TARGETS)))
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    block = tf.transformer_blocks[0]
    forward = block.forward

    def hooked(**kw):
        for k in ("hidden_states", "audio_hidden_states"):
            kw[k] = kw[k].detach().requires_grad_()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return forward(**kw)

    block.forward = hooked
    b, n_video = 1, frames * side * side
    assert n_video == n[0]
    t = torch.full((b,), 500.0)
    text = torch.randn(b, n_text, cfg["caption_channels"], dtype=torch.bfloat16)
    tf(
        hidden_states=torch.randn(b, n_video, cfg["in_channels"], dtype=torch.bfloat16),
        audio_hidden_states=torch.randn(b, n_audio, cfg["audio_in_channels"]).bfloat16(),
        encoder_hidden_states=text,
        audio_encoder_hidden_states=text,
        timestep=t[:, None].expand(b, n_video) if per_token_t else t,
        audio_timestep=t,
        sigma=t,
        encoder_attention_mask=torch.ones(b, n_text),
        audio_encoder_attention_mask=torch.ones(b, n_text),
        num_frames=frames,
        height=side,
        width=side,
        audio_num_frames=n_audio,
        use_cross_timestep=True,
        return_dict=False,
    )
    return sum(nbytes for ptr, nbytes in kept.items() if ptr not in weights)


@pytest.mark.parametrize("per_token_t", [False, True], ids=["t2va", "frame-conditioned"])
def test_ltx2_block_formula_matches_autograd(per_token_t: bool) -> None:
    """Per video, audio and text token, on the CPU (rms=4: nn.RMSNorm's composite path keeps
    an fp32 copy); a frame condition's per-token timesteps add the per-token adaLN tables."""
    c = ltx2.PRESETS["ltx2-tiny"]["transformer"]
    rank, n = 4, (75, 7, 11)  # odd counts: no token count equals a width
    h, h_a = c["num_attention_heads"] * c["attention_head_dim"], 16
    w = Widths(h=h, a=h, f=4 * h, heads=c["num_attention_heads"], r=rank, rms=4)
    wa = dataclasses.replace(w, h=h_a, a=h_a, f=4 * h_a, heads=c["audio_num_attention_heads"])
    ax, heads_x = h_a, c["audio_num_attention_heads"]
    video = ltx2_token(w, ax, heads_x) + ltx2_rope(w, ax) + (16 * h if per_token_t else 0)
    audio = ltx2_token(wa, ax, heads_x) + ltx2_rope(wa, ax)
    want = n[0] * video + n[1] * audio + n[2] * (ltx2_text_token(w) + ltx2_text_token(wa))
    got = _ltx2_block_saved(per_token_t, n, rank)
    assert got / want == pytest.approx(1, abs=0.01), (got, want)


@pytest.mark.parametrize("task_name", ["avbench", "avbench_fl2va", "avbench_ref2va"])
def test_h3_planned_rows_are_the_packed_sequence(task_name: str) -> None:
    """The rows H3's geometry plans for a task's conditions (asked of the task as ``diffrl
    plan`` asks: ``condition_keys``) are the packed sequence the net builds for a tiny batch
    of them: Ref2VA's reference image and soundtrack, FL2VA's two keyframes, T2VA's none. The
    plan counts the longest prompt's text (``max_text_len``); the net packs each prompt's own."""
    from diffrl.build import prompt_set
    from diffrl.models.families import minimax_h3
    from diffrl.models.registry import ModelConfig, load_model
    from diffrl.parallel.plan import condition_keys
    from diffrl.tasks import build_task
    from diffrl.tasks.base import TaskConfig

    torch.manual_seed(0)
    model = load_model(ModelConfig(preset="h3-avbench"))
    task = build_task(TaskConfig(task=task_name))
    keys = condition_keys(task, model.family)
    assert ("ref_image" in keys) == (task_name == "avbench_ref2va")
    pset = prompt_set(task, model, task.prompts("train")[:1])
    seen: dict[str, torch.Tensor] = {}
    forward = model.net.transformer.forward

    def spy(**kw):
        seen.update(kw)
        return forward(**kw)

    model.net.transformer.forward = spy
    with torch.no_grad():
        model(torch.randn(1, *model.family.latent_shape()), torch.tensor([0.5]),
              pset.input_ids, cond=pset.cond)  # fmt: skip
    packed = seen["position_ids"].shape[0]
    text = int((pset.input_ids != model.net.pad_id).sum())
    # with h = 1, a block's inputs (2h bytes a row) are 2 bytes a row
    one = Widths(h=1, a=1, f=1, heads=1, r=1, rms=2)
    geo = minimax_h3.geometry(model, one, keys)
    rows = geo.blocks[0].inputs / 2
    assert rows - model.family.max_text_len == packed - text, geo.tokens


@pytest.mark.parametrize("task_name", ["avbench", "avbench_i2av", "avbench_fl2va"])
def test_ltx2_planned_tokens_are_the_transformers(task_name: str) -> None:
    """The tokens LTX-2's geometry plans for a task's conditions are those the transformer
    reads for a tiny batch of them: FL2VA's appended keyframe, and per-token timesteps (the
    per-token adaLN tables) wherever a first frame is held."""
    from diffrl.build import prompt_set
    from diffrl.models.registry import ModelConfig, load_model
    from diffrl.parallel.plan import condition_keys
    from diffrl.tasks import build_task
    from diffrl.tasks.base import TaskConfig

    torch.manual_seed(0)
    model = load_model(ModelConfig(preset="ltx2-tiny", frames=11))  # AVBench: 10 frames or more
    task = build_task(TaskConfig(task=task_name))
    keys = condition_keys(task, model.family)
    pset = prompt_set(task, model, task.prompts("train")[:1])
    seen: dict[str, torch.Tensor] = {}
    forward = model.net.transformer.forward

    def spy(**kw):
        seen.update(kw)
        return forward(**kw)

    model.net.transformer.forward = spy
    with torch.no_grad():
        model(torch.randn(1, *model.family.latent_shape()), torch.tensor([0.5]),
              pset.input_ids, cond=pset.cond)  # fmt: skip
    n_video, n_cond, n_audio, n_text = ltx2.ltx2_tokens(model, keys)
    assert seen["hidden_states"].shape[1] == n_video
    assert (n_cond > 0) == (task_name == "avbench_fl2va")
    assert seen["audio_hidden_states"].shape[1] == n_audio
    assert seen["encoder_hidden_states"].shape[1] == n_text  # padded to max_text_len
    assert (seen["timestep"].ndim == 2) == ("first_frame" in keys)  # per-token timesteps


def test_condition_keys_refuse_as_the_data_stage_would() -> None:
    """A text-only task has none; a geometry the task cannot render and a family that takes
    no conditions are one-line ConfigErrors naming them (``diffrl train`` fails there too)."""
    from types import SimpleNamespace

    from diffrl.errors import ConfigError
    from diffrl.parallel.plan import condition_keys
    from diffrl.tasks import build_task
    from diffrl.tasks.base import TaskConfig

    geometry = dict(frames=9, size=32, fps=24.0, sample_rate=16000)  # AVBench: 10 frames or more
    fam = SimpleNamespace(name="ltx2", media_geometry=lambda: geometry)
    assert condition_keys(build_task(TaskConfig(task="avbench")), fam) == frozenset()
    fl2va = build_task(TaskConfig(task="avbench_fl2va"))
    with pytest.raises(ConfigError, match="'avbench_fl2va' at the model's .*frames >= 10"):
        condition_keys(fl2va, fam)
    with pytest.raises(ConfigError, match="family 'sd3' takes no conditions"):
        condition_keys(fl2va, SimpleNamespace(name="sd3"))
