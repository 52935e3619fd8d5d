"""MiniMax-H3's FL2VA semantic branch: the keyframes seen by Qwen3-VL's vision tower.

For an FL2VA request the release does not present the prompt alone to its Qwen3-VL conditioner
(diffusers' ``MiniMaxH3FL2VATextEncoderStep``): each keyframe i comes first as a label,
``"<Picture i>: "``, and a vision block, ``<|vision_start|>`` + n x ``<|image_pad|>`` +
``<|vision_end|>`` (n = the image's patch grid over merge_size^2), then the prompt verbatim;
one conditioner call with ``pixel_values`` / ``image_grid_thw`` puts the vision tower's tokens
in place of the pads. The vision block's rows are tagged VIDEO (0) in the packed sequence, the
labels and the prompt TEXT (1): that is what the DiT's AdaLN reads.

diffrl builds the same presentation from the data stage's ids and the keyframes' pixels:

- **Pixels.** Qwen-VL's image preprocessing (the ``Qwen2VLImageProcessor`` layout; its
  module needs torchvision, which diffrl does not, so the few array steps are done here):
  the keyframe, resized to the model's frame, is rounded to a multiple of patch x merge,
  scaled to [0, 1] and normalised by mean = std = 0.5 (Qwen3-VL's), repeated over the
  temporal patch, and flattened patch by patch in merge-window order to
  (grid_h * grid_w, 3 * temporal_patch * patch^2). Every keyframe has the model's frame size,
  so the grid is fixed and the per-prompt pixels are one fixed-size row.
- **Travel.** The data stage appends those pixels to the keyframe latents, one flat row per
  prompt (``PromptBatch.cond``), so ``cond_hash`` covers both: a keyframe that changes on the
  way changes its hash, as token drift does.
- **Once.** The encoder states are cached per (prompt ids, keyframe pixels) in the net's
  ``EncodeCache``: a prompt sampled G times, trained on and evaluated is encoded once.

Not built: ``min_pixels`` / ``max_pixels`` (keyframes at the model's frame size stay inside
them for the release's 288 x 448 .. 768 x 768). ``family.conditioned`` (keyframes handed in
directly) stays text-only. Under ``parallel.etp > 1`` the build encodes every FL2VA
presentation before the cache is sealed (``MiniMaxH3Net.encode_with_conditions``); that path
has not run on several ranks.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from diffrl.errors import ConfigError

# the AdaLN table's modality rows (a checkpoint fact; minimax_h3 packs its sequence with them)
VIDEO_TAG, TEXT_TAG, AUDIO_TAG = 0, 1, 2

VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")
MEAN = STD = 0.5  # Qwen3-VL's image processor: image_mean = image_std = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class Presentation:
    """What the FL2VA presentation needs besides the prompt ids: the token ids of each
    keyframe's label and of the vision block, and the vision tower's patch geometry."""

    labels: tuple[tuple[int, ...], ...]  # "<Picture i>: " tokenized, one per keyframe
    start: int
    pad: int
    end: int
    patch: int
    merge: int
    temporal: int
    size: tuple[int, int]  # (H, W) the keyframes are presented at
    tail: tuple[int, ...] = ()  # text after the blocks (Ref2VA: "<Audio 1>: ")

    @property
    def grid(self) -> tuple[int, int]:
        return self.size[0] // self.patch, self.size[1] // self.patch

    @property
    def n_image_tokens(self) -> int:
        gh, gw = self.grid
        return gh * gw // self.merge**2

    @property
    def pixel_dim(self) -> int:
        """Values of one keyframe's processed pixels (its patches x values per patch)."""
        gh, gw = self.grid
        return gh * gw * 3 * self.temporal * self.patch**2

    def prefix(self) -> tuple[list[int], list[int]]:
        """(ids, tags) of the keyframes' labels and vision blocks, ahead of the prompt."""
        ids: list[int] = []
        tags: list[int] = []
        for label in self.labels:
            block = [self.start, *[self.pad] * self.n_image_tokens, self.end]
            ids += [*label, *block]
            tags += [TEXT_TAG] * len(label) + [VIDEO_TAG] * len(block)
        return ids + list(self.tail), tags + [TEXT_TAG] * len(self.tail)


def presentation(
    tokenizer, vision_config, size: tuple[int, int], n_keyframes: int, audio_refs: int = 0
):
    """The presentation of ``n_keyframes`` images at frame ``size`` (H, W) for this tokenizer
    and vision tower, then ``audio_refs`` "<Audio j>: " labels (Ref2VA's reference soundtrack:
    a waveform never reaches the encoder, its label does); a ConfigError when the tokenizer has
    no vision tokens."""
    vocab = tokenizer.get_vocab()
    missing = [t for t in VISION_TOKENS if t not in vocab]
    if missing:
        raise ConfigError(
            f"minimax_h3: the FL2VA semantic branch needs the tokenizer's vision tokens, and it "
            f"lacks {missing}"
        )
    factor = vision_config.patch_size * vision_config.spatial_merge_size
    side = tuple(max(factor, round(s / factor) * factor) for s in size)
    labels = tuple(
        tuple(tokenizer(f"<Picture {i + 1}>: ", add_special_tokens=False)["input_ids"])
        for i in range(n_keyframes)
    )
    return Presentation(
        labels,
        *(vocab[t] for t in VISION_TOKENS),
        patch=vision_config.patch_size,
        merge=vision_config.spatial_merge_size,
        temporal=vision_config.temporal_patch_size,
        size=(int(side[0]), int(side[1])),
        tail=tuple(
            i
            for j in range(audio_refs)
            for i in tokenizer(f"<Audio {j + 1}>: ", add_special_tokens=False)["input_ids"]
        ),
    )


def image_patches(pixels: Tensor, p: Presentation) -> Tensor:
    """(B, 3, H, W) keyframes in [-1, 1] -> (B, grid_h * grid_w, 3 * temporal * patch^2): the
    vision tower's ``pixel_values`` of one image each (Qwen-VL's patch order: merge windows
    row-major, then the patches inside a window; within a patch channel, time, row, column)."""
    b = pixels.shape[0]
    x = F.interpolate(pixels.float(), size=p.size, mode="bicubic", align_corners=False)
    x = (((x + 1) / 2).clamp(0, 1) - MEAN) / STD
    x = x[:, None].expand(b, p.temporal, *x.shape[1:])  # a still image: repeated over time
    gh, gw = p.grid
    m, ps = p.merge, p.patch
    x = x.reshape(b, p.temporal, 3, gh // m, m, ps, gw // m, m, ps)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (b, gh/m, gw/m, m, m, C, T, ps, ps)
    return x.reshape(b, gh * gw, 3 * p.temporal * ps * ps)


def row_keys(pixels: Tensor) -> Tensor:
    """(B, ...) float pixels -> (B, 1) int64 keys (a digest of each row's bytes), appended to
    the prompt ids to key the encode cache on (prompt, keyframes)."""
    flat = pixels.detach().float().cpu().contiguous().reshape(pixels.shape[0], -1)
    keys = [
        int(hashlib.sha256(row.numpy().tobytes()).hexdigest()[:15], 16) for row in flat.unbind(0)
    ]
    return torch.tensor(keys, dtype=torch.long)[:, None]


@torch.no_grad()
def encode(
    text_encoder, ids: Tensor, pad_id: int, pixels: Tensor, p: Presentation, layer: int
) -> Tensor:
    """(b, L) right-padded prompt ids and (b, K, n, d) keyframe patches -> (b, P + L, hidden)
    states of the FL2VA presentation, zero past each row's real tokens (P: the prefix)."""
    prefix, _ = p.prefix()
    b, n_pre = ids.shape[0], len(prefix)
    device = ids.device
    full = torch.full((b, n_pre + ids.shape[1]), pad_id, dtype=torch.long, device=device)
    full[:, :n_pre] = torch.tensor(prefix, device=device)
    full[:, n_pre:] = ids
    mask = full != pad_id
    k = pixels.shape[1]
    gh, gw = p.grid
    grid = torch.tensor([[1, gh, gw]] * (b * k), device=device)
    te = text_encoder
    out = te.model(
        input_ids=full,
        attention_mask=mask.long(),
        mm_token_type_ids=(full == p.pad).long(),
        pixel_values=pixels.reshape(-1, pixels.shape[-1]).to(device, te.dtype),
        image_grid_thw=grid,
        use_cache=False,
        output_hidden_states=True,
    )
    return out.hidden_states[layer] * mask[..., None]
