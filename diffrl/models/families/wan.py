"""Wan 2.1 / 2.2 as a model family: ``WanTransformer3DModel`` on a UMT5 text encoder.

What the family owns, and where diffusers' ``WanPipeline`` says it:

- **Presentation, once** (contract 3). The pipeline cleans each prompt (``prompt_clean``: html
  unescaped, whitespace collapsed), tokenizes it with UMT5's T5-style tokenizer padded to a
  fixed 512 tokens (with ``</s>``), and keeps UMT5's last hidden state for the real tokens
  with zeros after them. The transformer has no text mask: it attends to all 512 rows, the
  zero ones included, so the text length is part of the model (512 real, short for tiny).
- **Time** ("sigma_x1000"). The pipeline feeds the scheduler's timestep, 1000 * sigma, and
  its flow-prediction scheduler takes the output as d x / d sigma = eps - x0 (sign +1).
- **Latents.** ``AutoencoderKLWan`` gives (z_dim=16, (T-1)/4 + 1, H/8, W/8) for T frames,
  normalised as (z - latents_mean) / latents_std; ``x`` is (B, C, F, h, w) as the transformer
  takes it (patch (1, 2, 2) inside).
- **Media.** ``decode`` returns the clip (B, T, H, W, 3) uint8 with its ``fps``, and its middle
  frame as ``image`` so the image scorers score videos too.
- **Serving layout** (contract 2). Self-attention's q/k/v fused into ``attn1.to_qkv`` (the
  processor computes with it: ``fused_projections``), and the FFN's up-projection held as two
  row shards in swapped order, as a tensor-parallel server might.
- **Pipeline parity** (contract 1, ``reference``). ``WanPipeline`` over the model's own
  components, no CFG, its Euler scheduler handed diffrl's sigma grid (the pipeline takes no
  ``sigmas=``; its ``set_timesteps`` gets them): the probe compares the transformer's latents,
  ``timestep`` (1000 sigma) and UMT5 text states at its first calls.

Wan 2.2 A14B's two experts (``transformer_2`` with a ``boundary_ratio``) are one model per
noise range; this family trains one transformer, and refuses a directory with two.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from diffrl.errors import ConfigError
from diffrl.models.families._diffusers import (
    TINY_WORDS,
    DiffusersNet,
    check_pipeline_dir,
    load_component,
    load_source,
    random_component,
    save_pipeline_dir,
    tokenize_padded,
    vae_lock,
    word_tokenizer,
)
from diffrl.models.families._encoder_plans import T5_ENCODER_PLAN
from diffrl.models.family import (
    FamilyModel,
    FamilySpec,
    HasMediaGeometry,
    TokenBatch,
    attention_flops,
    hash_rows,
    linear_flops,
)
from diffrl.models.probe import HasReferencePipeline, Reference, flow_scheduler
from diffrl.parallel.tp import LocalHeads, Plan, ShardedRMSNorm
from diffrl.sync.layouts import fuse_qkv, merge, split_swapped
from diffrl.sync.weights import SlotMap

LORA_TARGETS = (
    "attn1.to_q",
    "attn1.to_k",
    "attn1.to_v",
    "attn1.to_out.0",
    "attn2.to_q",
    "attn2.to_k",
    "attn2.to_v",
    "attn2.to_out.0",
    "ffn.net.0.proj",
    "ffn.net.2",
)
COMPONENTS = {
    "transformer": "WanTransformer3DModel",
    "text_encoder": "UMT5EncoderModel",
    "tokenizer": "T5TokenizerFast (UMT5's)",
    "vae": "AutoencoderKLWan",
}
FPS = 16.0  # Wan 2.1's frame rate (``export_to_video(..., fps=16)`` in the pipeline's example)
FPS_WAN22_5B = 24.0  # Wan 2.2 TI2V-5B (its 48-channel VAE) renders at 24

_UMT5_XXL = dict(  # google/umt5-xxl's encoder, as Wan ships it
    vocab_size=256384,
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_heads=64,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
    dense_act_fn="gelu_new",
    is_gated_act=True,
    layer_norm_epsilon=1e-6,
    tie_word_embeddings=False,
)

# wan2.1-1.3b at real size: a 1.42 B transformer (2.8 GB in bf16), UMT5-XXL's encoder 5.7 B
# (11.4 GB), VAE 0.13 B; 81 frames at 480 x 480 are 21 x 30 x 30 = 18,900 tokens
PRESETS: dict[str, dict] = {
    "wan2.1-1.3b": dict(
        transformer=dict(
            patch_size=(1, 2, 2),
            num_attention_heads=12,
            attention_head_dim=128,
            in_channels=16,
            out_channels=16,
            text_dim=4096,
            freq_dim=256,
            ffn_dim=8960,
            num_layers=30,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            eps=1e-6,
        ),
        text_encoder=_UMT5_XXL,
        vae=dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2),
        resolution=480,
        frames=81,
        max_text_len=512,
    ),
    "wan-tiny": dict(
        transformer=dict(
            patch_size=(1, 2, 2),
            num_attention_heads=2,
            attention_head_dim=16,
            in_channels=16,
            out_channels=16,
            text_dim=32,
            freq_dim=32,
            ffn_dim=64,
            num_layers=2,
            cross_attn_norm=True,
            qk_norm="rms_norm_across_heads",
            eps=1e-6,
            rope_max_seq_len=64,
        ),
        text_encoder=dict(
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=2,
            num_heads=4,
            relative_attention_num_buckets=8,
            relative_attention_max_distance=16,
            feed_forward_proj="gated-gelu",
            dense_act_fn="gelu_new",
            is_gated_act=True,
            tie_word_embeddings=False,
        ),
        vae=dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1),
        resolution=32,
        frames=9,
        max_text_len=16,
    ),
}
# the pipeline's defaults: 81 frames at 480 x 832 (here square), 512 text tokens
DEFAULT_RESOLUTION, DEFAULT_FRAMES, DEFAULT_MAX_TEXT_LEN = 480, 81, 512


def present(text: str) -> str:
    """The one presentation of a prompt: the pipeline's own ``prompt_clean``."""
    from diffusers.pipelines.wan.pipeline_wan import prompt_clean

    return prompt_clean(text)


class WanNet(DiffusersNet):
    """forward(x (B, C, F, h, w), 1000 sigma (B,), input_ids (B, L)) -> eps - x0, x's shape."""

    def __init__(self, transformer, text_encoder, vae, pad_id: int) -> None:
        super().__init__(transformer, text_encoder=text_encoder, vae=vae)
        self.pad_id = pad_id

    def encode_uncached(self, input_ids: Tensor) -> tuple[Tensor]:
        """UMT5's last hidden state, zero after each row's real tokens (``_get_t5_prompt_embeds``
        for right-padded rows)."""
        mask = input_ids != self.pad_id  # (b, L)
        hidden = self.frozen.text_encoder(input_ids, mask.long()).last_hidden_state  # (b, L, D)
        return (hidden * mask[..., None].to(hidden.dtype),)

    def forward(self, x: Tensor, t: Tensor, input_ids: Tensor) -> Tensor:
        (txt,) = self.conditions(input_ids, dtype=x.dtype)
        return self.transformer(
            hidden_states=x, timestep=t, encoder_hidden_states=txt, return_dict=False
        )[0]


class WanFamily(HasReferencePipeline, HasMediaGeometry):
    name = "wan"
    native_convention = "sigma_x1000"
    lora_targets = LORA_TARGETS
    media = frozenset({"video", "fps", "image"})

    def __init__(self, tokenizer, net: WanNet, resolution: int, frames: int, max_text_len: int):
        self.tokenizer, self.net = tokenizer, net
        self.resolution, self.frames, self.max_text_len = resolution, frames, max_text_len
        vae = net.frozen.vae.config
        self.scale_t, self.scale_s = vae.scale_factor_temporal, vae.scale_factor_spatial
        self.fps = FPS_WAN22_5B if vae.z_dim == 48 else FPS
        tcfg = net.transformer.config
        p_t, p_h, _ = tcfg.patch_size
        # the rotary table covers rope_max_seq_len patches per axis; past it diffusers fails
        # deep in the first forward with a shape error, so the range is said here
        rope = getattr(tcfg, "rope_max_seq_len", 1024)
        step_s = self.scale_s * p_h
        if resolution % step_s or not 0 < resolution <= rope * step_s:
            raise ConfigError(
                f"config key 'model.resolution' = {resolution}: this wan model takes a multiple "
                f"of {step_s} from {step_s} to {rope * step_s} (VAE x{self.scale_s}, patch "
                f"{p_h}, {rope} rotary positions); 0 = the model's default"
            )
        latent_t = (frames - 1) // self.scale_t + 1  # the VAE keeps the first frame whole
        if frames < 1 or (frames - 1) % self.scale_t or latent_t % p_t or latent_t > rope * p_t:
            most = (rope * p_t - 1) * self.scale_t + 1
            patch = (
                f", and (frames - 1) / {self.scale_t} + 1 a multiple of {p_t}" if p_t > 1 else ""
            )
            raise ConfigError(
                f"config key 'model.frames' = {frames}: this wan model takes 1 + a multiple of "
                f"{self.scale_t} (VAE x{self.scale_t} in time) up to {most}{patch}; 0 = the "
                "model's default"
            )

    # --- contract 3 ---------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str]) -> TokenBatch:
        ids, mask = tokenize_padded(self.tokenizer, [present(t) for t in texts], self.max_text_len)
        return TokenBatch(ids, mask, hash_rows(ids))

    def null_ids(self) -> Tensor:
        return self.tokenize([""]).input_ids[0]  # the pipeline's default negative prompt

    # --- shapes and media ---------------------------------------------------------------
    def media_geometry(self) -> dict[str, float]:
        """What a task renders media at (and the start-up probe its synthetic frames)."""
        return dict(frames=self.frames, size=self.resolution, fps=self.fps)

    def latent_shape(self) -> tuple[int, ...]:
        s = self.resolution // self.scale_s
        return (self.net.frozen.vae.config.z_dim, (self.frames - 1) // self.scale_t + 1, s, s)

    def _stats(self, like: Tensor) -> tuple[Tensor, Tensor]:
        cfg = self.net.frozen.vae.config
        view = (1, cfg.z_dim, 1, 1, 1)
        mean = torch.tensor(cfg.latents_mean).view(view).to(like)
        std = torch.tensor(cfg.latents_std).view(view).to(like)
        return mean, std

    @torch.no_grad()
    def decode(self, latents: Tensor) -> dict[str, Tensor]:
        vae = self.net.frozen.vae
        z = latents.to(next(vae.parameters()))  # (B, C, F, h, w)
        mean, std = self._stats(z)
        with vae_lock(vae):  # (B, 3, T, H, W) in [-1, 1]
            clip = vae.decode(z * std + mean, return_dict=False)[0]
        video = ((clip.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        video = video.permute(0, 2, 3, 4, 1).cpu()  # (B, T, H, W, 3)
        fps = torch.full((video.shape[0],), self.fps)
        return {"video": video, "fps": fps, "image": video[:, video.shape[1] // 2]}

    @torch.no_grad()
    def encode_pixels(self, pixels: Tensor) -> Tensor:
        """(B, 3, T, H, W) clips in [-1, 1] -> latents; an image (B, 3, H, W) is taken as a
        still clip of ``frames`` frames."""
        vae = self.net.frozen.vae
        if pixels.ndim == 4:
            pixels = pixels.unsqueeze(2).expand(-1, -1, self.frames, -1, -1)
        with vae_lock(vae):
            z = vae.encode(pixels.to(next(vae.parameters()))).latent_dist.mode()
        mean, std = self._stats(z)
        return (z - mean) / std

    # --- contract 1: the reference pipeline ------------------------------------------------
    def reference(self, model: FamilyModel, shift: float) -> Reference:
        """``WanPipeline`` over this model's own components, no CFG (guidance_scale 1)."""
        from diffusers import WanPipeline

        f = model.net.frozen
        scheduler = flow_scheduler(shift)
        pipe = WanPipeline(
            tokenizer=self.tokenizer, text_encoder=f.text_encoder, vae=f.vae,
            scheduler=scheduler, transformer=model.net.transformer,
        )  # fmt: skip
        pipe.set_progress_bar_config(disable=True)
        _, _, h, _ = self.latent_shape()
        set_timesteps = scheduler.set_timesteps

        def call(prompt: str, noise: Tensor, grid) -> None:
            # WanPipeline takes no ``sigmas=`` and calls ``set_timesteps(steps, device=...)``:
            # its scheduler is handed the grid there, as ``retrieve_timesteps`` hands it in the
            # pipelines that take one (without it the scheduler spaces its own grid between its
            # already shifted training sigmas and shifts that again)
            scheduler.set_timesteps = functools.partial(set_timesteps, sigmas=list(grid))
            pipe(
                prompt=prompt, latents=noise, num_inference_steps=len(grid), guidance_scale=1.0,
                height=h * self.scale_s, width=h * self.scale_s, num_frames=self.frames,
                max_sequence_length=self.max_text_len, output_type="latent",
            )  # fmt: skip

        return Reference(model.net.transformer, call)

    # --- contract 2 and cost ------------------------------------------------------------
    def serving_layout(self, model: nn.Module) -> SlotMap:
        blocks = [f"net.transformer.blocks.{i}" for i in range(len(model.net.transformer.blocks))]
        # native: WanAttention's processor computes with to_qkv once fused_projections is set
        qkv = fuse_qkv(model, [f"{b}.attn1" for b in blocks], native=True)
        ffn = split_swapped(model, [f"{b}.ffn.net.0.proj" for b in blocks], n_shards=2)
        return merge(qkv, ffn)

    def flops(self, batch: int, input_ids: Tensor | None = None, cond=None) -> float:
        """One transformer forward (UMT5 runs once per prompt, cached; the text is padded to
        ``max_text_len``). Per block: self-attention's q/k/v/out and the cross-attention's
        q/out on the video tokens, its k/v on the text tokens, the MLP; self-attention 4 N^2 d,
        cross-attention 4 N L d. Outside: the patch conv in and the projection out, the text
        MLP (per text token), the time MLP and its 6 d table (per sample)."""
        cfg = self.net.transformer.config
        d = cfg.num_attention_heads * cfg.attention_head_dim
        c, f, h, w = self.latent_shape()
        p_t, p_h, p_w = cfg.patch_size
        n = (f // p_t) * (h // p_h) * (w // p_w)
        n_txt = self.max_text_len
        block = linear_flops(n, d, 6 * d + 2 * cfg.ffn_dim) + linear_flops(n_txt, d, 2 * d)
        block += attention_flops(n, n, d) + attention_flops(n, n_txt, d)
        io = linear_flops(n, c * p_t * p_h * p_w, d) + linear_flops(n, d, c * p_t * p_h * p_w)
        io += linear_flops(n_txt, cfg.text_dim + d, d)
        io += linear_flops(1, cfg.freq_dim + d, d) + linear_flops(1, d, 6 * d)
        return float(batch * (cfg.num_layers * block + io))


# --- building ---------------------------------------------------------------------------------


def build(
    transformer,
    text_encoder,
    vae,
    tokenizer,
    resolution: int,
    frames: int,
    max_text_len: int,
    convention: str = "",
) -> FamilyModel:
    tokenizer.padding_side = "right"
    if tokenizer.pad_token_id is None:
        raise ConfigError("wan: the tokenizer has no pad token")
    net = WanNet(transformer, text_encoder, vae, tokenizer.pad_token_id)
    return FamilyModel(net, WanFamily(tokenizer, net, resolution, frames, max_text_len), convention)


def tiny_tokenizer(max_len: int):
    return word_tokenizer(TINY_WORDS, "t5", max_len)


def _random(preset: str, dtype: torch.dtype, device: torch.device) -> dict:
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import UMT5EncoderModel

    spec = PRESETS[preset]
    tok = tiny_tokenizer(spec["max_text_len"])
    te_cfg = {"vocab_size": len(tok), **spec["text_encoder"]}
    return dict(
        transformer=random_component(WanTransformer3DModel, spec["transformer"], dtype, device),
        text_encoder=random_component(UMT5EncoderModel, te_cfg, dtype, device),
        vae=random_component(AutoencoderKLWan, spec["vae"], dtype, device),
        tokenizer=tok,
    )


def tiny_components(preset: str = "wan-tiny") -> dict[str, object]:
    """Random components of ``preset`` on the CPU in fp32, for ``save_pipeline_dir``."""
    from diffusers import UniPCMultistepScheduler

    parts = _random(preset, torch.float32, torch.device("cpu"))
    scheduler = UniPCMultistepScheduler(
        prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0
    )
    return {**parts, "scheduler": scheduler}


def save_tiny(path, preset: str = "wan-tiny"):
    return save_pipeline_dir(path, tiny_components(preset), "WanPipeline")


def _check_single_transformer(root) -> None:
    index = json.loads((root / "model_index.json").read_text())
    if (index.get("transformer_2") or [None])[0] is not None:
        raise ConfigError(
            f"{root}: a Wan 2.2 two-expert pipeline (transformer_2, boundary_ratio); the 'wan' "
            "family trains one transformer: point model.path at a single-transformer directory"
        )


def load(cfg, device: torch.device) -> FamilyModel:
    """From a local pipeline directory (``cfg.path``) or a preset with random weights."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel
    from transformers import AutoTokenizer, UMT5EncoderModel

    def from_dir(path: str, dtype: torch.dtype) -> tuple[dict, dict]:
        root = check_pipeline_dir(path, "wan", COMPONENTS)
        _check_single_transformer(root)
        parts = dict(
            transformer=load_component(root, "transformer", WanTransformer3DModel, dtype, device),
            text_encoder=load_component(root, "text_encoder", UMT5EncoderModel, dtype, device),
            vae=load_component(root, "vae", AutoencoderKLWan, dtype, device),
            tokenizer=load_component(root, "tokenizer", AutoTokenizer, dtype, device),
        )
        sizes = (DEFAULT_RESOLUTION, DEFAULT_FRAMES, DEFAULT_MAX_TEXT_LEN)
        return parts, dict(zip(("resolution", "frames", "max_text_len"), sizes, strict=True))

    def from_preset(name: str, dtype: torch.dtype) -> tuple[dict, dict]:
        spec = PRESETS[name]
        return _random(name, dtype, device), {
            k: spec[k] for k in ("resolution", "frames", "max_text_len")
        }

    parts, settings = load_source(cfg, "wan", PRESETS, from_dir, from_preset)
    return build(**parts, **settings, convention=cfg.convention)


# --- tensor parallelism: the DiT's plan (styles in diffrl/parallel/tp.py) ----------------------

# Wan 2.1 / 2.2 (WanTransformer3DModel): self-attention attn1, text cross-attention attn2 (its
# k/v read the text states; I2V's add_k/v_proj image branch is not in this plan), q/k normed
# across heads (ShardedRMSNorm), a GELU MLP.
TP_PLAN: Plan = {
    **{
        f"blocks.*.{attn}{leaf}": style
        for attn in ("attn1", "attn2")
        for leaf, style in (
            ("", LocalHeads("heads")),
            (".to_q", ColwiseParallel()),
            (".to_k", ColwiseParallel()),
            (".to_v", ColwiseParallel()),
            (".norm_q", ShardedRMSNorm()),
            (".norm_k", ShardedRMSNorm()),
            (".to_out.0", RowwiseParallel()),
        )
    },
    "blocks.*.ffn.net.0.proj": ColwiseParallel(),  # GELU(proj): elementwise
    "blocks.*.ffn.net.2": RowwiseParallel(),
}


FAMILY = FamilySpec(
    load=load,
    family_class=WanFamily,
    presets=PRESETS,
    tp_plan=TP_PLAN,
    etp_plans={"umt5": T5_ENCODER_PLAN},
    sp_plan="diffusers",
)
