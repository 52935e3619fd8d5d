"""The reward HTTP API's wire format, shared by the client and the server.

Images and video frames travel as base64 PNG: lossless, so a remote scorer sees exactly the
pixels a local one would and the two give identical rewards. Audio travels as base64 16-bit PCM
WAV, which every audio stack reads (float WAV is not written by the standard library).
Both sides import this one module so the wire format cannot drift between them.
"""

from __future__ import annotations

import base64
import binascii
import io
import struct
import wave
import zlib

import numpy as np
from PIL import Image

TOKEN_ENV = "DIFFRL_REWARD_TOKEN"  # default env var holding the shared bearer token
# Trajectory.extra_fields key -> JSON request field that carries it
MEDIA_FIELDS = {"image": "images", "video": "videos", "audio": "audio"}

# Per-image cap checked from the PNG header before decoding: a tiny, highly compressed PNG can
# claim billions of pixels, and the body-size limit alone does not stop that (a "PNG bomb").
# Decoding one image briefly takes ~10 bytes a pixel (Pillow's buffer, the RGB copy, the
# batch), so this also bounds the transient memory of one decode to ~170 MB; the server's
# per-request budget bounds the batch.
MAX_IMAGE_PIXELS = 1 << 24  # 16.8 Mpx, 4096 x 4096
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PCM_MAX = 32767.0


class CodecError(ValueError):
    """A media string could not be decoded; the message says which and why."""


class TooLargeError(CodecError):
    """Decoded media would exceed a size limit (the server answers 413, not 422)."""


def _b64decode(text: object, what: str) -> bytes:
    if not isinstance(text, str):
        raise CodecError(f"{what} must be a base64 string, got {type(text).__name__}")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise CodecError(f"{what} is not valid base64: {e}") from None


def encode_png(image: np.ndarray) -> str:
    """(H, W, 3) uint8 -> base64 PNG. compress_level=1: the payload is small either way and
    encoding runs on the training host's CPU, so speed matters more than the last few bytes."""
    if image.dtype != np.uint8 or image.ndim != 3 or image.shape[-1] != 3:
        raise ValueError(f"an image must be (H, W, 3) uint8, got {image.shape} {image.dtype}")
    buf = io.BytesIO()
    Image.fromarray(np.ascontiguousarray(image), mode="RGB").save(
        buf, format="PNG", compress_level=1
    )
    return base64.b64encode(buf.getvalue()).decode("ascii")


def check_png_whole(raw: bytes, what: str) -> None:
    """Every chunk of a PNG is present, its CRC right, up to IEND. Pillow decodes a PNG cut
    after its last image data (no IEND) without a word, so a truncated upload was scored as
    a valid image; this walks the chunk headers (a CRC over the bytes, no decoding)."""
    view, pos = memoryview(raw), len(PNG_SIGNATURE)
    while True:
        if pos + 12 > len(raw):
            raise CodecError(f"{what} is a truncated PNG: it ends at byte {len(raw)}, before IEND")
        length, kind = struct.unpack_from(">I4s", raw, pos)
        end = pos + 12 + length
        if end > len(raw):
            raise CodecError(
                f"{what} is a truncated PNG: its {kind!r} chunk needs {end} bytes, "
                f"it has {len(raw)}"
            )
        (crc,) = struct.unpack_from(">I", raw, end - 4)
        if zlib.crc32(view[pos + 4 : end - 4]) != crc:
            raise CodecError(f"{what} is a corrupt PNG: the CRC of its {kind!r} chunk is wrong")
        if kind == b"IEND":
            return
        pos = end


def png_size(text: object, what: str) -> tuple[bytes, tuple[int, int]]:
    """Base64 PNG -> (raw bytes, (width, height)) reading only the header, so limits can be
    checked before any pixel is decoded; then the file is checked whole (``check_png_whole``)."""
    raw = _b64decode(text, what)
    try:
        with Image.open(io.BytesIO(raw)) as im:
            if im.format != "PNG":
                raise CodecError(f"{what} is a {im.format} image; the API takes PNG only")
            size = im.size
    except CodecError:
        raise
    except Image.DecompressionBombError as e:
        raise TooLargeError(f"{what}: {e}") from None
    except Exception as e:  # Pillow raises many types for garbage input
        raise CodecError(f"{what} is not a PNG image ({type(e).__name__})") from None
    if size[0] * size[1] > MAX_IMAGE_PIXELS:
        raise TooLargeError(f"{what} is {size[0]}x{size[1]} px, over {MAX_IMAGE_PIXELS} pixels")
    check_png_whole(raw, what)
    return raw, size


def decode_png(raw: bytes, what: str) -> np.ndarray:
    """PNG bytes -> (H, W, 3) uint8. Grey or RGBA inputs are converted to RGB because every
    scorer reads three channels."""
    try:
        with Image.open(io.BytesIO(raw)) as im:
            return np.asarray(im.convert("RGB"), dtype=np.uint8)
    except Exception as e:
        raise CodecError(f"{what} could not be decoded: {e}") from None


def encode_wav(audio: np.ndarray, sample_rate: int) -> str:
    """(N,) mono or (C, N) float in [-1, 1] -> base64 16-bit PCM WAV (clipped to the range)."""
    a = np.asarray(audio, dtype=np.float32)
    if a.ndim == 1:
        a = a[None]
    if a.ndim != 2:
        raise ValueError(f"audio must be (N,) or (C, N), got shape {a.shape}")
    pcm = np.round(np.clip(a, -1.0, 1.0) * PCM_MAX).astype("<i2")
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(a.shape[0])
        w.setsampwidth(2)
        w.setframerate(int(sample_rate))
        w.writeframes(np.ascontiguousarray(pcm.T).tobytes())  # WAV interleaves channels
    return base64.b64encode(buf.getvalue()).decode("ascii")


def decode_wav(text: object, what: str) -> tuple[np.ndarray, int]:
    """Base64 16-bit PCM WAV -> ((N,) or (C, N) float32 in [-1, 1], sample rate)."""
    raw = _b64decode(text, what)
    try:
        with wave.open(io.BytesIO(raw), "rb") as w:
            channels, width, rate = w.getnchannels(), w.getsampwidth(), w.getframerate()
            frames = w.readframes(w.getnframes())
    except (wave.Error, EOFError) as e:
        raise CodecError(f"{what} is not a WAV file: {e}") from None
    if width != 2:
        raise CodecError(f"{what} has {8 * width}-bit samples; the API takes 16-bit PCM")
    pcm = np.frombuffer(frames, dtype="<i2").reshape(-1, channels).T
    out = pcm.astype(np.float32) / PCM_MAX
    return (out[0] if channels == 1 else out), rate
