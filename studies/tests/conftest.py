"""Fixtures of the studies' tests: a tiny random Llama saved like a checkpoint and a dense reward on
the built-in task, so that a comparison of a few runs takes seconds. The library's tests have their
own (tests/conftest.py); the studies import nothing from them."""

import dataclasses

import pytest
import torch

import cispo.data.tasks
from cispo.data.tasks import arithmetic
from cispo.models.loading import build_model, build_tokenizer, save_policy


def digit_reward(prompt, completion, **sample):
    """A dense reward so that a random model's groups are informative."""
    return completion.count("1") / max(len(completion), 1)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: intra-op threads only add overhead (and thrash on a shared machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A random tiny model on the addition alphabet, saved as a model folder."""
    tok = build_tokenizer(arithmetic.ALPHABET)
    path = tmp_path_factory.mktemp("tiny_model")
    save_policy(build_model(tok, size="tiny", seed=0), tok, path)
    return path


@pytest.fixture
def dense_task(monkeypatch):
    """The built-in addition task with `digit_reward` in place of its 0/1 reward."""
    base = cispo.data.tasks.get_task("addition")
    monkeypatch.setattr(cispo.data.tasks, "get_task",
                        lambda name="addition": dataclasses.replace(base, reward=digit_reward))
