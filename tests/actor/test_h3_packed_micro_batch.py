"""The actor's micro-batches of MiniMax-H3 samples: one transformer call per forward however
many samples (each a document of one packed sequence, ``_h3_packing``), with the loss and the
gradients of one sample per call; activation checkpointing of every block, none or the first
N, the same numbers too (the packed call's documents are bound again for the re-run)."""

from __future__ import annotations

import pytest
import torch

from diffrl.errors import ConfigError

pytest.importorskip("diffusers")

# text lengths 3, 3, 2 and 8: two documents of one length, two others
PROMPTS = ["a red ball", "a blue cat", "a dog", "two blue squares on the left of a tree"]


def _model():
    from diffrl.models.families._diffusers import init_weights
    from diffrl.models.registry import ModelConfig, load_model

    torch.manual_seed(0)
    model = load_model(ModelConfig(preset="h3-tiny"), "cpu")
    with torch.no_grad():  # adaLN gates far from 0: attention across documents would show
        init_weights(model.net.transformer, std=0.3)
    return model


def _batch(model):
    from diffrl.types import TrainBatch

    n = len(PROMPTS)
    g = torch.Generator().manual_seed(5)
    tokens = model.family.tokenize(PROMPTS)
    return TrainBatch(
        input_ids=tokens.input_ids,
        ids_hash=tuple(tokens.hashes),
        x0=torch.randn((n, *model.family.latent_shape()), generator=g),
        optimality=torch.rand(n, generator=g),
        seeds=torch.arange(n),
        noise_key=torch.arange(n),  # a sigma and a noise per row, whatever the micro-batch
    )


def _gradients(micro_batch: int, checkpointing: bool | int) -> tuple[float, list, int]:
    """(loss, the adapters' gradients, transformer calls) of one step's backward."""
    from diffrl.actor.engine import ActorConfig, ActorEngine, AdapterConfig
    from diffrl.algorithms.diffusion_nft import NFTConfig
    from diffrl.algorithms.registry import get_algorithm

    model = _model()
    cfg = ActorConfig(
        micro_batch=micro_batch, activation_checkpointing=checkpointing,
        lora=AdapterConfig(rank=4, alpha=4.0),
    )  # fmt: skip
    algo = NFTConfig(weighting="uniform", timesteps_per_sample=1, shared_noise=True)
    actor = ActorEngine(
        model, cfg, list(model.family.lora_targets), get_algorithm("diffusion_nft"), algo,
        torch.device("cpu"),
    )  # fmt: skip
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # B = 0 at init would give A no gradient
        for name, p in sorted(actor.model.named_parameters()):
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    calls = []
    model.net.transformer.register_forward_pre_hook(lambda *_: calls.append(1))
    batch = _batch(model)
    actor.begin_stream(len(batch), diagnose=False)
    actor.train_part(batch)
    step = actor._step
    assert step is not None
    return float(step.total), [p.grad.clone() for p in actor.params], len(calls)


def test_packed_micro_batches_match_one_sample_per_call() -> None:
    loss_1, grads_1, calls_1 = _gradients(1, False)
    assert calls_1 == 2 * len(PROMPTS)  # the old policy's and the policy's, per sample
    # micro-batches of 4 (lengths 3, 3, 2, 8: a document at a time in attention) and of 2
    # (3, 3: the documents as a batch; 2, 8); checkpointing none, every block, the first of 2
    for micro_batch, checkpointing in ((4, False), (2, True), (4, 1)):
        loss, grads, calls = _gradients(micro_batch, checkpointing)
        # one packed call per micro-batch each (the old policy's, the policy's)
        assert calls == 2 * len(PROMPTS) // micro_batch, checkpointing
        assert loss == pytest.approx(loss_1, rel=1e-5), checkpointing
        for a, b in zip(grads, grads_1, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)
    assert max(g.abs().max() for g in grads_1) > 0


def test_checkpointing_value_is_checked() -> None:
    from diffrl.actor.engine import ActorConfig, enable_checkpointing
    from diffrl.config import load_config

    cfg = load_config(None, ["actor.activation_checkpointing=2"])
    assert cfg.actor.activation_checkpointing == 2
    with pytest.raises(ConfigError, match=r"actor.activation_checkpointing.* = -1: true, false"):
        load_config(None, ["actor.activation_checkpointing=-1"])
    ActorConfig(activation_checkpointing=0).validate()
    with pytest.raises(ConfigError, match=r"=3: the model has 2 transformer blocks; .* 0..2"):
        enable_checkpointing(_model(), 3)
