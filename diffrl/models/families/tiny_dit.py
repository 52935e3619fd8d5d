"""The built-in tiny pixel-space DiT (diffrl.models.tiny_dit) as a model family.

It samples 32x32 RGB images directly (no VAE: decode is a cast to uint8), tokenizes with the
ShapesBench word tokenizer, and is native in diffrl's own convention. Its checkpoints are
diffrl .safetensors files that record the architecture in their metadata.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from diffrl.errors import ConfigError
from diffrl.models.family import (
    Builtin,
    FamilyModel,
    FamilySpec,
    ResolutionFree,
    TokenBatch,
    attention_flops,
    hash_rows,
    linear_flops,
)
from diffrl.models.tiny_dit import TINY_DIT_LORA_TARGETS, TinyDiT, TinyDiTConfig
from diffrl.models.words import WordTokenizer, read_words
from diffrl.sync.weights import SlotMap
from diffrl.types import images_to_uint8

# shapes_dit_v2 (the default recipe's base): pre-trained with text_embed_std=0.02, so the
# prompt's word order reaches the blocks and colours bind to their shapes
BUILTIN = {
    "builtin:shapes_dit": Builtin("shapes_dit.safetensors", "diffrl pretrain"),
    "builtin:shapes_dit_v2": Builtin("shapes_dit_v2.safetensors", "diffrl pretrain"),
}
LORA_TARGETS = TINY_DIT_LORA_TARGETS


class TinyDiTFamily(ResolutionFree):
    name = "tiny_dit"
    native_convention = "sigma"
    lora_targets = LORA_TARGETS
    media = frozenset({"image"})

    def __init__(self, arch: TinyDiTConfig) -> None:
        self.arch = arch
        self.tokenizer = WordTokenizer(read_words("shapes"), arch.max_text_len)
        if arch.vocab_size < self.tokenizer.vocab_size:
            raise ConfigError(
                f"model vocab ({arch.vocab_size}) is smaller than the "
                f"tokenizer's ({self.tokenizer.vocab_size})"
            )

    def tokenize(self, texts: Sequence[str]) -> TokenBatch:
        ids = self.tokenizer.encode(list(texts))
        return TokenBatch(ids, ids != self.tokenizer.pad_id, hash_rows(ids))

    def null_ids(self) -> Tensor:
        return self.tokenizer.encode([""])[0]

    def latent_shape(self) -> tuple[int, ...]:
        return (self.arch.channels, self.arch.image_size, self.arch.image_size)

    def accepts_shape(self, shape: tuple[int, ...]) -> bool:
        """Smaller square or oblong images too (the position table's top-left corner, as
        ``TinyDiT.pos``): sides multiples of the patch, at most ``image_size``; for
        mixed-resolution rollouts (``rollout.packed``)."""
        a = self.arch
        return (
            len(shape) == 3
            and shape[0] == a.channels
            and all(0 < n <= a.image_size and n % a.patch == 0 for n in shape[1:])
        )

    def decode(self, latents: Tensor) -> dict[str, Tensor]:
        return {"image": images_to_uint8(latents.cpu())}

    def encode_pixels(self, pixels: Tensor) -> Tensor:
        return pixels  # pixel space

    def serving_layout(self, model: nn.Module) -> SlotMap:
        return SlotMap()  # already fused (attn.qkv is one Linear)

    def flops(self, batch: int, input_ids: Tensor | None = None, cond=None) -> float:
        """The whole net (it embeds its own ids: no encoder): the text rows are the ids'
        columns (padding included: it is masked, not cut), default ``max_text_len``."""
        a = self.arch
        n_img = (a.image_size // a.patch) ** 2
        n_txt = a.max_text_len if input_ids is None else input_ids.shape[1]
        n, d, f, cp = n_img + n_txt, a.hidden, int(a.hidden * a.mlp_ratio), a.channels * a.patch**2
        block = linear_flops(n, d, 3 * d + d + 2 * f) + attention_flops(n, n, d)
        block += linear_flops(1, d, 6 * d)  # the per-sample adaLN table
        io = linear_flops(n_img, cp, d) + linear_flops(n_img, d, cp)
        io += linear_flops(1, d, d) * 2 + linear_flops(1, d, 2 * d)  # sigma MLP, final adaLN
        return float(batch * (a.depth * block + io))


def resolve_checkpoint(spec: str) -> Path:
    path = BUILTIN[spec].path if spec in BUILTIN else Path(spec)
    if not path.is_file():
        hint = f" (run `{BUILTIN[spec].command}` to create it)" if spec in BUILTIN else ""
        raise ConfigError(f"model checkpoint {spec!r} not found at {path}{hint}")
    return path


def read_metadata(path: Path) -> dict:
    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {})
    except Exception as e:  # safetensors' own error type, or an OSError: any bad file
        raise ConfigError(
            f"config key 'model.checkpoint' = {str(path)!r}: not a .safetensors checkpoint "
            f"({type(e).__name__}: {' '.join(str(e).split())}); give one `diffrl pretrain` "
            f"wrote, or one of {sorted(BUILTIN)}"
        ) from None


def build(arch: TinyDiTConfig, convention: str = "") -> FamilyModel:
    return FamilyModel(TinyDiT(arch), TinyDiTFamily(arch), convention)


def load(cfg, device: torch.device) -> FamilyModel:
    """Build the network from the checkpoint's recorded architecture and load it."""
    if cfg.path or cfg.preset:
        raise ConfigError(
            "model family 'tiny_dit' loads a diffrl .safetensors file (model.checkpoint); "
            "model.path and model.preset are for the diffusers families"
        )
    path = resolve_checkpoint(cfg.checkpoint)
    meta = read_metadata(path)
    if "arch" not in meta:
        raise ConfigError(f"{path} has no 'arch' metadata; was it written by diffrl?")
    model = build(TinyDiTConfig(**json.loads(meta["arch"])), cfg.convention)
    missing, unexpected = model.net.load_state_dict(load_file(str(path)), strict=False)
    if missing or unexpected:
        raise ConfigError(f"{path}: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}")
    return model


def save_model(model: FamilyModel, path: Path, extra: dict[str, str] | None = None) -> None:
    net = model.net
    meta = {
        "arch": json.dumps(net.cfg.to_dict()),
        "family": "tiny_dit",
        "convention": model.convention.name,
        **(extra or {}),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().float().contiguous().cpu() for k, v in net.state_dict().items()}
    save_file(state, str(path), metadata=meta)


FAMILY = FamilySpec(
    load=load,
    family_class=TinyDiTFamily,
    builtins=BUILTIN,  # model.checkpoint, not model.weights: the file records the architecture
)
