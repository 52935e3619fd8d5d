"""LTX-2 as a model family for text -> video + audio: ``LTX2VideoTransformer3DModel`` on Gemma-3.

What the family owns, and where diffusers' ``LTX2Pipeline`` says it:

- **Presentation, once** (contract 3). The pipeline strips each prompt and tokenizes it with
  Gemma's tokenizer (``<bos>`` prepended), padded on the LEFT to a fixed ``max_sequence_length``
  (1024). There is no chat template for generation (the one in ``enhance_prompt`` is an opt-in
  prompt rewriter, not the conditioning), so ``tokenize`` applies strip + ``<bos>`` and nothing
  else; ``null_ids`` is the empty prompt, the pipeline's default negative prompt.
- **Text conditions, once per prompt.** Gemma-3's hidden states of every layer (embeddings
  included) stacked and flattened, ``(L, hidden * (layers + 1))``, go through
  ``LTX2TextConnectors`` (frozen, like the encoder), which give the video and the audio stream
  their own text tokens and the mask the transformer uses. The cache keeps those three tensors.
- **Time** ("sigma_x1000"). The pipeline feeds ``FlowMatchEulerDiscreteScheduler``'s timestep,
  1000 * sigma, as ``timestep`` (and as ``sigma``, which LTX-2.3's prompt modulation reads), and
  steps with ``x += (sigma_next - sigma) * v``: the output is d x / d sigma = eps - x0 (+1).
- **One sigma for both modalities.** The pipeline runs the audio latents on a deep copy of the
  same scheduler with the same sigmas, so video and audio always share sigma. The family's one
  canonical sigma per sample is therefore exactly what LTX-2 is trained on: ``timestep`` and
  ``audio_timestep`` (and the cross-modal ``use_cross_timestep`` sigmas) are all 1000 * sigma,
  and the flow-matching target eps - x0 holds on the concatenation as on each part.
- **Latents: one flat vector per sample**, ``x = (D,)`` with ``D = D_video + D_audio``:
  ``x[:D_video]`` is the video latent ``(C, F, h, w)`` of ``AutoencoderKLLTX2Video`` (F =
  (T-1)/8 + 1, h = H/32 at real size), normalised ``(z - mean) * scaling / std`` as the pipeline
  does; ``x[D_video:]`` is the audio latent ``(C_a, L_a, M_a)`` of ``AutoencoderKLLTX2Audio``
  (L_a = round(T / fps * sample_rate / hop / 4) latent frames, M_a = mel_bins / 4), normalised
  in the packed ``(L_a, C_a * M_a)`` layout the pipeline normalises in. The net unflattens both,
  packs them into the transformer's video and audio tokens with the pipeline's own
  ``_pack_latents`` / ``_pack_audio_latents``, and flattens both velocities back.
- **Media.** ``decode`` runs the video VAE (the clip (B, T, H, W, 3) uint8, its ``fps``, its
  middle frame as ``image``) and the audio chain the pipeline runs: audio VAE -> mel
  spectrogram -> ``LTX2Vocoder`` -> a stereo waveform, averaged to mono ``audio`` (B, samples)
  float32 in [-1, 1] with its ``sample_rate`` (the vocoder's output rate, 24 kHz at real size).
- **Frame conditions** (I2AV, FL2VA; ``encode_conditions``, ``family.conditioned``). As
  ``LTX2ImageToVideoPipeline`` and ``LTX2ConditionPipeline`` condition: each given frame is
  resized, encoded ALONE (a one-frame clip, the posterior's mode) and normalised as the video
  latent is, once in the data stage (``PromptBatch.cond`` (B, K, C, 1, h, w), hashed like the
  ids). The first frame replaces latent frame 0's tokens with per-token timestep
  t * (1 - mask) = 0, and since the pipelines blend the x0 prediction with the clean condition
  where the mask is 1, frame 0's velocity is (x - condition) / sigma: the sampler lands on the
  condition, and no parameter (nor the condition) gets gradient there. FL2VA's last frame is
  appended as clean (timestep 0) keyframe tokens with the pipeline's own keyframe RoPE bounds
  (``_prepare_keyframe_coords``), placed at the clip's last PIXEL frame (diffusers' latent
  index -1 would put a single frame 8 frames early, at (F - 2) * 8 + 1); their outputs are
  dropped. T2VA never enters this path. Frame conditions need ``patch_size_t`` 1 (LTX-2.0's).
- **Serving layout** (contract 2). Video and audio self-attention (``attn1``, ``audio_attn1``:
  q, k and v read the same input, so a fused QKV is sound) held as one ``to_qkv`` weight; the
  cross-attentions (text, a2v, v2a) read another input for k/v and stay unfused. Both FFN
  up-projections are held as two row shards in swapped order.
- **Pipeline parity** (contract 1, ``reference``). ``LTX2Pipeline`` over the model's own
  components with every guidance off, from diffrl's noise split into packed video latents and
  audio latents (denormalised: the pipeline normalises the audio it is handed). The probe
  compares every transformer input at its first calls: both streams' latents, ``timestep`` and
  ``sigma``, both text states and their mask, frame counts, sizes, fps and the RoPE
  coordinates, which the net passes as the pipeline does (the transformer's own default).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from math import prod
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from diffrl.errors import ConfigError, ContractError
from diffrl.models import memory
from diffrl.models.families._diffusers import (
    TINY_WORDS,
    DiffusersNet,
    check_pipeline_dir,
    load_component,
    load_source,
    missing_error,
    random_component,
    save_pipeline_dir,
    tokenize_padded,
)
from diffrl.models.families._encoder_plans import GEMMA3_ENCODER_PLAN
from diffrl.models.family import (
    FamilyModel,
    FamilySpec,
    HasMediaGeometry,
    HasModalities,
    TakesConditions,
    TokenBatch,
    hash_rows,
    linear_flops,
)
from diffrl.models.memory import Widths
from diffrl.models.probe import HasReferencePipeline, Reference, flow_scheduler
from diffrl.parallel.tp import LocalRope, Plan, ShardedRMSNorm, optional
from diffrl.sync.layouts import fuse_qkv, merge, split_swapped
from diffrl.sync.weights import SlotMap
from diffrl.types import images_from_uint8

# Every attention of an LTX2VideoTransformerBlock: self (video, audio), text cross (video,
# audio), and the cross-modal pair (a2v: video queries audio; v2a: audio queries video).
ATTENTIONS = (
    "attn1",
    "audio_attn1",
    "attn2",
    "audio_attn2",
    "audio_to_video_attn",
    "video_to_audio_attn",
)
# peft matches a suffix at a dot, so "attn1.to_q" does not also match "audio_attn1.to_q"
LORA_TARGETS = tuple(
    f"{attn}.{proj}" for attn in ATTENTIONS for proj in ("to_q", "to_k", "to_v", "to_out.0")
) + ("ff.net.0.proj", "ff.net.2", "audio_ff.net.0.proj", "audio_ff.net.2")
COMPONENTS = {
    "transformer": "LTX2VideoTransformer3DModel",
    "text_encoder": "Gemma3ForConditionalGeneration",
    "tokenizer": "GemmaTokenizerFast",
    "connectors": "LTX2TextConnectors",
    "vae": "AutoencoderKLLTX2Video",
    "audio_vae": "AutoencoderKLLTX2Audio",
    "vocoder": "LTX2Vocoder",
}
PIPELINE = "LTX2Pipeline"
SELF_ATTENTIONS = ("attn1", "audio_attn1")
# the frame conditions a task may give (``encode_conditions``): I2AV the first frame, FL2VA the
# first and the last; K = 1 or 2 keyframe latents per row, in this order
CONDITION_MODES = {("first_frame",): "i2av", ("first_frame", "last_frame"): "fl2va"}
FFN_UP = ("ff.net.0.proj", "audio_ff.net.0.proj")

_GEMMA3_12B = dict(  # google/gemma-3-12b-it, as LTX-2 ships it (48 layers, 3840 wide)
    text_config=dict(
        vocab_size=262208,
        hidden_size=3840,
        intermediate_size=15360,
        num_hidden_layers=48,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=256,
        sliding_window=1024,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
    ),
    vision_config=dict(
        hidden_size=1152,
        intermediate_size=4304,
        num_hidden_layers=27,
        num_attention_heads=16,
        image_size=896,
        patch_size=14,
    ),
    mm_tokens_per_image=256,
)

# ltx2 at real size: the LTX-2.0 19 B audio-video transformer (the class defaults, which are the
# 2.0 conversion config), Gemma-3-12B, and the VAE/vocoder of the 2.0 conversion script.
# 121 frames at 512 x 512 are 16 x 16 x 16 = 4096 video tokens plus 126 audio tokens.
PRESETS: dict[str, dict] = {
    "ltx2": dict(
        transformer=dict(),
        text_encoder=_GEMMA3_12B,
        connectors=dict(),  # 3840 wide, 49 = 48 + 1 hidden states, 128 registers
        vae=dict(spatial_compression_ratio=32, temporal_compression_ratio=8, decoder_causal=False),
        audio_vae=dict(),  # 8 latent channels, 64 mel bins, 16 kHz with hop 160
        vocoder=dict(),  # 24 kHz out: 100 mel frames/s * 6*5*2*2*2
        resolution=512,
        frames=121,
        max_text_len=1024,
        fps=24.0,
    ),
    "ltx2-tiny": dict(
        transformer=dict(
            in_channels=8,
            out_channels=8,
            num_attention_heads=2,
            attention_head_dim=16,
            cross_attention_dim=32,
            vae_scale_factors=(2, 8, 8),
            audio_in_channels=16,  # C_a * M_a = 4 * (16 / 4)
            audio_out_channels=16,
            audio_num_attention_heads=2,
            audio_attention_head_dim=8,
            audio_cross_attention_dim=16,
            num_layers=2,
            caption_channels=32,
        ),
        text_encoder=dict(
            text_config=dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=1,
                head_dim=16,
                sliding_window=16,
                max_position_embeddings=64,
            ),
            vision_config=dict(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=1,
                num_attention_heads=2,
                image_size=28,
                patch_size=14,
            ),
            mm_tokens_per_image=4,
        ),
        connectors=dict(
            caption_channels=32,
            text_proj_in_factor=3,  # 2 layers + the embeddings
            video_connector_num_attention_heads=2,
            video_connector_attention_head_dim=16,
            video_connector_num_layers=1,
            video_connector_num_learnable_registers=8,
            audio_connector_num_attention_heads=2,
            audio_connector_attention_head_dim=16,
            audio_connector_num_layers=1,
            audio_connector_num_learnable_registers=8,
            connector_rope_base_seq_len=32,
        ),
        vae=dict(  # x8 spatial (patch 4, one down block), x2 temporal
            latent_channels=8,
            block_out_channels=(8,),
            decoder_block_out_channels=(8,),
            layers_per_block=(1, 1),
            decoder_layers_per_block=(1, 1),
            spatio_temporal_scaling=(True,),
            decoder_spatio_temporal_scaling=(True,),
            decoder_inject_noise=(False, False),
            downsample_type=("spatiotemporal",),
            upsample_type=("spatiotemporal",),
            upsample_residual=(False,),
            upsample_factor=(1,),
            patch_size=4,
            decoder_causal=False,
        ),
        audio_vae=dict(  # latents_mean has base_channels entries: = C_a * M_a = 4 * 4
            base_channels=16,
            ch_mult=(1, 2, 2),
            num_res_blocks=1,
            resolution=32,
            latent_channels=4,
            mel_bins=16,
        ),
        vocoder=dict(  # 100 mel frames/s * 4*4*10 = 16 kHz, the rate it claims
            in_channels=32,  # 2 mel channels (stereo) * 16 mel bins
            hidden_channels=32,
            upsample_kernel_sizes=[8, 8, 20],
            upsample_factors=[4, 4, 10],
            resnet_kernel_sizes=[3],
            resnet_dilations=[[1, 3]],
            output_sampling_rate=16000,
        ),
        resolution=32,
        frames=9,  # 9 frames at 24 fps: 0.375 s of video, 9 audio latent frames (0.33 s)
        max_text_len=16,
        fps=24.0,
    ),
}
# the pipeline's defaults: 121 frames at 512 x 768 (here square) and 24 fps, 1024 text tokens
DEFAULT_RESOLUTION, DEFAULT_FRAMES, DEFAULT_MAX_TEXT_LEN, DEFAULT_FPS = 512, 121, 1024, 24.0


def present(text: str) -> str:
    """The one presentation of a prompt: the pipeline's ``p.strip()`` (``<bos>`` is added by
    the tokenizer's own post-processor, as Gemma's is)."""
    return text.strip()


@dataclass(frozen=True)
class Geometry:
    """Where the two latents sit in one sample's flat x, and the clip they decode to."""

    video: tuple[int, int, int, int]  # (C, F, h, w) latent
    audio: tuple[int, int, int]  # (C_a, L_a, M_a) latent
    fps: float

    @property
    def split(self) -> tuple[int, int]:
        return prod(self.video), prod(self.audio)

    def unflatten(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(B, D) -> video (B, C, F, h, w), audio (B, C_a, L_a, M_a)."""
        v, a = x.split(self.split, dim=1)
        return v.reshape(-1, *self.video), a.reshape(-1, *self.audio)


def _pipeline():
    # the pipeline's own (static) pack/unpack and (de)normalisation, reused rather than copied
    from diffusers.pipelines.ltx2.pipeline_ltx2 import LTX2Pipeline

    return LTX2Pipeline


def keyframe_coords(net: LTX2Net, frame: int) -> Tensor:
    """(1, 3, h * w, 2) RoPE bounds of one appended single-frame keyframe at pixel frame
    ``frame``: ``LTX2ConditionPipeline._prepare_keyframe_coords`` itself (handed the sizes it
    reads off the pipeline), so the keyframe tokens sit where that pipeline puts them."""
    from diffusers.pipelines.ltx2.pipeline_ltx2_condition import LTX2ConditionPipeline

    vae, cfg, g = net.frozen.vae, net.transformer.config, net.geometry
    sizes = SimpleNamespace(
        transformer_spatial_patch_size=cfg.patch_size,
        transformer_temporal_patch_size=cfg.patch_size_t,
        vae_temporal_compression_ratio=vae.temporal_compression_ratio,
        vae_spatial_compression_ratio=vae.spatial_compression_ratio,
    )
    _, _, h, w = g.video
    device = next(net.transformer.parameters()).device
    return LTX2ConditionPipeline._prepare_keyframe_coords(
        sizes, 1, h, w, pixel_frame_idx=frame, num_pixel_frames=1, fps=g.fps, device=device
    )


class LTX2Net(DiffusersNet):
    """forward(x (B, D), 1000 sigma (B,), input_ids (B, L), cond (B, K, C, 1, h, w) or None)
    -> eps - x0 as (B, D)."""

    def __init__(self, transformer, text_encoder, connectors, vae, audio_vae, vocoder, pad_id):
        super().__init__(
            transformer,
            text_encoder=text_encoder,
            connectors=connectors,
            vae=vae,
            audio_vae=audio_vae,
            vocoder=vocoder,
        )
        self.pad_id = pad_id
        self.geometry: Geometry | None = None  # set by the family once the sample size is known
        self.frames = 0  # pixel frames of a clip, set with the geometry (the last keyframe's place)
        self.keyframes: Tensor | None = None  # (B, K, C, 1, h, w), set by family.conditioned()

    def encode_uncached(self, input_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Gemma-3's per-layer hidden states through the connectors (``_get_gemma_prompt_embeds``
        then ``connectors(..., padding_side="left")``): video text (b, L, d), audio text
        (b, L, d_a), and the (b, L) mask the transformer attends with."""
        mask = (input_ids != self.pad_id).long()  # (b, L), left-padded
        out = self.frozen.text_encoder(
            input_ids=input_ids, attention_mask=mask, output_hidden_states=True
        )
        embeds = torch.stack(out.hidden_states, dim=-1).flatten(2, 3)  # (b, L, hidden * layers)
        return self.frozen.connectors(embeds, mask, padding_side="left")

    def forward(
        self, x: Tensor, t: Tensor, input_ids: Tensor, cond: Tensor | None = None
    ) -> Tensor:
        """``cond``: (B, K, C, 1, h, w) keyframe latents per row (K = 1: I2AV, 2: FL2VA), as
        the data stage encoded them; else the ones ``family.conditioned`` set; else none
        (T2VA, the path below, untouched by the conditioned one)."""
        cond = cond if cond is not None else self.keyframes
        if cond is not None:
            return self._conditioned(x, t, input_ids, cond)
        g, cfg, pipe, tf = self.geometry, self.transformer.config, _pipeline(), self.transformer
        video, audio = g.unflatten(x)
        _, f, h, w = g.video
        _, frames_a, mels_a = g.audio
        tokens = pipe._pack_latents(video, cfg.patch_size, cfg.patch_size_t)
        # the RoPE coordinates, built as the pipeline builds them (the transformer's own
        # default when left out), so the parity probe sees them
        coords = tf.rope.prepare_video_coords(x.shape[0], f, h, w, x.device, fps=g.fps)
        out_v, out_a = self._transformer(tokens, audio, input_ids, t, coords)
        p, p_t = cfg.patch_size, cfg.patch_size_t
        out_v = pipe._unpack_latents(out_v, f // p_t, h // p, w // p, p, p_t)
        out_a = pipe._unpack_audio_latents(out_a, frames_a, mels_a)
        return torch.cat([out_v.flatten(1), out_a.flatten(1)], dim=1)

    def _conditioned(self, x: Tensor, t: Tensor, input_ids: Tensor, cond: Tensor) -> Tensor:
        """I2AV / FL2VA as diffusers' ``LTX2ImageToVideoPipeline`` and ``LTX2ConditionPipeline``
        condition: the first keyframe's latent REPLACES latent frame 0 (mask 1: per-token
        timestep t * (1 - mask) = 0), the last one is APPENDED as extra video tokens at timestep
        0 placed (RoPE) at the clip's last pixel frame, and their outputs are dropped. The
        pipelines blend the x0 prediction with the clean condition where the mask is 1, so frame
        0's velocity is (x - x0) / sigma with x0 = the condition: the sampler walks frame 0
        straight onto it (exactly, at sigma = 0, for an Euler step), and no parameter reaches
        it (no gradient; with x0's frame 0 the condition, its flow-matching loss is 0)."""
        g, cfg, pipe, tf = self.geometry, self.transformer.config, _pipeline(), self.transformer
        c, f, h, w = g.video
        b, k = x.shape[0], cond.shape[1] if cond.ndim == 6 else 0
        if cond.shape[0] != b or k not in (1, 2) or tuple(cond.shape[2:]) != (c, 1, h, w):
            raise ContractError(
                f"ltx2: conditions of shape {tuple(cond.shape)} for {b} rows; expected "
                f"(B, K, {c}, 1, {h}, {w}) keyframe latents, K = 1 (I2AV) or 2 (FL2VA)"
            )
        cond = cond.detach().to(x.dtype)
        video, audio = g.unflatten(x)
        _, frames_a, mels_a = g.audio
        p, p_t = cfg.patch_size, cfg.patch_size_t
        first = cond[:, 0]  # (b, C, 1, h, w)
        tokens = pipe._pack_latents(torch.cat([first, video[:, :, 1:]], dim=2), p, p_t)
        n, n_first = tokens.shape[1], (h // p) * (w // p)  # patch_size_t 1: frame 0's tokens
        timestep = t[:, None].expand(b, n).clone()
        timestep[:, :n_first] = 0
        coords = tf.rope.prepare_video_coords(b, f, h, w, x.device, fps=g.fps)
        if k == 2:  # the last frame: appended tokens, held clean, at the last pixel frame
            last = pipe._pack_latents(cond[:, 1], p, p_t)
            tokens = torch.cat([tokens, last], dim=1)
            timestep = torch.cat([timestep, timestep.new_zeros(b, last.shape[1])], dim=1)
            kf = keyframe_coords(self, self.frames - 1).to(coords)
            coords = torch.cat([coords, kf.expand(b, -1, -1, -1)], dim=2)
        out_v, out_a = self._transformer(tokens, audio, input_ids, t, coords, token_t=timestep)
        out_v = pipe._unpack_latents(out_v[:, :n], f // p_t, h // p, w // p, p, p_t)
        sigma = t.float().view(b, 1, 1, 1, 1) / 1000  # native 1000 sigma -> sigma
        held = (video[:, :, :1].float() - first.float()) / sigma.clamp_min(1e-12)
        held = torch.where(sigma > 0, held, torch.zeros_like(held))
        out_v = torch.cat([held.to(out_v), out_v[:, :, 1:]], dim=2)
        out_a = pipe._unpack_audio_latents(out_a, frames_a, mels_a)
        return torch.cat([out_v.flatten(1), out_a.flatten(1)], dim=1)

    def _transformer(
        self,
        tokens: Tensor,
        audio: Tensor,
        input_ids: Tensor,
        t: Tensor,
        video_coords: Tensor,
        token_t: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """The one transformer call of both paths: packed video ``tokens`` (B, N, C p p p_t)
        placed at ``video_coords``, and the audio latents (B, C_a, L_a, M_a), both attending to
        ``input_ids``' prompt, at the native time ``t`` (B,); ``token_t`` (B, N) overrides the
        video's per token (0 on conditioning tokens). Returns the packed (video, audio) outputs.
        """
        g, tf = self.geometry, self.transformer
        video_txt, audio_txt, txt_mask = self.conditions(input_ids, dtype=audio.dtype)
        _, f, h, w = g.video
        _, frames_a, _ = g.audio
        b = audio.shape[0]
        return tf(
            hidden_states=tokens,
            audio_hidden_states=_pipeline()._pack_audio_latents(audio),  # (B, L_a, C_a * M_a)
            encoder_hidden_states=video_txt,
            audio_encoder_hidden_states=audio_txt,
            timestep=t if token_t is None else token_t,
            # T2VA leaves it to the transformer's default (timestep), as the pipeline does: the
            # parity probe refuses an input the pipeline does not pass
            audio_timestep=None if token_t is None else t,
            sigma=t,  # as the pipeline passes it (LTX-2.3's prompt modulation reads it)
            encoder_attention_mask=txt_mask,
            audio_encoder_attention_mask=txt_mask,
            num_frames=f,
            height=h,
            width=w,
            fps=g.fps,
            audio_num_frames=frames_a,
            video_coords=video_coords,
            audio_coords=tf.audio_rope.prepare_audio_coords(b, frames_a, audio.device),
            # the pipeline's default: cross-modal modulation at the sample's sigma (not a
            # conditioning token's 0; with equal sigmas the same either way)
            use_cross_timestep=True,
            return_dict=False,
        )


# the transformer's per-sample timestep embedders (``LTX2AdaLayerNormSingle``), as ``flops``
# counts them: the streams' adaLN, the audio-video pair's scale/shift and its gates
TIME_EMBEDDERS = (
    "time_embed",
    "audio_time_embed",
    "av_cross_attn_video_scale_shift",
    "av_cross_attn_audio_scale_shift",
    "av_cross_attn_video_a2v_gate",
    "av_cross_attn_audio_v2a_gate",
)


class LTX2Family(TakesConditions, HasReferencePipeline, HasMediaGeometry, HasModalities):
    name = "ltx2"
    native_convention = "sigma_x1000"
    lora_targets = LORA_TARGETS
    media = frozenset({"video", "fps", "image", "audio", "sample_rate"})

    def __init__(
        self, tokenizer, net: LTX2Net, resolution: int, frames: int, max_text_len: int, fps: float
    ):
        self.tokenizer, self.net = tokenizer, net
        self.resolution, self.frames, self.max_text_len = resolution, frames, max_text_len
        vae, audio_vae = net.frozen.vae, net.frozen.audio_vae
        cfg = net.transformer.config
        s, s_t = vae.spatial_compression_ratio, vae.temporal_compression_ratio
        if (frames - 1) % s_t or resolution % (s * cfg.patch_size):
            raise ConfigError(
                f"ltx2: frames {frames} must be 1 + a multiple of {s_t}, and resolution "
                f"{resolution} a multiple of {s * cfg.patch_size} "
                f"(VAE x{s}, patch {cfg.patch_size})"
            )
        a = audio_vae.config
        per_second = a.sample_rate / a.mel_hop_length / audio_vae.temporal_compression_ratio
        video = (
            vae.config.latent_channels,
            (frames - 1) // s_t + 1,
            resolution // s,
            resolution // s,
        )
        audio = (
            a.latent_channels,
            round(frames / fps * per_second),
            a.mel_bins // audio_vae.mel_compression_ratio,
        )
        if cfg.in_channels != video[0] * cfg.patch_size**2 * cfg.patch_size_t:
            raise ConfigError(f"ltx2: transformer in_channels {cfg.in_channels} vs VAE {video}")
        if cfg.audio_in_channels != audio[0] * audio[2]:
            raise ConfigError(
                f"ltx2: transformer audio_in_channels {cfg.audio_in_channels} != audio latent "
                f"channels x mel bins {audio[0]} x {audio[2]}"
            )
        if video[1] % cfg.patch_size_t:
            raise ConfigError(f"ltx2: {video[1]} latent frames vs patch_size_t {cfg.patch_size_t}")
        net.geometry, net.frames = Geometry(video, audio, float(fps)), frames
        self.fps, self.sample_rate = (
            float(fps),
            float(net.frozen.vocoder.config.output_sampling_rate),
        )

    # --- contract 3 ---------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str]) -> TokenBatch:
        ids, mask = tokenize_padded(self.tokenizer, [present(t) for t in texts], self.max_text_len)
        return TokenBatch(ids, mask, hash_rows(ids))

    def null_ids(self) -> Tensor:
        return self.tokenize([""]).input_ids[0]  # the pipeline's default negative prompt

    # --- shapes and media ---------------------------------------------------------------
    @property
    def geometry(self) -> Geometry:
        return self.net.geometry

    def media_geometry(self) -> dict[str, float]:
        """What a task renders media at (and the start-up probe its synthetic frames)."""
        return dict(
            frames=self.frames, size=self.resolution, fps=self.fps, sample_rate=self.sample_rate
        )

    def latent_shape(self) -> tuple[int, ...]:
        return (sum(self.geometry.split),)

    def modality_split(self) -> tuple[int, int]:
        """(n_video, n_audio) elements of the flat x, video first (modality credit)."""
        return self.geometry.split

    def _video_stats(self, like: Tensor) -> tuple[Tensor, Tensor, float]:
        vae = self.net.frozen.vae
        view = (1, -1, 1, 1, 1)
        return (
            vae.latents_mean.view(view).to(like),
            vae.latents_std.view(view).to(like),
            vae.config.scaling_factor,
        )

    @torch.no_grad()
    def decode(self, latents: Tensor) -> dict[str, Tensor]:
        """(B, D) -> the clip, its fps and middle frame, and its mono waveform and rate."""
        f = self.net.frozen
        g, pipe = self.geometry, _pipeline()
        video, audio = g.unflatten(latents.to(next(f.vae.parameters())))
        mean, std, scale = self._video_stats(video)
        timestep = None  # decode_timestep 0 with no decode noise, as the pipeline's defaults
        if f.vae.config.timestep_conditioning:
            timestep = torch.zeros(video.shape[0]).to(video)
        clip = f.vae.decode(video * std / scale + mean, timestep, return_dict=False)[0]
        clip = ((clip.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        clip = clip.permute(0, 2, 3, 4, 1).cpu()  # (B, T, H, W, 3)
        # audio: denormalised in the packed layout the pipeline normalises in
        packed = pipe._pack_audio_latents(audio)  # (B, L_a, C_a * M_a)
        packed = pipe._denormalize_audio_latents(
            packed, f.audio_vae.latents_mean, f.audio_vae.latents_std
        )
        z = pipe._unpack_audio_latents(packed, g.audio[1], g.audio[2])
        mel = f.audio_vae.decode(z.to(next(f.audio_vae.parameters())), return_dict=False)[0]
        wave = f.vocoder(mel.to(next(f.vocoder.parameters())))  # (B, channels, samples)
        wave = wave.float().mean(dim=1).clamp(-1, 1).cpu()  # stereo -> mono (B, samples)
        b = clip.shape[0]
        return {
            "video": clip,
            "fps": torch.full((b,), self.fps),
            "image": clip[:, clip.shape[1] // 2],
            "audio": wave,
            "sample_rate": torch.full((b,), self.sample_rate),
        }

    @torch.no_grad()
    def encode_pixels(self, pixels: Tensor) -> Tensor:
        """(B, 3, T, H, W) clips in [-1, 1] (an image (B, 3, H, W) is a still clip of
        ``frames`` frames) -> (B, D). Pixels carry no sound: the audio part is 0, the mean of
        the normalised audio latents."""
        vae = self.net.frozen.vae
        if pixels.ndim == 4:
            pixels = pixels.unsqueeze(2).expand(-1, -1, self.frames, -1, -1)
        z = vae.encode(pixels.to(next(vae.parameters()))).latent_dist.mode()
        mean, std, scale = self._video_stats(z)
        video = ((z - mean) * scale / std).flatten(1)
        return torch.cat([video, video.new_zeros(video.shape[0], self.geometry.split[1])], dim=1)

    # --- frame conditions (I2AV, FL2VA) ----------------------------------------------------
    @torch.no_grad()
    def encode_conditions(self, conditions: Sequence[dict]) -> Tensor:
        """Per-prompt frame conditions, {"first_frame"} (I2AV) or {"first_frame",
        "last_frame"} (FL2VA), (H, W, 3) uint8 each, -> (N, K, C, 1, h, w) keyframe latents,
        encoded once in the data stage (the data stage hashes them beside the ids)."""
        keys = tuple(sorted(conditions[0])) if conditions else ()
        if keys not in CONDITION_MODES or any(tuple(sorted(c)) != keys for c in conditions):
            allowed = " or ".join("+".join(m) for m in CONDITION_MODES)
            raise ConfigError(
                f"config key 'data.task': ltx2 conditions a prompt on frames, {allowed} (I2AV, "
                f"FL2VA); this task gives {'+'.join(keys) or 'none'} (per row: "
                f"{sorted({'+'.join(sorted(c)) for c in conditions})})"
            )
        cfg = self.net.transformer.config
        if cfg.patch_size_t != 1 or (len(keys) == 2 and self.geometry.video[1] < 2):
            raise ConfigError(
                f"config key 'model.frames' = {self.frames}: ltx2's frame conditions take the "
                f"first latent frame's tokens alone (patch_size_t 1, here {cfg.patch_size_t}) "
                f"and, for FL2VA, 2 or more latent frames (here {self.geometry.video[1]})"
            )
        frames = np.stack([np.stack([c[key] for key in keys]) for c in conditions])
        device = next(self.net.transformer.parameters()).device
        return self.keyframe_latents(torch.from_numpy(frames).to(device)).float().cpu()

    @torch.no_grad()
    def keyframe_latents(self, frames: Tensor) -> Tensor:
        """(B, K, H, W, 3) uint8 frames -> (B, K, C, 1, h, w) latents: each frame resized to
        the model's size (bilinear, as the condition pipeline resizes), encoded ALONE as a
        one-frame clip (the pipelines' ``vae.encode(image.unsqueeze(2))``, the posterior's
        mode), normalised as the sample's video latent is (the pipelines normalise conditions
        without ``scaling_factor``, which is 1 in LTX-2's VAEs, so the two agree)."""
        if frames.dtype != torch.uint8 or frames.ndim != 5 or frames.shape[-1] != 3:
            raise ValueError(
                f"frame conditions must be (B, K, H, W, 3) uint8; got {tuple(frames.shape)} "
                f"{frames.dtype}"
            )
        b, k = frames.shape[:2]
        pixels = images_from_uint8(frames.flatten(0, 1))  # (b * k, 3, H, W) in [-1, 1]
        size = (self.resolution, self.resolution)
        if tuple(pixels.shape[-2:]) != size:
            pixels = F.interpolate(pixels, size=size, mode="bilinear", align_corners=False)
        vae = self.net.frozen.vae
        z = vae.encode(pixels.unsqueeze(2).to(next(vae.parameters()))).latent_dist.mode()
        mean, std, scale = self._video_stats(z)
        z = (z - mean) * scale / std  # (b * k, C, 1, h, w)
        return z.reshape(b, k, *z.shape[1:])

    @contextlib.contextmanager
    def conditioned(self, model: FamilyModel, keyframes: Tensor) -> Iterator[FamilyModel]:
        """I2AV (K = 1) / FL2VA (K = 2): within the block, ``model`` conditions every row on
        ``keyframes`` (B, K, C, 1, h, w), frozen (detached; no gradient reaches them)."""
        if keyframes.ndim != 6 or keyframes.shape[1] not in (1, 2):
            raise ConfigError(
                f"ltx2: keyframes of shape {tuple(keyframes.shape)}; (B, K, C, 1, h, w) with K "
                "1 (first frame: I2AV) or 2 (first and last: FL2VA)"
            )
        model.net.keyframes = keyframes.detach()
        try:
            yield model
        finally:
            model.net.keyframes = None

    # --- contract 1: the reference pipeline ------------------------------------------------
    def reference(self, model: FamilyModel, shift: float) -> Reference:
        """``LTX2Pipeline`` over this model's own components, every guidance off (CFG, STG and
        modality guidance at their neutral scales, no rescale), no prompt enhancement. Its
        audio runs on a copy of the video's scheduler with the same sigmas, as diffrl's one
        sigma per sample does, so both sides take the same Euler step on both modalities."""
        f = model.net.frozen
        pipe = _pipeline()(
            scheduler=flow_scheduler(shift), vae=f.vae, audio_vae=f.audio_vae,
            text_encoder=f.text_encoder, tokenizer=self.tokenizer, connectors=f.connectors,
            transformer=model.net.transformer, vocoder=f.vocoder,
        )  # fmt: skip
        pipe.set_progress_bar_config(disable=True)
        g, cfg = self.geometry, model.net.transformer.config
        size = g.video[2] * pipe.vae_spatial_compression_ratio
        # the pipeline warns that packed latents' dims cannot be inferred: it is given them
        log = logging.getLogger(type(pipe).__module__)

        def call(prompt: str, noise: Tensor, grid) -> None:
            video, audio = g.unflatten(noise)
            # video goes in packed, which the pipeline takes as it is (a 5-D one it would
            # normalise); audio it normalises whatever its layout, so it is handed diffrl's
            # (normalised) audio latent denormalised, in the packed layout it normalises in
            audio = pipe._denormalize_audio_latents(
                pipe._pack_audio_latents(audio), f.audio_vae.latents_mean, f.audio_vae.latents_std
            )
            kwargs = dict(
                prompt=prompt, height=size, width=size, num_frames=self.frames,
                frame_rate=g.fps, num_inference_steps=len(grid), sigmas=list(grid),
                guidance_scale=1.0, stg_scale=0.0, modality_scale=1.0, guidance_rescale=0.0,
                audio_guidance_scale=1.0, audio_stg_scale=0.0, audio_modality_scale=1.0,
                audio_guidance_rescale=0.0, max_sequence_length=self.max_text_len,
                latents=pipe._pack_latents(video, cfg.patch_size, cfg.patch_size_t),
                audio_latents=audio, output_type="latent",
                # noise_scale 0 still draws its (0 *) noise: from a generator of its own
                noise_scale=0.0, generator=torch.Generator(noise.device).manual_seed(0),
            )  # fmt: skip
            level = log.level
            log.setLevel(logging.ERROR)
            try:
                pipe(**kwargs)
            finally:
                log.setLevel(level)

        return Reference(model.net.transformer, call)

    # --- contract 2 and cost ------------------------------------------------------------
    def serving_layout(self, model: nn.Module) -> SlotMap:
        n = len(model.net.transformer.transformer_blocks)
        blocks = [f"net.transformer.transformer_blocks.{i}" for i in range(n)]
        # LTX2Attention's processor always calls to_q/to_k/to_v: the fused weight is the one
        # tensor the sync writes, and RowViews of it stand where q, k and v stood
        qkv = fuse_qkv(model, [f"{b}.{a}" for b in blocks for a in SELF_ATTENTIONS])
        ffn = split_swapped(model, [f"{b}.{u}" for b in blocks for u in FFN_UP], n_shards=2)
        return merge(qkv, ffn)

    def flops(self, batch: int, input_ids: Tensor | None = None, cond=None) -> float:
        """One transformer forward (Gemma and the connectors run once per prompt, cached): the
        Linears at 2 FLOPs per weight per token of the stream they read, attention 4 N_q N_k d
        per attention. Per block, in each stream (width d, or d_a for audio): self-attention's
        q/k/v/out (4 d^2) and the text cross-attention's q/out (2 d^2) on its own tokens, that
        cross-attention's k/v (2 d^2) on the text tokens, the 4x MLP (8 d^2); the audio-video
        pair works at the audio width: a2v's q/out and v2a's k/v on the video tokens (4 d d_a),
        a2v's k/v and v2a's q/out on the audio tokens (4 d_a^2). Outside the blocks: the patch
        projections in and out and the caption MLPs (per text token; the text is padded to
        ``max_text_len``), and per sample the six timestep MLPs with their tables (the two
        streams' adaLN, the audio-video pair's scale/shift and gates). Frame conditions
        (``cond``, else ``family.conditioned``'s keyframes; I2AV, FL2VA) give the video tokens
        a timestep each, so the video adaLN's MLP runs per token, and FL2VA's last frame adds
        one frame of video tokens."""
        cfg = self.net.transformer.config
        d = cfg.num_attention_heads * cfg.attention_head_dim
        d_a = cfg.audio_num_attention_heads * cfg.audio_attention_head_dim
        _, f, h, w = self.geometry.video
        n = f * h * w // (cfg.patch_size**2 * cfg.patch_size_t)
        cond = cond if cond is not None else self.net.keyframes
        if cond is not None and cond.shape[1] == 2:  # FL2VA: the appended last frame
            n += h * w // cfg.patch_size**2
        n_a, n_t = self.geometry.audio[1], self.max_text_len
        video = 2 * n * (4 + 2 + 8) * d * d + 2 * n_t * 2 * d * d
        audio = 2 * n_a * (4 + 2 + 8) * d_a * d_a + 2 * n_t * 2 * d_a * d_a
        cross = 2 * n * 4 * d * d_a + 2 * n_a * 4 * d_a * d_a  # a2v and v2a projections
        attn = 4 * (n * n * d + n * n_t * d + n_a * n_a * d_a + n_a * n_t * d_a + 2 * n * n_a * d_a)
        io = 2 * n * d * (cfg.in_channels + cfg.out_channels)
        io += 2 * n_a * d_a * (cfg.audio_in_channels + cfg.audio_out_channels)
        if cfg.use_prompt_embeddings:  # LTX-2.0's caption projections: Linear, GELU, Linear
            io += 2 * n_t * (cfg.caption_channels * (d + d_a) + d * d + d_a * d_a)
        tr = self.net.transformer
        for name in TIME_EMBEDDERS:  # each: a 256-wide sinusoid -> width -> width -> k tables
            k, width = getattr(tr, name).num_mod_params, d_a if "audio" in name else d
            rows = n if name == "time_embed" and cond is not None else 1
            io += linear_flops(rows, 256 + width, width) + linear_flops(rows, width, k * width)
        return float(batch * (cfg.num_layers * (video + audio + cross + attn) + io))


# --- building ---------------------------------------------------------------------------------


def build(
    transformer,
    text_encoder,
    connectors,
    vae,
    audio_vae,
    vocoder,
    tokenizer,
    resolution: int,
    frames: int,
    max_text_len: int,
    fps: float = DEFAULT_FPS,
    convention: str = "",
) -> FamilyModel:
    tokenizer.padding_side = "left"  # "Gemma expects left padding" (the pipeline sets it too)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    net = LTX2Net(
        transformer, text_encoder, connectors, vae, audio_vae, vocoder, tokenizer.pad_token_id
    )
    family = LTX2Family(tokenizer, net, resolution, frames, max_text_len, fps)
    return FamilyModel(net, family, convention)


_GEMMA_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>"]  # Gemma's own ids 0..3


def tiny_tokenizer(max_len: int, words=TINY_WORDS):
    """A word-level Gemma-style tokenizer: Gemma's specials at Gemma's ids, ``<bos>`` prepended,
    left padding. (``_diffusers.word_tokenizer`` knows CLIP, T5 and Qwen; Gemma's bos-only
    template is these few lines, kept here rather than growing that shared function.)"""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*_GEMMA_SPECIALS, *sorted(set(words))])}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(_GEMMA_SPECIALS)
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", vocab["<bos>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_max_length=max_len,
        padding_side="left",
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<bos>",
        unk_token="<unk>",
    )


def _classes() -> dict[str, type]:
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video
    from diffusers import LTX2VideoTransformer3DModel as Transformer
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3ForConditionalGeneration

    return dict(
        transformer=Transformer,
        text_encoder=Gemma3ForConditionalGeneration,
        connectors=LTX2TextConnectors,
        vae=AutoencoderKLLTX2Video,
        audio_vae=AutoencoderKLLTX2Audio,
        vocoder=LTX2Vocoder,
    )


def _random(preset: str, dtype: torch.dtype, device: torch.device) -> dict:
    spec = PRESETS[preset]
    tok = tiny_tokenizer(spec["max_text_len"])
    te = {k: dict(v) if isinstance(v, dict) else v for k, v in spec["text_encoder"].items()}
    if preset != "ltx2":  # the real preset keeps Gemma's vocabulary; the tiny one the word list
        te["text_config"]["vocab_size"] = len(tok)
        # Gemma-3's image token ids must lie inside the vocabulary
        te |= dict(image_token_index=len(tok) - 1, boi_token_index=2, eoi_token_index=1)
    parts = {
        sub: random_component(cls, te if sub == "text_encoder" else spec[sub], dtype, device)
        for sub, cls in _classes().items()
    }
    return {**parts, "tokenizer": tok}


def tiny_components(preset: str = "ltx2-tiny") -> dict[str, object]:
    """Random components of ``preset`` on the CPU in fp32, for ``save_pipeline_dir``."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    parts = _random(preset, torch.float32, torch.device("cpu"))
    # the shift the pipeline reads (base_shift 0.95, max_shift 2.05 over 1024..4096 tokens)
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_shift=0.95, max_shift=2.05
    )
    return {**parts, "scheduler": scheduler}


def save_tiny(path, preset: str = "ltx2-tiny"):
    return save_pipeline_dir(path, tiny_components(preset), PIPELINE)


def _check_classes(root) -> None:
    """Refuse a directory whose vocoder or text encoder is another LTX-2 generation's (2.3's
    ``LTX2VocoderWithBWE``, 2.5's Gemma-4): this family is written against LTX-2.0's."""
    index = json.loads((root / "model_index.json").read_text())
    for sub in ("text_encoder", "vocoder"):
        name = (index.get(sub) or [None, None])[1]
        if name is None:
            raise missing_error(root, "ltx2", COMPONENTS, [f"{sub} in model_index.json"])
        if name != COMPONENTS[sub]:
            raise ConfigError(
                f"{root}: {sub} is {name}; the 'ltx2' family loads LTX-2.0's {COMPONENTS[sub]}"
            )


def load(cfg, device: torch.device) -> FamilyModel:
    """From a local pipeline directory (``cfg.path``) or a preset with random weights."""
    from transformers import AutoTokenizer

    keys = ("resolution", "frames", "max_text_len", "fps")

    def from_dir(path: str, dtype: torch.dtype) -> tuple[dict, dict]:
        root = check_pipeline_dir(path, "ltx2", COMPONENTS)
        _check_classes(root)
        parts = {
            sub: load_component(root, sub, cls, dtype, device) for sub, cls in _classes().items()
        }
        parts["tokenizer"] = load_component(root, "tokenizer", AutoTokenizer, dtype, device)
        sizes = (DEFAULT_RESOLUTION, DEFAULT_FRAMES, DEFAULT_MAX_TEXT_LEN, DEFAULT_FPS)
        return parts, dict(zip(keys, sizes, strict=True))

    def from_preset(name: str, dtype: torch.dtype) -> tuple[dict, dict]:
        return _random(name, dtype, device), {k: PRESETS[name][k] for k in keys}

    parts, settings = load_source(cfg, "ltx2", PRESETS, from_dir, from_preset)
    return build(**parts, **settings, convention=cfg.convention)


# --- tensor parallelism: the DiT's plan (styles in diffrl/parallel/tp.py) ----------------------

# LTX-2 (LTX2VideoTransformer3DModel): each block's six attentions (ATTENTIONS: video and audio
# self-attention, their text cross-attentions, and the cross-modal a2v / v2a pair, whose queries
# come from one stream and keys/values from the other; both sides' projections are column-
# sharded by the attention's own heads) and the video and audio GELU MLPs. LTX2Attention
# normalises q and k across all heads (RMSNorm over heads * head_dim, as Wan: ShardedRMSNorm)
# and applies RoPE to the whole projection before splitting heads, so its (cos, sin) tables are
# cut to this rank's heads (LocalRope). LTX-2.3's per-head gates (to_gate_logits, a Linear to
# one logit per head) are column-sharded with the heads; LTX-2.0 has none. The AdaLN tables,
# the time embeddings and the text connectors stay replicated.
TP_PLAN: Plan = {
    **{
        f"transformer_blocks.*.{attn}{leaf}": style
        for attn in ATTENTIONS
        for leaf, style in (
            ("", LocalRope("heads", kwargs=("query_rotary_emb", "key_rotary_emb"))),
            (".to_q", ColwiseParallel()),
            (".to_k", ColwiseParallel()),
            (".to_v", ColwiseParallel()),
            (".norm_q", ShardedRMSNorm()),
            (".norm_k", ShardedRMSNorm()),
            (".to_gate_logits", optional(ColwiseParallel())),
            (".to_out.0", RowwiseParallel()),
        )
    },
    **{
        f"transformer_blocks.*.{ff}{leaf}": style
        for ff in ("ff", "audio_ff")
        for leaf, style in ((".net.0.proj", ColwiseParallel()), (".net.2", RowwiseParallel()))
    },
}


# --- memory geometry for `diffrl plan` (derivations in diffrl/parallel/plan.py) -------------


def ltx2_token(w: Widths, ax: float, heads_x: float) -> float:
    """Bytes one LTX-2 block keeps per token of one stream (video, or audio with the audio
    widths in ``w``); ``ax``, ``heads_x``: the audio<->video pair's inner width and heads on
    this rank (the audio attention's, whichever stream queries). The stream's RoPE tables are
    not in it (``ltx2_rope``: shared by every block)."""
    norms = 4 * 6 * w.h + 2 * w.rms * w.a + 2 * w.rms * ax  # 4 diffusers RMSNorms; q/k norms
    lora = 4 * (8 * w.h + 2 * w.a + ax + w.f) + 12 * 4 * w.r  # 12 LoRA inputs (see plan.py)
    attn = 8 * w.a + 4 * w.a + 8 * ax  # SDPA: self q,k,v,out; text q,out; the pair's 2 + 2
    rows = 4 * 4 + 5 * 4 + 4 * (2 * w.heads + heads_x)  # norm statistics, the 3 queries' lse
    return norms + w.rms * w.a + lora + attn + 2 * w.f + rows  # text q-norm; GELU's input


def ltx2_text_token(w: Widths) -> float:
    """Bytes one stream's text cross-attention keeps per text token (k, v read the text at
    the stream's width ``w.h``): the k/v LoRA inputs, the k norm, SDPA's k and v, the
    padding mask expanded per head (bf16)."""
    return 8 * w.h + 4 * 2 * w.r + w.rms * w.a + 4 + 4 * w.a + 2 * w.heads


def ltx2_rope(w: Widths, ax: float) -> float:
    """Bytes per token of a stream's RoPE tables (cos and sin in fp32, for its self-attention
    and for the audio<->video pair), computed once per forward and kept by every block."""
    return 8 * w.a + 8 * ax


def ltx2_tokens(model: nn.Module, conditioned: frozenset[str]) -> tuple[int, int, int, int]:
    """(video tokens, of which appended keyframe tokens, audio tokens, text tokens) of one
    sample the transformer reads, for the task's condition keys ``conditioned``."""
    cfg, fam = model.net.transformer.config, model.family
    _, f, h, w = fam.geometry.video
    per_frame = (h // cfg.patch_size) * (w // cfg.patch_size)
    n_cond = per_frame if "last_frame" in conditioned else 0  # FL2VA's appended keyframe
    n_video = f // cfg.patch_size_t * per_frame + n_cond
    return n_video, n_cond, fam.geometry.audio[1], fam.max_text_len


def geometry(model: nn.Module, w: Widths, conditioned: frozenset[str]) -> memory.Geometry:
    """LTX-2's two token streams at the recipe's size, for ``diffrl plan``. ``conditioned``:
    the task's condition keys (``parallel.plan.PlanOptions``); a first frame gives every video
    token its own timestep (per-token adaLN tables, 16 h: the six tables' sum, which the gates
    keep, and the two (1 + scale)), a last frame appends one latent frame of video tokens."""
    cfg = model.net.transformer.config
    tp_a = cfg.num_attention_heads * cfg.attention_head_dim / w.a  # the TP plan's divisors
    tp_f = 4 * cfg.num_attention_heads * cfg.attention_head_dim / w.f
    h_a = cfg.audio_num_attention_heads * cfg.audio_attention_head_dim
    heads_a = cfg.audio_num_attention_heads / tp_a
    wa = dataclasses.replace(w, h=h_a, a=h_a / tp_a, f=4 * h_a / tp_f, heads=heads_a)
    n_v, n_cond, n_a, n_t = ltx2_tokens(model, conditioned)
    per_token_t = "first_frame" in conditioned  # I2AV, FL2VA: frame 0 held at timestep 0
    video = ltx2_token(w, wa.a, heads_a) + (16 * w.h if per_token_t else 0)
    audio = ltx2_token(wa, wa.a, heads_a)
    text = ltx2_text_token(w) + ltx2_text_token(wa)
    saved = n_v * video + n_a * audio + n_t * text
    shared = n_v * ltx2_rope(w, wa.a) + n_a * ltx2_rope(wa, wa.a)
    if per_token_t:  # the per-token time embedding every block reads: 6 tables of h, bf16
        shared += n_v * 12 * w.h
    inputs = 2 * w.h * n_v + 2 * h_a * n_a  # both residual streams (checkpointing's inputs)
    # no grad: a stream's largest set (its FFN: 4h + 4f, or attention: 4h + 14a) beside the
    # other stream's residual, the text states and the shared tables
    live = n_v * max(4 * w.h + 4 * w.f, 4 * w.h + 14 * w.a) + n_a * 2 * h_a
    live = max(live, n_a * max(4 * h_a + 4 * wa.f, 4 * h_a + 14 * wa.a) + n_v * 2 * w.h)
    live += n_t * 2 * (w.h + h_a) + shared
    # the shared tables are held once per forward, checkpointed or not: spread over the blocks,
    # so that the blocks' sum (every block's saved set, or every block's inputs) counts them once
    spread, n = shared / cfg.num_layers, cfg.num_layers
    blocks = [memory.BlockCost("LTX-2 block", n, saved + spread, inputs + spread, live)]
    what = f"{n_v:,} video ({n_cond} keyframe) + {n_a} audio tokens, {n_t} text"
    return memory.Geometry(what, blocks, {"text_encoder": n_t})


FAMILY = FamilySpec(
    load=load,
    family_class=LTX2Family,
    presets=PRESETS,
    tp_plan=TP_PLAN,
    etp_plans={"gemma3": GEMMA3_ENCODER_PLAN},
    sp_plan="diffusers",
    geometry=geometry,
)
