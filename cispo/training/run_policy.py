"""The run's policy: the device, the model folder (``model.path``, a task's model, the built-in or a
packaged one), the checks made before weights load, the policy with its sampler, and the frozen
reference model of the KL penalty."""

from __future__ import annotations

import math
import sys
import threading
from dataclasses import replace

import torch

from cispo.config.train import ConfigError, TrainConfig
from cispo.foundations.distributed import DistInfo
from cispo.models.compile import compile_wanted, train_body
from cispo.models.policy import Policy, loss_scaler
from cispo.rollout import TorchSampler
from cispo.training.setup import vllm_settings


def resolve_device(name: str) -> torch.device:
    """``model.device`` as a torch device; one that does not exist here is a ``ConfigError``."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise ConfigError(f"model.device={name!r}: not a device ({e})") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"model.device={name!r}: CUDA is not available on this machine (use cpu or auto)")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ConfigError(f"model.device={name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def model_folder(cfg: TrainConfig, task):
    """The folder the policy loads from: ``model.path``, else the task's model (``Task.model``), else the
    task's built-in base model; a ``builtin:<name>`` packaged model is converted on first use
    (``cispo.models.packaged``)."""
    from cispo.models.builtin import ensure_builtin_model
    from cispo.models.packaged import is_packaged, resolve_model_path
    from cispo.training.checkpoint import check_model_folder

    path = cfg.model.path or (task.model if task is not None else None)
    if path and not is_packaged(path):
        check_model_folder(path)
    return resolve_model_path(path) if path else ensure_builtin_model(task.name, progress=cfg.progress)


def check_model(cfg: TrainConfig) -> None:
    """Before any data or weights are loaded: ``model.path`` and ``model.ref_path`` name a model
    (``cispo.training.checkpoint.check_model_folder``; a ``builtin:<name>`` is checked when it is converted),
    and with ``model.chat_template=true`` the tokenizer has a chat template. ``ConfigError`` otherwise."""
    from cispo.models.packaged import is_packaged, resolve_model_path
    from cispo.training.checkpoint import check_model_folder

    for path in (cfg.model.path, cfg.model.ref_path):
        if path and not is_packaged(path):
            check_model_folder(path)
    check_extras(cfg)
    if cfg.model.chat_template is True and cfg.model.path:
        from cispo.models.loading import check_chat_template

        check_chat_template(resolve_model_path(cfg.model.path))


EXTRAS = {"peft": ("model.lora_rank", "cispo[lora]"), "vllm": ("rollout.engine=vllm", "cispo[vllm]")}
"""An optional package -> (the setting that needs it, the extra that installs it)."""


def check_extras(cfg: TrainConfig) -> None:
    """ConfigError, in one line naming the setting and the extra to install, where the run needs an optional
    package this install lacks (LoRA: peft; ``rollout.engine=vllm``: vLLM): said before anything loads, not
    as an ImportError traceback after the model did."""
    needed = [name for name, wanted in (("peft", bool(cfg.model.lora_rank)), ("vllm", cfg.rollout.engine == "vllm"))
              if wanted]
    for name in needed:
        if not installed(name):
            setting, extra = EXTRAS[name]
            raise ConfigError(f"{setting} needs {name}, which is not installed: pip install \"{extra}\"")


def installed(name: str) -> bool:
    """Whether module ``name`` can be imported: already imported (a stand-in module may have no spec), or found."""
    import importlib.util

    if name in sys.modules:
        return sys.modules[name] is not None  # None: marked absent
    return importlib.util.find_spec(name) is not None


def check_run_tools(cfg: TrainConfig) -> None:
    """The run's tools (``data.tools``, or a built-in task's own) and environment class (``data.environment``,
    imported in a throw-away process first) checked before any weights load
    (``cispo.envs.tool_env.check_tools``: one ``ToolSpecError`` line naming the spec): where the format
    depends on the chat template (``data.tool_format=chat``, or ``auto`` beside no built-in task of its own),
    by the tokenizer of ``model.path`` (a packaged or built-in model's: as it loads)."""
    from cispo.envs.tool_env import TASK_TOOLS, check_tools
    from cispo.models.packaged import is_packaged

    task = cfg.data.task if cfg.data.path is None else None
    own_format = cfg.data.tool_format == "inline" or cfg.data.tool_format == "auto" and task in TASK_TOOLS
    tokenizer = None
    if cfg.data.tools not in (None, [], "") and not own_format and cfg.model.path and not is_packaged(cfg.model.path):
        from transformers import AutoTokenizer

        from cispo.models.loading import from_pretrained

        tokenizer = from_pretrained(AutoTokenizer, cfg.model.path)
    check_tools(cfg.data, tokenizer)
    if cfg.data.environment:
        from cispo.envs.factory import load_environment_class

        load_environment_class(cfg.data.environment)


def resolve_chat_template(cfg: TrainConfig, task, named_sets: dict | None = None) -> TrainConfig:
    """``cfg`` with ``model.chat_template=auto`` resolved once the data is read (``config.yaml`` then
    records what the run does): true when prompts of the run are chat message lists
    (``cispo.data.prompts.chat_samples``), ``data.system_prompt`` is set or the task is a chat task
    (``Task.chat``); false otherwise. Turned on by ``auto``, the tokenizer of ``model.path`` must have
    a chat template (``ConfigError`` naming the data file and the model; the built-in or a task's
    model is checked as it loads). With false, chat-message prompts are cut to their last user
    message: a warning counts those that lose a system message or earlier turns."""
    from cispo.data.prompts import chat_samples

    chats, chat_task = chat_samples(cfg.data, task, named_sets or {}), task is not None and task.chat
    if cfg.model.chat_template == "auto":
        why = auto_reason(cfg, chats)
        cfg = replace(cfg, model=replace(cfg.model, chat_template=why is not None or chat_task))
        if why is not None and cfg.model.path and not chat_task:  # a chat task's model: checked as it loads
            check_auto_template(cfg.model.path, why)
    if cfg.model.chat_template is False and not chat_task:
        warn_cut_conversations(chats)
    return cfg


def auto_reason(cfg: TrainConfig, chats: dict[str, list[dict]]) -> str | None:
    """Why ``model.chat_template=auto`` turns the template on for a data file's prompts (``chats``: its
    chat-message samples by file), or None (off)."""
    if chats:
        return f"the prompts of {next(iter(chats))} are chat messages"
    if cfg.data.system_prompt is not None:
        return "data.system_prompt is set (a system message exists only in a chat template)"
    return None


def check_auto_template(model_path: str, why: str) -> None:
    """ConfigError, saying ``why`` ``model.chat_template=auto`` turned the template on (the data file
    whose prompts are chat messages, ...) and naming the model, when the tokenizer of ``model_path``
    has no chat template."""
    from transformers import AutoTokenizer

    from cispo.models.loading import from_pretrained
    from cispo.models.packaged import resolve_model_path

    path = resolve_model_path(model_path)
    if from_pretrained(AutoTokenizer, path).chat_template:
        return
    raise ConfigError(f"model.chat_template=auto: {why}, but the tokenizer of {path} has no chat template (a base "
                      "model?): use a chat model, add a chat_template to its tokenizer_config.json, or set "
                      "model.chat_template=false to train on each prompt's last user message alone")


def warn_cut_conversations(chats: dict[str, list[dict]]) -> None:
    """The warning of ``model.chat_template=false`` for chat-message prompts that hold more than their
    last user message (a system message, earlier turns): each prompt is that user message alone."""
    for path, samples in chats.items():
        cut = sum(len(s["messages"]) > 1 for s in samples)
        if cut:
            print(f"cispo: warning: model.chat_template=false: {cut} of the chat-message prompts of {path} hold more "
                  "than their last user message (a system message, earlier turns), which is all the model sees of "
                  "them; model.chat_template=auto templates whole conversations", file=sys.stderr)


def load_policy_for(cfg: TrainConfig, task, device: torch.device, load_device: torch.device | None = None,
                    dist_info: DistInfo = DistInfo()) -> Policy:
    """The policy for ``device``; its weights are loaded onto ``load_device`` (default: ``device``),
    e.g. the CPU for a model that FSDP then shards onto the GPUs. ``dist_info``: this torchrun rank
    (a vLLM engine is then placed on it, with its own seed). ``task``: the run's `PromptSource`, or None for
    the model of ``model.path`` alone."""
    from cispo.models.loading import load_policy, precision, saved_dtype, stop_token_ids

    if cfg.model.chat_template == "auto":  # a caller that did not resolve it with its data (the runner does)
        cfg = resolve_chat_template(cfg, task)
    path = model_folder(cfg, task)
    param_dtype, autocast = precision(cfg.model.dtype, saved_dtype(path), cfg.model.master_weights)
    if not cfg.model.master_weights and (param_dtype or saved_dtype(path)) in (torch.bfloat16, torch.float16):
        print(f"cispo: warning: model.master_weights=false: parameters and AdamW state in "
              f"{param_dtype or saved_dtype(path)}; updates smaller than a weight's rounding step are lost "
              f"(at lr 1e-6 most of them)", file=sys.stderr)
    model, tokenizer = load_policy(path, dtype=param_dtype, device=load_device or device, dropout=cfg.model.dropout)
    check_weights(model, path)
    if all(p.dtype in (torch.float32, torch.float64) for p in model.parameters()):
        check_head(model, path)
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"the tokenizer of {path} has no EOS token, so a response could never end: set "
                          "eos_token in its tokenizer_config.json")
    chat_task = task is not None and task.chat
    templated = cfg.model.chat_template is True or chat_task
    if templated and not tokenizer.chat_template:
        why = (f"data.task={task.name} writes its prompts as chat messages" if chat_task else
               "model.chat_template is on (chat-message prompts, or data.system_prompt)")
        raise ConfigError(f"{why}, but the tokenizer of {path} has no chat template (a base model?): use an instruct "
                          "model or add a chat_template to its tokenizer_config.json")
    stops = stop_token_ids(model, tokenizer, templated)
    if tokenizer.pad_token_id is None:  # common for base models: pad with EOS (masked out anyway)
        print(f"cispo: tokenizer of {path} has no pad token; using its EOS token for padding", file=sys.stderr)
        tokenizer.pad_token = tokenizer.eos_token
    if cfg.model.gradient_checkpointing:  # transformers >= 5.2x names it activation checkpointing (the old name warns)
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    if cfg.model.lora_rank:
        from cispo.models.lora import apply_lora

        model = apply_lora(model, rank=cfg.model.lora_rank, alpha=cfg.model.lora_alpha,
                           dropout=cfg.model.lora_dropout, target_modules=cfg.model.lora_target_modules)
    if cfg.rollout.engine == "vllm":
        from cispo.rollout import VLLMSampler

        settings = vllm_settings(cfg, dist_info, device)
        sampler = VLLMSampler(str(path), tokenizer, stops, tokenizer.pad_token_id, **settings)
    else:
        sampler = TorchSampler(model, stops, tokenizer.pad_token_id, autocast=autocast,
                               fp32_head=cfg.model.fp32_lm_head, decode=cfg.rollout.decode,
                               prefill_observations=cfg.rollout.prefill_observations,
                               compile_step=compile_wanted(cfg.model.compile, device, cfg.steps, cfg.model.fsdp))
    body = train_body(cfg.model, model, device, tokenizer.pad_token_id, cfg.steps)
    environment = run_environment(cfg, tokenizer, templated)
    return Policy(model, tokenizer, sampler, device, chat_template=templated,
                  system_prompt=cfg.data.system_prompt, autocast=autocast, train_body=body,
                  grad_scaler=loss_scaler(autocast, device), share_prompts=share_prompts(cfg, model, body),
                  environment=environment, tools=(environment.schemas or None) if environment else None)


def run_environment(cfg: TrainConfig, tokenizer, templated: bool):
    """The run's environments (``data.environment``'s class, else ``data.tools`` or a built-in task's own:
    ``cispo.envs.factory.run_environments``), the tools' worker processes started; None without any.
    Chat-format tools need chat-templated prompts."""
    from cispo.envs.factory import run_environments

    environment = run_environments(tokenizer, cfg.data, cfg.rollout)
    if environment is not None and getattr(environment, "tool_format", None) == "chat" and not templated:
        environment.close()
        raise ConfigError("data.tool_format=chat: the tools are declared through the chat template, but the prompts "
                          "are not templated: set model.chat_template=true (or data.tool_format=inline)")
    if environment is not None:
        print(f"cispo: {environment.describe()}", file=sys.stderr)
    return environment


def share_prompts(cfg: TrainConfig, model, body) -> bool:
    """Whether the trainer's passes run each shared prompt once (``algo.share_prompts``): where asked and
    the model is covered (``cispo.models.shared_prefix.unsupported_reason``), not compiled
    (``model.compile``) nor sharded (``model.fsdp``); else the plain forward, said in one line."""
    from cispo.models.shared_prefix import unsupported_reason

    if not cfg.algo.share_prompts:
        return False
    why = ("model.compile runs the plain forward" if body is not None else
           "model.fsdp is not tested with it" if cfg.model.fsdp else unsupported_reason(model))
    if why is not None:
        print(f"cispo: algo.share_prompts: each row runs its own prompt ({why})", file=sys.stderr)
    return why is None


def load_reference(cfg: TrainConfig, task, device: torch.device, tokenizer) -> torch.nn.Module:
    """The frozen reference policy pi_ref of the KL penalty: ``model.ref_path``, else the initial
    policy (``model.path`` or the built-in model, read again, so a resumed run keeps the same
    reference). Loaded like the policy (same parameter dtype; the policy's autocast applies to
    its forward), in eval mode with ``requires_grad`` off. ValueError when ``model.ref_path``'s
    tokenizer differs from the policy's ``tokenizer`` (its log-probs would be of other tokens)."""
    from cispo.models.loading import load_policy, precision, saved_dtype
    from cispo.models.packaged import resolve_model_path

    policy_path = model_folder(cfg, task)
    param_dtype, _ = precision(cfg.model.dtype, saved_dtype(policy_path), cfg.model.master_weights)
    path = resolve_model_path(cfg.model.ref_path) or policy_path
    model, ref_tokenizer = load_policy(path, dtype=param_dtype or saved_dtype(policy_path), device=device,
                                       dropout=False)
    if ref_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ValueError(f"model.ref_path={path}: its tokenizer differs from the policy's ({policy_path}); "
                         "the reference model must share the policy's vocabulary")
    check_weights(model, path)
    if all(p.dtype in (torch.float32, torch.float64) for p in model.parameters()):
        check_head(model, path)
    model.eval()
    model.requires_grad_(False)
    return model


HEAD_TOLERANCE = 1e-3  # nats; float32 rounding gives ~1e-6


def check_weights(model, path) -> None:
    """ConfigError naming the first parameter of ``model`` (loaded from ``path``) that holds NaN or
    inf: training would only spread it, and the head check would misread it as a model it does not know."""
    from cispo.models.cache import nonfinite_tensors

    bad = nonfinite_tensors(model.named_parameters())
    if bad:
        raise ConfigError(f"{path}: the weights are not finite ({bad[0]} holds NaN or inf"
                          + (f", and {len(bad) - 1} more" if len(bad) > 1 else "") + "); the model folder is "
                          "damaged or was saved from a diverged run")


def check_head(model, path) -> None:
    """ValueError unless the trainer's chunked head reproduces ``model``'s own distribution
    (``cispo.models.policy.head_mismatch``): a model that post-processes its logits in a way
    ``cispo.objective.logprobs.logit_transform`` does not know is refused rather than trained on the
    wrong log-probs. One short forward at load; run on float32 weights."""
    from cispo.models.policy import head_mismatch

    err = head_mismatch(model)
    if math.isnan(err):  # finite weights (check_weights) whose logits are not: an overflow in the forward
        raise ConfigError(f"{path}: a short forward of {type(model).__name__} gives non-finite logits although its "
                          "weights are finite (an overflow in this dtype?); try model.dtype=float32")
    if not err <= HEAD_TOLERANCE:
        raise ValueError(f"{path}: the trainer's log-probs of {type(model).__name__} differ from the model's own "
                         f"by up to {err:.3g} nats: it post-processes its logits in a way "
                         "cispo.objective.logprobs.logit_transform does not know; please report it")


RENDER_TIMEOUT_S = 30.0
"""The longest the chat template may take to render the first prompt before the run is refused (a template
that loops would hang set-up, rendering every prompt to fit them to the context)."""


def check_chat_template(policy: Policy, sample: dict | None, timeout_s: float = RENDER_TIMEOUT_S) -> None:
    """With a chat template: ``sample`` (the first prompt) rendered once before any step, so that a template
    that fails (a Jinja error, a raise_exception in it), renders nothing, takes longer than ``timeout_s`` (a
    loop) or renders over ten times the model's context (50 MB a prompt) is one `ConfigError` naming the
    template's folder, not a traceback in the first step or a hang. None, or no template in use: nothing."""
    if sample is None or not policy.chat_template:
        return
    where = f"the chat template of {policy.tokenizer.name_or_path} (its tokenizer_config.json / chat_template.jinja)"
    done: dict = {}

    def render() -> None:
        try:
            done["ids"] = policy.encode(sample)
        except Exception as exc:  # noqa: BLE001 - a user's template raises whatever Jinja or its code raises
            done["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"

    worker = threading.Thread(target=render, daemon=True)  # a template that loops is left behind, not waited on
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise ConfigError(f"{where} took over {timeout_s:g} s to render the first prompt (a loop?): fix the template "
                          "or set model.chat_template=false")
    if "error" in done:
        raise ConfigError(f"{where} failed on the first prompt: {done['error']}")
    context = getattr(policy.model.config, "max_position_embeddings", None) or math.inf
    n = len(done["ids"])
    if not n or n > 10 * context:
        size = f"{n:,} tokens, over ten times the context ({context:,})" if n else "nothing"
        raise ConfigError(f"{where} renders the first prompt as {size}: fix the template or set "
                          "model.chat_template=false")
