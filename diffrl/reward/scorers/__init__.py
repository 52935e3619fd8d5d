"""Built-in scorers; importing this package registers them."""

from diffrl.reward.scorers import shapes  # noqa: F401
