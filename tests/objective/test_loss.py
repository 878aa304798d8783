"""The unified objective, pinned by value and by per-token gradient.

Oracles are slow loops over (i, t) in float64, written from the papers' own formulas:
eq. 4 for CISPO, PPO's min(r*A, clip(r)*A) for PPO / GRPO / DAPO, GSPO's sequence-level
min(s*A, clip(s)*A), and the IS-weighted policy gradient r*A for REINFORCE.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cispo.objective.advantages import group_advantages
from cispo.objective.loss import PRESETS, ObjectiveConfig, ObjectiveStats, aggregate, kl_penalty, policy_loss, preset


@pytest.fixture(autouse=True, scope="module")
def float64_default():
    """The oracles are float64; restore the default so other test modules see float32."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


# ---------------------------------------------------------------------------------------
# Oracles: the papers' formulas, one (i, t) at a time. Each returns J (to maximise).
# ---------------------------------------------------------------------------------------


def _lengths(mask):
    return [int(mask[i].sum()) for i in range(mask.shape[0])]


def _clip(x, lo, hi):
    return torch.clamp(x, lo, hi)


def oracle_cispo(lp, lo, A, mask, eps_high_is):
    """eq. 4: 1/sum|o_i| sum_i sum_t sg(min(r_it, 1 + eps_high_is)) A_i log pi_it."""
    total, n = 0.0, sum(_lengths(mask))
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if mask[i, t]:
                r = torch.exp(lp[i, t] - lo[i, t]).detach()
                w = torch.minimum(r, torch.tensor(1.0 + eps_high_is))
                total = total + w * A[i] * lp[i, t]
    return total / n


def oracle_ppo_token(lp, lo, A, mask, eps_low, eps_high, seq_mean):
    """PPO-clip: min(r A, clip(r, 1-eps_low, 1+eps_high) A); token-mean or seq-mean-token-mean."""
    lengths = _lengths(mask)
    per_seq, total = [], 0.0
    for i in range(lp.shape[0]):
        s = 0.0
        for t in range(lp.shape[1]):
            if mask[i, t]:
                r = torch.exp(lp[i, t] - lo[i, t])
                s = s + torch.minimum(r * A[i], _clip(r, 1 - eps_low, 1 + eps_high) * A[i])
        per_seq.append(s)
        total = total + s
    if seq_mean:
        seqs = [s / L for s, L in zip(per_seq, lengths) if L > 0]
        return sum(seqs) / len(seqs)
    return total / sum(lengths)


def oracle_gspo(lp, lo, A, mask, eps_low, eps_high):
    """GSPO: 1/G sum_i min(s_i A_i, clip(s_i) A_i), s_i = exp(1/|o_i| sum_t log r_it)."""
    terms = []
    for i in range(lp.shape[0]):
        toks = [lp[i, t] - lo[i, t] for t in range(lp.shape[1]) if mask[i, t]]
        if not toks:
            continue
        s = torch.exp(sum(toks) / len(toks))
        terms.append(torch.minimum(s * A[i], _clip(s, 1 - eps_low, 1 + eps_high) * A[i]))
    return sum(terms) / len(terms)


def oracle_reinforce(lp, lo, A, mask):
    """IS-weighted policy gradient: 1/sum|o_i| sum r_it A_i (gradient r A grad log pi)."""
    total = 0.0
    for i in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if mask[i, t]:
                total = total + torch.exp(lp[i, t] - lo[i, t]) * A[i]
    return total / sum(_lengths(mask))


def oracle_eq6(lp, lo, A, mask, cfg):
    """The value of eq. 6 itself: -agg(sg(w) A log pi M), written as a loop."""
    lengths = _lengths(mask)
    seq_terms = []
    for i in range(lp.shape[0]):
        toks = [t for t in range(lp.shape[1]) if mask[i, t]]
        if cfg.ratio_level == "sequence" and toks:
            seq_log_r = sum(float(lp[i, t] - lo[i, t]) for t in toks) / len(toks)
        s = 0.0
        for t in toks:
            log_r = seq_log_r if cfg.ratio_level == "sequence" else float(lp[i, t] - lo[i, t])
            r = math.exp(log_r)
            w = r
            neg = cfg.is_bounds_by_sign and A[i] < 0  # DISPO: an incorrect response's own bounds
            high, low = (cfg.eps_high_is_neg, cfg.eps_low_is_neg) if neg else (cfg.eps_high_is, cfg.eps_low_is)
            if high is not None:
                w = min(w, 1 + high)
            if low is not None:
                w = max(w, 1 - low)
            m = 1.0
            upper, lower = A[i] > 0 and r > 1 + cfg.eps_high, A[i] < 0 and r < 1 - cfg.eps_low
            if (cfg.mask_rule in ("ppo", "ppo-high") and upper) or (cfg.mask_rule in ("ppo", "ppo-low") and lower):
                m = 0.0
            if cfg.mask_rule.startswith("dppo-") and not dppo_keeps(float(lp[i, t]), float(lo[i, t]), float(A[i]),
                                                                    cfg.mask_rule, cfg.delta_low, cfg.delta_high):
                m = 0.0
            s += w * float(A[i]) * float(lp[i, t]) * m
        seq_terms.append((s, len(toks)))
    if cfg.aggregation == "token-mean":
        return -sum(s for s, _ in seq_terms) / sum(lengths)
    live = [(s, L) for s, L in seq_terms if L > 0]
    if cfg.aggregation == "seq-mean-token-mean":
        return -sum(s / L for s, L in live) / len(live)
    return -sum(s for s, _ in live) / (len(live) * cfg.token_sum_norm)


def dppo_keeps(logp, logp_old, a, rule, delta_low, delta_high):
    """DPPO's trust region (arXiv 2602.04879) on one token, from p = pi(o_t) and p_old: TV |p - p_old| or the
    binary KL D(Bern(p_old) || Bern(p)) bounded by delta_high where A > 0 (only a rise counts) and by delta_low
    where A <= 0 (only a fall counts)."""
    p, q = math.exp(logp), math.exp(logp_old)
    if rule == "dppo-tv":
        return p - q <= delta_high if a > 0 else q - p <= delta_low
    arg = (1 - q + 1e-8) / (1 - p + 1e-8)  # verl's 1e-8 guard; <= 0 only for a "log-prob" above 0: D is NaN
    d = q * (logp_old - logp) + (1 - q) * math.log(arg) if arg > 0 else math.nan
    return (p <= q or d <= delta_high) if a > 0 else (p >= q or d <= delta_low)


def native_objective(name, lp, lo, A, mask):
    """J of each preset in its own paper's form."""
    cfg = preset(name)
    if name == "cispo":
        return oracle_cispo(lp, lo, A, mask, cfg.eps_high_is)
    if name in ("ppo", "dapo"):
        return oracle_ppo_token(lp, lo, A, mask, cfg.eps_low, cfg.eps_high, seq_mean=False)
    if name == "grpo":
        return oracle_ppo_token(lp, lo, A, mask, cfg.eps_low, cfg.eps_high, seq_mean=True)
    if name == "gspo":
        return oracle_gspo(lp, lo, A, mask, cfg.eps_low, cfg.eps_high)
    if name == "reinforce":
        return oracle_reinforce(lp, lo, A, mask)
    return None  # no paper form of its own (cispo_lowmask, ...): test_objective_halves.py pins its gradient


def random_batch(seed, B, T, lengths=None, spread=0.5):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(B, T, generator=g) * 3  # log pi_new in (-3, 0)
    lo = lp + spread * torch.randn(B, T, generator=g)  # log r ~ N(0, spread^2)
    A = torch.randn(B, generator=g)
    if lengths is None:
        lengths = torch.randint(1, T + 1, (B,), generator=g).tolist()
    mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).double()
    return lp, lo, A, mask


def grad_of(fn, lp):
    lp = lp.detach().clone().requires_grad_(True)
    out = fn(lp)
    out.backward()
    return out.detach(), lp.grad


# ---------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------


def test_preset_table_is_exact():
    c = preset("cispo")
    assert (c.ratio_level, c.eps_low_is, c.eps_high_is, c.mask_rule, c.aggregation) == (
        "token", None, 4.0, "none", "token-mean")
    g = preset("grpo")
    assert (g.ratio_level, g.eps_low_is, g.eps_high_is, g.mask_rule, g.eps_low, g.eps_high, g.aggregation) == (
        "token", None, None, "ppo", 0.2, 0.2, "seq-mean-token-mean")
    d = preset("dapo")
    assert (d.eps_high_is, d.mask_rule, d.eps_low, d.eps_high, d.aggregation) == (None, "ppo", 0.2, 0.28, "token-mean")
    s = preset("gspo")
    assert (s.ratio_level, s.eps_high_is, s.mask_rule, s.eps_low, s.eps_high, s.aggregation) == (
        "sequence", None, "ppo", 3e-4, 4e-4, "seq-mean-token-mean")
    r = preset("reinforce")
    assert (r.ratio_level, r.eps_low_is, r.eps_high_is, r.mask_rule, r.aggregation) == (
        "token", None, None, "none", "token-mean")
    assert all(p.kl_coef == 0 for p in PRESETS.values())
    assert ObjectiveConfig() == c


def test_preset_overrides_and_errors():
    assert preset("cispo", eps_high_is=2.0).eps_high_is == 2.0
    assert preset("cispo").eps_high_is == 4.0  # presets are not mutated
    with pytest.raises(ValueError, match="did you mean 'cispo'"):
        preset("cipso")
    with pytest.raises(ValueError, match="did you mean 'eps_high_is'"):
        preset("cispo", eps_hi_is=1.0)
    with pytest.raises(ValueError, match="eps_high_is"):
        preset("cispo", eps_high_is=-1.0)
    with pytest.raises(ValueError, match="aggregation"):
        ObjectiveConfig(aggregation="token_mean")
    with pytest.raises(ValueError, match="mask_rule"):
        ObjectiveConfig(mask_rule="clip")
    with pytest.raises(ValueError, match="token_sum_norm"):
        ObjectiveConfig(token_sum_norm=0.0)
    with pytest.raises(ValueError, match="kl_coef"):
        ObjectiveConfig(kl_coef=float("nan"))


# ---------------------------------------------------------------------------------------
# Per-token gradients against the closed form
# ---------------------------------------------------------------------------------------


def one_token_grad(name, log_r, A, **overrides):
    """d loss / d log pi for a single response token with ratio exp(log_r)."""
    lp = torch.tensor([[-1.0]])
    lo = lp - log_r
    _, grad = grad_of(lambda x: policy_loss(x, lo, torch.tensor([A]), torch.ones(1, 1), preset(name, **overrides))[0],
                      lp)
    return grad.item()


@pytest.mark.parametrize("A", [1.5, -0.7])
def test_cispo_capped_token_keeps_capped_gradient(A):
    # r = e^2 = 7.39 > 1 + 4: weight capped at 5, gradient of the loss is -5 * A (not 0).
    assert one_token_grad("cispo", 2.0, A) == pytest.approx(-5.0 * A, abs=1e-12)
    # r = e^1 = 2.72 inside the cap: -r * A.
    assert one_token_grad("cispo", 1.0, A) == pytest.approx(-math.e * A, abs=1e-12)
    # r small: no lower bound in CISPO, the weight is r itself.
    assert one_token_grad("cispo", -3.0, A) == pytest.approx(-math.exp(-3.0) * A, abs=1e-12)
    # a custom cap and a lower bound
    assert one_token_grad("cispo", 2.0, A, eps_high_is=1.0) == pytest.approx(-2.0 * A, abs=1e-12)
    assert one_token_grad("cispo", -3.0, A, eps_low_is=0.5) == pytest.approx(-0.5 * A, abs=1e-12)


@pytest.mark.parametrize("name", ["ppo", "grpo", "dapo"])
def test_ppo_family_drops_out_of_region_tokens(name):
    cfg = preset(name)
    # A > 0 and r above 1 + eps_high: exactly zero
    assert one_token_grad(name, math.log(1 + cfg.eps_high) + 0.01, 1.3) == 0.0
    # A < 0 and r below 1 - eps_low: exactly zero
    assert one_token_grad(name, math.log(1 - cfg.eps_low) - 0.01, -1.3) == 0.0
    # the other two corners keep r * A (PPO's min picks the unclipped term)
    log_r = math.log(1 + cfg.eps_high) + 0.3
    assert one_token_grad(name, log_r, -1.3) == pytest.approx(-math.exp(log_r) * -1.3, abs=1e-12)
    log_r = math.log(1 - cfg.eps_low) - 0.3
    assert one_token_grad(name, log_r, 1.3) == pytest.approx(-math.exp(log_r) * 1.3, abs=1e-12)


def test_dapo_clip_higher_keeps_tokens_grpo_drops():
    log_r = math.log(1.25)  # between 1 + 0.2 and 1 + 0.28
    assert one_token_grad("grpo", log_r, 1.0) == 0.0
    assert one_token_grad("dapo", log_r, 1.0) == pytest.approx(-1.25, abs=1e-12)
    assert one_token_grad("cispo", log_r, 1.0) == pytest.approx(-1.25, abs=1e-12)


def test_inside_bounds_cispo_equals_ppo():
    lp, lo, A, mask = random_batch(3, 4, 6, spread=0.05)  # all |log r| small: r in (0.8, 1.2)
    ratio = torch.exp(lp - lo)[mask.bool()]
    assert ((ratio > 0.8) & (ratio < 1.2)).all()
    l1, g1 = grad_of(lambda x: policy_loss(x, lo, A, mask, preset("cispo"))[0], lp)
    l2, g2 = grad_of(lambda x: policy_loss(x, lo, A, mask, preset("ppo"))[0], lp)
    assert torch.allclose(g1, g2, rtol=0, atol=1e-15)
    assert torch.allclose(l1, l2)


def test_no_gradient_through_the_weight():
    # If w were not detached, d/dlogp of w*A*logp would be w*A*(1 + logp) inside the cap.
    lp, lo, A, mask = random_batch(4, 3, 5)
    N = mask.sum()
    for name in PRESETS:
        if preset(name).ratio_level == "sequence":
            continue
        _, g = grad_of(lambda x: policy_loss(x, lo, A, mask, preset(name, mask_rule="none"))[0], lp)
        cfg = preset(name)
        r = torch.exp(lp - lo)
        w = r.clamp(max=1 + cfg.eps_high_is) if cfg.eps_high_is is not None else r
        expected = -w * A[:, None] * mask
        if cfg.aggregation == "token-mean":
            expected = expected / N
        else:
            expected = expected / (mask.sum(-1, keepdim=True) * mask.shape[0])
        assert torch.allclose(g, expected, atol=1e-14), name


def test_gspo_gradient_is_sequence_weighted():
    lp, lo, A, mask = random_batch(5, 3, 4)
    cfg = preset("gspo", mask_rule="none")
    _, g = grad_of(lambda x: policy_loss(x, lo, A, mask, cfg)[0], lp)
    L = mask.sum(-1, keepdim=True)
    s = torch.exp(((lp - lo) * mask).sum(-1, keepdim=True) / L)
    expected = -s * A[:, None] * mask / (L * mask.shape[0])
    assert torch.allclose(g, expected, atol=1e-14)


def test_cispo_with_unit_ratio_equals_reinforce():
    lp, _, A, mask = random_batch(6, 4, 7)
    l1, g1 = grad_of(lambda x: policy_loss(x, lp.detach(), A, mask, preset("cispo"))[0], lp)
    l2, g2 = grad_of(lambda x: policy_loss(x, lp.detach(), A, mask, preset("reinforce"))[0], lp)
    assert torch.equal(l1, l2) and torch.equal(g1, g2)
    # ... and the plain policy gradient: -A / N per token
    assert torch.allclose(g1, -A[:, None] * mask / mask.sum(), atol=1e-15)


# ---------------------------------------------------------------------------------------
# Every preset against its paper's formula, on ragged random batches
# ---------------------------------------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), B=st.integers(1, 5), T=st.integers(1, 7), spread=st.sampled_from([0.05, 0.3, 1.5]))
def test_every_preset_matches_its_oracle(seed, B, T, spread):
    lp, lo, A, mask = random_batch(seed, B, T, spread=spread)
    for name in PRESETS:
        cfg = preset(name)
        loss, g = grad_of(lambda x: policy_loss(x, lo, A, mask, cfg)[0], lp)
        # value: eq. 6 in a loop
        assert loss.item() == pytest.approx(oracle_eq6(lp, lo, A, mask, cfg), rel=1e-10, abs=1e-12), name
        # gradient: the paper's own surrogate
        if native_objective(name, lp, lo, A, mask) is not None:
            _, g_ref = grad_of(lambda x: -native_objective(name, x, lo, A, mask), lp)
            assert torch.allclose(g, g_ref, rtol=1e-10, atol=1e-13), name


@settings(max_examples=10, deadline=None)
@given(seed=st.integers(0, 10_000), B=st.integers(1, 4), T=st.integers(1, 6))
def test_token_sum_norm_and_two_sided_is_against_loop(seed, B, T):
    lp, lo, A, mask = random_batch(seed, B, T, spread=1.0)
    for cfg in (
        preset("cispo", aggregation="seq-mean-token-sum-norm", token_sum_norm=9.0),
        preset("cispo", eps_low_is=0.2, eps_high_is=0.2),  # the two-sided variant some frameworks ship
        preset("dapo", aggregation="seq-mean-token-sum-norm", token_sum_norm=9.0),
        preset("reinforce", aggregation="seq-mean-token-mean"),
    ):
        loss, _ = policy_loss(lp, lo, A, mask, cfg)
        assert loss.item() == pytest.approx(oracle_eq6(lp, lo, A, mask, cfg), rel=1e-10, abs=1e-12)


def test_token_level_advantages_are_used_per_token():
    lp, lo, _, mask = random_batch(8, 3, 5)
    A_tok = torch.randn(3, 5, generator=torch.Generator().manual_seed(1))
    _, g = grad_of(lambda x: policy_loss(x, lo, A_tok, mask, preset("reinforce"))[0], lp)
    assert torch.allclose(g, -torch.exp(lp - lo) * A_tok * mask / mask.sum(), atol=1e-15)


# ---------------------------------------------------------------------------------------
# Padding, splitting, extremes
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(PRESETS))
def test_padding_invariance(name):
    lp, lo, A, mask = random_batch(11, 4, 5)
    cfg = preset(name, token_sum_norm=7.0)
    l1, g1 = grad_of(lambda x: policy_loss(x, lo, A, mask, cfg)[0], lp)
    # garbage (incl. inf / nan) in padding columns and in padded positions
    pad = torch.full((4, 3), float("nan"))
    lp2 = torch.cat([lp, pad], 1)
    lp2 = torch.where(torch.cat([mask, torch.zeros(4, 3)], 1).bool(), lp2, float("-inf"))
    lo2 = torch.cat([lo, torch.full((4, 3), 123.0)], 1)
    mask2 = torch.cat([mask, torch.zeros(4, 3)], 1)
    l2, g2 = grad_of(lambda x: policy_loss(x, lo2, A, mask2, cfg)[0], lp2)
    assert torch.allclose(l1, l2, atol=1e-14)
    assert torch.allclose(g2[:, :5], g1, atol=1e-15)
    assert (g2[~mask2.bool()] == 0).all()


@pytest.mark.parametrize("name", list(PRESETS))
def test_split_batch_equals_full_batch(name):
    lp, lo, A, mask = random_batch(12, 6, 5)
    cfg = preset(name, token_sum_norm=5.0)
    if name != "gspo":
        cfg = preset(name, token_sum_norm=5.0, kl_coef=0.1)
    logp_ref = lp.detach() + 0.1
    l_full, g_full = grad_of(lambda x: policy_loss(x, lo, A, mask, cfg, logp_ref=logp_ref)[0], lp)
    N, S = mask.sum(), (mask.sum(-1) > 0).sum()

    def split_loss(x):
        total = 0.0
        for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
            # micro-batches trimmed to their own length, as a trainer would
            T = int(mask[rows].sum(-1).max())
            total = total + policy_loss(
                x[rows, :T], lo[rows, :T], A[rows], mask[rows, :T], cfg,
                num_tokens=N, logp_ref=logp_ref[rows, :T], num_seqs=S,
            )[0]
        return total

    l_split, g_split = grad_of(split_loss, lp)
    assert torch.allclose(l_full, l_split, atol=1e-14)
    assert torch.allclose(g_full, g_split, atol=1e-15)


@pytest.mark.parametrize("name", list(PRESETS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_extreme_log_ratios_stay_finite(name, dtype):
    lp = torch.tensor([[-1.0, -2.0, -30.0, -0.5]], dtype=dtype)
    lo = lp - torch.tensor([[50.0, -50.0, 50.0, -50.0]], dtype=dtype)
    lp = lp.repeat(2, 1)
    lo = lo.repeat(2, 1)
    A = torch.tensor([1.0, -1.0], dtype=dtype)
    mask = torch.ones(2, 4, dtype=dtype)
    cfg = preset(name, kl_coef=0.1)
    x = lp.clone().requires_grad_(True)
    loss, stats = policy_loss(x, lo, A, mask, cfg, logp_ref=lo)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all()
    assert all(math.isfinite(v) for v in stats.to_dict().values())


def test_max_log_ratio_guard_can_be_disabled():
    lp = torch.tensor([[-1.0]])
    lo = lp - 30.0
    A = torch.tensor([-1.0])
    g_guard = grad_of(lambda x: policy_loss(x, lo, A, torch.ones(1, 1), preset("reinforce"))[0], lp)[1]
    g_raw = grad_of(lambda x: policy_loss(x, lo, A, torch.ones(1, 1), preset("reinforce", max_log_ratio=None))[0],
                    lp)[1]
    assert g_guard.item() == pytest.approx(math.exp(20.0))
    assert g_raw.item() == pytest.approx(math.exp(30.0))


# ---------------------------------------------------------------------------------------
# KL term and aggregation
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_kl_term_value_and_gradient(estimator):
    lp, lo, A, mask = random_batch(13, 3, 4)
    ref = lp.detach() + 0.3 * torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    base = preset("reinforce")
    with_kl = preset("reinforce", kl_coef=0.5, kl_estimator=estimator)
    l0, g0 = grad_of(lambda x: policy_loss(x, lo, A, mask, base)[0], lp)
    l1, g1 = grad_of(lambda x: policy_loss(x, lo, A, mask, with_kl, logp_ref=ref)[0], lp)
    d = ref - lp
    if estimator == "k1":
        kl, dkl = -d, torch.ones_like(d)
    else:
        kl, dkl = torch.exp(d) - 1 - d, 1 - torch.exp(d)
    N = mask.sum()
    assert l1.item() == pytest.approx(l0.item() + 0.5 * (kl * mask).sum().item() / N.item(), rel=1e-12)
    assert torch.allclose(g1 - g0, 0.5 * dkl * mask / N, atol=1e-15)
    with pytest.raises(ValueError, match="logp_ref"):
        policy_loss(lp, lo, A, mask, with_kl)


def test_kl_penalty_is_zero_at_reference():
    x = torch.randn(2, 3)
    assert torch.equal(kl_penalty(x, x, "k3"), torch.zeros(2, 3))
    assert torch.equal(kl_penalty(x, x, "k1"), torch.zeros(2, 3))


def test_aggregate_hand_computed():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert aggregate(x, m, "token-mean").item() == pytest.approx(10 / 4)  # (1+2+3+4) / 4
    assert aggregate(x, m, "seq-mean-token-mean").item() == pytest.approx((6 / 3 + 4 / 1) / 2)  # (2 + 4) / 2
    assert aggregate(x, m, "seq-mean-token-sum-norm", token_sum_norm=5).item() == pytest.approx(10 / (2 * 5))
    assert aggregate(x, m, "seq-mean-token-sum-norm").item() == pytest.approx(10 / (2 * 3))  # norm = T


# ---------------------------------------------------------------------------------------
# Stats
# ---------------------------------------------------------------------------------------


def test_stats_hand_computed():
    # 5 response tokens + 1 padding. log r chosen per token; p_old from logp_old.
    r = torch.tensor([[6.0, 1.1, 1.25, 0.7, 1.0, 9.0]])
    logp_old = torch.log(torch.tensor([[0.05, 0.5, 0.02, 0.5, 0.9, 0.5]]))
    lp = logp_old + torch.log(r)
    mask = torch.tensor([[1.0, 1, 1, 1, 1, 0]])
    A = torch.tensor([[1.0, 1.0, 1.0, -1.0, 1.0, 1.0]])
    _, s = policy_loss(lp, logp_old, A, mask, preset("cispo"))
    # capped: only r=6 (> 5) among response tokens -> 1/5
    assert s.frac_capped == pytest.approx(1 / 5)
    # PPO mask (0.2/0.2) would drop: r=6 (A>0), r=1.25 (A>0), r=0.7 (A<0) -> 3/5
    assert s.frac_ppo_dropped == pytest.approx(3 / 5)
    # low-prob tokens (p_old < 0.1): r=6 and r=1.25, both dropped -> 2/2
    assert s.frac_ppo_dropped_low_prob == pytest.approx(1.0)
    assert (s.num_tokens, s.num_low_prob_tokens) == (5, 2)
    assert s.ratio_mean == pytest.approx((6 + 1.1 + 1.25 + 0.7 + 1.0) / 5)
    assert (s.ratio_min, s.ratio_max) == (pytest.approx(0.7), pytest.approx(6.0))
    k3 = sum(x - 1 - math.log(x) for x in (6.0, 1.1, 1.25, 0.7, 1.0)) / 5
    assert s.approx_kl == pytest.approx(k3)
    # DAPO's wider upper edge keeps r=1.25
    _, s = policy_loss(lp, logp_old, A, mask, preset("dapo"))
    assert s.frac_ppo_dropped == pytest.approx(2 / 5) and s.frac_capped == 0.0


def test_stats_of_empty_batch_are_finite():
    lp = torch.zeros(2, 3, requires_grad=True)
    loss, s = policy_loss(lp, torch.zeros(2, 3), torch.zeros(2), torch.zeros(2, 3), preset("cispo"))
    loss.backward()
    assert loss.item() == 0.0 and s.num_tokens == 0
    assert all(math.isfinite(v) for v in s.to_dict().values())


def test_shape_errors():
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(lp, lp, torch.zeros(3), torch.ones(2, 3), preset("cispo"))
    with pytest.raises(ValueError, match="logp_old"):
        policy_loss(lp, torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3), preset("cispo"))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        policy_loss(torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.ones(3), preset("cispo"))


# ---------------------------------------------------------------------------------------
# Advantages
# ---------------------------------------------------------------------------------------


def test_group_advantages_hand_computed():
    R = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.3, 0.3, 0.3, 0.3])
    # group 1: mean 0.5, unbiased std sqrt(1/3)
    std = math.sqrt(1 / 3)
    a = group_advantages(R, 4, "grpo")
    assert torch.allclose(a[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std + 1e-6))
    assert torch.equal(a[4:], torch.zeros(4))  # zero-variance group: exactly 0
    assert torch.allclose(group_advantages(R, 4, "drgrpo")[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    # rloo: R_i - mean of the other three: 1 - 1/3, 0 - 2/3, ...
    assert torch.allclose(group_advantages(R, 4, "rloo")[:4], torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3]))
    for est in ("grpo", "drgrpo", "rloo"):
        a = group_advantages(torch.full((6,), 0.1), 3, est)  # 0.1 * 3 / 3 != 0.1 in floats
        assert torch.equal(a, torch.zeros(6)) and not torch.isnan(a).any()


def test_group_advantages_errors():
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(torch.zeros(4), 1)
    with pytest.raises(ValueError, match="multiple"):
        group_advantages(torch.zeros(5), 2)
    with pytest.raises(ValueError, match="estimator"):
        group_advantages(torch.zeros(4), 2, "ppo")


# ---------------------------------------------------------------------------------------
# ObjectiveStats: the per-token flags, the one list of diagnostics, merging micro-batches
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["cispo", "dapo", "gspo"])
def test_stats_flags_are_the_masks_behind_the_fractions(name):
    """``capped`` / ``ppo_dropped`` are eq. 5's and eq. 7's per-token flags: their means over
    response tokens are frac_capped / frac_ppo_dropped, padding is never flagged, and the
    dropped tokens are exactly the M = 0 tokens of ppo_token_mask."""
    from cispo.objective.loss import log_ratio, ppo_token_mask

    lp, lo, A, mask = random_batch(3, 6, 9, spread=1.0)
    cfg = preset(name, eps_high_is=0.5, eps_low_is=0.3) if name == "cispo" else preset(name)
    _, s = policy_loss(lp, lo, A, mask, cfg)
    n = mask.sum()
    assert s.capped.dtype == s.ppo_dropped.dtype == torch.bool and s.capped.shape == mask.shape
    assert not (s.capped | s.ppo_dropped)[mask == 0].any()
    assert float(s.capped.sum() / n) == pytest.approx(s.frac_capped)
    assert float(s.ppo_dropped.sum() / n) == pytest.approx(s.frac_ppo_dropped)
    assert s.ppo_dropped.any() and s.capped.any() == (name == "cispo")  # the PPO presets never cap
    ratio = torch.exp(log_ratio(lp, lo, mask, cfg.ratio_level, cfg.max_log_ratio))
    want = (ppo_token_mask(ratio, A[:, None].expand_as(ratio), cfg.eps_low, cfg.eps_high) == 0) & mask.bool()
    assert torch.equal(s.ppo_dropped, want)
    assert "capped" not in s.to_dict() and set(s.to_dict()) == set(ObjectiveStats.SCALARS)
    assert set(ObjectiveStats.DIAGNOSTICS) <= set(ObjectiveStats.SCALARS)
    assert s.to_dict("cispo/", keys=ObjectiveStats.DIAGNOSTICS) == {
        f"cispo/{k}": getattr(s, k) for k in ObjectiveStats.DIAGNOSTICS}


def test_merged_micro_batch_stats_equal_the_whole_batch():
    """Two micro-batches normalised by the whole batch's token count, merged, give the whole
    batch's statistics (loss summed, fractions and means token-weighted, extremes over parts)."""
    lp, lo, A, mask = random_batch(5, 8, 7, spread=1.0)
    cfg = preset("cispo", eps_high_is=0.5)
    _, whole = policy_loss(lp, lo, A, mask, cfg)
    n = mask.sum()
    parts = [policy_loss(lp[r], lo[r], A[r], mask[r], cfg, num_tokens=n)[1] for r in (slice(0, 3), slice(3, 8))]
    merged = ObjectiveStats.merge(parts)
    assert merged.capped is None and merged.ppo_dropped is None
    for key in ObjectiveStats.SCALARS:
        assert getattr(merged, key) == pytest.approx(getattr(whole, key), rel=1e-6, abs=1e-7), key  # stats: fp32
