"""Framework-neutral pieces of test_torch_compression.py and test_tf_compression.py:
the schemes under test, the deterministic rank-specific gradients, the reference
simulation (tests/reference.py) and the tolerances.

Not a test file (scripts/run_tests.sh launches only ``test_*.py``).
"""
import hashlib
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import reference as ref  # noqa: E402  (tests/reference.py)

import hvd_compress  # noqa: E402


def world_size_from_env():
    """The world size before hvd.init() (static process sets must be registered at init)."""
    for v in ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        if v in os.environ:
            return int(os.environ[v])
    return 1


def _factory(spec):
    """``**kw -> compressor`` for a registered spec: ``hvd_compress.<Name>(*args, **kwargs, **kw)``."""
    from hvd_compress.schemes.base import spec_call
    name, args, kwargs = spec_call(spec)
    return lambda **kw: getattr(hvd_compress, name)(*args, **kwargs, **kw)


def _horovod_cases(with_reference):
    return {cid: _factory(spec) for reg in hvd_compress.schemes.REGISTRY.values()
            if (reg.name in ref.SCHEMES) == with_reference for cid, spec in reg.horovod.items()}


#: the registered Horovod cases (hvd_compress.schemes.REGISTRY) of the schemes
#: tests/reference.py has math for: case id -> ``**kw -> compressor``
SCHEMES = _horovod_cases(with_reference=True)
IDS = list(SCHEMES)
EF_DEFAULT_ON = [s for s in IDS if SCHEMES[s]().error_feedback]
EF_DEFAULT_OFF = [s for s in IDS if not SCHEMES[s]().error_feedback]
# Float reductions (norms, means) are formed in another order by the reference: a few ulp.
LOOSE = {cid for reg in hvd_compress.schemes.REGISTRY.values() if reg.compare == "reducing" for cid in reg.horovod}
# Representatives of every transport path, for the option tests: dense allreduce, fp16
# allreduce, allreduce with local indices, allgather (fixed size), allgather (variable size),
# stochastic allgather, the vote (no op scaling).
PATHS = ["NoCompression", "FP16", "RandomK", "Int8-block64", "TopK", "Threshold", "DGC", "QSGD16", "SignSGD"]

# learning rates for the training tests (the vote moves every weight by lr each step)
TRAIN_LR = {"SignSGD": 0.002, "EFSignSGD": 0.05}


# Schemes tests/reference.py has no math for (yet): checked by their own laws -- Lossless is
# exact (and its bytes are those of byte-shuffle + zstd), PowerSGD's aggregate is a sum of what
# the ranks sent (conservation), both train.
EXTRA = _horovod_cases(with_reference=False)
TRAIN_IDS = IDS + list(EXTRA)


def train_scheme(sid, **kw):
    if sid == "Threshold":  # in the units of a small model's gradients
        return hvd_compress.Threshold(0.01, **kw)
    return (SCHEMES[sid] if sid in SCHEMES else EXTRA[sid])(**kw)


def shuffle_zstd_nbytes(x, level=1, block=1 << 17):
    """Bytes of Lossless's blob for flat fp32 ``x``: block by block of ``block`` elements,
    the four byte planes of the block's floats (all first bytes, then all second bytes,
    ...), each block compressed as its own frame by zstd at ``level``."""
    import zstandard
    b = np.asarray(x, np.float32).reshape(-1).view(np.uint8).reshape(-1, 4)
    c = zstandard.ZstdCompressor(level=level)
    return sum(len(c.compress(np.ascontiguousarray(b[lo:lo + block].T).tobytes())) for lo in range(0, len(b), block))


def aggregate_conservation(what, got_sum_steps, everyone_residuals, grads_all, rtol=1e-5):
    """Over all ranks, op=Sum: sum over steps of the aggregate + the ranks' final residuals
    == the sum of everyone's gradients (a linear scheme sends what it aggregates)."""
    sent_all = np.sum([np.asarray(g, np.float64).reshape(-1) for g in got_sum_steps], axis=0)
    res_all = np.asarray(everyone_residuals, np.float64).sum(axis=0)
    total = np.sum([np.asarray(g, np.float64).reshape(-1) for g in grads_all], axis=0)
    np.testing.assert_allclose(sent_all + res_all, total, rtol=rtol, atol=rtol * np.abs(total).max(), err_msg=what)


def covered_names():
    return {SCHEMES[i]().scheme.name for i in IDS}


def exported_schemes():
    """The scheme names hvd_compress exports as compressor factories."""
    import hvd_compress.schemes
    return (set(hvd_compress.schemes.__all__) - {"Scheme", "EncodeContext"}) & set(hvd_compress.__all__)


def uncovered():
    """(schemes the reference knows but these tests miss, schemes covered by nothing here)."""
    exported, names = exported_schemes(), covered_names()
    return (exported & set(ref.SCHEMES)) - names, exported - names - set(EXTRA)


def _seed_of(text):
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little")


def G(name, rank, step, shape, micro=0):
    """The gradient rank ``rank`` injects for parameter ``name`` at ``step``: N(0, 1)
    scaled per rank, identical wherever it is computed."""
    g = np.random.default_rng([_seed_of(name), rank, step, micro]).standard_normal(int(np.prod(shape)))
    return (g * (1.0 + 0.5 * rank)).astype(np.float32).reshape(shape)


def local_grads(name, shape, rank, steps, bpps=1):
    """Per-step flat gradient of one rank, micro-batches summed in fp32 like an accumulator."""
    out = []
    for step in range(steps):
        g = G(name, rank, step, shape).reshape(-1)
        for micro in range(1, bpps):
            g = (g + G(name, rank, step, shape, micro).reshape(-1)).astype(np.float32)
        out.append(g)
    return out


def simulate(comp, name, shape, ranks, steps=3, op="average", bpps=1, uniform_fn=None, indices_fn=None,
             ef=None, grads=None):
    """The reference run of ``comp`` on parameter ``name`` for the given ranks.
    Returns ``(SimResult, grads[step][rank])``."""
    if grads is None:
        per_rank = [local_grads(name, shape, r, steps, bpps) for r in ranks]
        grads = [[per_rank[i][s] for i in range(len(ranks))] for s in range(steps)]
    sim = ref.simulate(comp.scheme.name, comp.scheme.config(), grads,
                       error_feedback=comp.error_feedback if ef is None else ef, op=op,
                       uniform_fn=uniform_fn, indices_fn=indices_fn)
    return sim, grads


def tolerance(sid, want):
    want = np.asarray(want)
    scale = float(np.max(np.abs(want))) if want.size else 1.0
    if sid == "FP16":  # fp16 sums are formed in the collective's order
        return dict(rtol=2e-3, atol=2e-3 * scale)
    if sid in LOOSE:
        return dict(rtol=1e-5, atol=1e-5 * scale)
    return dict(rtol=1e-6, atol=1e-6 * scale)


def residual_tolerance(sid, grads_of_rank):
    """A residual is ``acc - sent``: a difference of numbers of the gradient's magnitude, so
    its rounding is a few ulp of the gradient, not of the (small) residual."""
    scale = max(float(np.max(np.abs(g))) for g in grads_of_rank)
    rel = 2e-3 if sid == "FP16" else (1e-5 if sid in LOOSE else 1e-6)
    return dict(rtol=rel, atol=4 * rel * scale)


def assert_matches(sid, got_steps, want_steps, what):
    assert len(got_steps) == len(want_steps)
    for step, (got, want) in enumerate(zip(got_steps, want_steps)):
        want = np.asarray(want).reshape(-1)
        np.testing.assert_allclose(np.asarray(got).reshape(-1), want, **tolerance(sid, want),
                                   err_msg=f"{sid} {what} step {step}")


def check_indices(idx, numel, k):
    idx = np.asarray(idx)
    assert idx.size == k and np.unique(idx).size == k and idx.min() >= 0 and idx.max() < numel, idx
    return idx


def conservation(sid, got_steps, residual, everyone_residuals, sim, grads, rank, size):
    """Nothing lost.  Per rank, with the reference's ``sent``: sum(sent) + residual ==
    sum(grads).  Over all ranks, from the product's outputs alone (not for the vote, whose
    aggregate is not a sum): sum over steps of (aggregate * size) + sum of the ranks'
    residuals == sum of everyone's gradients (op=Average)."""
    steps = len(grads)
    total = np.sum([grads[s][rank] for s in range(steps)], axis=0, dtype=np.float64)
    sent = np.sum([sim.sent[s][rank] for s in range(steps)], axis=0, dtype=np.float64)
    np.testing.assert_allclose(sent + np.asarray(residual, np.float64).reshape(-1), total, rtol=1e-5,
                               atol=1e-5 * np.abs(total).max(), err_msg=f"{sid}: rank {rank}")
    if sid == "SignSGD":
        return
    sent_all = np.sum([np.asarray(g, np.float64).reshape(-1) for g in got_steps], axis=0) * size
    res_all = np.asarray(everyone_residuals, np.float64).sum(axis=0)
    total_all = np.sum([grads[s][r] for s in range(steps) for r in range(size)], axis=0, dtype=np.float64)
    tol = 2e-3 if sid == "FP16" else 1e-5
    np.testing.assert_allclose(sent_all + res_all, total_all, rtol=tol, atol=tol * np.abs(total_all).max(),
                               err_msg=f"{sid}: all ranks")
