"""TRL's names of cispo's settings (trl 1.16's ``GRPOConfig`` fields): the TRL rows of
`cispo.config.foreign_names.OTHER_NAMES`. Plain data."""

from __future__ import annotations

from cispo.config.name_readers import OBJ, PROMPTS_NOT_CUT, OtherName, at_least, by_table, none_as, same, trl_report_to

_SCHEDULES = ("the HF Trainer's linear, cosine, constant and constant_with_warmup, per optimizer update (cispo's "
              "warm-up starts at lr / W, HF's at 0); TRL's default is linear, cispo's constant_with_warmup")
_TRL_IS = ("TRL's default, true with sequence_mask and clip_max 3.0, is algo.rollout_is=seq-sum "
           "algo.rollout_is_mode=mask algo.rollout_is_upper=3")
_TRL_IS_MODES = ("token_truncate -> rollout_is=token rollout_is_mode=truncate, token_mask -> token and mask, "
                 "sequence_truncate -> seq-sum and truncate, sequence_mask (TRL's default) -> seq-sum and mask "
                 "(TRL's sequence ratio is the product over the response: cispo's seq-sum)")

TRL_NAMES: dict[str, OtherName] = {
    "learning_rate": OtherName("TRL", ("optim.lr",), "", same, (1e-6, 1e-6)),
    "num_generations": OtherName("TRL", ("rollout.group_size",), "", same, (16, 16)),
    "per_device_train_batch_size": OtherName(
        "TRL", ("algo.micro_batch_size", "rollout.prompts_per_step"),
        "cispo's micro-batch is the rows of one forward/backward and its generation batch rollout.prompts_per_step "
        "prompts x rollout.group_size; TRL's per_device_train_batch_size sets both, with gradient_accumulation_steps "
        "and steps_per_generation"),
    "gradient_accumulation_steps": OtherName(
        "TRL", ("algo.micro_batch_size",),
        "cispo accumulates over the micro-batches of each of its algo.updates_per_batch mini-batches: give the rows of "
        "a micro-batch, not their count"),
    "max_completion_length": OtherName("TRL", ("rollout.max_new_tokens",), "", same, (512, 512)),
    "max_prompt_length": OtherName("TRL", (), f"{PROMPTS_NOT_CUT} (trl 1.16 has no such field either)"),
    "temperature": OtherName("TRL", ("rollout.temperature",), "", same, (0.7, 0.7)),
    "top_p": OtherName("TRL", ("rollout.top_p",), "", same, (0.95, 0.95)),
    "top_k": OtherName("TRL", ("rollout.top_k",), "0 turns it off in both", same, (50, 50)),
    "beta": OtherName(
        "TRL", (OBJ + "kl_coef",),
        "cispo's KL term is k3 alone; TRL multiplies it by the IS ratio unless use_bias_correction_kl=false (default "
        "true), which changes its gradient even on-policy"),
    "epsilon": OtherName(
        "TRL", (OBJ + "eps_low", OBJ + "eps_high"),
        "TRL's epsilon is the clip's lower edge 1 - epsilon and, unless epsilon_high is set, its upper edge "
        "1 + epsilon"),
    "epsilon_high": OtherName(
        "TRL", (OBJ + "eps_high", OBJ + "eps_high_is"),
        "the clip's upper edge 1 + epsilon_high; with loss_type=cispo TRL caps the IS weight at epsilon_high itself: "
        "eps_high_is = epsilon_high - 1"),
    "delta": OtherName(
        "TRL", (),
        "TRL's delta clips the ratio of the clipped surrogate from above (two-sided GRPO); cispo's nearest, "
        "algo.objective.eps_high_is, caps a detached IS weight"),
    "loss_type": OtherName(
        "TRL", ("algo.objective.name",),
        "grpo -> grpo; dapo -> ppo (TRL's dapo clips at 1 -/+ epsilon, 0.2, unless epsilon_high is set; cispo's dapo "
        "at 0.2 and 0.28)",
        by_table({"grpo": "grpo", "dapo": "ppo"}, {
            "cispo": "TRL's cispo caps the IS weight at epsilon_high itself (0.2 unless set); set "
                     "algo.objective=cispo, whose cap is 1 + eps_high_is = 5 (TRL's epsilon_high=5.0)",
            "dr_grpo": "TRL's dr_grpo divides by max_completion_length: set algo.objective=ppo with "
                       "algo.objective.aggregation=seq-mean-token-sum-norm and algo.objective.token_sum_norm=that "
                       "length",
            "bnpo": "TRL's bnpo divides by the tokens of the local micro-batch; cispo's token-mean (dapo -> ppo) by "
                    "those of the mini-batch"}),
        ("dapo", "ppo")),
    "scale_rewards": OtherName(
        "TRL", ("algo.advantage_estimator",),
        "group (true) -> grpo, batch -> batch-raw-std (the std of the raw rewards over the batch), none (false) -> "
        "drgrpo (TRL adds 1e-4 to the std, cispo 1e-6)",
        by_table({"group": "grpo", True: "grpo", "batch": "batch-raw-std", "none": "drgrpo", False: "drgrpo"}),
        ("none", "drgrpo")),
    "num_iterations": OtherName("TRL", ("algo.epochs",), "", same, (2, 2)),
    "steps_per_generation": OtherName(
        "TRL", ("algo.updates_per_batch",),
        "cispo counts optimizer steps per generation batch (K); TRL's steps_per_generation counts micro-steps: "
        "K = steps_per_generation / gradient_accumulation_steps"),
    "generation_batch_size": OtherName(
        "TRL", ("rollout.prompts_per_step", "rollout.group_size"),
        "cispo's generation batch is rollout.prompts_per_step prompts x rollout.group_size responses; TRL's "
        "generation_batch_size counts responses"),
    "importance_sampling_level": OtherName("TRL", (OBJ + "ratio_level",), "", same, ("sequence", "sequence")),
    "mask_truncated_completions": OtherName(
        "TRL", ("algo.mask_truncated_completions",),
        "out of the loss, still in the group's advantage statistics, in both", same, (True, True)),
    "max_steps": OtherName(
        "TRL", ("steps",),
        "cispo counts RL steps (generation batches), each of algo.updates_per_batch x algo.epochs optimizer steps; "
        "TRL's max_steps counts optimizer steps"),
    "num_train_epochs": OtherName(
        "TRL", ("steps",),
        "cispo counts RL steps of rollout.prompts_per_step prompts each (reshuffled when they run out); TRL's "
        "num_train_epochs counts passes over the data set"),
    "save_steps": OtherName("TRL", ("checkpoint_every",),
                            "cispo counts RL steps; TRL's save_steps counts optimizer steps"),
    "logging_steps": OtherName("TRL", (), "cispo logs every RL step (metrics.jsonl and the trackers)"),
    "eval_steps": OtherName("TRL", ("eval.every",), "cispo counts RL steps; TRL's eval_steps counts optimizer steps"),
    "seed": OtherName("TRL", ("seed",), "", same, (42, 42)),
    "bf16": OtherName(
        "TRL", ("model.dtype",),
        "true -> bfloat16 (with FP32 master weights under autocast, as TRL's mixed precision: model.master_weights), "
        "false -> float32",
        by_table({True: "bfloat16", False: "float32"}), (True, "bfloat16")),
    "fp16": OtherName(
        "TRL", ("model.dtype",), "true -> float16 (FP32 master weights, autocast and loss scaling)",
        by_table({True: "float16"}, {False: "false is TRL's default: leave it out"}), (True, "float16")),
    "use_cpu": OtherName("TRL", ("model.device",), "true -> cpu, false -> auto",
                         by_table({True: "cpu", False: "auto"}), (True, "cpu")),
    "use_vllm": OtherName(
        "TRL", ("rollout.engine",), "true -> vllm (in the trainer's process: TRL's vllm_mode=colocate), false -> torch",
        by_table({True: "vllm", False: "torch"}), (True, "vllm")),
    "vllm_mode": OtherName(
        "TRL", ("rollout.engine",),
        "rollout.engine=vllm runs vLLM inside each trainer process (TRL's colocate); there is no server mode"),
    "vllm_gpu_memory_utilization": OtherName("TRL", ("rollout.vllm_gpu_memory_utilization",), "", same, (0.5, 0.5)),
    "vllm_enable_sleep_mode": OtherName("TRL", ("rollout.vllm_sleep",), "", same, (True, True)),
    "vllm_max_model_length": OtherName("TRL", ("rollout.vllm_max_model_len",), "", same, (4096, 4096)),
    "vllm_importance_sampling_correction": OtherName(
        "TRL", ("algo.rollout_is",), f"false -> null (no correction, cispo's default); {_TRL_IS}",
        by_table({False: None}, {True: _TRL_IS}), (False, None)),
    "vllm_importance_sampling_mode": OtherName("TRL", ("algo.rollout_is", "algo.rollout_is_mode"), _TRL_IS_MODES),
    "vllm_importance_sampling_clip_max": OtherName(
        "TRL", ("algo.rollout_is_upper",), "the upper bound of rho in both (TRL's default 3.0, cispo's 2.0); null: "
        "none", same, (3.0, 3.0)),
    "vllm_importance_sampling_cap": OtherName(
        "TRL", ("algo.rollout_is_upper",), "TRL's older name of vllm_importance_sampling_clip_max", same, (3.0, 3.0)),
    "vllm_importance_sampling_clip_min": OtherName(
        "TRL", ("algo.rollout_is_lower",), "the lower bound of rho in both; null: none", same, (0.5, 0.5)),
    "multi_objective_aggregation": OtherName(
        "TRL", ("algo.advantage_estimator",),
        "normalize_then_sum (GDPO: each reward normalised in its group, the weighted sum over the batch) -> gdpo; "
        "sum_then_normalize is TRL's default and cispo's way with every other estimator: leave it out",
        by_table({"normalize_then_sum": "gdpo"}, {
            "sum_then_normalize": "TRL's default: cispo sums the rewards with data.reward_weights and normalises the "
                                  "sum by algo.advantage_estimator (scale_rewards' key): leave it out"}),
        ("normalize_then_sum", "gdpo")),
    "entropy_coef": OtherName(
        "TRL", (OBJ + "entropy_coef",),
        "the entropy bonus; TRL's is the mean entropy of each micro-batch's tokens (divided by the accumulation "
        "steps), cispo's aggregates as the policy term over the mini-batch (token-mean, the default: the same where "
        "a mini-batch is one micro-batch)", same, (0.01, 0.01)),
    "use_adaptive_entropy": OtherName(
        "TRL", (OBJ + "entropy_coef",),
        "cispo's entropy coefficient is constant (false, TRL's default: leave it out); Skywork-OR1's adaptive one has "
        "no cispo equivalent"),
    "top_entropy_quantile": OtherName(
        "TRL", (), "cispo trains on every response token (TRL's default, 1.0: leave it out); keeping only the "
                   "highest-entropy tokens in the loss has no cispo equivalent"),
    "num_generations_eval": OtherName(
        "TRL", ("eval.num_samples",), "responses per evaluation prompt, in both",
        at_least(1, "TRL's null samples num_generations; cispo's null takes the task's default: give a count"),
        (4, 4)),
    "repetition_penalty": OtherName("TRL", ("rollout.repetition_penalty",), "1 turns it off in both", same,
                                    (1.1, 1.1)),
    "min_p": OtherName("TRL", ("rollout.min_p",), "TRL's null (off) is cispo's 0", none_as(0.0), (0.05, 0.05)),
    "report_to": OtherName(
        "TRL", ("trackers",), "a sink or a list of them (tensorboard, wandb, mlflow); none -> []; all is refused",
        trl_report_to, ("tensorboard", ["tensorboard"])),
    "output_dir": OtherName("TRL", ("out_dir", "run_name"),
                            "cispo writes a run into out_dir/run_name; TRL's output_dir is that folder itself"),
    "reward_funcs": OtherName(
        "TRL", ("data.reward",),
        "TRL's are callables or reward-model ids; cispo's name module:function files (a list too, summed with "
        "data.reward_weights; a reward model is rm:FOLDER)"),
    "reward_weights": OtherName("TRL", ("data.reward_weights",), "", same, ([1.0, 0.5], [1.0, 0.5])),
    "tools": OtherName(
        "TRL", ("data.tools",),
        "TRL's are the functions, passed to GRPOTrainer; cispo's name them: file.py:f,g or module:f (a list too; "
        "built-in calculator and python)", same, (["my_tools.py:add"], ["my_tools.py:add"])),
    "max_tool_calling_iterations": OtherName(
        "TRL", ("rollout.max_turns",), "tool-calling turns per response in both",
        at_least(1, "cispo's rollout.max_turns is a count >= 1 (TRL's None leaves the turns unbounded)"), (3, 3)),
    "warmup_steps": OtherName(
        "TRL", ("optim.warmup_updates",), "optimizer steps in both",
        at_least(0, "TRL reads a warmup_steps below 1 as a share of the run's steps: give it as optim.warmup_ratio"),
        (10, 10)),
    "warmup_ratio": OtherName(
        "TRL", ("optim.warmup_ratio",),
        "a share of the run's optimizer updates, ceil(ratio x N), in both (transformers 5 reads it from a "
        "warmup_steps below 1)", same, (0.1, 0.1)),
    "lr_scheduler_type": OtherName(
        "TRL", ("optim.lr_scheduler_type",), _SCHEDULES,
        by_table({k: k for k in ("linear", "cosine", "constant", "constant_with_warmup")},
                dict.fromkeys(("cosine_with_restarts", "polynomial", "inverse_sqrt", "reduce_lr_on_plateau",
                               "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay", "greedy"),
                              "cispo's schedules are linear, cosine, constant and constant_with_warmup")),
        ("cosine", "cosine")),
    "max_grad_norm": OtherName("TRL", ("optim.grad_clip",), "0 turns clipping off in both", same, (0.5, 0.5)),
    "weight_decay": OtherName(
        "TRL", ("optim.weight_decay",),
        "cispo decays every parameter; TRL's weight_decay leaves biases and LayerNorm weights out"),
    "adam_beta1": OtherName("TRL", ("optim.betas",), "cispo's optim.betas is the pair [adam_beta1, adam_beta2]"),
    "adam_beta2": OtherName("TRL", ("optim.betas",), "cispo's optim.betas is the pair [adam_beta1, adam_beta2]"),
    "adam_epsilon": OtherName("TRL", ("optim.eps",), "", same, (1e-8, 1e-8)),
    "gradient_checkpointing": OtherName("TRL", ("model.gradient_checkpointing",), "", same, (True, True)),
    "cast_lm_head_to_fp32": OtherName("TRL", ("model.fp32_lm_head",), "", same, (True, True)),
    "log_completions": OtherName(
        "TRL", ("log_samples_every",),
        "cispo saves some responses of every log_samples_every-th RL step (samples.jsonl and the trackers); TRL's "
        "log_completions prints some every logging_steps"),
}
