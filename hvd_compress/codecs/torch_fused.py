"""Fused codecs for PyTorch CPU tensors: the hot schemes' error feedback,
encode and decode in one or two passes of :mod:`hvd_compress.kernels.native`'s kernels.

A codec is chosen per call by :func:`codec_for`; it encodes into buffers
kept in the parameter's workspace (reused every step, so no fresh 64 MB
temporaries and their page faults), updates the residual in place, and
decodes every rank's payload into one output buffer with Horovod's scaling
applied in the same pass.  Payload parts have the eager scheme's names,
dtypes and bytes, so the transports, the fingerprint and the receivers do not
know which path encoded them; tests/unit/test_kernels.py holds the two paths
to the same results.
"""
from __future__ import annotations

import ctypes

import torch

from ..backend import backend_for, ceil_div
from ..feedback.memory import MomentumMemory, ResidualMemory
from ..schemes.casts import BF16, FP16
from ..schemes.lossless import Lossless, native_coder
from ..schemes.quantization import QSGD, EFSignSGD, Int8, OneBit, SignSGD, TernGrad
from ..schemes.sparsification import DGC, RandomK, TopK, Threshold, _k_for
from ..kernels.constants import Framework, HalfDtype, SignMode
from ..kernels.native import load
from ..kernels.topk_plan import fits_fused, fuses_topk
from .torch_base import Codec, _p, _ptrs, _scale_args, buffer, output
from .torch_sparse import DGCCodec, ThresholdCodec, TopKCodec


class Int8Codec(Codec):
    def encode(self, x, r, ws, ctx):
        n = x.numel()
        block = self.scheme.block_for(n)
        q = buffer(ws, "q", n, torch.int8)
        scales = buffer(ws, "scale", max(1, ceil_div(n, block)), torch.float32)
        self.lib.hvdc_int8_encode(_p(x), _p(r), n, block, _p(q), _p(scales))
        return {"q": q, "scale": scales}

    def aggregate(self, payloads, numel, local, scale, out, ws):
        out = output(ws, out, numel)
        qs = [p["q"] for p in payloads]
        ss = [p["scale"] for p in payloads]
        self.lib.hvdc_int8_decode_sum(len(qs), _ptrs(qs), _ptrs(ss), numel, self.scheme.block_for(numel),
                                      *_scale_args(scale), _p(out))
        return out


class SignCodec(Codec):
    """SignSGD (a majority vote) and EFSignSGD (scaled signs), by their :class:`~hvd_compress.kernels.constants.SignMode`."""

    def __init__(self, lib, scheme, mode):
        super().__init__(lib, scheme)
        self.mode = mode

    def encode(self, x, r, ws, ctx):
        n = x.numel()
        bits = buffer(ws, "bits", ceil_div(n, 8), torch.uint8)
        scaled = self.mode == SignMode.EFSIGNSGD
        scale = buffer(ws, "scale", 1, torch.float32) if scaled else None
        self.lib.hvdc_sign_encode(_p(x), _p(r), n, self.mode, _p(bits), _p(scale))
        return {"bits": bits, "scale": scale} if scaled else {"bits": bits}

    def aggregate(self, payloads, numel, local, scale, out, ws):
        out = output(ws, out, numel)
        bits = [p["bits"] for p in payloads]
        scales = (torch.stack([p["scale"][0] for p in payloads]).contiguous() if self.mode == SignMode.EFSIGNSGD
                  else None)
        self.lib.hvdc_sign_decode_sum(len(bits), _ptrs(bits), _p(scales), numel, self.mode,
                                      *_scale_args(scale), _p(out))
        return out


class OneBitCodec(Codec):
    """OneBit (1-bit SGD): sign bits and the two means, one per side of zero."""

    def encode(self, x, r, ws, ctx):
        n = x.numel()
        bits = buffer(ws, "bits", ceil_div(n, 8), torch.uint8)
        means = buffer(ws, "means", 2, torch.float32)
        self.lib.hvdc_onebit_encode(_p(x), _p(r), n, _p(bits), _p(means))
        return {"bits": bits, "means": means}

    def aggregate(self, payloads, numel, local, scale, out, ws):
        out = output(ws, out, numel)
        bits = [p["bits"] for p in payloads]
        means = torch.cat([p["means"].reshape(2) for p in payloads]).contiguous()
        self.lib.hvdc_onebit_decode_sum(len(bits), _ptrs(bits), _p(means), numel, *_scale_args(scale), _p(out))
        return out


class HalfCodec(Codec):
    """FP16 (by allreduce) and BF16 (its bits by allgather)."""

    def __init__(self, lib, scheme, dtype):
        super().__init__(lib, scheme)
        self.dtype = dtype  # a HalfDtype

    def encode(self, x, r, ws, ctx):
        n = x.numel()
        fp16 = self.dtype == HalfDtype.FP16
        h = buffer(ws, "half", n, torch.float16 if fp16 else torch.int16)
        if r is None and fp16:
            h.copy_(x)  # torch's own vectorised conversion, round half to even
        else:
            self.lib.hvdc_half_encode(_p(x), _p(r), n, self.dtype, _p(h))
        return {"reduce": h} if fp16 else {"bits": h}

    def decode_reduced(self, reduced, numel, out, ws):
        out = output(ws, out, numel)
        out.copy_(reduced.reshape(-1))
        return out

    def aggregate(self, payloads, numel, local, scale, out, ws):
        out = output(ws, out, numel)
        hs = [p["bits"] for p in payloads]
        self.lib.hvdc_bf16_decode_sum(len(hs), _ptrs(hs), numel, *_scale_args(scale), _p(out))
        return out


def apply_momentum(x, u, memory, ws, out):
    """Momentum-aware error feedback's first half, in one pass: ``u = m u + x``
    in place and the direction ``d`` (``u``, or ``x + m u`` with Nesterov)
    written into ``out`` (the gradient Horovod replaces anyway) or a workspace
    buffer; the codec then compresses ``d + residual``."""
    n = x.numel()
    d = out if out is not None else buffer(ws, "momentum_d", n, torch.float32)
    load().hvdc_momentum(_p(x), _p(u), n, ctypes.c_float(memory.momentum), int(memory.nesterov), _p(d))
    return d


def draws(ctx, n, ws):
    """(u, seed) for a randomised kernel: the adapters' draws carry their seed
    (:class:`~hvd_compress.schemes.base.SeededDraws`), and the kernel draws
    torch's stream for it itself (u None); any other ``ctx.uniform`` is called
    and its n draws handed over."""
    seed = getattr(ctx.uniform, "seed", None)
    if seed is not None:
        return None, int(seed)
    u = ctx.uniform(n)
    return buffer(ws, "draws", n, torch.float32).copy_(u.reshape(-1)[:n]), 0


class QSGDCodec(Codec):
    """QSGD: ``acc`` and its norm in one pass, the stochastic levels (drawn in
    cache, block by block) and the residual in a second; the decode is Int8's
    ``sum_j q_j * scale_j`` with ``scale_j = norm_j / levels``."""

    def encode(self, x, r, ws, ctx):
        n = x.numel()
        u, seed = draws(ctx, n, ws)
        q, norm = buffer(ws, "q", n, torch.int8), buffer(ws, "norm", 1, torch.float32)
        self.lib.hvdc_qsgd_encode(_p(x), _p(r), n, self.scheme.levels, _p(u), Framework.TORCH, seed, _p(q), _p(norm))
        return {"q": q, "norm": norm}

    def aggregate(self, payloads, numel, local, scale, out, ws):
        out = output(ws, out, numel)
        qs = [p["q"] for p in payloads]
        steps = torch.cat([p["norm"].reshape(1) for p in payloads]) / float(self.scheme.levels)
        self.lib.hvdc_int8_decode_sum(len(qs), _ptrs(qs), _ptrs(list(steps.split(1))), numel, max(1, numel),
                                      *_scale_args(scale), _p(out))
        return out


class TernGradCodec(Codec):
    """TernGrad: ``acc`` and ``max|acc|`` in one pass, the ternary draw, its
    2-bit codes and the residual in a second."""

    def encode(self, x, r, ws, ctx):
        n = x.numel()
        u, seed = draws(ctx, n, ws)
        t, s = buffer(ws, "t", ceil_div(n, 4), torch.uint8), buffer(ws, "scale", 1, torch.float32)
        self.lib.hvdc_terngrad_encode(_p(x), _p(r), n, _p(u), Framework.TORCH, seed, _p(t), _p(s))
        return {"t": t, "scale": s}

    def aggregate(self, payloads, numel, local, scale, out, ws):
        out = output(ws, out, numel)
        ts = [p["t"] for p in payloads]
        scales = torch.cat([p["scale"].reshape(1) for p in payloads]).contiguous()
        self.lib.hvdc_terngrad_decode_sum(len(ts), _ptrs(ts), _p(scales), numel, *_scale_args(scale), _p(out))
        return out


class RandomKCodec(Codec):
    """Random-K: the shared indices drawn in C as torch's generator draws them
    (the whole-permutation case by torch itself), then one pass that forms
    ``acc`` in place, gathers the k values and clears their residual.  The
    decode scatters Horovod's reduced values at the indices kept for it."""

    def encode(self, x, r, ws, ctx):
        n = x.numel()
        k = _k_for(self.scheme.ratio, n)
        idx = buffer(ws, "randomk_idx", k, torch.int64)
        m = 2 * k + 64
        got = -1
        if 8 * k < n:
            seen, scratch = buffer(ws, "seen", ceil_div(n, 64), torch.int64), buffer(ws, "scratch", 2 * m, torch.int64)
            got = self.lib.hvdc_randomk_indices_torch(int(ctx.shared_seed), n, k, _p(idx), _p(seen), _p(scratch))
        if got < 0:
            idx.copy_(backend_for(x).randperm_prefix(n, k, ctx.shared_seed, like=x))
        vals = buffer(ws, "val", k, torch.float32)
        self.lib.hvdc_randomk_encode(_p(x), _p(r), n, _p(idx), k, _p(vals))
        return {"reduce": vals, "_idx": idx}

    def decode_reduced(self, reduced, numel, out, ws):
        out = output(ws, out, numel)
        idx = ws["randomk_idx"][:_k_for(self.scheme.ratio, numel)]
        vals = reduced.reshape(-1).contiguous()
        self.lib.hvdc_scatter(_p(idx), idx.numel(), _p(vals), numel, _p(out))
        return out


class LosslessCodec(Codec):
    """Lossless, one zstd frame per block: each block shuffled into a buffer that
    stays in the L2 cache and compressed from there by this thread's kept zstd
    context straight into a kept payload buffer; the decode decompresses each
    frame into that buffer and un-shuffles it into the sum at once, scaled in the
    last rank's pass.  Beyond zstd's own work: the shuffle's read of the tensor
    and the un-shuffle's write of the output, one full-size pass each, which
    zstd's compute hides little of (docs/results/benchmarks.md)."""

    def __init__(self, lib, scheme, coder):
        super().__init__(lib, scheme)
        self.coder = coder

    def encode(self, x, r, ws, ctx):
        from ..schemes.lossless import PLANE_BLOCK, encode_into
        n = x.numel()
        cap = self.coder[1].bound(n, PLANE_BLOCK)
        blob = buffer(ws, "blob", cap, torch.uint8)
        return {"bytes": blob[:encode_into(self.coder, x.data_ptr(), n, self.scheme.level, blob.data_ptr(), cap)]}

    def aggregate(self, payloads, numel, local, scale, out, ws):
        from ..schemes.lossless import decode_add_into
        out = output(ws, out, numel)
        s, scaled = _scale_args(scale)
        for j, p in enumerate(payloads):
            blob = p["bytes"].contiguous()
            decode_add_into(self.coder, blob.data_ptr(), blob.numel(), numel, out.data_ptr(), int(j == 0), s,
                            scaled if j == len(payloads) - 1 else 0)
        return out


FUSED = {Int8: Int8Codec, TopK: TopKCodec, Threshold: ThresholdCodec, DGC: DGCCodec, OneBit: OneBitCodec,
         QSGD: QSGDCodec, TernGrad: TernGradCodec, RandomK: RandomKCodec}


#: the codec chosen per (scheme, memory type, element count, kernel library): a codec
#: holds only its library and scheme, and choosing one is a dozen checks and an object
#: on every tensor's every call (tens of microseconds where a model has hundreds of tensors)
_CHOSEN = {}
_CHOSEN_MAX = 4096


def _kernel_tensor(x):
    """Whether ``x`` is a tensor the kernels take: contiguous CPU float32 (not
    the CUDA stand-in of the sync test) whose element offsets fit int32."""
    return (isinstance(x, torch.Tensor) and x.dtype == torch.float32 and x.is_contiguous()
            and fits_fused(x.numel()) and backend_for(x).host_reads_are_free(x))


def fuses(x):
    """Whether the kernels run on ``x``: built and on, and ``x`` a tensor they take."""
    return _kernel_tensor(x) and load() is not None


def codec_for(scheme, memory, x):
    """The fused codec of ``scheme`` for the flat float32 tensor ``x``, or None
    where the eager path runs: kernels off or unbuilt, not a CPU float32
    tensor, DGC's memory, or more elements than int32 offsets cover."""
    if not _kernel_tensor(x):
        return None
    lib = load()
    if lib is None:
        return None
    key = (id(scheme), type(memory), x.numel(), id(lib))
    hit = _CHOSEN.get(key)
    if hit is not None and hit[0] is scheme:  # the scheme itself, not one that reused its id
        return hit[1]
    if len(_CHOSEN) >= _CHOSEN_MAX:
        _CHOSEN.clear()
    codec = _choose(scheme, memory, x.numel(), lib)
    _CHOSEN[key] = (scheme, codec)
    return codec


def _choose(scheme, memory, numel, lib):
    """:func:`codec_for` past the tensor's own checks and the library."""
    if memory is not None and type(memory) not in (ResidualMemory, MomentumMemory):
        return None  # DGC's memory masks its momentum by what was sent: the eager path
    if type(scheme) is Lossless and memory is not None:
        return None  # exact: nothing to feed back; a memory asked for anyway runs the eager code
    cls = type(scheme)
    if cls is TopK and not fuses_topk(numel, scheme.fixed_k(numel)):
        return None
    if cls in FUSED:
        return FUSED[cls](lib, scheme)
    if cls is Lossless:
        coder = native_coder()
        return None if coder is None else LosslessCodec(lib, scheme, coder)
    if cls is SignSGD:
        return SignCodec(lib, scheme, SignMode.SIGNSGD)
    if cls is EFSignSGD:
        return SignCodec(lib, scheme, SignMode.EFSIGNSGD)
    if cls is FP16:
        return HalfCodec(lib, scheme, HalfDtype.FP16)
    if cls is BF16:
        return HalfCodec(lib, scheme, HalfDtype.BF16)
    return None
