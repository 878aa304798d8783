"""Shared fixtures and helpers: a tiny random Llama saved like a checkpoint, a dense reward, reward calls, and
small run configurations. Helpers import by full name from any folder: ``from tests.conftest import small_config``."""

import dataclasses

import pytest
import torch

import cispo.data.tasks
from cispo.config.train import TrainConfig, apply_overrides
from cispo.data.tasks import arithmetic
from cispo.models.loading import build_model, build_tokenizer, save_policy


def digit_reward(prompt, completion, **sample):
    """A dense reward so that a random model's groups are informative."""
    return completion.count("1") / max(len(completion), 1)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: intra-op threads only add overhead (and thrash on a shared machine).
    Use with ``pytestmark = pytest.mark.usefixtures("one_thread")`` for a whole module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    tok = build_tokenizer(arithmetic.ALPHABET)
    path = tmp_path_factory.mktemp("tiny_model")
    save_policy(build_model(tok, size="tiny", seed=0), tok, path)
    return path


@pytest.fixture
def dense_task(monkeypatch):
    base = cispo.data.tasks.get_task("addition")
    monkeypatch.setattr(cispo.data.tasks, "get_task",
                        lambda name="addition": dataclasses.replace(base, reward=digit_reward))


def train_dense(cfg):
    """``train(cfg)`` with the built-in addition task's reward replaced by `digit_reward`: for module-scoped
    fixtures, where the `dense_task` fixture (function-scoped) cannot be used."""
    from cispo.training.runner import train

    base = cispo.data.tasks.get_task("addition")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cispo.data.tasks, "get_task", lambda name="addition": dataclasses.replace(base, reward=digit_reward))
        return train(cfg)


def strip_perf(rows):
    """Metrics rows without their timings (``perf/...``), which differ between identical runs."""
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


def reward_calls(*completions, sample=None):
    """``score_rewards``' calls: one ``(prompt, completion, sample)`` per completion, each with its own
    copy of `sample`."""
    return [("p", c, dict(sample or {})) for c in completions]


def small_config(model_path, out_dir, *extra):
    """A three-step run of the built-in addition task on `model_path` that checkpoints and evaluates every 2
    steps: the smallest run that exercises resume and evaluation; `extra` key=value overrides come last. One
    thread, whatever the load: threads picked by load differ between two runs on a busy machine, and so do
    their sums' rounding (CI's bit-identical smoke run failed that way)."""
    return apply_overrides(
        TrainConfig(),
        [
            f"model.path={model_path}", f"out_dir={out_dir}", "model.device=cpu", "progress=false",
            "steps=3", "prompts_per_step=4", "group_size=4", "updates_per_batch=4", "max_new_tokens=10",
            "num_train_prompts=64", "num_eval_prompts=8", "eval.num_samples=2", "eval.every=2",
            "checkpoint_every=2", "lr=1e-3", "warmup_updates=2", "threads=1", *extra,
        ],
    )


def run_args(model, out, *extra):
    """`cispo train` arguments for a two-step run of the built-in addition task on `model`, writing under `out`."""
    return [f"model.path={model}", f"out_dir={out}", "model.device=cpu", "steps=2", "prompts_per_step=2",
            "group_size=2", "updates_per_batch=1", "max_new_tokens=6", "num_train_prompts=16", "num_eval_prompts=4",
            "eval.num_samples=1", "eval.every=0", "dynamic_sampling=false", "threads=1", *extra]


def example_command(name: str) -> str:
    """The command an examples/ config is for: ``sft`` for a file named ``*_sft.yaml`` (`cispo.config.sft.SFTConfig`),
    ``train`` for the others (`TrainConfig`)."""
    return "sft" if name.endswith("_sft.yaml") else "train"
