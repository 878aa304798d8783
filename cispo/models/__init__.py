"""The model: the training forward (``policy``), building / loading / saving Hugging Face models
(``loading``, re-exported here on first use), LoRA, the built-in base models (``pretrain_config``,
``pretrain``, ``builtin``), real models shipped in packages (``packaged``) and
``torch.compile`` of the decoder (``compile``).
"""

from cispo import lazy_exports

__getattr__ = lazy_exports(__name__, ('cispo.models.loading',))
