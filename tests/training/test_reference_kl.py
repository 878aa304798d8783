"""The KL penalty to a frozen reference model (``kl_coef > 0``): config checks, the trainer's
log pi_ref, its gradient, and whole runs with the initial policy or ``model.ref_path`` as pi_ref."""

import pytest
import torch

import cispo.training.trainer
from cispo.config.train import ConfigError, TrainConfig, apply_overrides
from cispo.data.tasks import arithmetic
from cispo.foundations.experience import Completion, collate
from cispo.models.loading import build_model, build_tokenizer, save_policy
from cispo.models.policy import Policy, policy_logprobs
from cispo.records.tracking import read_metrics
from cispo.rollout import TorchSampler
from cispo.training.runner import train
from tests.conftest import small_config

pytestmark = pytest.mark.usefixtures("one_thread")

KL = "algo.objective.kl_coef=0.1"


def _error(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        apply_overrides(TrainConfig(), overrides)
    return str(e.value)


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["model.ref_path=ref"], "model.ref_path is set but algo.objective.kl_coef is 0"),
        ([KL, "model.lora_rank=4"], "algo.objective.kl_coef > 0 cannot be combined with model.lora_rank"),
        ([KL, "model.fsdp=true"], "algo.objective.kl_coef > 0 cannot be combined with model.fsdp"),
    ],
)
def test_what_cannot_be_honoured_is_a_config_error(overrides, expected):
    assert expected in _error(overrides)


def test_kl_coef_is_accepted():
    cfg = apply_overrides(TrainConfig(), [KL, "kl_estimator=k1", "model.ref_path=ref"])
    assert cfg.model.ref_path == "ref"


def test_kl_gradient_matches_the_closed_form():
    """Zero advantages: the whole gradient of an update is the KL part. It equals the gradient of
    kl_coef * token-mean k3(log pi_theta, log pi_ref) computed in one piece, through micro-batches."""
    torch.manual_seed(0)
    tok = build_tokenizer(arithmetic.ALPHABET)
    model = build_model(tok, size="tiny", seed=0)
    ref = build_model(tok, size="tiny", seed=1).eval().requires_grad_(False)
    cfg = apply_overrides(TrainConfig(), [KL, "updates_per_batch=1", "micro_batch_size=3", "group_size=2",
                                          "lr=1e-2", "warmup_updates=0"])
    obj = cfg.algo.objective.resolve()
    policy = Policy(model, tok, TorchSampler(model, tok.eos_token_id, tok.pad_token_id), torch.device("cpu"),
                    ref_model=ref)
    g = torch.Generator().manual_seed(1)
    comps = []
    for i in range(6):
        n_p, n_r = 3 + i % 4, 2 + (5 * i) % 7
        comps.append(Completion({"prompt": ""}, torch.randint(3, len(tok), (n_p,), generator=g).tolist(),
                                torch.randint(3, len(tok), (n_r,), generator=g), torch.zeros(n_r), "eos", ""))
    exp = collate(comps, torch.zeros(6), tok.pad_token_id)
    exp.logp_old = cispo.training.trainer.Trainer(policy, None, obj, cfg, torch.Generator()).compute_logp_old(exp)
    mask = exp.response_mask
    assert torch.allclose(exp.extras["logp_ref"], policy_logprobs(ref, exp).detach() * mask, atol=1e-5)

    # closed form: kl_coef * sum_it M_it k3_it / sum_it M_it, k3 = exp(lr) - 1 - lr, lr = log pi_ref - log pi
    model.zero_grad()
    log_r = exp.extras["logp_ref"] - policy_logprobs(model, exp)  # [B, T]
    ((obj.kl_coef * (torch.exp(log_r) - 1 - log_r) * mask).sum() / mask.sum()).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    got = []

    class Recording(torch.optim.SGD):
        def step(self, closure=None):
            got.extend(p.grad.clone() for p in model.parameters())

    cispo.training.trainer.Trainer(policy, Recording(model.parameters(), lr=0.0), obj, cfg,
                                   torch.Generator().manual_seed(0)).update(exp)
    assert max(float((a - b).abs().max()) for a, b in zip(got, want)) < 1e-6
    assert max(float(a.abs().max()) for a in want) > 1e-4  # the KL part is not trivially zero


def _recorded_kl(monkeypatch) -> list[float]:
    """The KL of every optimizer step of a run, in order."""
    seen = []
    real = cispo.training.trainer.merge_stats

    def recording(parts, grad_norm, finite):
        out = real(parts, grad_norm, finite)
        seen.append(out["kl"])
        return out

    monkeypatch.setattr(cispo.training.trainer, "merge_stats", recording)
    return seen


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_run_with_the_initial_policy_as_reference(tiny_model, dense_task, tmp_path, monkeypatch, estimator):
    seen = _recorded_kl(monkeypatch)
    cfg = small_config(tiny_model, tmp_path, KL, f"algo.objective.kl_estimator={estimator}", "steps=2",
                       "eval.every=0", "checkpoint_every=0")
    run_dir = train(cfg).run_dir
    assert seen[0] == 0.0  # first update of the first step: pi_theta == pi_ref token for token
    assert all(abs(k) > 0 for k in seen[1:]) and len(seen) == 8
    if estimator == "k3":
        assert all(k > 0 for k in seen[1:])
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] > 0]
    assert all(torch.isfinite(torch.tensor(r["objective/kl"])) for r in rows)
    assert rows[-1]["objective/kl"] != 0


def test_ref_path_loads_a_different_model(tiny_model, dense_task, tmp_path, monkeypatch):
    tok = build_tokenizer(arithmetic.ALPHABET)
    other = tmp_path / "other"
    save_policy(build_model(tok, size="tiny", seed=1), tok, other)
    seen = _recorded_kl(monkeypatch)
    train(small_config(tiny_model, tmp_path / "run", KL, f"model.ref_path={other}", "steps=1", "eval.every=0",
                       "checkpoint_every=0"))
    assert seen[0] > 0.01  # a different pi_ref: KL > 0 from the first update


def test_ref_path_with_another_vocabulary_is_refused(tiny_model, dense_task, tmp_path):
    tok = build_tokenizer(arithmetic.ALPHABET + "xyz")
    other = tmp_path / "other"
    save_policy(build_model(tok, size="tiny", seed=1), tok, other)
    with pytest.raises(ValueError, match="model.ref_path=.*tokenizer differs from the policy's"):
        train(small_config(tiny_model, tmp_path / "run", KL, f"model.ref_path={other}", "steps=1"))


def test_resume_keeps_the_initial_policy_as_reference(tiny_model, dense_task, tmp_path):
    """The reference is read from model.path again on --resume, not from the checkpoint: the
    resumed run's metrics (objective/kl among them) equal the uninterrupted run's."""
    full = train(small_config(tiny_model, tmp_path / "full", KL, "steps=3"))
    train(small_config(tiny_model, tmp_path / "cut", KL, "steps=2"))
    resumed = train(small_config(tiny_model, tmp_path / "cut", KL, "steps=3"), resume=True)
    rows = [[{k: v for k, v in r.items() if not k.startswith("perf/")}
             for r in read_metrics(x.run_dir / "metrics.jsonl")] for x in (full, resumed)]
    assert rows[0] == rows[1] and rows[0][-1]["objective/kl"] > 0
