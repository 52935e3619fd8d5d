"""Reward engine: scorer protocol, scorers, and the pool that runs and weights them."""
