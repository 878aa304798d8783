"""Histories that are not append-only (``StepResult.context``): a context that extends the row's ids is fed as an
observation in the same row (the same ids as the observation path); one that does not ends the row and the
episode goes on in a new training row whose prompt is the context, on the torch sampler and the vLLM stand-in
alike. Tokens trained == tokens sampled in every row (the ids, and the sampler's log-probs of them, are the
model's own under each row's context); every row of an episode carries its advantage, the baseline is over
episodes, and ``reward_to_go`` counts an episode's turns across its rows."""

from __future__ import annotations

import pytest
import torch

from cispo.envs.base import Env, StepResult
from cispo.envs.rows import sample_episode_rows
from cispo.foundations.experience import Completion, collate
from cispo.training.batching import row_order
from cispo.training.credit import batch_advantages, num_segments, training_rows
from tests.envs.test_env_protocol import Family
from tests.envs.test_environments import ids as tok_ids

transformers = pytest.importorskip("transformers")

from cispo.models.loading import build_tokenizer, save_policy  # noqa: E402
from cispo.rollout import SamplingConfig, TorchSampler  # noqa: E402
from tests import fake_vllm  # noqa: E402
from tests.rollout.test_vllm_episodes import CHARS, EOS, PAD, ids, make_sampler  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py
PROMPTS = [[5, 6, 7], [8], [9, 10, 11]]


class Scripted(Env):
    """Three turns: ``ab`` observed after the first (reward 1), then by ``mode`` after the second (reward 2):
    ``observe`` the ids of ``cd``; ``extend`` the whole context so far + ``cd`` (the same ids); ``rewrite`` a
    compaction: the prompt, ``zz`` and the second segment (the first turn dropped). The third ends it (3)."""

    mode = "observe"

    def __init__(self):
        self.prompt, self.history, self.turn = None, None, 0

    def reset(self, sample):
        self.prompt = list(sample["prompt_ids"])
        self.history = list(self.prompt)
        return None

    def step(self, segment):
        self.turn += 1
        self.history += list(segment.ids)
        if self.turn == 1:
            self.history += ids("ab")
            return StepResult(ids("ab"), reward=1.0)
        if self.turn == 2 and self.mode == "observe":
            self.history += ids("cd")
            return StepResult(ids("cd"), reward=2.0)
        if self.turn == 2 and self.mode == "extend":
            self.history += ids("cd")
            return StepResult(context=list(self.history), reward=2.0)
        if self.turn == 2:
            self.history = [*self.prompt, *ids("zz"), *segment.ids]
            return StepResult(context=list(self.history), reward=2.0)
        return StepResult(None, reward=3.0, done=True)


def mode(name: str) -> type:
    return type(f"Scripted_{name}", (Scripted,), {"mode": name})


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    tok = build_tokenizer(CHARS)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                                   pad_token_id=PAD, eos_token_id=EOS, bos_token_id=None, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return tok, save_policy(transformers.LlamaForCausalLM(cfg), tok, tmp_path_factory.mktemp("rewrite"))


def play(model_path, name: str, which: str, max_new_tokens: int = 16):
    """Each episode's rows and records, every sampled character a turn (the stop strings: every character)."""
    tok, path = model_path
    family = Family(tok, cls=mode(name), stop_strings=tuple(CHARS))
    episodes = family.start([{"prompt": "p", "prompt_ids": p} for p in PROMPTS])
    sampler = TorchSampler(fake_vllm.load_hf(path), EOS, PAD) if which == "torch" else make_sampler(path)
    rows = sample_episode_rows(sampler, PROMPTS, SamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0),
                               None, episodes)
    fed = [int(sum(r.env_mask.sum() for r in ep)) for ep in rows]
    return rows, [episodes.record(i, fed=f) for i, f in enumerate(fed)]


def own_logprobs(path, row) -> torch.Tensor:
    """The model's log-prob of each response token of ``row`` under the row's own prompt and response."""
    model = fake_vllm.load_hf(path)
    seq = torch.tensor([[*row.prompt_ids, *row.response_ids.tolist()]])
    with torch.no_grad():
        logits = model(seq).logits[0, len(row.prompt_ids) - 1: -1]  # [T, V]
    return logits.log_softmax(-1).gather(-1, row.response_ids[:, None])[:, 0]


def assert_trained_is_sampled(path, rows) -> None:
    """Each row's policy tokens and their sampler log-probs are the model's own under that row's context."""
    for row in rows:
        policy = row.env_mask == 0
        torch.testing.assert_close(row.logp_rollout[policy], own_logprobs(path, row)[policy], atol=1e-4, rtol=0)
        assert (row.logp_rollout[~policy] == 0).all()


def test_a_context_that_extends_the_row_is_the_observation_in_the_same_row(model_path):
    observed, _ = play(model_path, "observe", "torch")
    extended, records = play(model_path, "extend", "torch")
    for a, b in zip(observed, extended):
        assert len(a) == len(b) == 1
        assert a[0].response_ids.tolist() == b[0].response_ids.tolist()
        assert a[0].env_mask.tolist() == b[0].env_mask.tolist() and torch.equal(a[0].logp_rollout, b[0].logp_rollout)
        assert_trained_is_sampled(model_path[1], b)
    assert all(r["contexts"] == 1 and r["rewrites"] == 0 for r in records)


@pytest.mark.parametrize("which", ["torch", "vllm"])
def test_a_context_that_rewrites_the_history_starts_a_new_training_row(model_path, which):
    episodes, records = play(model_path, "rewrite", which)
    for prompt, rows, record in zip(PROMPTS, episodes, records):
        assert len(rows) == 2, "the rewrite ends the first row; the episode goes on in a second"
        first, second = rows
        s0, s1 = first.response_ids[0].item(), first.response_ids[3].item()
        assert first.prompt_ids == prompt and first.response_ids.tolist() == [s0, *ids("ab"), s1]
        assert first.env_mask.tolist() == [0, 1, 1, 0] and first.finish_reason == "eos"
        assert second.prompt_ids == [*prompt, *ids("zz"), s1], "the new row's prompt is the context itself"
        assert second.env_mask.tolist() == [0] * len(second.response_ids)
        assert_trained_is_sampled(model_path[1], rows)
        assert record["turn_rewards"] == [1.0, 2.0, 3.0] and record["rewrites"] == 1
        assert [s["role"] for s in record["segments"]] == ["policy", "tool", "policy", "context", "policy"]


def test_the_torch_and_vllm_samplers_give_the_same_rows(model_path):
    t, t_rec = play(model_path, "rewrite", "torch")
    v, v_rec = play(model_path, "rewrite", "vllm")
    assert t_rec == v_rec
    for te, ve in zip(t, v):
        assert [r.prompt_ids for r in te] == [r.prompt_ids for r in ve]
        assert [r.response_ids.tolist() for r in te] == [r.response_ids.tolist() for r in ve]
        assert [r.env_mask.tolist() for r in te] == [r.env_mask.tolist() for r in ve]
        for a, b in zip(te, ve):
            torch.testing.assert_close(a.logp_rollout, b.logp_rollout, atol=1e-4, rtol=0)


def test_max_turns_counts_a_rewrite_as_a_turn(model_path):
    tok, _ = model_path
    family = Family(tok, cls=mode("rewrite"), stop_strings=tuple(CHARS), max_turns=1)
    episodes = family.start([{"prompt": "p", "prompt_ids": [5]}])
    episodes.begin([[5]])
    assert episodes.respond([0], [ids("1")], [False]) == [ids("ab")]
    assert episodes.respond([0], [ids("2")], [False]) == [None] and episodes.continuations() == []


# --------------------------------------------------------------------------- chat messages


def test_a_context_of_chat_messages_extends_or_rewrites_by_its_rendered_ids(qwen):
    """A messages context is rendered as the prompt is (chat template, assistant turn opened): appending the
    assistant's turn and a user turn extends the ids; dropping the first exchange (a compaction) rewrites them."""
    user = [{"role": "user", "content": "Hi."}]
    prompt = qwen.apply_chat_template(user, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    said = tok_ids(qwen, "Hello.") + tok_ids(qwen, "<|im_end|>")

    class Chat(Env):
        def step(self, segment):
            if segment.turn == 0:
                return StepResult(context=[*user, {"role": "assistant", "content": "Hello."},
                                           {"role": "user", "content": "More."}])
            return StepResult(context=[{"role": "user", "content": "Summary: said hello. More."}])

    episodes = Family(qwen, cls=Chat, stop_strings=()).start([{"prompt": "Hi."}])
    episodes.begin([prompt])
    obs, = episodes.respond([0], [said], [True])
    assert obs is not None and qwen.decode(obs).endswith("<|im_start|>user\nMore.<|im_end|>\n<|im_start|>assistant\n")
    assert episodes.respond([0], [tok_ids(qwen, "Sure.<|im_end|>")], [True]) == [None]
    (row, new_prompt), = episodes.continuations()
    summary = "Summary: said hello. More.<|im_end|>\n<|im_start|>assistant\n"
    assert row == 0 and qwen.decode(new_prompt).endswith(summary)


def test_a_step_with_both_an_observation_and_a_context_is_refused():
    with pytest.raises(ValueError, match="not both"):
        StepResult("x", context=[1, 2])


# --------------------------------------------------------------------------- training rows


def episode(rows: list[tuple[list[int], list[int], list[int]]], turn_rewards, reward=0.0) -> Completion:
    """An episode of ``rows`` (prompt, response, env_mask) with its turn rewards and final reward."""
    made = [Completion({"prompt": "p"}, p, torch.tensor(r), -0.5 * torch.ones(len(r)), "eos", "t",
                       env_mask=torch.tensor(m)) for p, r, m in rows]
    first = made[0]
    first.continuations, first.reward = made[1:], reward
    first.episode = {"turn_rewards": list(turn_rewards)}
    return first


def two_episodes():
    a = episode([([5, 6], [10, 11, 12], [0, 1, 0]), ([5, 9, 12], [13], [0])], [1.0, 2.0, 3.0])  # 2 rows
    b = episode([([5, 6], [20, 21, 22, 23, 24], [0, 1, 0, 1, 0])], [0.0, 0.0, 0.0])  # 1 row
    return a, b


class Algo:
    turn_credit, advantage_estimator, mask_truncated_completions = "episode", "grpo", False


def test_every_row_of_an_episode_gets_its_advantage_and_the_baseline_is_over_episodes():
    a, b = two_episodes()
    assert len(a.rows) == 2 and num_segments(a) == num_segments(b) == 3
    assert a.length == 4 and a.policy_length == 3
    A = batch_advantages([[a, b]], Algo())  # returns 6 and 0 over G = 2 episodes: +-1/sqrt(2) * ... equal sizes
    assert A.shape == (3,) and A[0] == A[1] and A[0] > 0 and torch.isclose(A[0], -A[2])
    exp = collate(training_rows([[a, b]]), A, pad_id=0)
    assert exp.input_ids.shape[0] == 3 and exp.advantages.tolist() == A.tolist()
    assert exp.response_mask.tolist() == [[1, 0, 1, 0, 0], [1, 0, 0, 0, 0], [1, 0, 1, 0, 1]]


def test_reward_to_go_counts_an_episodes_turns_across_its_rows():
    """G_a = (6, 5, 3), G_b = (0, 0, 0); with G = 2 the leave-one-out baseline is the other episode's."""
    a, b = two_episodes()
    algo = Algo()
    algo.turn_credit = "reward_to_go"
    A = batch_advantages([[a, b]], algo)  # [3 rows, T]
    assert A[0, :3].tolist() == [6.0, 0.0, 5.0] and A[1, :1].tolist() == [3.0]
    assert A[2, :5].tolist() == [-6.0, 0.0, -5.0, 0.0, -3.0]


def test_by_group_order_keeps_a_groups_rows_together():
    class ByGroup:
        minibatch_order = "by_group"

    group_of = torch.tensor([0, 0, 0, 1, 1])  # group 0: an episode of 2 rows and one of 1
    order = row_order(5, 2, ByGroup(), torch.Generator().manual_seed(0), group_of)
    assert sorted(order.tolist()) == [0, 1, 2, 3, 4]
    assert group_of[order].tolist() in ([0, 0, 0, 1, 1], [1, 1, 0, 0, 0])


def test_a_held_batch_keeps_an_episodes_rows_and_checks_them():
    """``rollout.async_steps=1`` keeps the batch sampled ahead in the checkpoint: an episode's further rows go with
    it, and a damaged one is named."""
    import json

    from cispo.training.held_batch import HeldBatchError, HeldBatchLimits, check_completion
    from cispo.training.prefetch import completion_state, load_completion

    class Stream:
        samples = [{"prompt": "p"}]

        def index_of(self, sample):
            return 0

    a, _ = two_episodes()
    state = json.loads(json.dumps(completion_state(a, Stream())))
    check_completion(state, HeldBatchLimits(vocab_size=32, num_samples=1), "c")
    back = load_completion(state, Stream())
    assert [r.prompt_ids for r in back.rows] == [r.prompt_ids for r in a.rows]
    assert [r.response_ids.tolist() for r in back.rows] == [r.response_ids.tolist() for r in a.rows]
    state["continuations"][0]["prompt_ids"][0] = 99
    with pytest.raises(HeldBatchError, match=r"c.continuations\[0\].prompt_ids holds token id 99"):
        check_completion(state, HeldBatchLimits(vocab_size=32, num_samples=1), "c")


# --------------------------------------------------------------------------- a template that rewrites past turns


def rewriting_template() -> str:
    """Qwen2.5's tool template, but an assistant turn with calls that is no longer the last message loses its
    thinking (``<think>...</think>``) and is marked ``(earlier)``: a tool turn does not extend the conversation."""
    from tests.envs.test_environments import QWEN_TOOL_TEMPLATE

    old = "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}{%- if message.content %}" \
          "{{- '\\n' + message.content }}{%- endif %}"
    assert old in QWEN_TOOL_TEMPLATE
    new = "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}" \
          "{%- if not loop.last %}{{- ' (earlier)' }}{%- endif %}{%- if message.content %}" \
          "{{- '\\n' + (message.content if loop.last else message.content.split('</think>')[-1].strip()) }}{%- endif %}"
    return QWEN_TOOL_TEMPLATE.replace(old, new)


def test_a_template_that_rewrites_past_turns_gives_the_tool_episode_a_new_row(qwen):
    """Where the template renders an assistant turn differently once a tool turn follows (thinking stripped), the
    tool environment re-renders the whole conversation each turn (``StepResult.context``) instead of refusing
    the template: the turn's row ends and the next row's prompt is the template's own rendering."""
    import copy

    from cispo.envs.tool_env import ToolEnvironment, appends_tool_turns, render_prompt, template_takes_tools
    from tests.envs.test_environments import CountingRunner, add

    tok = copy.copy(qwen)
    tok.chat_template = rewriting_template()
    assert template_takes_tools(tok) and not appends_tool_turns(tok) and appends_tool_turns(qwen)
    env = ToolEnvironment(tok, [add], "chat", 2, CountingRunner([add]))
    assert env.tool_format == "chat" and env.rerenders
    sample = {"prompt": "What is 2 + 3?"}
    episodes = env.start([sample])
    episodes.begin([render_prompt(tok, sample, env.schemas)])
    said = ('<think>add them</think>\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
            '<|im_end|>')
    assert episodes.respond([0], [tok_ids(tok, said)], [True]) == [None]  # the row ends ...
    (row, prompt), = episodes.continuations()  # ... and the episode goes on from the re-rendered conversation
    text = tok.decode(prompt)
    assert row == 0 and "<|im_start|>assistant (earlier)\n\n<tool_call>" in text and "add them" not in text
    assert text.endswith("<tool_response>\n5\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert episodes.respond([0], [tok_ids(tok, "It is 5.<|im_end|>")], [True]) == [None]
    record = episodes.record(0)
    assert [s["role"] for s in record["segments"]] == ["policy", "context", "policy"]
    assert record["rewrites"] == 1 and record["calls"][0]["name"] == "add"


def test_the_trainers_batch_lays_out_an_episodes_rows_with_its_group():
    """`Trainer.experience`: one row per training row, the episode's advantage on each, each row's group mean
    length over the group's episodes (every row's policy tokens), and the group of each row for ``by_group``."""
    from types import SimpleNamespace

    from cispo.training.trainer import Trainer

    a, b = two_episodes()
    c, d = episode([([7], [30, 31], [0, 0])], [1.0]), episode([([7], [40], [0])], [0.0])
    fake = SimpleNamespace(cfg=SimpleNamespace(rollout=SimpleNamespace(group_size=2), algo=Algo(),
                                                   data=SimpleNamespace(reward_weights=None)),
                           advantage_scale=lambda groups: None, policy=SimpleNamespace(pad_id=0, device="cpu"))
    exp = Trainer.experience(fake, [[a, b], [c, d]])
    assert len(exp) == 5 and exp.advantages[0] == exp.advantages[1] != exp.advantages[2]
    # episode policy tokens: a 2 + 1 = 3, b 3 -> mean 3; c 2, d 1 -> mean 1.5
    assert exp.extras["group_mean_length"].tolist() == [3.0, 3.0, 3.0, 1.5, 1.5]
    assert exp.extras["group_of"].tolist() == [0, 0, 0, 1, 1]
    assert exp.response_mask.sum().item() == 3 + 3 + 2 + 1


def test_under_lock_step_a_rank_with_no_row_left_joins_the_others_rounds():
    """Sharded weights (FSDP) need every rank in every ``generate``: the rounds go on while any rank continues an
    episode, a rank with none left running a throw-away greedy one."""
    from types import SimpleNamespace

    class Sampler:
        def __init__(self, others_rounds):
            self.others, self.calls, self.asked = others_rounds, [], []

        def _all_ranks_done(self, done):  # the other rank continues episodes for `others` more rounds
            self.asked.append(done)
            self.others -= 1
            return done and self.others < 0

        def generate(self, prompts, cfg, generator=None, episodes=None):
            self.calls.append((prompts, cfg.temperature, episodes is not None))
            n = len(prompts)
            return SimpleNamespace(response_lengths=torch.ones(n, dtype=torch.long), response_ids=torch.ones(n, 1),
                                   logp_rollout=torch.zeros(n, 1), env_mask=torch.zeros(n, 1),
                                   finish_reason=["eos"] * n)

    class Episodes:
        def __init__(self):
            self.left = [[(0, [7, 8])], []]  # this rank continues one episode once

        def begin(self, prompt_ids, encode):
            pass

        def continuations(self):
            return self.left.pop(0) if self.left else []

        def rows_of(self, which):
            return self

    sampler = Sampler(others_rounds=3)
    rows = sample_episode_rows(sampler, [[5, 6]], SamplingConfig(max_new_tokens=4), None, Episodes())
    assert [len(r) for r in rows] == [2] and rows[0][1].prompt_ids == [7, 8]
    assert [c[2] for c in sampler.calls] == [True, True, False, False] and sampler.calls[-1][1] == 0.0
    assert sampler.asked == [False, True, True, True]


def test_a_template_that_always_drops_thinking_is_rerendered(qwen):
    """A template that drops an assistant turn's thinking even as the last message (DeepSeek-R1's style) renders
    both sides of a tool turn alike, so only the thinking probe catches it: its episodes re-render the
    conversation each turn (the policy's next turn sees what the template shows, not its own thinking); Qwen's
    own template keeps the thinking and appends."""
    import copy

    from cispo.envs.tool_env import ToolEnvironment, appends_tool_turns
    from tests.envs.test_environments import QWEN_TOOL_TEMPLATE, CountingRunner, add

    turns = ("'\\n' + message.content + '<|im_end|>'", "{{- '\\n' + message.content }}")  # plain, with calls
    assert all(t in QWEN_TOOL_TEMPLATE for t in turns)
    tok = copy.copy(qwen)
    tok.chat_template = QWEN_TOOL_TEMPLATE
    stripped = "message.content.split('</think>')[-1]"
    for t in turns:
        tok.chat_template = tok.chat_template.replace(t, t.replace("message.content", stripped))
    qwen_plain = copy.copy(qwen)
    qwen_plain.chat_template = QWEN_TOOL_TEMPLATE
    assert appends_tool_turns(qwen_plain) and not appends_tool_turns(tok)
    assert ToolEnvironment(tok, [add], "chat", 2, CountingRunner([add])).rerenders
