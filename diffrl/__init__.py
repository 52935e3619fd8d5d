"""diffrl: RL post-training for flow-matching diffusion and omni (audio+video) generators."""

__version__ = "0.1.0"
