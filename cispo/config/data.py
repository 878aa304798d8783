"""The ``data:`` section of the run's configuration: the prompts (a built-in task or a prompt file),
the named evaluation sets, and the reward that scores them (`cispo.config.train` gathers the sections)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

__all__ = ["DataConfig", "EvalSetConfig", "FILE_EVAL_PROMPTS"]

FILE_EVAL_PROMPTS = 200
"""``data.num_eval_prompts`` of a prompt file (``data.path``) where it is None."""


BUILTIN_TASKS = ("addition", "addition4", "chain", "chain_hidden", "chain_hidden_graded", "chain_hidden_sharp",
                 "chain_hidden_strict", "chain_sparse", "guess_number", "wordmath", "wordmath_calc",
                 "wordmath_calc_example", "wordmath_calc_large", "wordmath_large", "wordmath_working")
"""The built-in tasks' names, without importing them (``cispo train --help`` loads no torch); a test keeps it equal
to ``cispo.data.tasks.list_tasks()``."""


@dataclass
class EvalSetConfig:
    """One named evaluation set (``data.eval_sets``), with its own fields; scored by
    ``data.reward`` and reported as ``eval/<name>/...``."""

    path: str
    """JSONL / Parquet file, folder of shards, ``datasets`` folder or hub id (as ``data.path``)."""
    prompt_field: str = "prompt"
    """Field holding the prompt (text or chat messages); dotted paths allowed."""
    answer_field: str | None = "answer"
    """Field holding the reference answer, passed to the reward as ``answer`` (as ``data.answer_field``)."""
    extra_fields: list[str] | Literal["all"] | None = "all"
    """Columns passed to the reward as keyword arguments (as ``data.extra_fields``)."""
    split: str | None = None
    """Split of a folder or hub data set (required for a hub id)."""
    name: str | None = None
    """Subset of a hub data set."""
    num_prompts: int | None = None
    """Evaluate the first this many prompts; None: all of them."""


@dataclass
class DataConfig:
    """The prompts and their reward."""

    task: str = "addition"
    """Built-in task name: one of `BUILTIN_TASKS` (``cispo.data.tasks.list_tasks()``; ``cispo train --help`` lists
    them)."""
    seed: int = 0
    """Seed of the train / held-out prompt sets: fixed, so runs of any seed share prompts. 0 to
    2^31 - 1, as ``seed``."""
    num_train_prompts: int = 20000
    """Size of the training prompt set drawn from the task's train split; at most 10^8 (held in memory)."""
    num_eval_prompts: int | None = None
    """Held-out prompts used by the periodic evaluation; at most 10^8. None: the built-in task's own
    (``Task.num_eval_prompts``: 200; ``wordmath`` and ``wordmath_working``, whose model is a real one: 100);
    with ``data.path``, 200 (at most 1/5 of the file when there is no ``eval_path``)."""
    path: str | None = None
    """Prompt file instead of the built-in task: JSONL, Parquet or a ``datasets`` folder."""
    eval_path: str | None = None
    """Held-out prompt file. None: a seeded slice of ``path`` (at most 1/5 of it)."""
    eval_sets: dict[str, EvalSetConfig] = field(default_factory=dict)
    """Named evaluation sets, each with its own path and fields, reported as ``eval/<name>/...``
    next to the held-out set's ``eval/...`` (``num_eval_prompts=0`` leaves only these)."""
    prompt_field: str = "prompt"
    """Field holding the prompt (text or chat messages); dotted paths allowed."""
    answer_field: str | None = "answer"
    """Field holding the reference answer, passed to the reward as ``answer`` (and under its own
    name). The default, ``answer``, may be missing from the whole file (then a reward that needs
    ``answer`` is refused before training); any other field must be in every row. None: no answer."""
    extra_fields: list[str] | Literal["all"] | None = "all"
    """Columns passed to the reward as keyword arguments: ``all`` (every column but the prompt's,
    under its own name, as TRL passes them), a list of fields (dotted paths allowed, each passed
    under its last component), or None (only ``answer`` and a chat prompt's ``messages``)."""
    split: str | None = None
    """Split of a ``datasets`` DatasetDict folder, of a folder of shards, or of a hub data set
    (required for a hub id)."""
    name: str | None = None
    """Subset (configuration) of a hub data set, ``datasets.load_dataset(path, name=...)``."""
    system_prompt: str | None = None
    """System message put before each prompt's chat messages (turns ``model.chat_template=auto`` on;
    refused with ``false``; a row whose messages already start with a system message keeps its own)."""
    on_error: Literal["raise", "skip"] = "raise"
    """Malformed rows: ``raise`` (the first one, naming file, line and field) or ``skip``."""
    reward: str | list[str] | None = None
    """Reward for ``path`` data: ``math``, ``exact_match``, ``code``, ``env`` (0: the environment's rewards
    alone, ``environment``), ``module:function``,
    ``file.py:function`` or ``rm:<folder>`` (a reward model); a list of them (``[a.py:f, b.py:g]``)
    sums them, weighted by ``reward_weights`` (docs/real-models.md, "Several rewards")."""
    reward_weights: list[float] | None = None
    """One weight per ``reward`` (the task reward is their weighted sum, TRL's ``reward_weights``).
    None: 1.0 each."""
    fork_tokens: list[str] | None = None
    """Reflective (fork) strings whose use, probability and clipping are tracked per string
    (``fork/<string>/...`` metrics, ``rollout/fork_rate``), e.g. ``[Wait, However, "Let me check"]``:
    each in either case of its first letter, with or without a leading space, as a whole word — every
    token and token sequence of the vocabulary that spells it (docs/metrics.md). None: the task's own
    (``wordmath``: an English list; ``addition``, ``chain``: ``[W]``; prompt files: none); ``[]``: none.
    ``data.fork_token=Wait``, its old name (one string), still reads as ``[Wait]``."""
    retire_pass_rate: float | None = None
    """ScaleRL's No-Positive-Resampling (arXiv 2510.13786): a training prompt whose group's pass rate
    (the mean task reward of its G responses) reaches this is not sampled again (in (0, 1]; ScaleRL:
    0.9; ``recipe=scalerl`` sets it). Kept across a resume; once every prompt is retired the stream
    samples them all again (said once). None: off."""
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
    """Worker processes of a ``process`` reward (1 to 1024). None: min(8, CPU count)."""
    tools: str | list[str] | None = None
    """Tools of a multi-turn rollout (``cispo.envs.tools``): ``calculator``, ``python`` (the code
    sandbox), ``module:function``, ``file.py:function`` or ``file.py:add,multiply`` (TRL-style functions:
    typed arguments and a docstring), or a list of them. None: the built-in task's own
    (``wordmath_calc``: ``calculator``), else none; ``[]``: none."""
    tool_format: Literal["auto", "chat", "inline", "hermes", "llama3_json", "qwen_xml", "mistral"] = "auto"
    """How the policy calls a tool: ``chat`` (the chat template's tool calls and tool turns, TRL's; the
    call's syntax is the one the template itself writes: ``hermes`` ``<tool_call>{...}</tool_call>``,
    ``llama3_json`` a bare ``{"name": ..., "parameters": {...}}``, ``qwen_xml`` Qwen3.5's
    ``<function=NAME><parameter=P>``, ``mistral`` ``[TOOL_CALLS]``; a template whose calls none of them
    reads is refused), one of those four names (chat, that syntax forced), ``inline`` (``<calc>2+3</calc>``
    pauses generation and ``<result>5</result>`` is inserted in the same turn), ``auto``: the built-in
    task's own (``wordmath_calc``: inline), else chat where the model's chat template takes tools, else
    inline. A chat call's arguments are cast to the tool's types (``"2"`` -> 2 for an int)."""
    environment: str | None = None
    """The environment of a multi-turn rollout as a class, ``module:Class`` or ``path/to/file.py:Class``
    (``cispo.envs.factory``): a TRL ``environment_factory`` class unchanged (``reset(**sample)``, its public
    methods the tools, ``get_reward()`` counted toward the episode's last turn; called in ``tool_format``), a
    ``cispo.envs.base.Env`` subclass (``reset`` / ``step`` with a reward per turn), or an
    ``cispo.envs.episodes.Environments`` subclass. One instance per episode, in the trainer's process. None:
    the tools of ``tools`` (if any) are the environment. Not with ``tools`` (give them as its methods)."""
    agent: str | None = None
    """An agent program as the environment, ``module:function`` or ``path/to/file.py:function``
    (``cispo.envs.agent_env``, docs/agents.md): a plain or async function given (by the names it takes)
    ``sample``, ``base_url``, ``api_key`` and ``session_id``, that runs its own loop against the
    OpenAI-compatible endpoint the trainer serves from the policy and returns the episode's reward (None:
    the task's reward alone). Each of its calls is a policy turn; ``rollout.max_turns`` + 1 calls at most.
    Not with ``environment`` or ``tools`` (the program runs its own tools)."""
    agent_command: str | None = None
    """An agent program as the environment, given as a command run once per episode in a process of its own,
    any language (``cispo.envs.agent_command``, docs/agents.md): split as a shell splits it, run without a
    shell in the trainer's folder, the sample as JSON on its standard input and ``OPENAI_BASE_URL``,
    ``OPENAI_API_KEY`` and ``CISPO_SESSION_ID`` in its environment (the ``openai`` client reads the first two);
    the last line it prints, a number, is the episode's reward (nothing: the task's reward alone). Killed with
    its process group when its episode ends. Not with ``agent``, ``environment`` or ``tools``."""
    agent_memory_mb: int = 4096
    """The address space (``RLIMIT_AS``, MiB) of each process of ``agent_command``: an allocation past it
    fails. 0: no cap. (An ``agent`` function runs in the trainer's process: no cap of its own.)"""
    agent_timeout_s: float = 60.0
    """The longest an agent program (``agent``) may run between the endpoint's answers (to its first
    request; from an answer to its next request or its return): past it the episode ends, recorded as
    failed (> 0)."""
    tool_timeout_s: float = 5.0
    """Per-call tool timeout (> 0): a call past it has its worker process killed and replaced, and the
    policy is shown a short error."""

    def __post_init__(self) -> None:
        """A prompt file's held-out count is known now (`FILE_EVAL_PROMPTS`), so every reader of a file's
        ``num_eval_prompts`` (the held-out slice, the reward's field check) gets a number; a built-in
        task's stays None until the run reads it from the task (`cispo.training.setup.eval_defaults`)."""
        if self.path is not None and self.num_eval_prompts is None:
            self.num_eval_prompts = FILE_EVAL_PROMPTS
        check_tools(self.tools, self.tool_timeout_s)
        if self.environment is not None and (not isinstance(self.environment, str) or ":" not in self.environment):
            raise ValueError(f"data.environment: expected 'module:Class' or 'path/to/file.py:Class', "
                             f"got {self.environment!r}")
        if self.agent is not None and (not isinstance(self.agent, str) or ":" not in self.agent):
            raise ValueError(f"data.agent: expected 'module:function' or 'path/to/file.py:function', "
                             f"got {self.agent!r}")
        command = self.agent_command
        if command is not None and (not isinstance(command, str) or not command.strip()):
            raise ValueError(f"data.agent_command: expected a command line, got {self.agent_command!r}")
        if self.agent is not None and self.agent_command is not None:
            raise ValueError("data.agent and data.agent_command are both set: give the agent program one way")
        key = "data.agent" if self.agent is not None else "data.agent_command"
        if (self.agent or self.agent_command) and (self.environment is not None or self.tools not in (None, [], "")):
            raise ValueError(f"{key} is set with data.environment or data.tools: an agent program runs its own "
                             "tools (set data.tools=[] and leave data.environment unset)")
        if not (isinstance(self.agent_memory_mb, int) and not isinstance(self.agent_memory_mb, bool)
                and self.agent_memory_mb >= 0):
            raise ValueError(f"data.agent_memory_mb must be an integer >= 0 (0: no cap), got {self.agent_memory_mb!r}")
        if not (isinstance(self.agent_timeout_s, (int, float)) and 0 < self.agent_timeout_s < float("inf")):
            raise ValueError(f"data.agent_timeout_s must be a number > 0, got {self.agent_timeout_s!r}")
        if self.environment is not None and self.tools not in (None, [], ""):
            raise ValueError("data.environment and data.tools are both set: give the tools as the environment's "
                             "public methods (or set data.tools=[])")


def check_tools(tools, timeout_s) -> None:
    """ValueError naming the field for ``data.tools`` entries that are no non-empty strings and a
    ``data.tool_timeout_s`` that is not a finite number > 0 (the names themselves are checked when loaded)."""
    items = [tools] if isinstance(tools, str) else tools or []
    if any(not isinstance(t, str) or not t.strip() or t.strip().endswith(":") for t in items):
        raise ValueError(f"data.tools: each entry must name a tool ('calculator', 'python', 'module:function', "
                         f"'file.py:f,g'), got {tools!r}")
    if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < float("inf")):
        raise ValueError(f"data.tool_timeout_s must be a number > 0, got {timeout_s!r}")
