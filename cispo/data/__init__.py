"""Data and rewards: the built-in ``tasks``, prompt files (``datasets``), ``rewards`` (verifiers,
the reward worker pool, the code sandbox) and the prompt stream with its dynamic-sampling refill
(``prompts``, which ``cispo.data`` re-exports on first use).
"""

from cispo import lazy_exports

__getattr__ = lazy_exports(__name__, ('cispo.data.prompts',))
