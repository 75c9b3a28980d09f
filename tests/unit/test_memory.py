"""Unit tests of the error-feedback memories (:mod:`hvd_compress.feedback.memory`)
against a numpy reference written here from the papers, over several steps,
in both framework backends.

* ``ResidualMemory`` -- plain error feedback: ``acc = g + e``; ``e' = acc - sent``.
* ``DGCMemory`` -- Deep Gradient Compression's corrections (Lin et al., ICLR
  2018, Algorithm 1 with §3.2-3.3):

  - local gradient clipping: ``g <- g * min(1, C / ||g||_2)``;
  - momentum correction: ``u <- m u + g``; ``v <- v + u``; ``v`` is compressed;
  - momentum factor masking: where an element was sent, ``v <- 0`` and ``u <- 0``.

The memories are driven exactly as the adapters drive them, through
``compressor.encode_with_memory`` with a real scheme (Top-K, whose selection
the reference reproduces with ``tests/reference.py``).  Single process, no
Horovod; the aggregated result across ranks is checked under horovodrun in
tests/horovod/test_training_*.py.
"""
import numpy as np
import pytest

import hvd_compress as hc
import reference as ref
from hvd_compress.compressor import Compressor, encode_with_memory
from hvd_compress.feedback.memory import DGCMemory, ResidualMemory
from unit_helpers import FRAMEWORKS, framework, make_ctx

f32 = np.float32


def grads(n, steps, seed, scale=1.0):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(n) * scale).astype(f32) for _ in range(steps)]


# --- the numpy reference -------------------------------------------------------------------------
def clip_ref(g, clip_norm):
    if clip_norm is None:
        return g
    norm = np.linalg.norm(g.astype(np.float64))
    return (g * f32(clip_norm / norm)).astype(f32) if norm > clip_norm else g


def dgc_reference(gs, momentum, clip_norm, select):
    """Per step: (sent, u, v) after the step.  ``select(v) -> dense sent``."""
    n = gs[0].size
    u, v = np.zeros(n, f32), np.zeros(n, f32)
    out = []
    for g in gs:
        g = clip_ref(g, clip_norm)
        u = (u * f32(momentum) + g).astype(f32)
        v = (v + u).astype(f32)
        sent = select(v)
        mask = sent != 0
        v = np.where(mask, f32(0), (v - sent).astype(f32)).astype(f32)
        u = np.where(mask, f32(0), u).astype(f32)
        out.append((sent, u.copy(), v.copy()))
    return out


def residual_reference(gs, select):
    e = np.zeros(gs[0].size, f32)
    out = []
    for g in gs:
        acc = (g + e).astype(f32)
        sent = select(acc)
        e = (acc - sent).astype(f32)
        out.append((sent, e.copy()))
    return out


def topk_select(ratio):
    return lambda x: ref.sent("TopK", {"ratio": ratio}, x)


# --- driving the product -------------------------------------------------------------------------
def run_memory(fwname, memory, scheme, gs):
    """The product's states after each step (numpy), driven like the adapters do."""
    fw = framework(fwname)
    B = fw.B
    n = gs[0].size
    state = {name: fw.tensor(np.zeros(n, f32)) for name in memory.names}
    out = []
    for g in gs:
        _, state = encode_with_memory(B, scheme, fw.tensor(g), state, make_ctx(fw, None, shape=(n,)), memory)
        assert set(state) == set(memory.names), sorted(state)  # nothing private ('_velocity') is kept
        out.append({k: fw.np(v).astype(f32) for k, v in state.items()})
    return out


def close(got, want, what, scale=1.0):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * scale, err_msg=what)


# --- DGCMemory vs the reference --------------------------------------------------------------------------
@pytest.mark.parametrize("fwname", FRAMEWORKS)
@pytest.mark.parametrize("momentum, clip_norm", [(0.9, None), (0.9, 12.0), (0.5, 1e6), (0.0, 8.0), (0.99, 3.0)])
def test_dgc_memory_matches_reference_over_steps(fwname, momentum, clip_norm):
    """8 steps of Top-K(10%) on 300 elements: velocity ``u`` (state 'momentum') and
    accumulation ``v`` (state 'residual') equal the reference after every step; clipping
    active on some steps only (||g|| ~ 17 * scale)."""
    gs = [g * f32(s) for g, s in zip(grads(300, 8, seed=1), [0.5, 1.0, 2.0, 0.3, 1.0, 1.5, 0.7, 1.0])]
    want = dgc_reference(gs, momentum, clip_norm, topk_select(0.1))
    got = run_memory(fwname, DGCMemory(momentum, clip_norm), hc.TopK(0.1).scheme, gs)
    for step, ((sent, u, v), st) in enumerate(zip(want, got)):
        close(st["momentum"], u, f"{fwname} u at step {step}", scale=float(np.abs(u).max()))
        close(st["residual"], v, f"{fwname} v at step {step}", scale=float(np.abs(v).max()))
        assert (sent != 0).sum() == 30
        # momentum factor masking: where sent, both u and v are zero; elsewhere u kept its momentum
        assert np.all(st["momentum"][sent != 0] == 0) and np.all(st["residual"][sent != 0] == 0)
        if momentum > 0:
            assert np.all(st["momentum"][sent == 0] != 0)


@pytest.mark.parametrize("fwname", FRAMEWORKS)
def test_dgc_momentum_correction_first_steps_by_hand(fwname):
    """Two steps on 4 elements, Top-K keeping 1, m = 0.5, written out:
    step 1: g=[1,2,3,4]: u=[1,2,3,4], v=u, sent element 3 (4) -> u=v=[1,2,3,0];
    step 2: g=[1,1,1,1]: u=0.5u+g=[1.5,2,2.5,1], v=v+u=[2.5,4,5.5,1], sent element 2 (5.5)
            -> u=[1.5,2,0,1], v=[2.5,4,0,1]."""
    gs = [np.array([1, 2, 3, 4], f32), np.array([1, 1, 1, 1], f32)]
    got = run_memory(fwname, DGCMemory(0.5), hc.TopK(0.25).scheme, gs)
    np.testing.assert_array_equal(got[0]["momentum"], [1, 2, 3, 0])
    np.testing.assert_array_equal(got[0]["residual"], [1, 2, 3, 0])
    np.testing.assert_array_equal(got[1]["momentum"], [1.5, 2, 0, 1])
    np.testing.assert_array_equal(got[1]["residual"], [2.5, 4, 0, 1])


@pytest.mark.parametrize("fwname", FRAMEWORKS)
@pytest.mark.parametrize("g, clip_norm, want", [
    ([3.0, 4.0], 10.0, [3.0, 4.0]),    # ||g|| = 5 <= C: untouched
    ([3.0, 4.0], 5.0, [3.0, 4.0]),     # at the threshold: untouched
    ([3.0, 4.0], 2.5, [1.5, 2.0]),     # scaled to norm C
    ([0.0, 0.0], 1.0, [0.0, 0.0]),     # zero gradient: no division by zero
])
def test_dgc_local_clipping(fwname, g, clip_norm, want):
    fw = framework(fwname)
    mem = DGCMemory(momentum=0.0, clip_norm=clip_norm)
    state = {"residual": fw.tensor(np.zeros(2, f32)), "momentum": fw.tensor(np.zeros(2, f32))}
    acc = fw.np(mem.compensate(fw.B, fw.tensor(np.array(g, f32)), state))
    np.testing.assert_allclose(acc, want, rtol=1e-6)
    assert np.all(np.isfinite(acc))


@pytest.mark.parametrize("fwname", FRAMEWORKS)
def test_dgc_without_momentum_or_clipping_is_plain_error_feedback(fwname):
    gs = grads(200, 5, seed=3)
    scheme = hc.TopK(0.05).scheme
    dgc = run_memory(fwname, DGCMemory(0.0, None), scheme, gs)
    plain = run_memory(fwname, ResidualMemory(), scheme, gs)
    for a, b in zip(dgc, plain):
        np.testing.assert_array_equal(a["residual"], b["residual"])


@pytest.mark.parametrize("fwname", FRAMEWORKS)
def test_dgc_conservation_of_velocities(fwname):
    """The documented law: sum over steps of what was sent + v == sum of the velocities u."""
    gs = grads(500, 6, seed=4)
    mom = 0.9
    want = dgc_reference(gs, mom, None, topk_select(0.02))
    got = run_memory(fwname, DGCMemory(mom), hc.TopK(0.02).scheme, gs)
    sent_total = np.sum([s for s, _, _ in want], axis=0, dtype=np.float64)
    # the velocity before masking at each step, from the reference's recursion
    u_prev, us = np.zeros(500, f32), []
    for g, (sent, u_after, _) in zip(gs, want):
        u = (u_prev * f32(mom) + g).astype(f32)
        us.append(u)
        u_prev = u_after
    total_u = np.sum(us, axis=0, dtype=np.float64)
    np.testing.assert_allclose(sent_total + got[-1]["residual"], total_u, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("fwname", FRAMEWORKS)
def test_dgc_non_finite_gradient_is_not_kept(fwname):
    g = grads(50, 1, seed=5)[0]
    g[7] = np.nan
    g[8] = np.inf
    got = run_memory(fwname, DGCMemory(0.9), hc.TopK(0.1).scheme, [g, grads(50, 1, seed=6)[0]])
    for st in got:
        assert np.all(np.isfinite(st["residual"])) and np.all(np.isfinite(st["momentum"]))


# --- ResidualMemory vs the reference -------------------------------------------------------------------
@pytest.mark.parametrize("fwname", FRAMEWORKS)
def test_residual_memory_matches_reference_and_conserves(fwname):
    gs = grads(400, 6, seed=7)
    want = residual_reference(gs, topk_select(0.05))
    got = run_memory(fwname, ResidualMemory(), hc.TopK(0.05).scheme, gs)
    for step, ((_, e), st) in enumerate(zip(want, got)):
        np.testing.assert_array_equal(st["residual"], e, err_msg=f"{fwname} residual at step {step}")
    sent_total = np.sum([s for s, _ in want], axis=0, dtype=np.float64)
    np.testing.assert_allclose(sent_total + got[-1]["residual"], np.sum(gs, axis=0, dtype=np.float64),
                               rtol=1e-5, atol=1e-5)


# --- configuration and validation -----------------------------------------------------------------------
@pytest.mark.parametrize("kw, param", [
    (dict(momentum=1.0), "momentum"),
    (dict(momentum=-0.1), "momentum"),
    (dict(momentum="0.9"), "momentum"),
    (dict(momentum=True), "momentum"),
    (dict(momentum=0.9, clip_norm=0.0), "clip_norm"),
    (dict(momentum=0.9, clip_norm=-1.0), "clip_norm"),
    (dict(momentum=0.9, clip_norm="1"), "clip_norm"),
])
def test_dgc_memory_validation_names_the_parameter(kw, param):
    with pytest.raises(ValueError, match=param):
        DGCMemory(**kw)


def test_dgc_factory_memories():
    plain = hc.DGC(0.01)
    assert isinstance(plain.memory, ResidualMemory) and plain.error_feedback
    both = hc.DGC(0.01, momentum=0.9, clip_norm=2.0)
    assert isinstance(both.memory, DGCMemory)
    assert (both.memory.momentum, both.memory.clip_norm) == (0.9, 2.0)
    assert both.scheme.name == "DGC" and both.error_feedback
    assert isinstance(hc.DGC(0.01, clip_norm=1.0).memory, DGCMemory)  # clipping alone: m = 0
    assert hc.DGC(0.01, clip_norm=1.0).memory.momentum == 0.0
    assert both.config()["memory"] == {"memory": "dgc", "momentum": 0.9, "clip_norm": 2.0}
    assert both.fingerprint() != plain.fingerprint()
    assert both.fingerprint() != hc.DGC(0.01, momentum=0.8, clip_norm=2.0).fingerprint()


@pytest.mark.parametrize("kw, param", [
    (dict(momentum=1.5), "momentum"),
    (dict(momentum=0.9, error_feedback=False), "error_feedback"),
    (dict(clip_norm=0), "clip_norm"),
])
def test_dgc_factory_validation(kw, param):
    with pytest.raises(ValueError, match=param):
        hc.DGC(0.01, **kw)


def test_compressor_memory_validation():
    with pytest.raises(ValueError, match="memory"):
        Compressor(hc.TopK(0.1).scheme, memory=object())
    with pytest.raises(ValueError, match="error_feedback"):
        Compressor(hc.TopK(0.1).scheme, error_feedback=False, memory=DGCMemory(0.9))
    c = Compressor(hc.TopK(0.1).scheme, memory=DGCMemory(0.9))  # any sparsifier can take DGC's corrections
    assert isinstance(c.memory, DGCMemory)
    assert Compressor(hc.FP16().scheme).memory is None  # no error feedback: nothing kept


# --- finite_or_zero: the backends' fast path must not change the result -------------------------------
@pytest.mark.parametrize("fwname", FRAMEWORKS)
@pytest.mark.parametrize("case", ["finite", "nan", "posinf", "neginf", "overflowing_sum"])
def test_finite_or_zero_drops_exactly_the_non_finite_entries(fwname, case):
    """The backends skip the rewrite when one sum shows everything is finite;
    values whose sum overflows (all finite) must come back unchanged, and a
    single NaN/Inf anywhere must become 0 with every other entry kept."""
    fw = framework(fwname)
    x = np.linspace(-3, 3, 1001).astype(f32)
    if case == "overflowing_sum":
        x[:] = f32(3e38)
    elif case != "finite":
        x[500] = {"nan": np.nan, "posinf": np.inf, "neginf": -np.inf}[case]
    want = np.where(np.isfinite(x), x, f32(0))
    got = fw.np(fw.B.finite_or_zero(fw.tensor(x)))
    np.testing.assert_array_equal(got, want)


def test_finite_or_zero_in_a_trace_is_the_eager_result_for_every_length():
    """In a trace the TF backend calls one shared tf.function (traced for any
    length after two): the same values, and the tensor keeps its static shape."""
    import tensorflow as tf
    fw = framework("tensorflow")
    cases = []
    for n in (7, 1001, 64, 3):
        x = np.linspace(-3, 3, n).astype(f32)
        x[n // 2] = np.nan if n % 2 else np.inf
        cases.append(x)

    @tf.function(autograph=False)
    def traced(*xs):
        outs = [fw.B.finite_or_zero(x) for x in xs]
        assert [o.shape.as_list() for o in outs] == [[x.shape[0]] for x in cases]
        return outs
    for got, x in zip(traced(*[tf.constant(x) for x in cases]), cases):
        np.testing.assert_array_equal(got.numpy(), np.where(np.isfinite(x), x, f32(0)))


# --- MomentumMemory: momentum-aware error feedback for every scheme -----------------------------------
# The reference, from Zheng et al. (NeurIPS 2019) and DGC's momentum correction without masking:
#   u <- m u + g;  d = u (heavy ball) or g + m u (Nesterov);  acc = e + d;  e <- acc - C(acc).
# The velocity u depends on the gradients only (nothing masks it), so the law
#   sum(sent) + e == sum(d)
# has a right-hand side computed from the gradients alone.
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

from hvd_compress.feedback.memory import MomentumMemory, momentum_memory  # noqa: E402
from hvd_compress.schemes.base import EncodeContext  # noqa: E402
from unit_helpers import CASE_IDS, CASES, wire  # noqa: E402


def momentum_directions(gs, momentum, nesterov):
    """d_t per step (float64), and the velocity u after each step (float32, as the product keeps it)."""
    u = np.zeros(gs[0].size, f32)
    ds, us = [], []
    for g in gs:
        u = (u * f32(momentum) + g).astype(f32)
        d = (g + u * f32(momentum)).astype(f32) if nesterov else u
        ds.append(d.astype(np.float64))
        us.append(u.copy())
    return ds, us


def momentum_reference(gs, momentum, nesterov, select):
    """Per step (sent, u, e) after the step, with error feedback; ``select(acc) -> dense sent``."""
    e = np.zeros(gs[0].size, f32)
    ds, us = momentum_directions(gs, momentum, nesterov)
    out = []
    for d, u in zip(ds, us):
        acc = (e + d.astype(f32)).astype(f32)
        sent = select(acc)
        e = (acc - sent).astype(f32)
        out.append((sent, u, e.copy()))
    return out


def efsign_select(x):
    return ref.sent("EFSignSGD", {}, x).astype(f32)


@pytest.mark.parametrize("fwname", FRAMEWORKS)
@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("which", ["topk", "efsignsgd"])
def test_momentum_memory_matches_reference_over_steps(fwname, nesterov, which):
    """8 steps on 300 elements, m = 0.9: velocity and residual equal the numpy
    reference after every step, in both backends (EF-sign's scale is a mean, summed
    in fp32 by the product and in float64 by the reference: relative tolerance)."""
    gs = [g * f32(s) for g, s in zip(grads(300, 8, seed=11), [0.5, 1.0, 2.0, 0.3, 1.0, 1.5, 0.7, 1.0])]
    scheme, select = {"topk": (hc.TopK(0.1).scheme, topk_select(0.1)),
                      "efsignsgd": (hc.EFSignSGD().scheme, efsign_select)}[which]
    want = momentum_reference(gs, 0.9, nesterov, select)
    got = run_memory(fwname, MomentumMemory(0.9, nesterov), scheme, gs)
    for step, ((_, u, e), st_) in enumerate(zip(want, got)):
        np.testing.assert_allclose(st_["momentum"], u, rtol=1e-6, atol=1e-6, err_msg=f"u at step {step}")
        np.testing.assert_allclose(st_["residual"], e, rtol=1e-4, atol=1e-4 * float(np.abs(e).max()),
                                   err_msg=f"{fwname} e at step {step}")


@pytest.mark.parametrize("fwname", FRAMEWORKS)
def test_momentum_memory_first_steps_by_hand(fwname):
    """Top-K keeping 1 of 4, m = 0.5:
    step 1: g=[1,2,3,4]: u=[1,2,3,4], acc=u, sent element 3 -> e=[1,2,3,0], u kept whole (no masking);
    step 2: g=[1,1,1,1]: u=[1.5,2,2.5,3], acc=e+u=[2.5,4,5.5,3], sent element 2 -> e=[2.5,4,0,3]."""
    gs = [np.array([1, 2, 3, 4], f32), np.array([1, 1, 1, 1], f32)]
    got = run_memory(fwname, MomentumMemory(0.5), hc.TopK(0.25).scheme, gs)
    np.testing.assert_array_equal(got[0]["momentum"], [1, 2, 3, 4])
    np.testing.assert_array_equal(got[0]["residual"], [1, 2, 3, 0])
    np.testing.assert_array_equal(got[1]["momentum"], [1.5, 2, 2.5, 3])
    np.testing.assert_array_equal(got[1]["residual"], [2.5, 4, 0, 3])


def _momentum_ctx(fw, step, n):
    like = fw.tensor(np.zeros(1, f32))
    return EncodeContext(key="p", step=step, rank=0, size=1, shape=(n,), state={},
                         uniform=lambda k: fw.B.uniform(k, 7 + step, like=like), shared_seed=1_000_003 + step)


def _decoded(fw, scheme, payload, n):
    """What the other ranks reconstruct from this rank's payload."""
    if scheme.transport == "allreduce":
        local = {k: v for k, v in payload.items() if k.startswith("_")}
        return fw.np(scheme.decode_reduced(fw.B, payload["reduce"], n, local)).astype(np.float64)
    return fw.np(scheme.decode_one(fw.B, wire(payload), n)).astype(np.float64)


def _momentum_law(fwname, case, gs, momentum, nesterov, error_feedback):
    """Runs the product; returns (sum of decoded sent + final residual, sum of d, tolerance)."""
    fw = framework(fwname)
    scheme = CASES[case]()
    memory = MomentumMemory(momentum, nesterov, error_feedback=error_feedback)
    n = gs[0].size
    state = {name: fw.tensor(np.zeros(n, f32)) for name in memory.names}
    sent_total = np.zeros(n)
    mag = np.zeros(n)
    for t, g in enumerate(gs):
        payload, state = encode_with_memory(fw.B, scheme, fw.tensor(g), state, _momentum_ctx(fw, t, n), memory)
        s = _decoded(fw, scheme, payload, n)
        sent_total += s
        mag += np.abs(s)
    ds, us = momentum_directions(gs, momentum, nesterov)
    np.testing.assert_allclose(fw.np(state["momentum"]), us[-1], rtol=1e-6, atol=1e-6)
    lhs = sent_total + (fw.np(state["residual"]).astype(np.float64) if error_feedback else 0.0)
    rhs = np.sum(ds, axis=0)
    mag += sum(np.abs(d) for d in ds)
    return lhs, rhs, 8 * len(gs) * np.finfo(np.float32).eps * (mag + 1.0)


def _sequences(max_steps=5, max_size=120):
    elems = st.floats(-100, 100, width=32, allow_nan=False, allow_infinity=False, allow_subnormal=False)
    return st.tuples(st.integers(1, max_steps), st.integers(1, max_size)).flatmap(
        lambda tn: st.lists(hnp.arrays(np.float32, tn[1], elements=elems), min_size=tn[0], max_size=tn[0]))


@settings(max_examples=40, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(fwname=st.sampled_from(FRAMEWORKS), case=st.sampled_from(CASE_IDS), gs=_sequences(),
       momentum=st.sampled_from([0.0, 0.5, 0.9, 0.99]), nesterov=st.booleans())
def test_momentum_memory_conservation_every_scheme_hypothesis(fwname, case, gs, momentum, nesterov):
    """The documented law, for any scheme, either backend, any gradients:
    ``sum(sent) + e == sum(d)`` with ``d`` the (Nesterov) momentum direction."""
    lhs, rhs, tol = _momentum_law(fwname, case, gs, momentum, nesterov, error_feedback=True)
    assert np.all(np.abs(lhs - rhs) <= tol), np.max(np.abs(lhs - rhs) - tol)


@pytest.mark.parametrize("fwname", FRAMEWORKS)
def test_momentum_memory_conservation_each_scheme_once(fwname):
    """The law for every scheme of the catalogue, whatever hypothesis samples."""
    gs = grads(257, 5, seed=12)
    for case in CASE_IDS:
        lhs, rhs, tol = _momentum_law(fwname, case, gs, 0.9, case.endswith("%"), error_feedback=True)
        assert np.all(np.abs(lhs - rhs) <= tol), case


@pytest.mark.parametrize("fwname", FRAMEWORKS)
@pytest.mark.parametrize("make", [lambda: hc.TopK(0.01, momentum=0.9), lambda: hc.RandomK(0.01, momentum=0.9),
                                  lambda: hc.TopK(0.01, momentum=0.9, nesterov=True)])
def test_momentum_conservation_through_a_recipes_ratio_ramp(fwname, make):
    """``hc.recipe(..., warmup_steps, ramp_steps)``: dense, then 25%, 6.25%, 1.5625%, 1%.  The
    phases share one velocity and one residual, so the law holds over the whole run:
    ``sum(sent) + e == sum(d)``, and the velocity is momentum SGD's."""
    fw = framework(fwname)
    comp = make()
    n, warmup, ramp = 300, 2, 2
    phases = hc.recipe(comp, dense_below=0, warmup_steps=warmup, ramp_steps=ramp).plan_for("p", n, (n,))
    gs = grads(n, warmup + 4 * ramp + 3, seed=5)
    state, sent_total, mag = {}, np.zeros(n), np.zeros(n)
    for t, g in enumerate(gs):
        phase = [p for p in phases if p.start <= t][-1]
        mine = {k: state.get(k, fw.tensor(np.zeros(n, f32))) for k in phase.memory.names}
        payload, mine = encode_with_memory(fw.B, phase.scheme, fw.tensor(g), mine, _momentum_ctx(fw, t, n),
                                           phase.memory)
        state.update(mine)
        s = _decoded(fw, phase.scheme, payload, n)
        sent_total += s
        mag += np.abs(s)
    assert [p.scheme.ratio for p in phases[1:]] == [0.25, 0.0625, 0.015625, 0.01]
    ds, us = momentum_directions(gs, 0.9, comp.memory.nesterov)
    np.testing.assert_allclose(fw.np(state["momentum"]), us[-1], rtol=1e-6, atol=1e-6)
    lhs = sent_total + fw.np(state["residual"]).astype(np.float64)
    tol = 8 * len(gs) * np.finfo(np.float32).eps * (mag + sum(np.abs(d) for d in ds) + 1.0)
    assert np.all(np.abs(lhs - np.sum(ds, axis=0)) <= tol)
    assert np.abs(fw.np(state["residual"])).sum() > 0  # the ramp's last phases did hold mass back


@pytest.mark.parametrize("fwname", FRAMEWORKS)
def test_momentum_without_error_feedback_sends_the_momentum(fwname):
    """No residual kept (Signum for SignSGD; QSGD; casts): a lossless scheme then
    sends exactly torch's SGD momentum buffer, so SGD(momentum=0) after it is
    SGD(momentum=m)."""
    gs = grads(64, 6, seed=13)
    lhs, rhs, _ = _momentum_law(fwname, "none", gs, 0.9, False, error_feedback=False)
    np.testing.assert_array_equal(lhs, rhs)
    import torch
    p = torch.zeros(64, requires_grad=True)
    opt = torch.optim.SGD([p], lr=1.0, momentum=0.9)
    for g in gs:
        p.grad = torch.from_numpy(g)
        opt.step()
    np.testing.assert_allclose(-p.detach().numpy(), rhs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fwname", FRAMEWORKS)
def test_momentum_memory_non_finite_gradient_is_not_kept(fwname):
    g = grads(50, 1, seed=14)[0]
    g[3], g[4] = np.nan, -np.inf
    got = run_memory(fwname, MomentumMemory(0.9), hc.EFSignSGD().scheme, [g, grads(50, 1, seed=15)[0]])
    for st_ in got:
        assert np.all(np.isfinite(st_["residual"])) and np.all(np.isfinite(st_["momentum"]))


FACTORIES = ["NoCompression", "FP16", "BF16", "Int8", "QSGD", "TernGrad", "SignSGD", "EFSignSGD", "OneBit",
             "TopK", "RandomK", "Threshold", "PowerSGD", "Lossless"]


@pytest.mark.parametrize("factory", FACTORIES)
def test_every_factory_takes_momentum(factory):
    plain = getattr(hc, factory)()
    c = getattr(hc, factory)(momentum=0.9)
    assert isinstance(c.memory, MomentumMemory) and c.memory.momentum == 0.9
    # error feedback stays the scheme's choice; the memory keeps a residual exactly when it is on
    assert c.error_feedback == plain.error_feedback
    assert c.memory.names == (("residual", "momentum") if plain.error_feedback else ("momentum",))
    assert c.config()["memory"] == {"memory": "momentum", "momentum": 0.9, "nesterov": False,
                                    "error_feedback": plain.error_feedback}
    assert c.fingerprint() != plain.fingerprint()
    assert "momentum=0.9" in repr(c)
    # momentum=0 is the plain compressor
    assert getattr(hc, factory)(momentum=0.0).config() == plain.config()


def test_momentum_factory_examples():
    assert hc.TopK(0.01, momentum=0.9).memory.names == ("residual", "momentum")
    assert hc.EFSignSGD(momentum=0.9, nesterov=True).memory.nesterov is True
    assert hc.RandomK(0.01, momentum=0.9).error_feedback
    off = hc.TopK(0.01, momentum=0.9, error_feedback=False)
    assert not off.error_feedback and off.memory.names == ("momentum",)
    with pytest.warns(UserWarning, match="QSGD with error feedback"):  # allowed, but warned about
        on = hc.QSGD(momentum=0.9, error_feedback=True)
    assert on.error_feedback and on.memory.names == ("residual", "momentum")
    assert isinstance(hc.DGC(0.01, momentum=0.9).memory, DGCMemory)  # DGC keeps its own corrections


@pytest.mark.parametrize("kw, param", [
    (dict(momentum=1.0), "momentum"),
    (dict(momentum=-0.5), "momentum"),
    (dict(momentum="0.9"), "momentum"),
    (dict(momentum=None), "momentum"),
    (dict(momentum=0.9, nesterov=1), "nesterov"),
    (dict(nesterov=True), "nesterov"),
    (dict(momentum=0.9, error_feedback="yes"), "error_feedback"),
])
def test_momentum_factory_validation_names_the_parameter(kw, param):
    for factory in (hc.TopK, hc.EFSignSGD, hc.RandomK):
        with pytest.raises(ValueError, match=param):
            factory(**kw)


@pytest.mark.parametrize("kw, param", [
    (dict(momentum=1.0), "momentum"), (dict(momentum=True), "momentum"),
    (dict(nesterov="no"), "nesterov"), (dict(error_feedback=None), "error_feedback"),
])
def test_momentum_memory_validation_names_the_parameter(kw, param):
    with pytest.raises(ValueError, match=param):
        MomentumMemory(**kw)


def test_compressor_with_momentum_memory():
    c = Compressor(hc.EFSignSGD().scheme, memory=MomentumMemory(0.9))
    assert c.error_feedback and c.memory.names == ("residual", "momentum")
    c = Compressor(hc.SignSGD().scheme, memory=MomentumMemory(0.9, error_feedback=False))
    assert not c.error_feedback and c.memory.names == ("momentum",)
    with pytest.raises(ValueError, match="error_feedback"):
        Compressor(hc.TopK(0.1).scheme, error_feedback=True, memory=MomentumMemory(0.9, error_feedback=False))
    with pytest.raises(ValueError, match="error_feedback"):
        Compressor(hc.TopK(0.1).scheme, error_feedback=False, memory=MomentumMemory(0.9))
    assert momentum_memory(hc.TopK(0.1).scheme, 0.0) is None


def test_policy_and_schedule_keep_the_momentum_memory():
    """A Rule's compressor keeps its memory in the plan; a schedule's phases share one velocity state name."""
    from hvd_compress import Policy, Rule, Schedule
    topk = hc.TopK(0.01, momentum=0.9)
    policy = Policy([Rule(topk, min_ndim=2)], default=hc.FP16(momentum=0.9))
    (phase,) = policy.plan_for("fc.weight", 1000, (10, 100))
    assert phase.memory is topk.memory
    (phase,) = policy.plan_for("fc.bias", 10, (10,))
    assert isinstance(phase.memory, MomentumMemory) and phase.memory.names == ("momentum",)
    sched = Schedule.dgc_warmup(warmup_steps=5, steps_per_stage=5, final_ratio=0.01, momentum=0.9)
    phases = sched.plan_for("w", 1000, (1000,))
    assert all(isinstance(p.memory, MomentumMemory) and p.memory.momentum == 0.9 for p in phases)
    assert phases[0].memory.names == ("momentum",) and phases[-1].memory.names == ("residual", "momentum")
    assert Schedule([(0, hc.none(momentum=0.9)), (3, hc.EFSignSGD(momentum=0.9))]).plan_for("w", 8, (8,))[1].memory
    with pytest.raises(ValueError, match="momentum"):
        Schedule.dgc_warmup(warmup_steps=5, steps_per_stage=5, momentum=2.0)
