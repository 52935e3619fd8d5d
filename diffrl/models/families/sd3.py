"""Stable Diffusion 3 / 3.5 as a model family: diffusers' ``SD3Transformer2DModel`` (MMDiT) on
CLIP-L + CLIP-G (``CLIPTextModelWithProjection``) + T5 (``T5EncoderModel``), with a 16-channel
``AutoencoderKL``.

Native convention ``sigma_x1000``: the pipeline passes ``timestep = 1000 * sigma`` (the flow-match
Euler scheduler's ``timesteps = sigmas * 1000``) and steps ``x <- x + (sigma_next - sigma) * out``,
so the output is dx/dsigma = eps - x0, diffrl's own velocity.

Prompt encoding follows ``StableDiffusion3Pipeline.encode_prompt``: each CLIP's penultimate hidden
states, concatenated on channels and zero-padded to T5's width, then T5's states appended along
the sequence; the pooled condition is the two CLIPs' projected text embeddings concatenated.
The three tokenizations travel as one (B, 77 + 77 + T) id row (contract 3).

Presets: ``sd35-medium`` (real size, random weights), ``sd35-tiny`` (a few hundred K parameters
per piece, 64 px) and ``sd3-shapes`` (a small transformer in pixel space, 32 px RGB, no VAE: the
ShapesBench base model that runs the learning check through a real diffusers class).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from diffrl.errors import ConfigError
from diffrl.models.families._diffusers import (
    JOINT_ATTENTION_TARGETS,
    TINY_WORDS,
    DiffusersNet,
    check_pipeline_dir,
    load_component,
    load_source,
    missing_error,
    random_component,
    save_pipeline_dir,
    tokenize_padded,
    word_tokenizer,
)
from diffrl.models.families._encoder_plans import T5_ENCODER_PLAN
from diffrl.models.families._sd3_packed import forward_packed
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
from diffrl.models.memory import BlockCost, Geometry, Widths, merge_blocks
from diffrl.models.probe import HasReferencePipeline, Reference, flow_scheduler
from diffrl.parallel.tp import LocalHeads, PerHeadNorm, Plan, optional
from diffrl.sync import layouts
from diffrl.sync.weights import SlotMap
from diffrl.types import images_to_uint8

LORA_TARGETS = (
    *JOINT_ATTENTION_TARGETS,
    "ff.net.0.proj",
    "ff.net.2",
)
PIPELINE = "StableDiffusion3Pipeline"
COMPONENTS = {
    "transformer": "SD3Transformer2DModel",
    "text_encoder": "CLIPTextModelWithProjection (CLIP-L)",
    "text_encoder_2": "CLIPTextModelWithProjection (CLIP-G)",
    "text_encoder_3": "T5EncoderModel",
    "tokenizer": "CLIP tokenizer",
    "tokenizer_2": "CLIP tokenizer",
    "tokenizer_3": "T5 tokenizer",
    "vae": "AutoencoderKL (16 latent channels; absent for a pixel-space transformer)",
}
T5_DEFAULT_LEN = 256

# fmt: off
_CLIP_L = dict(
    hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
    projection_dim=768, max_position_embeddings=77, hidden_act="quick_gelu", vocab_size=49408,
)
_CLIP_G = dict(
    hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
    projection_dim=1280, max_position_embeddings=77, hidden_act="gelu", vocab_size=49408,
)
_T5_XXL = dict(
    d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64, vocab_size=32128,
    feed_forward_proj="gated-gelu", relative_attention_num_buckets=32,
    relative_attention_max_distance=128, layer_norm_epsilon=1e-6,
)
_SD3_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512),
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    layers_per_block=2, norm_num_groups=32, scaling_factor=1.5305, shift_factor=0.0609,
    use_quant_conv=False, use_post_quant_conv=False, sample_size=1024,
)
_TINY_VAE = dict(
    _SD3_VAE, block_out_channels=(8, 8, 16, 16), layers_per_block=1, norm_num_groups=8,
    sample_size=64,
)


def _tiny_clip(width: int) -> dict:
    return dict(
        hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
        num_attention_heads=2, projection_dim=width, max_position_embeddings=16,
        hidden_act="quick_gelu", vocab_size=0,  # 0: the tokenizer's size
    )


def _tiny_t5(width: int) -> dict:
    return dict(
        d_model=width, d_kv=width // 4, d_ff=2 * width, num_layers=2, num_heads=4, vocab_size=0,
        feed_forward_proj="gated-gelu", relative_attention_num_buckets=8,
        relative_attention_max_distance=32,
    )


PRESETS: dict[str, dict] = {
    # stabilityai/stable-diffusion-3.5-medium: MMDiT-X, 24 blocks, 1536 wide, dual attention in
    # blocks 0-12, RMS qk-norm; 1024 px images, 128x128 latents. 2.24 B parameters (+ a 0.23 B
    # sin-cos position buffer: the published 2.5 B)
    "sd35-medium": dict(
        transformer=dict(
            sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
            attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
            caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=384,
            dual_attention_layers=tuple(range(13)), qk_norm="rms_norm",
        ),
        clip_l=_CLIP_L, clip_g=_CLIP_G, t5=_T5_XXL, vae=_SD3_VAE,
        clip_len=77, t5_len=T5_DEFAULT_LEN,
    ),
    # every piece tiny, the same wiring (dual attention, qk-norm, CLIP widths that need padding)
    "sd35-tiny": dict(
        transformer=dict(
            sample_size=8, patch_size=2, in_channels=16, out_channels=16, num_layers=2,
            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=48,
            caption_projection_dim=32, pooled_projection_dim=40, pos_embed_max_size=16,
            dual_attention_layers=(0,), qk_norm="rms_norm",
        ),
        clip_l=_tiny_clip(16), clip_g=_tiny_clip(24), t5=_tiny_t5(48), vae=_TINY_VAE,
        clip_len=16, t5_len=16,
    ),
    # ShapesBench: 32x32 RGB pixels straight into the MMDiT (patch 4: 64 image tokens); RMS
    # qk-norm as SD3.5, which keeps attention logits bounded while LoRA trains
    "sd3-shapes": dict(
        transformer=dict(
            sample_size=32, patch_size=4, in_channels=3, out_channels=3, num_layers=6,
            attention_head_dim=32, num_attention_heads=4, joint_attention_dim=128,
            caption_projection_dim=128, pooled_projection_dim=128, pos_embed_max_size=8,
            qk_norm="rms_norm",
        ),
        clip_l=_tiny_clip(64), clip_g=_tiny_clip(64), t5=_tiny_t5(128), vae=None,
        clip_len=16, t5_len=16,
    ),
}
# fmt: on


class SD3Net(DiffusersNet):
    """forward(x, t_native, input_ids) = the SD3 transformer's output (eps - x0)."""

    def __init__(self, transformer, clip_l, clip_g, t5, lens: tuple[int, int, int]) -> None:
        super().__init__(transformer, clip_l=clip_l, clip_g=clip_g, t5=t5)
        self.lens = lens  # (CLIP-L, CLIP-G, T5) tokens per row

    def encode_uncached(self, input_ids: Tensor) -> tuple[Tensor, Tensor]:
        f = self.frozen
        ids = input_ids.to(f.clip_l.device)
        ids_l, ids_g, ids_t = ids.split(self.lens, dim=1)
        hidden, pooled = [], []
        for enc, part in ((f.clip_l, ids_l), (f.clip_g, ids_g)):
            out = enc(part, output_hidden_states=True)
            hidden.append(out.hidden_states[-2])  # (b, 77, width): the penultimate layer
            pooled.append(out.text_embeds)  # (b, proj)
        t5 = f.t5(ids_t.to(f.t5.device))[0]  # (b, T, joint_dim)
        clip = torch.cat(hidden, dim=-1).to(t5)  # (b, 77, w_l + w_g)
        clip = nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
        return torch.cat([clip, t5], dim=-2), torch.cat(pooled, dim=-1)

    def forward(self, x: Tensor, t_native: Tensor, input_ids: Tensor) -> Tensor:
        prompt, pooled = self.conditions(input_ids, dtype=x.dtype)
        return self.transformer(
            hidden_states=x,
            timestep=t_native,
            encoder_hidden_states=prompt.to(x.device),
            pooled_projections=pooled.to(x.device),
            return_dict=False,
        )[0]

    def forward_packed(
        self, xs: Sequence[Tensor], ts: Sequence[Tensor], ids: Sequence[Tensor], attention: str
    ) -> list[Tensor]:
        """``forward`` over groups of several resolutions in one call (sequence packing:
        ``_sd3_packed.py``, ``models/packed.py``)."""
        conds = [self.conditions(i, dtype=x.dtype) for x, i in zip(xs, ids, strict=True)]
        prompts = [p.to(x.device) for (p, _), x in zip(conds, xs, strict=True)]
        pooled = [q.to(x.device) for (_, q), x in zip(conds, xs, strict=True)]
        return forward_packed(self.transformer, xs, ts, prompts, pooled, attention)


class SD3Family(ResolutionFree, HasReferencePipeline):
    name = "sd3"
    native_convention = "sigma_x1000"
    lora_targets = LORA_TARGETS
    media = frozenset({"image"})

    def __init__(
        self, tokenizers: Sequence, lens: tuple[int, int, int], transformer, vae, resolution: int
    ) -> None:
        self.tokenizers, self.lens, self.vae = tuple(tokenizers), lens, vae
        cfg = transformer.config
        self.tcfg = cfg
        if vae is None:
            if cfg.in_channels != 3:
                raise ConfigError(
                    f"sd3: a transformer with {cfg.in_channels} input channels needs a vae/"
                )
            down = 1  # pixel space: the image is the latent
            self._latent = (3, resolution, resolution)
        else:
            down = 2 ** (len(vae.config.block_out_channels) - 1)
            side = resolution // down
            self._latent = (vae.config.latent_channels, side, side)
        # checked here, before diffusers' own ValueError deep in the first forward ("Height (32)
        # cannot be greater than pos_embed_max_size: 16")
        step, most = down * cfg.patch_size, (cfg.pos_embed_max_size or cfg.sample_size)
        if resolution % step or not self.accepts_shape(self._latent):
            raise ConfigError(
                f"config key 'model.resolution' = {resolution}: this sd3 transformer takes a "
                f"multiple of {step} from {step} to {most * step} (position table of {most} "
                f"patches of {cfg.patch_size}, VAE x{down}); 0 = the model's default"
            )

    def tokenize(self, texts: Sequence[str]) -> TokenBatch:
        parts = [
            tokenize_padded(t, list(texts), n)
            for t, n in zip(self.tokenizers, self.lens, strict=True)
        ]
        ids = torch.cat([p[0] for p in parts], dim=1)  # (B, 77 + 77 + T)
        mask = torch.cat([p[1] for p in parts], dim=1)
        return TokenBatch(ids, mask, hash_rows(ids))

    def null_ids(self) -> Tensor:
        return self.tokenize([""]).input_ids[0]  # SD3's negative prompt is "" encoded

    def latent_shape(self) -> tuple[int, ...]:
        return self._latent

    def accepts_shape(self, shape: tuple[int, ...]) -> bool:
        """Any resolution the transformer's positional table covers: (C, h, w) with h and w
        multiples of the patch and at most ``pos_embed_max_size`` patches."""
        c, p = self.tcfg, self.tcfg.patch_size
        limit = (c.pos_embed_max_size or c.sample_size) * p
        return (
            len(shape) == 3
            and shape[0] == self._latent[0]
            and all(0 < n <= limit and n % p == 0 for n in shape[1:])
        )

    @torch.no_grad()
    def decode(self, latents: Tensor) -> dict[str, Tensor]:
        if self.vae is None:
            return {"image": images_to_uint8(latents.cpu())}
        c = self.vae.config
        z = latents.to(self.vae.device, self.vae.dtype) / c.scaling_factor + (c.shift_factor or 0.0)
        return {"image": images_to_uint8(self.vae.decode(z).sample.cpu())}

    @torch.no_grad()
    def encode_pixels(self, pixels: Tensor) -> Tensor:
        if self.vae is None:
            return pixels
        c = self.vae.config
        mean = self.vae.encode(pixels.to(self.vae.device, self.vae.dtype)).latent_dist.mean
        return (mean - (c.shift_factor or 0.0)) * c.scaling_factor

    def reference(self, model: FamilyModel, shift: float) -> Reference:
        """``StableDiffusion3Pipeline`` over this model's own components, no CFG."""
        from diffusers import StableDiffusion3Pipeline

        f = model.net.frozen
        tok = self.tokenizers
        pipe = StableDiffusion3Pipeline(
            transformer=model.net.transformer, scheduler=flow_scheduler(shift), vae=self.vae,
            text_encoder=f.clip_l, tokenizer=tok[0], text_encoder_2=f.clip_g, tokenizer_2=tok[1],
            text_encoder_3=f.t5, tokenizer_3=tok[2],
        )  # fmt: skip
        pipe.set_progress_bar_config(disable=True)
        _, h, w = self._latent
        scale = pipe.vae_scale_factor if self.vae is not None else 1

        def call(prompt: str, noise: Tensor, grid) -> None:
            pipe(
                prompt=prompt, latents=noise.to(model.net.transformer.dtype), sigmas=list(grid),
                num_inference_steps=len(grid), guidance_scale=1.0, height=h * scale,
                width=w * scale, max_sequence_length=self.lens[2], output_type="latent",
            )  # fmt: skip

        return Reference(model.net.transformer, call)

    def serving_layout(self, model: nn.Module) -> SlotMap:
        """Q/K/V and the context's added Q/K/V fused per attention (``to_qkv``,
        ``to_added_qkv``), each block's MLP up-projection in two swapped TP shards."""
        names = dict(model.named_modules())
        attns = [n for n in names if n.endswith(".attn") and ".transformer_blocks." in n]
        added = [n for n in attns if getattr(names[n], "add_q_proj", None) is not None]
        ups = [n for n in names if n.endswith(".ff.net.0.proj")]
        return layouts.merge(
            layouts.fuse_qkv(model, attns),
            layouts.fuse_qkv(
                model, added, "add_q_proj", "add_k_proj", "add_v_proj", "to_added_qkv"
            ),
            layouts.split_swapped(model, ups),
        )

    def flops(self, batch: int, input_ids: Tensor | None = None, cond=None) -> float:
        """The transformer's forward (the text encoders run once per prompt, cached; the text
        is always padded to its full length). Per block: the image stream's q/k/v/out and 4x
        MLP (12 d^2 per token), the text stream's too except in the last block (its text
        output is never read: q/k/v only), joint attention over both, the dual-attention
        blocks' second image-only attention; per sample, the adaLN tables (6 d, 9 d in a dual
        block; 6 d, or 2 d in the last block, for the text), the time and pooled-text MLPs,
        the output adaLN. Outside: the patch conv in and the projection out, the text
        embedder."""
        c = self.tcfg
        d = c.num_attention_heads * c.attention_head_dim
        n_img = (self._latent[1] // c.patch_size) * (self._latent[2] // c.patch_size)
        n_txt = self.lens[0] + self.lens[2]  # the CLIPs side by side on channels, then T5
        dual = set(c.dual_attention_layers or ())
        total = 0.0
        for i in range(c.num_layers):
            last = i == c.num_layers - 1
            total += linear_flops(n_img, d, 12 * d) + linear_flops(
                n_txt, d, 3 * d if last else 12 * d
            )
            total += attention_flops(n_img + n_txt, n_img + n_txt, d)
            total += linear_flops(1, d, (9 if i in dual else 6) * d + (2 if last else 6) * d)
            if i in dual:
                total += linear_flops(n_img, d, 4 * d) + attention_flops(n_img, n_img, d)
        p2 = c.patch_size**2
        total += linear_flops(n_img, c.in_channels * p2, d) + linear_flops(
            n_img, d, p2 * (c.out_channels or c.in_channels)
        )
        total += linear_flops(n_txt, c.joint_attention_dim, d)
        total += linear_flops(1, 256 + c.pooled_projection_dim + 2 * d, d)  # time, pooled text
        total += linear_flops(1, d, 2 * d)  # the output adaLN
        return float(batch * total)


# --- building and loading ---------------------------------------------------------------------


def _tokenizers(clip_len: int, t5_len: int) -> dict:
    clip = word_tokenizer(TINY_WORDS, "clip", clip_len)
    return dict(
        tokenizer=clip,
        tokenizer_2=word_tokenizer(TINY_WORDS, "clip", clip_len),
        tokenizer_3=word_tokenizer(TINY_WORDS, "t5", t5_len),
    )


def preset_components(
    preset: str, dtype=torch.float32, device="cpu", max_text_len: int = 0
) -> dict:
    """A preset's pipeline components with random weights (subfolder -> model or tokenizer)."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import CLIPTextModelWithProjection, T5EncoderModel

    if preset not in PRESETS:
        raise ConfigError(f"sd3: unknown preset {preset!r}; known: {sorted(PRESETS)}")
    p = PRESETS[preset]
    out = _tokenizers(p["clip_len"], max_text_len or p["t5_len"])
    clip_tok, t5_tok = out["tokenizer"], out["tokenizer_3"]
    ids = dict(
        bos_token_id=clip_tok.bos_token_id,
        eos_token_id=clip_tok.eos_token_id,
        pad_token_id=clip_tok.pad_token_id,
    )
    for sub, key in (("text_encoder", "clip_l"), ("text_encoder_2", "clip_g")):
        cfg = {**p[key], **ids, "vocab_size": max(p[key]["vocab_size"], len(clip_tok))}
        out[sub] = random_component(CLIPTextModelWithProjection, cfg, dtype, device)
    t5 = {
        **p["t5"],
        "vocab_size": max(p["t5"]["vocab_size"], len(t5_tok)),
        "pad_token_id": t5_tok.pad_token_id,
        "eos_token_id": t5_tok.eos_token_id,
    }
    out["text_encoder_3"] = random_component(T5EncoderModel, t5, dtype, device)
    out["transformer"] = random_component(SD3Transformer2DModel, p["transformer"], dtype, device)
    vae = p["vae"] and random_component(AutoencoderKL, p["vae"], dtype, device)
    out["vae"] = vae or None
    return out


def tiny_components(preset: str = "sd35-tiny") -> dict:
    """What tests write with ``save_pipeline_dir(path, tiny_components(), PIPELINE)``."""
    return preset_components(preset)


def _load_dir(path: str, dtype: torch.dtype, device: torch.device) -> dict:
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import AutoTokenizer, CLIPTextModelWithProjection, T5EncoderModel

    root = check_pipeline_dir(path, "sd3", COMPONENTS, optional=("vae",))
    classes = dict(
        transformer=SD3Transformer2DModel,
        text_encoder=CLIPTextModelWithProjection,
        text_encoder_2=CLIPTextModelWithProjection,
        text_encoder_3=T5EncoderModel,
        tokenizer=AutoTokenizer,
        tokenizer_2=AutoTokenizer,
        tokenizer_3=AutoTokenizer,
    )
    out = {sub: load_component(root, sub, cls, dtype, device) for sub, cls in classes.items()}
    has_vae = (root / "vae").is_dir()
    out["vae"] = load_component(root, "vae", AutoencoderKL, dtype, device) if has_vae else None
    if out["vae"] is None and out["transformer"].config.in_channels != 3:
        raise missing_error(root, "sd3", COMPONENTS, ["vae/"])
    return out


def assemble(parts: dict, resolution: int, t5_len: int, convention: str = "") -> FamilyModel:
    """A FamilyModel from pipeline components (however they were made)."""
    toks = (parts["tokenizer"], parts["tokenizer_2"], parts["tokenizer_3"])
    lens = (toks[0].model_max_length, toks[1].model_max_length, t5_len)
    net = SD3Net(
        parts["transformer"],
        parts["text_encoder"],
        parts["text_encoder_2"],
        parts["text_encoder_3"],
        lens,
    )
    family = SD3Family(toks, lens, parts["transformer"], parts["vae"], resolution)
    return FamilyModel(net, family, convention)


def default_resolution(parts: dict) -> int:
    c = parts["transformer"].config
    if parts["vae"] is None:
        return c.sample_size
    return c.sample_size * 2 ** (len(parts["vae"].config.block_out_channels) - 1)


def load(cfg, device: torch.device) -> FamilyModel:
    """``cfg.path`` (a local SD3 pipeline directory) or ``cfg.preset`` (random weights)."""

    def from_dir(path: str, dtype: torch.dtype) -> tuple[dict, dict]:
        parts = _load_dir(path, dtype, device)
        t5_len = min(parts["tokenizer_3"].model_max_length, T5_DEFAULT_LEN)
        return parts, dict(resolution=default_resolution(parts), max_text_len=t5_len)

    def from_preset(name: str, dtype: torch.dtype) -> tuple[dict, dict]:
        parts = preset_components(name, dtype, device, cfg.max_text_len)
        t5_len = parts["tokenizer_3"].model_max_length
        return parts, dict(resolution=default_resolution(parts), max_text_len=t5_len)

    parts, s = load_source(cfg, "sd3", PRESETS, from_dir, from_preset)
    return assemble(parts, s["resolution"], s["max_text_len"], cfg.convention)


def save(parts: dict, path) -> None:
    save_pipeline_dir(path, parts, PIPELINE)


# --- tensor parallelism: the DiT's plan (styles in diffrl/parallel/tp.py) ----------------------

# SD3 / SD3.5 (SD3Transformer2DModel): joint blocks attend over [image; text] with one head set,
# the text stream through add_*_proj; SD3.5's dual-attention blocks add an image-only attn2.
TP_PLAN: Plan = {
    "transformer_blocks.*.attn": LocalHeads("heads"),
    "transformer_blocks.*.attn.to_q": ColwiseParallel(),
    "transformer_blocks.*.attn.to_k": ColwiseParallel(),
    "transformer_blocks.*.attn.to_v": ColwiseParallel(),
    "transformer_blocks.*.attn.add_q_proj": ColwiseParallel(),
    "transformer_blocks.*.attn.add_k_proj": ColwiseParallel(),
    "transformer_blocks.*.attn.add_v_proj": ColwiseParallel(),
    "transformer_blocks.*.attn.to_out.0": RowwiseParallel(),
    "transformer_blocks.*.attn.to_add_out": RowwiseParallel(),
    # qk-norm (SD3.5 only), on (B, H, S, D)
    "transformer_blocks.*.attn.norm_q": optional(PerHeadNorm(heads_dim=1)),
    "transformer_blocks.*.attn.norm_k": optional(PerHeadNorm(heads_dim=1)),
    "transformer_blocks.*.attn.norm_added_q": optional(PerHeadNorm(heads_dim=1)),
    "transformer_blocks.*.attn.norm_added_k": optional(PerHeadNorm(heads_dim=1)),
    # dual attention (SD3.5's first blocks only)
    "transformer_blocks.*.attn2": optional(LocalHeads("heads")),
    "transformer_blocks.*.attn2.to_q": optional(ColwiseParallel()),
    "transformer_blocks.*.attn2.to_k": optional(ColwiseParallel()),
    "transformer_blocks.*.attn2.to_v": optional(ColwiseParallel()),
    "transformer_blocks.*.attn2.to_out.0": optional(RowwiseParallel()),
    "transformer_blocks.*.attn2.norm_q": optional(PerHeadNorm(heads_dim=1)),
    "transformer_blocks.*.attn2.norm_k": optional(PerHeadNorm(heads_dim=1)),
    "transformer_blocks.*.ff.net.0.proj": ColwiseParallel(),  # GELU(proj): elementwise
    "transformer_blocks.*.ff.net.2": RowwiseParallel(),
    "transformer_blocks.*.ff_context.net.0.proj": ColwiseParallel(),
    "transformer_blocks.*.ff_context.net.2": RowwiseParallel(),
}


# --- memory geometry for `diffrl plan` (derivations in diffrl/parallel/plan.py) -------------


def sd3_image_token(w: Widths, dual: bool) -> float:
    """Bytes one SD3 joint block keeps per image token (derivation in the module docstring)."""
    rows = 2 * 8 + 2 * 4 * w.heads + 4 * w.heads + 6 * 4 * w.r  # LN stats, qk rsqrt, lse, LoRA
    kept = 20 * w.h + 24 * w.a + 6 * w.f + rows
    return kept + (20 * w.a + 12 * w.heads if dual else 0)  # attn2: qk-norm, SDPA (no LoRA)


def sd3_text_token(w: Widths, pre_only: bool) -> float:
    """Bytes one SD3 joint block keeps per text token (the context stream)."""
    if pre_only:  # the last block: attention only, no to_add_out, no text FFN
        return 14 * w.h + 20 * w.a + 8 + 12 * w.heads + 3 * 4 * w.r
    return 16 * w.h + 24 * w.a + 2 * w.f + 16 + 12 * w.heads + 4 * 4 * w.r


def geometry(model: nn.Module, w: Widths, conditioned: bool) -> Geometry:
    """SD3's joint blocks at the model's size, for ``diffrl plan``."""
    cfg, fam = model.net.transformer.config, model.family
    _, hl, wl = fam.latent_shape()
    p = cfg.patch_size
    n_img, n_txt = (hl // p) * (wl // p), fam.lens[0] + fam.lens[2]  # CLIPs on channels, T5
    dual = set(cfg.dual_attention_layers or ())
    live = max(4 * w.h + 4 * w.f, 4 * w.h + 14 * w.a)
    blocks = []
    for i in range(cfg.num_layers):
        pre = i == cfg.num_layers - 1
        saved = n_img * sd3_image_token(w, i in dual) + n_txt * sd3_text_token(w, pre)
        kind = "joint" + (", dual" if i in dual else "") + (", last" if pre else "")
        blocks.append(BlockCost(kind, 1, saved, 2 * w.h * (n_img + n_txt), live * (n_img + n_txt)))
    decode = 0.0
    if fam.vae is not None:  # the last upsampling carries block_out_channels[1] to full size
        widths = fam.vae.config.block_out_channels
        side = hl * 2 ** (len(widths) - 1)
        decode = 3 * 2 * side * side * widths[min(1, len(widths) - 1)]
    encoders = dict(clip_l=fam.lens[0], clip_g=fam.lens[1], t5=fam.lens[2])
    return Geometry(
        f"{n_img:,} image + {n_txt} text tokens", merge_blocks(blocks), encoders, decode
    )


FAMILY = FamilySpec(
    load=load,
    family_class=SD3Family,
    presets=PRESETS,
    builtins={
        "builtin:shapes_sd3": Builtin(
            "shapes_sd3.safetensors", "diffrl pretrain preset=sd3-shapes", preset="sd3-shapes"
        ),
    },
    tp_plan=TP_PLAN,
    etp_plans={"t5": T5_ENCODER_PLAN},
    sp_plan="",  # SD3Transformer2DModel declares no _cp_plan
    geometry=geometry,
)
