"""The run's configuration: one dataclass per concern, a docstring per field; YAML files,
``key=value`` overrides, help text and errors that name the key.

The configs are plain dataclasses; pydantic checks and converts plain data into them (types,
``Literal`` choices, unknown keys, and each class's ``__post_init__`` checks). OmegaConf, which
verl and Hydra use, was the first choice; version 2.3 rejects ``Literal`` fields and turns
tuples into lists. The YAML files and ``key=value`` overrides are the same with either.
PyYAML reads ``1e-4`` (no dot) as a string; here it is a float, as in YAML 1.2.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, TypeVar

import pydantic
import yaml

from cispo.suggest import did_you_mean

__all__ = [
    "AlgoConfig", "DataConfig", "EvalConfig", "ModelConfig", "OptimConfig", "RolloutConfig", "TrainConfig",
    "ConfigError", "apply_overrides", "field_docs", "format_help", "from_dict", "load_yaml", "save_yaml", "to_dict",
]
T = TypeVar("T")
KeyPath = tuple  # field names (str) and list indices (int), as in pydantic's error locations


class ConfigError(ValueError):
    """A config could not be read, parsed or validated; the message says where and why."""


class _Loader(yaml.SafeLoader): ...  # reads 1e-4 as a float


class _Dumper(yaml.SafeDumper): ...  # quotes the string '1e-4'


for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(
        r"^[-+]?(\d[\d_]*(\.[\d_]*)?|\.\d[\d_]*)[eE][-+]?\d+$"), list("-+0123456789."))


@functools.cache
def _fields(cls: type) -> dict[KeyPath, Any]:
    """The type of every field of dataclass ``cls`` and of its sections, by key path."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"expected a dataclass type, got {cls!r}")
    hints, out = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        out[(f.name,)] = tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.update({(f.name, *key): t for key, t in _fields(tp).items()})
    return out


@functools.cache
def _adapter(cls: type) -> pydantic.TypeAdapter:
    """pydantic's validator of config ``cls``: unknown keys are errors; docstrings are read."""
    for c in [cls] + [t for t in _fields(cls).values() if dataclasses.is_dataclass(t)]:
        if "__pydantic_config__" not in vars(c):  # how pydantic reads a plain dataclass
            c.__pydantic_config__ = pydantic.ConfigDict(
                extra="forbid", use_attribute_docstrings=True, coerce_numbers_to_str=True)
    return pydantic.TypeAdapter(cls)


def _dotted(path: KeyPath) -> str:
    """``('optim', 'betas', 1)`` -> ``'optim.betas[1]'``."""
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


def _type_name(tp: Any) -> str:
    """``float``, ``int | None``, ``Literal['torch', 'vllm']``, ``tuple[float, float]``..."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return " | ".join(map(_type_name, typing.get_args(tp)))
    if tp is type(None):
        return "None"
    return tp.__name__ if isinstance(tp, type) and not typing.get_args(tp) else str(tp).replace("typing.", "")


def _accepts_str(tp: Any) -> bool:
    """``str``, ``str | None``, ``Literal['a', 'b']``..."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    return tp is str or (origin is Literal and any(isinstance(a, str) for a in args)) or (
        origin in (typing.Union, types.UnionType) and any(map(_accepts_str, args)))


def _problem(cls: type, err: dict) -> str:
    """``dotted.key: what is wrong`` for one pydantic error (a typo gets a suggestion)."""
    loc, fields = tuple(err["loc"]), _fields(cls)
    key, tp, got = _dotted(loc), fields.get(loc), err.get("input")
    if err["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
        same_leaf = [_dotted(k) for k in fields if k[-1] == loc[-1]]  # 'lr' where 'optim.lr' belongs
        hint = (did_you_mean(key, same_leaf, len(same_leaf), 0) if same_leaf else "") or did_you_mean(
            key, map(_dotted, fields)) or did_you_mean(loc[-1], {k[-1] for k in fields})  # a short name
        return f"{key}: unknown key{hint}"
    if err["type"] == "value_error":  # a __post_init__ check; its message names the key
        return f"{key + ': ' if key else ''}{err['ctx']['error']}"
    if err["type"] == "literal_error" and tp is not None:  # Literal[...] or Literal[...] | None
        choices = [c for a in (tp, *typing.get_args(tp)) if typing.get_origin(a) is Literal for c in typing.get_args(a)]
        return f"{key}: expected one of {', '.join(map(repr, choices))}, got {got!r}{did_you_mean(got, choices)}"
    return f"{key}: expected {_type_name(tp)}, got {got!r}" if tp else f"{key}: {err['msg']}, got {got!r}"


def _build(cls: type[T], data: Any, where: Callable[[KeyPath], str]) -> T:
    """``cls`` from plain data; each problem is a line ``where(key path): key: what``."""
    for key, tp in _fields(cls).items():  # pydantic reads true as 1 where a number is due: refused
        value = functools.reduce(lambda d, k: d.get(k) if isinstance(d, dict) else None, key, data)
        if isinstance(value, bool) and {int, float} & {tp, *typing.get_args(tp)} and bool not in typing.get_args(tp):
            raise ConfigError(f"{where(key)}: {_dotted(key)}: expected {_type_name(tp)}, got {value!r}")
    try:
        return _adapter(cls).validate_python({} if data is None else data)
    except pydantic.ValidationError as exc:
        problems = dict.fromkeys(f"{where(tuple(e['loc']))}: {_problem(cls, e)}" for e in exc.errors())
        raise ConfigError("\n".join(problems)) from None


def from_dict(cls: type[T], data: dict[str, Any] | None, source: str = "<dict>") -> T:
    """Config ``cls`` from plain nested data; ``None`` or a missing key: the defaults. Wrong
    types, unknown keys and failed checks raise ``ConfigError`` s starting with ``source``."""
    return _build(cls, data, lambda loc: source)


def _line(node: yaml.Node | None, loc: KeyPath) -> str:
    """``:N``, the 1-based line of key path ``loc`` (of its deepest key found) in a YAML node."""
    line = ""
    for part in loc:
        items = node.value if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)) else []
        hits = [(k, v) for k, v in items if k.value == part] if isinstance(node, yaml.MappingNode) else (
            [(items[part], items[part])] if isinstance(part, int) and part < len(items) else [])
        if not hits:
            break
        line, node = f":{hits[-1][0].start_mark.line + 1}", hits[-1][1]
    return line


def load_yaml(cls: type[T], path: str | pathlib.Path) -> T:
    """Config ``cls`` from a YAML file (empty: the defaults). Errors name the file, line and
    key: ``run.yaml:12: optim.lr: expected float, got 'abc'``."""
    _fields(cls)
    try:
        text = pathlib.Path(path).read_text(encoding="utf-8")
        node, data = yaml.compose(text, Loader=_Loader), yaml.load(text, Loader=_Loader)
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: cannot read config file: {getattr(exc, 'strerror', None) or exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise ConfigError(f"{path}{f':{mark.line + 1}' if mark else ''}: invalid YAML: "
                          f"{getattr(exc, 'problem', None) or exc}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(f"{path}:1: expected a mapping of config keys at top level, got {type(data).__name__}")
    sections = {k for k, v in (data or {}).items() if v is None and dataclasses.is_dataclass(_fields(cls).get((k,)))}
    data = {**(data or {}), **dict.fromkeys(sections, {})}  # 'optim:' with nothing below: its defaults
    return _build(cls, data, lambda loc: f"{path}{_line(node, loc)}")


def to_dict(cfg: Any) -> Any:
    """A config as nested plain data: sections -> dicts, tuples -> lists (all new containers)."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, dict):
        return {k: to_dict(v) for k, v in cfg.items()}
    return [to_dict(v) for v in cfg] if isinstance(cfg, (list, tuple)) else cfg


def save_yaml(cfg: Any, path: str | pathlib.Path) -> None:
    """Every field of a config (defaults included) as a YAML file that ``load_yaml`` reads
    back to an equal config. Parent folders are created."""
    text = yaml.dump(to_dict(cfg), Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=88)
    target = pathlib.Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(f"# {type(cfg).__name__}: {_class_doc(type(cfg))} Written by cispo.config.save_yaml; "
                      f"every field, defaults included.\n{text}", encoding="utf-8")


def _override_value(text: str, tp: Any, source: str) -> Any:
    """YAML (``3e-4``, ``true``, ``[1, 2]``, ``{a: 1}``); ``None``/``null``: None; the text
    itself for a string field that YAML reads as something else (``run_name=2024``)."""
    if text.lower() in ("none", "null", "~"):
        return None
    try:
        value = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        if not _accepts_str(tp):
            raise ConfigError(f"{source}: cannot parse {text!r} as a YAML value: {getattr(exc, 'problem', exc)}")
        value = text
    return text if not isinstance(value, str) and _accepts_str(tp) else value


def apply_overrides(cfg: T, overrides: list[str] | tuple[str, ...]) -> T:
    """A copy of ``cfg`` with ``key=value`` overrides set in order, then checked once as a
    whole (so no order of ``prompts_per_step=2 updates_per_batch=4`` trips a check).

    ``key``: a dotted path (``optim.lr``) or a field name found in one place only (``lr``; a
    top-level field wins); an ambiguous name is an error naming the candidates. Past a dict
    field the rest is a key into it (``objective_overrides.eps_high_is=2``). A mapping for a
    section sets just those fields. ``cfg`` is not changed."""
    if not overrides:
        return cfg
    cls, data, sources = type(cfg), to_dict(cfg), {}
    fields = _fields(cls)
    for item in overrides:
        source = f"override {item!r}"
        key, sep, text = item.partition("=") if isinstance(item, str) else ("", "", "")
        path = tuple(p.strip() for p in key.split("."))
        if not sep or not all(path):
            raise ConfigError(f"{source}: expected key=value (e.g. optim.lr=3e-4)")
        if path[:1] not in fields:
            found = [k for k in fields if k[-1] == path[0]]
            if len(found) > 1:
                raise ConfigError(f"{source}: ambiguous key {path[0]!r}: it could be "
                                  f"{', '.join(map(_dotted, found))}; use the full dotted key")
            path = found[0] + path[1:] if found else path  # an unknown key: pydantic names it
        value, node = _override_value(text.strip(), fields.get(path), source), data
        for i, part in enumerate(path[:-1]):
            node = node[part] if isinstance(node.get(part), dict) else node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{source}: {_dotted(path[:i + 1])} is not a section")
        if dataclasses.is_dataclass(fields.get(path)) and isinstance(value, dict):
            value = {**node[path[-1]], **value}
        node[path[-1]], sources[path] = value, source
    every = source if len(overrides) == 1 else "overrides " + ", ".join(map(repr, overrides))
    return _build(cls, data, lambda loc: next(
        (sources[loc[:n]] for n in range(len(loc), 0, -1) if loc[:n] in sources), every))


def _class_doc(cls: type) -> str:
    """The first line of a class's own docstring ("" for dataclasses' generated one)."""
    doc = (cls.__dict__.get("__doc__") or "").strip()
    return "" if not doc or doc.startswith(f"{cls.__name__}(") else doc.splitlines()[0]


def field_docs(cls: type) -> dict[str, str]:
    """The docstring below each field of dataclass ``cls`` ("" where none), by field name."""
    docs = dict.fromkeys((f.name for f in dataclasses.fields(cls)), "")
    for c in reversed([c for c in cls.__mro__ if dataclasses.is_dataclass(c)] if _fields(cls) else []):
        docs.update({k: v["description"] for k, v in _adapter(c).json_schema()["properties"].items() if "description" in v})
    return docs


def format_help(cls: type) -> str:
    """Every field of config ``cls``: dotted key, type, default and docstring, by section."""
    fields, out = _fields(cls), [
        "Config fields. Override any with KEY=VALUE: KEY is a dotted path (section.field) or a",
        "field name that occurs in one place only; VALUE is YAML (3e-4, true, null, [1, 2], {a: 1}).", ""]

    def section(c: type, prefix: KeyPath, title: str) -> None:
        out.append(title)
        subs, docs = [], field_docs(c)
        for f in dataclasses.fields(c):
            key = prefix + (f.name,)
            if dataclasses.is_dataclass(fields[key]):
                subs.append(key)
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            out.append(f"  {_dotted(key)}: {_type_name(fields[key])} = {default!r}")
            out.extend(f"      {line}".rstrip() for line in docs[f.name].splitlines())
        for key in subs:
            sub = fields[key]
            section(sub, key, f"\n{_dotted(key)} ({sub.__name__}): {_class_doc(sub)}")

    section(cls, (), f"{cls.__name__}: {_class_doc(cls)}")
    return "\n".join(out).rstrip() + "\n"


# =======================================================================================
# The run's configuration: one dataclass per concern, a docstring per field.
# =======================================================================================


@dataclass
class ModelConfig:
    """The policy."""

    path: str | None = None
    """Local Hugging Face causal-LM folder. None: the built-in base model of the task
    (pretrained on first use and cached in ~/.cache/cispo)."""
    fp32_lm_head: bool = True
    """Compute the LM head (logits, log-probs) in FP32: MiniMax-M1's fix for the train /
    rollout probability mismatch."""
    device: str = "auto"
    """``cpu``, ``cuda``, ``cuda:1``, … or ``auto`` (CUDA when available)."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Parameter dtype: ``float32``, ``bfloat16``, ``float16``. None: as saved."""
    chat_template: bool = False
    """Wrap each prompt (or its ``messages``) in the tokenizer's chat template."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, ~30% more compute)."""
    lora_rank: int = 0
    """LoRA rank (``pip install "cispo[lora]"``): train rank-r adapters on every linear layer
    but lm_head. 0: full fine-tuning."""
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
    process holds the whole model. Ignored in a single process; not with rollout.engine=vllm."""
    dropout: bool = False
    """Keep the model's dropout in the RL passes (logp_old and the updates). Off (default, as
    TRL and verl do): every dropout probability is set to 0 at load, so pi_old and the updated
    policy are the deterministic distribution the sampler draws from."""
    master_weights: bool = True
    """With a low-precision ``dtype`` (bfloat16, float16; or one saved in the checkpoint):
    keep FP32 parameters, gradients and AdamW state and compute under torch.autocast in that
    dtype (mixed precision). False: the parameters themselves are low precision (less memory;
    small updates are rounded away — a warning says so)."""
    ref_path: str | None = None
    """With ``algo.objective_overrides.kl_coef > 0``: local Hugging Face causal-LM folder of the
    frozen reference policy pi_ref (same tokenizer as the policy). None: a frozen copy of the
    initial policy (``model.path`` or the built-in model)."""


@dataclass
class DataConfig:
    """The prompts and their reward."""

    task: str = "addition"
    """Built-in task name (see ``cispo.tasks.list_tasks()``)."""
    seed: int = 0
    """Seed of the train / held-out prompt sets: fixed, so runs of any seed share prompts."""
    num_train_prompts: int = 20000
    """Size of the training prompt set drawn from the task's train split."""
    num_eval_prompts: int = 200
    """Held-out prompts used by the periodic evaluation."""
    path: str | None = None
    """Prompt file instead of the built-in task: JSONL, Parquet or a ``datasets`` folder."""
    eval_path: str | None = None
    """Held-out prompt file. None: a seeded slice of ``path`` (at most 1/5 of it)."""
    prompt_field: str = "prompt"
    """Field holding the prompt (text or chat messages); dotted paths allowed."""
    answer_field: str | None = "answer"
    """Field holding the reference answer, passed to the reward as ``answer``."""
    extra_fields: list[str] | None = None
    """More fields passed to the reward as keyword arguments."""
    split: str | None = None
    """Split of a ``datasets`` DatasetDict folder."""
    on_error: Literal["raise", "skip"] = "raise"
    """Malformed rows: ``raise`` (the first one, naming file, line and field) or ``skip``."""
    reward: str | None = None
    """Reward for ``path`` data: ``math``, ``exact_match``, ``code`` or ``module:function``."""
    fork_token: str | None = None
    """For ``path`` data: a string whose use is tracked as the fork rate (e.g. ``Wait``)."""
    reward_timeout_s: float | None = 60.0
    """Per-call reward timeout; a reward that hangs, raises or returns a non-number scores 0
    and is counted in ``rollout/reward_errors``. Applies to rewards in worker processes
    (``reward_isolation``); None: no timeout."""
    reward_isolation: Literal["auto", "process", "main"] = "auto"
    """Where ``reward`` runs: ``process`` (worker processes that a hang, exit or crash cannot
    take down; ``reward_timeout_s`` kills a call), ``main`` (the trainer's main thread; trusted,
    no timeout), ``auto``: ``main`` for the built-in names, ``process`` for ``module:function``
    and ``file.py:function``."""
    reward_workers: int | None = None
    """Worker processes of a ``process`` reward (>= 1). None: min(8, CPU count)."""


@dataclass
class RolloutConfig:
    """Sampling the generation batch."""

    prompts_per_step: int = 32
    """P: prompts (groups) per generation batch."""
    group_size: int = 8
    """G: responses sampled per prompt."""
    temperature: float = 1.0
    """Sampling temperature (the trainer's log-probs use the same one)."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1 = off)."""
    max_new_tokens: int | None = None
    """Longest response, in tokens. None: the task's longest well-formed answer + 25%."""
    repetition_stop_tokens: int | None = None
    """Stop a response once this many consecutive tokens each had probability above
    ``repetition_stop_prob`` (MiniMax-M1: 3000 of 40k-80k). None: 3/4 of max_new_tokens.
    0: off."""
    repetition_stop_prob: float = 0.99
    """Probability threshold of the repetition early stop."""
    dynamic_sampling: bool = True
    """Drop groups whose rewards are all equal and sample more prompts (DAPO)."""
    max_sampling_rounds: int = 3
    """Cap on generation rounds per step with dynamic sampling; then train on what was kept."""
    overlong_buffer: int | None = None
    """DAPO's soft overlong penalty: the last ``overlong_buffer`` tokens before
    max_new_tokens are penalised linearly down to -1. None: off."""
    engine: Literal["torch", "vllm"] = "torch"
    """Sampler: ``torch`` (the built-in KV-cache sampler) or ``vllm`` (needs a CUDA GPU and
    ``pip install "cispo[vllm]"``; weights are pushed to it after every step)."""
    decode: Literal["auto", "static", "hf"] = "auto"
    """How the torch sampler decodes: ``static`` (a preallocated KV cache written in place,
    rotary table and mask once per batch, stopped rows dropped; Llama / Qwen2 / Mistral),
    ``hf`` (the model's forward with its dynamic cache), ``auto`` (static where supported).
    Same tokens and log-probs either way; static is faster (docs/performance.md)."""
    vllm_gpu_memory_utilization: float = 0.3
    """Fraction of GPU memory vLLM may take (the trainer shares the GPU)."""
    vllm_sleep: bool = False
    """Put the vLLM engine to sleep during the updates (frees its memory; slower)."""


@dataclass
class AlgoConfig:
    """The objective and the schedule of off-policy updates."""

    objective: Literal["cispo", "ppo", "grpo", "dapo", "gspo", "reinforce"] = "cispo"
    """Objective preset: cispo, ppo, grpo, dapo, gspo, reinforce."""
    objective_overrides: dict[str, Any] = field(default_factory=dict)
    """Fields of ``ObjectiveConfig`` to override, e.g. ``objective_overrides.eps_high_is=2.0``."""
    advantage_estimator: Literal["grpo", "drgrpo", "rloo"] = "grpo"
    """Group-relative advantages: grpo, drgrpo, rloo."""
    updates_per_batch: int = 16
    """K: the generation batch is split into K mini-batches, one optimizer step each
    (MiniMax-M1: 16). With K = 1 every objective is identical (r = 1)."""
    epochs: int = 1
    """Passes over the generation batch (K optimizer steps each)."""
    micro_batch_size: int | None = None
    """Rows per forward/backward (gradient accumulation within a mini-batch). None: whole."""
    micro_batch_split_cost: float | None = 128.0
    """Length-sorted micro-batches: the rows of each mini-batch (and of the logp_old pass) are
    sorted by length and cut into micro-batches wherever a cut saves more padded decoder
    positions than this (the fixed cost of one more forward/backward, in positions), each of at
    most ``micro_batch_size`` rows and trimmed to its longest row. The mini-batches and the
    gradient are unchanged (up to float summation order). None: rows in random order, cut only
    by ``micro_batch_size``."""
    tis_cap: float | None = None
    """Truncated importance sampling for the rollout/trainer mismatch: each token's advantage
    is multiplied by min(pi_old / pi_rollout, tis_cap) (Yao et al. 2025 use 2). None: off."""


@dataclass
class OptimConfig:
    """AdamW, with MiniMax-M1's settings by default."""

    lr: float = 1e-4
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (beta1, beta2). MiniMax-M1: (0.9, 0.95); (0.9, 0.999) did not converge for them."""
    eps: float = 1e-15
    """AdamW epsilon. MiniMax-M1: 1e-15 (their gradients span 1e-18 .. 1e-5)."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value (0 = off)."""
    warmup_updates: int = 16
    """Linear learning-rate warm-up over this many optimizer steps."""


@dataclass
class EvalConfig:
    """Periodic held-out evaluation."""

    every: int = 10
    """Evaluate every this many steps (and before the first and after the last). 0: only then."""
    num_samples: int = 4
    """k: samples per prompt for the mean accuracy (the analogue of avg@k)."""
    temperature: float = 1.0
    """Temperature of the k samples (greedy accuracy is also reported)."""


@dataclass
class TrainConfig:
    """A CISPO (or PPO / GRPO / DAPO / GSPO / REINFORCE) training run."""

    steps: int = 60
    """Generation batches (RL steps)."""
    seed: int = 0
    """Seeds sampling, shuffling and the prompt order."""
    out_dir: str = "runs"
    """Folder that holds the run folders."""
    run_name: str | None = None
    """Run folder name. None: ``{objective}__{task}__seed{seed}``."""
    checkpoint_every: int = 20
    """Save a checkpoint every this many steps (and at the end). 0: only at the end."""
    keep_checkpoints: int = 2
    """How many of the newest checkpoints to keep. 0: all."""
    threads: int | None = None
    """torch CPU threads. None: picked by load (``cispo.threads.pick_threads``: 2 when another
    core is idle, else 1; docs/performance.md)."""
    progress: bool = True
    """Show a progress bar."""
    max_bad_steps: int = 3
    """Stop (with a checkpoint of the last good weights) after this many consecutive steps
    whose every update had a non-finite gradient."""
    trackers: list[str] = field(default_factory=list)
    """Metric sinks besides metrics.jsonl: ``tensorboard``, ``wandb``, ``mlflow``
    (``pip install 'cispo[wandb]'`` etc.). W&B and MLflow read their usual environment
    variables (WANDB_PROJECT, WANDB_MODE, MLFLOW_TRACKING_URI, ...); see docs/api.md."""
    log_samples_every: int = 1
    """Append some of the step's responses (prompt, completion, reward, advantage, fork /
    capped / PPO-dropped token counts) to ``<run>/samples.jsonl`` and the trackers every this
    many steps (docs/metrics.md). 0: never."""
    max_samples_per_step: int = 8
    """Responses saved per such step: the first ones of the batch, whole groups first."""
    samples_max_chars: int = 2000
    """Prompts and completions longer than this are cut (marked with ``…``) in the samples."""
    samples_max_mb: float = 50.0
    """``samples.jsonl`` stops growing (with a note) before it passes this size."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        """Every setting checked before any work: ``ValueError`` naming the key. None means the
        default; 0 or a negative number is an error where it has no meaning."""
        r, a, d = self.rollout, self.algo, self.data
        rows = r.prompts_per_step * r.group_size
        checks = [
            ("steps", self.steps >= 1, "must be >= 1"),
            ("checkpoint_every", self.checkpoint_every >= 0, "must be >= 0 (0: only at the end)"),
            ("keep_checkpoints", self.keep_checkpoints >= 0, "must be >= 0 (0: all)"),
            ("threads", self.threads is None or self.threads >= 1, "must be >= 1 or None (by load)"),
            ("max_bad_steps", self.max_bad_steps >= 1, "must be >= 1"),
            ("model.lora_rank", self.model.lora_rank >= 0, "must be >= 0"),
            ("model.fsdp", not (self.model.fsdp and r.engine == "vllm"),
             "cannot be combined with rollout.engine=vllm (the engine needs the full weights)"),
            ("data.num_train_prompts", d.num_train_prompts >= 1, "must be >= 1"),
            ("data.num_eval_prompts", d.num_eval_prompts >= 0, "must be >= 0"),
            ("data.reward_timeout_s", d.reward_timeout_s is None or d.reward_timeout_s > 0, "must be > 0 or None (off)"),
            ("data.reward_workers", d.reward_workers is None or d.reward_workers >= 1, "must be >= 1 or None (auto)"),
            ("model.path", d.path is None or self.model.path is not None,
             "is required with data.path (the built-in base model knows only the built-in tasks)"),
            ("data.reward", d.path is None or d.reward is not None,
             "is required with data.path (math, exact_match, code or module:function)"),
            ("rollout.max_new_tokens", d.path is None or r.max_new_tokens is not None, "is required with data.path"),
            ("rollout.prompts_per_step", r.prompts_per_step >= 1, "must be >= 1"),
            ("rollout.group_size", r.group_size >= 2, "must be >= 2 (group-relative advantages)"),
            ("rollout.temperature", r.temperature > 0, "must be > 0 (the trainer's log-probs divide by it)"),
            ("rollout.top_p", 0 < r.top_p <= 1, "must be in (0, 1]"),
            ("rollout.max_new_tokens", r.max_new_tokens is None or r.max_new_tokens >= 1, "must be >= 1 or None"),
            ("rollout.repetition_stop_tokens", r.repetition_stop_tokens is None or r.repetition_stop_tokens >= 0,
             "must be >= 0 (0: off) or None"),
            ("rollout.overlong_buffer", r.overlong_buffer is None or r.overlong_buffer >= 1, "must be >= 1 or None (off)"),
            ("rollout.max_sampling_rounds", r.max_sampling_rounds >= 1, "must be >= 1"),
            ("algo.updates_per_batch", a.updates_per_batch >= 1, "must be >= 1"),
            ("algo.updates_per_batch", a.updates_per_batch <= rows,
             f"must be <= the rows of a batch, prompts_per_step * group_size = {rows}"),
            ("algo.epochs", a.epochs >= 1, "must be >= 1"),
            ("algo.micro_batch_size", a.micro_batch_size is None or a.micro_batch_size >= 1, "must be >= 1 or None"),
            ("algo.tis_cap", a.tis_cap is None or a.tis_cap > 0, "must be > 0 or None"),
            ("optim.lr", self.optim.lr > 0, "must be > 0"),
            ("optim.grad_clip", self.optim.grad_clip >= 0, "must be >= 0"),
            ("optim.warmup_updates", self.optim.warmup_updates >= 0, "must be >= 0"),
            ("eval.every", self.eval.every >= 0, "must be >= 0 (0: only before the first and after the last step)"),
            ("eval.num_samples", self.eval.num_samples >= 1, "must be >= 1"),
            ("eval.temperature", self.eval.temperature >= 0, "must be >= 0"),
            ("log_samples_every", self.log_samples_every >= 0, "must be >= 0 (0: never)"),
            ("max_samples_per_step", self.max_samples_per_step >= 1, "must be >= 1"),
            ("samples_max_chars", self.samples_max_chars >= 1, "must be >= 1"),
            ("samples_max_mb", self.samples_max_mb > 0, "must be > 0"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"{name} {why}")
        from cispo.objective import preset
        from cispo.tracking import check_sink_kinds

        check_sink_kinds(self.trackers)  # unknown name -> ValueError with a suggestion
        kl_coef = preset(a.objective, **a.objective_overrides).kl_coef  # unknown name / field / bad value
        ref_checks = [
            ("model.ref_path", self.model.ref_path is None or kl_coef > 0,
             "is set but algo.objective_overrides.kl_coef is 0: the reference model would be unused"),
            ("algo.objective_overrides.kl_coef", kl_coef == 0 or self.model.lora_rank == 0,
             "> 0 cannot be combined with model.lora_rank > 0 (a reference model next to LoRA adapters "
             "is not supported yet)"),
            ("algo.objective_overrides.kl_coef", kl_coef == 0 or not self.model.fsdp,
             "> 0 cannot be combined with model.fsdp (the reference model is not sharded)"),
        ]
        for name, ok, why in ref_checks:
            if not ok:
                raise ValueError(f"{name} {why}")
