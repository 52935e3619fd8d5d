"""MiniMax-H3 as a model family: ``MiniMaxH3Transformer3DModel`` over one packed sequence.

H3 denoises ONE sequence per request, ``[text | keyframe conditions | target audio | target
video]`` (diffusers' ``MiniMaxH3PrepareLayoutStep.build_packed_sequence``, used here as is), with
full self-attention, per-row modality tags (0 video, 1 text, 2 audio) and per-row timesteps.
What the family owns, and where diffusers says it:

- **Sample layout.** diffrl's engines hold one tensor and one sigma per sample, so ``x`` is
  ``(D,)``: the video latent ``(C, F, h, w)`` flattened, then the audio latent
  ``(channels, N, C_a)`` flattened (channel-major, as H3 packs stereo). ``MiniMaxH3Net``
  unpacks it, patchifies the video into rows, packs the sequence, runs the transformer and
  flattens both heads' velocities back.
- **Time** ("data_progress"). ``MiniMaxH3Scheduler``: t = 1 - sigma in [0, 1] unscaled, t = 1
  clean, and a data-ward velocity (x0 = x_t + sigma * v), so ``FamilyModel`` feeds 1 - sigma
  and flips the sign. The transformer's ``time_proj`` takes t itself (no 1000x).
- **Per-modality sigma.** H3 runs two schedules of one grid u: sigma_v = f_sv(u) (shift 12)
  and sigma_a = f_sa(u) (shift 3), f_s(u) = s u / (1 + (s-1) u). f_s multiplies the odds
  sigma/(1-sigma) by s, so sigma_a = f_k(sigma_v) with k = s_a / s_v (0.25): the audio sigma
  is a deterministic function of the canonical (video) sigma. diffrl keeps ONE sigma per
  sample: the canonical audio variable is b = a / k (the audio latent divided by k), noised
  at the canonical sigma, x_b = (1 - sigma) b0 + sigma eps. Then H3's audio state is exactly
  ``y = g x_b`` with g = k / (1 + (k-1) sigma), at sigma_a = g sigma (so y = (1 - sigma_a) a0
  + sigma_a eps, the same eps), and the canonical velocity eps - b0 is an affine map of y and
  H3's audio output u: eps - b0 = (1 - 1/k) y - ((1 - sigma_a) + sigma_a / k) u. Training
  targets, samplers and log-probs all see one rectified flow on (video, b); decode multiplies
  b by k. At k = 1 (equal shifts) all of this is the identity.
- **Presentation, once** (contract 3). ``MiniMaxH3TextEncoderStep``: the prompt verbatim,
  no chat template, no special tokens; the ids travel right-padded with the pad token (which
  no presentation contains) so a row's real length is ``ids != pad``. The checkpoint is
  guidance-distilled: no negative prompt (``null_ids`` is the empty prompt, one pad row).
- **Text encoder.** Qwen3-VL's ``hidden_states[50]`` (of 64 layers) off ``text_encoder.model``
  (the LM head never runs); h3-tiny reads layer 1 of its 2, a raw decoder output as in the
  release (the pipeline refuses the last entry, which comes after the final norm; h3-avbench,
  trained by diffrl, reads it). Run once per prompt (``EncodeCache``);
  ``offload_text_encoder`` keeps it on the CPU between uses.
- **Conditioning rows** (FL2VA). ``family.conditioned(model, keyframes)`` packs first/last
  keyframe latents (``encode_keyframes``) as conditioning rows, held at t = max(t, 0.999)
  (the pipeline's ``keyframe_noise_aug``), detached, and cut from the output: no gradient, no
  loss. The semantic branch (``_h3_vision``, the pipeline's FL2VA text step): the keyframes
  also enter the encoder's presentation, a ``"<Picture i>: "`` label and a Qwen3-VL vision block
  each ahead of the prompt, whose rows the packed sequence tags VIDEO. Their vision patches
  travel in ``cond`` beside the keyframe latents (so ``cond_hash`` covers them) and the states
  are cached per (ids, patches). On for a real checkpoint directory (its tokenizer has the
  vision tokens); off for the presets (word tokenizers), whose FL2VA is text-only as before.
- **Ref2VA** (``_h3_ref2va``, the pipeline's ``ref2va`` task with the references fixed to one
  image and one soundtrack): the data stage encodes ``{"ref_image", "ref_audio"}`` once
  (``ref2va_conditions``: the image as a keyframe, the soundtrack through the audio codec over
  the clip's duration) into one flat ``cond`` row; the net packs ``[text | image | soundtrack |
  target audio | target video]``, the image at t = max(t, 0.999), the soundtrack clean at
  t = 1, both detached and cut from the output. A flat row's length says Ref2VA from FL2VA
  (``cond_kind``; the mode ``encode_conditions`` records decides only where both lengths
  agree); a row of the wrong length is a ContractError. ``diffrl plan`` sizes both (``geometry``).
- **Serving layout** (contract 2). ``MiniMaxH3Attention``'s processor computes with ``to_qkv``
  once ``fused_projections`` is set, so the rollout fuses q/k/v natively (blocks and token
  refiner) and holds the SwiGLU up-projection ``ff.net.0.proj`` as two swapped row shards.
- **Parity probe** (contract 1, ``reference_pipeline``). diffusers ships H3 as a modular
  pipeline only; the reference runs its ``MiniMaxH3Blocks`` t2va branch (text encoder step,
  layout, noise packing, both schedules' row timesteps, denoising loop) over this model's own
  transformer, Qwen3-VL, tokenizer and VAEs, from diffrl's noise (the video part as
  ``latents``, H3's audio state g * x_b as ``audio_latents``), its video scheduler at the
  rollout's shift and its audio scheduler at shift * k. The probe compares, for 2 transformer
  calls: the video and audio rows, the text states, the distinct timesteps and each row's index
  into them (video and audio rows each at their own t), the modality tags, the rotary position
  ids and the three row-index tensors; call 1 also checks each side's step (flipped velocity,
  the audio map). Presets off the release's geometry (h3-tiny: 16 fps mono) run the pipeline's
  packed sequence at the family's latent sizes instead of its 24 fps layout step; h3-avbench
  (no autoencoders, the post-norm text layer) has no pipeline to compare with.
- **Geometry.** Frames are ``model.height`` x ``model.width`` (``model.resolution`` square when
  neither is set); the packed sequence's rotary grid takes the latent height and width as the
  pipeline's layout step does. Frame counts are the video VAE's ``clip_length n +
  tokens_chunk_size`` (17 n + 5), else a ConfigError naming ``model.frames``.
- **Batching.** The transformer's batch axis replicates ONE layout and ONE timestep table, so
  samples sharing a (text length, sigma) go along it: a rollout step is one call per prompt
  length. Samples at different sigmas (training: a sigma per sample) go in ONE packed call,
  each sample's sequence a document of one sequence with block-diagonal attention
  (``_h3_packing``), so an actor micro-batch is one call; ``net.pack = False`` (and
  ``parallel.sp``, which splits the sequence over ranks) makes a call per (length, sigma).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from diffrl.errors import ConfigError, ContractError
from diffrl.models.families import _h3_packing as packing
from diffrl.models.families import _h3_vision as vision
from diffrl.models.families._diffusers import (
    TINY_WORDS,
    DiffusersNet,
    check_pipeline_dir,
    load_component,
    load_source,
    random_component,
    save_pipeline_dir,
    tokenize_padded,
    word_tokenizer,
)
from diffrl.models.families._encoder_plans import QWEN3_VL_ENCODER_PLAN
from diffrl.models.families._h3_codecs import DCTAudio, PixelVideo, VAEAudio, VAEVideo
from diffrl.models.families._h3_ref2va import ref2va_layout
from diffrl.models.families._h3_vision import AUDIO_TAG, TEXT_TAG, VIDEO_TAG
from diffrl.models.family import (
    Builtin,
    EncodesClips,
    FamilyModel,
    FamilySpec,
    HasModalities,
    TakesConditions,
    TokenBatch,
    hash_rows,
)
from diffrl.models.host_offload import HostResident
from diffrl.models.memory import BlockCost, Geometry, Widths
from diffrl.models.probe import HasReferencePipeline, NoReference, Reference
from diffrl.models.words import read_words
from diffrl.parallel.tp import FusedColwiseParallel, LocalHeads, PerHeadNorm, Plan
from diffrl.sync.layouts import fuse_qkv, merge, split_swapped
from diffrl.sync.weights import SlotMap
from diffrl.types import images_from_uint8

# suffixes: the transformer blocks' and the token refiner's attention and SwiGLU FFN (FC1 is
# ff.net.0.proj, the fused [hidden | gate] up-projection; FC2 is ff.net.2)
LORA_TARGETS = (
    "attn.to_q",
    "attn.to_k",
    "attn.to_v",
    "attn.to_out.0",
    "ff.net.0.proj",
    "ff.net.2",
)
PIPELINE = "MiniMaxH3ModularPipeline"
COMPONENTS = {
    "transformer": "MiniMaxH3Transformer3DModel",
    "vae": "AutoencoderKLMiniMaxH3",
    "audio_vae": "AutoencoderKLMiniMaxH3Audio",
    "text_encoder": "Qwen3VLForConditionalGeneration",
    "tokenizer": "Qwen2TokenizerFast (Qwen3-VL's)",
    "scheduler": "MiniMaxH3Scheduler (video, shift 12)",
    "audio_scheduler": "MiniMaxH3Scheduler (audio, shift 3)",
}
KEYFRAME_T = 0.999  # the pipeline's keyframe_noise_aug: conditioning rows sit just short of clean
ANCHORS = ("first", "last")  # FL2VA: the two keyframes' places in the clip
TEXT_LAYER = 50  # hidden_states[50] of Qwen3-VL-32B conditions the DiT

_QWEN3_VL_32B = dict(
    text_config=dict(
        vocab_size=151936,
        hidden_size=5120,
        intermediate_size=25600,
        num_hidden_layers=64,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=262144,
        rope_scaling={"rope_type": "default", "mrope_section": [24, 20, 20]},
        tie_word_embeddings=False,
    ),
    vision_config=dict(
        depth=27,
        hidden_size=1152,
        intermediate_size=4304,
        num_heads=16,
        out_hidden_size=5120,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        deepstack_visual_indexes=[8, 16, 24],
    ),
)


def tiny_qwen3_vl(hidden: int, head_dim: int, mrope: list[int], kv_heads: int = 2) -> dict:
    """A 2-layer Qwen3-VL config (4 heads, ``kv_heads`` KV heads, a 1-block vision tower)."""
    return dict(
        text_config=dict(
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rope_scaling={"rope_type": "default", "mrope_section": mrope},
            tie_word_embeddings=False,
        ),
        vision_config=dict(
            depth=1,
            hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            out_hidden_size=hidden,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
            deepstack_visual_indexes=[0],
        ),
    )


PRESETS: dict[str, dict] = {
    # the released DiT: the class defaults (50 layers, hidden 5376, 56 x 128 heads, 33 B);
    # video VAE x16 spatial, 17n+5 -> 5n+2 frames, 24 channels; audio VAE 32 kHz, hop 800,
    # 32 channels, stereo; 124 frames (5.2 s at 24 fps) on a 768 px square canvas
    "minimax-h3": dict(
        transformer=dict(),
        vae=dict(),
        audio_vae=dict(),
        text_encoder=_QWEN3_VL_32B,
        text_layer=TEXT_LAYER,
        video_shift=12.0,
        audio_shift=3.0,
        audio_channels=2,
        fps=24.0,
        resolution=768,
        frames=124,
        max_text_len=512,
        offload_text_encoder=True,
    ),
    # ~0.2 M parameters: 8 frames of 32 x 32 px -> (4, 5, 8, 8) video latents; 0.5 s of mono
    # 8 kHz audio -> 20 latents of 4 channels; a 2-layer Qwen3-VL text encoder
    "h3-tiny": dict(
        transformer=dict(
            num_attention_heads=2,
            attention_head_dim=16,
            hidden_size=32,
            num_layers=2,
            num_refiner_layers=1,
            ffn_dim=64,
            in_channels=4,
            audio_in_channels=4,
            patch_size=(1, 2, 2),
            text_dim=32,
            freq_dim=32,
            time_embed_hidden_dim=32,
            time_embed_dim=16,
            rope_freq_dim=2,
        ),
        vae=dict(
            latent_channels=4,
            block_out_channels=(8, 16),
            layers_per_block=1,
            spatial_downsample_factors=(2, 2),
            temporal_downsample_factors=(1, 2),
            norm_num_groups=4,
            decoder_num_layers=1,
            decoder_num_attention_heads=2,
            decoder_attention_head_dim=8,
            decoder_num_register_tokens=1,
            clip_length=5,
            token_drop=1,
            latents_mean=(0.0,) * 4,
            latents_std=(1.0,) * 4,
        ),
        audio_vae=dict(
            encoder_dim=4,
            encoder_rates=(2, 4, 5, 5),
            latent_dim=16,
            latent_channels=4,
            num_attention_heads=2,
            decoder_dim=16,
            decoder_rates=(5, 5, 4, 2),
            decoder_kernel_sizes=(9, 9, 8, 4),
            resblock_kernel_sizes=(3,),
            resblock_dilation_sizes=((1,),),
            sampling_rate=8000,
            latents_mean=[0.0] * 4,
            latents_std=[1.0] * 4,
        ),
        text_encoder=tiny_qwen3_vl(32, 8, [1, 1, 2]),
        text_layer=1,  # a raw layer output, as the release's 50 of 64 (the last one is post-norm)
        video_shift=12.0,
        audio_shift=3.0,
        audio_channels=1,
        fps=16.0,
        resolution=32,
        frames=8,
        max_text_len=16,
        offload_text_encoder=False,
    ),
    # the built-in AVBench base (docs/avbench.md): the real transformer class, ~1.8 M
    # parameters, over AVBench's own clips, 12 frames of 16 x 16 px at 16 fps (pixel latents,
    # 4 x 4 patches: 192 video rows of 48 values) and 0.75 s of 8 kHz mono audio (60 DCT frames
    # of 100 samples: 60 audio rows); a 2-layer Qwen3-VL text encoder over AVBench's words. A
    # row's values must fit through the hidden width (128): 8 x 8 patches of 32 px frames (192
    # values) capped the velocity loss at ~0.4. The shift ratio 0.5 keeps H3's per-modality
    # sigma map in play (audio noised less than video)
    "h3-avbench": dict(
        transformer=dict(
            num_attention_heads=4,
            attention_head_dim=32,
            hidden_size=128,
            num_layers=4,
            num_refiner_layers=1,
            ffn_dim=384,
            in_channels=3,
            audio_in_channels=100,
            patch_size=(1, 4, 4),
            text_dim=64,
            freq_dim=64,
            time_embed_hidden_dim=128,
            time_embed_dim=64,
            rope_freq_dim=4,
        ),
        vae=None,
        audio_vae=None,
        audio_dct=dict(sample_rate=8000, hop=100, scale=0.5),
        text_encoder=tiny_qwen3_vl(64, 16, [2, 2, 4]),
        words="avbench",
        text_layer=2,
        video_shift=2.0,
        audio_shift=1.0,
        audio_channels=1,
        fps=16.0,
        resolution=16,
        frames=12,
        max_text_len=12,
        offload_text_encoder=False,
    ),
}
# h3-avbench's geometry (AVBench's clips and words) with every width the 8-GPU layout splits
# (recipes/h3_fl2va_8gpu.yaml: tp 4, etp 4) divisible by 4: the DiT's 4 heads and FFN 384 as
# there, the encoder's 4 query heads over 4 KV heads (h3-avbench's 2 do not divide over etp 4)
# and its MLP of 128. Random weights (builtin:avbench_h3 is h3-avbench's); the 8-GPU recipe's
# CPU counterpart, run at 8 gloo ranks (tests/parallel/test_h3_8rank_cli.py)
PRESETS["h3-avbench-tp4"] = {
    **PRESETS["h3-avbench"],
    "text_encoder": tiny_qwen3_vl(64, 16, [2, 2, 4], kv_heads=4),
}
DEFAULT_RESOLUTION, DEFAULT_FRAMES, DEFAULT_MAX_TEXT_LEN = 768, 124, 512


def present(text: str) -> str:
    """The one presentation of a t2va prompt: verbatim (no chat template, no specials)."""
    return text


def odds_shift(sigma: Tensor, k: float) -> Tensor:
    """f_k(sigma) = k sigma / (1 + (k - 1) sigma): the scheduler's shift, which multiplies the
    odds sigma / (1 - sigma) by k (so f_a(f_b^-1(s)) = f_{a/b}(s))."""
    return k * sigma / (1 + (k - 1) * sigma)


def patchify(z: Tensor, patch: tuple[int, int, int]) -> Tensor:
    """(B, C, F, h, w) -> (B, rows, C * pt * ph * pw), frame-major then row-major (the
    pipeline's ``patchify_video_latents``, keeping the batch axis)."""
    b, c, f, h, w = z.shape
    pt, ph, pw = patch
    z = z.reshape(b, c, f // pt, pt, h // ph, ph, w // pw, pw).permute(0, 2, 4, 6, 1, 3, 5, 7)
    return z.reshape(b, -1, c * pt * ph * pw)


def unpatchify(rows: Tensor, shape: tuple[int, int, int, int], patch) -> Tensor:
    """The inverse of ``patchify``: (B, rows, C * pt * ph * pw) -> (B, C, F, h, w)."""
    c, f, h, w = shape
    pt, ph, pw = patch
    z = rows.reshape(-1, f // pt, h // ph, w // pw, c, pt, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7)
    return z.reshape(-1, c, f, h, w)


def _text_tags(n_text: int, prefix: tuple[int, ...]) -> Tensor:
    """(n_text,) tags of the text rows: ``prefix`` (the semantic branch's), then TEXT_TAG."""
    return torch.tensor([*prefix, *[TEXT_TAG] * (n_text - len(prefix))], dtype=torch.long)


def _layout_dict(
    packed: tuple[Tensor, Tensor, Tensor, Tensor, Tensor, int, int], device
) -> dict[str, Tensor]:
    """The five tensors the transformer reads, on ``device``, from a packed-sequence builder's
    7-tuple: the pipeline's ``build_packed_sequence`` and ``_h3_ref2va.ref2va_layout`` both
    return (position_ids, token_tags, video, audio, text indices, two more)."""
    pos, tags, vid, aud, txt, _, _ = packed
    out = dict(
        position_ids=pos.float(),
        token_tags=tags,
        video_indices=vid,
        audio_indices=aud,
        text_indices=txt,
    )
    return {k: v.to(device) for k, v in out.items()}


class MiniMaxH3Net(DiffusersNet):
    """forward(x (B, D), t = 1 - sigma (B,), input_ids (B, L)) -> H3's native data-ward
    velocity, flat (B, D): the video part as the transformer returns it, the audio part the
    canonical audio velocity negated (module docstring), so FamilyModel's flip is exact."""

    def __init__(
        self,
        transformer,
        text_encoder,
        vae,
        audio_vae,
        *,
        pad_id: int,
        video_shape: tuple[int, int, int, int],
        audio_shape: tuple[int, int, int],
        audio_shift_ratio: float,
        text_layer: int,
        offload_text_encoder: bool = False,
    ) -> None:
        super().__init__(transformer, text_encoder=text_encoder, vae=vae, audio_vae=audio_vae)
        self.pad_id, self.text_layer = pad_id, text_layer
        self.video_shape, self.audio_shape = video_shape, audio_shape  # (C,F,h,w), (ch,N,Ca)
        self.k = float(audio_shift_ratio)
        self.offload = offload_text_encoder
        if offload_text_encoder and not hasattr(self.frozen, "te_home"):
            # pinned, flat, streamed a layer ahead (models/host_offload.py); in the Shared
            # holder, so the rollout's and evaluator's copies use this one host copy
            on_host = next(text_encoder.parameters()).device.type == "cpu"
            self.frozen.te_home = HostResident(text_encoder) if on_host else None
        self.keyframes: tuple[Tensor, tuple[str, ...]] | None = None  # set by conditioned()
        self._layouts: dict[tuple, dict[str, Tensor]] = {}  # layout() per (n_text, anchors)
        # the FL2VA semantic branch (_h3_vision): set by build when on, else text-only FL2VA
        self.semantic: vision.Presentation | None = None
        self.semantic_ref: vision.Presentation | None = None  # Ref2VA's (one image, one audio)
        # what the data stage's conditions are ("fl2va" keyframes, or "ref2va" references):
        # set by family.encode_conditions from the task's condition keys
        self.cond_mode = "fl2va"
        # samples at different times in one packed call (_h3_packing), each sample's sequence a
        # document of it; False: a call per (text length, time), as under parallel.sp
        self.pack = True
        self.documents = packing.Documents()
        n_layers = text_encoder.config.text_config.num_hidden_layers
        if not 0 < text_layer <= n_layers:
            raise ConfigError(
                f"minimax_h3: text layer {text_layer} is not in the encoder's 1..{n_layers}"
            )

    @property
    def dims(self) -> tuple[int, int]:
        return math.prod(self.video_shape), math.prod(self.audio_shape)

    # --- text ---------------------------------------------------------------------------
    def encode_uncached(self, input_ids: Tensor) -> tuple[Tensor]:
        """Qwen3-VL's hidden_states[text_layer] off ``text_encoder.model`` (no LM head), zero
        after each row's real tokens. Right padding leaves the real rows as the pipeline's
        unpadded call computes them (causal attention, positions from 0)."""
        te = self.frozen.text_encoder
        mask = input_ids != self.pad_id
        with self.encoder_on(input_ids.device):
            out = te.model(
                input_ids=input_ids,
                attention_mask=mask.long(),
                use_cache=False,
                output_hidden_states=True,
            )
        hidden = out.hidden_states[self.text_layer] * mask[..., None]
        return (hidden,)

    def encoder_on(self, device: torch.device):
        """A block in which the text encoder computes on ``device``: an offloaded one visits
        from pinned host memory (``HostResident``) and leaves nothing behind; else a no-op."""
        home = getattr(self.frozen, "te_home", None) if self.offload else None
        return home.visit(device) if home is not None else contextlib.nullcontext()

    # --- the packed sequence ------------------------------------------------------------
    def layout(
        self, n_text: int, anchors: tuple[str, ...], device, prefix: tuple[int, ...] = ()
    ) -> dict[str, Tensor]:
        """position_ids, token_tags and the three index tensors of one request's sequence,
        built once per (text length, anchors, device, the text rows' leading tags ``prefix``:
        the FL2VA semantic branch's labels and vision blocks)."""
        key = (n_text, tuple(anchors), str(device), prefix)
        if key not in self._layouts:
            self._layouts[key] = self._build_layout(n_text, anchors, device, prefix)
        return self._layouts[key]

    def ref2va_layout(
        self, n_text: int, prefix: tuple[int, ...], n_ref_audio: int, device
    ) -> dict[str, Tensor]:
        """Ref2VA's sequence (``_h3_ref2va``), built once per (text length, prefix, device)."""
        key = (n_text, "ref2va", str(device), prefix, n_ref_audio)
        if key not in self._layouts:
            tags = _text_tags(n_text, prefix)
            patch = tuple(self.transformer.config.patch_size)
            packed = ref2va_layout(
                tags, self.video_shape, self.audio_shape, patch, n_ref_audio, (VIDEO_TAG, AUDIO_TAG)
            )
            self._layouts[key] = _layout_dict(packed, device)
        return self._layouts[key]

    def _build_layout(
        self, n_text: int, anchors: tuple[str, ...], device, prefix: tuple[int, ...] = ()
    ) -> dict[str, Tensor]:
        from diffusers.modular_pipelines.minimax_h3.before_denoise import (
            MiniMaxH3PrepareLayoutStep,
        )

        _, f, h, w = self.video_shape
        ch, n_audio, _ = self.audio_shape
        packed = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
            _text_tags(n_text, prefix),
            f,
            h,
            w,
            n_audio,
            tuple(self.transformer.config.patch_size),
            ch,
            AUDIO_TAG,
            VIDEO_TAG,
            anchors,
        )
        return _layout_dict(packed, device)

    def _group(
        self,
        x: Tensor,
        t: Tensor,
        txt: Tensor,
        lengths: list[int],
        cond: Tensor | None,
        anchors,
        prefix: tuple[int, ...] = (),
        ref_audio: Tensor | None = None,
    ) -> Tensor:
        """ONE transformer call for the b samples ``x`` at native times ``t`` (b,) with text
        lengths ``lengths``: along the class's batch axis when they share one (length, time),
        else packed, each sample's sequence a document of one sequence (``_h3_packing``).
        ``ref_audio``: Ref2VA's clean reference soundtrack (b, ch, N, Ca), packed ahead of the
        generated audio at t = 1 (``_h3_ref2va``); ``cond`` is then its one image."""
        b = x.shape[0]
        dv, _ = self.dims
        patch = tuple(self.transformer.config.patch_size)
        sigma = 1.0 - t.float()[:, None]  # (b, 1) canonical sigma, from the native time
        g = self.k / (1 + (self.k - 1) * sigma)  # H3 audio state = g * canonical audio
        sigma_a = g * sigma
        video = patchify(x[:, :dv].reshape(b, *self.video_shape), patch)  # (b, Nv, Cp)
        y = g * x[:, dv:].float()  # (b, Da) H3-space audio
        audio_rows = y.reshape(b, -1, self.audio_shape[-1])  # (b, ch * N, Ca), channel-major
        n_cond = 0
        if cond is not None:  # (b, K, C, 1, h, w) keyframe latents: frozen rows, no gradient
            cond_rows = patchify(cond.detach().squeeze(3).transpose(1, 2), patch)  # (b, K*rows, Cp)
            n_cond = cond_rows.shape[1]
            video = torch.cat([cond_rows.to(video), video], dim=1)
        n_ref = 0
        if ref_audio is not None:  # Ref2VA: the soundtrack's rows ahead of the generated ones
            ref_rows = ref_audio.detach().reshape(b, -1, self.audio_shape[-1])
            n_ref = ref_rows.shape[1]
            audio_rows = torch.cat([ref_rows.to(audio_rows), audio_rows], dim=1)

        def layout(n_text: int) -> dict[str, Tensor]:
            if ref_audio is not None:
                return self.ref2va_layout(n_text, prefix, ref_audio.shape[2], x.device)
            return self.layout(n_text, anchors, x.device, prefix)

        times, audio_times = t.float().tolist(), (1.0 - sigma_a[:, 0]).tolist()  # one sync

        def row_times(lay: dict[str, Tensor], i: int) -> Tensor:  # (seq_len,) sample i's
            row_t = torch.full((lay["position_ids"].shape[0],), times[i], device=x.device)
            row_t[lay["audio_indices"]] = audio_times[i]
            row_t[lay["video_indices"][:n_cond]] = max(times[i], KEYFRAME_T)
            row_t[lay["audio_indices"][:n_ref]] = 1.0  # a reference soundtrack is clean
            return row_t

        dtype = txt.dtype
        docs = None
        if len(set(zip(lengths, times, strict=True))) == 1:
            lay = layout(lengths[0])
            row_t = row_times(lay, 0)
            text = txt[:, : lengths[0]]
        else:  # (1, sum of the samples' rows, .) each, the samples' layouts concatenated
            lays = [layout(n) for n in lengths]
            lay = packing.concat_layouts(lays)
            row_t = torch.cat([row_times(one, i) for i, one in enumerate(lays)])
            video, audio_rows = (
                video.reshape(1, -1, video.shape[-1]),
                audio_rows.flatten(0, 1)[None],
            )
            text = torch.cat([txt[i, :n] for i, n in enumerate(lengths)])[None]
            seq = tuple(one["position_ids"].shape[0] for one in lays)
            docs = packing.Docs(seq, tuple(lengths))
            packing.install(self.transformer, self.documents)
        timestep, timestep_indices = torch.unique(row_t, sorted=True, return_inverse=True)
        with self.documents.bound(docs):
            v_out, a_out = self.transformer(
                hidden_states=video.to(dtype),
                audio_hidden_states=audio_rows.to(dtype),
                encoder_hidden_states=text,
                timestep=timestep.to(dtype),
                timestep_indices=timestep_indices,
                return_dict=False,
                **lay,
            )
        v_out, a_out = v_out.reshape(b, -1, v_out.shape[-1]), a_out.reshape(b, -1, a_out.shape[-1])
        v_video = unpatchify(v_out[:, n_cond:], self.video_shape, patch).flatten(1)
        u = a_out[:, n_ref:].float().flatten(1)  # H3's data-ward audio velocity, at sigma_a
        canon = (1 - 1 / self.k) * y - ((1 - sigma_a) + sigma_a / self.k) * u  # eps - b0
        return torch.cat([v_video.to(x.dtype), (-canon).to(x.dtype)], dim=1)

    def _calls(self, t: Tensor, lengths: list[int]) -> list[list[int]]:
        """The rows of each transformer call: the samples sharing a (text length, time) along
        the batch axis, or, when their times differ (the actor's: a sigma per sample), all of
        them in one packed call. Under diffusers' context parallelism, which splits the one
        sequence over ranks, a call per (length, time)."""
        groups: dict[tuple[int, float], list[int]] = {}
        for i, (n, ti) in enumerate(zip(lengths, t.float().tolist(), strict=True)):
            groups.setdefault((n, ti), []).append(i)
        split = getattr(self.transformer, "_parallel_config", None) is not None
        if split or not self.pack or len({ti for _, ti in groups}) == 1:
            return list(groups.values())
        return [list(range(len(lengths)))]

    def checkpoint_context(self):
        """The documents of a packed call, bound again when activation checkpointing re-runs a
        block in the backward (``torch.utils.checkpoint``'s ``context_fn``)."""
        return self.documents.recompute_context()

    def split_cond(self, cond: Tensor) -> tuple[Tensor, Tensor | None]:
        """The data stage's per-row conditions -> keyframe latents (B, 2, C, 1, h, w) and, with
        the semantic branch, the keyframes' vision patches (B, 2, n, d) (one flat row each)."""
        p = self.semantic
        if p is None:
            return cond, None
        _, _, h, w = self.video_shape
        c = self.video_shape[0]
        n_lat = len(ANCHORS) * c * h * w
        want = n_lat + len(ANCHORS) * p.pixel_dim
        if cond.ndim != 2 or cond.shape[1] != want:
            raise ContractError(
                f"minimax_h3: FL2VA conditions of shape {tuple(cond.shape)}; the semantic "
                f"branch takes one flat row of {want} values per sample (keyframe latents, then "
                "their vision patches)"
            )
        b = cond.shape[0]
        lat = cond[:, :n_lat].reshape(b, len(ANCHORS), c, 1, h, w)
        gh, gw = p.grid
        return lat, cond[:, n_lat:].reshape(b, len(ANCHORS), gh * gw, -1)

    def semantic_states(
        self, input_ids: Tensor, patches: Tensor, dtype, p: vision.Presentation | None = None
    ) -> Tensor:
        """(B, P + L, hidden) states of the FL2VA presentation (or ``p``: Ref2VA's) from
        ``_h3_vision``, encoded once per (prompt ids, image patches) through the net's
        ``EncodeCache``."""
        p = p or self.semantic
        assert p is not None
        key = torch.cat([input_ids.cpu(), vision.row_keys(patches)], dim=1)
        where = {tuple(r.tolist()): i for i, r in enumerate(key)}

        def encode(rows: Tensor) -> tuple[Tensor]:
            sel = [where[tuple(r.tolist())] for r in rows.cpu()]
            device = self.compute_device()
            te = self.frozen.text_encoder
            with self.encoder_on(device):
                te.eval()
                states = vision.encode(
                    te, input_ids[sel].to(device), self.pad_id, patches[sel].to(device), p,
                    self.text_layer,
                )  # fmt: skip
            return (states,)

        rows = self.cache.get(key, encode)
        return torch.stack([r[0] for r in rows]).to(dtype)

    def cond_kind(self, cond: Tensor) -> str:
        """ "fl2va" or "ref2va" for the data stage's conditions, by their shape: keyframe latents
        are 6-D, a flat row's length says which it is; only where both flat lengths agree
        (the semantic branch with a soundtrack as long as an image latent and its patches)
        does the mode ``encode_conditions`` recorded decide (an engine built elsewhere then
        needs it set)."""
        if cond.ndim != 2:
            return "fl2va"
        c, _, h, w = self.video_shape
        n_img, n_aud = c * h * w, math.prod(self.audio_shape)
        ref = n_img + n_aud + (self.semantic_ref.pixel_dim if self.semantic_ref else 0)
        fl2va = len(ANCHORS) * (n_img + self.semantic.pixel_dim) if self.semantic else -1
        if ref == fl2va:
            return self.cond_mode
        return "ref2va" if cond.shape[1] == ref else "fl2va"

    def split_ref2va(self, cond: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """Ref2VA's per-row conditions, one flat row each -> the reference image's latent
        (B, 1, C, 1, h, w), its soundtrack's H3-space latents (B, ch, N, Ca) and, with the
        semantic branch, the image's vision patches (B, 1, n, d)."""
        c, _, h, w = self.video_shape
        n_img, n_aud = c * h * w, math.prod(self.audio_shape)
        p = self.semantic_ref
        want = n_img + n_aud + (p.pixel_dim if p is not None else 0)
        if cond.ndim != 2 or cond.shape[1] != want:
            raise ContractError(
                f"minimax_h3: Ref2VA conditions of shape {tuple(cond.shape)}; expected one flat "
                f"row of {want} values per sample (the image latent, the soundtrack latent"
                f"{', the image patches' if p is not None else ''})"
            )
        b = cond.shape[0]
        image = cond[:, :n_img].reshape(b, 1, c, 1, h, w)
        audio = cond[:, n_img : n_img + n_aud].reshape(b, *self.audio_shape)
        n_patches = p.grid[0] * p.grid[1] if p is not None else 0
        patches = None if p is None else cond[:, n_img + n_aud :].reshape(b, 1, n_patches, -1)
        return image, audio, patches

    def _forward_ref2va(self, x: Tensor, t: Tensor, input_ids: Tensor, cond: Tensor) -> Tensor:
        """Ref2VA (``_h3_ref2va``): the reference image as a conditioning frame, the reference
        soundtrack as clean audio rows, both cut from the output."""
        image, audio, patches = self.split_ref2va(cond)
        lengths = (input_ids != self.pad_id).sum(1).clamp(min=1).tolist()
        prefix: tuple[int, ...] = ()
        if patches is not None and self.semantic_ref is not None:
            txt = self.semantic_states(input_ids, patches, x.dtype, self.semantic_ref)
            ids, tags = self.semantic_ref.prefix()
            prefix = tuple(tags)
            lengths = [n + len(ids) for n in lengths]
        else:
            (txt,) = self.conditions(input_ids, dtype=x.dtype)
        if image.shape[0] != x.shape[0]:
            raise ContractError(
                f"minimax_h3: Ref2VA conditions for {image.shape[0]} rows, {x.shape[0]} samples"
            )
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        for rows in self._calls(t, lengths):
            idx = torch.tensor(rows, device=x.device)
            n = [lengths[i] for i in rows]
            out[idx] = self._group(
                x[idx], t[idx], txt[idx], n, image[idx], ("first",), prefix, audio[idx]
            )
        return out

    def encode_with_conditions(self, input_ids: Tensor, cond: Tensor, chunk: int) -> None:
        """Encode the FL2VA presentations of a prompt set ((N, L) ids, (N, ...) conditions) into
        the cache, ``chunk`` rows per encoder call: under ETP before the cache is sealed
        (``diffrl.build``), since an encode is a collective there. Nothing without the
        semantic branch."""
        ref2va = self.cond_kind(cond) == "ref2va"
        p = self.semantic_ref if ref2va else self.semantic
        if p is None:
            return
        patches = self.split_ref2va(cond)[2] if ref2va else self.split_cond(cond)[1]
        assert patches is not None
        for start in range(0, input_ids.shape[0], max(1, chunk)):
            rows = slice(start, start + chunk)
            self.semantic_states(input_ids[rows], patches[rows], torch.float32, p)

    def forward(
        self, x: Tensor, t: Tensor, input_ids: Tensor, cond: Tensor | None = None
    ) -> Tensor:
        """``cond``: (B, 2, C, 1, h, w) first/last keyframe latents per row (FL2VA), as the
        data stage encoded them (with the semantic branch: one flat row of those latents and
        the keyframes' vision patches); else the ones ``family.conditioned`` set, else none
        (T2VA)."""
        if cond is not None and self.cond_kind(cond) == "ref2va":
            return self._forward_ref2va(x, t, input_ids, cond)
        lengths = (input_ids != self.pad_id).sum(1).clamp(min=1).tolist()
        patches, prefix = None, ()
        if cond is not None:
            cond, patches = self.split_cond(cond)
        if patches is not None and self.semantic is not None:
            txt = self.semantic_states(input_ids, patches, x.dtype)
            ids, tags = self.semantic.prefix()
            prefix = tuple(tags)
            lengths = [n + len(ids) for n in lengths]
        else:
            (txt,) = self.conditions(input_ids, dtype=x.dtype)
        if cond is not None:
            anchors = ANCHORS
            if cond.shape[0] != x.shape[0] or cond.shape[1] != len(anchors):
                raise ContractError(
                    f"minimax_h3: conditions of shape {tuple(cond.shape)} for {x.shape[0]} rows; "
                    f"expected (B, {len(anchors)}, C, 1, h, w) keyframe latents"
                )
        else:
            cond, anchors = self.keyframes if self.keyframes is not None else (None, ())
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        for rows in self._calls(t, lengths):
            idx = torch.tensor(rows, device=x.device)
            c = None if cond is None else cond[idx]
            n = [lengths[i] for i in rows]
            out[idx] = self._group(x[idx], t[idx], txt[idx], n, c, anchors, prefix)
        return out


class MiniMaxH3Family(TakesConditions, EncodesClips, HasModalities, HasReferencePipeline):
    name = "minimax_h3"
    native_convention = "data_progress"
    lora_targets = LORA_TARGETS
    media = frozenset({"video", "fps", "image", "audio", "sample_rate"})

    def __init__(
        self,
        tokenizer,
        net: MiniMaxH3Net,
        size: tuple[int, int],
        frames: int,
        fps: float,
        video_codec,
        audio_codec,
    ) -> None:
        self.tokenizer, self.net = tokenizer, net
        self.video_codec, self.audio_codec = video_codec, audio_codec
        self.height, self.width = size  # pixels; square unless model.height/width say otherwise
        self.frames, self.fps = frames, fps
        self.max_text_len = tokenizer.model_max_length

    # --- contract 3 ---------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str]) -> TokenBatch:
        ids, mask = tokenize_padded(self.tokenizer, [present(t) for t in texts], self.max_text_len)
        return TokenBatch(ids, mask, hash_rows(ids))

    def null_ids(self) -> Tensor:
        return self.tokenize([""]).input_ids[0]  # guidance-distilled: no negative prompt

    # --- shapes and media ---------------------------------------------------------------
    def latent_shape(self) -> tuple[int, ...]:
        return (sum(self.net.dims),)

    def modality_split(self) -> tuple[int, int]:
        """(n_video, n_audio) elements of the flat x: ``split``'s layout (modality credit)."""
        dv, da = self.net.dims
        return dv, da

    def split(self, latents: Tensor) -> tuple[Tensor, Tensor]:
        """(B, D) -> video (B, C, F, h, w) and H3-space audio (B, ch, N, Ca) (= k * b)."""
        dv, _ = self.net.dims
        b = latents.shape[0]
        video = latents[:, :dv].reshape(b, *self.net.video_shape)
        audio = self.net.k * latents[:, dv:].reshape(b, *self.net.audio_shape)
        return video, audio

    @torch.no_grad()
    def decode(self, latents: Tensor) -> dict[str, Tensor]:
        video, audio = self.split(latents.float())
        clip = self.video_codec.decode(video)[:, :, : self.frames]  # (B, 3, T, H, W) in [0, 1]
        frames = (clip * 255).round().to(torch.uint8).permute(0, 2, 3, 4, 1)  # (B, T, H, W, 3)
        wave = self.audio_codec.decode(audio)  # (B, samples)
        b = frames.shape[0]
        return {
            "video": frames,
            "fps": torch.full((b,), float(self.fps)),
            "image": frames[:, frames.shape[1] // 2],
            "audio": wave,
            "sample_rate": torch.full((b,), float(self.audio_codec.sample_rate)),
        }

    @torch.no_grad()
    def encode_video(self, pixels: Tensor) -> Tensor:
        """(B, 3, T, H, W) in [-1, 1] -> video latents (B, C, F', h, w)."""
        return self.video_codec.encode(pixels)

    @torch.no_grad()
    def encode_clip(self, video: Tensor, audio: Tensor) -> Tensor:
        """Ground-truth clips, video (B, T, H, W, 3) uint8 and audio (B, samples) float, ->
        (B, D) canonical latents (the audio part is H3's audio latent divided by k)."""
        if video.dtype != torch.uint8 or video.ndim != 5 or audio.ndim != 2:
            raise ValueError(
                f"encode_clip takes video (B, T, H, W, 3) uint8 and audio (B, samples); got "
                f"{tuple(video.shape)} {video.dtype} and {tuple(audio.shape)}"
            )
        b, t = video.shape[:2]
        pixels = images_from_uint8(video.flatten(0, 1)).unflatten(0, (b, t)).transpose(1, 2)
        z_v = self.encode_video(self._resize(pixels)).flatten(1)
        z_a = self.audio_codec.encode(audio, self.net.audio_shape) / self.net.k
        return torch.cat([z_v, z_a.flatten(1).to(z_v)], dim=1)

    def media_geometry(self) -> dict[str, float]:
        """What a task renders conditions at: frames, size (px), fps and sample rate; a
        non-square model also says its height and width (``size`` is then the longer side, which
        a square-rendering task draws at and the family resizes to its frame)."""
        return dict(
            frames=self.frames,
            size=max(self.height, self.width),
            height=self.height,
            width=self.width,
            fps=self.fps,
            sample_rate=self.audio_codec.sample_rate,
        )

    @torch.no_grad()
    def encode_conditions(self, conditions: Sequence[dict]) -> Tensor:
        """Per-prompt FL2VA conditions, {"first_frame", "last_frame"} (H, W, 3) uint8 each, ->
        (N, 2, C, 1, h, w) keyframe latents, encoded once in the data stage; Ref2VA's
        {"ref_image", "ref_audio"} -> ``ref2va_conditions``."""
        if conditions and {"ref_image", "ref_audio"} <= set(conditions[0]):
            return self.ref2va_conditions(conditions)
        self.net.cond_mode = "fl2va"
        missing = [k for k in ("first_frame", "last_frame") if k not in (conditions or [{}])[0]]
        if not conditions or missing:
            raise ConfigError(f"minimax_h3: FL2VA conditions need {missing or 'some rows'}")
        first = torch.from_numpy(np.stack([c["first_frame"] for c in conditions]))
        last = torch.from_numpy(np.stack([c["last_frame"] for c in conditions]))
        device = next(self.net.transformer.parameters()).device
        latents = self.keyframe_latents(first.to(device), last.to(device)).float().cpu()
        p = self.net.semantic
        if p is None:
            return latents
        # the semantic branch: the keyframes' vision patches travel beside their latents, one
        # flat row per prompt, so cond_hash covers both (_h3_vision)
        pixels = images_from_uint8(torch.stack([first, last], 1).flatten(0, 1))
        patches = vision.image_patches(self._resize(pixels), p).reshape(len(conditions), -1)
        return torch.cat([latents.flatten(1), patches], dim=1)

    @torch.no_grad()
    def ref2va_conditions(self, conditions: Sequence[dict]) -> Tensor:
        """Ref2VA's per-prompt references, {"ref_image": (H, W, 3) uint8, "ref_audio":
        (samples,) float at the model's sample rate}, -> one flat row each: the image's latent
        (a keyframe's encoding), the soundtrack's H3-space latent over the clip's duration
        (cut or zero-padded to it), and with the semantic branch the image's vision patches.
        Sets the net's condition mode (``_h3_ref2va``)."""
        image = torch.from_numpy(np.stack([c["ref_image"] for c in conditions]))
        if image.dtype != torch.uint8 or image.ndim != 4:
            raise ValueError(f"Ref2VA ref_image must be (H, W, 3) uint8; got {image.dtype}")
        device = next(self.net.transformer.parameters()).device
        pixels = images_from_uint8(image.to(device))
        latent = self.encode_keyframes(pixels[:, None]).float().cpu().flatten(1)
        hop = getattr(self.audio_codec, "hop", None) or self.audio_codec.vae.hop_length
        samples = self.net.audio_shape[1] * hop
        wave = torch.zeros(len(conditions), samples)
        for i, c in enumerate(conditions):
            ref = torch.as_tensor(np.asarray(c["ref_audio"], dtype=np.float32)).reshape(-1)
            wave[i, : min(samples, ref.numel())] = ref[:samples]
        audio = self.audio_codec.encode(wave.to(device), self.net.audio_shape).float().cpu()
        rows = [latent, audio.flatten(1)]
        p = self.net.semantic_ref
        if p is not None:
            rows.append(vision.image_patches(self._resize(pixels), p).reshape(len(conditions), -1))
        self.net.cond_mode = "ref2va"
        return torch.cat([r.cpu() for r in rows], dim=1)

    def keyframe_latents(self, first: Tensor, last: Tensor) -> Tensor:
        """First and last frames, (B, H, W, 3) uint8 each, -> (B, 2, C, 1, h, w) latents."""
        if first.dtype != torch.uint8 or first.ndim != 4 or first.shape != last.shape:
            raise ValueError(
                f"FL2VA frames must be (H, W, 3) uint8 of one size; got {tuple(first.shape)} "
                f"{first.dtype} and {tuple(last.shape)}"
            )
        pixels = images_from_uint8(torch.stack([first, last], 1).flatten(0, 1))
        return self.encode_keyframes(pixels.unflatten(0, (first.shape[0], 2)))

    def _resize(self, pixels: Tensor) -> Tensor:
        size = (self.height, self.width)
        if tuple(pixels.shape[-2:]) == size:
            return pixels
        flat = pixels.flatten(0, -4) if pixels.ndim == 5 else pixels
        out = F.interpolate(flat, size=size, mode="bilinear", antialias=True)
        return out.reshape(*pixels.shape[:-2], *size) if pixels.ndim == 5 else out

    @torch.no_grad()
    def encode_pixels(self, pixels: Tensor) -> Tensor:
        """(B, 3, H, W) images (a still clip) or (B, 3, T, H, W) clips in [-1, 1] -> (B, D)
        latents; the audio part is 0 (the audio latents' mean), as images carry no sound."""
        pixels = self._resize(pixels)
        if pixels.ndim == 4:
            pixels = pixels.unsqueeze(2).expand(-1, -1, self.frames, -1, -1)
        video = self.encode_video(pixels).flatten(1)
        return torch.cat([video, video.new_zeros(video.shape[0], self.net.dims[1])], dim=1)

    def encode_keyframes(self, pixels: Tensor) -> Tensor:
        """(B, K, 3, H, W) first/last frames in [-1, 1] -> (B, K, C, 1, h, w) latents, each
        frame encoded alone (the spatial encoder, as the pipeline encodes a keyframe)."""
        b, k = pixels.shape[:2]
        z = self.encode_video(self._resize(pixels.flatten(0, 1)).unsqueeze(2))
        return z.reshape(b, k, *z.shape[1:])

    @contextlib.contextmanager
    def conditioned(
        self, model: FamilyModel, keyframes: Tensor, anchors: tuple[str, ...] = ANCHORS
    ) -> Iterator[FamilyModel]:
        """FL2VA: within the block, ``model`` packs ``keyframes`` (B, K, C, 1, h, w) as frozen
        conditioning rows anchored at ``anchors`` (no gradient, cut from the output)."""
        if keyframes.shape[1] != len(anchors):
            raise ConfigError(f"{keyframes.shape[1]} keyframes for anchors {anchors}")
        model.net.keyframes = (keyframes.detach(), tuple(anchors))
        try:
            yield model
        finally:
            model.net.keyframes = None

    # --- contract 1: the reference pipeline ----------------------------------------------
    def reference(self, model: FamilyModel, shift: float) -> Reference:
        """H3's modular t2va pipeline (``MiniMaxH3Blocks``) over this model's own components:
        see ``reference_pipeline``."""
        return reference_pipeline(model, shift)

    # --- contract 2 and cost ------------------------------------------------------------
    def serving_layout(self, model: nn.Module) -> SlotMap:
        tr = model.net.transformer
        blocks = [
            f"net.transformer.transformer_blocks.{i}" for i in range(len(tr.transformer_blocks))
        ]
        blocks += [
            f"net.transformer.token_refiner.refiner_blocks.{i}"
            for i in range(len(tr.token_refiner.refiner_blocks))
        ]
        # native: MiniMaxH3AttnProcessor computes with attn.to_qkv once fused_projections is set
        qkv = fuse_qkv(model, [f"{b}.attn" for b in blocks], native=True)
        ffn = split_swapped(model, [f"{b}.ff.net.0.proj" for b in blocks], n_shards=2)
        return merge(qkv, ffn)

    def flops(
        self, batch: int, input_ids: Tensor | None = None, cond: Tensor | None = None
    ) -> float:
        """The transformer calls of one forward over the packed sequences ``MiniMaxH3Net``
        builds (the text encoder runs once per prompt, cached). Each sample's sequence is its
        real text rows (``input_ids``' non-pad tokens, plus the FL2VA semantic branch's
        labels and vision rows; default ``max_text_len``), the conditioning rows ``cond`` (or
        ``family.conditioned``'s keyframes) packs (FL2VA: two keyframes; Ref2VA: the image and
        the reference soundtrack), and the target audio and video rows. Per row: every
        block's q/k/v/out and SwiGLU, both output heads (each runs over every row); attention
        4 S^2 d per block; the token refiner over the text rows; the input projections over
        their modality's rows. Per call, taken as one per distinct text length (a rollout
        step's grouping; training calls once per sample, a sigma each, which this undercounts
        by the per-call terms only, under 0.1% at real size): the time MLP and the adaLN
        tables over the call's distinct times (target video and text, target audio unless the
        shifts are equal, each kind of conditioning row)."""
        from diffrl.models.family import attention_flops, linear_flops

        net, cfg = self.net, self.net.transformer.config
        hid, inner, ffn = (
            cfg.hidden_size,
            cfg.num_attention_heads * cfg.attention_head_dim,
            cfg.ffn_dim,
        )
        c, f, h, w = net.video_shape
        pt, ph, pw = cfg.patch_size
        cp, frame_rows = c * pt * ph * pw, (h // ph) * (w // pw)
        rows_v, (ch, n_audio, c_a) = (f // pt) * frame_rows, net.audio_shape
        lengths = [self.max_text_len] * batch
        if input_ids is not None:
            lengths = (input_ids != net.pad_id).sum(1).clamp(min=1).tolist()
        cond_v = cond_a = 0  # conditioning rows: keyframes (video), a reference soundtrack
        semantic = None
        if cond is not None and net.cond_kind(cond) == "ref2va":
            _, ref_audio, patches = net.split_ref2va(cond)
            cond_v, cond_a = frame_rows, ref_audio.shape[1] * ref_audio.shape[2]
            semantic = net.semantic_ref if patches is not None else None
        elif cond is not None:
            keyframes, patches = net.split_cond(cond)
            cond_v = keyframes.shape[1] // pt * frame_rows
            semantic = net.semantic if patches is not None else None
        elif net.keyframes is not None:
            cond_v = net.keyframes[0].shape[1] // pt * frame_rows
        if semantic is not None:  # its labels and vision blocks lead the text rows
            lengths = [n + len(semantic.prefix()[0]) for n in lengths]
        times = 1 + (self.net.k != 1) + (cond_v > 0) + (cond_a > 0)
        per_call = linear_flops(times, cfg.freq_dim, cfg.time_embed_hidden_dim)
        per_call += linear_flops(times, cfg.time_embed_hidden_dim, cfg.time_embed_dim)
        per_call += linear_flops(times, cfg.time_embed_dim, (cfg.num_layers * 18 + 2) * hid)
        block_row = 4 * inner + 3 * ffn  # q/k/v/out, the SwiGLU's two up and one down
        total = per_call * len(set(lengths))
        for n_txt in lengths:
            s = n_txt + cond_v + cond_a + ch * n_audio + rows_v
            total += cfg.num_layers * (
                linear_flops(s, hid, block_row) + attention_flops(s, s, inner)
            )
            total += cfg.num_refiner_layers * (
                linear_flops(n_txt, hid, block_row) + attention_flops(n_txt, n_txt, inner)
            )
            total += linear_flops(n_txt, cfg.text_dim, hid) + linear_flops(s, hid, cp + c_a)
            total += linear_flops(rows_v + cond_v, cp, hid) + linear_flops(
                ch * n_audio + cond_a, c_a, hid
            )
        return float(total)


# --- the reference pipeline (contract 1's parity probe) ---------------------------------------


@functools.cache
def _pipeline_classes() -> tuple[type, type, type]:
    """(pipeline, layout step, processor) classes over diffusers' H3 modular pipeline, built on
    first use so that importing the family does not import the modular pipelines."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import MiniMaxH3PrepareLayoutStep
    from diffusers.modular_pipelines.minimax_h3.modular_pipeline import MiniMaxH3ModularPipeline
    from transformers import Qwen3VLProcessor

    class FamilyPipeline(MiniMaxH3ModularPipeline):
        """The release's pipeline with the two facts it fixes as properties and a preset may
        set: the conditioning layer (50 for the release) and the audio channels (stereo)."""

        text_layer: int | None = None  # None: the release's
        channels: int | None = None

        @property
        def text_encoder_layer(self) -> int:
            return super().text_encoder_layer if self.text_layer is None else self.text_layer

        @property
        def audio_channels(self) -> int:
            return super().audio_channels if self.channels is None else self.channels

    class FamilyGeometryLayout(MiniMaxH3PrepareLayoutStep):
        """The pipeline's layout step for a preset off the release's geometry (not 24 fps, 5 to
        15 s of stereo in 17 n + 5 frames, which the step hard-codes): the same packed sequence
        (its ``build_packed_sequence``) at the family's latent sizes."""

        video_shape: tuple[int, ...] = ()
        audio_shape: tuple[int, ...] = ()

        def __call__(self, components, state):
            bs = self.get_block_state(state)
            _, f, h, w = self.video_shape
            ch, n_audio, _ = self.audio_shape
            bs.num_latent_frames, bs.latent_height, bs.latent_width = f, h, w
            bs.num_audio_latents = n_audio
            *rows, bs.num_condition_video_rows, bs.num_condition_audio_rows = (
                self.build_packed_sequence(
                    bs.text_token_tags, f, h, w, n_audio, components.patch_size, ch,
                    components.audio_tag, components.video_tag, bs.keyframe_anchors,
                )
            )  # fmt: skip
            names = ("position_ids", "token_tags", "video_indices", "audio_indices", "text_indices")
            for name, value in zip(names, rows, strict=True):
                setattr(bs, name, value.to(components._execution_device))
            self.set_block_state(state, bs)
            return components, state

    class TextOnlyProcessor(Qwen3VLProcessor):
        """Qwen3-VL's processor for a text-only presentation: t2va calls only its
        ``create_mm_token_type_ids``, which needs the tokenizer's vision-token ids and not the
        image/video processors (those need torchvision). A tokenizer without vision tokens
        (the tiny word vocabularies) has none, so no prompt word is typed as an image."""

        def __init__(self, tokenizer) -> None:  # no super(): it demands the image processors
            vocab = tokenizer.get_vocab()
            self.tokenizer = tokenizer
            self.image_token_id = vocab.get("<|image_pad|>")
            self.video_token_id = vocab.get("<|video_pad|>")

    return FamilyPipeline, FamilyGeometryLayout, TextOnlyProcessor


def reference_pipeline(model: FamilyModel, shift: float) -> Reference:
    """Contract 1's reference: diffusers' ``MiniMaxH3Blocks`` (the t2va branch: the text encoder
    step, the layout, the noise packing, both schedules' row timesteps, the denoising loop) over
    this model's transformer, Qwen3-VL, tokenizer and VAEs.

    The pipeline's video scheduler applies the rollout's ``shift``, its audio scheduler
    ``shift * k`` (diffrl's audio sigma is f_k of the canonical one and f_k(f_s) = f_ks), both
    over the H3 grid ``linspace(1, 0, T + 1)``, which is the probe's grid with its terminal 0.
    diffrl's noise enters as the pipeline's ``latents`` (the video part) and ``audio_latents``
    (H3's audio state g * x_b at the first sigma, (channels, C_a, N)). A preset on the release's
    geometry (24 fps stereo) runs the pipeline's own layout step; a smaller one its packed
    sequence at the family's latent sizes (``FamilyGeometryLayout``)."""
    from diffusers import MiniMaxH3Scheduler
    from diffusers.modular_pipelines.minimax_h3 import modular_pipeline as h3
    from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3Blocks

    net, fam = model.net, model.family
    f = net.frozen
    n_layers = f.text_encoder.config.text_config.num_hidden_layers
    if f.vae is None or f.audio_vae is None or n_layers <= net.text_layer:
        # h3-avbench: pixel video and DCT audio (no autoencoders), and the encoder's last,
        # post-norm state, which diffrl trained it on and the pipeline's text step refuses
        raise NoReference(
            "minimax_h3 reference: diffusers' H3 pipeline needs both autoencoders and a text "
            f"layer below the encoder's last ({n_layers}); this model has video VAE "
            f"{f.vae is not None}, audio VAE {f.audio_vae is not None}, text layer "
            f"{net.text_layer}: it has no diffusers pipeline to compare with"
        )
    pipeline_cls, layout_cls, processor_cls = _pipeline_classes()
    release = fam.fps == h3.MINIMAX_H3_FPS and net.audio_shape[0] == h3.MINIMAX_H3_AUDIO_CHANNELS
    blocks = MiniMaxH3Blocks()
    core = blocks.sub_blocks["denoise"].sub_blocks["t2va"]
    core.sub_blocks["denoise"].set_progress_bar_config(disable=True)  # the pipe's does not reach
    if not release:
        layout = layout_cls()
        layout.video_shape, layout.audio_shape = net.video_shape, net.audio_shape
        core.sub_blocks["prepare_layout"] = layout
    pipe = pipeline_cls(blocks=blocks)
    # the release's layer 50 where the encoder has it (an independent check of diffrl's), else
    # the preset's (h3-tiny: 1 of 2)
    if n_layers <= pipe.text_encoder_layer:
        pipe.text_layer = net.text_layer
    pipe.channels = net.audio_shape[0]
    pipe.update_components(
        transformer=net.transformer, text_encoder=f.text_encoder, tokenizer=fam.tokenizer,
        processor=processor_cls(fam.tokenizer), vae=f.vae, audio_vae=f.audio_vae,
        scheduler=MiniMaxH3Scheduler(shift=shift),
        audio_scheduler=MiniMaxH3Scheduler(shift=shift * net.k),
    )  # fmt: skip
    dv, _ = net.dims
    device = next(net.transformer.parameters()).device

    def call(prompt: str, noise: Tensor, grid: Sequence[float]) -> None:
        steps = len(grid)
        if not torch.allclose(torch.tensor(list(grid)), torch.linspace(1.0, 0.0, steps + 1)[:-1]):
            raise ContractError(
                "minimax_h3 reference: MiniMaxH3Scheduler builds its own grid, linspace(1, 0, "
                f"T + 1) (its set-timesteps step takes no sigmas), and {list(grid)} is not one"
            )
        sigma = shift * grid[0] / (1 + (shift - 1) * grid[0])  # the first canonical sigma
        g = net.k / (1 + (net.k - 1) * sigma)  # H3's audio state = g * the canonical audio
        video = noise[:, :dv].reshape(1, *net.video_shape).float()
        audio = (g * noise[0, dv:].float()).reshape(net.audio_shape).transpose(1, 2)
        quiet = logging.getLogger("diffusers.modular_pipelines.modular_pipeline")
        level = quiet.level
        quiet.setLevel(logging.CRITICAL)  # the probe's stop is not a pipeline error to log
        try:
            with net.encoder_on(device):  # as encode_uncached: on the device while it encodes
                pipe(
                    prompt=prompt, latents=video, audio_latents=audio,
                    num_inference_steps=steps + 1, height=fam.height, width=fam.width,
                    num_frames=fam.frames, output_type="pt",
                )  # fmt: skip
        finally:
            quiet.setLevel(level)

    return Reference(net.transformer, call)


# --- building ---------------------------------------------------------------------------------


def codecs(vae, audio_vae, spec: dict) -> tuple:
    """The (video, audio) codecs: the autoencoders when there are modules, else the
    weightless pixel / DCT transforms that ``spec`` (a preset) describes."""
    video = VAEVideo(vae) if vae is not None else PixelVideo()
    if audio_vae is not None:
        audio = VAEAudio(audio_vae)
    else:
        dct = spec.get("audio_dct") or {}
        if not dct:
            raise ConfigError("minimax_h3: no audio VAE and no DCT audio codec in the preset")
        audio = DCTAudio(dct["sample_rate"], dct["hop"], dct["scale"])
    return video, audio


def build(
    transformer,
    text_encoder,
    video_codec,
    audio_codec,
    tokenizer,
    *,
    resolution: int,
    frames: int,
    max_text_len: int,
    height: int = 0,
    width: int = 0,
    fps: float,
    audio_shift_ratio: float,
    audio_channels: int,
    text_layer: int,
    offload_text_encoder: bool = False,
    semantic_keyframes: bool = False,
    convention: str = "",
) -> FamilyModel:
    tokenizer.padding_side = "right"
    tokenizer.model_max_length = max_text_len
    if tokenizer.pad_token_id is None:
        raise ConfigError("minimax_h3: the tokenizer has no pad token")
    text_encoder = trim_text_encoder(text_encoder, text_layer)
    cfg = transformer.config
    size = (height or resolution, width or resolution)  # model.height/width: non-square frames
    video_shape = video_codec.latent_shape(frames, *size, tuple(cfg.patch_size))
    audio_shape = audio_codec.latent_shape(frames / fps, audio_channels)
    if cfg.in_channels != video_shape[0] or cfg.audio_in_channels != audio_shape[-1]:
        raise ConfigError(
            f"minimax_h3: transformer takes {cfg.in_channels} video / {cfg.audio_in_channels} "
            f"audio channels, the codecs give {video_shape[0]} / {audio_shape[-1]}"
        )
    net = MiniMaxH3Net(
        transformer,
        text_encoder,
        getattr(video_codec, "vae", None),
        getattr(audio_codec, "vae", None),
        pad_id=tokenizer.pad_token_id,
        video_shape=video_shape,
        audio_shape=audio_shape,
        audio_shift_ratio=audio_shift_ratio,
        text_layer=text_layer,
        offload_text_encoder=offload_text_encoder,
    )
    if semantic_keyframes:  # FL2VA presents the keyframes to the encoder too (_h3_vision)
        vcfg = text_encoder.config.vision_config
        net.semantic = vision.presentation(tokenizer, vcfg, size, len(ANCHORS))
        net.semantic_ref = vision.presentation(tokenizer, vcfg, size, 1, audio_refs=1)
    family = MiniMaxH3Family(tokenizer, net, size, frames, fps, video_codec, audio_codec)
    return FamilyModel(net, family, convention)


def trim_text_encoder(text_encoder, text_layer: int):
    """Drop the decoder layers past ``text_layer + 1`` (13 of the 32 B encoder's 64, ~10 GB in
    bf16): the DiT reads ``hidden_states[text_layer]``, which no later layer changes. One layer
    past it stays because transformers returns the last entry after the final norm, and the
    DiT wants layer ``text_layer``'s raw output. The vision tower stays (unused by text
    prompts, small)."""
    layers = text_encoder.model.language_model.layers
    keep = text_layer + 1
    if len(layers) > keep:
        text_encoder.model.language_model.layers = layers[:keep]
        text_encoder.config.text_config.num_hidden_layers = keep
    return text_encoder


def tiny_tokenizer(max_len: int, words: str = "tiny"):
    """A word-level Qwen-style tokenizer: over the tiny presets' words, or with
    ``words="avbench"`` over AVBench's prompt words as well."""
    vocab = set(TINY_WORDS)
    if words == "avbench":
        vocab |= set(read_words("avbench"))
    return word_tokenizer(sorted(vocab), "qwen", max_len)


def _random(preset: str, dtype: torch.dtype, device: torch.device) -> dict:
    from diffusers import (
        AutoencoderKLMiniMaxH3,
        AutoencoderKLMiniMaxH3Audio,
        MiniMaxH3Transformer3DModel,
    )
    from transformers import Qwen3VLForConditionalGeneration

    spec = PRESETS[preset]
    tok = tiny_tokenizer(spec["max_text_len"], spec.get("words", "tiny"))
    te_cfg = {k: dict(v) for k, v in spec["text_encoder"].items()}
    if preset != "minimax-h3":
        te_cfg["text_config"]["vocab_size"] = len(tok)
    te_device = torch.device("cpu") if spec["offload_text_encoder"] else device
    layers = te_cfg["text_config"].get("num_hidden_layers", 0)  # built as trim_text_encoder keeps
    te_cfg["text_config"]["num_hidden_layers"] = min(layers, spec["text_layer"] + 1) or layers
    tr = random_component(MiniMaxH3Transformer3DModel, spec["transformer"], dtype, device)
    return dict(
        transformer=tr,
        text_encoder=random_component(Qwen3VLForConditionalGeneration, te_cfg, dtype, te_device),
        vae=None
        if spec["vae"] is None
        else random_component(AutoencoderKLMiniMaxH3, spec["vae"], dtype, device),
        audio_vae=None
        if spec["audio_vae"] is None
        else random_component(AutoencoderKLMiniMaxH3Audio, spec["audio_vae"], dtype, device),
        tokenizer=tok,
    )


def tiny_components(preset: str = "h3-tiny") -> dict[str, object]:
    """Random components of ``preset`` on the CPU in fp32, for ``save_pipeline_dir``; the two
    schedulers carry the per-modality shifts (video 12, audio 3) a directory is read with."""
    from diffusers import MiniMaxH3Scheduler

    spec = PRESETS[preset]
    parts = _random(preset, torch.float32, torch.device("cpu"))
    return {
        **parts,
        "scheduler": MiniMaxH3Scheduler(shift=spec["video_shift"]),
        "audio_scheduler": MiniMaxH3Scheduler(shift=spec["audio_shift"]),
    }


def save_tiny(path, preset: str = "h3-tiny"):
    return save_pipeline_dir(path, tiny_components(preset), PIPELINE)


def load(cfg, device: torch.device) -> FamilyModel:
    """From a local pipeline directory (``cfg.path``) or a preset with random weights. A
    directory's sizes default to the tiny preset's when its transformer is tiny (hidden < 1024),
    else to the release's 124 frames of 768 px; its shift ratio comes from its schedulers."""
    from diffusers import (
        AutoencoderKLMiniMaxH3,
        AutoencoderKLMiniMaxH3Audio,
        MiniMaxH3Scheduler,
        MiniMaxH3Transformer3DModel,
    )
    from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration

    def settings(spec: dict, shifts, text_layer: int, offload: bool) -> dict:
        keys = ("resolution", "frames", "max_text_len", "fps", "audio_channels")
        return {
            **{k: spec[k] for k in keys},
            "semantic_keyframes": spec.get("semantic_keyframes", False),
            "height": spec.get("height", 0),  # 0: square frames of the resolution
            "width": spec.get("width", 0),
            "audio_shift_ratio": shifts[1] / shifts[0],
            "text_layer": text_layer,
            "offload_text_encoder": offload,
        }

    def with_codecs(parts: dict, spec: dict) -> dict:
        video_codec, audio_codec = codecs(parts.pop("vae"), parts.pop("audio_vae"), spec)
        return {**parts, "video_codec": video_codec, "audio_codec": audio_codec}

    def from_dir(path: str, dtype: torch.dtype) -> tuple[dict, dict]:
        root = check_pipeline_dir(path, "minimax_h3", COMPONENTS)
        transformer = load_component(
            root, "transformer", MiniMaxH3Transformer3DModel, dtype, device
        )
        spec = PRESETS["h3-tiny" if transformer.config.hidden_size < 1024 else "minimax-h3"]
        offload = spec["offload_text_encoder"] and device.type == "cuda"
        te_device = torch.device("cpu") if offload else device
        parts = dict(
            transformer=transformer,
            text_encoder=load_component(
                root, "text_encoder", Qwen3VLForConditionalGeneration, dtype, te_device
            ),
            vae=load_component(root, "vae", AutoencoderKLMiniMaxH3, dtype, device),
            audio_vae=load_component(root, "audio_vae", AutoencoderKLMiniMaxH3Audio, dtype, device),
            tokenizer=load_component(root, "tokenizer", AutoTokenizer, dtype, device),
        )
        shifts = [
            MiniMaxH3Scheduler.from_pretrained(str(root), subfolder=s).shift
            for s in ("scheduler", "audio_scheduler")
        ]
        n_layers = parts["text_encoder"].config.text_config.num_hidden_layers
        # the release's layer 50, or a small encoder's last pre-norm output (layer n - 1)
        text_layer = TEXT_LAYER if n_layers > TEXT_LAYER else n_layers - 1
        s = settings(spec, shifts, text_layer, offload)
        # a real checkpoint presents FL2VA keyframes to its encoder, as the release's pipeline
        # does (_h3_vision); a tiny directory's word tokenizer has no vision tokens
        s["semantic_keyframes"] = transformer.config.hidden_size >= 1024
        return with_codecs(parts, spec), s

    def from_preset(name: str, dtype: torch.dtype) -> tuple[dict, dict]:
        spec = PRESETS[name]
        shifts = (spec["video_shift"], spec["audio_shift"])
        parts = with_codecs(_random(name, dtype, device), spec)
        return parts, settings(spec, shifts, spec["text_layer"], spec["offload_text_encoder"])

    parts, s = load_source(cfg, "minimax_h3", PRESETS, from_dir, from_preset)
    return build(**parts, **s, convention=cfg.convention)


# --- tensor parallelism: the DiT's plan (styles in diffrl/parallel/tp.py) ----------------------

# MiniMax-H3 (MiniMaxH3Transformer3DModel): self-attention only (one packed sequence), in the
# text refiner and the main blocks, per-head qk-norm; the feed-forward is a SwiGLU whose one
# Linear yields [up; gate] (FusedColwiseParallel). A model after fuse_projections() (to_qkv)
# does not match this plan.
TP_PLAN: Plan = {
    f"{blocks}.*.{leaf}": style
    for blocks in ("token_refiner.refiner_blocks", "transformer_blocks")
    for leaf, style in (
        ("attn", LocalHeads("heads")),
        ("attn.to_q", ColwiseParallel()),
        ("attn.to_k", ColwiseParallel()),
        ("attn.to_v", ColwiseParallel()),
        ("attn.norm_q", PerHeadNorm(heads_dim=2)),  # on (B, S, H, D)
        ("attn.norm_k", PerHeadNorm(heads_dim=2)),
        ("attn.to_out.0", RowwiseParallel()),
        ("ff.net.0.proj", FusedColwiseParallel(chunks=2)),
        ("ff.net.2", RowwiseParallel()),
    )
}


# --- memory geometry for `diffrl plan` (derivations in diffrl/parallel/plan.py) -------------


def h3_row(w: Widths, refiner: bool, rot: int) -> float:
    """Bytes one MiniMax-H3 block keeps per packed row (a token refiner block per text row)."""
    norms = 2 * w.rms * w.h + 2 * w.rms * w.a  # norm1, norm2; per-head q/k norms
    lora = 4 * (4 * w.h + w.a + w.f) + 6 * 4 * w.r  # q, k, v, FFN-up; out; FFN-down
    rows = 2 * 4 + 2 * 4 * w.heads + 4 * w.heads  # rstd of the norms, the attention's lse
    kept = norms + lora + 8 * w.a + 6 * w.f + rows  # SDPA's q, k, v, out; SwiGLU
    return kept if refiner else kept + 4 * 2 * w.h + 4 * 2 * rot  # adaLN tables; rope cos/sin


def geometry(model: nn.Module, w: Widths, conditioned: frozenset[str]) -> Geometry:
    """H3's packed rows, for ``diffrl plan``: with the task's condition keys ``conditioned``,
    FL2VA's two keyframes or Ref2VA's reference image and soundtrack (``_h3_ref2va``: one
    frame's rows, and the soundtrack as long as the generated audio, which
    ``ref2va_conditions`` cuts or pads it to), and the semantic branch's labels and vision
    blocks ahead of the text where the net has one."""
    tr, net = model.net.transformer, model.net
    cfg = tr.config
    _, f, hv, wv = net.video_shape
    pt, ph, pw = cfg.patch_size
    per_frame = (hv // ph) * (wv // pw)
    n_video = (f // pt) * per_frame
    n_audio = net.audio_shape[0] * net.audio_shape[1]
    n_text = model.family.max_text_len  # the longest prompt: a row's real length at most
    n_cond, n_ref, semantic = 0, 0, None  # keyframe or reference image rows, soundtrack rows
    if "ref_image" in conditioned:  # Ref2VA
        n_cond, n_ref, semantic = per_frame, n_audio, net.semantic_ref
    elif conditioned:  # FL2VA: first and last frames
        n_cond, semantic = 2 * per_frame, net.semantic
    if semantic is not None:
        n_text += len(semantic.prefix()[0])
    n = n_video + n_cond + n_ref + n_audio + n_text
    rot = 6 * cfg.rope_freq_dim  # cos and sin over 3 axes, twice (rotate_half)
    live = max(4 * w.h + 8 * w.f, 4 * w.h + 12 * w.a)
    blocks = [
        BlockCost("H3 block", cfg.num_layers, n * h3_row(w, False, rot), 2 * w.h * n, live * n),
        BlockCost(
            "token refiner",
            cfg.num_refiner_layers,
            n_text * h3_row(w, True, rot),
            2 * w.h * n_text,
            live * n_text,
        ),
    ]
    cond = f"{n_cond} reference image, {n_ref} reference audio" if n_ref else f"{n_cond} keyframe"
    what = f"{n:,} rows ({n_video:,} video, {cond}, {n_audio} audio, {n_text} text)"
    return Geometry(what, blocks, {"text_encoder": n_text})


FAMILY = FamilySpec(
    load=load,
    family_class=MiniMaxH3Family,
    presets=PRESETS,
    builtins={
        "builtin:avbench_h3": Builtin(
            "avbench_h3.safetensors", "diffrl pretrain task=avbench", preset="h3-avbench"
        ),
    },
    tp_plan=TP_PLAN,
    etp_plans={"qwen3_vl": QWEN3_VL_ENCODER_PLAN},
    sp_plan="diffusers",
    geometry=geometry,
)
