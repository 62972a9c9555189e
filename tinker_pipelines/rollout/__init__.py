"""Rollout: the batched sampler and the episode runner that drives environments with it."""
