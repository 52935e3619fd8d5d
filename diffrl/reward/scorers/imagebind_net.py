"""ImageBind (``imagebind_huge``) as a plain torch network whose state dict uses the names and
shapes of Meta's released ``imagebind_huge.pth``, so a user's local copy loads with
``load_state_dict(strict=True)``; no ImageBind package is needed at run time.

Layout of the release (names are facts of the checkpoint; the code here is diffrl's own):

- ``modality_preprocessors.<m>``: patch stem (``rgbt_stem`` / ``depth_stem`` / ``imu_stem``), a
  CLS token and a learned position table (``pos_embedding_helper.pos_embed``; text and IMU keep
  theirs at ``pos_embed``). Vision's stem is ``proj.1``: a Conv3d with kernel (2, 14, 14) over a
  pair of frames (slot 0 is the parameter-free "repeat a still image to 2 frames" step).
- ``modality_trunks.<m>``: a pre-norm ViT (``blocks.<i>.attn.in_proj_weight``, ``norm_1``,
  ``mlp.fc1``...) with a LayerNorm before the blocks for vision only and learned key/value bias
  tokens (``attn.bias_k`` / ``bias_v``) for every modality but vision and text.
- ``modality_heads.<m>``: LayerNorm, take the CLS token (text: its end-of-text token), project
  to the joint width without bias.
- ``modality_postprocessors.<m>``: L2 normalise, then multiply by a logit scale (a parameter for
  text, a fixed buffer for the others: audio 20, depth 5, thermal 10, IMU 5).

All six modalities are built by default so the release loads strictly. The reward uses vision
and audio only; ``ImageBindConfig.modalities`` can leave the others out, and ``load_weights``
then drops exactly those modalities' entries from the file (any other mismatch is an error).
The depth, thermal and IMU forwards are parked: no diffrl command reaches them; they exist
because their weights are part of the file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from diffrl.errors import check, check_choice

MODALITIES = ("vision", "text", "audio", "depth", "thermal", "imu")
# the fixed logit scale of each non-text modality's postprocessor (text's is learned)
FIXED_LOGIT_SCALE = {"vision": None, "audio": 20.0, "depth": 5.0, "thermal": 10.0, "imu": 5.0}
TEXT_LOGIT_SCALE_INIT = 1 / 0.07
MAX_LOGIT_SCALE = 100.0


@dataclass(frozen=True)
class TowerConfig:
    """One modality's ViT trunk: token width, blocks and attention heads (MLP ratio 4)."""

    width: int
    blocks: int
    heads: int


@dataclass(frozen=True)
class ImageBindConfig:
    """Sizes of every tower and the input geometry each was trained on.

    ``huge()`` is ``imagebind_huge`` (the released checkpoint); ``tiny()`` keeps the input
    geometry (224 px frame pairs, 128 mel x 204 frames, 77 text tokens) but narrow one-block
    towers, for CPU tests with random weights.
    """

    embed_dim: int = 1024  # the joint space
    vision: TowerConfig = TowerConfig(1280, 32, 16)  # ViT-H/14
    text: TowerConfig = TowerConfig(1024, 24, 16)
    audio: TowerConfig = TowerConfig(768, 12, 12)  # ViT-B over the mel spectrogram
    depth: TowerConfig = TowerConfig(384, 12, 8)
    thermal: TowerConfig = TowerConfig(768, 12, 12)
    imu: TowerConfig = TowerConfig(512, 6, 8)
    image_size: int = 224
    patch: int = 14  # vision patch (square); the temporal patch is `frames`
    frames: int = 2  # frames per vision clip, one temporal patch
    mel_bins: int = 128
    mel_frames: int = 204  # 2 s of 10 ms hops, padded
    audio_patch: int = 16
    audio_stride: int = 10  # overlapping audio patches
    context: int = 77  # text tokens
    vocab: int = 49408  # CLIP's BPE
    depth_patch: int = 16  # depth and thermal: 1-channel 224 px images
    imu_channels: int = 6
    imu_length: int = 2000
    imu_patch: int = 8
    modalities: tuple[str, ...] = MODALITIES  # which towers to build

    @classmethod
    def huge(cls, **overrides) -> ImageBindConfig:
        return replace(cls(), **overrides)

    @classmethod
    def tiny(cls, **overrides) -> ImageBindConfig:
        small = dict(
            embed_dim=16,
            vision=TowerConfig(32, 1, 2),
            text=TowerConfig(32, 1, 2),
            audio=TowerConfig(24, 1, 2),
            depth=TowerConfig(16, 1, 2),
            thermal=TowerConfig(16, 1, 2),
            imu=TowerConfig(16, 1, 2),
            vocab=512,
        )
        return replace(cls(), **{**small, **overrides})

    def tower(self, modality: str) -> TowerConfig:
        return getattr(self, modality)

    def validate(self) -> None:
        for m in self.modalities:
            check_choice("modalities", m, MODALITIES)
            t = self.tower(m)
            check(
                t.width % t.heads == 0 and t.blocks >= 1,
                f"{m}.width",
                t.width,
                f"a multiple of {m}.heads={t.heads}, with blocks >= 1",
            )
        check(self.image_size % self.patch == 0, "image_size", self.image_size, "patch-aligned")
        check(
            self.mel_bins >= self.audio_patch and self.mel_frames >= self.audio_patch,
            "mel_bins",
            (self.mel_bins, self.mel_frames),
            f"both >= audio_patch={self.audio_patch}",
        )

    def audio_grid(self) -> tuple[int, int]:
        """(rows, cols) of the overlapping audio patches: (12, 19) for 128 x 204."""

        def n(size: int) -> int:
            return (size - self.audio_patch) // self.audio_stride + 1

        return n(self.mel_bins), n(self.mel_frames)


# --- building blocks (names follow the release) ----------------------------------------------


class Attention(nn.Module):
    """Multi-head self-attention stored as ``nn.MultiheadAttention`` stores it (``in_proj_weight``
    (3D, D), ``in_proj_bias``, ``out_proj``, optional ``bias_k``/``bias_v`` (1, 1, D): one learned
    key/value token appended to every sequence), computed with ``scaled_dot_product_attention``
    on (B, L, D) tokens."""

    def __init__(self, width: int, heads: int, kv_bias_token: bool) -> None:
        super().__init__()
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.zeros(3 * width))
        self.out_proj = nn.Linear(width, width)
        if kv_bias_token:
            self.bias_k = nn.Parameter(torch.zeros(1, 1, width))
            self.bias_v = nn.Parameter(torch.zeros(1, 1, width))
        else:
            self.bias_k = self.bias_v = None
        nn.init.xavier_uniform_(self.in_proj_weight)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        b, n, d = x.shape
        q, k, v = F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1)
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.expand(b, 1, d)], dim=1)
            v = torch.cat([v, self.bias_v.expand(b, 1, d)], dim=1)
            if mask is not None:  # the extra key is visible to every query
                mask = F.pad(mask, (0, 1))
        if mask is not None:
            mask = mask.to(q.dtype)

        def split(t: Tensor) -> Tensor:  # (B, L, D) -> (B, H, L, D/H)
            return t.unflatten(-1, (self.heads, d // self.heads)).transpose(1, 2)

        out = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=mask)
        return self.out_proj(out.transpose(1, 2).flatten(2))


class Mlp(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 4 * width)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm residual block; LayerNorm eps 1e-6 as in the release."""

    def __init__(self, width: int, heads: int, kv_bias_token: bool) -> None:
        super().__init__()
        self.attn = Attention(width, heads, kv_bias_token)
        self.norm_1 = nn.LayerNorm(width, eps=1e-6)
        self.mlp = Mlp(width)
        self.norm_2 = nn.LayerNorm(width, eps=1e-6)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        x = x + self.attn(self.norm_1(x), mask)
        return x + self.mlp(self.norm_2(x))


class Trunk(nn.Module):
    """``pre_transformer_layer`` (slot 0: LayerNorm for vision, nothing otherwise; slot 1 was
    the release's layout change, parameter-free) then ``blocks``."""

    def __init__(self, t: TowerConfig, pre_norm: bool, kv_bias_token: bool) -> None:
        super().__init__()
        first = nn.LayerNorm(t.width, eps=1e-6) if pre_norm else nn.Identity()
        self.pre_transformer_layer = nn.Sequential(first, nn.Identity())
        self.blocks = nn.Sequential(
            *[Block(t.width, t.heads, kv_bias_token) for _ in range(t.blocks)]
        )

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        x = self.pre_transformer_layer(x)
        for blk in self.blocks:
            x = blk(x, mask)
        return x


class RepeatToFrames(nn.Module):
    """A still image (B, C, H, W) or a 1-frame clip becomes ``frames`` identical frames, so the
    temporal patch sees a pair (the release's slot ``proj.0``; no parameters)."""

    def __init__(self, frames: int) -> None:
        super().__init__()
        self.frames = frames

    def forward(self, x: Tensor) -> Tensor:
        if x.ndim == 4:
            x = x.unsqueeze(2)
        return x.expand(-1, -1, self.frames, -1, -1) if x.shape[2] == 1 else x


class Stem(nn.Module):
    """``proj`` then, for 1-channel inputs and IMU, ``norm_layer`` over the tokens."""

    def __init__(self, proj: nn.Module, norm: nn.LayerNorm | None) -> None:
        super().__init__()
        self.proj = proj
        self.norm_layer = norm

    def forward(self, x: Tensor) -> Tensor:
        x = self.proj(x)
        if x.ndim > 3:  # conv output (B, D, *grid) -> tokens (B, N, D)
            x = x.flatten(2).transpose(1, 2)
        return self.norm_layer(x) if self.norm_layer is not None else x


class PosTable(nn.Module):
    def __init__(self, tokens: int, width: int) -> None:
        super().__init__()
        self.pos_embed = nn.Parameter(torch.randn(1, tokens, width) * width**-0.5)


class PatchPreprocessor(nn.Module):
    """Image-like input -> [CLS] + patch tokens + positions. The stem sits under the attribute
    the release uses (``rgbt_stem`` for vision, audio and thermal; ``depth_stem`` for depth)."""

    def __init__(self, stem: Stem, stem_name: str, patches: int, width: int) -> None:
        super().__init__()
        self.stem_name = stem_name
        setattr(self, stem_name, stem)
        self.cls_token = nn.Parameter(torch.randn(1, 1, width) * width**-0.5)
        self.pos_embedding_helper = PosTable(patches + 1, width)

    def forward(self, x: Tensor) -> Tensor:
        tokens = getattr(self, self.stem_name)(x)
        pos = self.pos_embedding_helper.pos_embed
        if tokens.shape[1] + 1 != pos.shape[1]:
            raise ValueError(
                f"{tuple(x.shape)} gives {tokens.shape[1]} patches but the position table has "
                f"{pos.shape[1] - 1}: feed the geometry the weights were trained on"
            )
        cls = self.cls_token.expand(tokens.shape[0], -1, -1)
        return torch.cat([cls, tokens], dim=1) + pos


class TextPreprocessor(nn.Module):
    """Token ids (B, context) -> embeddings + positions; ``mask`` (a saved buffer in the
    release) is the additive causal mask."""

    def __init__(self, vocab: int, context: int, width: int) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, width)
        self.pos_embed = nn.Parameter(torch.randn(1, context, width) * 0.01)
        self.register_buffer(
            "mask", torch.full((context, context), float("-inf")).triu(1), persistent=True
        )

    def forward(self, ids: Tensor) -> Tensor:
        return self.token_embedding(ids) + self.pos_embed


class IMUPreprocessor(nn.Module):
    """(B, 6, 2000) -> 250 tokens of 8 samples x 6 channels (parked: see the module doc)."""

    def __init__(self, cfg: ImageBindConfig) -> None:
        super().__init__()
        w, k = cfg.imu.width, cfg.imu_patch
        self.patch = k
        self.imu_stem = Stem(nn.Linear(cfg.imu_channels * k, w, bias=False), nn.LayerNorm(w))
        self.pos_embed = nn.Parameter(torch.randn(1, cfg.imu_length // k + 1, w) * 0.01)
        self.cls_token = nn.Parameter(torch.randn(1, 1, w) * w**-0.5)

    def forward(self, x: Tensor) -> Tensor:
        # (B, C, S) -> (B, S/k, C, k) -> (B, S/k, C*k): channel-major within a patch
        x = x.unfold(-1, self.patch, self.patch).permute(0, 2, 1, 3).flatten(2)
        tokens = self.imu_stem(x)
        cls = self.cls_token.expand(tokens.shape[0], -1, -1)
        return torch.cat([cls, tokens], dim=1) + self.pos_embed


class SelectToken(nn.Module):
    def forward(self, x: Tensor) -> Tensor:  # (B, L, D) -> (B, D): the CLS token
        return x[:, 0]


class EndOfTextHead(nn.Module):
    """Text head: the end-of-text token's features (the highest id of a CLIP-tokenised row),
    then ``proj`` (LayerNorm, Linear)."""

    def __init__(self, width: int, out: int) -> None:
        super().__init__()
        self.proj = nn.Sequential(nn.LayerNorm(width, eps=1e-6), nn.Linear(width, out, bias=False))

    def forward(self, x: Tensor, ids: Tensor) -> Tensor:
        return self.proj(x[torch.arange(x.shape[0], device=x.device), ids.argmax(dim=-1)])


class LogitScale(nn.Module):
    """``min(exp(log_logit_scale), 100) * x``; learned for text, a buffer for the rest."""

    def __init__(self, init: float, learnable: bool) -> None:
        super().__init__()
        value = torch.tensor(math.log(init))
        if learnable:
            self.log_logit_scale = nn.Parameter(value)
        else:
            self.register_buffer("log_logit_scale", value)

    def forward(self, x: Tensor) -> Tensor:
        return self.log_logit_scale.exp().clamp(max=MAX_LOGIT_SCALE) * x


class Normalize(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return F.normalize(x, dim=-1)


# --- the network ----------------------------------------------------------------------------


def _cls_head(width: int, out: int, dropout: bool = False) -> nn.Sequential:
    # IMU's head has a dropout before the projection, which moves the Linear to slot 3
    mid = [nn.Dropout(0.5)] if dropout else []
    return nn.Sequential(
        nn.LayerNorm(width, eps=1e-6), SelectToken(), *mid, nn.Linear(width, out, bias=False)
    )


class ImageBindNet(nn.Module):
    """The towers of ``cfg.modalities``. ``embed(modality, x)`` maps one modality's model input
    to the joint space, postprocessed (normalised, times the modality's logit scale), as the
    release's forward does before its per-clip mean. Inputs:

    - vision (N, 3, T, 224, 224) float, CLIP-normalised, T = ``frames`` (or a still image);
    - audio (N, 1, 128, 204) normalised log-mel (``imagebind_audio.mel_clips`` makes it);
    - text (N, 77) CLIP BPE ids, zero-padded, end-of-text the highest id of a row;
    - depth / thermal (N, 1, 224, 224); imu (N, 6, 2000) (parked).
    """

    def __init__(self, cfg: ImageBindConfig) -> None:
        super().__init__()
        cfg.validate()
        self.cfg = cfg
        pre, trunks, heads, post = {}, {}, {}, {}
        for m in cfg.modalities:
            t = cfg.tower(m)
            pre[m] = self._preprocessor(m, cfg)
            # the release gives key/value bias tokens to every trunk but vision's and text's
            trunks[m] = Trunk(t, pre_norm=m == "vision", kv_bias_token=m not in ("vision", "text"))
            if m == "text":
                heads[m] = EndOfTextHead(t.width, cfg.embed_dim)
                post[m] = nn.Sequential(Normalize(), LogitScale(TEXT_LOGIT_SCALE_INIT, True))
            else:
                heads[m] = _cls_head(t.width, cfg.embed_dim, dropout=m == "imu")
                scale = FIXED_LOGIT_SCALE[m]
                post[m] = (
                    Normalize()
                    if scale is None
                    else nn.Sequential(Normalize(), LogitScale(scale, False))
                )
        self.modality_preprocessors = nn.ModuleDict(pre)
        self.modality_trunks = nn.ModuleDict(trunks)
        self.modality_heads = nn.ModuleDict(heads)
        self.modality_postprocessors = nn.ModuleDict(post)

    @staticmethod
    def _preprocessor(m: str, cfg: ImageBindConfig) -> nn.Module:
        w = cfg.tower(m).width
        if m == "vision":
            k = (cfg.frames, cfg.patch, cfg.patch)
            conv = nn.Conv3d(3, w, kernel_size=k, stride=k, bias=False)
            stem = Stem(nn.Sequential(RepeatToFrames(cfg.frames), conv), None)
            return PatchPreprocessor(stem, "rgbt_stem", (cfg.image_size // cfg.patch) ** 2, w)
        if m == "audio":
            conv = nn.Conv2d(1, w, cfg.audio_patch, stride=cfg.audio_stride, bias=False)
            rows, cols = cfg.audio_grid()
            return PatchPreprocessor(Stem(conv, nn.LayerNorm(w)), "rgbt_stem", rows * cols, w)
        if m in ("depth", "thermal"):
            k = cfg.depth_patch
            conv = nn.Conv2d(1, w, k, stride=k, bias=False)
            name = "depth_stem" if m == "depth" else "rgbt_stem"
            patches = (cfg.image_size // k) ** 2
            return PatchPreprocessor(Stem(conv, nn.LayerNorm(w)), name, patches, w)
        if m == "text":
            return TextPreprocessor(cfg.vocab, cfg.context, w)
        return IMUPreprocessor(cfg)

    def embed(self, modality: str, x: Tensor) -> Tensor:
        if modality not in self.modality_trunks:
            raise KeyError(
                f"modality {modality!r} is not built; built: {list(self.cfg.modalities)}"
            )
        tokens = self.modality_preprocessors[modality](x)
        if modality == "text":
            feats = self.modality_trunks["text"](tokens, self.modality_preprocessors["text"].mask)
            out = self.modality_heads["text"](feats, x)
        else:
            out = self.modality_heads[modality](self.modality_trunks[modality](tokens))
        return self.modality_postprocessors[modality](out)


# --- weights from a local file --------------------------------------------------------------


def _modality_of(key: str) -> str | None:
    parts = key.split(".")
    return parts[1] if len(parts) > 2 and parts[0].startswith("modality_") else None


def fit_state_dict(net: ImageBindNet, state: dict[str, Tensor], source: str) -> dict[str, Tensor]:
    """``state`` less the entries of modalities ``net`` leaves out (by design, see
    ``ImageBindConfig.modalities``); raises ``ValueError`` naming every missing or unexpected
    name and every shape that differs, so a wrong file or a wrong size is told apart."""
    built = set(net.cfg.modalities)
    kept = {
        k: v
        for k, v in state.items()
        if not (_modality_of(k) in MODALITIES and _modality_of(k) not in built)
    }
    own = net.state_dict(keep_vars=True)
    missing = sorted(set(own) - set(kept))
    unexpected = sorted(set(kept) - set(own))
    shapes = [
        f"{k}: file {tuple(kept[k].shape)} vs net {tuple(own[k].shape)}"
        for k in sorted(set(own) & set(kept))
        if tuple(kept[k].shape) != tuple(own[k].shape)
    ]
    if missing or unexpected or shapes:

        def few(xs: list[str]) -> str:
            return f"{len(xs)} {xs[:4]}{' ...' if len(xs) > 4 else ''}"

        raise ValueError(
            f"ImageBind weights {source} do not fit this network (embed_dim "
            f"{net.cfg.embed_dim}, vision width {net.cfg.vision.width}): missing "
            f"{few(missing)}, unexpected {few(unexpected)}, shape mismatches {few(shapes)}; "
            "use Meta's imagebind_huge.pth with size 'huge', or check the file"
        )
    return kept


def load_weights(net: ImageBindNet, path: str | Path) -> ImageBindNet:
    """Load a local ``imagebind_huge.pth``-layout file into ``net`` strictly (never a
    download). A network built on the meta device takes the file's tensors as they are
    (``assign``), so the weights are not allocated twice."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise FileNotFoundError(
            f"ImageBind weights {str(p)!r} do not exist or are not a file (diffrl never "
            "downloads weights: pass the local path of imagebind_huge.pth, the state dict "
            "Meta releases, as params.weights)"
        )
    state = torch.load(p, map_location="cpu", weights_only=True, mmap=True)
    if not isinstance(state, dict):
        raise ValueError(
            f"ImageBind weights {str(p)!r} hold a {type(state).__name__}, not a state dict"
        )
    meta = any(t.is_meta for t in net.state_dict().values())
    net.load_state_dict(fit_state_dict(net, state, repr(str(p))), strict=True, assign=meta)
    return net


def state_shapes(cfg: ImageBindConfig) -> dict[str, tuple[int, ...]]:
    """Every state-dict name and shape of ``cfg``'s network, built on the meta device (no
    memory): what a checkpoint for it must hold."""
    with torch.device("meta"):
        net = ImageBindNet(cfg)
    return {k: tuple(v.shape) for k, v in net.state_dict().items()}


__all__ = [
    "ImageBindConfig",
    "ImageBindNet",
    "TowerConfig",
    "fit_state_dict",
    "load_weights",
    "state_shapes",
]
