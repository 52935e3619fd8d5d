"""Qwen-Image as a model family: ``QwenImageTransformer2DModel`` on a Qwen2.5-VL text encoder.

What the family owns, and where diffusers' ``QwenImagePipeline`` says it:

- **Presentation, once** (contract 3). The pipeline wraps each prompt in a system/user chat
  template, tokenizes the whole text, runs Qwen2.5-VL over it and keeps the last layer's
  hidden states *after* the template's prefix (``prompt_template_encode_start_idx`` = 34 tokens
  for the real tokenizer). Here the template is applied in ``tokenize`` and nowhere else: the
  ids that travel carry it, and the encoder only drops the prefix's hidden states. The prefix
  length is measured on the family's own tokenizer (34 for Qwen2's; fewer for the tiny one).
- **Time** ("sigma"). The pipeline feeds ``timestep / 1000`` (= sigma) and the transformer
  scales it by 1000 inside its sinusoidal embedding; the flow-match Euler step
  ``x += (sigma_next - sigma) * out`` makes the output d x / d sigma = eps - x0 (sign +1).
- **Latents.** The VAE (``AutoencoderKLQwenImage``, a one-frame video VAE) gives 16 x H/8 x W/8,
  normalised as (z - latents_mean) / latents_std; the transformer sees them packed in 2x2
  patches, (B, H/16 * W/16, 64), with ``img_shapes`` for its RoPE and the text mask.
- **Serving layout** (contract 2). The rollout copy fuses each block's image-stream q/k/v into
  ``attn.to_qkv`` and text-stream add_q/k/v into ``attn.to_added_qkv`` (one GEMM each instead of
  three); ``FusedQKVProcessor`` feeds diffusers' own processor from the fused projections.
- **Pipeline parity** (contract 1). ``QwenImageFamily.reference`` runs ``QwenImagePipeline``
  (its own template, true CFG off) over the same transformer and encoder from diffrl's noise
  packed in 2x2 patches; the probe compares the packed latents, ``timestep`` (sigma), the text
  states after the template prefix, ``encoder_hidden_states_mask`` (None on both sides when no
  row is padded) and ``img_shapes``.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager

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
    vae_lock,
    word_tokenizer,
)
from diffrl.models.families._encoder_plans import QWEN2_5_VL_ENCODER_PLAN
from diffrl.models.family import (
    FamilyModel,
    FamilySpec,
    TokenBatch,
    attention_flops,
    hash_rows,
    linear_flops,
)
from diffrl.models.probe import HasReferencePipeline, Reference, flow_scheduler
from diffrl.parallel.tp import LocalHeads, PerHeadNorm, Plan
from diffrl.sync.layouts import fuse_qkv, merge
from diffrl.sync.weights import SlotMap
from diffrl.types import images_to_uint8

# Module-name suffixes under net.transformer: both streams' attention and MLPs, never the
# AdaLN modulation (img_mod / txt_mod) or the embedders.
LORA_TARGETS = (
    *JOINT_ATTENTION_TARGETS,
    "img_mlp.net.0.proj",
    "img_mlp.net.2",
    "txt_mlp.net.0.proj",
    "txt_mlp.net.2",
)

# QwenImagePipeline.prompt_template_encode: the prompt goes in the user turn
TEMPLATE = (
    "<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
    "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
    "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
)
NEGATIVE_PROMPT = " "  # the pipeline's documented "empty" negative prompt for true CFG
COMPONENTS = {
    "transformer": "QwenImageTransformer2DModel",
    "text_encoder": "Qwen2_5_VLForConditionalGeneration",
    "tokenizer": "Qwen2Tokenizer",
    "vae": "AutoencoderKLQwenImage",
}

_QWEN_VL_7B_TEXT = dict(  # Qwen2.5-VL-7B-Instruct's language model
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    max_position_embeddings=128000,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6, "mrope_section": [16, 24, 24]},
    bos_token_id=151643,
    eos_token_id=151645,
)
_QWEN_VL_7B_VISION = dict(  # built (from_pretrained needs it) but never run by this family
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    out_hidden_size=3584,
    fullatt_block_indexes=[7, 15, 23, 31],
    window_size=112,
    tokens_per_second=2,
)

# qwen-image at real size: a 20.4 B transformer (40.9 GB in bf16), Qwen2.5-VL-7B 8.3 B (16.6 GB,
# of which the unused vision tower and lm_head are 1.2 B), VAE 0.13 B
PRESETS: dict[str, dict] = {
    "qwen-image": dict(
        transformer=dict(
            patch_size=2,
            in_channels=64,
            out_channels=16,
            num_layers=60,
            attention_head_dim=128,
            num_attention_heads=24,
            joint_attention_dim=3584,
            axes_dims_rope=(16, 56, 56),
        ),
        text_encoder=dict(text_config=_QWEN_VL_7B_TEXT, vision_config=_QWEN_VL_7B_VISION),
        vae=dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2),
        resolution=1024,
        max_text_len=512,
    ),
    "qwen-image-tiny": dict(
        transformer=dict(
            patch_size=2,
            in_channels=64,
            out_channels=16,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=32,
            axes_dims_rope=(4, 6, 6),
        ),
        text_encoder=dict(
            text_config=dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                rms_norm_eps=1e-6,
                rope_parameters={
                    "rope_type": "default",
                    "rope_theta": 1e6,
                    "mrope_section": [1, 1, 2],
                },
                bos_token_id=None,
                eos_token_id=None,
            ),
            vision_config=dict(
                depth=1,
                hidden_size=16,
                intermediate_size=32,
                num_heads=2,
                out_hidden_size=32,
                fullatt_block_indexes=[0],
            ),
        ),
        vae=dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1),
        resolution=32,
        max_text_len=16,
    ),
}
DEFAULT_RESOLUTION, DEFAULT_MAX_TEXT_LEN = 1024, 512  # the pipeline's 128 * 8 px, 512 tokens


def present(text: str) -> str:
    """The one presentation of a prompt: Qwen-Image's chat template around it."""
    return TEMPLATE.format(text)


def pack(x: Tensor) -> Tensor:
    """(B, C, H, W) -> (B, H/2 * W/2, 4C): 2x2 patches, channel-major within a patch."""
    b, c, h, w = x.shape
    x = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(x: Tensor, h: int, w: int) -> Tensor:
    """(B, H/2 * W/2, 4C) -> (B, C, H, W), the inverse of ``pack``."""
    b, _, c4 = x.shape
    x = x.view(b, h // 2, w // 2, c4 // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c4 // 4, h, w)


class QwenImageNet(DiffusersNet):
    """forward(x (B, 16, h, w), sigma (B,), input_ids (B, L)) -> eps - x0 (B, 16, h, w)."""

    def __init__(self, transformer, text_encoder, vae, prefix_len: int, pad_id: int) -> None:
        super().__init__(transformer, text_encoder=text_encoder, vae=vae)
        self.prefix_len, self.pad_id = prefix_len, pad_id

    def encode_uncached(self, input_ids: Tensor) -> tuple[Tensor, Tensor]:
        """Last hidden layer over template + prompt, the template's prefix dropped: the
        pipeline's ``_get_qwen_prompt_embeds`` for right-padded rows (B, L)."""
        te = self.frozen.text_encoder
        mask = input_ids != self.pad_id  # (b, L)
        out = te(input_ids=input_ids, attention_mask=mask.long(), output_hidden_states=True)
        hidden = out.hidden_states[-1][:, self.prefix_len :]  # (b, L - prefix, D)
        keep = mask[:, self.prefix_len :]
        return hidden * keep[..., None].to(hidden.dtype), keep

    def forward(self, x: Tensor, t: Tensor, input_ids: Tensor) -> Tensor:
        txt, mask = self.conditions(input_ids, dtype=x.dtype)
        # the pipeline pads a batch to its longest prompt; counted on the (host) ids, the same
        # count as the cached mask's without waiting for the GPU
        n = int((input_ids[:, self.prefix_len :] != self.pad_id).sum(1).max())
        txt, mask = txt[:, :n], mask[:, :n]
        b, _, h, w = x.shape
        out = self.transformer(
            hidden_states=pack(x),
            timestep=t.to(x.dtype),
            encoder_hidden_states=txt,
            encoder_hidden_states_mask=None if mask.all() else mask,
            img_shapes=[[(1, h // 2, w // 2)]] * b,
            return_dict=False,
        )[0]
        return unpack(out, h, w)


class _Given(nn.Module):
    """Stands in for a projection whose output was already computed (by a fused GEMM)."""

    def __init__(self, out: Tensor) -> None:
        super().__init__()
        self.out = out

    def forward(self, _x: Tensor) -> Tensor:
        return self.out


class FusedQKVProcessor:
    """The rollout's attention for a fused block: one GEMM per stream (``to_qkv`` on the image
    tokens, ``to_added_qkv`` on the text tokens), whose chunks are handed to diffusers'
    ``QwenDoubleStreamAttnProcessor2_0`` in place of its six separate projections. The wrapped
    processor is diffusers' own, so the attention maths is not copied here."""

    PROJ = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj")

    def __init__(self, inner) -> None:
        self.inner = inner

    # diffusers sets the attention backend and context-parallel config on the processor
    _attention_backend = property(
        lambda self: self.inner._attention_backend,
        lambda self, v: setattr(self.inner, "_attention_backend", v),
    )
    _parallel_config = property(
        lambda self: self.inner._parallel_config,
        lambda self, v: setattr(self.inner, "_parallel_config", v),
    )

    # the parameters are spelt out: ``Attention.forward`` drops the kwargs a processor's
    # signature does not name
    def __call__(
        self,
        attn,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        encoder_hidden_states_mask: Tensor | None = None,
        attention_mask: Tensor | None = None,
        image_rotary_emb=None,
    ):
        outs = (
            *attn.to_qkv(hidden_states).chunk(3, dim=-1),
            *attn.to_added_qkv(encoder_hidden_states).chunk(3, dim=-1),
        )
        with _stand_ins(attn, dict(zip(self.PROJ, outs, strict=True))):
            return self.inner(
                attn,
                hidden_states,
                encoder_hidden_states,
                encoder_hidden_states_mask=encoder_hidden_states_mask,
                attention_mask=attention_mask,
                image_rotary_emb=image_rotary_emb,
            )


@contextmanager
def _stand_ins(attn: nn.Module, outs: dict[str, Tensor]):
    for name, out in outs.items():
        attn._modules[name] = _Given(out)
    try:
        yield
    finally:
        for name in outs:
            del attn._modules[name]


def fuse_attention(model: nn.Module) -> SlotMap:
    """Re-lay every Qwen-Image block of ``model`` (a FamilyModel copy) with fused q/k/v per
    stream (``to_qkv``, ``to_added_qkv``), computed by ``FusedQKVProcessor``; returns where
    each trained projection's delta rows land."""
    blocks = model.net.transformer.transformer_blocks
    prefixes = [f"net.transformer.transformer_blocks.{i}.attn" for i in range(len(blocks))]
    image = fuse_qkv(model, prefixes, native=True)
    text = fuse_qkv(
        model, prefixes, "add_q_proj", "add_k_proj", "add_v_proj", "to_added_qkv", native=True
    )
    for block in blocks:
        block.attn.set_processor(FusedQKVProcessor(block.attn.processor))
    return merge(image, text)


class QwenImageFamily(HasReferencePipeline):
    name = "qwen_image"
    native_convention = "sigma"
    lora_targets = LORA_TARGETS
    media = frozenset({"image"})

    def __init__(self, tokenizer, net: QwenImageNet, resolution: int, max_text_len: int) -> None:
        self.tokenizer, self.net = tokenizer, net
        self.resolution, self.max_text_len = resolution, max_text_len
        self.vae_scale = 2 ** len(net.frozen.vae.temperal_downsample)  # 8
        if resolution % (2 * self.vae_scale):
            raise ConfigError(
                f"qwen_image: resolution {resolution} must be a multiple of {2 * self.vae_scale} "
                "(VAE x8, then 2x2 packing)"
            )

    # --- contract 3 ---------------------------------------------------------------------
    @property
    def row_len(self) -> int:
        return self.net.prefix_len + self.max_text_len

    def tokenize(self, texts: Sequence[str]) -> TokenBatch:
        ids, mask = tokenize_padded(self.tokenizer, [present(t) for t in texts], self.row_len)
        return TokenBatch(ids, mask, hash_rows(ids))

    def null_ids(self) -> Tensor:
        return self.tokenize([NEGATIVE_PROMPT]).input_ids[0]

    # --- shapes and media ---------------------------------------------------------------
    def latent_shape(self) -> tuple[int, ...]:
        s = self.resolution // self.vae_scale
        return (self.net.frozen.vae.config.z_dim, s, s)

    def _stats(self, like: Tensor) -> tuple[Tensor, Tensor]:
        cfg = self.net.frozen.vae.config
        view = (1, cfg.z_dim, 1, 1, 1)
        mean = torch.tensor(cfg.latents_mean).view(view).to(like)
        std = torch.tensor(cfg.latents_std).view(view).to(like)
        return mean, std

    @torch.no_grad()
    def decode(self, latents: Tensor) -> dict[str, Tensor]:
        vae = self.net.frozen.vae
        z = latents.to(next(vae.parameters())).unsqueeze(2)  # (B, 16, 1, h, w)
        mean, std = self._stats(z)
        with vae_lock(vae):  # (B, 3, H, W)
            pixels = vae.decode(z * std + mean, return_dict=False)[0][:, :, 0]
        return {"image": images_to_uint8(pixels.cpu())}

    @torch.no_grad()
    def encode_pixels(self, pixels: Tensor) -> Tensor:
        vae = self.net.frozen.vae
        x = pixels.to(next(vae.parameters())).unsqueeze(2)  # (B, 3, 1, H, W)
        with vae_lock(vae):
            z = vae.encode(x).latent_dist.mode()
        mean, std = self._stats(z)
        return ((z - mean) / std)[:, :, 0]

    # --- contract 1: the reference pipeline ------------------------------------------------
    def reference(self, model: FamilyModel, shift: float) -> Reference:
        """``QwenImagePipeline`` over this model's own components, true CFG off, its own prompt
        template. Its template prefix is a constant for Qwen2's tokenizer (34), which stands for
        that tokenizer (so the probe checks diffrl's measured prefix against it); for another
        (the tiny presets' word tokenizer) it is counted on the pipeline's own template."""
        from diffusers import QwenImagePipeline

        net = model.net
        pipe = QwenImagePipeline(
            scheduler=flow_scheduler(shift), vae=net.frozen.vae,
            text_encoder=net.frozen.text_encoder, tokenizer=self.tokenizer,
            transformer=net.transformer,
        )  # fmt: skip
        if not type(self.tokenizer).__name__.startswith("Qwen2"):
            prefix = pipe.prompt_template_encode.split("{}")[0]
            ids = self.tokenizer(prefix, add_special_tokens=False)["input_ids"]
            pipe.prompt_template_encode_start_idx = len(ids)
        pipe.set_progress_bar_config(disable=True)
        _, h, w = self.latent_shape()
        scale = pipe.vae_scale_factor

        def call(prompt: str, noise: Tensor, grid) -> None:
            pipe(
                prompt=prompt, latents=pack(noise).to(net.transformer.dtype), sigmas=list(grid),
                num_inference_steps=len(grid), true_cfg_scale=1.0, guidance_scale=None,
                height=h * scale, width=w * scale, max_sequence_length=self.max_text_len,
                output_type="latent",
            )  # fmt: skip

        return Reference(net.transformer, call)

    # --- contract 2 and cost ------------------------------------------------------------
    def serving_layout(self, model: nn.Module) -> SlotMap:
        return fuse_attention(model)

    def flops(self, batch: int, input_ids: Tensor | None = None, cond=None) -> float:
        """One transformer forward (the text encoder runs once per prompt, cached), its text
        as the net cuts it: the batch's longest prompt in ``input_ids`` (default
        ``max_text_len``). Per block and stream: q/k/v/out and the 4x MLP (12 d^2 per token), a
        per-sample 6 d adaLN table; joint attention. Outside: the latent and text embedders,
        the time MLP, the output adaLN and projection."""
        cfg = self.net.transformer.config
        d = cfg.num_attention_heads * cfg.attention_head_dim
        n_img = (self.resolution // self.vae_scale // 2) ** 2
        n_txt = self.max_text_len
        if input_ids is not None:
            net = self.net
            n_txt = int((input_ids[:, net.prefix_len :] != net.pad_id).sum(1).max())
        n = n_img + n_txt
        block = linear_flops(n, d, 12 * d) + attention_flops(n, n, d) + linear_flops(2, d, 6 * d)
        io = linear_flops(n_img, cfg.in_channels, d) + linear_flops(
            n_txt, cfg.joint_attention_dim, d
        )
        io += linear_flops(n_img, d, cfg.patch_size**2 * cfg.out_channels)
        io += linear_flops(1, 256 + d, d) + linear_flops(1, d, 2 * d)  # time MLP, output adaLN
        return float(batch * (cfg.num_layers * block + io))


# --- building ---------------------------------------------------------------------------------


def prefix_len(tokenizer) -> int:
    """Tokens of the template before the prompt: the hidden states the encoder drops."""
    prefix = TEMPLATE.split("{}")[0]
    return len(tokenizer(prefix, add_special_tokens=False)["input_ids"])


def build(
    transformer, text_encoder, vae, tokenizer, resolution: int, max_text_len: int, convention=""
):
    tokenizer.padding_side = "right"  # encode_uncached drops the first prefix_len positions
    if tokenizer.pad_token_id is None:
        raise ConfigError("qwen_image: the tokenizer has no pad token")
    net = QwenImageNet(
        transformer, text_encoder, vae, prefix_len(tokenizer), tokenizer.pad_token_id
    )
    family = QwenImageFamily(tokenizer, net, resolution, max_text_len)
    return FamilyModel(net, family, convention)


def tiny_tokenizer(max_len: int):
    return word_tokenizer(TINY_WORDS, "qwen", max_len)


def _text_encoder_config(spec: dict, vocab: int) -> dict:
    text = {"vocab_size": vocab, **spec["text_config"]}
    return {"text_config": text, "vision_config": spec["vision_config"]}


def _random(preset: str, dtype: torch.dtype, device: torch.device) -> dict:
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import Qwen2_5_VLForConditionalGeneration

    spec = PRESETS[preset]
    tok = tiny_tokenizer(spec["max_text_len"])
    vocab = spec["text_encoder"]["text_config"].get("vocab_size", len(tok))
    te_cfg = _text_encoder_config(spec["text_encoder"], vocab)
    return dict(
        transformer=random_component(
            QwenImageTransformer2DModel, spec["transformer"], dtype, device
        ),
        text_encoder=random_component(Qwen2_5_VLForConditionalGeneration, te_cfg, dtype, device),
        vae=random_component(AutoencoderKLQwenImage, spec["vae"], dtype, device),
        tokenizer=tok,
    )


def tiny_components(preset: str = "qwen-image-tiny") -> dict[str, object]:
    """Random components of ``preset`` on the CPU in fp32, for ``save_pipeline_dir``."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    parts = _random(preset, torch.float32, torch.device("cpu"))
    return {**parts, "scheduler": FlowMatchEulerDiscreteScheduler(shift_terminal=None)}


def save_tiny(path, preset: str = "qwen-image-tiny"):
    return save_pipeline_dir(path, tiny_components(preset), "QwenImagePipeline")


def load(cfg, device: torch.device) -> FamilyModel:
    """From a local pipeline directory (``cfg.path``) or a preset with random weights."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration

    def from_dir(path: str, dtype: torch.dtype) -> tuple[dict, dict]:
        root = check_pipeline_dir(path, "qwen_image", COMPONENTS)
        parts = dict(
            transformer=load_component(
                root, "transformer", QwenImageTransformer2DModel, dtype, device
            ),
            text_encoder=load_component(
                root, "text_encoder", Qwen2_5_VLForConditionalGeneration, dtype, device
            ),
            vae=load_component(root, "vae", AutoencoderKLQwenImage, dtype, device),
            tokenizer=load_component(root, "tokenizer", AutoTokenizer, dtype, device),
        )
        return parts, dict(resolution=DEFAULT_RESOLUTION, max_text_len=DEFAULT_MAX_TEXT_LEN)

    def from_preset(name: str, dtype: torch.dtype) -> tuple[dict, dict]:
        spec = PRESETS[name]
        sizes = dict(resolution=spec["resolution"], max_text_len=spec["max_text_len"])
        return _random(name, dtype, device), sizes

    parts, settings = load_source(cfg, "qwen_image", PRESETS, from_dir, from_preset)
    return build(**parts, **settings, convention=cfg.convention)


# --- tensor parallelism: the DiT's plan (styles in diffrl/parallel/tp.py) ----------------------

# Qwen-Image (QwenImageTransformer2DModel): dual-stream blocks, one joint attention over
# [text; image] with the image projections (to_*) and the text ones (add_*_proj) and per-head
# RMSNorm qk-norms on (B, S, H, D), then an image and a text GELU MLP. The processor reshapes
# by ``head_dim = inner_dim // heads`` with -1 heads, so both are divided (the ratio, and so
# head_dim, stays; a processor that reshapes by ``heads`` would see the local count too). The
# AdaLN modulation (img_mod, txt_mod) stays replicated.
TP_PLAN: Plan = {
    "transformer_blocks.*.attn": LocalHeads("heads", "inner_dim"),
    "transformer_blocks.*.attn.to_q": ColwiseParallel(),
    "transformer_blocks.*.attn.to_k": ColwiseParallel(),
    "transformer_blocks.*.attn.to_v": ColwiseParallel(),
    "transformer_blocks.*.attn.add_q_proj": ColwiseParallel(),
    "transformer_blocks.*.attn.add_k_proj": ColwiseParallel(),
    "transformer_blocks.*.attn.add_v_proj": ColwiseParallel(),
    "transformer_blocks.*.attn.norm_q": PerHeadNorm(heads_dim=2),  # on (B, S, H, D)
    "transformer_blocks.*.attn.norm_k": PerHeadNorm(heads_dim=2),
    "transformer_blocks.*.attn.norm_added_q": PerHeadNorm(heads_dim=2),
    "transformer_blocks.*.attn.norm_added_k": PerHeadNorm(heads_dim=2),
    "transformer_blocks.*.attn.to_out.0": RowwiseParallel(),
    "transformer_blocks.*.attn.to_add_out": RowwiseParallel(),
    "transformer_blocks.*.img_mlp.net.0.proj": ColwiseParallel(),  # GELU(proj): elementwise
    "transformer_blocks.*.img_mlp.net.2": RowwiseParallel(),
    "transformer_blocks.*.txt_mlp.net.0.proj": ColwiseParallel(),
    "transformer_blocks.*.txt_mlp.net.2": RowwiseParallel(),
}


FAMILY = FamilySpec(
    load=load,
    family_class=QwenImageFamily,
    presets=PRESETS,
    tp_plan=TP_PLAN,
    etp_plans={"qwen2_5_vl": QWEN2_5_VL_ENCODER_PLAN},
    sp_plan="diffusers",
)
