"""What keeps the sampling loop and the update from waiting on the GPU: a diffusers net's ids
stay on the host (its text conditions are looked up by their hashes there), the empty prompt's
row is made once per device, and host tensors go to a GPU through pinned memory."""

from __future__ import annotations

import torch

from diffrl.models.registry import ModelConfig, load_model
from diffrl.rollout.samplers import null_row
from diffrl.types import host_to_device


def test_a_diffusers_net_takes_host_ids_and_the_tiny_dit_device_ids(tiny_model) -> None:
    sd3 = load_model(ModelConfig(family="sd3", preset="sd35-tiny", resolution=32), "cpu")
    assert sd3.ids_device("cuda") == torch.device("cpu")
    assert tiny_model.ids_device("cuda") == torch.device("cuda")


def test_the_actor_keeps_a_diffusers_nets_ids_on_the_host(train_batch_factory) -> None:
    from diffrl.actor.engine import ActorConfig, ActorEngine, AdapterConfig
    from diffrl.algorithms.diffusion_nft import NFTConfig
    from diffrl.algorithms.registry import get_algorithm
    from diffrl.models.families.sd3 import LORA_TARGETS

    sd3 = load_model(ModelConfig(family="sd3", preset="sd35-tiny", resolution=32), "cpu")
    cfg = ActorConfig(lora=AdapterConfig(rank=2, alpha=2.0))
    nft = get_algorithm("diffusion_nft")
    actor = ActorEngine(sd3, cfg, list(LORA_TARGETS), nft, NFTConfig(), torch.device("cpu"))
    assert actor.ids_device == torch.device("cpu")
    # what _on_device does on a GPU: every row field moved but the ids ("meta" stands in)
    batch = train_batch_factory(4)
    mb = batch.select(torch.arange(2), "meta", host=("input_ids",))
    assert mb.x0.device.type == "meta" and mb.input_ids.device.type == "cpu"
    assert torch.equal(mb.input_ids, batch.input_ids[:2])


def test_null_row_is_made_once_per_dtype_and_device() -> None:
    like = torch.zeros(2, 3, dtype=torch.int64)
    a, b = null_row((4, 5, 6), like), null_row((4, 5, 6), like)
    assert a is b and a.tolist() == [4, 5, 6] and a.dtype == torch.int64
    c = null_row((4, 5, 6), like.int())
    assert c is not a and c.dtype == torch.int32
    t = torch.tensor([7, 8, 9])
    assert null_row(t, like).tolist() == [7, 8, 9]


def test_host_to_device_on_a_cpu_is_a_plain_copy() -> None:
    t = torch.arange(4.0)
    assert torch.equal(host_to_device(t, "cpu"), t)
    assert host_to_device(torch.arange(3), "cpu", torch.float16).dtype == torch.float16


def test_cache_misses_are_encoded_on_the_compute_device() -> None:
    """The ids stay on the host, so a diffusers net moves the rows its cache misses to where
    it computes (its transformer's device; "meta" stands in for a GPU) before encoding them:
    encoders that take the ids as given (Qwen, UMT5, Gemma, Qwen3-VL) get them there."""
    from diffrl.models.families._diffusers import DiffusersNet

    seen = []

    class Net(DiffusersNet):
        def encode_uncached(self, ids):
            seen.append(ids.device.type)
            return (torch.zeros(len(ids), 2, device=ids.device),)

    net = Net(torch.nn.Linear(2, 2, device="meta"))
    (out,) = net.conditions(torch.arange(12).reshape(3, 4))
    assert seen == ["meta"] and out.device.type == "meta" and out.shape == (3, 2)
