"""On-policy distillation: each target's loss against its formula written out here (the KL
against torch.distributions), the teacher's LoRA merge, and the recipe's two steps through the
CLI with a teacher that differs from the student."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny_runs import tiny_run

from diffrl.algorithms.opd import OPDConfig, distill_error, merge_lora, teacher_model
from diffrl.errors import ConfigError


def _inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn((3, 2, 4), generator=g, dtype=torch.float64)
    v_s = torch.randn((3, 2, 4), generator=g, dtype=torch.float64)
    v_t = torch.randn((3, 2, 4), generator=g, dtype=torch.float64)
    sigma = torch.tensor([1.0, 0.7, 0.3], dtype=torch.float64)
    return x, v_s, v_t, sigma, sigma - 0.1


@pytest.mark.parametrize("target", ["v", "x0", "xt"])
def test_ode_targets_match_their_formula(target) -> None:
    x, v_s, v_t, sigma, sigma_next = _inputs()
    s, dt = sigma.view(-1, 1, 1), (sigma_next - sigma).view(-1, 1, 1)
    y = {  # the matched quantity: the velocity, x0_hat = x - sigma v, the Euler mean x + v dt
        "v": lambda v: v,
        "x0": lambda v: x - s * v,
        "xt": lambda v: x + v * dt,
    }[target]
    want = ((y(v_s) - y(v_t)) ** 2).mean(dim=(1, 2))
    assert torch.allclose(distill_error(v_s, v_t, x, sigma, sigma_next, target), want)


def test_kl_target_is_the_gaussian_steps_kl() -> None:
    x, v_s, v_t, sigma, sigma_next = _inputs(1)
    a, cap = 0.7, 0.9  # noise level; sigma = 1 takes the schedule's second sigma
    safe = torch.where(sigma >= 1, torch.tensor(cap, dtype=sigma.dtype), sigma)
    scale = (a * (safe / (1 - safe)).sqrt()).view(-1, 1, 1)
    sig, ds = sigma.view(-1, 1, 1), (sigma_next - sigma).view(-1, 1, 1)

    def mean(v):  # FlowGRPO's SDE step mean
        return x + (v + scale**2 / (2 * sig) * (x + (1 - sig) * v)) * ds

    std = scale * (-ds).sqrt()
    kl = torch.distributions.kl_divergence(
        torch.distributions.Normal(mean(v_s), std.expand_as(x)),
        torch.distributions.Normal(mean(v_t), std.expand_as(x)),
    ).mean(dim=(1, 2))
    got = distill_error(v_s, v_t, x, sigma, sigma_next, "kl", noise_level=a, sigma_cap=cap)
    assert torch.allclose(got, kl)


def test_the_teachers_lora_is_merged_and_a_foreign_one_refused(tiny_checkpoint, tmp_path) -> None:
    from diffrl.models.registry import ModelConfig, load_model

    base = load_model(ModelConfig(checkpoint=str(tiny_checkpoint)))
    name = "blocks.0.attn.qkv"
    w = base.net.get_submodule(name).weight.detach().clone()
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn((2, w.shape[1]), generator=g), torch.randn((w.shape[0], 2), generator=g)
    path = tmp_path / "lora.safetensors"
    save_file({f"net.{name}.lora_A.weight": a, f"net.{name}.lora_B.weight": b}, str(path))
    assert merge_lora(base, str(path)) == 1
    assert torch.allclose(base.net.get_submodule(name).weight, w + b @ a, atol=1e-5)
    save_file({"net.nowhere.lora_A.weight": a, "net.nowhere.lora_B.weight": b}, str(path))
    with pytest.raises(ConfigError, match="not a LoRA of the teacher"):
        merge_lora(base, str(path))
    with pytest.raises(ConfigError, match="diffrl export"):
        merge_lora(base, str(tmp_path / "absent.safetensors"))


def test_recipe_distils_two_steps_through_the_cli(tiny_checkpoint, tmp_path: Path) -> None:
    from diffrl.cli import main
    from diffrl.models.tiny_dit import TINY_DIT_LORA_TARGETS

    # the teacher: the student's base with a LoRA merged (as `diffrl export` writes one)
    teacher = teacher_model(OPDConfig(teacher=_model(tiny_checkpoint)), torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    lora = {}
    for name, m in teacher.net.named_modules():
        if name.endswith(TINY_DIT_LORA_TARGETS) and name.startswith("blocks.0"):
            lora[f"net.{name}.lora_A.weight"] = torch.randn((2, m.in_features), generator=g)
            lora[f"net.{name}.lora_B.weight"] = torch.randn((m.out_features, 2), generator=g) * 0.1
    save_file(lora, str(tmp_path / "teacher.safetensors"))
    extra = (
        "data.prompts_per_step=1", "rollout.group_size=2", "rollout.num_steps=2",
        f"algorithm.teacher.checkpoint={tiny_checkpoint}",
        f"algorithm.teacher_lora={tmp_path / 'teacher.safetensors'}",
        "algorithm.steps_per_sample=1", "run.eval_every=100", "data.eval_prompts=2",
    )  # fmt: skip
    assert (
        main(["train", "recipes/shapes_opd.yaml", *tiny_run(tiny_checkpoint, tmp_path, 2, *extra)])
        == 0
    )
    rows = [json.loads(line) for line in (tmp_path / "shapes_opd" / "metrics.jsonl").open()]
    trained = [r for r in rows if "opd/v_gap" in r]
    assert len(trained) == 2
    assert all(r["opd/v_gap"] > 0 and r["actor/grad_norm"] > 0 for r in trained)
    assert trained[0]["opd/teacher_mib"] > 0
    # the teacher the run held: frozen, and after two updates still the base plus its LoRA
    cfg = OPDConfig(
        teacher=_model(tiny_checkpoint), teacher_lora=str(tmp_path / "teacher.safetensors")
    )
    held = teacher_model(cfg, torch.device("cpu"))
    assert not held.training and not any(p.requires_grad for p in held.parameters())
    a, b = lora["net.blocks.0.attn.qkv.lora_A.weight"], lora["net.blocks.0.attn.qkv.lora_B.weight"]
    base = teacher_model(OPDConfig(teacher=_model(tiny_checkpoint)), torch.device("cpu"))
    w = base.net.get_submodule("blocks.0.attn.qkv").weight
    assert torch.allclose(held.net.get_submodule("blocks.0.attn.qkv").weight, w + b @ a, atol=1e-5)


def _model(checkpoint):
    from diffrl.models.registry import ModelConfig

    return ModelConfig(checkpoint=str(checkpoint))
