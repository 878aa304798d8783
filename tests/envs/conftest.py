"""The code sandbox's fixtures for every test under tests/envs/ (the python tool): ``cfg`` / ``netns`` skip where the
machine has no sandbox, and ``nothing_survives`` (autouse)
fails a test after which a sandbox process of this run is still alive. Defined in tests/sandbox_helpers.py."""

from tests.sandbox_helpers import cfg, netns, nothing_survives  # noqa: F401  (fixtures pytest finds here)
