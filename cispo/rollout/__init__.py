"""Rollout: sampling responses (and their log-probs) from the policy.

``TorchSampler`` is the plain-PyTorch reference backend (KV-cached batched decoding of any Hugging Face
causal LM); ``VLLMSampler`` (``pip install "cispo[vllm]"``, a CUDA GPU) samples with a colocated vLLM
engine. Both subclass ``Sampler`` (``generate`` plus optional capabilities with no-op defaults).
``rollout_is_weights`` corrects for the mismatch between the rollout engine and the trainer (token or
sequence level; truncated, masked or rejected), ``truncated_is_weights`` its token-level truncated case (TIS).
"""

from cispo.rollout.base import RolloutBatch, Sampler, SamplingConfig
from cispo.rollout.correction import rollout_is_weights, truncated_is_weights
from cispo.rollout.torch_sampler import TorchSampler

__all__ = ["RolloutBatch", "Sampler", "SamplingConfig", "TorchSampler", "VLLMSampler", "rollout_is_weights",
           "truncated_is_weights"]


def __getattr__(name: str):
    # Lazy: `cispo.rollout.vllm_sampler` imports vLLM only when a VLLMSampler is built, but keep even that
    # module out of `import cispo.rollout`.
    if name == "VLLMSampler":
        from cispo.rollout.vllm_sampler import VLLMSampler

        return VLLMSampler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
