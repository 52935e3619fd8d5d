"""Built-in scorers; importing this package registers them."""

from diffrl.reward.http import client as _http_client  # noqa: F401  (registers "http")
from diffrl.reward.scorers import clap, clip, compress, imagebind, ocr, shapes, vlm  # noqa: F401
