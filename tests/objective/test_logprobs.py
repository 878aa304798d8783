"""Tests for cispo.objective.logprobs: chunked token log-probs / entropy against the naive reference."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cispo.objective.logprobs import naive_token_logprobs, token_logprobs

TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-4, atol=1e-5)}


def make(shape=(37,), H=8, V=50, dtype=torch.float64, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, H, generator=g, dtype=torch.float64).to(dtype)
    weight = torch.randn(V, H, generator=g, dtype=torch.float64).to(dtype)
    b = torch.randn(V, generator=g, dtype=torch.float64).to(dtype) if bias else None
    targets = torch.randint(0, V, shape, generator=g)
    return hidden, weight, b, targets


def leaves(hidden, weight, bias):
    out = [hidden.clone().requires_grad_(), weight.clone().requires_grad_()]
    out.append(None if bias is None else bias.clone().requires_grad_())
    return out


def run_both(fn, hidden, weight, bias, targets, g_logp, g_ent, **kw):
    """Forward + backward with upstream grads; returns (logp, ent, grads)."""
    h, w, b = leaves(hidden, weight, bias)
    logp, ent = fn(h, w, targets, bias=b, with_entropy=True, **kw)
    loss = (logp * g_logp).sum()
    if g_ent is not None:
        loss = loss + (ent * g_ent).sum()
    loss.backward()
    grads = [t.grad for t in (h, w, b) if t is not None]
    return logp.detach(), ent.detach(), grads


def assert_match(hidden, weight, bias, targets, dtype, chunk_size, temperature=1.0, ent_grad=True):
    g = torch.Generator().manual_seed(1)
    g_logp = torch.randn(targets.shape, generator=g, dtype=torch.float64).to(dtype)
    g_ent = torch.randn(targets.shape, generator=g, dtype=torch.float64).to(dtype) if ent_grad else None
    a = run_both(token_logprobs, hidden, weight, bias, targets, g_logp, g_ent,
                 temperature=temperature, chunk_size=chunk_size)
    r = run_both(naive_token_logprobs, hidden, weight, bias, targets, g_logp, g_ent,
                 temperature=temperature)
    tol = TOL[dtype]
    torch.testing.assert_close(a[0], r[0], **tol)
    torch.testing.assert_close(a[1], r[1], **tol)
    assert len(a[2]) == len(r[2])
    for ga, gr in zip(a[2], r[2]):
        torch.testing.assert_close(ga, gr, **tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("chunk_size", [1, 8, 37, 100])
@pytest.mark.parametrize("ent_grad", [True, False])
def test_matches_naive_values_and_grads(dtype, chunk_size, ent_grad):
    hidden, weight, bias, targets = make(dtype=dtype)
    assert_match(hidden, weight, bias, targets, dtype, chunk_size, ent_grad=ent_grad)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_3d_inputs_no_bias_temperature(dtype):
    hidden, weight, bias, targets = make(shape=(3, 7), bias=False, dtype=dtype)
    assert_match(hidden, weight, bias, targets, dtype, chunk_size=4, temperature=0.7)
    hidden, weight, bias, targets = make(shape=(2, 5), bias=True, dtype=dtype, seed=3)
    assert_match(hidden, weight, bias, targets, dtype, chunk_size=3, temperature=1.9)


def test_output_shapes_and_single_output():
    hidden, weight, bias, targets = make(shape=(2, 3, 4))
    logp = token_logprobs(hidden, weight, targets, bias=bias, chunk_size=5)
    assert isinstance(logp, torch.Tensor) and logp.shape == (2, 3, 4)
    assert (logp <= 0).all()
    logp2, ent = token_logprobs(hidden, weight, targets, bias=bias, chunk_size=5, with_entropy=True)
    assert ent.shape == (2, 3, 4) and (ent >= 0).all()
    torch.testing.assert_close(logp, logp2, rtol=0, atol=0)


def test_only_entropy_grad():
    hidden, weight, bias, targets = make()
    h, w, b = leaves(hidden, weight, bias)
    _, ent = token_logprobs(h, w, targets, bias=b, chunk_size=8, with_entropy=True)
    ent.sum().backward()
    h2, w2, b2 = leaves(hidden, weight, bias)
    _, ent2 = naive_token_logprobs(h2, w2, targets, bias=b2, with_entropy=True)
    ent2.sum().backward()
    for x, y in ((h, h2), (w, w2), (b, b2)):
        torch.testing.assert_close(x.grad, y.grad, **TOL[torch.float64])


def test_partial_requires_grad():
    hidden, weight, bias, targets = make()
    h = hidden.clone().requires_grad_()
    token_logprobs(h, weight, targets, bias=bias, chunk_size=8).sum().backward()
    h2 = hidden.clone().requires_grad_()
    naive_token_logprobs(h2, weight, targets, bias=bias).sum().backward()
    torch.testing.assert_close(h.grad, h2.grad, **TOL[torch.float64])


def test_gradcheck():
    hidden, weight, bias, targets = make(shape=(5,), H=3, V=6)
    h, w, b = leaves(hidden, weight, bias)
    def fn(h, w, b):
        return token_logprobs(h, w, targets, bias=b, temperature=0.8, chunk_size=2, with_entropy=True)

    assert torch.autograd.gradcheck(fn, (h, w, b))


def test_bf16_fp32_head():
    hidden, weight, bias, targets = make(shape=(4, 6), H=16, V=40, dtype=torch.bfloat16)
    h, w, b = leaves(hidden, weight, bias)
    logp, ent = token_logprobs(h, w, targets, bias=b, chunk_size=7, with_entropy=True)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    (logp.sum() + ent.sum()).backward()
    assert h.grad.dtype == w.grad.dtype == b.grad.dtype == torch.bfloat16
    # Same bf16 values, computed naively in fp32.
    hf, wf, bf = leaves(hidden.float(), weight.float(), bias.float())
    rlogp, rent = naive_token_logprobs(hf, wf, targets, bias=bf, with_entropy=True)
    (rlogp.sum() + rent.sum()).backward()
    torch.testing.assert_close(logp, rlogp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, rent, rtol=1e-5, atol=1e-5)
    # Gradients are rounded to bf16 at the end only.
    for x, y in ((h, hf), (w, wf), (b, bf)):
        torch.testing.assert_close(x.grad, y.grad.to(torch.bfloat16), rtol=1e-2, atol=1e-2)


def test_bf16_no_fp32_head_is_close_and_float32_output():
    hidden, weight, bias, targets = make(shape=(20,), H=16, V=40, dtype=torch.bfloat16)
    logp = token_logprobs(hidden, weight, targets, bias=bias, fp32_head=False, chunk_size=6)
    ref = naive_token_logprobs(hidden.float(), weight.float(), targets, bias=bias.float())
    assert logp.dtype == torch.float32
    torch.testing.assert_close(logp, ref, rtol=0.05, atol=0.3)


def test_float64_stays_float64_with_fp32_head():
    hidden, weight, bias, targets = make()
    assert token_logprobs(hidden, weight, targets, bias=bias).dtype == torch.float64


def _saved_numels(fn):
    numels = []

    def pack(t):
        numels.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return numels


def test_forward_does_not_save_full_logits():
    N, H, V = 64, 4, 100  # N * V = 6400 > every input
    hidden, weight, bias, targets = make(shape=(N,), H=H, V=V, dtype=torch.float32)
    h, w, b = leaves(hidden, weight, bias)
    saved = _saved_numels(lambda: token_logprobs(h, w, targets, bias=b, chunk_size=16,
                                                 with_entropy=True))
    assert saved and max(saved) < N * V
    # Sanity: the hook does see [N, V] tensors saved by the naive path.
    saved_naive = _saved_numels(lambda: naive_token_logprobs(h, w, targets, bias=b,
                                                             with_entropy=True))
    assert max(saved_naive) >= N * V


@pytest.mark.parametrize("bad", [
    dict(hidden=torch.zeros(4, 3), weight=torch.zeros(5, 2), targets=torch.zeros(4, dtype=torch.long)),
    dict(hidden=torch.zeros(4, 3), weight=torch.zeros(5), targets=torch.zeros(4, dtype=torch.long)),
    dict(hidden=torch.zeros(4, 3), weight=torch.zeros(5, 3), targets=torch.zeros(3, dtype=torch.long)),
    dict(hidden=torch.zeros(2, 4, 3), weight=torch.zeros(5, 3), targets=torch.zeros(8, dtype=torch.long)),
    dict(hidden=torch.zeros(4, 3), weight=torch.zeros(5, 3), targets=torch.zeros(4)),
    dict(hidden=torch.zeros(4, 3), weight=torch.zeros(5, 3), targets=torch.zeros(4, dtype=torch.long),
         bias=torch.zeros(4)),
    dict(hidden=torch.zeros(4, 3), weight=torch.zeros(5, 3), targets=torch.tensor([0, 1, -100, 2])),
    dict(hidden=torch.zeros(4, 3), weight=torch.zeros(5, 3), targets=torch.tensor([0, 1, 5, 2])),
    dict(hidden=torch.zeros(4, 3), weight=torch.zeros(5, 3), targets=torch.zeros(4, dtype=torch.long),
         temperature=0.0),
    dict(hidden=torch.zeros(4, 3), weight=torch.zeros(5, 3), targets=torch.zeros(4, dtype=torch.long),
         chunk_size=0),
])
def test_bad_inputs_raise(bad):
    bad = dict(bad)
    args = (bad.pop("hidden"), bad.pop("weight"), bad.pop("targets"))
    with pytest.raises(ValueError):
        token_logprobs(*args, **bad)
    if "chunk_size" not in bad:  # the reference validates the same way
        with pytest.raises(ValueError):
            naive_token_logprobs(*args, **bad)


def test_empty_input():
    hidden, weight, bias, targets = make(shape=(0,))
    logp, ent = token_logprobs(hidden, weight, targets, bias=bias, with_entropy=True)
    assert logp.shape == (0,) and ent.shape == (0,)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 12), H=st.integers(1, 5), V=st.integers(2, 9), chunk=st.integers(1, 14),
       temp=st.floats(0.3, 3.0), use_bias=st.booleans(), seed=st.integers(0, 1000))
def test_property_matches_naive(n, H, V, chunk, temp, use_bias, seed):
    hidden, weight, bias, targets = make(shape=(n,), H=H, V=V, bias=use_bias, seed=seed)
    assert_match(hidden, weight, bias, targets, torch.float64, chunk, temperature=temp)
