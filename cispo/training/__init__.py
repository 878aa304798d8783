"""The loop and the run: micro-batches (``batching``), a step's metrics, one RL step
(``trainer``: sample -> score -> filter -> advantages -> logp_old -> K updates), held-out
evaluation, set-up from the config, checkpoints and the whole run (``runner``).
"""
