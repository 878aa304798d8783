"""The test suite, one folder per layer of the package (tests/objective/ tests cispo/objective/, ...).

Every folder is a package, so test files in different folders may share a name, and the shared helpers
import by their full name from anywhere: ``from tests.conftest import small_config``,
``from tests import fake_vllm``, ``from tests.sandbox_helpers import cfg``. pytest puts the repository
root first on ``sys.path`` (its rootdir, the first folder above without an ``__init__.py``), so this
``tests`` package wins over any other installed under that name (verl installs one).
"""
