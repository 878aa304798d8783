"""The ``algo:`` and ``optim:`` sections of the run's configuration: the objective (``algo.objective``:
a preset and any of its fields set otherwise) and the schedule of off-policy updates over a generation
batch, and the AdamW that takes each update (`cispo.config.train` gathers the sections)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from cispo.objective.presets import AGGREGATIONS, KL_ESTIMATORS, MASK_RULES, RATIO_LEVELS, ObjectiveConfig, preset

__all__ = ["AlgoConfig", "ObjectiveSection", "OptimConfig", "PRESET", "schedule_checks"]

PRESET = "preset"
"""The value of an ``algo.objective`` field that takes the preset's value (each field's default)."""


@dataclass
class ObjectiveSection:
    """The objective, MiniMax-M1 eq. 6: a preset (name), each field 'preset' (its value) or set otherwise.

    The fields are those of `cispo.objective.presets.ObjectiveConfig` (`cispo.objective.loss` computes the
    loss from them); 'preset' rather than None stands for the preset's value, so that None keeps its meaning
    there (no bound, off). ``cispo train objective=ppo`` (or ``algo.objective=ppo``, or ``objective: ppo`` in a
    file) sets ``name``; ``algo.objective.eps_high_is=2`` (or ``eps_high_is=2``) a field."""

    name: Literal["cispo", "ppo", "grpo", "dapo", "gspo", "reinforce", "cispo_lowmask", "cispo_highmask", "dppo_tv",
                  "dppo_kl"] = "cispo"
    """Objective preset: cispo, ppo, grpo, dapo, gspo, reinforce; cispo_lowmask / cispo_highmask (CISPO with
    the lower / upper half of DAPO's trust region); dppo_tv / dppo_kl (DPPO's trust region on the probability,
    verl's dppo_tv / dppo_kl, prime-rl's default loss). docs/objective.md lists each preset's fields."""
    ratio_level: Literal[(*RATIO_LEVELS, PRESET)] = PRESET
    """Unit of the IS ratio: ``token`` (r_it) or ``sequence`` (GSPO's length-normalised s_i)."""
    eps_low_is: float | None | Literal[PRESET] = PRESET
    """IS weight lower bound 1 - eps_low_is (eq. 5), >= 0. None: no lower bound (cispo's)."""
    eps_high_is: float | None | Literal[PRESET] = PRESET
    """IS weight upper bound 1 + eps_high_is (eq. 5), >= 0. None: no upper bound. cispo: 4.0 (the weight
    capped at 5, ScaleRL's value; the paper does not publish its own)."""
    is_bounds_by_sign: bool | Literal[PRESET] = PRESET
    """False: eps_low_is / eps_high_is bound every token's weight. True (DISPO): they bound the tokens with
    A >= 0 (correct responses) and eps_low_is_neg / eps_high_is_neg those with A < 0."""
    eps_low_is_neg: float | None | Literal[PRESET] = PRESET
    """With is_bounds_by_sign: lower weight bound 1 - eps_low_is_neg of A < 0 tokens. None: none."""
    eps_high_is_neg: float | None | Literal[PRESET] = PRESET
    """With is_bounds_by_sign: upper weight bound 1 + eps_high_is_neg of A < 0 tokens. None: none."""
    mask_rule: Literal[(*MASK_RULES, PRESET)] = PRESET
    """Token mask M (eq. 7): ``none`` (M = 1), ``ppo`` (PPO's trust region, eps_low / eps_high), ``ppo-low``
    (its lower half only: A < 0, r < 1 - eps_low) or ``ppo-high`` (its upper half only: A > 0, r > 1 + eps_high);
    ``dppo-tv`` / ``dppo-kl`` (DPPO: A > 0 tokens whose probability rose, A <= 0 tokens whose probability fell, by
    more than delta_high / delta_low in total variation p - p_old or in binary KL)."""
    eps_low: float | Literal[PRESET] = PRESET
    """PPO trust region lower edge 1 - eps_low, in [0, 1]: masks A < 0 tokens below it (eq. 7). Also
    defines ``objective/frac_ppo_dropped`` under every mask rule."""
    eps_high: float | Literal[PRESET] = PRESET
    """PPO trust region upper edge 1 + eps_high, >= 0: masks A > 0 tokens above it (eq. 7). Also defines
    ``objective/frac_ppo_dropped`` under every mask rule."""
    delta_low: float | Literal[PRESET] = PRESET
    """DPPO's bound on a fall of the probability (``dppo-tv``: p_old - p; ``dppo-kl``: the binary KL), >= 0:
    masks A <= 0 tokens beyond it. dppo_tv: 0.15, dppo_kl: 0.05 (verl's DPPO recipe)."""
    delta_high: float | Literal[PRESET] = PRESET
    """DPPO's bound on a rise of the probability (``dppo-tv``: p - p_old; ``dppo-kl``: the binary KL), >= 0:
    masks A > 0 tokens beyond it. dppo_tv: 0.15, dppo_kl: 0.05 (verl's DPPO recipe)."""
    aggregation: Literal[(*AGGREGATIONS, PRESET)] = PRESET
    """How per-token terms become a scalar: ``token-mean`` (sum / total tokens), ``seq-mean-token-mean``
    (mean over sequences of per-sequence means), ``seq-mean-token-sum-norm`` (sum / (num_seqs *
    token_sum_norm), Dr. GRPO), ``prompt-mean-token-mean`` (mean over prompts of the mean over their G
    responses' tokens, ScaleRL)."""
    token_sum_norm: float | None | Literal[PRESET] = PRESET
    """Constant length of ``seq-mean-token-sum-norm``, > 0. None: ``rollout.max_new_tokens`` in a run
    (`cispo.training.setup.make_objective`: a constant keeps split batches exact)."""
    kl_coef: float | Literal[PRESET] = PRESET
    """Coefficient of the KL penalty to the reference policy (``model.ref_path``), >= 0. 0: no KL term
    (every preset's)."""
    kl_estimator: Literal[(*KL_ESTIMATORS, PRESET)] = PRESET
    """KL estimator: ``k1`` (log pi - log pi_ref) or ``k3`` (r - 1 - log r, r = pi_ref / pi)."""
    entropy_coef: float | Literal[PRESET] = PRESET
    """Entropy bonus, >= 0: loss -= entropy_coef * agg(H_it), H_it pi_theta's full-vocabulary entropy at each
    response token, with its gradient, aggregated as the policy term (verl's ``actor.entropy_coeff``; TRL's
    ``entropy_coef`` takes the token mean, the same under token-mean). 0: off (every preset's)."""
    max_log_ratio: float | None | Literal[PRESET] = PRESET
    """Clamp of log r (and log s) to +-max_log_ratio before exp, for finite weights, > 0. None: off."""

    def __post_init__(self) -> None:
        """The fields checked as the objective they make (`resolve`): ``ValueError`` naming the field."""
        try:
            self.resolve()
        except ValueError as exc:
            raise ValueError(str(exc).replace("ObjectiveConfig.", "")) from None

    def overrides(self) -> dict[str, Any]:
        """The fields set otherwise than the preset (those not ``preset``), by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name != "name" and getattr(self, f.name) != PRESET}

    def resolve(self) -> ObjectiveConfig:
        """The objective: preset ``name`` with `overrides` (`cispo.objective.presets.preset`)."""
        return preset(self.name, **self.overrides())



@dataclass
class AlgoConfig:
    """The objective and the schedule of off-policy updates."""

    objective: ObjectiveSection = field(default_factory=ObjectiveSection)
    advantage_estimator: Literal["grpo", "drgrpo", "rloo", "batch-std", "batch-raw-std", "gdpo"] = "grpo"
    """Group-relative advantages: grpo (R - group mean) / group std, drgrpo R - group mean, rloo
    (leave-one-out mean), batch-std (R - group mean) / the batch std of those differences (ScaleRL's
    batch-level normalisation), batch-raw-std (R - group mean) / the batch std of the rewards themselves
    (TRL's scale_rewards=batch), gdpo (several rewards: each normalised within its group, then the weighted sum
    normalised over the batch: GDPO, TRL's multi_objective_aggregation=normalize_then_sum; not with
    rollout.overlong_buffer or turn rewards, which are no data.reward of their own). A response no reward could
    score (every reward returned None) is left out of its group's mean and std and gets advantage 0, as in TRL."""
    turn_credit: Literal["episode", "reward_to_go"] = "episode"
    """How a multi-turn episode's rewards become advantages, where the environment rewards each policy turn
    (docs/agents.md, "Per-turn rewards and credit"). ``episode``: one advantage per response, by
    ``advantage_estimator`` over its return R_i = final reward + the sum of its turn rewards (without turn
    rewards: the reward, unchanged). ``reward_to_go``: each policy segment k its own, A_{i,k} = G_{i,k} -
    1/(G-1) sum_{j != i} G_{j,k}, where G_{i,k} is the sum of the rewards from turn k on plus the final
    reward (0 for an episode that ended before turn k): unbiased whatever the numbers of turns, with no std
    scaling, so it needs ``advantage_estimator=rloo`` (the same baseline for one turn). Dynamic sampling
    then keeps a group where any segment's advantage is non-zero."""
    mask_truncated_completions: bool = False
    """Leave the responses cut at ``rollout.max_new_tokens`` without a stop token (finish reason ``length``) out
    of the loss, as TRL's ``mask_truncated_completions`` (DAPO): their tokens get no gradient (policy term and KL)
    and leave the token counts, while they still count in their group's advantage statistics (their rewards
    are scored as usual) and as sequences in the ``seq-mean`` / ``prompt-mean`` aggregations (TRL's ``grpo``
    loss averages over every row). A response stopped by the repetition early stop is not truncated: it stays."""
    updates_per_batch: int = 16
    """K: the generation batch is split into K mini-batches, one optimizer step each
    (MiniMax-M1: 16). With K = 1 every objective is identical (r = 1)."""
    minibatch_policy: Literal["fixed_updates", "fixed_size"] = "fixed_updates"
    """When dynamic sampling leaves the batch short of prompts_per_step groups: ``fixed_updates``
    keeps K updates on smaller mini-batches; ``fixed_size`` keeps the mini-batch at
    prompts_per_step * group_size / K rows and runs fewer updates (K_eff = kept rows // that,
    logged as ``optim/step_updates``), as DAPO's recipe keeps its mini-batch size."""
    epochs: int = 1
    """Passes over the generation batch (K optimizer steps each); at most 10^6."""
    micro_batch_size: int | None = None
    """Rows per forward/backward (gradient accumulation within a mini-batch). None: whole."""
    micro_batch_split_cost: float | None = 128.0
    """Length-sorted micro-batches: the rows of each mini-batch (and of the logp_old pass) are
    sorted by length and cut into micro-batches wherever a cut saves more padded decoder
    positions than this (the fixed cost of one more forward/backward, in positions), each of at
    most ``micro_batch_size`` rows and trimmed to its longest row. The mini-batches and the
    gradient are unchanged (up to float summation order). None: rows in random order, cut only
    by ``micro_batch_size``."""
    minibatch_order: Literal["random", "by_group"] = "random"
    """How an epoch's rows are dealt into the K mini-batches: ``random`` (a random permutation of the
    rows, so a mini-batch holds ~G/K rows of each prompt) or ``by_group`` (a random permutation of the
    groups, each group's G rows kept together, verl's layout: with ``share_prompts`` a mini-batch then
    runs each of its prompts once for all G rows: 1.57x faster updates on SmolLM2's 62-token prompts,
    1.26x at random, docs/performance.md). Each row is in exactly one mini-batch either way; what changes is which rows
    share an optimizer step."""
    share_prompts: bool = True
    """Run each prompt once for the rows of a forward/backward call that share it (a group's G
    responses), in the logp_old pass and the updates (``cispo.models.shared_prefix``): the responses
    attend to the prompt's keys and values, kept in the graph, so the log-probs and the gradient
    are the plain forward's up to float rounding while the prompt's compute is paid once per group
    and call. Llama / Qwen2 / Qwen3 / Mistral without a window; other models, ``model.compile``,
    gradient checkpointing and ``model.fsdp`` run the plain forward (one log line). False: always
    the plain forward."""
    logp_old: Literal["recompute", "rollout"] = "recompute"
    """Where log pi_old, the anchor of the importance ratio r = pi_theta / pi_old, comes from. ``recompute``:
    the trainer's own no-grad pass over the batch, in train mode, after sampling (its first update's rows
    from that update's forward: ``logp_old_from_update``). ``rollout``: the sampler's own log-probs of the
    tokens it drew (``logp_rollout``, under the same softmax(logits / temperature): refused with a repetition
    penalty, top_k, min_p or top_p, whose distribution is another), so no
    pass runs (verl's ``rollout_correction.bypass_mode``; a SmolLM2 step at K = 4 in 0.90x the time,
    docs/performance.md; nothing saved at K = 1, where the first update already gives every row's).
    Only where the sampler is the trainer's own policy, so the two agree to float32 rounding (~1e-5 nats
    per token): refused with ``rollout.engine=vllm`` (another engine), ``model.dropout`` or
    ``model.lora_dropout`` (the sampler runs without), a low-precision ``model.dtype``, a rollout correction
    (``tis_cap``, ``rollout_is``: with pi_old = pi_rollout its weights are all 1) and ``model.fsdp`` (not
    tested sharded); a model saved in bfloat16 / float16 (``model.dtype`` unset) recomputes, said in one
    line (``cispo.training.logp_old``). ``objective/entropy`` and the ``rollout/logp_*`` mismatch metrics
    then come from the first update's forward, on its rows (1/K of the batch). The reference pass of a KL
    term runs either way."""
    logp_old_from_update: bool = True
    """Take logp_old of the first update's rows (the first of the K mini-batches; with K = 1 the
    whole first epoch) from that update's own forward, detached, instead of a separate no-grad
    pass: it runs on the same weights over the same micro-batches, so the numbers are bitwise
    those of the separate pass, one forward fewer over 1/K of the batch. Applies only where
    exact: not with dropout (``model.dropout``, ``model.lora_dropout``), ``fused_head``, a rollout
    correction (``tis_cap``, ``rollout_is``) or FSDP (``cispo.training.logp_old.logp_old_from_update``).
    False: a separate pass over every row."""
    tis_cap: float | None = None
    """Truncated importance sampling for the rollout/trainer mismatch: each token's advantage
    is multiplied by min(pi_old / pi_rollout, tis_cap) (Yao et al. 2025 use 2). None: off. The same
    as rollout_is=token, rollout_is_mode=truncate, rollout_is_upper=tis_cap (set one or the other)."""
    rollout_is: Literal["token", "seq-mean", "seq-sum"] | None = None
    """Rollout correction (cispo.rollout.correction): each token's advantage is multiplied by a
    detached weight of rho = pi_old / pi_rollout taken per ``token`` or per response: ``seq-mean``
    (the geometric mean, exp(mean_t log rho_t)) or ``seq-sum`` (the product, exp(sum_t log rho_t):
    TRL's and verl's "sequence" level). None: off (unless tis_cap)."""
    rollout_is_mode: Literal["truncate", "mask", "reject", "reject-k2", "reject-k3"] = "truncate"
    """With rollout_is: ``truncate`` (weight clip(rho, lower, upper), TIS), ``mask`` (weight rho
    inside [lower, upper], 0 outside: TRL's *_mask, IcePop) or ``reject`` (weight 1 inside, 0
    outside: rejection without reweighting, verl's rollout_rs k1); ``reject-k2`` / ``reject-k3`` (weight 1
    where the divergence estimate (log rho)^2 / 2, or rho - 1 - log rho, is <= rollout_is_max_divergence,
    0 above: verl's rollout_rs token_k2 / k3, and its seq_mean_ / seq_sum_ options at those levels, where the
    estimate is the mean / sum of the tokens'; the bounds of rho are not read)."""
    rollout_is_lower: float | None = None
    """With rollout_is: the lower bound of rho (>= 0). None: none. IcePop (verl's defaults): 0.5."""
    rollout_is_upper: float | None = 2.0
    """With rollout_is: the upper bound of rho (> lower). None: none. IcePop (verl's defaults): 5."""
    rollout_is_max_divergence: float | None = None
    """With rollout_is_mode=reject-k2 or reject-k3 (and only there): the threshold of the divergence estimate,
    > 0 (verl's rollout_rs_threshold of a k2 / k3 option)."""
    fused_head: bool = False
    """Compute the LM head and the objective in one chunked pass in the updates
    (``cispo.objective.fused_head``): each chunk's gradient is formed in the forward while its logits
    exist, so the backward recomputes no logits (one large matmul fewer; docs/performance.md).
    The same gradient up to float rounding; the statistics come from the detached log-probs.
    Only for objectives whose per-token weight is known token by token: refused at config time
    for a sequence-level ratio (GSPO: a token's weight depends on its whole sequence) and with
    ``model.fsdp`` (not tested under sharding)."""


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
    """Linear learning-rate warm-up over this many optimizer steps (updates): update u < W runs at lr (u + 1) / W."""
    warmup_ratio: float | None = None
    """The warm-up as a share of the run's optimizer updates, in [0, 1]: W = ceil(warmup_ratio x N) (HF's rule;
    N = steps x algo.updates_per_batch x algo.epochs, a ``cispo sft`` run's steps). None: ``warmup_updates``;
    set one or the other."""
    lr_scheduler_type: Literal["constant_with_warmup", "constant", "linear", "cosine"] = "constant_with_warmup"
    """The learning-rate schedule over the run's N optimizer updates (HF Trainer's names and, after the warm-up,
    ``transformers.get_scheduler``'s formulas): ``constant_with_warmup`` (the warm-up, then lr), ``constant`` (lr
    from the first update: no warm-up, as HF's), ``linear`` (the warm-up, then down to 0 at update N: TRL's
    default), ``cosine`` (the warm-up, then half a cosine down to 0 at N). Counted in optimizer updates taken; a
    resumed run continues it (the count is in the checkpoint). HF's warm-up starts at lr 0 (its first update is
    lost); cispo's at lr / W, one update ahead (`cispo.training.gradients.lr_at`)."""


def schedule_checks(optim: OptimConfig) -> list[tuple[str, object, str]]:
    """The learning-rate schedule's checks (``cispo train``'s and ``cispo sft``'s): a warm-up >= 0, a ratio in
    [0, 1], and the warm-up given once (``warmup_ratio`` beside a ``warmup_updates`` other than its default)."""
    ratio, default = optim.warmup_ratio, type(optim)().warmup_updates
    return [
        ("optim.warmup_updates", optim.warmup_updates >= 0, "must be >= 0"),
        ("optim.warmup_ratio", ratio is None or 0 <= ratio <= 1, "must be in [0, 1] or None"),
        ("optim.warmup_ratio", ratio is None or optim.warmup_updates == default,
         f"is set beside optim.warmup_updates={optim.warmup_updates}: give the warm-up once (a ratio of the run's "
         "updates, or a count)"),
    ]
