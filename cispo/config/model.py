"""The ``model:`` section of the run's configuration: the policy, its precision, LoRA, FSDP and
compilation, and the frozen reference of a KL term (`cispo.config.train` gathers the sections)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["ModelConfig"]


@dataclass
class ModelConfig:
    """The policy."""

    path: str | None = None
    """Local Hugging Face causal-LM folder, ``builtin:<name>`` (a real model shipped in a pip
    package, `cispo.models.packaged`) or a hub id ``org/name``. None: the built-in base model of the task
    (shipped with the package; `cispo.models.builtin`)."""
    fp32_lm_head: bool = True
    """Compute the LM head (logits, log-probs) in FP32: MiniMax-M1's fix for the train /
    rollout probability mismatch."""
    device: str = "auto"
    """``cpu``, ``cuda``, ``cuda:1``, … or ``auto`` (CUDA when available)."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Parameter dtype: ``float32``, ``bfloat16``, ``float16``. None: as saved."""
    chat_template: bool | Literal["auto"] = "auto"
    """Put each prompt through the tokenizer's chat template (``apply_chat_template(messages,
    add_generation_prompt=True)``): a row's whole chat message list (system, user and earlier
    assistant turns), or a text prompt as one user message, after ``data.system_prompt``. ``auto``:
    on when the prompts are chat message lists (TRL's conversational format, verl's parquet
    ``prompt``) or ``data.system_prompt`` is set, off for text prompts; resolved when the run starts
    (``config.yaml`` records true or false), a ``ConfigError`` naming the data file and the model
    when the prompts are messages and the tokenizer has no chat template. ``true``: always (the
    tokenizer must have one). ``false``: never; a chat-message prompt is then its last user message
    alone (its system message and earlier turns dropped: a warning counts them). Templated prompts
    also stop at the template's end-of-turn token (``cispo.models.loading.stop_token_ids``)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, ~30% more compute)."""
    lora_rank: int = 0
    """LoRA rank (``pip install "cispo[lora]"``): train rank-r adapters on every linear layer
    but lm_head; at most 65536 (wider than any layer). 0: full fine-tuning."""
    lora_alpha: float = 16.0
    """LoRA scale: the adapters' output is multiplied by lora_alpha / lora_rank."""
    lora_dropout: float = 0.0
    """Dropout on the adapters' input."""
    lora_target_modules: list[str] | None = None
    """Module names to adapt. None: all linear layers but lm_head."""
    fsdp: bool = False
    """Under ``torchrun`` with several processes: shard the parameters, gradients and
    optimizer state across them with FSDP2 (one unit per decoder layer, plus the rest), for
    a model that does not fit one device with its gradients and Adam state. Off: every
    process holds the whole model. With a low-precision model.dtype (and master weights) the
    decoder layers gather their weights in that dtype and reduce gradients in FP32 (FSDP2's
    ``MixedPrecisionPolicy``, as verl does) over FP32 shards; the root unit (embeddings, final
    norm, LM head) stays FP32, so the FP32 head uses the FP32 weight. With rollout.engine=vllm
    each rank's engine takes the full weights, gathered one tensor at a time. Ignored in a single
    process."""
    fsdp_offload: bool = False
    """With model.fsdp: keep the sharded parameters, gradients and optimizer state in CPU memory
    (FSDP2's ``CPUOffloadPolicy``; each unit is copied to the GPU to run), for a model whose shards
    do not fit the GPUs; the optimizer step then runs on the CPU (much slower)."""
    dropout: bool = False
    """Keep the model's dropout in the RL passes (logp_old and the updates). Off (default, as
    TRL and verl do): every dropout probability is set to 0 at load, so pi_old and the updated
    policy are the deterministic distribution the sampler draws from."""
    master_weights: bool = True
    """With a low-precision ``dtype`` (bfloat16, float16; or one saved in the checkpoint):
    keep FP32 parameters, gradients and AdamW state and compute under torch.autocast in that
    dtype (mixed precision; float16 adds dynamic loss scaling, ``cispo.models.policy.loss_scaler``).
    False: the parameters themselves are low precision (less memory; small updates are rounded
    away — a warning says so; float16 then has no loss scaling)."""
    compile: Literal["auto", "on", "off"] = "auto"
    """Run the decoder of the trainer's passes (logp_old and the updates' forward + backward)
    and the sampler's static-cache decode step under ``torch.compile`` with dynamic shapes, the
    compiled graphs cached on disk under the cispo cache folder (``cispo.models.compile``). ``on``;
    ``off`` (eager); ``auto``: where it was
    measured to pay off: on a CPU with a C++ compiler for runs of at least
    ``cispo.models.compile.AUTO_MIN_STEPS`` (1000) steps (on the built-in models it saves a little per
    step and costs 10-100 s to compile; docs/performance.md), eager otherwise (no GPU measured).
    A compile that fails falls back to eager with a warning. Not with ``model.fsdp``."""
    ref_path: str | None = None
    """With ``algo.objective.kl_coef > 0``: local Hugging Face causal-LM folder of the
    frozen reference policy pi_ref (same tokenizer as the policy). None: a frozen copy of the
    initial policy (``model.path`` or the built-in model)."""
