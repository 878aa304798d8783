"""The run's settings: one dataclass per concern, a docstring per field (``train``), read from
YAML and ``key=value`` overrides and checked by pydantic (``engine``). ``from cispo.config import
TrainConfig, load_yaml, apply_overrides`` imports them on first use; none of it loads torch.
"""

from cispo import lazy_exports

__getattr__ = lazy_exports(__name__, ("cispo.config.train",))
