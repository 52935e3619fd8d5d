"""Built-in scorers; importing this package registers them."""

import diffrl.reward.scorers.avbench  # noqa: F401  (registers "avbench")
from diffrl.reward.http import client as _http_client  # noqa: F401  (registers "http")
from diffrl.reward.scorers import clap, clip, compress, imagebind, ocr, shapes, vlm  # noqa: F401
