"""Each family's analytic ``flops(batch, input_ids, cond)`` against torch's own FLOP counter
(``FlopCounterMode``) on the same transformer forward:

- at real size on the ``meta`` device (shapes only, so a 33 B transformer costs no memory
  and no arithmetic), and
- on each family's tiny preset on the CPU (real arithmetic, milliseconds), where the
  per-sample terms (adaLN tables, time MLPs) weigh most, with prompts of different lengths
  (the text rows Qwen-Image and MiniMax-H3 run at) and the conditioned forwards (H3's FL2VA
  keyframe rows and Ref2VA reference rows, LTX-2's I2AV and FL2VA frames).

Only the transformer is counted. ``flops`` leaves the text encoders out because they run once
per prompt and are cached, so each case puts its prompt's text conditions in the encode cache
first (the state of every denoising step after a prompt's first) and reads the count at the
transformer's module path.

What is counted, on both sides: matmuls (Linear, bmm, convolution) at 2 FLOPs per
multiply-add, and attention as its two matmuls (4 N_q N_k d). FlopCounterMode has no formula
for elementwise work (norms, activations, softmax, RoPE, modulation), embedding lookups or
index copies, so the analytic counts leave them out too. SDPA runs on its math path (two bmm,
which the counter counts): the CPU's fused SDPA kernel has no FLOP formula, so attention would
silently count as 0 there (on a GPU the flash/efficient/cuDNN kernels have formulas).

TOLERANCE: 0.5%. Every matmul the forward runs is in the formulas, so today they agree to
rounding; the margin is for a diffusers change to a per-sample term. Before this count
(2026-12-05) the formulas were up to 49% off on the tiny presets (Qwen-Image's text taken at
its padded length, H3's keyframe rows and second output head missing), and a count 1% off
fails.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import pytest
import torch
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from diffrl.models.families import flux, ltx2, minimax_h3, qwen_image, sd3, tiny_dit, wan
from diffrl.models.families._diffusers import TINY_WORDS, word_tokenizer
from diffrl.models.family import FamilyModel, hash_rows
from diffrl.models.registry import ModelConfig, load_model
from diffrl.models.tiny_dit import TinyDiTConfig

TOLERANCE = 0.005
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


# --- the tiny presets, on the CPU -------------------------------------------------------------

TINY = ("sd35-tiny", "flux1-tiny", "qwen-image-tiny", "wan-tiny", "ltx2-tiny", "h3-tiny")
PROMPTS = ["a red circle on the left of a big blue square", "two squares"]  # different lengths


@functools.cache
def tiny_model(preset: str) -> FamilyModel:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return load_model(ModelConfig(preset=preset))


def tiny_conds(model: FamilyModel) -> dict[str, Tensor | None]:
    """The family's conditioned forwards beside T2V(A): name -> ``cond`` rows for 2 samples."""
    net, out = model.net, {"text only": None}
    if model.family.name == "minimax_h3":
        c, _, h, w = net.video_shape
        out["fl2va"] = torch.randn(len(PROMPTS), 2, c, 1, h, w)
        out["ref2va"] = torch.randn(len(PROMPTS), c * h * w + math.prod(net.audio_shape))
    if model.family.name == "ltx2":
        c, _, h, w = model.family.geometry.video
        out["i2av"] = torch.randn(len(PROMPTS), 1, c, 1, h, w)
        out["fl2va"] = torch.randn(len(PROMPTS), 2, c, 1, h, w)
    return out


@pytest.mark.parametrize("preset", TINY)
def test_tiny_preset_flops_match_the_counter(preset: str) -> None:
    pytest.importorskip("diffusers")
    model = tiny_model(preset)
    ids = model.family.tokenize(PROMPTS).input_ids
    x = torch.randn(len(PROMPTS), *model.family.latent_shape())
    sigma = torch.full((len(PROMPTS),), 0.3)
    for name, cond in tiny_conds(model).items():
        args = (x, sigma, ids) if cond is None else (x, sigma, ids, cond)
        with torch.no_grad():
            model(*args)  # fills the encode cache: the count is a denoising step's
            with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
                model(*args)
        counted = sum(counter.get_flop_counts()[TRANSFORMER].values())
        ratio = model.family.flops(len(PROMPTS), ids, cond) / counted
        assert abs(ratio - 1) < TOLERANCE, f"{preset} {name}: analytic / counted = {ratio:.4f}"


def test_text_length_and_keyframe_rows_count() -> None:
    """The corrections the tiny counts rest on, stated directly: H3's sequence follows each
    row's real text length, and FL2VA adds two keyframes' rows; Qwen-Image's follows the
    batch's longest prompt."""
    h3 = tiny_model("h3-tiny").family
    long_short = h3.tokenize(PROMPTS).input_ids
    assert h3.flops(2, long_short) < h3.flops(2)  # below the padded max_text_len
    assert h3.flops(1, long_short[1:]) < h3.flops(1, long_short[:1])
    c, _, h, w = h3.net.video_shape
    fl2va = torch.zeros(1, 2, c, 1, h, w)
    assert h3.flops(1, long_short[:1], fl2va) > h3.flops(1, long_short[:1])
    qwen = tiny_model("qwen-image-tiny").family
    ids = qwen.tokenize(PROMPTS).input_ids
    assert qwen.flops(2, ids) == 2 * qwen.flops(1, ids[:1]) > 2 * qwen.flops(1, ids[1:])
