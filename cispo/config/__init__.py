"""The run's settings: one dataclass per concern, a docstring per field (a module per section:
``model``, ``data``, ``rollout``, ``algo`` with ``optim``; the run and the checks across sections
in ``train``), read from YAML and ``key=value`` overrides and checked by pydantic (``engine``); a paper's
settings across sections as one name (``recipes``: ``cispo train recipe=scalerl``).
``from cispo.config import TrainConfig, load_yaml, apply_overrides`` imports them on first use;
none of it loads torch.
"""

from cispo import lazy_exports

__getattr__ = lazy_exports(__name__, ("cispo.config.engine", "cispo.config.model", "cispo.config.data",
                                      "cispo.config.rollout", "cispo.config.algo", "cispo.config.train",
                                      "cispo.config.recipes"))
