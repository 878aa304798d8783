"""An agent program given as a command (cispo.envs.agent_command, ``data.agent_command``): one process per
episode (tests/envs/fixtures/agent_command.py), its episodes those of the same program run as a function; a
crash, a hang, no reward, a result that is no number and a memory cap each a recorded episode, and a hung
command's whole process group killed."""

from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

import pytest

from cispo.config.data import DataConfig
from cispo.envs.agent_command import AgentCommand, AgentCommandError, reward_of_output
from cispo.envs.agent_env import AgentEnvironments
from cispo.envs.tools import ToolSpecError
from tests.envs.fixtures import agent_programs as programs
from tests.envs.test_agent_env import play, row, sampler, tok  # noqa: F401 - fixtures

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "agent_command.py"


def command(kind: str, memory_mb: int = 0) -> AgentCommand:
    return AgentCommand.parse(f"{shlex.quote(sys.executable)} {shlex.quote(str(FIXTURE))} {kind}", memory_mb)


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not reaped by whoever adopted it, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def test_a_command_plays_the_episodes_of_the_same_program_as_a_function(tok, sampler):  # noqa: F811
    """The command that runs `three_calls` samples exactly the ids and log-probs, and earns the rewards, of the
    function `three_calls`; what it printed before its last line is not its reward."""
    samples = [{"prompt": "add 2 and 3"}] * 2
    batch, records = play(AgentEnvironments(command("three_calls"), tok, max_turns=4, timeout_s=30), sampler,
                          samples)
    same, same_records = play(AgentEnvironments(programs.three_calls, tok, max_turns=4, timeout_s=30), sampler,
                              samples)
    assert [row(batch, i) for i in range(2)] == [row(same, i) for i in range(2)]
    assert sum(row(batch, 0)[2]) > 0  # observations were fed: three calls made
    for r, s in zip(records, same_records):
        assert r["agent"] == {**s["agent"], "session": r["agent"]["session"]}
        assert r["agent"]["calls"] == 3 and r["agent"]["ended"] == "returned" and r["agent"]["error"] is None
        assert r["turn_rewards"] == s["turn_rewards"]


def test_commands_that_crash_hang_or_give_no_reward_are_recorded_and_the_batch_goes_on(tok, sampler,  # noqa: F811
                                                                                       tmp_path):
    """Each kind in one batch (the command picks its kind from the sample): the crash is a failed episode
    with its exit status and standard error, the hang one past the timeout whose process and the child it
    started are killed, no output a returned episode without a reward, a last line that is no number one with
    its error recorded, while the three-call episode ends as it would alone."""
    kinds = ["crashes", "hangs", "no_reward", "not_a_number", "three_calls"]
    pids = tmp_path / "pids"
    samples = [{"prompt": f"add {i} and 1", "kind": k, "pids": str(pids)} for i, k in enumerate(kinds)]
    _, records = play(AgentEnvironments(command("by_kind"), tok, max_turns=4, timeout_s=3), sampler, samples)
    agent = {k: r["agent"] for k, r in zip(kinds, records)}
    assert agent["crashes"]["ended"] == "failed"
    assert "exit status 3" in agent["crashes"]["error"] and "the agent's own bug" in agent["crashes"]["error"]
    assert agent["hangs"]["ended"] == "failed" and "within 3 s" in agent["hangs"]["error"]
    assert agent["no_reward"] == {**agent["no_reward"], "ended": "returned", "reward": None, "error": None}
    assert agent["not_a_number"]["reward"] is None and "not a finite number" in agent["not_a_number"]["error"]
    assert agent["three_calls"] == {**agent["three_calls"], "calls": 3, "ended": "returned", "error": None}
    group = [int(p) for p in pids.read_text().split()]
    for _ in range(100):  # SIGKILL is sent; the kernel ends them at once (a bounded wait, not a timing)
        if not any(alive(p) for p in group):
            break
        time.sleep(0.05)
    assert not any(alive(p) for p in group), "the hung command or its child outlived its episode"


def test_a_command_past_its_memory_cap_is_a_failed_episode(tok, sampler):  # noqa: F811
    """2 GiB asked under a 512 MiB cap: the command fails (MemoryError), recorded; without the cap it would
    print True and return."""
    _, records = play(AgentEnvironments(command("needs_memory", memory_mb=512), tok, max_turns=2, timeout_s=30),
                      sampler, [{"prompt": "hi"}])
    assert records[0]["agent"]["ended"] == "failed"
    assert "MemoryError" in records[0]["agent"]["error"] and "exit status 1" in records[0]["agent"]["error"]


def test_the_reward_is_the_last_line_printed():
    assert reward_of_output("thinking...\n0.25\n\n") == 0.25
    assert reward_of_output("") is None and reward_of_output("\n \n") is None
    for bad in ("done", "nan", "inf"):
        with pytest.raises(AgentCommandError, match="not a finite number"):
            reward_of_output(f"1\n{bad}\n")


def test_a_command_is_checked_where_the_run_starts():
    assert command("three_calls", 64).memory_bytes == 64 << 20 and command("x").memory_bytes is None
    with pytest.raises(ToolSpecError, match="no program 'no-such-agent-program'"):
        AgentCommand.parse("no-such-agent-program --fast")
    with pytest.raises(ToolSpecError, match="cannot be split"):
        AgentCommand.parse("python 'agent.py")
    with pytest.raises(ValueError, match="data.agent and data.agent_command are both set"):
        DataConfig(agent="a.py:run", agent_command="python a.py")
    with pytest.raises(ValueError, match="data.agent_command is set with data.environment"):
        DataConfig(agent_command="python a.py", tools=["calculator"])
    with pytest.raises(ValueError, match="data.agent_memory_mb"):
        DataConfig(agent_command="python a.py", agent_memory_mb=-1)


def test_the_example_react_agent_runs_as_a_command_through_the_openai_client(tok, sampler):  # noqa: F811
    """examples/react_agent_command.py, as its docstring runs it: the ``openai`` client finds the endpoint in
    OPENAI_BASE_URL / OPENAI_API_KEY, its episode ends as returned, without a reward of its own."""
    pytest.importorskip("openai")
    example = Path(__file__).resolve().parents[2] / "examples" / "react_agent_command.py"
    agent = AgentCommand.parse(f"{shlex.quote(sys.executable)} {shlex.quote(str(example))}")
    _, records = play(AgentEnvironments(agent, tok, max_turns=4, timeout_s=30), sampler, [{"prompt": "2 + 3?"}])
    assert records[0]["agent"] == {**records[0]["agent"], "ended": "returned", "reward": None, "error": None}
    assert records[0]["agent"]["calls"] >= 1
