"""The trainer: one generation batch in, the policy updated K times, the step's training metrics out.

One step (MiniMax-M1 section 3; DAPO for dynamic sampling), given the groups the sampler kept
(`cispo.training.rl_step` samples them):

    1. the advantages (``cispo.training.credit``: group-relative over each episode's return, or per turn
       under ``algo.turn_credit=reward_to_go``), the batch as padded tensors;
    2. log pi_old of every response token, from the run's `LogpOldSource` (`cispo.training.logp_old`:
       the trainer's pass in train mode, the first update's own forward where that is exact, or the
       sampler's log-probs); with a KL penalty (``kl_coef > 0``) log pi_ref of the frozen reference
       model; with a rollout correction (``algo.tis_cap``, ``algo.rollout_is``) the weights of
       pi_old / pi_rollout on each token's advantage;
    3. the batch split into K mini-batches (``cispo.training.batching``), each one optimizer step on the
       unified objective (``cispo.objective.loss``) normalised by the mini-batch's global token count,
       run as length-sorted micro-batches (``cispo.training.gradients``);
    4. the updates' metrics (``cispo.training.metrics``), and the probes' (`cispo.training.probes`).

Under data parallelism each rank holds its own rows: counts and ``batch-std``'s scale are global and
gradients are summed over ranks, so an update equals the single-process update on the union of the rows.
"""

from __future__ import annotations

import time
from functools import partial

import torch

from cispo.foundations.distributed import DistInfo, all_reduce_sum, sum_gradients
from cispo.foundations.experience import Completion, Experience, collate
from cispo.models.policy import Policy, policy_logprobs
from cispo.objective.advantages import batch_std, group_advantages, raw_std
from cispo.objective.loss import ObjectiveConfig
from cispo.rollout import rollout_is_weights
from cispo.training.batching import micro_batches, minibatches, row_order
from cispo.training.credit import batch_advantages, rows_per_episode, training_rows
from cispo.training.gradients import (
    Counts,
    empty_experience,
    idle_pass,
    idle_passes,
    lr_at,
    merge_stats,
    micro_batch_loss,
    optimizer_step,
)
from cispo.training.logp_old import logp_old_source, reference_logprobs, rollout_correction
from cispo.training.metrics import update_metrics
from cispo.training.probes import Probe


class Trainer:
    """The policy's updates, built once per run: ``step(groups) -> (batch, metrics)``; ``state_dict()`` /
    ``load_state_dict()`` for the checkpoint (the optimizer-step count and float16's loss scale).

    ``generator`` draws the mini-batches' row order; ``dist_info`` is this process's rank under torchrun.
    Where log pi_old comes from is decided here, once (`cispo.training.logp_old.logp_old_source`)."""

    def __init__(self, policy: Policy, optimizer: torch.optim.Optimizer, objective: ObjectiveConfig, cfg,
                 generator: torch.Generator, dist_info: DistInfo = DistInfo()) -> None:
        self.policy, self.optimizer, self.objective, self.cfg = policy, optimizer, objective, cfg
        self.generator, self.dist_info = generator, dist_info
        self.logp_old = logp_old_source(cfg, policy)
        self.probes: list[Probe] = []
        self.update_count = 0  # optimizer steps taken (skipped ones not counted)

    def add_probe(self, probe: Probe) -> None:
        """Measure with ``probe`` from the next step on (`cispo.training.probes`)."""
        self.probes.append(probe)

    # ----------------------------------------------------------------------------- the checkpoint

    def state_dict(self) -> dict:
        """``update_count``, and float16's loss scaler where there is one (a resume continues with its scale)."""
        state = {"update_count": self.update_count}
        if self.policy.grad_scaler is not None:
            state["grad_scaler"] = self.policy.grad_scaler.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        self.update_count = state["update_count"]
        if self.policy.grad_scaler is not None and "grad_scaler" in state:
            self.policy.grad_scaler.load_state_dict(state["grad_scaler"])

    # ----------------------------------------------------------------------------- one step

    def step(self, groups: list[list[Completion]]) -> tuple[Experience | None, dict]:
        """Steps 1-4 of the module docstring on this rank's kept ``groups``. Returns the batch (None when
        there was nothing to train on: no group here and no other rank to join) and the training metrics."""
        before, t0 = self.update_count, time.perf_counter()
        if not groups and not self.dist_info.enabled:
            return None, {"optim/updates": float(self.update_count), "optim/step_updates": 0.0}
        exp, first_order, correction = self.prepare(groups)
        t1 = time.perf_counter()
        stats = self.update(exp, first_order)
        t2 = time.perf_counter()
        metrics = update_metrics(stats) if stats else {}
        if groups:
            metrics.update(self.logp_old.metrics(exp))  # the sampler's logp_old: the mismatch the first update saw
            if correction is not None:  # rollout/is_weight_mean, is_masked, is_truncated
                metrics.update(correction.metrics(exp.response_mask))
        for probe in self.probes:
            metrics.update(probe.on_step(exp))
        tokens = float(exp.response_mask.sum())
        metrics.update({
            "optim/lr": lr_at(self.update_count - 1, self.cfg.optim),
            "optim/updates": float(self.update_count),
            "optim/step_updates": float(self.update_count - before),  # 0: this step changed nothing
            "perf/logp_old_s": t1 - t0,
            "perf/update_s": t2 - t1,
            "perf/tokens_per_s": tokens * (self.cfg.algo.epochs + self.logp_old.passes) / max(t2 - t0, 1e-9),
        })
        return exp, metrics

    def prepare(self, groups: list[list[Completion]]):
        """Steps 1-2: the batch with its advantages and log pi_old (and a rollout correction's weights in
        ``extras["tis"]``). Returns ``(exp, first_order, correction)``: the first epoch's row order, drawn here
        so the pass can run the first mini-batch as the first update will, and the correction
        (`cispo.rollout.correction.RolloutWeights`, for its metrics) or None."""
        cfg, G = self.cfg, self.cfg.rollout.group_size
        exp = self.experience(groups) if groups else empty_experience(self.policy)
        for probe in self.probes:
            probe.on_batch(exp)
        if cfg.rollout.vllm_sleep:  # free the inference engine's memory for the updates (no-op for torch)
            self.policy.sampler.sleep()
        first_order = row_order(len(exp), G, cfg.algo, self.generator, exp.extras.get("group_of")).to(
            exp.input_ids.device)
        first_rows = minibatches(first_order, cfg.algo, self.full_rows, self.kept_rows(exp))[0]
        exp.logp_old = self.compute_logp_old(exp, first_rows)
        settings, correction = rollout_correction(cfg.algo), None
        if settings is not None:  # the trainer's pi_old vs the sampler's own probabilities: c_it   [B, T]
            correction = rollout_is_weights(exp.logp_old, exp.logp_rollout, exp.response_mask, **settings)
            exp.extras["tis"] = correction.weight
        return exp, first_order, correction

    def experience(self, groups: list[list[Completion]]) -> Experience:
        """The advantages (``algo.turn_credit``, `cispo.training.credit.batch_advantages`: group-relative over
        the returns, ``batch-std`` over every rank's rows, or per policy segment), then padded tensors on the
        policy's device, with each row's group mean response length in ``extras["group_mean_length"]``
        (``prompt-mean-token-mean``). One row per training row (`cispo.training.credit.training_rows`): an
        episode a context rewrote has several, each with the episode's advantage and its group's mean length
        (|o_i| the episode's policy tokens, over all its rows), and ``extras["group_of"]`` then says each row's
        group (``minibatch_order=by_group``)."""
        G = self.cfg.rollout.group_size
        advantages = batch_advantages(groups, self.cfg.algo, self.advantage_scale(groups))  # A_i [B] or A_it [B, T]
        exp = collate(training_rows(groups), advantages, self.policy.pad_id).to(self.policy.device)
        counts = rows_per_episode(groups)  # [N]
        if bool((counts == 1).all()):
            lengths = exp.response_mask.sum(-1).reshape(-1, G)  # |o_i|   [num_groups, G]
            exp.extras["group_mean_length"] = lengths.mean(-1).repeat_interleave(G)  # Lbar_g(i)   [B]
            return exp
        lengths = torch.tensor([float(c.policy_length) for g in groups for c in g]).reshape(-1, G)  # [num_groups, G]
        group_rows = counts.reshape(-1, G).sum(-1)  # [num_groups]
        device = exp.input_ids.device
        exp.extras["group_mean_length"] = lengths.mean(-1).repeat_interleave(group_rows).to(device)  # [B]
        exp.extras["group_of"] = torch.arange(len(groups)).repeat_interleave(group_rows).to(device)  # [B]
        return exp

    def advantage_scale(self, groups: list[list[Completion]]) -> torch.Tensor | None:
        """Under data parallelism with ``batch-std`` / ``batch-raw-std`` advantages, std_batch / std_raw over
        every rank's scored rows (each rank joins the sum, also one that kept no group); else None
        (`group_advantages` takes its own batch's)."""
        G, dist_info, estimator = self.cfg.rollout.group_size, self.dist_info, self.cfg.algo.advantage_estimator
        if estimator not in ("batch-std", "batch-raw-std") or not dist_info.enabled:
            return None
        rewards = torch.tensor([c.episode_return for group in groups for c in group])  # R_k   [B]
        if estimator == "batch-std":  # Ahat_k (0 where not scored)
            values = (group_advantages(rewards, G, "drgrpo") if groups else rewards).double()
        else:
            values = rewards[~rewards.isnan()].double()  # the scored R_k
        n = float((~rewards.isnan()).sum())
        sums = torch.stack([values.sum(), values.square().sum(), torch.tensor(n, dtype=torch.float64)])
        sums = all_reduce_sum(sums.to(self.policy.device), dist_info).cpu()  # sum, sum of squares, N   over ranks
        return batch_std(sums[1], sums[2]) if estimator == "batch-std" else raw_std(sums[0], sums[1], sums[2])

    @torch.no_grad()
    def compute_logp_old(self, exp: Experience, first_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Log pi_old of every response token, in train mode, once per generation batch, from the run's source
        (`LogpOldSource`). Also stores the per-token entropy in ``exp.extras["entropy"]`` and, with a reference
        model, log pi_ref in ``exp.extras["logp_ref"]`` (same micro-batches).  -> [B, T]

        ``first_rows``: the rows of the first update's mini-batch, run as the micro-batches that update will use
        (a row's log-prob depends on its micro-batch's shape by float rounding), the other rows as micro-batches
        of their own; the source decides which of them the policy runs here (pi_ref is computed for all)."""
        policy, cfg = self.policy, self.cfg
        policy.model.train()
        T = exp.response_mask.shape[1]
        logp_old, entropy = torch.zeros_like(exp.logp_rollout), torch.zeros_like(exp.logp_rollout)
        micro = partial(micro_batches, exp, algo=cfg.algo, share=policy.share_prompts)
        all_rows = torch.arange(len(exp), device=exp.input_ids.device)
        first = [] if first_rows is None else micro(first_rows)
        rest = micro(all_rows if first_rows is None else all_rows[~torch.isin(all_rows, first_rows)])
        policy_micros = self.logp_old.pass_micro_batches(first, rest)
        for _ in range(idle_passes(len(policy_micros), policy, self.dist_info)):
            idle_pass(policy, cfg, backward=False)
        for rows in policy_micros:
            sub = exp.select(rows)
            with policy.compute():
                lp, ent = policy_logprobs(policy.model, sub, cfg.rollout.temperature, cfg.model.fp32_lm_head, True,
                                          body=policy.train_body, share_prompts=policy.share_prompts)
            logp_old[rows, : lp.shape[1]] = lp.float()
            entropy[rows, : lp.shape[1]] = ent.float()
        exp.extras["entropy"] = entropy * exp.response_mask
        if policy.ref_model is not None:
            logp_ref = torch.zeros_like(exp.logp_rollout)
            for rows in first + rest:
                sub = exp.select(rows)
                logp_ref[rows, : sub.response_mask.shape[1]] = reference_logprobs(policy, sub, cfg)
            exp.extras["logp_ref"] = logp_ref[:, :T] * exp.response_mask
        self.logp_old.after_pass(exp)
        return self.logp_old.logp_old(exp, logp_old)

    # ----------------------------------------------------------------------------- the K updates

    def update(self, exp: Experience, first_order: torch.Tensor | None = None) -> list[dict]:
        """K optimizer steps (per epoch) on random mini-batches of ``exp``; returns each optimizer step's
        statistics. ``first_order``: the first epoch's row order, drawn by `prepare` before its pass, whose
        first mini-batch's forward then supplies the log pi_old the source left to it (`LogpOldSource.supply`);
        None: ``exp.logp_old`` is complete and every order is drawn here."""
        cfg, device = self.cfg, exp.input_ids.device
        self.policy.model.train()
        kept = self.kept_rows(exp)
        stats = []
        for epoch in range(cfg.algo.epochs):
            order = first_order if epoch == 0 and first_order is not None else \
                row_order(len(exp), cfg.rollout.group_size, cfg.algo, self.generator,
                          exp.extras.get("group_of")).to(device)
            for k, rows in enumerate(minibatches(order, cfg.algo, self.full_rows, kept)):
                supplies = first_order is not None and epoch == 0 and k == 0 and self.logp_old.first_update_supplies
                step = self.minibatch_step(exp, rows, supplies)
                if step is not None:
                    stats.append(step)
        return stats

    def minibatch_step(self, exp: Experience, rows: torch.Tensor, supplies: bool) -> dict | None:
        """One optimizer step on the mini-batch ``rows`` (all ranks' counts): its gradient accumulated over its
        micro-batches, summed over ranks, clipped, applied. Returns its statistics (None: this rank ran no
        micro-batch, or the mini-batch is empty on every rank)."""
        mask = exp.response_mask[rows]  # [b, T]
        counts = Counts(all_reduce_sum(mask.sum(), self.dist_info),  # sum_i |o_i|, whole mini-batch
                        all_reduce_sum((mask.sum(-1) > 0).sum(), self.dist_info))
        if counts.num_tokens == 0:  # an empty mini-batch on every rank
            return None
        self.optimizer.zero_grad(set_to_none=True)
        parts = self.accumulate_gradients(exp, rows, counts, supplies)
        params = [p for p in self.policy.model.parameters() if p.requires_grad]
        sum_gradients(params, self.dist_info)
        grad_norm, finite, scale = optimizer_step(self.policy, self.optimizer, params, self.cfg.optim,
                                                  self.update_count)
        self.update_count += int(finite)
        for probe in self.probes:
            probe.on_update()
        if not parts:
            return None
        out = merge_stats(parts, float(grad_norm), finite)
        if scale is not None:
            out["loss_scale"] = scale
        return out

    def accumulate_gradients(self, exp: Experience, rows: torch.Tensor, counts: Counts, supplies: bool) -> list:
        """One mini-batch's gradient, accumulated over its micro-batches (``micro_batches``), each loss normalised
        by the whole mini-batch's ``counts``; ranks with fewer micro-batches run idle passes so every rank joins
        each collective. Returns each micro-batch's ``ObjectiveStats``."""
        policy, parts = self.policy, []
        micros = micro_batches(exp, rows, self.cfg.algo, policy.share_prompts)
        for _ in range(idle_passes(len(micros), policy, self.dist_info)):
            idle_pass(policy, self.cfg, backward=True)
        for micro in micros:  # the same gradient whatever the split
            sub = exp.select(micro)
            supply = partial(self.logp_old.supply, exp, micro) if supplies else None
            loss, stats = micro_batch_loss(policy, sub, self.objective, self.cfg, counts, supply)
            policy.scaled(loss).backward()
            for probe in self.probes:
                probe.on_micro_batch(exp, micro, sub, stats)
            parts.append(stats)
        return parts

    @property
    def full_rows(self) -> int:
        """Rows of a full generation batch over every rank: prompts_per_step x group_size."""
        return self.cfg.rollout.prompts_per_step * self.cfg.rollout.group_size

    def kept_rows(self, exp: Experience) -> int:
        """Rows this step kept, summed over ranks."""
        return int(all_reduce_sum(torch.tensor(len(exp), device=exp.input_ids.device), self.dist_info))
