"""hvd_compress through the stock, unpatched Horovod TensorFlow 2 APIs.

Runs under ``horovodrun -np 2`` with Gloo and with MPI (see scripts/run_tests.sh), with
tf_keras (``TF_USE_LEGACY_KERAS=1``); the process-set test's set has several members from
3 processes on.  Three entry points of Horovod 0.28.1 are driven:

* ``hvd.DistributedGradientTape`` inside ``tf.function`` (the main path);
* the legacy ``hvd.DistributedOptimizer`` around
  ``tf.compat.v1.train.GradientDescentOptimizer``: under TF 2.21 it works inside
  ``tf.function`` (``compute_gradients`` with a callable loss, then
  ``apply_gradients``); only its ``backward_passes_per_step > 1`` is refused,
  by Horovod itself, in eager mode;
* ``horovod.tensorflow.keras.DistributedOptimizer`` with ``model.fit``
  (``backward_passes_per_step`` and ``op`` included).

Every rank injects a rank-specific deterministic gradient through the loss
``sum(v * G_rank)`` and reads the aggregated gradient Horovod returns; every
rank can compute every rank's ``G``, so each checks the result against the
independent numpy reference (``tests/reference.py``), over several steps with
error feedback.  The stochastic schemes' draws are reproduced:
``tf.random.stateless_uniform([n], seed=(s // 2**31, s % 2**31))`` with
``s = TensorFlowBackend.seed_for(stable_hash(seed, key, rank), step)``, where ``key``
is the variable's name (``'TopK/big/weight:0'``), ``rank`` the rank in the
process set and ``step`` counts communications per key from 1; Random-K's
coordinates come from the shared seed ``seed_for(stable_hash(seed, key), step)``.

``DistributedGradientTape`` has no ``backward_passes_per_step`` in Horovod
0.28.1 (only the optimizers do), so that option is tested through Keras.

Cost: tracing is what is slow here (autograph converts hvd_compress's Python
on every trace).  So one ``tf.function`` drives many schemes at once, each on
its own variables (named ``<scheme>/<param>``) behind its own tape, and the
parametrized tests read their scheme's slice of that shared run: an assertion
names its scheme, though a crash while tracing fails the whole group.  Most
runs trace with ``autograph=False`` (the same hvd_compress code, unconverted,
about half the tracing time); the converted path that users get by default
is checked by test_tape_with_autograph_matches_reference (one scheme of each
transport path), the legacy-optimizer tests and Keras ``model.fit``.

Every rank runs the same tests in the same order and issues all collectives of
a test before asserting anything, so one rank's failure cannot leave another
waiting in a collective.
"""
import os
from collections import Counter

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import horovod.tensorflow as hvd  # noqa: E402
import horovod.tensorflow.keras as hvdk  # noqa: E402

from compression_cases import (EF_DEFAULT_OFF, EXTRA, IDS, SCHEMES, TRAIN_IDS, G,  # noqa: E402
                               aggregate_conservation, assert_matches, check_indices, conservation,
                               covered_names, exported_schemes, ref, residual_tolerance, shuffle_zstd_nbytes,
                               uncovered, world_size_from_env)
from compression_cases import simulate as ref_simulate  # noqa: E402
from tf_linear_training import CaptureSGD, Inject, LinearTraining, dataset, flat_weights, linear_model  # noqa: E402

import hvd_compress  # noqa: E402
from hvd_compress.backend import backend_for  # noqa: E402
from hvd_compress.cross_rank import collective_name, stable_hash  # noqa: E402
from hvd_compress.adapters.tf_adapter import TFAdapter  # noqa: E402
from hvd_compress.backend import TensorFlowBackend  # noqa: E402

_WORLD = world_size_from_env()
SUBSET = hvd.ProcessSet(list(range(_WORLD - 1))) if _WORLD >= 2 else None  # [0] at np=2, [0, 1] at np=3
hvd.init(process_sets=[SUBSET] if SUBSET is not None else None)
RANK, SIZE = hvd.rank(), hvd.size()
TFB = backend_for(tf.zeros([0]))

# parameter -> shape (few: tracing costs per tensor).  'big' has > 256 elements, so DGC samples
# with a random offset, and is not a multiple of Int8's block of 64; 'tiny' is not a multiple
# of 8 (bit packing) and Threshold often keeps none of it (empty payloads).
SPECS = {"big/weight": (40, 25), "tiny": (7,)}


def test_every_scheme_is_covered():
    """Every scheme hvd_compress exports is exercised here: against tests/reference.py where it
    has the scheme's math, by the scheme's own laws otherwise (EXTRA: Lossless, PowerSGD)."""
    assert covered_names() <= exported_schemes()
    with_reference, not_at_all = uncovered()
    assert not with_reference, f"schemes with a reference but not covered by these tests: {with_reference}"
    assert not not_at_all, f"schemes not covered by these tests: {not_at_all}"
    assert tf.keras.__name__.startswith("tf_keras"), "TF_USE_LEGACY_KERAS=1 must select tf_keras"


# --- the reference ----------------------------------------------------------------------------------
def _stateless(n, seed):
    return tf.random.stateless_uniform([n], seed=tf.constant([seed // 2**31, seed % 2**31], tf.int64),
                                       dtype=tf.float32).numpy()


def uniform_fn_for(comp, key):
    """The adapter's private draws, reproduced: ``uniform_fn(step, set_rank, n)``."""
    def fn(step, set_rank, n):
        seed = int(TensorFlowBackend.seed_for(None, stable_hash(comp.seed, key, set_rank), step + 1).numpy())
        return _stateless(n, seed)
    return fn


def indices_fn_for(comp, key):
    """Random-K's coordinates: the product's randperm_prefix from the documented shared seed."""
    def fn(step, numel, k):
        seed = TensorFlowBackend.seed_for(None, stable_hash(comp.seed, key), step + 1)
        return check_indices(TFB.randperm_prefix(numel, k, seed).numpy(), numel, k)
    return fn


def simulate(comp, spec, key, shape, steps, ranks=None, **kw):
    ranks = list(range(SIZE)) if ranks is None else list(ranks)
    return ref_simulate(comp, spec, shape, ranks, steps=steps,
                        uniform_fn=uniform_fn_for(comp, key), indices_fn=indices_fn_for(comp, key), **kw)


class Result:
    """One scheme's part of a run: its compressor, ``got[step][spec]`` (aggregated gradients
    as numpy), ``keys[spec]`` (the compressor's key) and the run's shapes and step count."""

    def __init__(self, sid, comp, specs, keys, steps):
        self.sid, self.comp, self.specs, self.keys, self.steps = sid, comp, specs, keys, steps
        self.got = []

    def check(self, what, **kw):
        for spec, shape in self.specs.items():
            sim, _ = simulate(self.comp, spec, self.keys[spec], shape, self.steps, **kw)
            assert_matches(self.sid, [g[spec] for g in self.got], sim.aggregated,
                           f"{self.keys[spec]} {what} (rank {RANK} of {SIZE})")

    def residuals(self):
        return {k: v.numpy() for k, v in self.comp.adapters["tensorflow"].residuals.items()}


def injected(spec, step, shape, micro=0):
    return tf.constant(G(spec, RANK, step, shape, micro))


def tape_run(cases, steps, specs=SPECS, autograph=True, orders=None, **tape_kw):
    """One tf.function, called ``steps`` times, with one DistributedGradientTape per case
    (``cases``: {tag: (sid, compressor)}), each on its own variables ``<tag>/<spec>`` and the
    loss sum(v * G_rank).  ``orders``: a list of source orders, one tf.function each, used in
    turn (the keying test).  Returns {tag: Result}."""
    variables = {tag: {s: tf.Variable(tf.zeros(shape), name=f"{tag}/{s}") for s, shape in specs.items()}
                 for tag in cases}
    results = {tag: Result(sid, comp, specs, {s: f"{tag}/{s}:0" for s in specs}, steps)
               for tag, (sid, comp) in cases.items()}
    orders = [list(specs)] if orders is None else orders

    def make(order):
        def step_fn(grads):
            out = {}
            for tag, (_, comp) in cases.items():
                vs = [variables[tag][s] for s in order]
                with tf.GradientTape() as tape:
                    loss = tf.add_n([tf.reduce_sum(v * grads[s]) for v, s in zip(vs, order)])
                tape = hvd.DistributedGradientTape(tape, compression=comp, **tape_kw)
                out[tag] = dict(zip(order, tape.gradient(loss, vs)))
            return out
        return tf.function(step_fn, autograph=autograph)

    fns = [make(o) for o in orders]
    for step in range(steps):
        out = fns[step % len(fns)]({s: injected(s, step, shape) for s, shape in specs.items()})
        for tag, grads in out.items():
            results[tag].got.append({s: g.numpy() for s, g in grads.items()})
    return results


class Spy:
    """Records, at trace time, the tensors handed to Horovod's collectives:
    (kind, name, static bytes or None)."""

    def __init__(self, monkeypatch):
        self.calls = []
        orig_reduce, orig_gather = hvd._allreduce, hvd.allgather

        def nbytes(t):
            n = t.shape.num_elements()
            return None if n is None else n * t.dtype.size

        def reduce_(tensor, *a, **kw):
            self.calls.append(("allreduce", str(tensor.name), nbytes(tensor)))
            return orig_reduce(tensor, *a, **kw)

        def gather(tensor, *a, **kw):
            # the name among the ranks: after the last "/" of the node name (ignore_name_scope=True)
            name = kw.get("name")
            self.calls.append(("allgather", name.rsplit("/", 1)[-1] if name else name, nbytes(tensor)))
            return orig_gather(tensor, *a, **kw)

        monkeypatch.setattr(hvd, "_allreduce", reduce_)
        monkeypatch.setattr(hvd, "allgather", gather)


# --- the main run: every scheme, default error feedback and switched ----------------------------------
MAIN_CASES = [(sid, None) for sid in IDS] + [(sid, True) for sid in EF_DEFAULT_OFF if sid != "NoCompression"] \
    + [("TopK", False)]
_MAIN = {}


def _tag(sid, ef):
    return sid.replace("-", "_") + {None: "", True: "_ef", False: "_noef"}[ef]


def main_run(sid, ef=None):
    """3 tape steps, op=Average, of every case in MAIN_CASES (one tf.function, autograph off;
    see test_tape_with_autograph_matches_reference for the converted path)."""
    if not _MAIN:
        cases = {_tag(s, e): (s, SCHEMES[s]() if e is None else SCHEMES[s](error_feedback=e)) for s, e in MAIN_CASES}
        mp = pytest.MonkeyPatch()
        spy = Spy(mp)
        try:
            _MAIN.update(tape_run(cases, steps=3, autograph=False, op=hvd.Average))
        finally:
            mp.undo()
        _MAIN["spy"] = spy.calls
    return _MAIN[_tag(sid, ef)]


AUTOGRAPH = ["FP16", "RandomK", "Int8-block64", "QSGD16", "TopK-Int8", "Threshold"]
_AUTOGRAPH = {}


@pytest.mark.parametrize("sid", AUTOGRAPH)
def test_tape_with_autograph_matches_reference(sid):
    """As users run it: tf.function with autograph (which converts hvd_compress's code too),
    3 steps, one scheme of each transport path."""
    if not _AUTOGRAPH:
        cases = {"ag_" + _tag(s, None): (s, SCHEMES[s]()) for s in AUTOGRAPH}
        _AUTOGRAPH.update(tape_run(cases, steps=3, autograph=True, op=hvd.Average))
    _AUTOGRAPH["ag_" + _tag(sid, None)].check("tape, autograph")


@pytest.mark.parametrize("sid", IDS)
def test_tape_aggregate_matches_reference(sid):
    """Default error feedback, op=Average, 3 steps: the tape's gradients == reference,
    and the residual variables too."""
    res = main_run(sid)
    res.check("tape")
    residuals = res.residuals()
    for spec, shape in SPECS.items():
        key = res.keys[spec]
        if res.comp.error_feedback:
            sim, grads = simulate(res.comp, spec, key, shape, 3)
            np.testing.assert_allclose(residuals[key], sim.residuals[RANK],
                                       **residual_tolerance(sid, [g[RANK] for g in grads]),
                                       err_msg=f"{sid} residual of {key}")
        else:
            assert key not in residuals


@pytest.mark.parametrize("sid", [s for s in EF_DEFAULT_OFF if s != "NoCompression"])
def test_tape_error_feedback_switched_on(sid):
    res = main_run(sid, ef=True)
    assert res.comp.error_feedback is True
    res.check("tape error_feedback=True")


@pytest.mark.parametrize("sid", ["TopK"])
def test_tape_error_feedback_switched_off(sid):
    res = main_run(sid, ef=False)
    assert res.comp.error_feedback is False and not res.residuals()
    res.check("tape error_feedback=False")


@pytest.mark.parametrize("sid", [s for s in IDS if s != "NoCompression"])
def test_tape_error_feedback_conservation(sid):
    """For every rank and variable: sum of what was sent + final residual == sum of the
    gradients (see compression_cases.conservation); residuals live in tf.Variables keyed
    by the variable's name."""
    res = main_run(sid, ef=True if sid in EF_DEFAULT_OFF else None)
    residuals = res.residuals()
    assert set(residuals) == set(res.keys.values()), sorted(residuals)
    assert all(isinstance(v, tf.Variable) for v in res.comp.adapters["tensorflow"].residuals.values())
    mine = np.concatenate([residuals[res.keys[s]].reshape(-1) for s in SPECS])
    everyone = hvd.allgather(tf.constant(mine[None]), name=f"tf.conservation.{sid}").numpy()
    offset = 0
    for spec, shape in SPECS.items():
        n = int(np.prod(shape))
        sim, grads = simulate(res.comp, spec, res.keys[spec], shape, 3, ef=True)
        conservation(sid, [g[spec] for g in res.got], residuals[res.keys[spec]], everyone[:, offset:offset + n],
                     sim, grads, RANK, SIZE)
        offset += n


@pytest.mark.parametrize("sid", IDS)
def test_tape_bytes_counter(sid):
    """stats.per_tensor() after the last step == the reference's payload formula (this rank's
    kept count for Threshold/DGC); where sizes are static, also == the bytes of the tensors
    handed to Horovod; an allgather scheme hands Horovod's allreduce a 4-byte placeholder."""
    res = main_run(sid)
    calls = _MAIN["spy"]
    stats = res.comp.stats.per_tensor()
    assert set(stats) == set(res.keys.values()), sorted(stats)
    for spec, shape in SPECS.items():
        key, numel = res.keys[spec], int(np.prod(shape))
        sim, _ = simulate(res.comp, spec, key, shape, 3)
        want = sim.nbytes[-1][RANK]
        row = stats[key]
        assert row["payload_bytes"] == want, (key, row, want)
        assert row["dense_fp32_bytes"] == 4 * numel and row["scheme"] == res.comp.scheme.name
        prefix = collective_name(key, "x")[:-1]
        side = {c[1]: c for c in calls if c[0] == "allgather" and (c[1] or "").startswith(prefix)}
        if ref.transport(res.comp.scheme.name) == "allgather":
            assert side, f"no side allgather for {key}"
            if all(c[2] is not None for c in side.values()):
                assert 4 + sum(c[2] for c in side.values()) == want, (side, want)
        else:
            assert not side, side
    totals = res.comp.stats.totals()
    if sid == "NoCompression":
        assert totals["payload_bytes"] == totals["dense_fp32_bytes"], totals
    else:
        assert totals["payload_bytes"] < totals["dense_fp32_bytes"], totals


def test_tape_what_reaches_horovods_allreduce():
    """Every tensor handed to Horovod's allreduce during the main trace: the scheme's payload
    for the allreduce schemes (dense fp32 only for NoCompression, fp16 for FP16, k values for
    Random-K) and a 1-element fp32 placeholder for each tensor of an allgather scheme --
    never a dense tensor of zeros.  (tf.function may trace more than once: whole copies.)"""
    main_run("TopK")
    got = Counter(c[2] for c in _MAIN["spy"] if c[0] == "allreduce")
    want = Counter()
    for sid, ef in MAIN_CASES:
        name, config = SCHEMES[sid]().scheme.name, SCHEMES[sid]().scheme.config()
        for shape in SPECS.values():
            numel = int(np.prod(shape))
            want[ref.payload_bytes(name, config, numel) if ref.transport(name) == "allreduce" else 4] += 1
    traces = sum(got.values()) // sum(want.values())
    assert traces >= 1 and got == Counter({k: v * traces for k, v in want.items()}), (got, want)


# --- schemes without a numpy reference: their own laws ------------------------------------------------
_EXTRA = {}


def extra_run(sid):
    """Lossless (op=Average) and PowerSGD (op=Sum), 3 tape steps, one tf.function each."""
    if not _EXTRA:
        _EXTRA.update(tape_run({"lossless": ("Lossless", EXTRA["Lossless"]())}, steps=3, autograph=False))
        _EXTRA.update(tape_run({"powersgd": ("PowerSGD", EXTRA["PowerSGD"]())}, steps=3, autograph=False,
                               op=hvd.Sum))
    return _EXTRA[sid.lower()]


def test_tape_lossless_is_exact_and_counts_its_bytes():
    """Lossless: the aggregate is exactly the uncompressed one; the counter is the placeholder,
    the blob's length (4) and the blob: byte planes of the floats, zstd level 1."""
    res = extra_run("Lossless")
    stats = res.comp.stats.per_tensor()
    for spec, shape in SPECS.items():
        grads = [[G(spec, r, s, shape).reshape(-1) for r in range(SIZE)] for s in range(3)]
        sim = ref.simulate("NoCompression", {}, grads, error_feedback=False, op="average")
        assert_matches("Lossless", [g[spec] for g in res.got], sim.aggregated, f"{spec} (rank {RANK})")
        key = res.keys[spec]
        assert stats[key]["payload_bytes"] == 8 + shuffle_zstd_nbytes(grads[-1][RANK]), (key, stats[key])


def test_tape_powersgd_conservation_and_bytes():
    """PowerSGD (op=Sum, error feedback): aggregate + residuals == everything given; a rank-2
    aggregate; factors of (n + m) * rank floats, vectors dense."""
    res = extra_run("PowerSGD")
    residuals = res.residuals()
    assert set(residuals) == set(res.keys.values()), sorted(residuals)
    mine = np.concatenate([residuals[res.keys[s]].reshape(-1) for s in SPECS])
    everyone = hvd.allgather(tf.constant(mine[None]), name="tf.powersgd.residuals").numpy()
    offset = 0
    for spec, shape in SPECS.items():
        n = int(np.prod(shape))
        grads_all = [G(spec, r, s, shape) for s in range(3) for r in range(SIZE)]
        aggregate_conservation(f"PowerSGD {spec} (rank {RANK})", [g[spec] for g in res.got],
                               everyone[:, offset:offset + n], grads_all)
        offset += n
    stats = res.comp.stats.per_tensor()
    assert stats[res.keys["big/weight"]]["payload_bytes"] == 4 + 4 * (40 + 25) * 2
    assert stats[res.keys["tiny"]]["payload_bytes"] == 4 * 7
    for g in res.got:
        m = g["big/weight"].reshape(40, 25)
        assert np.linalg.matrix_rank(m, tol=1e-4 * np.abs(m).max()) <= 2, "not a rank-2 aggregate"


# --- Horovod's options keep their meaning -----------------------------------------------------------
_OPTS = {}


def option_run(option, sid):
    """One 2-step tape run (autograph off) per option, over that option's schemes."""
    if option not in _OPTS:
        schemes, kw, _ = OPTION_CASES[option]
        cases = {_tag(s, None): (s, SCHEMES[s]()) for s in schemes}
        _OPTS[option] = tape_run(cases, steps=2, specs=SPECS, autograph=False, **kw)
    return _OPTS[option][_tag(sid, None)]


OPTION_CASES = {
    "sum": (["NoCompression", "FP16", "BF16", "RandomK", "TopK-Int8", "QSGD16", "SignSGD", "Threshold"],
            dict(op=hvd.Sum), dict(op="sum")),
    "predivide": (["NoCompression", "FP16", "TopK", "QSGD16"],
                  dict(op=hvd.Average, gradient_predivide_factor=2.0), dict(op="average")),
    "groups": (["FP16", "RandomK", "QSGD16", "DGC"], dict(groups=2), {}),
    "process_set": (["FP16", "RandomK", "TopK", "Threshold"], dict(process_set=SUBSET), {}),
}


@pytest.mark.parametrize("sid", OPTION_CASES["sum"][0])
def test_tape_op_sum(sid):
    option_run("sum", sid).check("op=Sum", op="sum")


@pytest.mark.parametrize("sid", OPTION_CASES["predivide"][0])
def test_tape_gradient_predivide_factor(sid):
    option_run("predivide", sid).check("gradient_predivide_factor=2", op="average")


@pytest.mark.parametrize("sid", OPTION_CASES["groups"][0])
def test_tape_groups(sid):
    """groups=2: Horovod's grouped TF path gives the compressor no variable name, so it keys
    by the gradient tensor's graph name (the same on every rank); each key still follows one
    variable (the four have distinct sizes, which maps keys to variables here)."""
    res = option_run("groups", sid)
    by_numel = {row["dense_fp32_bytes"] // 4: key for key, row in res.comp.stats.per_tensor().items()}
    assert len(by_numel) == len(SPECS), by_numel
    res.keys = {spec: by_numel[int(np.prod(shape))] for spec, shape in SPECS.items()}
    res.check("groups=2")


@pytest.mark.parametrize("sid", OPTION_CASES["process_set"][0])
def test_tape_process_set_subset(sid):
    """process_set=<all ranks but the last> ([0, 1] at np=3): the members aggregate among
    themselves, side collectives on the same set, seeds from the set rank.  A set of one rank
    (np=2) gets its local gradient back (Horovod's tf.cond skips the reduction).

    The excluded rank does not take part: in Horovod 0.28.1 a rank outside the set cannot
    even trace DistributedGradientTape(process_set=...) inside tf.function -- with or
    without compression, ``process_set.size()`` raises "Process set does not exist or has
    not been registered" while tf.cond traces the reduction branch."""
    members = SUBSET.ranks
    if RANK not in members:
        return
    res = option_run("process_set", sid)
    if len(members) > 1:
        res.check(f"process_set={members}", ranks=members)
    else:
        for spec, shape in SPECS.items():
            for step, g in enumerate(res.got):
                np.testing.assert_array_equal(g[spec], G(spec, RANK, step, shape))


# --- keying ------------------------------------------------------------------------------------------
TWINS = {"twin_a": (64,), "twin_b": (64,)}
KEYING = ["TopK", "QSGD16"]
_KEYING = {}


@pytest.mark.parametrize("sid", KEYING)
def test_keying_sources_in_changing_order(sid):
    """Two variables of identical shape; two tf.functions that list the sources in different
    orders, alternating between steps, share each compressor: every residual, draw and side
    collective follows its own variable."""
    if not _KEYING:
        cases = {_tag(s, True): (s, SCHEMES[s](error_feedback=True)) for s in KEYING}
        _KEYING.update(tape_run(cases, steps=4, specs=TWINS, autograph=False,
                                orders=[["twin_a", "twin_b"], ["twin_b", "twin_a"]]))
    res = _KEYING[_tag(sid, True)]
    residuals = res.residuals()
    assert set(residuals) == set(res.keys.values())
    res.check("sources reordered")
    for spec, shape in TWINS.items():
        sim, grads = simulate(res.comp, spec, res.keys[spec], shape, 4)
        np.testing.assert_allclose(residuals[res.keys[spec]], sim.residuals[RANK],
                                   **residual_tolerance(sid, [g[RANK] for g in grads]),
                                   err_msg=f"residual of {spec} crossed")


# --- the legacy optimizer ------------------------------------------------------------------------------
LEGACY = ["TopK", "QSGD16"]
_LEGACY = {}


@pytest.mark.parametrize("sid", LEGACY)
def test_legacy_optimizer_compute_gradients(sid):
    """hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer) inside
    tf.function: compute_gradients returns the reference's aggregate."""
    if not _LEGACY:
        order = list(SPECS)
        parts = {}
        for s in LEGACY:
            tag = "legacy_" + _tag(s, None)
            comp = SCHEMES[s]()
            variables = [tf.Variable(tf.zeros(SPECS[p]), name=f"{tag}/{p}") for p in order]
            opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.0), compression=comp)
            parts[s] = (variables, opt, Result(s, comp, SPECS, {p: f"{tag}/{p}:0" for p in order}, 2))

        @tf.function
        def step_fn(grads):
            out = {}
            for s, (variables, opt, _) in parts.items():
                loss = lambda vs=variables: tf.add_n([tf.reduce_sum(v * g) for v, g in zip(vs, grads)])  # noqa: E731
                out[s] = [g for g, _ in opt.compute_gradients(loss, var_list=variables)]
            return out

        for step in range(2):
            out = step_fn([injected(p, step, SPECS[p]) for p in order])
            for s, grads in out.items():
                parts[s][2].got.append({p: g.numpy() for p, g in zip(order, grads)})
        _LEGACY.update({s: p[2] for s, p in parts.items()})
    res = _LEGACY[sid]
    assert set(res.comp.stats.per_tensor()) == set(res.keys.values())
    res.check("legacy optimizer")


def test_legacy_optimizer_backward_passes_per_step_refused_eagerly_by_horovod():
    """Horovod 0.28.1 itself refuses backward_passes_per_step > 1 for the legacy optimizer
    in eager mode (TF2's default), before any compression is involved."""
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                 compression=hvd_compress.TopK(0.1), backward_passes_per_step=2)


# --- Keras model.fit ----------------------------------------------------------------------------------
class Recorder(tf.keras.callbacks.Callback):
    """After every batch: if the optimizer applied gradients, keep a copy of them."""

    def __init__(self, opt):
        super().__init__()
        self.opt, self.seen, self.got = opt, 0, []

    def on_train_batch_end(self, batch, logs=None):
        n = int(self.opt.applied.numpy()) if hasattr(self.opt, "applied") else 0
        if n != self.seen:
            self.seen = n
            self.got.append({k: v.numpy() for k, v in self.opt.captured.items()})


KERAS = [("TopK", 1, "average"), ("QSGD16", 2, "average"), ("RandomK", 2, "average"), ("Threshold", 2, "sum")]


@pytest.mark.parametrize("sid,bpps,op", KERAS)
def test_keras_fit_aggregate_matches_reference(sid, bpps, op):
    """model.fit with horovod.tensorflow.keras.DistributedOptimizer: the gradients the
    wrapped optimizer applies == reference.  backward_passes_per_step=2: Horovod sums two
    micro-batches' gradients locally, then compresses and reduces once (the compressor's
    step counts communications)."""
    comp = SCHEMES[sid]()
    tag = f"keras_{_tag(sid, None)}_{bpps}_{op}".lower()
    steps = 2
    numel = sum(int(np.prod(s)) for s in SPECS.values())
    x = np.stack([np.concatenate([G(s, RANK, step, shape, micro).reshape(-1) for s, shape in SPECS.items()])
                  for step in range(steps) for micro in range(bpps)])
    inp = tf.keras.Input(shape=(numel,))
    model = tf.keras.Model(inp, Inject(SPECS, name=tag)(inp))
    opt = hvdk.DistributedOptimizer(CaptureSGD(learning_rate=0.0), compression=comp, backward_passes_per_step=bpps,
                                    op=hvd.Sum if op == "sum" else hvd.Average)
    model.compile(optimizer=opt, loss=lambda y_true, y_pred: tf.reduce_mean(y_pred))
    rec = Recorder(opt)
    model.fit(x, np.zeros((len(x), 1), np.float32), batch_size=1, epochs=1, shuffle=False, verbose=0,
              callbacks=[rec])
    res = Result(sid, comp, SPECS, {s: f"{tag}/{s}:0" for s in SPECS}, steps)
    res.got = [{s: g[res.keys[s]] for s in SPECS} for g in rec.got]
    assert set(comp.stats.per_tensor()) == set(res.keys.values())
    res.check(f"keras fit backward_passes_per_step={bpps} op={op}", bpps=bpps, op=op)


# --- a large fixed-length payload between 2 ranks: swapped by a reduce-scatter where switched on -------------
SWAP_AT = 1 << 20  # HVDC_PAIR_SWAP_MIN_BYTES in these tests


@pytest.mark.skipif(SIZE != 2, reason="the swap is for 2 ranks; at others allgather_fixed is the allgather")
def test_large_fixed_payload_swapped_exactly(monkeypatch):
    """With HVDC_PAIR_SWAP_MIN_BYTES set, ``TFCollectives.allgather_fixed`` in a tf.function gives
    hvd.allgather's bytes exactly (odd byte lengths, int8, -0.0 and NaN payloads included) and moves
    a payload of that size by a reduce-scatter, smaller ones by the allgather.  (The transport's
    use of it is tested in torch: test_top_k_through_the_swap_matches_the_allgather.)"""
    monkeypatch.setenv("HVDC_PAIR_SWAP_MIN_BYTES", str(SWAP_AT))
    adapter = TFAdapter()
    rng = np.random.default_rng(1234 + RANK)
    floats = rng.integers(-2 ** 31, 2 ** 31 - 1, SWAP_AT // 4 + 5, dtype=np.int32).view(np.float32)
    floats[:3] = [-0.0, np.nan, -np.inf]
    odd = rng.integers(0, 256, SWAP_AT + 3, dtype=np.uint8)
    cases = {"odd": tf.constant(odd), "int8": tf.constant(odd.view(np.int8)), "floats": tf.constant(floats),
             "small": tf.constant(odd[:1000])}
    swaps = []
    orig = hvd.reducescatter

    def spy(tensor, *a, name=None, **kw):
        swaps.append(name.rsplit("/", 1)[-1])  # the name among the ranks (ignore_name_scope=True)
        return orig(tensor, *a, name=name, **kw)

    monkeypatch.setattr(hvd, "reducescatter", spy)

    @tf.function(autograph=False)
    def both():
        got = {k: adapter.roles.collectives.allgather_fixed(t, f"tf.swap.{k}", hvd.global_process_set, RANK, SIZE)
               for k, t in cases.items()}
        want = {k: hvd.allgather(t, name=f"tf.swap.want.{k}") for k, t in cases.items()}
        return got, want

    got, want = both()
    assert sorted(swaps) == ["tf.swap.floats", "tf.swap.int8", "tf.swap.odd"], swaps
    for k in cases:
        g, w = got[k].numpy(), want[k].numpy()
        assert g.dtype == w.dtype and g.shape == w.shape, (k, g.shape, w.shape)
        assert g.tobytes() == w.tobytes(), k


# --- pass-through --------------------------------------------------------------------------------------
@pytest.mark.parametrize("sid", IDS)
def test_non_float_passes_through_and_ctx_none(sid):
    comp = SCHEMES[sid]()
    for t in (tf.range(6, dtype=tf.int32), tf.range(6, dtype=tf.int64), tf.constant([True, False]),
              tf.constant([1, 2], tf.uint8)):
        out, ctx = comp.compress(t)
        assert out is t and ctx is None
    x = tf.random.normal([5])
    assert comp.decompress(x, None) is x
    s = hvd.allreduce(tf.fill([3], tf.constant(RANK + 1, tf.int64)), op=hvd.Sum, compression=comp,
                      name=f"tf.passthrough.{sid}")
    assert s.dtype == tf.int64 and s.numpy().tolist() == [SIZE * (SIZE + 1) // 2] * 3
    assert comp.stats.per_tensor() == {}


# --- training: replicas identical, loss falls --------------------------------------------------------------
def _dataset():
    return dataset(SIZE)


_model = linear_model
_flat = flat_weights
_TRAIN = {}


def train_all():
    """Every scheme trains its own linear model with DistributedGradientTape, all in one
    tf.function (autograph off), 20 steps on this rank's shard; then the flattened weights of
    every replica are gathered."""
    if _TRAIN:
        return _TRAIN
    run = LinearTraining(TRAIN_IDS, name_of=lambda sid: "linear_" + _tag(sid, None).lower())
    before = run.losses()
    for step in range(20):
        run.step(step)
    _TRAIN.update(before=before, after=run.losses(), everyone=run.everyone("tf.replicas.all"))
    return _TRAIN


@pytest.mark.parametrize("sid", TRAIN_IDS)
def test_tape_training_replicas_identical_and_loss_falls(sid):
    t = train_all()
    i = TRAIN_IDS.index(sid)
    for r in range(SIZE):
        np.testing.assert_array_equal(t["everyone"][r, i], t["everyone"][0, i],
                                      err_msg=f"{sid}: replica {r} differs from replica 0")
    assert t["after"][sid] < 0.8 * t["before"][sid], f"{sid}: loss {t['before'][sid]:.4f} -> {t['after'][sid]:.4f}"


def test_keras_fit_training_replicas_identical_and_loss_falls():
    model = _model(200 + RANK, "keras_fit_linear")
    opt = hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(learning_rate=0.1), compression=hvd_compress.TopK(0.2))
    model.compile(optimizer=opt, loss="mse")
    x, y = _dataset()
    mine = slice(RANK * 96, (RANK + 1) * 96)
    hist = model.fit(x[mine], y[mine], batch_size=32, epochs=7, shuffle=False, verbose=0,
                     callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0)])
    everyone = hvd.allgather(_flat(model)[None], name="tf.replicas.keras").numpy()
    for r in range(SIZE):
        np.testing.assert_array_equal(everyone[r], everyone[0], err_msg=f"replica {r} differs from replica 0")
    losses = hist.history["loss"]
    assert losses[-1] < 0.8 * losses[0], f"epoch losses {losses}"


def test_legacy_optimizer_training_replicas_identical_and_loss_falls():
    model = _model(300 + RANK, "legacy_linear")
    hvd.broadcast_variables(model.variables, root_rank=0)
    comp = hvd_compress.TopK(0.2)
    opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), compression=comp)
    x, y = _dataset()

    @tf.function
    def train_step(xb, yb):
        loss = lambda: tf.reduce_mean(tf.square(model(xb, training=True) - yb))  # noqa: E731
        opt.apply_gradients(opt.compute_gradients(loss, var_list=model.trainable_variables))

    before = float(tf.reduce_mean(tf.square(model(x) - y)))
    for step in range(20):
        lo = RANK * 96 + (step % 3) * 32
        train_step(tf.constant(x[lo:lo + 32]), tf.constant(y[lo:lo + 32]))
    after = float(tf.reduce_mean(tf.square(model(x) - y)))
    everyone = hvd.allgather(_flat(model)[None], name="tf.replicas.legacy").numpy()
    for r in range(SIZE):
        np.testing.assert_array_equal(everyone[r], everyone[0], err_msg=f"replica {r} differs from replica 0")
    assert after < 0.8 * before, f"loss {before:.4f} -> {after:.4f}"
    assert {k.split("/")[-1] for k in comp.stats.per_tensor()} == {"kernel:0", "bias:0"}
