"""Framework-neutral tensor operations.

Every scheme's math is written once, against the small vocabulary below, and
runs unchanged on PyTorch tensors (CPU or CUDA) and on TensorFlow tensors
(eager or inside the ``tf.function`` that Horovod always traces).  Only
vectorised operations appear here: no Python loops over elements and no host
round trips, so the same code is valid on a GPU.

``backend_for(tensor)`` picks the implementation.  Neither framework is
imported unless a tensor of that framework is seen.
"""
from __future__ import annotations

import math

DTYPES = ("float16", "bfloat16", "float32", "float64",
          "int8", "uint8", "int16", "int32", "int64", "bool")


def sampled_topk_plan(n, k):
    """``(stride, want)`` for the exact top-k's sampled-threshold shortcut over
    ``n`` elements, or None where a plain top-k is as cheap (small tensors, or
    k above an eighth of them): sample every ``stride``-th element (about
    65536 of them) and take the ``want``-th largest as the threshold, aiming at
    about 2k candidates."""
    if n < (1 << 18) or k * 8 > n:
        return None
    stride = max(1, n // 65536)
    m = -(-n // stride)  # the sample's length
    return stride, min(m, max(1, int(2.0 * k * m / n) + 8))


class TorchBackend:
    name = "torch"

    def __init__(self):
        import torch
        self.torch = torch
        self._dt = {n: getattr(torch, n) for n in DTYPES}
        self._dt["bool"] = torch.bool

    # --- dtype and shape -------------------------------------------------
    def dtype_name(self, x):
        return str(x.dtype).replace("torch.", "")

    def is_floating(self, x):
        return x.dtype.is_floating_point

    def shape(self, x):
        return tuple(x.shape)

    def numel(self, x):
        return x.numel()

    def cast(self, x, dtype):
        return x.to(self._dt[dtype])

    def bitcast(self, x, dtype):
        return x.view(self._dt[dtype])

    def flatten(self, x):
        return x.reshape(-1)

    def reshape(self, x, shape):
        return x.reshape(shape)

    # --- construction ----------------------------------------------------
    def zeros(self, n, dtype, like):
        return self.torch.zeros(n, dtype=self._dt[dtype], device=like.device)

    def ones(self, n, dtype, like):
        return self.torch.ones(n, dtype=self._dt[dtype], device=like.device)

    def full(self, n, value, dtype, like):
        return self.torch.full((n,), value, dtype=self._dt[dtype], device=like.device)

    def arange(self, n, dtype, like):
        return self.torch.arange(n, dtype=self._dt[dtype], device=like.device)

    def scalar(self, value, dtype, like):
        return self.torch.tensor([value], dtype=self._dt[dtype], device=like.device)

    def concat(self, xs):
        return self.torch.cat(list(xs))

    def stack(self, xs):
        return self.torch.stack(list(xs))

    def sum_in_order(self, xs):
        """``((xs[0] + xs[1]) + xs[2]) + ...``: every rank must round the same way,
        and eager torch runs the adds exactly as written.  ``xs`` may be a
        generator: one decoded tensor at a time is alive besides the sum."""
        out = None
        for x in xs:
            out = x if out is None else out + x
        return out

    # --- elementwise -----------------------------------------------------
    def abs(self, x):
        return x.abs()

    def sign(self, x):
        return x.sign()

    def round(self, x):
        return self.torch.round(x)

    def floor(self, x):
        return self.torch.floor(x)

    def clip(self, x, lo, hi):
        return self.torch.clamp(x, lo, hi)

    def round_clip(self, x, lo, hi):
        # round then clamp in the same buffer: one temporary fewer
        return self.torch.round(x).clamp_(lo, hi)

    def abs_max(self, x, axis):
        # the inf-norm reduces |x| without materialising it; NaN propagates
        return self.torch.linalg.vector_norm(x, ord=float("inf"), dim=axis)

    def where(self, cond, a, b):
        return self.torch.where(cond, a, b)

    def maximum(self, a, b):
        return self.torch.maximum(a, b)

    def isfinite(self, x):
        return self.torch.isfinite(x)

    def host_reads_are_free(self, x):
        """True where reading a value on the host costs no device sync (CPU
        tensors, outside torch.compile tracing).  The CPU stand-in of the
        sync test turns it off to walk the CUDA path."""
        return x.device.type == "cpu" and not self.torch.compiler.is_compiling()

    def finite_or_zero(self, x):
        # Nearly always everything is finite: on the CPU one read-only sum
        # proves it (a NaN or Inf anywhere makes the sum non-finite; a sum that
        # merely overflows takes the slow path, which is still right), and
        # costs a fraction of rewriting the tensor.  On CUDA the test would be
        # a host sync, so there it is always the single fused pass.
        if self.host_reads_are_free(x) and bool(self.torch.isfinite(x.sum())):
            return x
        return self.torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)

    def shift_left(self, x, bits):
        return self.torch.bitwise_left_shift(x, bits)

    def shift_right(self, x, bits):
        return self.torch.bitwise_right_shift(x, bits)

    def bit_and(self, x, y):
        return self.torch.bitwise_and(x, y)

    # --- reductions --------------------------------------------------------
    def sum(self, x, axis=None):
        return x.sum() if axis is None else x.sum(dim=axis)

    def max(self, x, axis=None):
        return x.max() if axis is None else x.amax(dim=axis)

    def norm(self, x):
        return self.torch.linalg.vector_norm(x)

    def cumsum(self, x):
        return self.torch.cumsum(x, 0)

    def count_nonzero(self, x):
        return self.torch.count_nonzero(x)

    # --- selection ---------------------------------------------------------
    def topk_indices(self, x, k):
        """Indices of the k largest entries of ``x`` (exact).

        On the CPU, ``torch.topk`` over millions of elements costs tens of
        memory copies.  A threshold estimated from a strided sample keeps
        about 2k candidates in one vectorised pass; as long as at least k
        entries pass it, the k largest are all among them, so a top-k over the
        candidates alone is exact.  When the estimate undershoots, fall back
        to the full top-k.  CUDA keeps ``torch.topk``: the candidate count is
        data-dependent and reading it would synchronise with the host.
        """
        plan = sampled_topk_plan(x.numel(), k)
        if x.is_cuda or plan is None:
            return self.torch.topk(x, k, sorted=False).indices
        stride, want = plan
        thr = self.torch.topk(x[::stride], want, sorted=False).values.min()
        cand = self.torch.nonzero(x >= thr, as_tuple=True)[0]
        if cand.numel() < k:
            return self.torch.topk(x, k, sorted=False).indices
        return cand[self.torch.topk(x[cand], k, sorted=False).indices]

    def gather(self, x, idx):
        return x[idx]

    def nonzero_indices(self, mask):
        return self.torch.nonzero(mask, as_tuple=False).reshape(-1)

    def sort(self, x):
        return self.torch.sort(x).values

    def searchsorted(self, sorted_seq, values):
        return self.torch.searchsorted(sorted_seq, values)

    def kth_largest(self, x, k):
        # kthvalue counts from the smallest
        return self.torch.kthvalue(x, x.numel() - k + 1).values

    def scatter_add(self, n, idx, values):
        out = self.torch.zeros(n, dtype=values.dtype, device=values.device)
        return out.index_add_(0, idx.to(self.torch.int64), values)

    def split(self, x, sizes, num):
        """Split a 1-D tensor into ``num`` pieces; sizes may be a tensor."""
        if not isinstance(sizes, (list, tuple)):
            sizes = sizes.tolist()  # variable-length payloads need the lengths on the host
        return list(self.torch.split(x, [int(s) for s in sizes]))

    def matmul(self, a, b):
        return a @ b

    def transpose(self, a):
        return a.t()

    def orthonormalize(self, m):
        # QR is the stable choice; PowerSGD (Vogels et al.) uses Gram-Schmidt.
        return self.torch.linalg.qr(m).Q

    # --- randomness without global side effects ---------------------------------
    def uniform(self, n, seed, like):
        """U[0,1) from a private generator seeded by ``seed`` (a Python int or a
        0-d integer tensor); the global RNG is never touched."""
        seed = int(seed) if not hasattr(seed, "item") else int(seed.item())
        gen = self.torch.Generator(device=like.device)
        gen.manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
        return self.torch.rand(n, generator=gen, device=like.device, dtype=self.torch.float32)

    def randperm_prefix(self, n, k, seed, like):
        """k distinct indices in [0, n), the same on every rank for the same seed."""
        gen = self.torch.Generator(device=like.device)
        gen.manual_seed(int(seed) & 0x7FFF_FFFF_FFFF_FFFF)
        if k * 8 < n:
            # sampling with rejection of duplicates is cheaper than a full permutation
            idx = self.torch.randint(0, n, (2 * k + 64,), generator=gen, device=like.device)
            uniq = self.torch.unique(idx)
            if uniq.numel() >= k:
                perm = self.torch.randperm(uniq.numel(), generator=gen, device=like.device)[:k]
                return self.torch.sort(uniq[perm]).values
        return self.torch.sort(self.torch.randperm(n, generator=gen, device=like.device)[:k]).values

    def identity_with_deps(self, x, deps):
        return x

    def host_call(self, fn, x, out_dtype, out_len=None):
        """Run a numpy function on the host (codecs without device kernels)."""
        import numpy as np
        out = fn(x.detach().cpu().numpy())
        return self.torch.from_numpy(np.array(out, copy=True)).to(device=x.device, dtype=self._dt[out_dtype])


class TensorFlowBackend:
    name = "tensorflow"

    def __init__(self):
        import tensorflow as tf
        self.tf = tf
        self._dt = {n: getattr(tf, n) for n in DTYPES}
        _exclude_from_autograph()

    def dtype_name(self, x):
        return x.dtype.name

    def is_floating(self, x):
        return x.dtype.is_floating

    def shape(self, x):
        return tuple(x.shape.as_list())

    def numel(self, x):
        n = x.shape.num_elements()
        if n is None:
            raise ValueError(
                f"hvd_compress needs gradients with a static shape in TensorFlow; got {x.shape} "
                f"for {getattr(x, 'name', '?')}")
        return n

    def cast(self, x, dtype):
        return self.tf.cast(x, self._dt[dtype])

    def bitcast(self, x, dtype):
        return self.tf.bitcast(x, self._dt[dtype])

    def flatten(self, x):
        return self.tf.reshape(x, [-1])

    def reshape(self, x, shape):
        return self.tf.reshape(x, shape)

    def zeros(self, n, dtype, like=None):
        return self.tf.zeros([n], dtype=self._dt[dtype])

    def ones(self, n, dtype, like=None):
        return self.tf.ones([n], dtype=self._dt[dtype])

    def full(self, n, value, dtype, like=None):
        return self.tf.fill([n], self.tf.constant(value, dtype=self._dt[dtype]))

    def arange(self, n, dtype, like=None):
        return self.tf.range(n, dtype=self._dt[dtype])

    def scalar(self, value, dtype, like=None):
        return self.tf.reshape(self.tf.cast(value, self._dt[dtype]), [1])

    def concat(self, xs):
        return self.tf.concat(list(xs), 0)

    def stack(self, xs):
        return self.tf.stack(list(xs))

    def sum_in_order(self, xs):
        """``((xs[0] + xs[1]) + xs[2]) + ...`` as one reduction over a stacked axis.

        Why not a chain of adds: Grappler's arithmetic optimizer may rewrite such
        a chain into one AddN whose input order varies from process to process
        (measured: 1 to 3 fresh processes in 10 summed three tensors in another
        order; none with that optimizer switched off), so ranks rounded
        differently and TF replicas drifted apart by an ulp (a CI failure).  A
        reduction over axis 0 of a stack is one op that nothing reorders, and
        it sums in index order (checked against the sequential sum in
        tests/unit/test_backend.py)."""
        xs = list(xs)
        if len(xs) == 1:
            return xs[0]
        return self.tf.reduce_sum(self.tf.stack(xs), axis=0)

    def abs(self, x):
        return self.tf.abs(x)

    def sign(self, x):
        return self.tf.sign(x)

    def round(self, x):
        return self.tf.round(x)  # banker's rounding, like torch.round

    def floor(self, x):
        return self.tf.floor(x)

    def clip(self, x, lo, hi):
        return self.tf.clip_by_value(x, lo, hi)

    def round_clip(self, x, lo, hi):
        return self.tf.clip_by_value(self.tf.round(x), lo, hi)

    def abs_max(self, x, axis):
        return self.tf.reduce_max(self.tf.abs(x), axis=axis)

    def where(self, cond, a, b):
        return self.tf.where(cond, a, b)

    def maximum(self, a, b):
        return self.tf.maximum(a, b)

    def isfinite(self, x):
        return self.tf.math.is_finite(x)

    def finite_or_zero(self, x):
        # as in torch: one read-only sum decides, and only a tensor with a
        # NaN/Inf is rewritten (tf.cond runs the branch it takes)
        tf = self.tf
        return tf.cond(tf.math.is_finite(tf.reduce_sum(x)), lambda: tf.identity(x),
                       lambda: tf.where(tf.math.is_finite(x), x, tf.zeros_like(x)))

    def shift_left(self, x, bits):
        return self.tf.bitwise.left_shift(x, self.tf.cast(bits, x.dtype))

    def shift_right(self, x, bits):
        return self.tf.bitwise.right_shift(x, self.tf.cast(bits, x.dtype))

    def bit_and(self, x, y):
        return self.tf.bitwise.bitwise_and(x, self.tf.cast(y, x.dtype))

    def sum(self, x, axis=None):
        return self.tf.reduce_sum(x, axis=axis)

    def max(self, x, axis=None):
        return self.tf.reduce_max(x, axis=axis)

    def norm(self, x):
        return self.tf.norm(x)

    def cumsum(self, x):
        return self.tf.cumsum(x)

    def count_nonzero(self, x):
        return self.tf.math.count_nonzero(x)

    def topk_indices(self, x, k):
        """Exact, by the same sampled-threshold shortcut as the torch backend
        (``tf.math.top_k`` over millions of elements is slower still); the
        fallback to the full top-k is a ``tf.cond``, so no host round trip."""
        tf = self.tf
        plan = None if x.shape[0] is None else sampled_topk_plan(x.shape[0], k)
        if plan is None:
            return tf.math.top_k(x, k=k, sorted=False).indices
        stride, want = plan
        thr = tf.reduce_min(tf.math.top_k(x[::stride], k=want, sorted=False).values)
        cand = tf.cast(tf.reshape(tf.where(x >= thr), [-1]), tf.int32)

        def among_candidates():
            return tf.gather(cand, tf.math.top_k(tf.gather(x, cand), k=k, sorted=False).indices)

        def full():
            return tf.math.top_k(x, k=k, sorted=False).indices

        return tf.cond(tf.size(cand) >= k, among_candidates, full)

    def gather(self, x, idx):
        return self.tf.gather(x, idx)

    def nonzero_indices(self, mask):
        return self.tf.reshape(self.tf.where(mask), [-1])

    def sort(self, x):
        return self.tf.sort(x)

    def searchsorted(self, sorted_seq, values):
        return self.tf.cast(self.tf.searchsorted(sorted_seq, values, side="left"), self.tf.int64)

    def kth_largest(self, x, k):
        return self.tf.math.top_k(x, k=k, sorted=True).values[k - 1]

    def scatter_add(self, n, idx, values):
        idx = self.tf.cast(self.tf.reshape(idx, [-1, 1]), self.tf.int64)
        return self.tf.scatter_nd(idx, values, self.tf.constant([n], dtype=self.tf.int64))

    def split(self, x, sizes, num):
        if isinstance(sizes, (list, tuple)):
            return self.tf.split(x, list(sizes), num=num)
        return self.tf.split(x, self.tf.reshape(self.tf.cast(sizes, self.tf.int64), [num]), num=num)

    def matmul(self, a, b):
        return self.tf.matmul(a, b)

    def transpose(self, a):
        return self.tf.transpose(a)

    def orthonormalize(self, m):
        return self.tf.linalg.qr(m).q

    def uniform(self, n, seed, like=None):
        # stateless: the seed tensor (base seed, step) fully determines the draw
        seed = self.tf.cast(seed, self.tf.int64)
        pair = self.tf.stack([seed // 2**31, seed % 2**31])
        return self.tf.random.stateless_uniform([n], seed=pair, dtype=self.tf.float32)

    def randperm_prefix(self, n, k, seed, like=None):
        u = self.uniform(n, seed)
        return self.tf.sort(self.tf.math.top_k(u, k=k, sorted=False).indices)

    def identity_with_deps(self, x, deps):
        with self.tf.control_dependencies([d for d in deps if d is not None]):
            return self.tf.identity(x)

    def host_call(self, fn, x, out_dtype, out_len=None):
        out = self.tf.numpy_function(fn, [x], self._dt[out_dtype], stateful=False)
        return self.tf.reshape(out, [-1 if out_len is None else out_len])


def _exclude_from_autograph():
    """Horovod's TF code is converted by autograph, and it would convert ours
    too (every call below ``compress``): slow on every trace and pointless,
    since our code has no tensor-dependent Python control flow.  Autograph has
    no public per-module opt-out, so this adds a DoNotConvert rule for
    ``hvd_compress`` to its rule list; if that internal moves, conversion
    simply stays on."""
    try:
        from tensorflow.python.autograph.core import config, config_lib
    except ImportError:
        return
    if not any(isinstance(r, config_lib.DoNotConvert) and r._prefix == "hvd_compress"
               for r in config.CONVERSION_RULES):
        config.CONVERSION_RULES = (config_lib.DoNotConvert("hvd_compress"),) + tuple(config.CONVERSION_RULES)


_BACKENDS = {}


def backend_for(tensor):
    """The backend that handles ``tensor``'s framework."""
    mod = type(tensor).__module__
    if mod.startswith("torch"):
        key = "torch"
    elif mod.startswith("tensorflow") or mod.startswith("tf_keras") or mod.startswith("keras"):
        key = "tensorflow"
    else:
        raise TypeError(f"hvd_compress: unsupported tensor type {type(tensor)!r}; "
                        "expected a torch.Tensor or a tf.Tensor")
    if key not in _BACKENDS:
        _BACKENDS[key] = TorchBackend() if key == "torch" else TensorFlowBackend()
    return _BACKENDS[key]


def index_dtype(numel):
    """int32 indices while they fit, int64 beyond 2**31 - 1 elements."""
    return "int32" if numel < 2**31 else "int64"


def ceil_div(a, b):
    return -(-a // b)


def bits_for(max_value):
    return max(1, int(math.ceil(math.log2(max_value + 1))))
