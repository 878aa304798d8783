"""The maths: tensors in, tensors out, no models, data or trainers.

``advantages`` (group-relative, Dr. GRPO, RLOO; per-turn reward to go), ``logprobs`` (chunked token log-probs and
entropy), ``presets`` (the objective's settings as frozen data; no torch), ``loss`` (MiniMax-M1
eq. 4-7: IS weight, weight clip + detach, token mask, aggregation, KL) and ``fused_head`` (the LM
head and a token-level objective in one chunked pass). ``from cispo.objective import preset,
policy_loss, group_advantages`` imports them on first use.
"""

from cispo import lazy_exports

__getattr__ = lazy_exports(__name__, ('cispo.objective.loss', 'cispo.objective.advantages'))
