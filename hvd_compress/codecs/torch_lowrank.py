"""PowerSGD's rounds for PyTorch tensors (CPU and CUDA) in preallocated
buffers: what :mod:`hvd_compress.transports.lowrank` runs instead of the
scheme's eager ``first_round`` / ``second_round`` / ``finish`` where it can.

The math is the scheme's (Vogels, Karimireddy & Jaggi, NeurIPS 2019), with
``M`` the ``n x m`` matrix of gradient plus residual and ``r`` the rank::

    P_i = M_i Q                    allreduce P          (start, in compress)
    P   = orth(sum P_i); Q_i = M_i^T P; allreduce Q   (second round)
    out = P (sum Q_i)^T * scale;  residual = M_i - P Q_i^T   (finish)

What differs from the eager chain is where the numbers live and the order
of a few roundings:

* every buffer is kept in the parameter's workspace and reused (``P`` and
  ``Q`` as sent, ``Q_i^T``, the scaled ``Q^T``, the seeded start), the residual is
  updated in place (``residual += g`` is ``M``; ``residual -= P Q_i^T`` at
  the end), and the aggregate is written into the gradient Horovod replaces
  by the result.  With plain error feedback (or none), nothing of the
  gradient's size is allocated after the first step (each ``n x m``
  temporary of the eager chain is a fresh ``mmap`` and its page faults under
  glibc's malloc); another memory gets a fresh ``sent`` for its ``update``;
* on the CPU (ranks up to ``LowRankLimit.MAX_RANK``, the C kernels built)
  each round is one pass of a C kernel over ``M`` (``hvdc_lowrank_first``,
  ``_project``, ``_finish`` in hvdc_kernels.c): forming ``M = g + residual``
  into the residual and ``P_i = M Q`` in one pass; ``Q_i^T = P^T M``; and the
  finish, which writes the aggregate and subtracts ``P Q_i^T`` from the
  residual (non-finite entries to 0) while each element of ``M`` is in a
  register, ``2r`` multiply-adds an element, the aggregate streamed past the
  caches where it is large.  A BLAS ``gemm`` with an inner dimension of a few
  runs far below the memory's speed on the CPUs measured, and an op chain
  passes over ``M`` several times (docs/results/benchmarks.md, PowerSGD);
* without the kernels the products are laid out as the BLAS runs a thin
  factor fastest: ``P_i = M Q`` with Q stored column-major (its transpose
  contiguous) and ``Q_i^T = P^T M`` with P column-major as the QR returns it
  (``M^T P``, the eager chain's form, is the slowest layout of all on the CPUs
  measured), and the finish's two ``n x m`` outer products are built one block
  of rows at a time, small enough to stay in the L2 cache, ``r`` multiply-adds
  each, the residual block corrected and summed (the NaN/Inf test) while still
  cached.  On CUDA each product is one ``mm``;
* Horovod's scale (Average's ``1/size``) multiplies the ``m x r`` factor
  before the product instead of the ``n x m`` result;
* the orthonormalisation is one ``torch.linalg.qr`` per matrix, batched over
  every pending matrix of one shape on the CPU (where a batched QR is the same
  LAPACK call per matrix, bit for bit).

Payloads on the wire are those of the eager path (``P`` as ``n x r`` and ``Q``
as ``m x r``, row-major), so ranks on either path add up correctly.  The
results equal the eager chain's to float32 rounding: tests/unit/
test_torch_lowrank.py holds them to a relative 1e-5 of the aggregate's norm
over several steps, with every memory, and checks the buffers are reused.
"""
from __future__ import annotations

import ctypes

import torch

from ..feedback.memory import RESIDUAL, ResidualMemory, compensate, update
from ..kernels import native
from ..kernels.constants import LowRankLimit
from ..kernels.native import enabled

#: elements of one row block of the CPU finish: 1 MB of float32, half an L2
#: cache of the machines measured (2 MB), leaving room for the output block
BLOCK_ELEMENTS = 1 << 18
#: the largest rank built from multiply-adds on the CPU; above it a gemm per block
ELEMENTWISE_MAX_RANK = 8


def codec_for(scheme, memory, x):
    """The preallocated PowerSGD rounds for the flat float32 tensor ``x``, or
    None where the eager chain runs (``HVDC_KERNELS=0``, not a contiguous
    float32 torch tensor)."""
    if not (enabled() and isinstance(x, torch.Tensor) and x.dtype == torch.float32 and x.is_contiguous()):
        return None
    return LowRankCodec(scheme, memory)


def _buffer(ws, name, shape, like):
    t = ws.get(name)
    if t is None or tuple(t.shape) != tuple(shape) or t.device != like.device:
        t = ws[name] = torch.empty(shape, dtype=torch.float32, device=like.device)
    return t


def _is_cpu(t):
    return t.device.type == "cpu" and not torch.compiler.is_compiling()


def _kernels_for(t, rank):
    """The C library where the CPU passes of ``hvdc_lowrank_*`` run for ``t`` at
    ``rank``, else None (a device, a rank above the kernels' limit, no compiler)."""
    if not _is_cpu(t) or rank > LowRankLimit.MAX_RANK:
        return None
    return native.load()


def _ptr(t):
    return ctypes.c_void_p(t.data_ptr()) if t is not None else None


def _check(rc, what):
    if rc != 0:  # the rank was checked against the kernels' limit: a mismatch is a bug
        raise RuntimeError(f"hvdc_lowrank_{what} refused its arguments (returned {rc})")


class LowRankCodec:
    """One tensor's rounds; per-parameter buffers live in ``ws`` (the
    parameter's workspace), the residual and ``Q`` in the state store."""

    def __init__(self, scheme, memory):
        self.scheme, self.memory = scheme, memory
        #: the residual is updated in place here (plain error feedback); any
        #: other memory gets its ``compensate`` / ``update`` with ``sent``
        self.in_place_residual = memory is not None and type(memory) is ResidualMemory

    # --- start: M, and P_i = M Q -----------------------------------------------------------
    def first_round(self, store, key, x, q, shape, ws):
        """(P_i flat as sent, M as ``n x m``, acc flat, memory state or None).

        ``q`` is the stored ``m x r`` Q (its transpose is kept contiguous)."""
        n, m = self.scheme.matrix_shape(shape)
        r = self.scheme.rank
        lib = _kernels_for(x, r) if q.dtype == torch.float32 else None  # a float64 Q (a loaded state): torch
        p_wire = _buffer(ws, "lowrank.P", (n, r), x)
        state = None
        if self.memory is None:
            acc = x
        elif self.in_place_residual:
            acc = store.get_memory(RESIDUAL, key, x.numel(), x)
            if lib is not None:  # M = x + residual into the residual and P = M Q in one pass
                _check(lib.hvdc_lowrank_first(_ptr(x), _ptr(acc), n, m, r, _ptr(q), _ptr(p_wire)), "first")
                return p_wire.reshape(-1), acc.reshape(n, m), acc, state
            acc.add_(x)  # the residual becomes M = x + residual; finish subtracts what was sent
        else:
            acc, state = compensate(store, self.memory, key, x.numel(), x)
        mat = acc.reshape(n, m)
        if lib is not None and mat.is_contiguous():  # q's transpose is contiguous (codec_q lays it out so)
            _check(lib.hvdc_lowrank_first(_ptr(mat), None, n, m, r, _ptr(q), _ptr(p_wire)), "first")
        else:
            torch.mm(mat, q, out=p_wire)  # q is column-major: the gemm the BLAS runs fastest here
        return p_wire.reshape(-1), mat, acc, state

    # --- second round: orth(P), Q_i = M^T P ------------------------------------------------
    @staticmethod
    def orthonormalize(p_sums):
        """orth of each ``n x r`` sum: one QR per matrix, batched over matrices
        of one shape on the CPU.  Returns the P's (column-major ``n x r``)."""
        out = [None] * len(p_sums)
        groups = {}
        for i, p in enumerate(p_sums):
            if _is_cpu(p):
                groups.setdefault(tuple(p.shape), []).append(i)
            else:
                out[i] = torch.linalg.qr(p).Q
        for idx in groups.values():
            if len(idx) == 1:
                out[idx[0]] = torch.linalg.qr(p_sums[idx[0]]).Q
                continue
            qs = torch.linalg.qr(torch.stack([p_sums[i] for i in idx])).Q
            for j, i in enumerate(idx):
                out[i] = qs[j]
        return out

    def second_round(self, p, mat, ws):
        """This rank's Q_i as sent (``m x r`` flat) and as ``r x m`` (kept)."""
        r, (n, m) = self.scheme.rank, mat.shape
        qt_local = _buffer(ws, "lowrank.Qt_local", (r, m), mat)
        lib = _kernels_for(mat, r)
        if lib is not None and mat.is_contiguous() and p.dtype == torch.float32:  # one pass over M, P at its strides
            _check(lib.hvdc_lowrank_project(_ptr(mat), n, m, r, _ptr(p), p.stride(0), p.stride(1), _ptr(qt_local)),
                   "project")
        else:
            torch.mm(p.t(), mat, out=qt_local)  # Q_i^T = P^T M
        q_wire = _buffer(ws, "lowrank.Q", (m, r), mat)
        q_wire.copy_(qt_local.t())
        return q_wire.reshape(-1), qt_local

    # --- finish: the aggregate, the residual, the next Q -----------------------------------
    def finish(self, store, key, p, qt_local, q_sum, scale, acc, mat, state, ws, out):
        """Write ``P (sum Q_i)^T * scale`` into ``out`` (flat; a fresh tensor
        when None) and update the memory; returns (out, dependencies)."""
        n, m = mat.shape
        r = self.scheme.rank
        qt_sum = q_sum.reshape(m, r).t()
        qt_scaled = _buffer(ws, "lowrank.Qt_scaled", (r, m), mat)
        if scale is None:
            qt_scaled.copy_(qt_sum)
        else:
            torch.mul(qt_sum, scale, out=qt_scaled)
        if out is None:
            out = torch.empty(n * m, dtype=torch.float32, device=mat.device)
        agg = out.reshape(n, m)
        deps = []
        fits = agg.is_contiguous() and mat.is_contiguous() and p.dtype == torch.float32
        lib = _kernels_for(mat, r) if fits else None
        if self.memory is None:
            _outer(p, qt_scaled, agg, ws, lib)
        elif self.in_place_residual:
            if lib is not None:  # the aggregate written and the residual updated in one pass over M
                _check(lib.hvdc_lowrank_finish(_ptr(p), p.stride(0), p.stride(1), n, m, r, _ptr(qt_scaled),
                                               _ptr(qt_local), _ptr(mat), _ptr(agg)), "finish")
            else:
                _outer_and_residual(p, qt_scaled, qt_local, agg, mat, ws, store.B.host_reads_are_free(mat))
        else:
            # the memory's update first: ``acc`` may share the gradient's buffer that ``out`` is
            sent = torch.empty((n, m), dtype=torch.float32, device=mat.device)  # the memory may keep it
            _outer(p, qt_local, sent, ws, lib)
            deps = update(store, self.memory, key, acc, sent.reshape(-1), state)
            _outer(p, qt_scaled, agg, ws, lib)
        return out, deps

    @staticmethod
    def next_q(q_state, q_sum, size, q_start, host_reads_are_free):
        """``sum Q_i / size`` into the stored Q (in place); entries that are
        not finite fall back to the seeded starting values ``q_start``.
        ``host_reads_are_free`` (the backend's answer for this tensor) allows
        the all-finite test on the host that skips the fallback pass."""
        m, r = q_state.shape
        q_state.copy_(q_sum.reshape(m, r))
        q_state.div_(float(size))
        if host_reads_are_free and bool(torch.isfinite(q_state).all()):
            return q_state
        q_state.copy_(torch.where(torch.isfinite(q_state), q_state, q_start))
        return q_state


#: the CPU finish's scratch block, shared by every tensor (one runs at a time)
_SCRATCH = []


def _block_scratch(numel):
    if not _SCRATCH or _SCRATCH[0].numel() < numel:
        _SCRATCH[:] = [torch.empty(max(numel, BLOCK_ELEMENTS), dtype=torch.float32)]
    return _SCRATCH[0][:numel]


def _rows_per_block(m):
    return max(1, BLOCK_ELEMENTS // max(m, 1))


def _outer_block(p, qt, out):
    """``out = p qt`` for a CPU row block: ``r`` multiply-adds over the cached
    block for small ranks, else one gemm."""
    r = qt.shape[0]
    if r > ELEMENTWISE_MAX_RANK:
        torch.mm(p, qt, out=out)
        return
    torch.mul(p[:, 0:1], qt[0], out=out)
    for j in range(1, r):
        out.addcmul_(p[:, j:j + 1], qt[j])


def _outer(p, qt, out, ws, lib=None):
    """``out = p qt`` (``n x r`` times ``r x m``): with ``lib`` one pass of the C
    kernel, else on the CPU by cached row blocks, on a device one ``mm``."""
    if lib is not None:
        n, m = out.shape
        _check(lib.hvdc_lowrank_finish(_ptr(p), p.stride(0), p.stride(1), n, m, qt.shape[0], _ptr(qt), None, None,
                                       _ptr(out)), "finish")
        return
    if not _is_cpu(out):
        torch.mm(p, qt, out=out)
        return
    n = out.shape[0]
    step = _rows_per_block(out.shape[1])
    for i in range(0, n, step):
        _outer_block(p[i:i + step], qt, out[i:i + step])


def _outer_and_residual(p, qt_scaled, qt_local, agg, mat, ws, host_reads_are_free):
    """``agg = p qt_scaled`` and ``mat -= p qt_local`` with non-finite entries
    of the new residual set to zero; on the CPU one row block at a time, the
    block of what was sent built in a cached scratch block and the residual's
    block summed while cached (a NaN or Inf makes its sum non-finite; the
    blocks that have one are cleaned after the loop).  Where a host read is
    not free (a device, or the sync check walking the device path) it is one
    gemm, one addmm and a cleaning pass on the device, with nothing read back."""
    if not host_reads_are_free:
        torch.mm(p, qt_scaled, out=agg)
        mat.addmm_(p, qt_local, alpha=-1.0)
        torch.nan_to_num(mat, nan=0.0, posinf=0.0, neginf=0.0, out=mat)  # no host read on the device
        return
    n, m = mat.shape
    step = _rows_per_block(m)
    scratch = _block_scratch(min(step, n) * m).reshape(-1, m)
    starts = range(0, n, step)
    sums = _buffer(ws, "lowrank.block_sums", (len(starts),), mat)
    for k, i in enumerate(starts):
        pb, rb = p[i:i + step], mat[i:i + step]
        _outer_block(pb, qt_scaled, agg[i:i + step])
        sb = scratch[:rb.shape[0]]
        _outer_block(pb, qt_local, sb)
        rb.sub_(sb)
        torch.sum(rb, dim=None, out=sums[k])
    if not bool(torch.isfinite(sums).all()):
        for k in torch.nonzero(~torch.isfinite(sums)).reshape(-1).tolist():
            rb = mat[starts[k]:starts[k] + step]
            torch.nan_to_num(rb, nan=0.0, posinf=0.0, neginf=0.0, out=rb)
