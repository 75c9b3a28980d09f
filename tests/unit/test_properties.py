"""Property-based tests (hypothesis) of every scheme's invariants, on the torch
backend: decode(encode(x)) bounds, selection rules, unbiasedness in
expectation, and the error-feedback conservation law ("nothing lost") over
random sequences of gradients, including steps with NaN/Inf.

Every test is derandomized (fixed seeds: the same examples on every run) and
limited to <= 50 examples.
"""
from __future__ import annotations


import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import reference as R
from hvd_compress import schemes as S
from hvd_compress.backend import TorchBackend
from hvd_compress.compressor import encode_with_residual
from hvd_compress.schemes.base import EncodeContext
from unit_helpers import CASE_IDS, CASES, wire

B = TorchBackend()
f32 = np.float32

SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def fast(n=50):
    return settings(max_examples=n, **SETTINGS)


def floats(lo=-100.0, hi=100.0):
    return st.floats(lo, hi, width=32, allow_nan=False, allow_infinity=False, allow_subnormal=False)


def vectors(min_size=1, max_size=300, lo=-100.0, hi=100.0):
    return st.integers(min_size, max_size).flatmap(
        lambda n: hnp.arrays(np.float32, n, elements=floats(lo, hi)))


def ctx(seed, shared=None, n=None):
    """A context whose draws come from the backend's private generator."""
    return EncodeContext(key="p", step=seed, rank=0, size=1,
                         uniform=lambda k: B.uniform(k, seed, like=torch.zeros(1)),
                         shared_seed=1_000_003 + (seed if shared is None else shared), shape=(n,), state={})


def encode(scheme, x, seed=0, shared=None):
    payload, sent = scheme.encode(B, torch.from_numpy(np.array(x, f32)), ctx(seed, shared, len(x)))
    return payload, sent.numpy()


def decoded(scheme, payload, n):
    """What the other ranks reconstruct from this payload."""
    if scheme.transport == "allreduce":
        local = {k: v for k, v in payload.items() if k.startswith("_")}
        return scheme.decode_reduced(B, payload["reduce"], n, local).numpy()
    return scheme.decode_one(B, wire(payload), n).numpy()


# --- decode(encode(x)) invariants --------------------------------------------------------------------
@fast()
@given(x=vectors(lo=-1e6, hi=1e6), ratio=st.floats(1e-3, 1.0))
def test_topk_keeps_exactly_the_k_largest_magnitudes(x, ratio):
    scheme = S.TopK(ratio)
    payload, sent = encode(scheme, x)
    n, k = x.size, R.k_for(ratio, x.size)
    dec = decoded(scheme, payload, n)
    np.testing.assert_array_equal(dec, sent)
    # which coordinates were kept, whatever the index code: decode the payload
    # with every value replaced by 1
    marked = dict(wire(payload), val=torch.ones_like(payload["val"]))
    kept = np.nonzero(decoded(scheme, marked, n))[0]
    assert kept.size == k
    dropped = np.setdiff1d(np.arange(n), kept)
    if dropped.size:
        assert np.abs(x[kept]).min() >= np.abs(x[dropped]).max()  # ties aside, the k largest
        assert np.all(sent[dropped] == 0)
    np.testing.assert_array_equal(sent[kept], x[kept])  # kept values exact


@fast()
@given(x=vectors(lo=-1e6, hi=1e6), block=st.one_of(st.none(), st.integers(1, 64)))
def test_int8_error_at_most_half_a_step(x, block):
    scheme = S.Int8(block_size=block)
    payload, sent = encode(scheme, x)
    np.testing.assert_array_equal(decoded(scheme, payload, x.size), sent)
    q = payload["q"].numpy().astype(np.int32)
    assert q.min() >= -127 and q.max() <= 127
    bs = x.size if block is None else min(block, x.size)
    nb = -(-x.size // bs)
    scale = payload["scale"].numpy()
    assert scale.size == nb
    per_elem = np.repeat(scale, bs)[:x.size].astype(np.float64)
    amax = np.repeat(np.maximum.reduceat(np.abs(x), np.arange(0, x.size, bs)), bs)[:x.size]
    np.testing.assert_allclose(per_elem[amax > 0], amax[amax > 0] / 127.0, rtol=1e-6)
    err = np.abs(sent.astype(np.float64) - x)
    tol = 0.5 * per_elem * (1 + 1e-6) + 2 * np.spacing(np.abs(x)) + 1e-40
    assert np.all(err <= tol), float((err - tol).max())


@fast()
@given(x=vectors(lo=-1e3, hi=1e3), levels=st.integers(1, 127), seed=st.integers(0, 2**20))
def test_qsgd_error_at_most_one_level(x, levels, seed):
    scheme = S.QSGD(levels)
    payload, sent = encode(scheme, x, seed)
    np.testing.assert_array_equal(decoded(scheme, payload, x.size), sent)
    norm = float(np.linalg.norm(x.astype(np.float64)))
    q = payload["q"].numpy().astype(np.int32)
    assert np.abs(q).max(initial=0) <= levels
    assert np.all((q == 0) | (np.sign(q) == np.sign(x)))  # never flips a sign
    assert np.all(np.abs(sent - x) <= norm / levels * (1 + 1e-5) + 1e-30)


@fast()
@given(x=vectors(lo=-1e3, hi=1e3), seed=st.integers(0, 2**20))
def test_terngrad_is_ternary(x, seed):
    scheme = S.TernGrad()
    payload, sent = encode(scheme, x, seed)
    np.testing.assert_array_equal(decoded(scheme, payload, x.size), sent)
    s = np.abs(x).max()
    assert set(np.unique(sent)) <= {f32(-s), f32(0), f32(s)}
    assert np.all((sent == 0) | (np.sign(sent) == np.sign(x)))
    assert np.all(sent[np.abs(x) == s] == x[np.abs(x) == s])  # the largest is always kept


# --- sign schemes -----------------------------------------------------------------------------------
@fast()
@given(xs=st.lists(vectors(min_size=5, max_size=5), min_size=1, max_size=5))
def test_signsgd_signs_and_majority_vote(xs):
    scheme = S.SignSGD()
    payloads = []
    for x in xs:
        payload, sent = encode(scheme, x)
        np.testing.assert_array_equal(sent, np.where(x >= 0, 1.0, -1.0))  # zero votes +
        np.testing.assert_array_equal(decoded(scheme, payload, x.size), sent)
        payloads.append(wire(payload))
    votes = sum(np.where(x >= 0, 1, -1) for x in xs)
    np.testing.assert_array_equal(scheme.aggregate(B, payloads, 5).numpy(), np.sign(votes))


@fast()
@given(x=vectors(lo=-1e3, hi=1e3))
def test_efsignsgd_scaled_signs(x):
    scheme = S.EFSignSGD()
    payload, sent = encode(scheme, x)
    np.testing.assert_array_equal(decoded(scheme, payload, x.size), sent)
    scale = np.abs(x.astype(np.float64)).mean()
    np.testing.assert_allclose(np.abs(sent), scale, rtol=1e-5, atol=1e-30)
    if scale > 0:
        np.testing.assert_array_equal(np.sign(sent), np.where(x >= 0, 1.0, -1.0))


@fast()
@given(x=vectors(lo=-1e3, hi=1e3))
def test_onebit_two_means_keep_the_sum(x):
    scheme = S.OneBit()
    payload, sent = encode(scheme, x)
    np.testing.assert_array_equal(decoded(scheme, payload, x.size), sent)
    pos = x >= 0
    x64 = x.astype(np.float64)
    if pos.any():
        np.testing.assert_allclose(sent[pos], x64[pos].mean(), rtol=1e-5, atol=1e-6)
        assert np.all(sent[pos] >= 0)
    if (~pos).any():
        np.testing.assert_allclose(sent[~pos], x64[~pos].mean(), rtol=1e-5)
        assert np.all(sent[~pos] < 0)
    scale = np.abs(x64).sum() + 1e-30
    assert abs(sent.astype(np.float64).sum() - x64.sum()) <= 1e-5 * scale  # the sum survives


# --- selections -------------------------------------------------------------------------------------
@fast()
@given(x=vectors(lo=-10, hi=10), tau=st.floats(1e-3, 10.0))
def test_threshold_keeps_exactly_those_above_tau(x, tau):
    scheme = S.Threshold(tau)
    payload, sent = encode(scheme, x)
    keep = np.abs(x) >= f32(tau)
    np.testing.assert_array_equal(np.sort(payload["idx"].numpy()), np.nonzero(keep)[0])
    np.testing.assert_array_equal(sent, np.where(keep, x, 0))
    np.testing.assert_array_equal(decoded(scheme, payload, x.size), sent)


@fast()
@given(x=vectors(max_size=3000, lo=-10, hi=10), ratio=st.floats(1e-3, 1.0), seed=st.integers(0, 2**20))
def test_dgc_keeps_everything_above_its_threshold(x, ratio, seed):
    scheme = S.DGC(ratio)
    payload, sent = encode(scheme, x, seed)
    kept = np.sort(payload["idx"].numpy())
    assert kept.size >= 1  # the threshold is one of the sampled magnitudes
    dropped = np.setdiff1d(np.arange(x.size), kept)
    if dropped.size:
        assert np.abs(x[kept]).min() > np.abs(x[dropped]).max()
    np.testing.assert_array_equal(decoded(scheme, payload, x.size), sent)


# --- unbiasedness, checked statistically ------------------------------------------------------------------
DRAWS = 400
Z = 6.0  # per-element false-alarm rate ~2e-9


def mean_is(samples, expected, var, scale):
    """True if the sample mean is within Z standard errors of ``expected``
    (plus float noise relative to ``scale``)."""
    mean = np.mean(samples, axis=0)
    tol = Z * np.sqrt(var / len(samples)) + 1e-5 * scale + 1e-30
    return bool(np.all(np.abs(mean - expected) <= tol))


def qsgd_samples(x, levels, draws=DRAWS, uniform=None):
    scheme = S.QSGD(levels)
    out = []
    for d in range(draws):
        c = ctx(d, n=x.size)
        if uniform is not None:
            c.uniform = lambda k, d=d: uniform(k, d)
        out.append(scheme.encode(B, torch.from_numpy(x), c)[1].numpy().astype(np.float64))
    return np.stack(out)


def qsgd_moments(x, levels):
    norm = np.linalg.norm(x.astype(np.float64))
    level = np.abs(x) / (norm or 1.0) * levels
    p = level - np.floor(level)
    return x.astype(np.float64), (norm / levels) ** 2 * p * (1 - p), norm


@fast(20)
@given(x=vectors(max_size=16, lo=-10, hi=10), levels=st.integers(1, 127))
def test_qsgd_unbiased(x, levels):
    expected, var, norm = qsgd_moments(x, levels)
    assert mean_is(qsgd_samples(x, levels), expected, var, norm)


def test_unbiasedness_check_can_fail():
    """The check above has power: skewed draws (u**2) bias QSGD's rounding
    and are caught; honest draws of the same size pass."""
    x = np.array([0.3, -0.7, 1.1, 0.2, -0.45], f32)
    expected, var, norm = qsgd_moments(x, 2)
    assert mean_is(qsgd_samples(x, 2), expected, var, norm)
    skewed = qsgd_samples(x, 2, uniform=lambda k, d: B.uniform(k, d, like=torch.zeros(1)) ** 2)
    assert not mean_is(skewed, expected, var, norm)


@fast(20)
@given(x=vectors(max_size=16, lo=-10, hi=10))
def test_terngrad_unbiased(x):
    scheme = S.TernGrad()
    samples = np.stack([scheme.encode(B, torch.from_numpy(x), ctx(d, n=x.size))[1].numpy().astype(np.float64)
                        for d in range(DRAWS)])
    s = float(np.abs(x).max())
    p = np.abs(x) / (s or 1.0)
    assert mean_is(samples, x.astype(np.float64), s * s * p * (1 - p), s)


@fast(20)
@given(x=vectors(min_size=2, max_size=16, lo=-10, hi=10), ratio=st.floats(0.05, 0.9))
def test_randomk_unbiased_after_rescaling(x, ratio):
    """Random-K keeps each coordinate with probability k/n (the same set on
    every rank for one shared seed, a fresh set per step): E[sent] = (k/n) x."""
    scheme = S.RandomK(ratio)
    n = x.size
    k = R.k_for(ratio, n)
    samples = np.stack([scheme.encode(B, torch.from_numpy(x), ctx(0, shared=d, n=n))[1].numpy().astype(np.float64)
                        for d in range(DRAWS)])
    q = k / n
    x64 = x.astype(np.float64)
    assert np.all(np.count_nonzero(samples, axis=1) <= k)
    assert mean_is(samples, q * x64, x64 ** 2 * q * (1 - q), np.abs(x64).max())


# --- error feedback: nothing lost ----------------------------------------------------------------------
def run_feedback(scheme, grads):
    """encode_with_residual over steps; returns (decoded per step, residual per step)."""
    n = grads[0].size
    residual = torch.zeros(n)
    sent, residuals = [], []
    for t, g in enumerate(grads):
        payload, residual = encode_with_residual(B, scheme, torch.from_numpy(g), residual, ctx(t, n=n))
        sent.append(decoded(scheme, payload, n).astype(np.float64))
        residuals.append(residual.numpy().astype(np.float64))
    return sent, residuals


def sequences(min_steps=1, max_steps=6, max_size=200):
    return st.tuples(st.integers(min_steps, max_steps), st.integers(1, max_size)).flatmap(
        lambda tn: st.lists(hnp.arrays(np.float32, tn[1], elements=floats()), min_size=tn[0], max_size=tn[0]))


def conservation_tol(grads, sent):
    mag = sum(np.abs(g.astype(np.float64)) for g in grads) + sum(np.abs(s) for s in sent)
    return 4 * len(grads) * np.finfo(np.float32).eps * (mag + 1.0)


@fast()
@given(case=st.sampled_from(CASE_IDS), grads=sequences())
def test_error_feedback_conservation(case, grads):
    """sum(sent) + final residual == sum(gradients), for every scheme."""
    scheme = CASES[case]()
    sent, residuals = run_feedback(scheme, grads)
    lhs = sum(sent) + residuals[-1]
    rhs = sum(g.astype(np.float64) for g in grads)
    assert np.all(np.abs(lhs - rhs) <= conservation_tol(grads, sent))


def test_error_feedback_conservation_every_scheme():
    """The law for each scheme at least once, whatever hypothesis samples."""
    rng = np.random.default_rng(0)
    grads = [rng.standard_normal(257).astype(f32) for _ in range(5)]
    for case in CASE_IDS:
        sent, residuals = run_feedback(CASES[case](), grads)
        lhs = sum(sent) + residuals[-1]
        rhs = sum(g.astype(np.float64) for g in grads)
        assert np.all(np.abs(lhs - rhs) <= conservation_tol(grads, sent)), case


@fast()
@given(case=st.sampled_from(CASE_IDS), grads=sequences(min_steps=2, max_steps=5), data=st.data(),
       bad=st.sampled_from([np.nan, np.inf, -np.inf]))
def test_nan_step_does_not_poison_the_residual(case, grads, data, bad):
    scheme = CASES[case]()
    grads = [g.copy() for g in grads]
    step = data.draw(st.integers(0, len(grads) - 2), label="bad step")
    pos = data.draw(st.integers(0, grads[0].size - 1), label="bad element")
    grads[step][pos] = bad
    sent, residuals = run_feedback(scheme, grads)
    for r in residuals:
        assert np.all(np.isfinite(r))
    # from the step after the bad one, the law holds again
    after = grads[step + 1:]
    lhs = sum(sent[step + 1:]) + residuals[-1]
    rhs = residuals[step] + sum(g.astype(np.float64) for g in after)
    assert np.all(np.isfinite(lhs))
    assert np.all(np.abs(lhs - rhs) <= conservation_tol(after, sent[step + 1:]) + 4 * np.abs(residuals[step])
                  * np.finfo(np.float32).eps)


#: dense schemes: a non-finite gradient element must reach the receivers (as
#: with uncompressed Horovod, so e.g. AMP's GradScaler sees the overflow).
#: Sparsifiers may drop it (Threshold/DGC compare |x| >= t, false for NaN) and a
#: 1-bit vote cannot carry it: their residual still forgets it.
PROPAGATING = ["none", "fp16", "bf16", "int8", "int8-b100", "int8-b1", "qsgd127", "qsgd4", "qsgd1",
               "terngrad", "efsignsgd", "onebit"]


@fast()
@given(case=st.sampled_from(PROPAGATING), x=vectors(min_size=2), data=st.data(),
       bad=st.sampled_from([np.nan, np.inf, -np.inf]))
def test_non_finite_reaches_receivers_and_equals_sent(case, x, data, bad):
    scheme = CASES[case]()
    x = x.copy()
    pos = data.draw(st.integers(0, x.size - 1))
    x[pos] = bad
    payload, sent = encode(scheme, x)
    dec = decoded(scheme, payload, x.size)
    assert not np.isfinite(dec[pos])
    np.testing.assert_array_equal(np.isfinite(dec), np.isfinite(sent))
    fin = np.isfinite(sent)
    np.testing.assert_array_equal(dec[fin], sent[fin])
