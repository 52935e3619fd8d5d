"""MiniMax-H3's Ref2VA packed sequence: a reference image and a reference soundtrack ahead of
the generated rows.

diffusers' H3 has a ``ref2va`` task (``MiniMaxH3Ref2VABlocks``): an ordered list of references
(images, videos with their soundtrack, audio clips) packed one block per reference,
``[text | reference blocks | target audio | target video]``
(``MiniMaxH3Ref2VAPrepareLayoutStep.build_ref2va_packed_sequence``). diffrl's Ref2VA is that
task with the references fixed to ``[image, audio]``, in that order:

- the image: one latent frame through the video VAE at the model's frame size, at rotary time
  ``n_text``, its own (h, w) grid; it advances the shared clock by 1. Its rows are held at
  t = max(t, 0.999) as FL2VA keyframes are (the pipeline's ``keyframe_noise_aug``);
- the soundtrack: audio-VAE latents of the clip's duration, channel-major, clean at t = 1
  (the pipeline never noises a reference soundtrack), at rotary time ``n_text + 1`` onwards,
  pinned to the target frame's width extremes as generated audio is; it advances the clock by
  its latent count;
- the generated audio and video start where the references left the clock.

Both blocks are detached and cut from the output (no gradient, no loss). The pipeline's
``_fill_audio_positions`` writes two width coordinates per latent (stereo); this layout writes
the channel-major pattern of the t2va layout (channel 0 at the first width coordinate, the
rest at the last), so a mono model (h3-tiny) has one; for stereo the two agree
(tests/models/families/test_minimax_h3.py compares them).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _audio_positions(pos: Tensor, start: int, n: int, channels: int, time: float, width) -> None:
    """One channel-major audio block of ``n`` latents per channel from row ``start``."""
    rows = slice(start, start + n * channels)
    pos[rows, 0] = (time + torch.arange(n, dtype=torch.float64)).repeat(channels)
    pos[rows, 2] = float(width[-1])
    pos[start : start + n, 2] = float(width[0])


def ref2va_layout(
    text_tags: Tensor,
    video_shape: tuple[int, int, int, int],
    audio_shape: tuple[int, int, int],
    patch: tuple[int, int, int],
    n_ref_audio: int,
    tags: tuple[int, int],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, int, int]:
    """(position_ids, token_tags, video_indices, audio_indices, text_indices, reference video
    rows, reference audio rows) of ``[text | image | soundtrack | target audio | target video]``;
    ``tags`` = (video tag, audio tag)."""
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (
        _frame_position_grid,
        _temporal_position_grid,
    )

    _, f, h, w = video_shape
    channels, n_audio, _ = audio_shape
    _, ph, pw = patch
    video_tag, audio_tag = tags
    per_frame = (h // ph) * (w // pw)
    n_text = text_tags.shape[0]
    n_img, n_ref = per_frame, n_ref_audio * channels
    ref_start = n_text + n_img
    audio_start = ref_start + n_ref
    video_start = audio_start + n_audio * channels
    length = video_start + f * per_frame
    pos = torch.zeros(length, 3, dtype=torch.float64)
    pos[:n_text, 0] = torch.arange(n_text, dtype=torch.float64)
    grid, width = _frame_position_grid(h, w, ph, pw)
    clock = float(n_text)
    pos[n_text:ref_start, 0] = clock  # the image: one frame, one integer rotary slot
    pos[n_text:ref_start, 1:] = grid
    clock += 1.0
    _audio_positions(pos, ref_start, n_ref_audio, channels, clock, width)
    clock += float(n_ref_audio)
    _audio_positions(pos, audio_start, n_audio, channels, clock, width)
    frame_time = _temporal_position_grid(f, clock)
    pos[video_start:, 0] = frame_time.repeat_interleave(per_frame)
    pos[video_start:, 1:] = grid.repeat(f, 1)
    video = torch.cat([torch.arange(n_text, ref_start), torch.arange(video_start, length)])
    audio = torch.arange(ref_start, video_start)
    text = torch.arange(n_text)
    token_tags = torch.empty(length, dtype=torch.long)
    token_tags[text] = text_tags.long()
    token_tags[audio] = audio_tag
    token_tags[video] = video_tag
    return pos, token_tags, video, audio, text, n_img, n_ref
