"""Algorithms: small pure functions over typed batches, registered by name."""
