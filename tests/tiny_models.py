"""The tiny models, actors and batches tests build, importable by name (``from tiny_models
import ...``): a test module cannot import ``conftest`` reliably, since several directories
have one and whichever was imported last holds the name."""

from __future__ import annotations

import torch

from diffrl.models.families.tiny_dit import build
from diffrl.models.family import FamilyModel
from diffrl.models.tiny_dit import TinyDiTConfig
from diffrl.tasks.shapes.tokenizer import WordTokenizer

TINY_ARCH = dict(hidden=32, depth=2, heads=2, max_text_len=12)


def make_tiny_model(seed: int = 0) -> FamilyModel:
    """A random tiny DiT in the canonical 'sigma' convention.

    TinyDiT zero-initialises its AdaLN gates and output projection (DiT's zero init), so a
    freshly built one predicts v == 0 everywhere and LoRA on its attention/MLP layers gets no
    gradient. Those all-zero tensors are re-drawn here so the model is a non-trivial function
    of x, sigma and the prompt, and every LoRA target receives gradient.
    """
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = build(TinyDiTConfig(vocab_size=WordTokenizer().vocab_size, **TINY_ARCH))
        with torch.no_grad():
            for p in model.parameters():
                if not p.any():
                    p.normal_(0.0, 0.1)
    return model


# --- actor helpers ---------------------------------------------------------------------------

CPU = torch.device("cpu")


def tiny_lora_names(model: torch.nn.Module) -> list[str]:
    """Full names of the Linear modules the tiny DiT's LoRA targets (what the rollout syncs)."""
    from diffrl.models.tiny_dit import TINY_DIT_LORA_TARGETS

    return sorted(
        n
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear)
        and n.rsplit(".", 2)[-2:] in [t.split(".") for t in TINY_DIT_LORA_TARGETS]
    )


def make_actor(
    model: FamilyModel,
    *,
    lr: float = 1e-2,
    rank: int = 4,
    algorithm=None,
    algo_cfg=None,
    **actor_kw,
):
    from diffrl.actor.engine import ActorConfig, ActorEngine, AdapterConfig
    from diffrl.algorithms.diffusion_nft import NFTConfig
    from diffrl.algorithms.registry import get_algorithm
    from diffrl.models.tiny_dit import TINY_DIT_LORA_TARGETS

    cfg = ActorConfig(lr=lr, lora=AdapterConfig(rank=rank, alpha=float(rank)), **actor_kw)
    return ActorEngine(
        model,
        cfg,
        list(TINY_DIT_LORA_TARGETS),
        algorithm or get_algorithm("diffusion_nft"),
        algo_cfg or NFTConfig(weighting="uniform", timesteps_per_sample=1),
        CPU,
    )


def make_train_batch(n: int = 4, seed: int = 0):
    from diffrl.tasks.shapes.prompts import split_prompts
    from diffrl.tasks.shapes.tokenizer import hash_ids
    from diffrl.types import TrainBatch

    g = torch.Generator().manual_seed(seed)
    texts = [p.text for p in split_prompts("train")[:n]]
    ids = WordTokenizer().encode(texts)
    return TrainBatch(
        input_ids=ids,
        ids_hash=tuple(hash_ids(ids)),
        x0=torch.rand((n, 3, 32, 32), generator=g) * 2 - 1,
        optimality=torch.rand(n, generator=g),
        seeds=torch.arange(n),
    )
