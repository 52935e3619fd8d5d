"""`diffrl pretrain` of the tiny DiT at toy size: ``text_embed_std`` sets the token embeddings'
init (the default recipe's base, builtin:shapes_dit_v2, was pre-trained with 0.02), and records
it in the file; 0 keeps nn.Embedding's N(0, 1)."""

from __future__ import annotations

import pytest
from safetensors import safe_open

from diffrl.errors import ConfigError
from diffrl.pretrain import load_pretrain_config, pretrain

TOY = ["steps=1", "batch=4", "bank_per_prompt=1", "eval_samples=1", "hidden=16", "depth=1",
       "heads=2", "workers=1", "threads=1", "device=cpu"]  # fmt: skip


def token_embedding_std(path) -> tuple[float, dict]:
    with safe_open(str(path), "pt") as f:
        name = next(k for k in f.keys() if k.endswith("tok_emb.weight"))  # noqa: SIM118
        return float(f.get_tensor(name).std()), f.metadata()


@pytest.mark.parametrize(("std", "low", "high"), [("0.02", 0.01, 0.04), ("0", 0.7, 1.3)])
def test_text_embed_std_sets_the_token_embedding_init(tmp_path, std, low, high) -> None:
    out = tmp_path / "base.safetensors"
    pretrain(load_pretrain_config([*TOY, f"text_embed_std={std}", f"out={out}"]))
    got, meta = token_embedding_std(out)
    assert low < got < high  # one step of lr 1e-3 barely moves the EMA weights off the init
    assert float(meta["text_embed_std"]) == float(std)


def test_negative_text_embed_std_is_refused() -> None:
    with pytest.raises(ConfigError, match="text_embed_std"):
        load_pretrain_config(["text_embed_std=-0.1"])
    with pytest.raises(ConfigError, match="text_embed_std"):  # it would be silently ignored
        load_pretrain_config(["text_embed_std=0.02", "init=builtin:shapes_dit"])
