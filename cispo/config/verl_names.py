"""verl's names of cispo's settings (verl 0.9.1's ``ppo_trainer.yaml`` keys, dotted): the verl rows of
`cispo.config.foreign_names.OTHER_NAMES`. Plain data."""

from __future__ import annotations

from cispo.config.name_readers import (
    OBJ,
    PROMPTS_NOT_CUT,
    OtherName,
    at_least,
    by_table,
    one_file,
    positive,
    same,
    verl_logger,
    verl_lora_targets,
    verl_rollout_is_threshold,
    verl_top_k,
)

_VERL_SCHEDULES = ("constant -> constant_with_warmup (verl's constant warms up), cosine -> cosine (at verl's default "
                   "min_lr_ratio 0 and num_cycles 0.5); verl's scheduler steps once per RL step, cispo's per "
                   "optimizer update")
_VERL_RS = ("verl's rollout_rs rejects on k1 = -log rho against [log L, log U] of rollout_rs_threshold \"L_U\", so "
            "it keeps L <= pi_rollout / pi_old <= U: algo.rollout_is_mode=reject with the reciprocal bounds "
            "algo.rollout_is_lower=1/U algo.rollout_is_upper=1/L (\"0.5_5.0\" -> 0.2 and 2; one number U -> 1/U "
            "and U), at the level token_k1 -> token, seq_sum_k1 -> seq-sum, seq_mean_k1 -> seq-mean; its k2 / k3 "
            "options are algo.rollout_is_mode=reject-k2 / reject-k3 at the same levels, with "
            "algo.rollout_is_max_divergence = the threshold; seq_max and chained criteria have no equivalent")
_A, _R, _M = "actor_rollout_ref.actor.", "actor_rollout_ref.rollout.", "actor_rollout_ref.model."
_RC = "algorithm.rollout_correction."

VERL_NAMES: dict[str, OtherName] = {
    _A + "clip_ratio": OtherName(
        "verl", (OBJ + "eps_low", OBJ + "eps_high"),
        "both edges of verl's clip 1 -/+ clip_ratio where clip_ratio_low / clip_ratio_high are null (verl's defaults "
        "set them: 0.2)"),
    _A + "clip_ratio_low": OtherName(
        "verl", (OBJ + "eps_low",),
        "the clip's lower edge; with loss_mode=cispo the IS weight's lower bound: eps_low_is; with loss_mode=dppo_tv "
        "/ dppo_kl DPPO's bound on a fall of the probability: delta_low"),
    _A + "clip_ratio_high": OtherName(
        "verl", (OBJ + "eps_high",),
        "the clip's upper edge; with loss_mode=cispo the IS weight's cap: eps_high_is; with loss_mode=dppo_tv / "
        "dppo_kl DPPO's bound on a rise of the probability: delta_high"),
    _A + "clip_ratio_c": OtherName(
        "verl", (OBJ + "eps_high_is",),
        "verl's dual-clip of A < 0 tokens, which the unified objective has not; with loss_mode=dppo_tv / dppo_kl the "
        "cap of the detached weight (verl's default 3): eps_high_is = clip_ratio_c - 1"),
    _A + "policy_loss.loss_mode": OtherName(
        "verl", ("algo.objective.name",),
        "verl's vanilla adds a dual-clip (clip_ratio_c) to ppo, its cispo bounds the IS weight to [0.8, 1.2] by "
        "default (cispo's: at most 5), its dppo_tv / dppo_kl (cispo's presets of those names) take their bounds from "
        "clip_ratio_low / high (0.2 by default; the presets': the DPPO recipe's 0.15 / 0.05) and cap the weight at "
        "clip_ratio_c (3 by default; the presets: no cap), and each takes verl's clip ratios and loss_agg_mode"),
    _A + "loss_agg_mode": OtherName(
        "verl", (OBJ + "aggregation",),
        "token-mean, seq-mean-token-mean and seq-mean-token-sum-norm are the same (in both, it replaces the preset's)",
        by_table({m: m for m in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")}, {
            "token-sum": "verl's token-sum is a sum, which no cispo aggregation is",
            "seq-mean-token-sum": "set aggregation=seq-mean-token-sum-norm with token_sum_norm=1"}),
        ("seq-mean-token-mean", "seq-mean-token-mean")),
    _A + "loss_scale_factor": OtherName(
        "verl", (OBJ + "token_sum_norm",), "null: the padded response length, in both", same, (512, 512)),
    _A + "entropy_coeff": OtherName(
        "verl", (OBJ + "entropy_coef",),
        "the entropy bonus, in both aggregated as the policy term (loss_agg_mode; cispo's aggregation)", same,
        (0.001, 0.001)),
    _A + "use_kl_loss": OtherName(
        "verl", (OBJ + "kl_coef",), "no switch here: a coefficient > 0 turns the KL loss on"),
    _A + "kl_loss_coef": OtherName(
        "verl", (OBJ + "kl_coef",),
        "verl applies it only with use_kl_loss=true; cispo's coefficient > 0 turns the KL loss on"),
    _A + "kl_loss_type": OtherName(
        "verl", (OBJ + "kl_estimator",), "kl (k1) -> k1, low_var_kl (k3) -> k3 (verl also clamps k3 at 10)",
        by_table({"kl": "k1", "k1": "k1", "low_var_kl": "k3", "k3": "k3"}), ("low_var_kl", "k3")),
    _A + "ppo_epochs": OtherName("verl", ("algo.epochs",), "", same, (2, 2)),
    _A + "ppo_mini_batch_size": OtherName(
        "verl", ("algo.updates_per_batch",),
        "cispo counts mini-batches per generation batch (K); verl's ppo_mini_batch_size counts prompts per mini-batch: "
        "K = data.train_batch_size / ppo_mini_batch_size"),
    _A + "ppo_micro_batch_size_per_gpu": OtherName("verl", ("algo.micro_batch_size",), "responses per forward/backward "
                                                   "on each process, in both", same, (4, 4)),
    _A + "optim.lr": OtherName("verl", ("optim.lr",), "", same, (1e-6, 1e-6)),
    _A + "optim.weight_decay": OtherName("verl", ("optim.weight_decay",), "", same, (0.01, 0.01)),
    _A + "optim.betas": OtherName("verl", ("optim.betas",), "", same, ([0.9, 0.999], (0.9, 0.999))),
    _A + "optim.clip_grad": OtherName(
        "verl", ("optim.grad_clip",), "a norm > 0", positive(
            "verl's 0 scales every gradient to 0; cispo's optim.grad_clip=0 turns clipping off"), (0.5, 0.5)),
    _A + "grad_clip": OtherName(
        "verl", ("optim.grad_clip",), "a norm > 0 (verl's older name of optim.clip_grad)", positive(
            "verl's 0 scales every gradient to 0; cispo's optim.grad_clip=0 turns clipping off"), (0.5, 0.5)),
    _A + "optim.lr_warmup_steps": OtherName(
        "verl", ("optim.warmup_updates",),
        "cispo counts optimizer steps; verl's scheduler steps once per RL step: warmup_updates = lr_warmup_steps x "
        "algo.updates_per_batch x algo.epochs"),
    _A + "optim.lr_warmup_steps_ratio": OtherName(
        "verl", ("optim.warmup_ratio",),
        "a share of the run in both: verl's of its RL steps, int(ratio x steps), cispo's of its optimizer updates, "
        "ceil(ratio x N)", same, (0.1, 0.1)),
    _A + "optim.lr_scheduler_type": OtherName(
        "verl", ("optim.lr_scheduler_type",), _VERL_SCHEDULES,
        by_table({"constant": "constant_with_warmup", "cosine": "cosine"}), ("constant", "constant_with_warmup")),
    _A + "optim.warmup_style": OtherName(
        "verl", ("optim.lr_scheduler_type",), f"verl's older name of lr_scheduler_type: {_VERL_SCHEDULES}",
        by_table({"constant": "constant_with_warmup", "cosine": "cosine"}), ("cosine", "cosine")),
    _R + "n": OtherName("verl", ("rollout.group_size",), "", same, (8, 8)),
    _R + "temperature": OtherName("verl", ("rollout.temperature",), "", same, (0.7, 0.7)),
    _R + "top_p": OtherName("verl", ("rollout.top_p",), "", same, (0.9, 0.9)),
    _R + "top_k": OtherName("verl", ("rollout.top_k",), "verl's -1 (off) is cispo's 0", verl_top_k, (-1, 0)),
    _R + "response_length": OtherName("verl", ("rollout.max_new_tokens",), "", same, (1024, 1024)),
    _R + "prompt_length": OtherName("verl", (), PROMPTS_NOT_CUT),
    _R + "name": OtherName(
        "verl", ("rollout.engine",), "vllm -> vllm (in the trainer's process); sglang and trtllm have no equivalent",
        by_table({"vllm": "vllm"}, {"sglang": "cispo samples with torch or vllm",
                                   "trtllm": "cispo samples with torch or vllm"}), ("vllm", "vllm")),
    _R + "gpu_memory_utilization": OtherName("verl", ("rollout.vllm_gpu_memory_utilization",), "", same, (0.5, 0.5)),
    _R + "enforce_eager": OtherName("verl", ("rollout.vllm_enforce_eager",), "", same, (True, True)),
    _R + "max_num_batched_tokens": OtherName("verl", ("rollout.vllm_max_num_batched_tokens",), "", same,
                                             (8192, 8192)),
    _R + "max_num_seqs": OtherName("verl", ("rollout.vllm_max_num_seqs",), "", same, (256, 256)),
    _R + "max_model_len": OtherName("verl", ("rollout.vllm_max_model_len",), "", same, (4096, 4096)),
    _R + "tensor_model_parallel_size": OtherName(
        "verl", (), "cispo's vLLM engine always has tensor parallel size 1 (the weight push needs the whole model)"),
    _M + "path": OtherName("verl", ("model.path",), "", same, ("Qwen/Qwen2.5-0.5B-Instruct",) * 2),
    _M + "enable_gradient_checkpointing": OtherName("verl", ("model.gradient_checkpointing",), "", same,
                                                    (True, True)),
    _M + "lora_rank": OtherName("verl", ("model.lora_rank",), "", same, (8, 8)),
    _M + "lora_alpha": OtherName("verl", ("model.lora_alpha",), "", same, (32, 32.0)),
    _M + "target_modules": OtherName(
        "verl", ("model.lora_target_modules",), "all-linear -> null (every linear layer but lm_head, in both)",
        verl_lora_targets, ("all-linear", None)),
    "data.train_files": OtherName("verl", ("data.path",), "one path (a list of one)", one_file,
                                  ("train.parquet", "train.parquet")),
    "data.val_files": OtherName("verl", ("data.eval_path",), "one path (a list of one)", one_file,
                                ("test.parquet", "test.parquet")),
    "data.prompt_key": OtherName("verl", ("data.prompt_field",), "", same, ("question", "question")),
    "data.max_prompt_length": OtherName("verl", (), PROMPTS_NOT_CUT),
    "data.max_response_length": OtherName("verl", ("rollout.max_new_tokens",), "", same, (1024, 1024)),
    "data.train_batch_size": OtherName("verl", ("rollout.prompts_per_step",), "prompts per RL step, in both", same,
                                       (64, 64)),
    "trainer.total_epochs": OtherName(
        "verl", ("steps",),
        "cispo counts RL steps of rollout.prompts_per_step prompts each; verl's total_epochs counts passes over the "
        "data set: steps = total_epochs x prompts / data.train_batch_size"),
    "trainer.total_training_steps": OtherName(
        "verl", ("steps",), "RL steps, in both", at_least(1, "verl's null counts total_epochs instead: give steps"),
        (200, 200)),
    "trainer.save_freq": OtherName(
        "verl", ("checkpoint_every",), "every N RL steps and at the end, in both",
        at_least(1, "verl's -1 never saves; cispo always saves at the end (checkpoint_every=0: only then)"),
        (20, 20)),
    "trainer.test_freq": OtherName(
        "verl", ("eval.every",), "every N RL steps, before the first and after the last, in both",
        at_least(1, "verl's -1 never evaluates during training; cispo always evaluates before the first step and "
                      "after the last (eval.every=0: only then)"), (10, 10)),
    "trainer.logger": OtherName(
        "verl", ("trackers",),
        "tensorboard, wandb, mlflow as they are; file -> jsonl (metrics.jsonl is always written); console is dropped "
        "(cispo's progress bar)", verl_logger, (["console", "wandb"], ["wandb"])),
    "trainer.experiment_name": OtherName(
        "verl", ("run_name",), "the run's name (cispo's run folder is out_dir/run_name)", same, ("gsm8k", "gsm8k")),
    "trainer.project_name": OtherName(
        "verl", (), "cispo's runs have no project: W&B reads WANDB_PROJECT, MLflow MLFLOW_EXPERIMENT_NAME"),
    "trainer.default_local_dir": OtherName(
        "verl", ("out_dir", "run_name"),
        "cispo writes a run, checkpoints included, into out_dir/run_name; verl's default_local_dir is its checkpoint "
        "folder"),
    "trainer.n_gpus_per_node": OtherName("verl", (), "cispo runs on the processes torchrun starts (--nproc-per-node)"),
    "trainer.nnodes": OtherName("verl", (), "cispo runs on the processes torchrun starts (--nnodes)"),
    "trainer.val_before_train": OtherName(
        "verl", ("eval.every",), "cispo always evaluates before the first step and after the last"),
    "algorithm.adv_estimator": OtherName(
        "verl", ("algo.advantage_estimator",),
        "grpo -> grpo (with norm_adv_by_std_in_grpo=false: drgrpo), rloo -> rloo; gae and the others have no "
        "equivalent", by_table({"grpo": "grpo", "rloo": "rloo"}), ("rloo", "rloo")),
    "algorithm.norm_adv_by_std_in_grpo": OtherName(
        "verl", ("algo.advantage_estimator",), "with adv_estimator=grpo, true is cispo's grpo and false its drgrpo"),
    "algorithm.use_kl_in_reward": OtherName(
        "verl", (OBJ + "kl_coef",),
        "verl's puts a KL penalty in the reward; cispo's KL is a loss term (false, verl's default, is cispo's way: "
        "leave it out)"),
    "algorithm.kl_ctrl.kl_coef": OtherName(
        "verl", (OBJ + "kl_coef",),
        "verl's is the coefficient of a KL penalty in the reward (use_kl_in_reward); cispo's is a loss term's"),
    "algorithm.filter_groups.enable": OtherName(
        "verl", ("rollout.dynamic_sampling",),
        "drop groups whose rewards are all equal and sample more (DAPO); on by default in cispo, off in verl", same,
        (True, True)),
    "algorithm.filter_groups.max_num_gen_batches": OtherName(
        "verl", ("rollout.max_sampling_rounds",), "generation rounds per RL step, in both",
        at_least(1, "verl's 0 samples until the batch is full; cispo's rounds are capped (at most 10^4)"), (10, 10)),
    "algorithm.rollout_correction.bypass_mode": OtherName(
        "verl", ("algo.logp_old",),
        "true -> rollout (pi_old is the sampler's log-probs, not recomputed), false -> recompute; cispo takes them "
        "only from its own torch sampler at float32, without dropout or a rollout correction beside it",
        by_table({True: "rollout", False: "recompute"}), (True, "rollout")),
    _RC + "rollout_is": OtherName(
        "verl", ("algo.rollout_is",),
        "token -> token, sequence -> seq-sum (verl's sequence ratio is the product over the response), null -> null; "
        "the bounds are rollout_is_threshold's (verl's and cispo's default upper bound: 2.0)",
        by_table({"token": "token", "sequence": "seq-sum", None: None}), ("sequence", "seq-sum")),
    _RC + "rollout_is_threshold": OtherName(
        "verl", ("algo.rollout_is_upper",),
        "a number C (TIS: the weight clipped at C, cispo's rollout_is_mode=truncate) -> rollout_is_upper=C; "
        "\"L_U\" (IcePop) is refused with its translation",
        verl_rollout_is_threshold, (3.0, 3.0)),
    _RC + "rollout_rs": OtherName(
        "verl", ("algo.rollout_is", "algo.rollout_is_mode", "algo.rollout_is_lower", "algo.rollout_is_upper"),
        _VERL_RS),
    _RC + "rollout_rs_threshold": OtherName(
        "verl", ("algo.rollout_is_lower", "algo.rollout_is_upper", "algo.rollout_is_max_divergence"), _VERL_RS),
    "custom_reward_function.path": OtherName(
        "verl", ("data.reward",), "cispo names the file and the function together: data.reward=PATH:NAME"),
    "custom_reward_function.name": OtherName(
        "verl", ("data.reward",), "cispo names the file and the function together: data.reward=PATH:NAME"),
}
