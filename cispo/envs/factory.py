"""A user's environment class as the run's environments (``data.environment``).

Two kinds of class are taken, told apart by what they define:

* **A cispo `Env`** (a subclass of ``cispo.envs.base.Env``: ``reset(sample)``, ``step(segment)``, optionally
  ``final_reward()`` and a class attribute ``stop_strings``): one instance per episode, made with no argument
  (`ClassEnvironments`).
* **A TRL ``environment_factory`` class** (TRL's ``GRPOTrainer(environment_factory=...)``), unchanged: a class
  with ``reset(**sample)`` (None, or text appended to the last user message) whose public methods are the
  tools the policy calls (their type hints and docstrings give their JSON schemas, as TRL requires), and
  optionally ``get_reward()``, read once per finished episode and counted toward its last turn (TRL adds it as
  a reward of weight 1). One instance per episode (`FactoryEnvironments`); its tools are called in the
  format the run's tools would be (``data.tool_format``: the chat template's call format, or inline tags),
  through the same parsing, argument casting and observation rendering as ``data.tools``
  (``cispo.envs.tool_env``).

Both run in the trainer's process, as TRL runs them: an instance's state lives between its calls, so its
methods cannot run in the tools' worker processes; a method that raises is an error observation, but a method
that hangs holds its episode's turn (no time limit) — give stateless tools as ``data.tools`` to have them run
isolated, in worker processes with a time limit.
"""

from __future__ import annotations

import inspect

from cispo.data.rewards import RewardSpecError
from cispo.data.rewards.loading import _resolve
from cispo.data.tasks import guess_number
from cispo.envs.agent_command import AgentCommand
from cispo.envs.agent_env import AgentEnvironments, load_agent
from cispo.envs.base import Env
from cispo.envs.episodes import ClassEnvironments, Environments
from cispo.envs.guess import GuessEnv
from cispo.envs.tool_env import ToolEnvironment, ToolEpisode, environment_from_config, resolve_tool_format
from cispo.envs.tools import ToolRunner, ToolSpecError, as_tool

__all__ = ["ClassEnvironments", "FactoryEnvironments", "environments_from_class", "public_methods",
           "load_environment_class", "run_environments", "TASK_ENVIRONMENTS"]

TASK_ENVIRONMENTS = {guess_number.NAME: GuessEnv}
"""A built-in task's own environment family, made with ``(tokenizer, max_turns)``: the run's environments where
``data.task`` names the task and neither ``data.environment`` nor ``data.tools`` is given."""
RESERVED_METHODS = ("reset", "get_reward")
"""A TRL environment's methods that are not tools."""


def public_methods(instance) -> list:
    """The tools of a TRL environment ``instance``: its class's public functions other than `RESERVED_METHODS`
    (listed on the class, so that no property is evaluated), bound to ``instance``, in name order."""
    names = [n for n, _ in inspect.getmembers(type(instance), predicate=inspect.isfunction)
             if not n.startswith("_") and n not in RESERVED_METHODS]
    return [getattr(instance, n) for n in names]


def _reset_kwargs(reset, sample: dict) -> dict:
    """The sample's fields ``reset`` takes: all of them where it takes ``**kwargs`` (TRL passes every column),
    else those it names."""
    params = inspect.signature(reset).parameters.values()
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return dict(sample)
    return {p.name: sample[p.name] for p in params if p.name in sample}


class FactoryEnvironments(ToolEnvironment):
    """A TRL ``environment_factory`` class as the run's environments (module docstring): the tools' names,
    schemas and format come from one probe instance, made now (its ``reset`` checked callable); each episode
    gets a fresh instance (`FactoryEpisode`)."""

    def __init__(self, factory, tokenizer, tool_format: str, max_turns: int, max_observation_tokens: int = 256,
                 system_prompt: str | None = None, task: str | None = None) -> None:
        probe = factory()
        if not callable(getattr(probe, "reset", None)):
            raise ToolSpecError(f"data.environment: {_name(factory)} has no callable reset(): a TRL environment "
                                f"defines reset(**sample) (returning None or text to append to the prompt)")
        methods = public_methods(probe)
        if not methods:
            raise ToolSpecError(f"data.environment: {_name(factory)} has no public method for the policy to call")
        fmt = resolve_tool_format(tokenizer, tool_format, task)
        super().__init__(tokenizer, methods, fmt, max_turns, ToolRunner(methods, isolation="main"),
                         max_observation_tokens, system_prompt)
        self.factory = factory

    def make(self, sample: dict) -> FactoryEpisode:
        return FactoryEpisode(self, self.factory())

    def describe(self) -> str:
        return f"environment: {_name(self.factory)}; " + super().describe()


class FactoryEpisode(ToolEpisode):
    """One episode of a TRL environment: its own instance, whose bound methods its calls run."""

    def __init__(self, env: FactoryEnvironments, instance) -> None:
        super().__init__(env)
        self.instance = instance
        self.runner = ToolRunner([as_tool(m) for m in public_methods(instance)], isolation="main")

    def reset(self, sample: dict):
        opening = self.instance.reset(**_reset_kwargs(self.instance.reset, sample))
        if opening is not None and not isinstance(opening, str):
            raise TypeError(f"{_name(type(self.instance))}.reset returned {type(opening).__name__}: "
                            f"None or text to append to the prompt")
        return opening

    def final_reward(self) -> float | None:
        get_reward = getattr(self.instance, "get_reward", None)
        return None if get_reward is None else get_reward()


def _name(obj) -> str:
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', type(obj).__name__)}"


def environments_from_class(cls, tokenizer, data_cfg, rollout_cfg) -> Environments:
    """The run's environments for ``data.environment``'s class (module docstring): a cispo `Env` subclass, an
    `Environments` subclass (made with the tokenizer, ``data`` and ``rollout`` sections), or a TRL
    ``environment_factory`` class. ToolSpecError naming the class otherwise."""
    if isinstance(cls, type) and issubclass(cls, Environments):
        return cls(tokenizer, data_cfg, rollout_cfg)
    if isinstance(cls, type) and issubclass(cls, Env):
        return ClassEnvironments(cls, tokenizer, rollout_cfg.max_turns)
    if callable(cls):
        task = data_cfg.task if data_cfg.path is None else None
        return FactoryEnvironments(cls, tokenizer, data_cfg.tool_format, rollout_cfg.max_turns,
                                   system_prompt=data_cfg.system_prompt, task=task)
    raise ToolSpecError(f"data.environment: {cls!r} is no class: give 'module:Class' or 'path/to/file.py:Class'")


def load_environment_class(spec: str, trial: bool = True):
    """The class ``data.environment`` names (``module:Class``, ``path/to/file.py:Class``), its module first
    imported in a throw-away process where ``trial`` (an exit at import is an error here, not the trainer's
    end). ToolSpecError naming the spec otherwise."""
    try:
        return _resolve(spec, spec, trial)
    except RewardSpecError as e:
        message = str(e).replace(f"reward {spec!r}", f"data.environment {spec!r}", 1)
        raise ToolSpecError(message.replace("a reward module", "an environment module")) from None


def run_environments(tokenizer, data_cfg, rollout_cfg) -> Environments | None:
    """The run's environments: ``data.environment``'s class (`environments_from_class`), else the built-in
    task's own environment (`TASK_ENVIRONMENTS`, where ``data.tools`` is None), else the tools of ``data.tools``
    or the built-in task's own (``cispo.envs.tool_env.environment_from_config``), else None. ``data.agent``
    (``data.agent_command``): its program as the environment (``cispo.envs.agent_env``)."""
    if data_cfg.agent or data_cfg.agent_command:
        agent = load_agent(data_cfg.agent) if data_cfg.agent else \
            AgentCommand.parse(data_cfg.agent_command, data_cfg.agent_memory_mb)
        return AgentEnvironments(agent, tokenizer, rollout_cfg.max_turns, data_cfg.agent_timeout_s,
                                 data_cfg.tool_format)
    if data_cfg.environment:
        return environments_from_class(load_environment_class(data_cfg.environment), tokenizer, data_cfg,
                                       rollout_cfg)
    task = data_cfg.task if data_cfg.path is None else None
    if task in TASK_ENVIRONMENTS and data_cfg.tools is None:
        return ClassEnvironments(TASK_ENVIRONMENTS[task], tokenizer, rollout_cfg.max_turns)
    return environment_from_config(tokenizer, data_cfg, rollout_cfg)
