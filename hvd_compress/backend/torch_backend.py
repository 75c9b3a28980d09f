"""The PyTorch backend (CPU or CUDA tensors)."""
from __future__ import annotations

from .common import DTYPES, sampled_topk_plan


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

    def copy(self, x):
        return x.clone()

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
    def seed_for(self, base, step):
        """The seed of the draws of ``base`` (a Python int) at ``step``: a Python int."""
        return (base * 1_000_003 + int(step)) & 0x7FFF_FFFF_FFFF_FFFF

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
