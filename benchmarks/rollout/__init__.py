"""Sampling: the torch sampler against HF generate, each prompt once per group, sampling beside training."""
