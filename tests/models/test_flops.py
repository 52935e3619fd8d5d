"""Each family's analytic ``flops(batch)`` against torch's own FLOP counter
(``FlopCounterMode``) on the same transformer forward, at real size on the ``meta`` device:
shapes only, so a 33 B transformer costs no memory and no arithmetic.

Only the transformer is counted. ``flops`` leaves the text encoders out because they run once
per prompt and are cached, so each case puts its prompt's text conditions in the encode cache
first (the state of every denoising step after a prompt's first), builds no encoder at all,
and reads the count at the transformer's module path.

On meta, SDPA takes its math path (two bmm, which the counter counts); the CPU's fused SDPA
kernel has no FLOP formula, so attention would silently count as 0 there.

TOLERANCE: the analytic counts are the per-token Linears and the attention by sequence length;
what they leave out is per sample (adaLN modulation, timestep and pooled-text embeddings) or,
in some families, the patch embedding and final projection, all under 1% at real size (the
tiny DiT, 76 tokens, is the furthest off: 0.9915). 5% holds every family with room to spare,
and a count off by 10% fails.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor
from torch.utils.flop_counter import FlopCounterMode

from diffrl.models.families import flux, ltx2, minimax_h3, qwen_image, sd3, tiny_dit, wan
from diffrl.models.families._diffusers import TINY_WORDS, word_tokenizer
from diffrl.models.family import FamilyModel, hash_rows
from diffrl.models.tiny_dit import TinyDiTConfig

TOLERANCE = 0.05
BATCH = 2
META = torch.device("meta")
TRANSFORMER = "FamilyModel.net.transformer"  # FlopCounterMode's key: the module path

# a case: the model, one forward of it, and the module path whose FLOPs flops() counts
Case = tuple[FamilyModel, Callable[[], object], str]


def meta(*shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.empty(*shape, device=META, dtype=dtype)


def cached_forward(
    model: FamilyModel, *rows: Tensor, ids: Tensor | None = None
) -> Callable[[], Tensor]:
    """The model's own forward at sigma 0.5 over BATCH copies of one prompt (``ids``, default
    one token) whose text conditions (one row each, no batch axis) are already in the encode
    cache."""
    if ids is None:
        ids = torch.zeros(BATCH, 1, dtype=torch.long)  # on the CPU: the cache hashes them
    model.net.cache.store[hash_rows(ids)[0]] = rows
    x = meta(BATCH, *model.family.latent_shape())
    sigma = torch.full((BATCH,), 0.5, device=META)
    return lambda: model(x, sigma, ids)


def sd35_medium_512() -> Case:
    """SD3.5 Medium at 512 px: 32 x 32 image tokens, 77 CLIP + 256 T5 text tokens."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel

    p = sd3.PRESETS["sd35-medium"]
    with META:
        parts = dict(
            transformer=SD3Transformer2DModel.from_config(p["transformer"]),
            vae=AutoencoderKL.from_config(p["vae"]),
        )
    no_encoders = dict.fromkeys(("text_encoder", "text_encoder_2", "text_encoder_3"))
    tokenizers = sd3._tokenizers(p["clip_len"], p["t5_len"])
    model = sd3.assemble({**parts, **no_encoders, **tokenizers}, 512, p["t5_len"])
    prompt = meta(p["clip_len"] + p["t5_len"], p["t5"]["d_model"])  # CLIPs on channels, then T5
    pooled = meta(p["clip_l"]["projection_dim"] + p["clip_g"]["projection_dim"])
    return model, cached_forward(model, prompt, pooled), TRANSFORMER


def flux1_dev() -> Case:
    """FLUX.1-dev at 1024 px: 64 x 64 packed tokens, 512 T5 tokens."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel

    p = flux.PRESETS["flux1-dev"]
    with META:
        parts = dict(
            transformer=FluxTransformer2DModel.from_config(p["transformer"]),
            vae=AutoencoderKL.from_config(p["vae"]),
        )
    tokenizers = dict(
        tokenizer=word_tokenizer(TINY_WORDS, "clip", p["clip_len"]),
        tokenizer_2=word_tokenizer(TINY_WORDS, "t5", p["t5_len"]),
    )
    no_encoders = dict.fromkeys(("text_encoder", "text_encoder_2"))
    model = flux.assemble({**parts, **no_encoders, **tokenizers}, p["resolution"], p["t5_len"])
    prompt, pooled = meta(p["t5_len"], p["t5"]["d_model"]), meta(p["clip"]["hidden_size"])
    return model, cached_forward(model, prompt, pooled), TRANSFORMER


def qwen_image_1024() -> Case:
    """Qwen-Image at 1024 px: 64 x 64 packed tokens, 512 text tokens."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel

    p = qwen_image.PRESETS["qwen-image"]
    with META:
        dit = QwenImageTransformer2DModel.from_config(p["transformer"])
        vae = AutoencoderKLQwenImage.from_config(p["vae"])
    n_txt = p["max_text_len"]
    tok = qwen_image.tiny_tokenizer(n_txt)
    model = qwen_image.build(dit, None, vae, tok, p["resolution"], n_txt)
    txt = meta(n_txt, p["transformer"]["joint_attention_dim"])
    mask = torch.ones(n_txt, dtype=torch.bool)
    # ids whose n_txt tokens after the template are all real: the net reads the longest prompt
    # off the (host) ids
    net = model.net
    ids = torch.full((BATCH, net.prefix_len + n_txt), net.pad_id + 1, dtype=torch.long)
    return model, cached_forward(model, txt, mask, ids=ids), TRANSFORMER


def wan21_1_3b() -> Case:
    """Wan2.1-1.3B, 81 frames at 480 px: 21 x 30 x 30 = 18,900 tokens, 512 text tokens."""
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    p = wan.PRESETS["wan2.1-1.3b"]
    with META:
        dit = WanTransformer3DModel.from_config(p["transformer"])
        vae = AutoencoderKLWan.from_config(p["vae"])
    n_txt = p["max_text_len"]
    tok = wan.tiny_tokenizer(n_txt)
    model = wan.build(dit, None, vae, tok, p["resolution"], p["frames"], n_txt)
    txt = meta(n_txt, p["transformer"]["text_dim"])
    return model, cached_forward(model, txt), TRANSFORMER


def ltx2_512() -> Case:
    """LTX-2, 121 frames at 512 px: 4,096 video + 126 audio tokens, 1024 text tokens."""
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video
    from diffusers import LTX2VideoTransformer3DModel as Transformer
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    p = ltx2.PRESETS["ltx2"]
    classes = dict(
        transformer=Transformer,
        vae=AutoencoderKLLTX2Video,
        audio_vae=AutoencoderKLLTX2Audio,
        vocoder=LTX2Vocoder,
    )
    with META:
        parts = {sub: cls.from_config(p[sub]) for sub, cls in classes.items()}
    n_txt = p["max_text_len"]
    model = ltx2.build(
        **parts,
        text_encoder=None,
        connectors=None,
        tokenizer=ltx2.tiny_tokenizer(n_txt),
        resolution=p["resolution"],
        frames=p["frames"],
        max_text_len=n_txt,
        fps=p["fps"],
    )
    width = parts["transformer"].config.caption_channels  # the connectors' output
    mask = torch.ones(n_txt, dtype=torch.long, device=META)
    return model, cached_forward(model, meta(n_txt, width), meta(n_txt, width), mask), TRANSFORMER


def minimax_h3_768() -> Case:
    """MiniMax-H3, 124 frames at 768 px: one packed sequence of 512 text, 414 audio and
    21,312 video rows.

    The transformer is called directly with what ``MiniMaxH3Net._group`` passes it: the net
    itself tabulates each row's time with ``torch.unique``, which has no meta kernel. Its
    Qwen3-VL is built (on meta, trimmed as the preset trims it) only because the net reads
    its config; it never runs."""
    from diffusers import (
        AutoencoderKLMiniMaxH3,
        AutoencoderKLMiniMaxH3Audio,
        MiniMaxH3Transformer3DModel,
    )
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    p = minimax_h3.PRESETS["minimax-h3"]
    te = {k: dict(v) for k, v in p["text_encoder"].items()}
    te["text_config"]["num_hidden_layers"] = p["text_layer"] + 1
    with META:
        dit = MiniMaxH3Transformer3DModel.from_config(p["transformer"])
        vae = AutoencoderKLMiniMaxH3.from_config(p["vae"])
        audio_vae = AutoencoderKLMiniMaxH3Audio.from_config(p["audio_vae"])
        text_encoder = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**te))
    n_txt = p["max_text_len"]
    model = minimax_h3.build(
        dit,
        text_encoder,
        *minimax_h3.codecs(vae, audio_vae, p),
        minimax_h3.tiny_tokenizer(n_txt),
        resolution=p["resolution"],
        frames=p["frames"],
        max_text_len=n_txt,
        fps=p["fps"],
        audio_shift_ratio=p["audio_shift"] / p["video_shift"],
        audio_channels=p["audio_channels"],
        text_layer=p["text_layer"],
    )
    net, cfg = model.net, dit.config
    c, f, h, w = net.video_shape
    pt, ph, pw = cfg.patch_size
    ch, n_audio, c_a = net.audio_shape
    layout = net.layout(n_txt, (), META)
    rows = layout["position_ids"].shape[0]

    def forward():
        return dit(
            hidden_states=meta(BATCH, (f // pt) * (h // ph) * (w // pw), c * pt * ph * pw),
            audio_hidden_states=meta(BATCH, ch * n_audio, c_a),
            encoder_hidden_states=meta(BATCH, n_txt, cfg.text_dim),
            timestep=meta(2),  # the video and the audio time
            timestep_indices=torch.zeros(rows, dtype=torch.long, device=META),
            return_dict=False,
            **layout,
        )

    return model, forward, type(dit).__name__  # called directly: the module is the root


DIFFUSERS_CASES = {
    f.__name__: f
    for f in (sd35_medium_512, flux1_dev, qwen_image_1024, wan21_1_3b, ltx2_512, minimax_h3_768)
}


def assert_flops_match(model: FamilyModel, forward: Callable[[], object], path: str) -> None:
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        forward()
    counted = sum(counter.get_flop_counts()[path].values())
    ratio = model.family.flops(BATCH) / counted
    assert abs(ratio - 1) < TOLERANCE, f"{model.family.name}: analytic / counted = {ratio:.4f}"


@pytest.mark.parametrize("case", DIFFUSERS_CASES)
def test_diffusers_family_flops_match_the_counter(case: str) -> None:
    pytest.importorskip("diffusers")
    assert_flops_match(*DIFFUSERS_CASES[case]())


def test_tiny_dit_flops_match_the_counter() -> None:
    """The built-in DiT at the config's defaults (the shapes_dit checkpoint's size): 64 image
    + 12 text tokens. It is its own network (no encoder): the count is the whole net's."""
    with META:
        model = tiny_dit.build(TinyDiTConfig())
    x = meta(BATCH, *model.family.latent_shape())
    ids = torch.ones(BATCH, model.family.arch.max_text_len, dtype=torch.long, device=META)
    sigma = torch.full((BATCH,), 0.5, device=META)
    assert_flops_match(model, lambda: model(x, sigma, ids), "FamilyModel.net")
