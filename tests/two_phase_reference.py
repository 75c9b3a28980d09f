"""A numpy reference of the two-phase compressed allreduce, built on tests/reference.py.

Nothing here imports ``hvd_compress``: the per-chunk encoding and the
combination over ranks are ``reference.sent()`` and ``reference.aggregate()``
(written from the papers), and the two-phase bookkeeping below is written from
the transport's description in docs/design/two_phase.md -- so the Horovod tests that compare the library
against this module compare two independent implementations.

The math, per tensor of ``n`` elements on ``N`` ranks, ``c = ceil(n / N)``
elements a chunk, every tensor zero-padded to ``N * c``:

1. stage-1 error feedback: ``acc_i = g_i + r1_i``;
2. rank ``i`` encodes each chunk ``j`` of its padded ``acc_i`` on its own
   (``s1_ij = sent(chunk_j(acc_i))``) and sends chunk ``j``'s payload to rank
   ``j`` (alltoall); ``r1_i = acc_i - concat_j(s1_ij)[:n]``;
3. the owner ``j`` of chunk ``j`` combines the ``N`` contributions
   (``aggregate``: a rank-ordered fp32 sum; SignSGD: the majority sign), adds
   its stage-2 residual ``r2_j`` (a chunk-sized vector; the library keys it
   ``"<name>#owned_chunk"``), re-encodes: ``s2_j = sent(acc2_j)``,
   ``r2_j = acc2_j - s2_j``;
4. the ``N`` owners' payloads are allgathered; every rank decodes them,
   concatenates, cuts to ``n`` and applies Horovod's op like the allgather
   transport does (Average: ``* fp32(placeholder) / N``; SignSGD: no scaling).

Without error feedback neither stage keeps a residual.  A non-finite residual
element is reset to 0 (as ``finite_or_zero`` does).

Conservation (every scheme whose combination is a sum, with error feedback)::

    sum_steps concat_j(s2_j)[:n] + sum_i r1_i + sum_j r2_j[:n] == sum_steps sum_i g_i

(with ``op=Sum`` the first term is the aggregated gradient itself; with
Average it is the aggregated gradient times ``N``).

Stochastic schemes (QSGD, TernGrad) take their draws from callables:
``uniform1(step, rank, chunk, n)`` for stage 1 and ``uniform2(step, owner, n)``
for stage 2 (the Horovod tests reproduce the adapters' seeded generators).

Top-K ties: with ``values=Int8()`` the owner selects among sums of quantized
values, so equal magnitudes at the k-th place are common and which one is kept
is the framework's top-k's choice (TF documents "lower index first", as
``reference.topk_indices`` does; torch's CPU top-k does not say).  ``select``,
a callable ``(abs_values, k) -> indices``, lets a test use the framework's
selection on the same float32 magnitudes (reproducing a tie-break, as the draws
are reproduced); None keeps the reference's stable lowest-index rule.
"""
from __future__ import annotations

import hashlib
import os
import sys
from typing import Callable, List, Optional

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import reference as ref  # noqa: E402  (tests/reference.py)

f32 = np.float32

#: The fixed-size allgather schemes the two-phase transport accepts, as used by the tests:
#: id -> (factory name, positional args, keyword args for the scheme).
CASES = {
    "Int8": ("Int8", (), {}),
    "Int8-block64": ("Int8", (), {"block_size": 64}),
    "EFSignSGD": ("EFSignSGD", (), {}),
    "OneBit": ("OneBit", (), {}),
    "SignSGD": ("SignSGD", (), {}),
    "TopK": ("TopK", (0.05,), {}),
    "TopK-Int8": ("TopK", (0.05,), {"values": "Int8"}),
    "BF16": ("BF16", (), {}),
    "QSGD16": ("QSGD", (16,), {}),
    "TernGrad": ("TernGrad", (), {}),
}
DETERMINISTIC = ["Int8", "Int8-block64", "EFSignSGD", "OneBit", "SignSGD", "TopK", "TopK-Int8", "BF16"]
STOCHASTIC = ["QSGD16", "TernGrad"]
#: float reductions (norms, means) formed in another order than here: a few ulp of the scale
LOOSE = {"QSGD16", "EFSignSGD", "OneBit"}


#: id -> (reference scheme name, reference config)
REF = {
    "Int8": ("Int8", {}),
    "Int8-block64": ("Int8", {"block_size": 64}),
    "EFSignSGD": ("EFSignSGD", {}),
    "OneBit": ("OneBit", {}),
    "SignSGD": ("SignSGD", {}),
    "TopK": ("TopK", {"ratio": 0.05}),
    "TopK-Int8": ("TopK", {"ratio": 0.05, "values": ("Int8", {})}),
    "BF16": ("BF16", {}),
    "QSGD16": ("QSGD", {"levels": 16}),
    "TernGrad": ("TernGrad", {}),
}


def make_compressor(hvd_compress, sid, transport="two_phase", **kw):
    """The library's compressor of case ``sid`` (the only place the tests build one)."""
    name, args, skw = CASES[sid]
    skw = dict(skw)
    if skw.get("values") == "Int8":
        skw["values"] = hvd_compress.Int8()
    return getattr(hvd_compress, name)(*args, transport=transport, **skw, **kw)


def _seed_of(text):
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little")


def G(name, rank, step, shape):
    """The gradient rank ``rank`` injects for parameter ``name`` at ``step``: N(0, 1)
    scaled per rank, identical wherever it is computed."""
    g = np.random.default_rng([_seed_of("two_phase:" + name), rank, step]).standard_normal(int(np.prod(shape)))
    return (g * (1.0 + 0.5 * rank)).astype(f32).reshape(shape)


def grads_for(name, shape, size, steps):
    """``grads[step][rank]``, flat float32."""
    return [[G(name, r, s, shape).reshape(-1) for r in range(size)] for s in range(steps)]


def chunk_size(numel, size):
    return -(-numel // size)


def _finite(r):
    return np.where(np.isfinite(r), r, f32(0)).astype(f32)


class TwoPhaseResult:
    """``aggregated[step]`` (what every rank gets), ``r1[rank]`` (stage-1 residuals, length
    n), ``r2[owner]`` (stage-2 residuals, length c), ``sent2[step]`` (the concatenated,
    unscaled second-stage contributions cut to n), ``chunk_sums[step][owner]``."""

    def __init__(self):
        self.aggregated: List[np.ndarray] = []
        self.sent2: List[np.ndarray] = []
        self.chunk_sums: List[List[np.ndarray]] = []
        self.r1: List[Optional[np.ndarray]] = []
        self.r2: List[Optional[np.ndarray]] = []


def _sent(name, config, x, draw, select):
    if name == "TopK" and select is not None:
        k = ref.k_for(ref._cfg(name, config)["ratio"], x.size)
        idx = np.sort(np.asarray(select(np.abs(x).astype(f32), k), np.int64).reshape(-1))
        assert idx.size == k and np.unique(idx).size == k, "select must return k distinct indices"
        return ref.sent(name, config, x, uniform=draw, indices=idx)
    return ref.sent(name, config, x, uniform=draw)


def simulate(scheme, config, grads, error_feedback, op="average",
             uniform1: Optional[Callable] = None, uniform2: Optional[Callable] = None,
             select: Optional[Callable] = None):
    """Run the two-phase math over ``grads[step][rank]`` (flat float32 arrays)."""
    name = ref._name(scheme)
    steps = len(grads)
    size = len(grads[0])
    n = int(np.asarray(grads[0][0]).size)
    c = chunk_size(n, size)
    pad = c * size - n
    out = TwoPhaseResult()
    r1 = [np.zeros(n, f32) for _ in range(size)] if error_feedback else [None] * size
    r2 = [np.zeros(c, f32) for _ in range(size)] if error_feedback else [None] * size
    for step in range(steps):
        per_owner = [[None] * size for _ in range(size)]  # [owner][sender]
        for i in range(size):
            g = ref._check_x(grads[step][i])
            acc = g if r1[i] is None else (g + r1[i]).astype(f32)
            padded = np.concatenate([acc, np.zeros(pad, f32)])
            sents = []
            for j in range(size):
                draw = None if uniform1 is None else (lambda m, s=step, i=i, j=j: uniform1(s, i, j, m))
                s = _sent(name, config, padded[j * c:(j + 1) * c], draw, select)
                per_owner[j][i] = s
                sents.append(s)
            if error_feedback:
                r1[i] = _finite(acc - np.concatenate(sents)[:n])
        sums, sent2 = [], []
        for j in range(size):
            chunk_sum = ref.aggregate(name, per_owner[j])
            sums.append(chunk_sum)
            acc2 = chunk_sum if r2[j] is None else (chunk_sum + r2[j]).astype(f32)
            draw = None if uniform2 is None else (lambda m, s=step, j=j: uniform2(s, j, m))
            # SignSGD's owner sends its vote exactly (2 bits: a tie stays 0)
            s2 = np.sign(acc2).astype(f32) if name == "SignSGD" else _sent(name, config, acc2, draw, select)
            if error_feedback:
                r2[j] = _finite(acc2 - s2)
            sent2.append(s2)
        total = np.concatenate(sent2)[:n].astype(f32)
        out.chunk_sums.append(sums)
        out.sent2.append(total)
        out.aggregated.append(ref.op_scale(name, total, size, op))
    out.r1, out.r2 = r1, r2
    return out


def stage2_cut(r2, numel):
    """The owners' stage-2 residuals laid out over the tensor, cut to ``numel``."""
    return np.concatenate([np.asarray(r, f32).reshape(-1) for r in r2])[:numel]


def conservation_gap(sent_steps, r1, r2, grads):
    """``(lhs, rhs)`` of the conservation law in float64: ``sum_steps sent +
    sum_i r1_i + sum_j r2_j[:n]`` and ``sum_steps sum_i g_i``; ``sent_steps[step]``
    is the unscaled combined contribution (aggregated * N for Average)."""
    n = int(np.asarray(grads[0][0]).size)
    lhs = np.sum([np.asarray(s, np.float64).reshape(-1) for s in sent_steps], axis=0)
    lhs = lhs + np.sum([np.asarray(r, np.float64).reshape(-1) for r in r1], axis=0)
    lhs = lhs + stage2_cut(r2, n).astype(np.float64)
    rhs = np.sum([np.asarray(g, np.float64).reshape(-1) for step in grads for g in step], axis=0)
    return lhs, rhs


# --- tolerances ---------------------------------------------------------------------------------
def tolerance(sid, want):
    """rtol 1e-5 relative to the largest element (the brief's rtol ~1e-5); the
    float-reduction schemes get the same (their scales differ by a few ulp)."""
    want = np.asarray(want)
    scale = float(np.max(np.abs(want))) if want.size else 1.0
    return dict(rtol=1e-5, atol=1e-5 * max(scale, 1e-30))


def residual_tolerance(sid, magnitude):
    """A residual is ``acc - sent``: its rounding is a few ulp of the gradient's magnitude."""
    return dict(rtol=1e-5, atol=4e-5 * magnitude)


def assert_steps_match(sid, got_steps, want_steps, what):
    assert len(got_steps) == len(want_steps), (len(got_steps), len(want_steps))
    for step, (got, want) in enumerate(zip(got_steps, want_steps)):
        want = np.asarray(want).reshape(-1)
        np.testing.assert_allclose(np.asarray(got).reshape(-1), want, **tolerance(sid, want),
                                   err_msg=f"{sid} {what} step {step}")


def payload_bytes_two_phase(scheme, config, numel, size):
    """Bytes the library's stats count for one two-phase call: the 4-byte placeholder,
    the N chunk payloads sent by alltoall and the one owned-chunk payload allgathered
    (each chunk's payload without the placeholder the allgather transport adds)."""
    c = chunk_size(numel, size)
    one = ref.payload_bytes(scheme, config, c) - 4  # payload_bytes counts the placeholder once
    owned = -(-c // 4) if scheme == "SignSGD" else one  # SignSGD's vote goes out in 2 bits an element
    return 4 + size * one + owned


def expected_ratio(scheme, config, numel, size):
    """Two-phase over allgather bytes at the Horovod call for one tensor."""
    return payload_bytes_two_phase(scheme, config, numel, size) / ref.payload_bytes(scheme, config, numel)


__all__ = ["CASES", "DETERMINISTIC", "STOCHASTIC", "LOOSE", "G", "grads_for", "chunk_size", "simulate",
           "stage2_cut", "conservation_gap", "tolerance", "residual_tolerance", "assert_steps_match",
           "payload_bytes_two_phase", "make_compressor", "REF"]
