"""LoRA fine-tuning of the policy, with ``peft`` (``pip install "cispo[lora]"``).

:func:`apply_lora` injects LoRA layers *into the Hugging Face model itself*
(``peft.inject_adapter_in_model``) and returns that same object, rather than wrapping it in a
``peft.PeftModel``. The rest of the library relies on the Hugging Face interface:
``cispo.foundations.experience.decoder`` takes ``getattr(model, model.base_model_prefix)`` and ``lm_head`` takes
``model.get_output_embeddings()``. On a ``PeftModel`` the first resolves to the wrong module:
``base_model_prefix`` is forwarded to the wrapped model ("model" for Llama), but ``peft_model.model`` is the
wrapped ``LlamaForCausalLM`` (through ``LoraModel.model``), not its ``LlamaModel`` body, so the decoder
would return logits instead of hidden states. With the adapters injected in place, the model class,
``base_model_prefix``, ``get_output_embeddings``, ``save_pretrained``, the samplers and the checkpoints all
keep working; only the LoRA parameters require grad (the optimizer already takes the trainable ones).

The output projection is never adapted (``"all-linear"`` excludes it, and an explicit target on it is
refused): ``cispo.objective.logprobs`` multiplies the hidden states by ``lm_head.weight`` directly, which would skip
the adapter.

:func:`merged_named_weights` gives the merged weights under the base model's names (for pushing to a
rollout engine, e.g. ``VLLMSampler.update_weights``); :func:`merge_and_save` writes a plain Hugging Face
folder that ``cispo.models.loading.load_policy`` loads.
"""

from __future__ import annotations

import copy
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

INSTALL_HINT = 'LoRA needs peft: pip install "cispo[lora]"'

DEFAULT_TARGET_MODULES = "all-linear"
"""Every linear layer but the output projection (for Llama-like models: q/k/v/o_proj, gate/up/down_proj)."""

_LORA_PARAM_KEYS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")


def _peft():
    try:
        import peft
        import peft.tuners.lora  # noqa: F401  (the LoRA tuner itself, so a broken install fails here with the hint)
    except ImportError as e:
        raise ImportError(INSTALL_HINT) from e
    return peft


def _is_lora_layer(module: torch.nn.Module) -> bool:
    """Whether ``module`` is a peft LoRA layer. Where peft's LoRA tuner was never imported no module can be one
    (peft made every LoRA layer), so a run without LoRA does not import peft (~0.1-0.15 s) to find none."""
    if "peft.tuners.lora" not in sys.modules:
        return False
    from peft.tuners.lora import LoraLayer

    return isinstance(module, LoraLayer)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside a ``peft.PeftModel`` (or the model itself; peft never imported: no
    ``PeftModel`` exists)."""
    if "peft" not in sys.modules:
        return model
    try:
        from peft import PeftModel
    except ImportError:  # a peft whose import failed half-way
        return model
    return model.base_model.model if isinstance(model, PeftModel) else model


def has_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` holds LoRA layers (injected by :func:`apply_lora` or in a ``PeftModel``)."""
    return any(_is_lora_layer(m) for m in model.modules())


def lora_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of the LoRA adapters."""
    return [(n, p) for n, p in model.named_parameters() if any(f".{k}." in f".{n}" for k in _LORA_PARAM_KEYS)]


def apply_lora(
    model: torch.nn.Module,
    rank: int = 8,
    alpha: float = 16,
    dropout: float = 0.0,
    target_modules: str | list[str] | None = None,
    adapter_name: str = "default",
    **lora_kwargs,
) -> torch.nn.Module:
    """Inject LoRA adapters into ``model`` (in place) and freeze everything else; returns ``model``.

    Args:
        model: a Hugging Face causal LM (e.g. from ``cispo.models.loading.load_policy``).
        rank: r, the rank of each adapter (>= 1).
        alpha: the scaling numerator: the adapter's output is multiplied by ``alpha / rank``.
        dropout: dropout on the adapter's input, in [0, 1).
        target_modules: module names (or suffixes, or a regex) to adapt, as ``peft.LoraConfig`` takes them;
            None: ``"all-linear"`` (every linear layer but the output projection).
        adapter_name: the adapter's name in peft.
        **lora_kwargs: more ``peft.LoraConfig`` fields (``use_rslora``, ``init_lora_weights``, ...).

    The adapters' B matrices start at zero, so the returned model computes exactly what ``model`` did.
    """
    peft = _peft()
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA rank must be an int >= 1, got {rank!r}")
    if not alpha > 0:
        raise ValueError(f"LoRA alpha must be > 0, got {alpha!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout!r}")
    if has_lora(model):
        raise ValueError("model already has LoRA layers")
    if lora_kwargs.get("use_dora"):
        raise ValueError("DoRA is not supported (merged_named_weights merges plain LoRA deltas only)")
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        target_modules=DEFAULT_TARGET_MODULES if target_modules is None else target_modules,
        bias="none",
        **lora_kwargs,
    )
    model = peft.inject_adapter_in_model(config, model, adapter_name=adapter_name)
    if _is_lora_layer(model.get_output_embeddings()):
        raise ValueError("LoRA on the output projection (lm_head) is not supported: cispo.objective.logprobs uses "
                         "lm_head.weight directly; leave it out of target_modules")
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    lora = {n for n, _ in lora_parameters(model)}
    if not lora:
        raise ValueError(f"target_modules={config.target_modules!r} matched no layer of {type(model).__name__}")
    if trainable != lora:  # peft marks only the adapters trainable; make sure
        for n, p in model.named_parameters():
            p.requires_grad_(n in lora)
    checkpointing = getattr(model, "is_activation_checkpointing", None)
    if checkpointing is None:
        checkpointing = getattr(model, "is_gradient_checkpointing", False)
    if checkpointing and hasattr(model, "enable_input_require_grads"):
        # reentrant checkpointing needs an input that requires grad, and the embeddings are frozen now
        model.enable_input_require_grads()
    return model


@torch.no_grad()
def merged_named_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's ``state_dict`` with every LoRA layer merged: ``W + (alpha / r) B A`` under the base
    layer's name (``...q_proj.weight``), adapter tensors left out. Yields one tensor at a time (merged ones
    are new tensors; the others are the model's own, detached). Does not modify the model."""
    model = _unwrap(model)
    lora_layers = {name: m for name, m in model.named_modules() if _is_lora_layer(m)}
    for key, tensor in model.state_dict().items():
        owner, sep, rest = key.partition(".base_layer.")
        if sep and owner in lora_layers:
            layer = lora_layers[owner]
            if rest == "weight" and not layer.merged:
                delta = sum(layer.get_delta_weight(a) for a in layer.active_adapters
                            if a in layer.lora_A or a in getattr(layer, "lora_embedding_A", {}))
                if isinstance(delta, torch.Tensor):
                    tensor = tensor + delta.to(tensor.dtype)
            yield f"{owner}.{rest}", tensor.detach()
            continue
        if any(f".{k}." in key for k in _LORA_PARAM_KEYS) or key.endswith(tuple(f".{k}" for k in _LORA_PARAM_KEYS)):
            continue
        yield key, tensor.detach()


def merge_lora(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with the adapters merged into the base layers and the LoRA layers removed:
    a plain Hugging Face model (all parameters trainable). ``model`` is left unchanged."""
    _peft()
    plain = copy.deepcopy(_unwrap(model))
    for name, module in list(plain.named_modules()):
        if not _is_lora_layer(module):
            continue
        module.merge(safe_merge=True)
        parent_name, _, child = name.rpartition(".")
        parent = plain.get_submodule(parent_name) if parent_name else plain
        setattr(parent, child, module.get_base_layer())
    if hasattr(plain, "peft_config"):
        del plain.peft_config
    for p in plain.parameters():
        p.requires_grad_(True)
    return plain


def merge_and_save(model: torch.nn.Module, tokenizer, path) -> Path:
    """Merge the adapters into a copy of ``model`` and save it (safetensors) with ``tokenizer`` into ``path``,
    a plain Hugging Face folder for ``cispo.models.loading.load_policy`` (or vLLM). Returns the path."""
    from cispo.models.loading import save_policy

    plain = merge_lora(model)
    path = Path(path)
    if tokenizer is None:
        path.mkdir(parents=True, exist_ok=True)
        plain.save_pretrained(path, safe_serialization=True)
        return path
    return save_policy(plain, tokenizer, path)


# --------------------------------------------------------------------------- checkpoints

ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."  # how peft's PeftModel.save_pretrained names the adapter tensors


def split_lora_state(state: dict[str, torch.Tensor], model: torch.nn.Module,
                     adapter_name: str = "default") -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A LoRA model's state dict ``state`` (the model's own, or the full one gathered from a sharded
    model) -> ``(merged, adapter)``:

    * ``merged``: the base model's names and shapes, ``W + scaling * B A`` for every adapted linear layer
      (``W + scaling * (B A)^T`` with ``fan_in_fan_out``), for a plain Hugging Face checkpoint;
    * ``adapter``: the adapter tensors under peft's own save names
      (``base_model.model.<layer>.lora_A.weight``), for ``peft.PeftModel.from_pretrained``.

    ``scaling`` (alpha / r, or alpha / sqrt(r) with rsLoRA) is read from the model's LoRA layers."""
    lora_layers = {name: m for name, m in _unwrap(model).named_modules() if _is_lora_layer(m)}
    merged, adapter = {}, {}
    for key, tensor in state.items():
        owner, sep, rest = key.partition(".base_layer.")
        if sep and owner in lora_layers:
            if rest == "weight":
                layer = lora_layers[owner]
                a = state.get(f"{owner}.lora_A.{adapter_name}.weight")
                b = state.get(f"{owner}.lora_B.{adapter_name}.weight")
                if a is None or b is None:
                    raise ValueError(f"LoRA layer {owner}: only linear adapters named {adapter_name!r} can be saved")
                delta = (b.float() @ a.float()) * layer.scaling[adapter_name]  # [out, in]
                if getattr(layer, "fan_in_fan_out", False):
                    delta = delta.T
                tensor = (tensor.float() + delta).to(tensor.dtype)
            merged[f"{owner}.{rest}"] = tensor
            continue
        head, dot, param = key.rpartition(".")
        for k in _LORA_PARAM_KEYS:
            suffix = f".{k}.{adapter_name}"
            if head.endswith(suffix):
                adapter[f"{_PEFT_PREFIX}{head[: -len(suffix)]}.{k}.{param}"] = tensor
                break
            if key.endswith(f".{k}.{adapter_name}"):  # a bare parameter (DoRA's magnitude vector)
                adapter[f"{_PEFT_PREFIX}{key[: -len(adapter_name) - 1]}"] = tensor
                break
        else:
            merged[key] = tensor
    return merged, adapter


def save_adapter(model: torch.nn.Module, adapter: dict[str, torch.Tensor], path, adapter_name: str = "default") -> Path:
    """Write ``adapter`` (from :func:`split_lora_state`) and the model's LoRA config in peft's format:
    ``adapter_model.safetensors`` + ``adapter_config.json``, which ``peft.PeftModel.from_pretrained(base,
    path)`` loads on top of the base model. The config names that base model and its kind
    (``base_model_name_or_path``: the folder or hub id the model was loaded from; ``task_type``: ``CAUSAL_LM``),
    so that ``peft.AutoPeftModelForCausalLM.from_pretrained(path)`` loads both (injecting the adapters in place,
    `apply_lora`, leaves peft's own fields None)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = copy.copy(_unwrap(model).peft_config[adapter_name])
    if not config.base_model_name_or_path:
        config.base_model_name_or_path = base_model_name(model)
    if config.task_type is None:  # every policy is a causal LM
        config.task_type = "CAUSAL_LM"
    config.save_pretrained(str(path))
    save_file({k: v.detach().cpu().contiguous() for k, v in adapter.items()}, str(path / ADAPTER_WEIGHTS))
    return path


def base_model_name(model: torch.nn.Module) -> str | None:
    """The folder or hub id ``model`` was loaded from (Hugging Face's ``name_or_path``), or None (a model built
    in memory)."""
    name = getattr(_unwrap(model), "name_or_path", None)
    return str(name) if name else None


def load_adapter_state(path, model: torch.nn.Module, adapter_name: str = "default",
                       device="cpu") -> dict[str, torch.Tensor]:
    """The adapter tensors saved by :func:`save_adapter`, under ``model``'s own state-dict names. Raises
    ValueError (naming the folder) unless they are exactly ``model``'s adapter tensors."""
    from safetensors.torch import load_file

    path = Path(path)
    file = path / ADAPTER_WEIGHTS
    if not file.is_file():
        raise ValueError(f"{path}: no {ADAPTER_WEIGHTS}; this checkpoint was not written for a LoRA model")
    out = {}
    for key, tensor in load_file(str(file), device=str(device)).items():
        name = key.removeprefix(_PEFT_PREFIX)
        head, _, param = name.rpartition(".")
        if head.rsplit(".", 1)[-1] in _LORA_PARAM_KEYS:
            name = f"{head}.{adapter_name}.{param}"
        else:
            name = f"{name}.{adapter_name}"
        out[name] = tensor
    expected = {k for k in _unwrap(model).state_dict() if any(f".{p}." in k or k.endswith(f".{p}.{adapter_name}")
                                                               for p in _LORA_PARAM_KEYS)}
    missing, unexpected = sorted(expected - set(out)), sorted(set(out) - expected)
    if missing or unexpected:
        raise ValueError(f"{path}: adapter does not match the model's LoRA layers: missing {missing[:5]} "
                         f"({len(missing)}), unexpected {unexpected[:5]} ({len(unexpected)}); resume with the same "
                         "model.lora_* settings")
    return out
