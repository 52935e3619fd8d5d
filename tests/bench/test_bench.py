"""``diffrl bench``: the three kinds run on a tiny recipe and report consistent figures, each
against its in-process baseline; the baseline update is the run's (exactly in fp32, under bf16
autocast for a bf16 run); the FLOP model follows the algorithm; bad kinds are refused."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from tiny_runs import tiny_run

from diffrl.algorithms.registry import get_algorithm
from diffrl.bench import mfu as B
from diffrl.build import build
from diffrl.cli import main
from diffrl.config import load_config
from diffrl.controller.step import rollout_and_score
from diffrl.errors import ConfigError
from diffrl.models.registry import load_model


def cfg_for(tiny_checkpoint, tmp_path, *extra):
    over = tiny_run(tiny_checkpoint, tmp_path, 1, "rollout.num_steps=3", *extra)
    return load_config("recipes/shapes_nft.yaml", over)


@pytest.mark.parametrize("kind", ("rollout", "train", "epoch"))
def test_each_kind_reports_consistent_figures(kind, tiny_checkpoint, tmp_path) -> None:
    cfg = cfg_for(tiny_checkpoint, tmp_path)
    r = B.bench(kind, cfg, repeats=1)
    rows = r.rows()
    n = cfg.data.prompts_per_step * cfg.rollout.group_size
    assert r.samples == n and r.seconds > 0 and r.peak_flops > 0
    # the FLOPs are the family's analytic count times the forwards the work ran: 3 sampler
    # steps (no CFG) per rollout sample; NFT's old, forward and backward per trained timestep
    assert cfg.rollout.cfg_scale == 1 and cfg.algorithm.kl_coef == 0
    family_fwd = load_model(cfg.model, torch.device("cpu")).family.flops(1)
    per_sample = {"rollout": 3, "train": 3 * cfg.algorithm.timesteps_per_sample}
    per_sample["epoch"] = per_sample["rollout"] + per_sample["train"]
    assert r.flops == pytest.approx(n * per_sample[kind] * family_fwd)
    assert rows[f"bench/{kind}/samples_per_s"] == pytest.approx(n / r.seconds)
    assert 0 < rows[f"bench/{kind}/mfu"] < 1
    if kind != "train":
        assert rows[f"bench/{kind}/step_latency_s"] == pytest.approx(r.seconds / 3)
    # every kind has its in-process baseline: the plain loop, the diffusers-style update, both
    assert rows[f"bench/{kind}/speedup"] == pytest.approx(r.baseline_seconds / r.seconds)
    assert rows[f"bench/{kind}/baseline_samples_per_s"] == pytest.approx(n / r.baseline_seconds)
    assert not B.bench(kind, cfg, repeats=1, baseline=False).rows().keys() & {
        f"bench/{kind}/speedup",
        f"bench/{kind}/baseline_samples_per_s",
    }


def scored_batch(cfg):
    parts = build(cfg)
    scored = asyncio.run(rollout_and_score(parts, 0))[0]
    return parts, parts.algorithm.prepare(scored, cfg.algorithm)


def sd35_tiny_grpo(tmp_path, *extra):
    """The SD3.5 FlowGRPO recipe on the sd35-tiny preset (random weights), CPU-sized."""
    over = [
        'model.path=""', "model.preset=sd35-tiny", "model.resolution=64", "run.device=cpu",
        "reward.scorers=[{name: jpeg_incompressibility}]", "data.prompts_per_step=2",
        "rollout.group_size=2", "rollout.num_steps=3", "actor.micro_batch=2",
        f"run.out_dir={tmp_path}", "run.tensorboard=false", *extra,
    ]  # fmt: skip
    return load_config("recipes/sd35_grpo.yaml", over)


@pytest.mark.parametrize("recipe", ["tiny_dit_nft", "sd35_tiny_grpo"])
def test_the_baseline_takes_the_runs_update(recipe, tiny_checkpoint, tmp_path) -> None:
    """In fp32 the baseline (its own fp32 copy, eager, no autocast) is the run's update: the
    same losses, KL, gradient norms and adapters over two steps, to float rounding (1e-6, or
    1e-9 absolute: a clipped GRPO objective at ratio 1 is about 0). NFT runs its old and
    reference forwards; FlowGRPO, on a random SD3.5 preset (the baseline's fresh copy draws
    other weights until the run's are copied in, and shares the run's text encoders), its CFG
    forwards and the reference."""
    if recipe == "tiny_dit_nft":
        cfg, kl = cfg_for(tiny_checkpoint, tmp_path, "algorithm.kl_coef=0.1"), "nft/kl"
    else:
        cfg, kl = sd35_tiny_grpo(tmp_path, "model.dtype=float32"), "grpo/kl"
    parts, batch = scored_batch(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # adapters off zero, each its own: a KL, old != default, a gradient
        for name, p in parts.actor.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    base = B.baseline_actor(parts)
    run_weights = {id(p) for p in parts.actor.model.parameters()}
    assert not run_weights & {id(p) for p in base.model.parameters()}  # its own copy
    for step in range(2):  # the second with the optimizer's state
        got, want = base.train_step(batch), parts.actor.train_step(batch)
        for key in ("actor/loss", "actor/grad_norm", kl):
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), (step, key)
    assert want[kl] > 0 and want["actor/grad_norm"] > 0
    after, run_after = base.adapter_tensors(), parts.actor.adapter_tensors()
    for name, t in run_after.items():
        torch.testing.assert_close(after[name], t, rtol=1e-6, atol=1e-7)


def test_a_bf16_runs_baseline_trains_fp32_weights_under_autocast(tiny_checkpoint, tmp_path):
    """bf16 run: the baseline keeps fp32 weights (the run's bf16 values) and its matmuls run in
    bf16 under autocast; its loss is the run's within bf16 rounding (0.5%)."""
    cfg = cfg_for(tiny_checkpoint, tmp_path, "model.dtype=bfloat16")
    parts, batch = scored_batch(cfg)
    with torch.no_grad():  # masters off their bf16 rounding: the baseline must take them
        for m in parts.actor.masters.values():
            m.add_(1e-4)
    base = B.baseline_actor(parts)
    assert {p.dtype for p in base.model.parameters()} == {torch.float32}
    assert parts.actor.masters
    for name, t in parts.actor.adapter_tensors().items():
        assert torch.equal(base.adapter_tensors()[name], t), name
    seen = []
    layer = next(iter(base.layers.values())).base_layer
    layer.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype))
    got, want = base.train_step(batch), parts.actor.train_step(batch)
    assert seen and set(seen) == {torch.bfloat16}
    assert got["actor/loss"] == pytest.approx(want["actor/loss"], rel=5e-3)


def passes(cfg, batch) -> float:
    """Forward-equivalents per trained sample, as the algorithm declares them."""
    return get_algorithm(cfg.algorithm.name).train_cost(cfg.algorithm, batch).passes


def test_flop_model_follows_the_algorithm(tiny_checkpoint, tmp_path) -> None:
    nft = cfg_for(
        tiny_checkpoint, tmp_path, "algorithm.timesteps_per_sample=2", "algorithm.kl_coef=0.1"
    )
    assert passes(nft, None) == 2 * 4  # old, fwd, bwd, KL reference
    cost = get_algorithm("diffusion_nft").train_cost(nft.algorithm, None)
    assert (cost.forwards, cost.backwards) == (2 * 3, 2)
    dpo = get_algorithm("diffusion_dpo")
    assert dpo.train_cost(dpo.config_cls(timesteps_per_pair=3), None).passes == 3 * 3  # + ref
    grpo = load_config("recipes/shapes_grpo.yaml", tiny_run(tiny_checkpoint, tmp_path, 1))

    class Batch:
        sde_mask = torch.tensor([True] * 5 + [False] * 5)
        step_spec = SimpleNamespace(cfg_scale=1.0)

    k = max(1, round(grpo.algorithm.timestep_fraction * 5))
    kl = 1 if grpo.algorithm.kl_coef > 0 else 0
    assert passes(grpo, Batch()) == k * (2 + kl)
    Batch.step_spec = SimpleNamespace(cfg_scale=4.5)  # both CFG branches in every pass
    assert passes(grpo, Batch()) == 2 * k * (2 + kl)


def test_train_forward_count_matches_torchs_counter_on_a_cfg_update(tmp_path) -> None:
    """The FlowGRPO update on a CFG rollout (sd35-tiny, KL on), counted by torch's
    FlopCounterMode with SDPA on its math path (attention's matmuls counted, backward
    included), in forwards of the same model counted the same way: the analytic count of
    forward-equivalents (forward, input-gradient backward and the KL reference, x2 for CFG's
    branches) is within 20% below it. The count is a floor by design: attention's backward is
    two forwards' worth, and the LoRA factors' own gradients and the pre-update diagnostics are
    left out; forgetting CFG's branches halves it. (The forward's own analytic count is checked
    at real size in tests/models/test_flops.py: at 64 px the per-sample layers dominate.)"""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    cfg = sd35_tiny_grpo(tmp_path, "model.dtype=float32", "algorithm.kl_coef=0.04")
    parts, batch = scored_batch(cfg)
    assert batch.step_spec.cfg_scale > 1 and parts.actor.cfg.micro_batch < len(batch)
    model = parts.actor.model
    one, update = FlopCounterMode(display=False), FlopCounterMode(display=False)
    x = torch.randn(2, *model.family.latent_shape())
    with sdpa_kernel(SDPBackend.MATH):
        with torch.no_grad(), one:
            model(x, torch.full((2,), 0.5), batch.input_ids[:2])
        with update:
            parts.actor.train_step(batch)
    per_row = one.get_total_flops() / 2
    analytic = len(batch) * passes(cfg, batch) * per_row
    ratio = analytic / update.get_total_flops()
    assert 0.8 < ratio <= 1.0, ratio


def test_cli_and_bad_kind(tiny_checkpoint, tmp_path, capsys) -> None:
    over = tiny_run(tiny_checkpoint, tmp_path, 1, "rollout.num_steps=2")
    assert main(["bench", "train", "recipes/shapes_nft.yaml", *over, "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "bench/train/samples_per_s" in out and "bench/train/mfu" in out
    assert "bench/train/speedup" in out
    assert main(["bench", "train", *over, "--repeats", "1", "--no-baseline"]) == 0
    assert "speedup" not in capsys.readouterr().out
    with pytest.raises(ConfigError, match="kind"):
        B.bench("sample", cfg_for(tiny_checkpoint, tmp_path))
    with pytest.raises(ConfigError, match="repeats"):
        B.bench("train", cfg_for(tiny_checkpoint, tmp_path), repeats=0)


def test_profile_writes_time_by_kernel_kind(tiny_checkpoint, tmp_path, capsys) -> None:
    over = tiny_run(tiny_checkpoint, tmp_path, 1, "rollout.num_steps=2")
    out = tmp_path / "profile.txt"
    # the update: on a CPU the profile sees the calling thread's operators only (the rollout's
    # run in a worker thread); on a GPU it sees every kernel
    args = ["bench", "train", *over, "--repeats", "1", "--no-baseline", "--profile", str(out)]
    assert main(args) == 0
    text = out.read_text()
    assert "operator calls" in text and "share  kind" in text
    shares = [float(line.split("%")[0]) for line in text.split("share  kind")[1].split("\n\n")[0]
              .strip().splitlines()]  # fmt: skip
    assert sum(shares) == pytest.approx(100, abs=0.5)
    assert "matmul" in text  # the DiT's linear layers


def test_kernel_kinds() -> None:
    assert B.kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64") == "matmul"
    assert B.kernel_kind("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NNT") == "matmul"
    assert B.kernel_kind("flash_fwd_kernel") == "attention"
    assert B.kernel_kind("triton_poi_fused_add_mul_0") == "compiled (triton)"
    assert B.kernel_kind("void at::native::vectorized_elementwise_kernel<4, ...>") == "elementwise"
    assert B.kernel_kind("Memcpy DtoD (Device -> Device)") == "copy/cast"
    assert B.kernel_kind("aten::addmm") == "matmul"


def test_the_epoch_reports_its_parts_and_the_baselines(tiny_checkpoint, tmp_path) -> None:
    r = B.bench("epoch", cfg_for(tiny_checkpoint, tmp_path), repeats=1)
    rows = r.rows()
    parts = [rows[f"bench/epoch/{p}_seconds"] for p in ("rollout", "update")]
    assert all(p > 0 for p in parts) and sum(parts) <= r.seconds * 1.05 + 1e-3
    base = [rows[f"bench/epoch/baseline_{p}_seconds"] for p in ("rollout", "score", "update")]
    assert sum(base) == pytest.approx(r.baseline_seconds)


def test_hardware_flops_count_the_recompute(tmp_path) -> None:
    """Under actor.activation_checkpointing every backward reruns its forward: hardware FLOPs
    are the model FLOPs plus one forward per backward (``train_flops``). Counted by torch as in
    the test above (forwards of the actor's own model, LoRA included, as the unit), the
    hardware count is within 20% below the checkpointed update's, as the model count is below
    the plain one's; the model count alone would fall further short by the recompute."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from diffrl.controller.flops import train_flops

    cfg = sd35_tiny_grpo(
        tmp_path, "model.dtype=float32", "algorithm.kl_coef=0.04",
        "actor.activation_checkpointing=true",
    )  # fmt: skip
    parts, batch = scored_batch(cfg)
    model = parts.actor.model
    one, update = FlopCounterMode(display=False), FlopCounterMode(display=False)
    x = torch.randn(2, *model.family.latent_shape())
    with sdpa_kernel(SDPBackend.MATH):
        with torch.no_grad(), one:
            model(x, torch.full((2,), 0.5), batch.input_ids[:2])
        with update:
            parts.actor.train_step(batch)
    per_row, counted = one.get_total_flops() / 2, update.get_total_flops()
    cost = parts.algorithm.train_cost(cfg.algorithm, batch)
    fam = model.family
    plain, hw = train_flops(fam, parts.algorithm, cfg.algorithm, batch, checkpointing=True)
    assert hw - plain == cost.backwards * fam.flops(len(batch), batch.input_ids)
    assert 0.8 < len(batch) * (cost.passes + cost.backwards) * per_row / counted <= 1.0
    assert len(batch) * cost.passes * per_row / counted < 0.8


def test_pipeline_counts_every_stage(tmp_path) -> None:
    """``diffrl bench pipeline`` on SD3.5 (tiny, CFG 4.5, FlowGRPO): every stage timed and
    counted. The text encoders (CLIP-L, CLIP-G, T5) on the step's prompts and the VAE decode
    on every sample, each as torch's counter counts one row of it; the rollout as one guided
    call of the rollout's model (both CFG branches, counted) at each sampler step; the update
    as the algorithm's forward-equivalents; JPEG compressibility has no matmul. The whole
    step's MFU is the FLOPs of the stages over the epoch plus its encodes."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    from diffrl.rollout.samplers import guided_velocity

    cfg = sd35_tiny_grpo(tmp_path, "model.dtype=float32")
    parts = build(cfg)
    r = B.pipeline(parts, repeats=1, peak=B.matmul_rate(parts.device, torch.float32))
    rows = r.rows()
    model, prompts = parts.rollout.model, parts.prompts.at(0)
    n = len(prompts) * cfg.rollout.group_size

    def count(fn) -> float:
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as c:
            fn()
        return c.get_total_flops()

    ids = prompts.input_ids
    x = torch.randn(n, *model.family.latent_shape())
    sigma = torch.full((n,), 0.5)

    def step() -> None:
        rows = ids.repeat_interleave(cfg.rollout.group_size, 0)
        guided_velocity(model, x, sigma, rows, cfg.rollout.cfg_scale, parts.rollout.null_ids)

    per_step = count(step)  # the encodes are cached (the bench ran): a sampler step's state
    want = {
        "encode": len(ids) * count(lambda: model.net._encode(ids[:1])),
        "decode": n * count(lambda: model.family.decode(x[:1])),
        "rollout": cfg.rollout.num_steps * per_step,
        "reward": 0.0,
    }
    for stage, fl in want.items():
        assert r.stages[stage][1] == pytest.approx(fl, rel=1e-6), stage
        assert rows[f"bench/pipeline/{stage}/tflop"] == pytest.approx(fl / 1e12, rel=1e-6)
    assert min(want["encode"], want["decode"]) > 0
    assert r.stages["train"][1] > 0 and r.hw_flops == r.flops  # no checkpointing: no recompute
    assert r.flops == pytest.approx(sum(fl for _, fl, _ in r.stages.values()))
    assert rows["bench/pipeline/train/hw_tflop"] == rows["bench/pipeline/train/tflop"]
    for stage in ("encode", "rollout", "decode", "reward", "train"):
        assert r.stages[stage][0] > 0, stage
    assert 0 < rows["bench/pipeline/mfu"] == pytest.approx(r.flops / r.seconds / r.peak_flops)
    assert 0 < rows["bench/pipeline/rollout/mfu"] < 1
