"""Step 1 of the RL loop (`cispo.training.rl_step`): sample P prompts x G responses with the policy
(``cispo.rollout``), score them, and refill while dynamic sampling drops groups whose rewards are all
equal (``cispo.data.prompts.fill_groups``); ScaleRL's No-Positive-Resampling retires solved prompts.
The held-out evaluation (``cispo.training.evaluation``) samples through `sample_groups` too.

With an environment (``policy.environment``, ``cispo.envs``) each response is an episode: the
policy's segments and the environment's observations, the latter masked out of training (``env_mask``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import groupby

import torch

from cispo.data.prompts import PromptStream, fill_groups
from cispo.data.rewards import score_completions, shaped_reward
from cispo.envs.episodes import opened_sample
from cispo.envs.rows import batch_rows, sample_episode_rows
from cispo.envs.tools import ToolSpecError
from cispo.foundations.distributed import DistInfo, any_rank, is_sharded
from cispo.foundations.experience import Completion
from cispo.models.policy import Policy
from cispo.rollout import SamplingConfig
from cispo.training.credit import informative_test


@dataclass(frozen=True)
class Scoring:
    """How sampled responses are scored: ``reward_fn`` (the task's reward; user rewards run in worker
    processes, each call killed past ``timeout_s``, ``data.reward_timeout_s``), then DAPO's overlong penalty
    over the last ``overlong_buffer`` tokens of the budget (``rollout.overlong_buffer``, None: off) on
    ``overlong_scope``'s answers (`cispo.data.rewards.shaped_reward`)."""

    reward_fn: Callable
    timeout_s: float | None = None
    overlong_buffer: int | None = None
    overlong_scope: str = "all"
    policy_text: bool = False
    """The reward reads the policy's own text (`policy_text`: the environment's tokens taken out by ``env_mask``)
    instead of the transcript (a task's ``scores_policy_text``: ``wordmath_calc``, whose calculator results
    must never state, hedge or restate an answer for the policy)."""


def sample_groups(policy: Policy, samples: list[dict], group_size: int, sampling: SamplingConfig, scoring: Scoring,
                  generator: torch.Generator) -> list[list[Completion]]:
    """G responses to each sample's prompt, decoded and scored by ``scoring``, the whole batch at once
    (`cispo.data.rewards.score_completions`; several rewards summed with their weights). A reward that fails
    scores 0 and the failure is recorded on the completion (``reward_error``), with each reward's
    value (``reward_parts``) and the numbers the calls reported (``reward_extras``).

    With an environment (``policy.environment``) each response is an episode: the policy's segments and
    the environment's observations (``env_mask``), recorded on the completion (``episode``); the reward
    reads the whole transcript, or with ``scoring.policy_text`` the policy's own text (`policy_text`, kept as
    ``scored_text``), the overlong penalty the policy's tokens. An episode a context rewrote runs over several
    training rows (``cispo.envs.rows``; `Completion.continuations`): its text is its rows' responses' texts
    joined, in order, and the overlong penalty reads its last row (the one a budget can cut). The prompt is
    rendered, and the reward called, with the sample as the episodes opened it (`opened_groups`); each
    completion's ``sample`` is still the data set's row itself, the stream's object (a checkpoint's held batch
    keeps its index, `retire_solved` retires it)."""
    episodes = None if policy.environment is None else \
        policy.environment.start([s for s in samples for _ in range(group_size)])
    rows_of = samples  # the data set rows: each completion's ``sample``, even where an opening changed a copy
    if episodes is not None:
        samples = opened_groups(samples, episodes.openings, group_size)
    prompt_ids = [policy.encode(s) for s in samples]
    rows = [ids for ids in prompt_ids for _ in range(group_size)]
    if episodes is None:
        sampled = [[r] for r in batch_rows(policy.sampler.generate(rows, sampling, generator=generator), rows)]
    else:  # an episode may run over several training rows (a context that rewrote its history)
        encode = (lambda messages: policy.encode({"messages": messages})) if policy.chat_template else None
        sampled = sample_episode_rows(policy.sampler, rows, sampling, generator, episodes, encode)
    texts = [[policy.tokenizer.decode(r.response_ids, skip_special_tokens=True) for r in ep] for ep in sampled]
    own = [[policy_text(policy.tokenizer, r.response_ids, r.env_mask) for r in ep]
           if scoring.policy_text and ep[0].env_mask is not None else None for ep in sampled]  # None: reads texts
    calls = [(samples[i // group_size]["prompt"], "".join(texts[i] if own[i] is None else own[i]),
              {k: v for k, v in samples[i // group_size].items() if k != "prompt"}) for i in range(len(rows))]
    scored = score_completions(scoring.reward_fn, calls, scoring.timeout_s)  # [Scored(task reward, error, ...)]   [B]
    groups: list[list[Completion]] = []
    for g, origin in enumerate(rows_of):
        group = []
        for i in range(g * group_size, (g + 1) * group_size):
            task_reward, error, parts, extras = scored[i]
            first, more = sampled[i][0], sampled[i][1:]
            record = None if episodes is None else episodes.record(i, fed=_fed([r.env_mask for r in sampled[i]]))
            c = Completion(origin, prompt_ids[g], first.response_ids, first.logp_rollout, sampled[i][-1].finish_reason,
                           "".join(texts[i]), task_reward, 0.0, error, parts, extras, first.env_mask, record,
                           None if own[i] is None else "".join(own[i]),
                           [Completion(origin, r.prompt_ids, r.response_ids, r.logp_rollout, r.finish_reason, text,
                                       env_mask=r.env_mask) for r, text in zip(more, texts[i][1:])])
            c.reward = shaped_reward(task_reward, c.rows[-1].policy_length, sampling.max_new_tokens,
                                     scoring.overlong_buffer, scoring.overlong_scope)
            group.append(c)
        groups.append(group)
    return groups


def opened_groups(samples: list[dict], openings: list, group_size: int) -> list[dict]:
    """Each group's sample as its episodes opened it (``cispo.envs.episodes.opened_sample`` of each row's
    ``Env.reset``). The G episodes of one prompt must open alike: their prompt is shared (one prefill, one
    group baseline), so an environment seeds any randomness of its opening from the sample. `ToolSpecError`
    (one line, naming ``data.environment``) where they do not, or where a reset returned no kind of opening."""
    out = []
    for g, sample in enumerate(samples):
        try:
            opened = [opened_sample(sample, o) for o in openings[g * group_size: (g + 1) * group_size]]
        except TypeError as e:
            raise ToolSpecError(f"data.environment: {e}") from None
        if any(o != opened[0] for o in opened[1:]):
            raise ToolSpecError("data.environment: reset opened the episodes of one prompt differently; they share "
                                "the prompt (and its group's baseline): seed any randomness of reset from the sample")
        out.append(opened[0])
    return out


def policy_text(tokenizer, response_ids: torch.Tensor, env_mask: torch.Tensor) -> str:
    """What the policy wrote in a response: each run of its own tokens (``env_mask`` 0) decoded on its own
    (special tokens removed) and the runs joined, the environment's tokens (``env_mask`` 1) left out. The
    mask says whose a token is, so nothing the policy writes can pass for the environment's or hide its own
    words as an observation: ``</calc`` + a special token + ``>`` reads ``</calc>`` but made no call, and
    a ``<result>`` it writes after it stays its own text.   # response_ids, env_mask: [T_i]"""
    if response_ids.shape != env_mask.shape:
        raise ValueError(f"env_mask {tuple(env_mask.shape)} does not match the response {tuple(response_ids.shape)}")
    runs = groupby(zip(response_ids.tolist(), env_mask.tolist()), key=lambda pair: pair[1] == 0)
    return "".join(tokenizer.decode([i for i, _ in run], skip_special_tokens=True) for mine, run in runs if mine)


def _fed(env_masks: list) -> int | None:
    """The observation ids an episode's rows were fed (their ``env_mask``s' sum; None without one): what its
    record shows."""
    return None if env_masks[0] is None else int(sum(m.sum() for m in env_masks))


@dataclass
class StepRollout:
    """A step's sampling: the informative ``groups`` it keeps, the refill's ``report``, every reward
    call's error, and every group ``sampled``, kept or dropped (empty in a batch held by a checkpoint
    written before they were kept: the kept ``groups`` stand for them)."""

    groups: list[list[Completion]]
    report: object
    errors: list[str]
    sampled: list[list[Completion]]


@dataclass
class StepSampler:
    """What step 1 samples from: this rank's prompt ``stream``, the ``task`` (its reward), the run's config,
    the ``sampling`` settings and the ``generator`` of the draws (``dist_info``: this rank of how many)."""

    stream: PromptStream
    task: object
    cfg: object
    sampling: SamplingConfig
    generator: torch.Generator
    dist_info: DistInfo = DistInfo()

    @property
    def scoring(self) -> Scoring:
        cfg = self.cfg
        return Scoring(self.task.reward, cfg.data.reward_timeout_s, cfg.rollout.overlong_buffer,
                       cfg.rollout.overlong_scope, self.task.scores_policy_text)

    def sample(self, policy: Policy) -> StepRollout:
        """This rank's ``prompts_per_step / world_size`` groups from ``policy``, sampled and scored, refilled
        while dynamic sampling drops uninformative ones (``cispo.data.prompts.fill_groups``; the test follows
        ``algo.turn_credit``, `cispo.training.credit.informative_test`); solved prompts retired
        (``data.retire_pass_rate``). Every group sampled, kept or dropped, is kept in ``sampled``: the step's
        rollout metrics and ``samples.jsonl`` read them."""
        cfg, scoring = self.cfg, self.scoring
        errors: list[str] = []
        sampled: list = []

        def generate(samples):
            groups = sample_groups(policy, samples, cfg.rollout.group_size, self.sampling, scoring, self.generator)
            errors.extend(c.reward_error for g in groups for c in g if c.reward_error)
            retire_solved(self.stream, groups, cfg.data.retire_pass_rate)
            sampled.extend(groups)
            return groups

        groups, report = fill_groups(
            self.stream.take,
            generate,
            informative_test(cfg.algo.turn_credit),
            cfg.rollout.prompts_per_step // self.dist_info.world_size,
            cfg.rollout.max_sampling_rounds,
            filter_groups=cfg.rollout.dynamic_sampling,
            **sharded_sampling(policy, self.sampling, self.dist_info),
        )
        return StepRollout(groups, report, errors, sampled)


def retire_solved(stream: PromptStream, groups, pass_rate: float | None) -> None:
    """ScaleRL's No-Positive-Resampling: retire from ``stream`` each prompt whose group's mean task reward
    reached ``pass_rate`` (``data.retire_pass_rate``; None: nothing)."""
    if pass_rate is None:
        return
    for group in groups:
        if sum(c.task_reward for c in group) / len(group) >= pass_rate:
            stream.retire(group[0].sample)


def sharded_sampling(policy: Policy, sampling: SamplingConfig, dist_info: DistInfo) -> dict:
    """``fill_groups``' arguments for weights sharded across ranks (FSDP): every rank takes
    part in every generation round, a rank with enough groups with a throw-away greedy one."""
    if not (dist_info.enabled and is_sharded(policy.model)):
        return {}
    greedy = SamplingConfig(max_new_tokens=sampling.max_new_tokens, temperature=0.0)
    return {"any_rank": lambda flag: any_rank(flag, dist_info),
            "idle": lambda: policy.sampler.generate([[policy.eos_id]], greedy)}
