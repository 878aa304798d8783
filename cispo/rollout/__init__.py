"""Rollout: sampling responses (and their log-probs) from the policy.

``TorchSampler`` is the plain-PyTorch reference backend (KV-cached batched decoding of any Hugging Face
causal LM); other backends implement the same ``Sampler`` protocol.
"""

from cispo.rollout.base import RolloutBatch, Sampler, SamplingConfig
from cispo.rollout.torch_sampler import TorchSampler

__all__ = ["RolloutBatch", "Sampler", "SamplingConfig", "TorchSampler"]
