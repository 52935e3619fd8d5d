"""Rollout: pure sampler steps, the batching scheduler and the engine that keeps trajectories."""
