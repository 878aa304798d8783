"""The RL loop: sample groups, score, filter, compute advantages, update K times.

One step (MiniMax-M1 section 3; DAPO for dynamic sampling and the overlong penalty):

    1. sample P prompts x G responses with the policy (``cispo.rollout``), score them;
       drop groups whose rewards are all equal and sample more (dynamic sampling);
    2. group-relative advantages (``cispo.advantages``);
    3. log pi_old of every response token, recomputed once in train mode (``logp_old``;
       dropout is off unless ``model.dropout``, so this is the sampler's distribution);
       the sampler's own log-probs are kept to measure the train / rollout mismatch;
    4. split the batch into K mini-batches; for each, one optimizer step on the unified
       objective (``cispo.objective``), normalised by the mini-batch's global token count;
    5. metrics, periodic held-out evaluation, checkpoints.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from cispo.advantages import group_advantages
from cispo.data import FillReport, PromptStream, fill_groups
from cispo.distributed import DistInfo, all_reduce_sum, any_rank, is_sharded, max_over_ranks, sum_gradients
from cispo.experience import (Completion, Experience, collate, is_informative, length_micro_batches, pearson,
                              policy_logprobs)
from cispo.objective import ObjectiveConfig, log_ratio, policy_loss, ppo_token_mask, preset
from cispo.rewards import overlong_penalty, score_rewards
from cispo.rollout import Sampler, SamplingConfig, truncated_is_weights
from cispo.samples import add_token_counts, start_token_counts


@dataclass
class Policy:
    """The model being trained, its tokenizer and its sampler."""

    model: torch.nn.Module
    tokenizer: object
    sampler: Sampler
    device: torch.device
    chat_template: bool = False
    autocast: torch.dtype | None = None  # mixed precision: compute dtype over FP32 master weights

    def compute(self):
        """The context of every forward pass: ``torch.autocast`` in ``autocast``, or nothing."""
        return torch.autocast(self.device.type, dtype=self.autocast, enabled=self.autocast is not None)

    def encode(self, sample: dict) -> list[int]:
        """Prompt token ids: the raw prompt, or its chat messages in the chat template."""
        if self.chat_template:
            messages = sample.get("messages") or [{"role": "user", "content": sample["prompt"]}]
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        return self.tokenizer.encode(sample["prompt"], add_special_tokens=True)

    @property
    def pad_id(self) -> int:
        return self.tokenizer.pad_token_id

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_token_id


# ---------------------------------------------------------------------------------------
# 1. Rollout and rewards
# ---------------------------------------------------------------------------------------


def sample_groups(
    policy: Policy,
    samples: list[dict],
    group_size: int,
    sampling: SamplingConfig,
    reward_fn,
    generator: torch.Generator,
    overlong_buffer: int | None = None,
    reward_timeout_s: float | None = None,
) -> list[list[Completion]]:
    """G responses to each sample's prompt, decoded and scored, the whole batch at once
    (`cispo.rewards.score_rewards`: user rewards in worker processes, each call killed past
    ``reward_timeout_s``). A reward that fails scores 0 and the failure is recorded on the
    completion (``reward_error``)."""
    prompt_ids = [policy.encode(s) for s in samples]
    rows = [ids for ids in prompt_ids for _ in range(group_size)]
    batch = policy.sampler.generate(rows, sampling, generator=generator)
    lengths = batch.response_lengths.tolist()
    response_ids = [batch.response_ids[i, : lengths[i]].cpu() for i in range(len(rows))]
    texts = [policy.tokenizer.decode(ids, skip_special_tokens=True) for ids in response_ids]
    calls = [(samples[i // group_size]["prompt"], texts[i],
              {k: v for k, v in samples[i // group_size].items() if k != "prompt"}) for i in range(len(rows))]
    scored = score_rewards(reward_fn, calls, reward_timeout_s)  # [(task reward, error)]   [B]
    groups: list[list[Completion]] = []
    for g, sample in enumerate(samples):
        group = []
        for i in range(g * group_size, (g + 1) * group_size):
            task_reward, error = scored[i]
            reward = task_reward
            if overlong_buffer:
                reward += overlong_penalty(lengths[i], sampling.max_new_tokens, overlong_buffer)
            group.append(
                Completion(sample, prompt_ids[g], response_ids[i], batch.logp_rollout[i, : lengths[i]].cpu(),
                           batch.finish_reason[i], texts[i], task_reward, reward, error)
            )
        groups.append(group)
    return groups


def build_experience(groups: list[list[Completion]], cfg, policy: Policy) -> Experience:
    """Group-relative advantages, then padded tensors on the policy's device."""
    flat = [c for group in groups for c in group]
    rewards = torch.tensor([c.reward for c in flat])  # R_i   [B]
    advantages = group_advantages(rewards, cfg.rollout.group_size, cfg.algo.advantage_estimator)  # A_i   [B]
    return collate(flat, advantages, policy.pad_id).to(policy.device)


# ---------------------------------------------------------------------------------------
# 3. logp_old, 4. the K updates
# ---------------------------------------------------------------------------------------


def micro_batches(exp: Experience, rows: torch.Tensor, cfg) -> list[torch.Tensor]:
    """The forward/backward calls over ``rows`` of ``exp``: length-sorted micro-batches cut where
    a cut saves more than ``algo.micro_batch_split_cost`` padded positions, each of at most
    ``algo.micro_batch_size`` rows; with the split cost None, consecutive chunks of
    ``micro_batch_size`` rows (all of them when None); [] when ``rows`` is empty."""
    size, split_cost = cfg.algo.micro_batch_size, cfg.algo.micro_batch_split_cost
    if len(rows) == 0:
        return []
    if split_cost is None:
        return [rows] if not size else list(rows.split(size))
    return length_micro_batches(exp, rows, size, split_cost)


@torch.no_grad()
def compute_logp_old(policy: Policy, exp: Experience, cfg, dist_info: DistInfo = DistInfo()) -> torch.Tensor:
    """log pi_old of every response token, in train mode, once per generation batch. Also
    stores the per-token entropy in ``exp.extras["entropy"]``.  -> [B, T]"""
    policy.model.train()
    T = exp.response_mask.shape[1]
    logp_old = torch.zeros_like(exp.logp_rollout)
    entropy = torch.zeros_like(exp.logp_rollout)
    micros = micro_batches(exp, torch.arange(len(exp), device=exp.input_ids.device), cfg)
    for _ in range(idle_passes(len(micros), policy, dist_info)):
        idle_pass(policy, cfg, backward=False)
    for rows in micros:
        sub = exp.select(rows)
        with policy.compute():
            lp, ent = policy_logprobs(policy.model, sub, cfg.rollout.temperature, cfg.model.fp32_lm_head, True)
        t = lp.shape[1]
        logp_old[rows, :t] = lp.float()
        entropy[rows, :t] = ent.float()
    exp.extras["entropy"] = entropy * exp.response_mask
    return logp_old[:, :T] * exp.response_mask


def lr_at(update: int, cfg) -> float:
    """Linear warm-up to ``optim.lr`` over ``optim.warmup_updates`` optimizer steps, then flat."""
    warm = cfg.optim.warmup_updates
    return cfg.optim.lr * min(1.0, (update + 1) / warm) if warm > 0 else cfg.optim.lr


def update_policy(
    policy: Policy,
    optimizer: torch.optim.Optimizer,
    exp: Experience,
    obj: ObjectiveConfig,
    cfg,
    generator: torch.Generator,
    update_count: int,
    fork_ids: torch.Tensor | None,
    dist_info: DistInfo = DistInfo(),
) -> tuple[list[dict], int]:
    """K optimizer steps (per epoch) on random mini-batches of ``exp``. Returns the per-step
    stats and the new optimizer-step count.

    Each mini-batch runs as micro-batches (``micro_batches``: by default its rows sorted by
    length and cut into length-homogeneous parts, each trimmed to its own longest row); the
    objective is normalised by the whole mini-batch's token / sequence counts, so the summed
    gradient is that of the mini-batch in one piece (up to float summation order).

    Under data parallelism each rank splits its own rows into K parts; the objective is
    normalised by the mini-batch's global counts and gradients are summed over ranks, so
    the update equals the single-process update on the union of the ranks' rows."""
    policy.model.train()
    device = exp.input_ids.device
    params = [p for p in policy.model.parameters() if p.requires_grad]
    stats = []
    for _ in range(cfg.algo.epochs):
        order = torch.randperm(len(exp), generator=generator).to(device)
        for rows in order.tensor_split(cfg.algo.updates_per_batch):
            mask = exp.response_mask[rows]  # [b, T]
            num_tokens = all_reduce_sum(mask.sum(), dist_info)  # sum_i |o_i|, whole mini-batch
            num_seqs = all_reduce_sum((mask.sum(-1) > 0).sum(), dist_info)
            if num_tokens == 0:  # an empty mini-batch on every rank
                continue
            optimizer.zero_grad(set_to_none=True)
            parts = []
            micros = micro_batches(exp, rows, cfg)
            for _ in range(idle_passes(len(micros), policy, dist_info)):
                idle_pass(policy, cfg, backward=True)
            for micro in micros:  # the same gradient whatever the split
                sub = exp.select(micro)
                with policy.compute():
                    logp_new = policy_logprobs(policy.model, sub, cfg.rollout.temperature, cfg.model.fp32_lm_head)
                add_token_counts(exp, micro, sub, logp_new, obj)  # per-row counts for samples.jsonl
                advantages = sub.advantages  # [b]
                if "tis" in sub.extras:  # per-token truncated IS weight   [b, T]
                    advantages = advantages[:, None] * sub.extras["tis"][:, : sub.response_mask.shape[1]]
                loss, s = policy_loss(logp_new, sub.logp_old, advantages, sub.response_mask, obj,
                                      num_tokens=num_tokens, num_seqs=num_seqs)
                loss.backward()
                parts.append((s, fork_drop_counts(logp_new, sub, obj, fork_ids)))
            sum_gradients(params, dist_info)
            grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip or float("inf"))
            finite = bool(torch.isfinite(grad_norm))
            if finite:
                for group in optimizer.param_groups:
                    group["lr"] = lr_at(update_count, cfg)
                optimizer.step()
                update_count += 1
            optimizer.zero_grad(set_to_none=True)
            if parts:
                stats.append(merge_stats(parts, float(grad_norm), finite))
    return stats, update_count


@torch.no_grad()
def fork_drop_counts(logp_new, exp: Experience, obj: ObjectiveConfig,
                     fork_ids: torch.Tensor | None) -> tuple[int, int]:
    """(# fork tokens, # of them a PPO mask with obj's eps_low/eps_high would drop); a fork token
    is any of ``fork_ids`` (``fork_token_ids``)."""
    if fork_ids is None:
        return 0, 0
    is_fork = torch.isin(exp.response_ids, fork_ids.to(exp.response_ids.device)) & exp.response_mask.bool()  # [b, T]
    ratio = torch.exp(log_ratio(logp_new, exp.logp_old, exp.response_mask, obj.ratio_level, obj.max_log_ratio))
    A = exp.advantages[:, None].expand_as(ratio)
    dropped = (ppo_token_mask(ratio, A, obj.eps_low, obj.eps_high) == 0) & is_fork
    return int(is_fork.sum()), int(dropped.sum())


def merge_stats(parts, grad_norm: float, finite: bool) -> dict:
    """Token-weighted means of the micro-batches' ObjectiveStats for one optimizer step."""
    n = sum(s.num_tokens for s, _ in parts)
    n_low = sum(s.num_low_prob_tokens for s, _ in parts)
    w = lambda name: sum(getattr(s, name) * s.num_tokens for s, _ in parts) / max(n, 1)  # noqa: E731
    n_fork = sum(f[0] for _, f in parts)
    return {
        "loss": sum(s.loss for s, _ in parts),
        "pg_loss": sum(s.pg_loss for s, _ in parts),
        "frac_capped": w("frac_capped"),
        "frac_ppo_dropped": w("frac_ppo_dropped"),
        "frac_ppo_dropped_low_prob": sum(s.frac_ppo_dropped_low_prob * s.num_low_prob_tokens for s, _ in parts)
        / max(n_low, 1),
        "frac_ppo_dropped_fork": sum(f[1] for _, f in parts) / n_fork if n_fork else float("nan"),
        "ratio_mean": w("ratio_mean"),
        "ratio_min": min(s.ratio_min for s, _ in parts),
        "ratio_max": max(s.ratio_max for s, _ in parts),
        "approx_kl": w("approx_kl"),
        "grad_norm": grad_norm,
        "skipped": 0.0 if finite else 1.0,
    }


# ---------------------------------------------------------------------------------------
# Metrics of a step and the held-out evaluation
# ---------------------------------------------------------------------------------------


def rollout_metrics(groups, exp: Experience, report: FillReport, used_fork) -> dict:
    flat = [c for group in groups for c in group]
    mask = exp.response_mask.bool()
    lengths = torch.tensor([c.length for c in flat], dtype=torch.float)
    forked = [used_fork(c.text) for c in flat] if used_fork else []
    return {
        "rollout/reward_mean": sum(c.reward for c in flat) / len(flat),
        "rollout/accuracy": sum(c.task_reward for c in flat) / len(flat),
        "rollout/response_length": float(lengths.mean()),
        "rollout/response_length_max": float(lengths.max()),
        "rollout/fork_rate": sum(forked) / len(flat) if forked else float("nan"),
        "rollout/truncated": sum(c.finish_reason == "length" for c in flat) / len(flat),
        "rollout/repetition_stops": float(sum(c.finish_reason == "repetition" for c in flat)),
        "rollout/logp_corr": pearson(exp.logp_rollout[mask], exp.logp_old[mask]),
        "rollout/logp_abs_diff": float((exp.logp_rollout - exp.logp_old)[mask].abs().mean()),
        "rollout/rounds": float(report.rounds),
        "rollout/groups_sampled": float(report.groups_sampled),
        "rollout/groups_kept": float(report.groups_kept),
        "objective/entropy": float(exp.extras["entropy"][mask].mean()),
    }


def update_metrics(stats: list[dict]) -> dict:
    """Means over the step's optimizer steps (min / max for the ratio extremes)."""
    out = {}
    for key in stats[0]:
        values = [s[key] for s in stats if not (isinstance(s[key], float) and math.isnan(s[key]))]
        if key == "ratio_min":
            agg = min(values)
        elif key == "ratio_max":
            agg = max(values)
        elif key == "skipped":
            agg = sum(values)
        else:
            agg = sum(values) / len(values) if values else float("nan")
        out[f"objective/{key}" if key not in ("grad_norm", "skipped") else f"optim/{key}"] = agg
    return out


@torch.no_grad()
def evaluate(policy: Policy, samples: list[dict], reward_fn, used_fork, cfg, max_new_tokens: int, seed: int,
             answer_fn=None) -> dict:
    """Held-out accuracy: greedy, and over k samples per prompt the mean (avg@k), pass@k and
    maj@k (``group_accuracies``; ``answer_fn(completion)`` gives the answer maj@k votes on)."""
    if not samples:
        return {}
    generator = torch.Generator(device=policy.device).manual_seed(seed)
    greedy = SamplingConfig(max_new_tokens=max_new_tokens, temperature=0.0)
    sampled = SamplingConfig(max_new_tokens=max_new_tokens, temperature=cfg.eval.temperature)
    out, errors = {}, []
    for name, sampling, k in (("greedy", greedy, 1), ("sampled", sampled, cfg.eval.num_samples)):
        groups = []
        for start in range(0, len(samples), 256):
            groups += sample_groups(policy, samples[start : start + 256], k, sampling, reward_fn, generator,
                                    reward_timeout_s=cfg.data.reward_timeout_s)
        flat = [c for g in groups for c in g]
        acc = sum(c.task_reward for c in flat) / len(flat)
        errors += [c.reward_error for c in flat if c.reward_error]
        if name == "greedy":
            out["eval/accuracy_greedy"] = acc
            continue
        out[f"eval/accuracy_mean_at_{k}"] = acc
        out["eval/accuracy"] = acc
        out.update({f"eval/accuracy_{name}_at_{k}": v for name, v in group_accuracies(groups, answer_fn).items()})
        if used_fork:
            fork = [c for c in flat if used_fork(c.text)]
            rest = [c for c in flat if not used_fork(c.text)]
            out["eval/fork_rate"] = len(fork) / len(flat)
            out["eval/accuracy_with_fork"] = sum(c.task_reward for c in fork) / len(fork) if fork else float("nan")
            out["eval/accuracy_without_fork"] = sum(c.task_reward for c in rest) / len(rest) if rest else float("nan")
        out["eval/response_length"] = sum(c.length for c in flat) / len(flat)
    out["eval/reward_errors"] = float(len(errors))  # greedy and sampled calls together
    if errors:
        print(f"cispo: evaluation: {len(errors)} reward call(s) failed and scored 0 (first: {errors[0]})",
              file=sys.stderr)
    return out


def group_accuracies(groups: list[list[Completion]], answer_fn=None) -> dict[str, float]:
    """Over prompts (one group of k samples each), the mean of
    pass@k = max_j R_j (for 0/1 verifiers: at least one of the k is right), and
    maj@k  = R of the most frequent answer (``answer_fn(text)``, default the stripped text;
    None answers do not vote; a tie goes to the answer seen first; no answer at all: 0)."""
    answer_fn = answer_fn or str.strip
    pass_k, maj_k = [], []
    for group in groups:
        pass_k.append(max(c.task_reward for c in group))
        votes: dict[str, list[Completion]] = {}
        for c in group:
            answer = answer_fn(c.text)
            if answer is not None:
                votes.setdefault(answer, []).append(c)
        best = max(votes.values(), key=len, default=None)  # first of the largest: insertion order
        maj_k.append(best[0].task_reward if best else 0.0)
    n = max(len(groups), 1)
    return {"pass": sum(pass_k) / n, "maj": sum(maj_k) / n}


# ---------------------------------------------------------------------------------------
# One RL step
# ---------------------------------------------------------------------------------------


def rl_step(policy, optimizer, stream: PromptStream, task, cfg, obj, sampling, generators, update_count, fork_ids,
            dist_info: DistInfo = DistInfo(), on_samples=None):
    """Steps 1-4 of the module docstring. Returns (metrics, new optimizer-step count).
    Under data parallelism this rank's share is ``prompts_per_step / world_size`` groups.
    ``on_samples(groups, exp)``, if given, is called after the updates with this rank's batch
    (``exp.extras`` then holds the per-row counts of ``cispo.samples``)."""
    t0 = time.perf_counter()
    errors: list[str] = []

    def generate(samples):
        groups = sample_groups(policy, samples, cfg.rollout.group_size, sampling, task.reward, generators["sample"],
                               cfg.rollout.overlong_buffer, cfg.data.reward_timeout_s)
        errors.extend(c.reward_error for g in groups for c in g if c.reward_error)
        return groups

    groups, report = fill_groups(
        stream.take,
        generate,
        is_informative,
        cfg.rollout.prompts_per_step // dist_info.world_size,
        cfg.rollout.max_sampling_rounds,
        filter_groups=cfg.rollout.dynamic_sampling,
        **sharded_sampling(policy, sampling, dist_info),
    )
    if errors:
        print(f"cispo: {len(errors)} reward call(s) failed and scored 0 (first: {errors[0]})", file=sys.stderr)
    t1 = time.perf_counter()
    if not groups and not dist_info.enabled:  # every group uninformative, every round: nothing to learn
        return {"rollout/groups_kept": 0.0, "rollout/rounds": float(report.rounds), "optim/step_updates": 0.0,
                "optim/updates": float(update_count), "perf/step_s": t1 - t0,
                "rollout/reward_errors": float(len(errors))}, update_count
    if not groups:  # this rank has nothing, but it must join the other ranks' updates
        exp = empty_experience(policy)
    else:
        exp = build_experience(groups, cfg, policy)
        if on_samples is not None:
            start_token_counts(exp)
    if cfg.rollout.vllm_sleep and hasattr(policy.sampler, "sleep"):
        policy.sampler.sleep()
    exp.logp_old = compute_logp_old(policy, exp, cfg, dist_info)
    if cfg.algo.tis_cap:  # truncated IS: the trainer's pi_old vs the sampler's own probabilities
        exp.extras["tis"] = truncated_is_weights(exp.logp_old, exp.logp_rollout, exp.response_mask, cfg.algo.tis_cap)
    t2 = time.perf_counter()
    updates_before = update_count
    stats, update_count = update_policy(policy, optimizer, exp, obj, cfg, generators["shuffle"], update_count, fork_ids,
                                        dist_info)
    if hasattr(policy.sampler, "update_weights"):  # a separate inference engine samples the next batch
        policy.sampler.update_weights(policy.model)
    t3 = time.perf_counter()
    if on_samples is not None and groups:
        on_samples(groups, exp)
    tokens = float(exp.response_mask.sum())
    metrics = rollout_metrics(groups, exp, report, tracked_fork(task)) if groups else {}
    metrics["rollout/reward_errors"] = float(len(errors))
    if fork_ids is not None and groups:  # reflective tokens per response (several on the `chain` task)
        is_fork = torch.isin(exp.response_ids, fork_ids.to(exp.response_ids.device)) & exp.response_mask.bool()  # [b, T]
        metrics["rollout/fork_tokens_per_response"] = float(is_fork.sum()) / max(1, exp.response_ids.shape[0])
    if stats:
        metrics.update(update_metrics(stats))
    metrics.update({
        "optim/lr": lr_at(update_count - 1, cfg),
        "optim/updates": float(update_count),
        "optim/step_updates": float(update_count - updates_before),  # 0: this step changed nothing
        "perf/sample_s": t1 - t0,
        "perf/logp_old_s": t2 - t1,
        "perf/update_s": t3 - t2,
        "perf/step_s": t3 - t0,
        "perf/tokens_per_s": tokens * (1 + cfg.algo.epochs) / max(t3 - t1, 1e-9),
    })
    return metrics, update_count


def idle_passes(n: int, policy: Policy, dist_info: DistInfo) -> int:
    """With weights sharded across ranks (FSDP) every rank must run as many forward (and
    backward) passes as the busiest one: how many empty ones to add to this rank's ``n``."""
    if not (dist_info.enabled and is_sharded(policy.model)):
        return 0
    return max_over_ranks(n, dist_info) - n


def idle_pass(policy: Policy, cfg, backward: bool) -> None:
    """A forward (and backward) pass over one padding row with a zero loss: it joins the other
    ranks' FSDP collectives and adds nothing to the gradient."""
    ids = torch.full((1, 2), policy.pad_id, dtype=torch.long, device=policy.device)
    zero = torch.zeros(1, 1, device=policy.device)
    exp = Experience(ids, torch.ones_like(ids), zero, zero, zero[0], logp_old=zero)
    with policy.compute():
        logp = policy_logprobs(policy.model, exp, cfg.rollout.temperature, cfg.model.fp32_lm_head)
    if backward:
        (logp * 0).sum().backward()


def sharded_sampling(policy: Policy, sampling: SamplingConfig, dist_info: DistInfo) -> dict:
    """``fill_groups``' arguments for weights sharded across ranks (FSDP): every rank takes
    part in every generation round, a rank with enough groups with a throw-away greedy one."""
    if not (dist_info.enabled and is_sharded(policy.model)):
        return {}
    greedy = SamplingConfig(max_new_tokens=sampling.max_new_tokens, temperature=0.0)
    return {"any_rank": lambda flag: any_rank(flag, dist_info),
            "idle": lambda: policy.sampler.generate([[policy.eos_id]], greedy)}


def empty_experience(policy: Policy) -> Experience:
    """A batch of zero rows (a data-parallel rank whose groups were all dropped)."""
    z = torch.zeros(0, 1, device=policy.device)
    return Experience(z.long(), z.long(), z, z, torch.zeros(0, device=policy.device), logp_old=z)


def fit_prompts(policy: Policy, samples: list[dict], max_new_tokens: int, what: str) -> list[dict]:
    """The samples whose prompt plus ``max_new_tokens`` fits the model's context; the others
    are dropped with a note (an error when none is left)."""
    context = getattr(policy.model.config, "max_position_embeddings", None)
    if not context or not samples:
        return samples
    fits = [len(policy.encode(s)) + max_new_tokens <= context for s in samples]
    kept = [s for s, ok in zip(samples, fits) if ok]
    if len(kept) < len(samples):
        first = fits.index(False)
        msg = (f"{len(samples) - len(kept)} of {len(samples)} {what} prompts are longer than the context "
               f"({context} tokens) minus max_new_tokens={max_new_tokens} (first: #{first})")
        if not kept:
            raise ValueError(msg + "; nothing left to train on")
        print(f"cispo: skipping {msg}", file=sys.stderr)
    return kept


def make_objective(cfg) -> ObjectiveConfig:
    obj = preset(cfg.algo.objective, **cfg.algo.objective_overrides)
    if obj.aggregation == "seq-mean-token-sum-norm" and obj.token_sum_norm is None:
        # a constant normaliser keeps micro-batching exact: the longest possible response
        from dataclasses import replace

        obj = replace(obj, token_sum_norm=float(cfg.rollout.max_new_tokens))
    return obj


def make_optimizer(model, cfg) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=lr_at(0, cfg),
        betas=tuple(cfg.optim.betas),
        eps=cfg.optim.eps,
        weight_decay=cfg.optim.weight_decay,
    )


def fork_token_ids(tokenizer, task) -> torch.Tensor | None:
    """The vocabulary ids of the task's fork word: every token whose decoded text, stripped of
    surrounding whitespace, is the word (``Wait`` and ``ĠWait`` / ``▁Wait`` alike), so the fork
    is found wherever it occurs, sentence-initial or mid-sentence. None when the task tracks no
    fork word, or when no single token spells it (then a note says so)."""
    word = (getattr(task, "fork_token", None) or "").strip()
    if not word:
        return None
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    ids = [i for i, t in enumerate(texts) if t.strip() == word]
    if not ids:
        print(f"cispo: no token of the vocabulary spells the fork word {word!r}; "
              "objective/frac_ppo_dropped_fork is not tracked", file=sys.stderr)
        return None
    return torch.tensor(ids)


def tracked_fork(task):
    """``task.used_fork`` when the task names a fork word, else None (fork rates are then null,
    not 0)."""
    return task.used_fork if getattr(task, "fork_token", None) else None


def sampling_config(cfg, default_max_new_tokens: int) -> SamplingConfig:
    max_new = cfg.rollout.max_new_tokens or default_max_new_tokens
    rep = cfg.rollout.repetition_stop_tokens
    if rep is None:
        rep = max(1, (3 * max_new) // 4)
    return SamplingConfig(
        max_new_tokens=max_new,
        temperature=cfg.rollout.temperature,
        top_p=cfg.rollout.top_p,
        repetition_stop_tokens=rep or None,
        repetition_stop_prob=cfg.rollout.repetition_stop_prob,
    )


def default_max_new_tokens(task) -> int:
    return math.ceil(1.25 * task.max_new_tokens)


def as_path(p) -> Path:
    return Path(p).expanduser()
