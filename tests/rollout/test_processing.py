"""cispo.rollout.processing: the distribution sampled (repetition penalty, temperature, min_p, top_k, top_p) against
transformers' own logits processors, and its log-probs summing to 1 over the tokens it keeps."""

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from cispo.rollout import SamplingConfig  # noqa: E402
from cispo.rollout.processing import penalise, processed_logprobs, processes, seen_tokens  # noqa: E402

V = 50


def hf_processors(cfg: SamplingConfig) -> transformers.LogitsProcessorList:
    """transformers' processors for ``cfg``, in vLLM's order (penalty, temperature, min_p, top_k, top_p)."""
    out = []
    if cfg.repetition_penalty != 1.0:
        out.append(transformers.RepetitionPenaltyLogitsProcessor(cfg.repetition_penalty))
    out.append(transformers.TemperatureLogitsWarper(cfg.temperature))
    if cfg.min_p:
        out.append(transformers.MinPLogitsWarper(cfg.min_p))
    if cfg.top_k:
        out.append(transformers.TopKLogitsWarper(cfg.top_k))
    if cfg.top_p < 1:
        out.append(transformers.TopPLogitsWarper(cfg.top_p))
    return transformers.LogitsProcessorList(out)


CONFIGS = [dict(top_p=0.7), dict(top_k=5), dict(min_p=0.1), dict(repetition_penalty=1.7),
           dict(temperature=0.7, top_k=10, top_p=0.8, min_p=0.02, repetition_penalty=1.2)]


@pytest.mark.parametrize("kw", CONFIGS)
def test_processed_logprobs_are_transformers_processors_then_log_softmax(kw):
    torch.manual_seed(0)
    cfg = SamplingConfig(**kw)
    logits = torch.randn(6, V) * 3  # [b, V]
    ids = torch.randint(0, V, (6, 9))  # [b, L] prompt + response so far
    got = processed_logprobs(logits, cfg, seen_tokens(ids, torch.ones_like(ids), V))
    want = F.log_softmax(hf_processors(cfg)(ids, logits.clone()), -1)
    assert torch.equal(torch.isinf(got), torch.isinf(want))  # the same tokens dropped
    torch.testing.assert_close(got[~got.isinf()], want[~want.isinf()], atol=1e-5, rtol=0)


@pytest.mark.parametrize("kw", CONFIGS)
def test_logprobs_sum_to_one_over_the_truncated_support(kw):
    torch.manual_seed(1)
    cfg = SamplingConfig(**kw)
    logits = torch.randn(8, V) * 2
    logp = processed_logprobs(logits, cfg, torch.rand(8, V) < 0.3)
    torch.testing.assert_close(logp.exp().sum(-1), torch.ones(8), atol=1e-5, rtol=0)
    kept = (~logp.isinf()).sum(-1)
    assert (kept >= 1).all()
    if cfg.top_k:
        assert (kept <= cfg.top_k).all()
    if cfg.top_p < 1 or cfg.top_k or cfg.min_p:
        assert (kept < V).any()  # something was truncated


def test_repetition_penalty_is_hfs_formula_over_prompt_and_response():
    """HF's RepetitionPenaltyLogitsProcessor: at a token already in prompt + response a positive logit is divided
    by the penalty, a negative one multiplied; padding (mask 0) is not in the context."""
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0]])
    ids, mask = torch.tensor([[4, 0, 1, 3]]), torch.tensor([[0, 1, 1, 1]])  # id 4 is left padding
    seen = seen_tokens(ids, mask, 5)
    assert seen.tolist() == [[True, True, False, True, False]]
    got = penalise(logits, seen, 2.0)
    assert got.tolist() == [[1.0, -2.0, 0.5, -6.0, 1.0]]
    hf = transformers.RepetitionPenaltyLogitsProcessor(2.0)(torch.tensor([[0, 1, 3]]), logits.clone())
    assert torch.equal(got, hf)


def test_greedy_is_the_penalised_untempered_distribution():
    torch.manual_seed(2)
    logits, seen = torch.randn(3, V), torch.rand(3, V) < 0.5
    cfg = SamplingConfig(temperature=0.0, repetition_penalty=1.4, top_k=2)
    torch.testing.assert_close(processed_logprobs(logits, cfg, seen), F.log_softmax(penalise(logits, seen, 1.4), -1))


def test_what_counts_as_processing_and_bad_input():
    assert not processes(SamplingConfig(temperature=0.7))
    assert all(processes(SamplingConfig(**kw)) for kw in CONFIGS)
    with pytest.raises(ValueError, match="seen"):
        processed_logprobs(torch.zeros(1, V), SamplingConfig(repetition_penalty=1.1))
