"""CLAP audio-text agreement: ``cos(audio_emb, text_emb)`` for omni (audio) generators.

The rollout's audio comes at its own sample rate; CLAP's feature extractor expects a fixed one
(48 kHz for LAION's checkpoints) and rejects anything else, so the scorer resamples with a
polyphase filter (scipy) when the two differ. Clips longer than the extractor's window are
cropped to their start rather than left to the extractor, whose long-clip handling
("rand_trunc" / "fusion") draws random chunks: a reward must be a deterministic function of the
sample, or the same rollout scores differently each time it is looked at.
"""

from __future__ import annotations

import asyncio
from math import gcd

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from diffrl.reward.scorer import ScoreResult, audio_rate, register_scorer
from diffrl.reward.scorers.clip import pooled, require_local_dir, resolve_dtype, unique_index
from diffrl.types import Trajectory


def mono(audio: Tensor) -> Tensor:
    """(B, S) or (B, C, S) -> (B, S) float32; channels are averaged (CLAP is mono)."""
    if audio.ndim == 3:
        audio = audio.float().mean(dim=1)
    if audio.ndim != 2:
        raise ValueError(f"audio must be (B, samples) or (B, C, samples), got {tuple(audio.shape)}")
    return audio.float()


def resample(audio: np.ndarray, sr_from: int, sr_to: int) -> np.ndarray:
    """Resample (B, S) along the last axis with a polyphase FIR (anti-aliased, exact ratio)."""
    if sr_from == sr_to:
        return audio
    from scipy.signal import resample_poly

    g = gcd(int(sr_from), int(sr_to))
    return resample_poly(audio, sr_to // g, sr_from // g, axis=-1).astype(np.float32)


@register_scorer("clap")
class ClapScorer:
    """``cos(CLAP(audio), CLAP(prompt))`` with a local transformers CLAP checkpoint.

    Params: ``path`` (required, a ``save_pretrained`` directory with ``ClapModel`` and
    ``ClapProcessor``), ``sample_rate`` (0 = the
    trajectory's ``extra_fields["sample_rate"]``; else it must match), ``device``, ``dtype``,
    ``batch_size``, ``crop`` (True: keep the first window of a long clip, deterministically;
    False: hand the whole clip to the extractor and accept its random long-clip handling).
    Rows with a non-finite audio sample are marked invalid, never scored.
    """

    needs = frozenset({"audio"})
    modality = "audio"  # the sound against the text: credit per modality gives it to the audio

    def __init__(
        self,
        path: str | None = None,
        sample_rate: int = 0,  # 0 = the trajectory's extra_fields['sample_rate']
        device: str = "cpu",
        dtype: str = "float32",
        batch_size: int = 16,
        crop: bool = True,
        name: str = "clap",
    ) -> None:
        from transformers import ClapModel, ClapProcessor

        self.name = name
        model_dir = require_local_dir(path, name)
        torch_dtype = resolve_dtype(dtype)
        if sample_rate < 0 or batch_size < 1:
            raise ValueError(
                f"sample_rate={sample_rate} (>= 0), batch_size={batch_size} (>= 1): out of range"
            )
        self.sample_rate = int(sample_rate)
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.crop = crop
        self.model = ClapModel.from_pretrained(model_dir, local_files_only=True)
        self.model.to(self.device, torch_dtype).eval().requires_grad_(False)
        self.processor = ClapProcessor.from_pretrained(model_dir, local_files_only=True)
        self.model_rate = int(self.processor.feature_extractor.sampling_rate)
        self.window = int(self.processor.feature_extractor.nb_max_samples)
        self.max_text_len = int(self.model.config.text_config.max_position_embeddings) - 2

    async def score(self, traj: Trajectory) -> ScoreResult:
        return await asyncio.to_thread(self.score_sync, traj)

    @torch.no_grad()
    def score_sync(self, traj: Trajectory) -> ScoreResult:
        audio = mono(traj.extra_fields["audio"])
        finite = torch.isfinite(audio).all(dim=1)
        audio = torch.where(finite[:, None], audio, torch.zeros_like(audio)).clamp(-1, 1)
        rate = audio_rate(traj, self.sample_rate)
        wav = resample(audio.cpu().numpy(), rate, self.model_rate)
        if self.crop:
            wav = wav[:, : self.window]
        texts, idx = unique_index(traj.prompts.texts)
        text_emb = F.normalize(self.embed_texts(texts).float(), dim=-1)[idx]
        audio_emb = torch.cat(
            [
                self.embed_audio(wav[i : i + self.batch_size])
                for i in range(0, len(wav), self.batch_size)
            ]
        )
        scores = (F.normalize(audio_emb.float(), dim=-1) * text_emb).sum(-1).cpu()
        scores = torch.where(finite, scores, torch.full_like(scores, float("nan")))
        return ScoreResult(scores, torch.isfinite(scores))

    def embed_texts(self, texts: list[str]) -> Tensor:
        tok = self.processor.tokenizer(
            texts, padding=True, truncation=True, max_length=self.max_text_len, return_tensors="pt"
        )
        return pooled(self.model.get_text_features(**tok.to(self.device)))

    def embed_audio(self, wav: np.ndarray) -> Tensor:
        feats = self.processor.feature_extractor(
            list(wav), sampling_rate=self.model_rate, return_tensors="pt"
        )
        inputs = {k: v.to(self.device) for k, v in feats.items()}
        inputs["input_features"] = inputs["input_features"].to(self.model.dtype)
        return pooled(self.model.get_audio_features(**inputs))
