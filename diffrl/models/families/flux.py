"""FLUX.1 as a model family: diffusers' ``FluxTransformer2DModel`` (19 double-stream + 38
single-stream blocks) on CLIP-L (pooled) + T5, with a 16-channel ``AutoencoderKL``.

Native convention ``sigma``: ``FluxPipeline`` passes ``timestep / 1000`` (= sigma) and the
transformer multiplies by 1000 inside; the flow-match Euler step makes its output eps - x0. So
FLUX is native in diffrl's own convention, and the family says so rather than pretending to be
``sigma_x1000``.

The engines see latents as (B, 16, H/8, W/8). ``FluxNet.forward`` packs them into 2x2 patches,
(B, HW/4, 64), builds the rotary position ids (``img_ids`` on the latent grid, ``txt_ids`` zeros,
as the pipeline does), runs the transformer and unpacks. FLUX.1-dev is guidance-distilled: its
transformer takes the guidance scale as an input (``guidance``, default 3.5), and the engines'
CFG is normally off for it.

Pipeline parity (contract 1): ``FluxFamily.reference`` runs ``FluxPipeline`` over the same
transformer and encoders, true CFG off and ``guidance_scale`` the family's guidance, from diffrl's
noise packed in 2x2 patches; the probe compares the packed latents, ``timestep`` (sigma),
``guidance``, the T5 states, CLIP's pooled output, ``txt_ids`` and ``img_ids``.
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
    random_component,
    save_pipeline_dir,
    tokenize_padded,
    word_tokenizer,
)
from diffrl.models.families._encoder_plans import T5_ENCODER_PLAN
from diffrl.models.family import (
    FamilyModel,
    FamilySpec,
    TokenBatch,
    attention_flops,
    hash_rows,
    linear_flops,
)
from diffrl.models.probe import HasReferencePipeline, Reference, flow_scheduler
from diffrl.parallel.tp import (
    FusedColwiseParallel,
    FusedRowwiseParallel,
    LocalHeads,
    PerHeadNorm,
    Plan,
)
from diffrl.sync import layouts
from diffrl.sync.weights import SlotMap
from diffrl.types import images_to_uint8

# Double blocks: attention (image and context projections) and the image MLP; single blocks:
# attention and the MLP up-projection. The single blocks' ``proj_out`` is left out: its name is
# also the transformer's final layer's, and a suffix target would catch both.
LORA_TARGETS = (
    *JOINT_ATTENTION_TARGETS,
    "ff.net.0.proj",
    "ff.net.2",
    "proj_mlp",
)
PIPELINE = "FluxPipeline"
COMPONENTS = {
    "transformer": "FluxTransformer2DModel",
    "text_encoder": "CLIPTextModel (CLIP-L)",
    "text_encoder_2": "T5EncoderModel",
    "tokenizer": "CLIP tokenizer",
    "tokenizer_2": "T5 tokenizer",
    "vae": "AutoencoderKL (16 latent channels)",
}
DEFAULT_GUIDANCE = 3.5
T5_DEFAULT_LEN = 512

# fmt: off
PRESETS: dict[str, dict] = {
    # black-forest-labs/FLUX.1-dev: 3072 wide (24 heads x 128), 1024 px, 128x128 latents
    "flux1-dev": dict(
        transformer=dict(
            patch_size=1, in_channels=64, num_layers=19, num_single_layers=38,
            attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
            pooled_projection_dim=768, guidance_embeds=True, axes_dims_rope=(16, 56, 56),
        ),
        clip=dict(
            hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
            num_attention_heads=12, max_position_embeddings=77, hidden_act="quick_gelu",
            vocab_size=49408, projection_dim=768,
        ),
        t5=dict(
            d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64, vocab_size=32128,
            feed_forward_proj="gated-gelu", relative_attention_num_buckets=32,
            relative_attention_max_distance=128, layer_norm_epsilon=1e-6,
        ),
        vae=dict(
            in_channels=3, out_channels=3, latent_channels=16,
            block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4, layers_per_block=2, norm_num_groups=32,
            scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
            use_post_quant_conv=False, sample_size=1024,
        ),
        resolution=1024, clip_len=77, t5_len=T5_DEFAULT_LEN,
    ),
    "flux1-tiny": dict(
        transformer=dict(
            patch_size=1, in_channels=64, num_layers=1, num_single_layers=2,
            attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
            pooled_projection_dim=16, guidance_embeds=True, axes_dims_rope=(4, 6, 6),
        ),
        clip=dict(
            hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=16, hidden_act="quick_gelu", vocab_size=0, projection_dim=16,
        ),
        t5=dict(
            d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, vocab_size=0,
            feed_forward_proj="gated-gelu", relative_attention_num_buckets=8,
            relative_attention_max_distance=32,
        ),
        vae=dict(
            in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(8, 8, 16, 16),
            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
            layers_per_block=1, norm_num_groups=8, scaling_factor=0.3611, shift_factor=0.1159,
            use_quant_conv=False, use_post_quant_conv=False, sample_size=64,
        ),
        resolution=64, clip_len=16, t5_len=16,
    ),
}
# fmt: on


def pack(x: Tensor) -> Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, 4C): 2x2 patches, as FluxPipeline._pack_latents."""
    b, c, h, w = x.shape
    return (
        x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, h * w // 4, 4 * c)
    )


def unpack(x: Tensor, h: int, w: int) -> Tensor:
    """The inverse of ``pack``: (B, H/2 * W/2, 4C) -> (B, C, H, W)."""
    b, _, c4 = x.shape
    return x.view(b, h // 2, w // 2, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, -1, h, w)


def image_ids(h: int, w: int, device, dtype) -> Tensor:
    """(h * w, 3) rotary ids of the packed latent grid: (0, row, col)."""
    ids = torch.zeros(h, w, 3, device=device, dtype=dtype)
    ids[..., 1] = torch.arange(h, device=device, dtype=dtype)[:, None]
    ids[..., 2] = torch.arange(w, device=device, dtype=dtype)[None, :]
    return ids.reshape(h * w, 3)


class FluxNet(DiffusersNet):
    """forward(x, t_native = sigma, input_ids) = the FLUX transformer's output (eps - x0)."""

    def __init__(self, transformer, clip, t5, lens: tuple[int, int], guidance: float) -> None:
        super().__init__(transformer, clip=clip, t5=t5)
        self.lens, self.guidance = lens, guidance

    def encode_uncached(self, input_ids: Tensor) -> tuple[Tensor, Tensor]:
        f = self.frozen
        ids_c, ids_t = input_ids.to(f.clip.device).split(self.lens, dim=1)
        pooled = f.clip(ids_c).pooler_output  # (b, 768): CLIP's eos state, no projection
        return f.t5(ids_t.to(f.t5.device))[0], pooled  # (b, T, 4096), (b, 768)

    def forward(self, x: Tensor, t_native: Tensor, input_ids: Tensor) -> Tensor:
        b, _, h, w = x.shape
        prompt, pooled = self.conditions(input_ids, dtype=x.dtype)
        guidance = None
        if self.transformer.config.guidance_embeds:
            guidance = torch.full((b,), self.guidance, device=x.device, dtype=x.dtype)
        out = self.transformer(
            hidden_states=pack(x),
            timestep=t_native.to(x.dtype),
            guidance=guidance,
            encoder_hidden_states=prompt.to(x.device),
            pooled_projections=pooled.to(x.device),
            txt_ids=torch.zeros(prompt.shape[1], 3, device=x.device, dtype=x.dtype),
            img_ids=image_ids(h // 2, w // 2, x.device, x.dtype),
            return_dict=False,
        )[0]
        return unpack(out, h, w)


class FluxFamily(HasReferencePipeline):
    name = "flux"
    native_convention = "sigma"  # timestep = sigma (the transformer scales by 1000 inside)
    lora_targets = LORA_TARGETS
    media = frozenset({"image"})

    def __init__(
        self,
        tokenizers: Sequence,
        lens: tuple[int, int],
        transformer,
        vae,
        resolution: int,
        guidance: float,
    ) -> None:
        self.tokenizers, self.lens, self.vae, self.guidance = tuple(tokenizers), lens, vae, guidance
        self.tcfg = transformer.config
        down = 2 ** (len(vae.config.block_out_channels) - 1)
        if resolution % (2 * down):
            raise ConfigError(f"flux: resolution {resolution} is not a multiple of {2 * down}")
        self._latent = (vae.config.latent_channels, resolution // down, resolution // down)

    def tokenize(self, texts: Sequence[str]) -> TokenBatch:
        parts = [
            tokenize_padded(t, list(texts), n)
            for t, n in zip(self.tokenizers, self.lens, strict=True)
        ]
        ids = torch.cat([p[0] for p in parts], dim=1)  # (B, 77 + T)
        return TokenBatch(ids, torch.cat([p[1] for p in parts], dim=1), hash_rows(ids))

    def null_ids(self) -> Tensor:
        return self.tokenize([""]).input_ids[0]

    def latent_shape(self) -> tuple[int, ...]:
        return self._latent

    @torch.no_grad()
    def decode(self, latents: Tensor) -> dict[str, Tensor]:
        c = self.vae.config
        z = latents.to(self.vae.device, self.vae.dtype) / c.scaling_factor + c.shift_factor
        return {"image": images_to_uint8(self.vae.decode(z).sample.cpu())}

    @torch.no_grad()
    def encode_pixels(self, pixels: Tensor) -> Tensor:
        c = self.vae.config
        mean = self.vae.encode(pixels.to(self.vae.device, self.vae.dtype)).latent_dist.mean
        return (mean - c.shift_factor) * c.scaling_factor

    def reference(self, model: FamilyModel, shift: float) -> Reference:
        """``FluxPipeline`` over this model's own components: no true CFG, the guidance
        embedding at the family's scale (what ``FluxNet`` feeds), diffrl's noise packed into the
        pipeline's 2x2 patches."""
        from diffusers import FluxPipeline

        f = model.net.frozen
        pipe = FluxPipeline(
            transformer=model.net.transformer, scheduler=flow_scheduler(shift), vae=self.vae,
            text_encoder=f.clip, tokenizer=self.tokenizers[0], text_encoder_2=f.t5,
            tokenizer_2=self.tokenizers[1],
        )  # fmt: skip
        pipe.set_progress_bar_config(disable=True)
        _, h, w = self._latent
        scale = pipe.vae_scale_factor

        def call(prompt: str, noise: Tensor, grid) -> None:
            pipe(
                prompt=prompt, latents=pack(noise).to(model.net.transformer.dtype),
                sigmas=list(grid), num_inference_steps=len(grid), guidance_scale=self.guidance,
                true_cfg_scale=1.0, height=h * scale, width=w * scale,
                max_sequence_length=self.lens[1], output_type="latent",
            )  # fmt: skip

        return Reference(model.net.transformer, call)

    def serving_layout(self, model: nn.Module) -> SlotMap:
        """diffusers' own fused path (``FluxAttention.fused_projections``: the processor
        computes with ``to_qkv`` and ``to_added_qkv``), and the MLP up-projections of both block
        kinds (``ff.net.0.proj``, ``proj_mlp``) in two swapped TP shards."""
        names = dict(model.named_modules())
        attns = [n for n in names if n.endswith(".attn") and hasattr(names[n], "fused_projections")]
        added = [n for n in attns if getattr(names[n], "add_q_proj", None) is not None]
        ups = [n for n in names if n.endswith((".ff.net.0.proj", ".proj_mlp"))]
        fused = layouts.merge(
            layouts.fuse_qkv(model, attns, native=True),
            layouts.fuse_qkv(
                model, added, "add_q_proj", "add_k_proj", "add_v_proj", "to_added_qkv", native=True
            ),
        )
        return layouts.merge(fused, layouts.split_swapped(model, ups))

    def flops(self, batch: int, input_ids: Tensor | None = None, cond=None) -> float:
        """The transformer's forward (T5 padded to its full length, cached). A double block:
        q/k/v/out and the 4x MLP on each stream (12 d^2 per token), joint attention, two
        per-sample adaLN tables (6 d each); a single block over the joint sequence: q/k/v, the
        4x MLP's up projection and the output over [attention, MLP] (12 d^2 per token), one
        3 d table. Outside: the packed-latent and text embedders, the time (and guidance) and
        pooled-text MLPs, the output adaLN and projection."""
        c = self.tcfg
        d = c.num_attention_heads * c.attention_head_dim
        n_img = (self._latent[1] // 2) * (self._latent[2] // 2)
        n_txt = self.lens[1]
        n = n_img + n_txt
        double = linear_flops(n, d, 12 * d) + attention_flops(n, n, d) + linear_flops(1, d, 12 * d)
        single = linear_flops(n, d, 12 * d) + attention_flops(n, n, d) + linear_flops(1, d, 3 * d)
        out = (c.out_channels or c.in_channels) * c.patch_size**2
        io = linear_flops(n_img, c.in_channels, d) + linear_flops(n_img, d, out)
        io += linear_flops(n_txt, c.joint_attention_dim, d)
        times = 2 if c.guidance_embeds else 1  # the timestep's MLP, and the guidance's
        io += linear_flops(1, times * 256 + c.pooled_projection_dim + (times + 1) * d, d)
        io += linear_flops(1, d, 2 * d)
        return float(batch * (c.num_layers * double + c.num_single_layers * single + io))


# --- building and loading ---------------------------------------------------------------------


def preset_components(
    preset: str, dtype=torch.float32, device="cpu", max_text_len: int = 0
) -> dict:
    """A preset's pipeline components with random weights (subfolder -> model or tokenizer)."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextModel, T5EncoderModel

    if preset not in PRESETS:
        raise ConfigError(f"flux: unknown preset {preset!r}; known: {sorted(PRESETS)}")
    p = PRESETS[preset]
    clip_tok = word_tokenizer(TINY_WORDS, "clip", p["clip_len"])
    t5_tok = word_tokenizer(TINY_WORDS, "t5", max_text_len or p["t5_len"])
    clip = {
        **p["clip"],
        "vocab_size": max(p["clip"]["vocab_size"], len(clip_tok)),
        "bos_token_id": clip_tok.bos_token_id,
        "eos_token_id": clip_tok.eos_token_id,
        "pad_token_id": clip_tok.pad_token_id,
    }
    t5 = {
        **p["t5"],
        "vocab_size": max(p["t5"]["vocab_size"], len(t5_tok)),
        "pad_token_id": t5_tok.pad_token_id,
        "eos_token_id": t5_tok.eos_token_id,
    }
    return {
        "transformer": random_component(FluxTransformer2DModel, p["transformer"], dtype, device),
        "text_encoder": random_component(CLIPTextModel, clip, dtype, device),
        "text_encoder_2": random_component(T5EncoderModel, t5, dtype, device),
        "tokenizer": clip_tok,
        "tokenizer_2": t5_tok,
        "vae": random_component(AutoencoderKL, p["vae"], dtype, device),
    }


def tiny_components(preset: str = "flux1-tiny") -> dict:
    """What tests write with ``save_pipeline_dir(path, tiny_components(), PIPELINE)``."""
    return preset_components(preset)


def _load_dir(path: str, dtype: torch.dtype, device: torch.device) -> dict:
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

    root = check_pipeline_dir(path, "flux", COMPONENTS)
    classes = dict(
        transformer=FluxTransformer2DModel,
        text_encoder=CLIPTextModel,
        text_encoder_2=T5EncoderModel,
        tokenizer=AutoTokenizer,
        tokenizer_2=AutoTokenizer,
        vae=AutoencoderKL,
    )
    return {sub: load_component(root, sub, cls, dtype, device) for sub, cls in classes.items()}


def assemble(
    parts: dict,
    resolution: int,
    t5_len: int,
    convention: str = "",
    guidance: float = DEFAULT_GUIDANCE,
) -> FamilyModel:
    """A FamilyModel from pipeline components (however they were made)."""
    toks = (parts["tokenizer"], parts["tokenizer_2"])
    lens = (toks[0].model_max_length, t5_len)
    net = FluxNet(
        parts["transformer"], parts["text_encoder"], parts["text_encoder_2"], lens, guidance
    )
    family = FluxFamily(toks, lens, parts["transformer"], parts["vae"], resolution, guidance)
    return FamilyModel(net, family, convention)


def load(cfg, device: torch.device, guidance: float = DEFAULT_GUIDANCE) -> FamilyModel:
    """``cfg.path`` (a local FLUX pipeline directory) or ``cfg.preset`` (random weights)."""

    def from_dir(path: str, dtype: torch.dtype) -> tuple[dict, dict]:
        parts = _load_dir(path, dtype, device)
        t5_len = min(parts["tokenizer_2"].model_max_length, T5_DEFAULT_LEN)
        return parts, dict(resolution=parts["vae"].config.sample_size, max_text_len=t5_len)

    def from_preset(name: str, dtype: torch.dtype) -> tuple[dict, dict]:
        parts = preset_components(name, dtype, device, cfg.max_text_len)
        t5_len = parts["tokenizer_2"].model_max_length
        return parts, dict(resolution=PRESETS[name]["resolution"], max_text_len=t5_len)

    parts, s = load_source(cfg, "flux", PRESETS, from_dir, from_preset)
    return assemble(parts, s["resolution"], s["max_text_len"], cfg.convention, guidance)


def save(parts: dict, path) -> None:
    save_pipeline_dir(path, parts, PIPELINE)


# --- tensor parallelism: the DiT's plan (styles in diffrl/parallel/tp.py) ----------------------

# FLUX.1 (FluxTransformer2DModel). Double-stream blocks: one joint attention over [text; image]
# (image projections to_*, text add_*_proj, per-head RMSNorm qk-norms on (B, S, H, D)) and two
# GELU MLPs, as SD3's joint blocks. Single-stream blocks run attention (pre_only: no to_out) and
# an MLP side by side on the same input and project ``cat([attn, gelu(proj_mlp)])`` back with
# one ``proj_out``: its input is two column-sharded tensors side by side, so a plain row shard
# would pair rank 1's attention columns with rank 0's weights. FluxSingleTransformerBlock's
# MLP is 4x the width (mlp_ratio 4.0, which FluxTransformer2DModel never changes), so the
# concatenation is 5 chunks of the width: proj_mlp is FusedColwiseParallel(4) (each rank's MLP
# slice of each quarter) and proj_out FusedRowwiseParallel(5), whose input columns are those
# same slices (the attention's heads, then the four quarters). The processor reshapes by
# head_dim (``unflatten(-1, (-1, head_dim))``); ``heads`` is divided to keep the module true.
_FLUX_ATTENTION: Plan = {
    "attn": LocalHeads("heads"),
    "attn.to_q": ColwiseParallel(),
    "attn.to_k": ColwiseParallel(),
    "attn.to_v": ColwiseParallel(),
    "attn.norm_q": PerHeadNorm(heads_dim=2),  # on (B, S, H, D)
    "attn.norm_k": PerHeadNorm(heads_dim=2),
}
TP_PLAN: Plan = {
    **{f"transformer_blocks.*.{k}": v for k, v in _FLUX_ATTENTION.items()},
    "transformer_blocks.*.attn.add_q_proj": ColwiseParallel(),
    "transformer_blocks.*.attn.add_k_proj": ColwiseParallel(),
    "transformer_blocks.*.attn.add_v_proj": ColwiseParallel(),
    "transformer_blocks.*.attn.norm_added_q": PerHeadNorm(heads_dim=2),
    "transformer_blocks.*.attn.norm_added_k": PerHeadNorm(heads_dim=2),
    "transformer_blocks.*.attn.to_out.0": RowwiseParallel(),
    "transformer_blocks.*.attn.to_add_out": RowwiseParallel(),
    "transformer_blocks.*.ff.net.0.proj": ColwiseParallel(),  # GELU(proj): elementwise
    "transformer_blocks.*.ff.net.2": RowwiseParallel(),
    "transformer_blocks.*.ff_context.net.0.proj": ColwiseParallel(),
    "transformer_blocks.*.ff_context.net.2": RowwiseParallel(),
    **{f"single_transformer_blocks.*.{k}": v for k, v in _FLUX_ATTENTION.items()},
    "single_transformer_blocks.*.proj_mlp": FusedColwiseParallel(chunks=4),
    "single_transformer_blocks.*.proj_out": FusedRowwiseParallel(chunks=5),  # [attn; 4 x mlp]
}


FAMILY = FamilySpec(
    load=load,
    family_class=FluxFamily,
    presets=PRESETS,
    tp_plan=TP_PLAN,
    etp_plans={"t5": T5_ENCODER_PLAN},
    sp_plan="diffusers",
)
