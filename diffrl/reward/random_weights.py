"""Random-weight reward models in the layouts a user's real checkpoints have on disk, for
benchmarks and tests that must run the real scorers without downloading anything.

- ``clap_dir``: transformers' ``ClapModel`` (default config: HTSAT audio, RoBERTa-base text, the
  layout of LAION's clap-htsat checkpoints; or a tiny one) saved with ``save_pretrained`` beside
  a processor whose tokenizer is built here, because the CLAP scorer loads a directory.
- ``random_imagebind`` / ``write_imagebind``: diffrl's ImageBind network (``imagebind_huge``
  or the tiny config) with a ViT-style random init; its state dict carries Meta's parameter
  names, so the written file loads as a user's ``imagebind_huge.pth`` does.
- ``write_av_rewards`` writes both under one folder; ``scorers_override`` is the
  ``reward.scorers=[...]`` override that points the CLAP + ImageBind reward at them.

Used by ``benchmarks/random_av_rewards.py`` and ``benchmarks/av_reward.py``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from diffrl.reward.scorers.imagebind_net import ImageBindConfig, ImageBindNet

# the unfused checkpoints' extractor: one mel channel (the default "fusion" makes 4, for the
# fused model); the scorer crops long clips itself, so the random truncation never runs
UNFUSED = dict(truncation="rand_trunc", padding="repeatpad")
# the towers the AV reward reads; a file holding only their entries loads (imagebind_net's
# fit_state_dict skips the modalities a network leaves out, and the file has none of them)
AV_TOWERS = ("vision", "audio")


def byte_tokenizer(folder: Path):
    """A RoBERTa tokenizer with one token per byte (no merges): the CLAP scorer needs one on
    disk and none may be downloaded. Texts come out longer than with the real vocabulary."""
    from transformers import RobertaTokenizer

    printable = set(range(33, 127)) | set(range(161, 173)) | set(range(174, 256))
    vocab = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}
    unprintable = [b for b in range(256) if b not in printable]  # stand-ins from U+0100 up
    for b in range(256):
        vocab[chr(b) if b in printable else chr(256 + unprintable.index(b))] = len(vocab)
    vocab["<mask>"] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n", encoding="utf-8")
    return RobertaTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"))


def clap_dir(folder: Path, tiny: bool) -> Path:
    """A random ``ClapModel`` + ``ClapProcessor`` directory: the default config (48 kHz, 10 s
    windows, 64 mel bins), or a tiny one (8 kHz, 1 s windows) for CPU runs."""
    from transformers import ClapConfig, ClapFeatureExtractor, ClapModel, ClapProcessor

    folder.mkdir(parents=True, exist_ok=True)
    tok = byte_tokenizer(folder)
    if tiny:
        layers = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2)
        cfg = ClapConfig(
            text_config=dict(vocab_size=len(tok), num_attention_heads=2, **layers,
                             max_position_embeddings=80, projection_dim=16),
            audio_config=dict(spec_size=64, num_mel_bins=16, patch_size=4, patch_stride=(4, 4),
                              patch_embeds_hidden_size=16, hidden_size=32, depths=[1, 1],
                              num_attention_heads=[2, 2], window_size=4, freq_ratio=4,
                              enable_fusion=False, projection_dim=16),
            projection_dim=16,
        )  # fmt: skip
        fe = ClapFeatureExtractor(feature_size=16, sampling_rate=8000, hop_length=160,
                                  max_length_s=1, fft_window_size=256, frequency_max=4000,
                                  **UNFUSED)  # fmt: skip
    else:
        cfg, fe = ClapConfig(), ClapFeatureExtractor(**UNFUSED)
    ClapModel(cfg).save_pretrained(folder)
    ClapProcessor(feature_extractor=fe, tokenizer=tok).save_pretrained(folder)
    return folder


def random_imagebind(
    cfg: ImageBindConfig, device: torch.device, dtype: torch.dtype
) -> ImageBindNet:
    """Meta-built, then ``to_empty`` on ``device`` and a ViT-style random init (normal 0.02
    matrices, unit norms, zero biases; the fixed logit scales as the release's)."""
    with torch.device("meta"):
        net = ImageBindNet(cfg)
    net.to_empty(device=device)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if p.ndim >= 2:
                nn.init.normal_(p, std=0.02)
            elif name.endswith("bias") or "bias_" in name:
                p.zero_()
            else:
                p.fill_(1.0)
        for name, b in net.named_buffers():
            if name.endswith("log_logit_scale"):
                b.fill_(math.log(20.0))
    return net.to(dtype)


def write_imagebind(path: Path, tiny: bool, dtype: torch.dtype, device: torch.device) -> Path:
    """A random ImageBind state dict (the AV towers, Meta's names) saved with ``torch.save``."""
    size = ImageBindConfig.tiny if tiny else ImageBindConfig.huge
    net = random_imagebind(size(modalities=AV_TOWERS), device, dtype)
    torch.save({k: v.cpu() for k, v in net.state_dict().items()}, path)
    return path


def write_av_rewards(out: Path, tiny: bool, device: torch.device | None = None) -> dict[str, Path]:
    """``out/clap`` and ``out/imagebind_{huge,tiny}.pth``; huge is written in bfloat16 (the
    dtype the recipes score in: half the bytes), tiny in float32."""
    out.mkdir(parents=True, exist_ok=True)
    device = device or torch.device("cpu")
    dtype = torch.float32 if tiny else torch.bfloat16
    name = f"imagebind_{'tiny' if tiny else 'huge'}.pth"
    return {
        "clap": clap_dir(out / "clap", tiny),
        "imagebind": write_imagebind(out / name, tiny, dtype, device),
    }


def scorers_override(paths: dict[str, Path], tiny: bool, weights=(0.5, 0.5)) -> str:
    """``reward.scorers=[clap, imagebind]`` at ``paths``, each on the run's device (quote it
    for the shell with single quotes: it holds ``${run.device}``)."""
    on_run = 'device: "${run.device}"'
    ib = f"weights: {paths['imagebind']}, {on_run}"
    ib += ", size: tiny, dtype: float32" if tiny else ", dtype: bfloat16"
    return (
        f"reward.scorers=[{{name: clap, weight: {weights[0]}, params: "
        f"{{path: {paths['clap']}, {on_run}}}}}, "
        f"{{name: imagebind, weight: {weights[1]}, params: {{{ib}}}}}]"
    )
