"""Fixtures of the studies' tests: the library tests' tiny random Llama saved like a checkpoint and the
dense reward on the built-in task (tests/conftest.py, one home for them), so that a comparison of a few runs
takes seconds."""

from tests.conftest import dense_task, digit_reward, one_thread, tiny_model  # noqa: F401 - fixtures by name
