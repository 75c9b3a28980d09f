"""Low-rank compression."""
from __future__ import annotations

from math import prod

from .base import Scheme, check_range, register


@register(kind="lowrank", compare="lowrank", examples={"powersgd": "PowerSGD(2)"},
          horovod={"PowerSGD": "PowerSGD(2)"}, bench=("PowerSGD(2)",), table={"PowerSGD(4)": "4 r (rows + cols)"})
class PowerSGD(Scheme):
    """PowerSGD (Vogels, Karimireddy & Jaggi, "PowerSGD: Practical Low-Rank
    Gradient Compression for Distributed Optimization", NeurIPS 2019).

    A gradient reshaped to an ``n x m`` matrix ``M`` is approximated by
    ``P Q^T`` of rank ``rank`` with one step of power iteration, warm-started
    from the previous step's ``Q``:

    1. ``P_i = M_i Q``; allreduce P (sum)       -- side collective, in ``compress``
    2. ``P = orthonormalize(P)``; ``Q_i = M_i^T P``; allreduce Q (sum)
    3. aggregate ``P (sum_i Q_i)^T``; this rank sent ``P Q_i^T``; the error
       ``M_i - P Q_i^T`` is fed back (per rank, so nothing is lost).

    Both factors are sums of per-rank terms, so they travel by allreduce:
    traffic ``(n + m) * rank`` floats a tensor, flat in the number of workers.
    Tensors with fewer than 2 dimensions, or too small for the rank to save
    bytes, are sent uncompressed (as in PyTorch's ``powerSGD_hook``).

    Tuning (from the paper and PyTorch's hook): rank 1-4 for CNNs, more for
    Transformers; error feedback is essential; start compression after a short
    dense warmup (see :class:`hvd_compress.Policy` schedules).
    """
    transport = "powersgd"
    error_feedback_default = True

    def __init__(self, rank=2):
        check_range("rank", rank, 1, None, kind=int)
        self.rank = rank

    def config(self):
        return {"rank": self.rank}

    @staticmethod
    def matrix_shape(shape):
        """The ``n x m`` matrix a gradient of ``shape`` is treated as (None below 2-D).

        A tensor of 3 or more dimensions splits after its first dimension (PyTorch's
        layouts: a conv weight is ``(out, in, kh, kw)``, as PyTorch's ``powerSGD_hook``
        reshapes it) or before its last (TensorFlow's: a conv kernel is ``(kh, kw, in, out)``).
        The split whose shorter side is longer is taken: a rank-``r`` factorisation saves
        bytes only while ``r (n + m) < n m``, which a side as short as a 3-wide kernel
        never allows, so splitting a TF kernel after its first dimension would send every
        conv layer uncompressed.  Ties keep the first split.  The choice depends on the
        shape alone, so every rank makes the same one."""
        if len(shape) < 2:
            return None
        dims = [int(d) for d in shape]
        first = (dims[0], prod(dims[1:]))
        last = (prod(dims[:-1]), dims[-1])
        return last if min(last) > min(first) else first

    def transport_for(self, shape):
        nm = self.matrix_shape(shape)
        if nm is None or (nm[0] + nm[1]) * self.rank >= nm[0] * nm[1]:
            return "allreduce"  # compressing would not save bytes
        return "powersgd"

    # -- the uncompressed fallback ------------------------------------------------
    def encode(self, B, x, ctx):
        return {"reduce": x}, x

    def decode_reduced(self, B, reduced, numel, ctx=None):
        return reduced

    # -- the two rounds -------------------------------------------------------------
    def first_round(self, B, x, q, shape):
        """``P_i = M_i Q``; returns (P_i, M_i)."""
        n, m = self.matrix_shape(shape)
        mat = B.reshape(x, (n, m))
        return B.matmul(mat, q), mat

    def second_round(self, B, p_sum, mat):
        """Orthonormalized P and this rank's ``Q_i = M_i^T P``."""
        p = B.orthonormalize(p_sum)
        return p, B.matmul(B.transpose(mat), p)

    def finish(self, B, p, q_local, q_sum):
        """(sum over ranks as a flat tensor, this rank's contribution)."""
        agg = B.flatten(B.matmul(p, B.transpose(q_sum)))
        sent = B.flatten(B.matmul(p, B.transpose(q_local)))
        return agg, sent

    def payload_nbytes(self, numel, shape=None):
        nm = self.matrix_shape(shape) if shape is not None else None
        if nm is None or self.transport_for(shape) != "powersgd":
            return 4 * numel
        return 4 * (nm[0] + nm[1]) * self.rank + 4

    def step_nbytes(self, numel, shape):
        return self.payload_nbytes(numel, shape)
