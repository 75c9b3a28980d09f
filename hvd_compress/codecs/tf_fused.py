"""Fused codecs for TensorFlow CPU tensors: the ops of ``hvdc_tf_ops.cc``
(:mod:`hvd_compress.kernels.tf_native`), which run the C kernels of ``hvdc_kernels.c`` -- the
same code as the torch codecs -- inside Horovod's traced ``tf.function``.

An encode op takes the gradient and the residual ``tf.Variable``'s handle,
and updates the residual in place under the variable's lock (copying it
first only where another tensor still aliases it), so the payload it returns
is produced by the very op that updated the residual: whatever waits on the
payload waits on the update, and no ``assign`` of a fresh 64 MB residual
follows.  Inside a ``tf.function``, automatic control dependencies order the
op with every other access of that variable.  Payload parts have the eager
scheme's names, dtypes and bytes; tests/unit/test_kernels_tf.py holds the two
paths to the same results.

Fused here: Int8 (any block size), Top-K (``values=None`` or ``BF16()``),
Threshold and DGC (``values=None``), SignSGD, EFSignSGD, OneBit, QSGD, TernGrad, Random-K
(drawing TF's own stateless numbers for the seed), BF16, and FP16 with error feedback or momentum (without either,
TF's cast is one pass already), with plain error feedback, none, or
momentum-aware error feedback (:class:`~hvd_compress.MomentumMemory`: the
codec provider's ``fused_momentum`` forms the direction first, in two elementwise
ops).  Every other scheme, memory (DGC's) or device runs the eager code.
"""
from __future__ import annotations

import tensorflow as tf

from ..backend import ceil_div
from ..schemes.bit_coding import _ef_low_bits, index_code_nbytes
from ..feedback.memory import MomentumMemory, ResidualMemory
from ..schemes.casts import BF16, FP16
from ..schemes.quantization import QSGD, EFSignSGD, Int8, OneBit, SignSGD, TernGrad
from ..schemes.sparsification import DGC, RandomK, Threshold, TopK, _k_for
from ..kernels.constants import SignMode
from ..kernels.topk_plan import CODES, fits_fused, fused_topk_plan, fused_topk_sent_rank, fuses_topk
from ..kernels.tf_native import load


def _scale_args(scale):
    """(``s`` input, ``scaled`` attribute) of a decode op."""
    if scale is None:
        return tf.zeros([], tf.float32), False
    return tf.reshape(tf.cast(scale, tf.float32), []), True


class TFCodec:
    """Encode (with error feedback) and decode of one scheme, fused."""

    def __init__(self, ops, store, scheme):
        self.ops, self.store, self.scheme = ops, store, scheme

    def residual_handles(self, r, ctx):
        """The resource list an encode op updates in place: the residual
        variable of this key (``r``, its value, is not used), or none."""
        if r is None:
            return []
        return [self.store.residual_variable(ctx.key).handle]

    def decode_reduced(self, reduced, numel, out, ws):
        raise NotImplementedError


class Int8Codec(TFCodec):
    def encode(self, x, r, ws, ctx):
        n = int(x.shape[0])
        block = self.scheme.block_for(n)
        q, scale = self.ops.hvdc_int8_encode(x=x, r=self.residual_handles(r, ctx), n=n, block=block,
                                             nb=max(1, ceil_div(n, block)))
        return {"q": q, "scale": scale}

    def aggregate(self, payloads, numel, local, scale, out, ws):
        s, scaled = _scale_args(scale)
        return self.ops.hvdc_int8_decode_sum(qs=[p["q"] for p in payloads], scales=[p["scale"] for p in payloads],
                                             s=s, n=numel, block=self.scheme.block_for(numel), scaled=scaled)


class TopKCodec(TFCodec):
    """Sampled threshold, one pass forming ``acc = x + r`` in place and
    collecting the candidates (with error feedback, their residuals written as
    if sent above the sample's estimate of the k-th largest), the exact k among
    them (ties in index order) packed as the payload as they are kept, the
    residuals on the wrong side of the estimate settled -- all in one op, on
    the kernels torch's Top-K codec runs."""

    def _code(self, n):
        k = self.scheme.fixed_k(n)
        code = self.scheme.index_code(n)
        return k, code, index_code_nbytes(code, n, k), _ef_low_bits(n, k)

    def __init__(self, ops, store, scheme):
        super().__init__(ops, store, scheme)
        #: the payload part of the values: float32, or bfloat16 bits with values=BF16()
        self.val_part, self.val_dtype = ("v.bits", tf.int16) if type(scheme.values) is BF16 else ("val", tf.float32)

    def encode(self, x, r, ws, ctx):
        n = int(x.shape[0])
        k, code, nbytes, low = self._code(n)
        stride, want = fused_topk_plan(n, k)
        idx, val = self.ops.hvdc_top_k_encode(x=x, r=self.residual_handles(r, ctx), T=_idx_dtype(code), n=n, k=k,
                                              stride=stride, want=want, sent_rank=fused_topk_sent_rank(n, k),
                                              code=int(CODES[code]), low=low, nbytes=nbytes, V=self.val_dtype)
        return {"idx": idx, self.val_part: val}

    def aggregate(self, payloads, numel, local, scale, out, ws):
        k, code, nbytes, low = self._code(numel)
        s, scaled = _scale_args(scale)
        idxs = [tf.cast(p["idx"], _idx_dtype(code)) for p in payloads]
        return self.ops.hvdc_sparse_sum(idxs=idxs, vals=[p[self.val_part] for p in payloads], s=s, n=numel, k=k,
                                        code=int(CODES[code]), low=low, nbytes=nbytes, scaled=scaled)


class SentSelectCodec(TFCodec):
    """Threshold and DGC (``values=None``): one op forms ``acc = x + r`` in
    place, sends every element whose magnitude reaches the threshold (raw
    int32 indices, ascending) and zeroes the residual there; DGC's threshold
    is the eager scheme's own, from the same sample of ``acc`` (the same
    draw, gather and ``top_k``), so the kept set is identical."""

    def threshold(self, x, r, ctx):
        return tf.constant(self.scheme.tau, tf.float32)

    def encode(self, x, r, ws, ctx):
        n = int(x.shape[0])
        thr = self.threshold(x, r, ctx)
        idx, val = self.ops.hvdc_select_sent(x=x, r=self.residual_handles(r, ctx), thr=thr, n=n)
        return {"idx": idx, "val": val}

    def aggregate(self, payloads, numel, local, scale, out, ws):
        s, scaled = _scale_args(scale)
        return self.ops.hvdc_sparse_sum_raw(idxs=[tf.cast(p["idx"], tf.int32) for p in payloads],
                                            vals=[p["val"] for p in payloads], s=s, n=numel, scaled=scaled)


class DGCCodec(SentSelectCodec):
    def threshold(self, x, r, ctx):
        n, s = int(x.shape[0]), self.scheme
        if n == 0:
            return tf.constant(float("inf"), tf.float32)
        m = min(n, max(_k_for(s.sample_ratio, n), 256))
        stride = max(1, n // m)
        offset = tf.cast(ctx.uniform(1) * float(stride), tf.int64)
        sample_idx = tf.clip_by_value(tf.range(m, dtype=tf.int64) * stride + offset, 0, n - 1)
        sample = tf.gather(x, sample_idx) if r is None else tf.gather(x, sample_idx) + tf.gather(r, sample_idx)
        ks = _k_for(s.ratio, m)
        return tf.math.top_k(tf.abs(sample), k=ks, sorted=True).values[ks - 1]


class SignCodec(TFCodec):
    """SignSGD (a majority vote), EFSignSGD (scaled signs) and OneBit (each side of
    zero sent as its mean), by their :class:`~hvd_compress.kernels.constants.SignMode`."""

    #: the payload part that carries the scales, by mode
    SCALE_PART = {SignMode.SIGNSGD: None, SignMode.EFSIGNSGD: "scale", SignMode.ONEBIT: "means"}

    def __init__(self, ops, store, scheme, mode):
        super().__init__(ops, store, scheme)
        self.mode = mode
        self.part = self.SCALE_PART[mode]

    def encode(self, x, r, ws, ctx):
        bits, scale = self.ops.hvdc_sign_encode(x=x, r=self.residual_handles(r, ctx), n=int(x.shape[0]),
                                                mode=int(self.mode))
        return {"bits": bits, self.part: scale} if self.part else {"bits": bits}

    def aggregate(self, payloads, numel, local, scale, out, ws):
        s, scaled = _scale_args(scale)
        scales = [tf.reshape(p[self.part], [-1]) if self.part else tf.ones([1]) for p in payloads]
        return self.ops.hvdc_sign_decode_sum(bits=[p["bits"] for p in payloads], scales=scales, s=s, n=numel,
                                             mode=int(self.mode), scaled=scaled)


class HalfCodec(TFCodec):
    """FP16 (by Horovod's allreduce) and BF16 (its bits by allgather)."""

    def __init__(self, ops, store, scheme, bf16):
        super().__init__(ops, store, scheme)
        self.bf16 = bf16

    def encode(self, x, r, ws, ctx):
        h = self.ops.hvdc_half_encode(x=x, r=self.residual_handles(r, ctx), n=int(x.shape[0]),
                                      T=tf.int16 if self.bf16 else tf.float16)
        return {"bits": h} if self.bf16 else {"reduce": h}

    def decode_reduced(self, reduced, numel, out, ws):
        return tf.cast(tf.reshape(reduced, [-1]), tf.float32)

    def aggregate(self, payloads, numel, local, scale, out, ws):
        s, scaled = _scale_args(scale)
        return self.ops.hvdc_bf16_decode_sum(hs=[p["bits"] for p in payloads], s=s, n=numel, scaled=scaled)


def _seed(seed):
    """A seed (a Python int or an int64 tensor) as the scalar int64 input of the ops."""
    return tf.reshape(tf.cast(0 if seed is None else seed, tf.int64), [])


def _draws(ctx, n):
    """(u, seed) inputs of a randomised encode op: the adapters' draws carry their seed
    (:class:`~hvd_compress.schemes.base.SeededDraws`) and the op draws TF's stateless
    stream for it itself (u empty); any other ``ctx.uniform`` is called and its n draws
    handed over; none (a codec timed outside a step) draws for seed 0."""
    if ctx.uniform is None or getattr(ctx.uniform, "seed", None) is not None:
        return [], _seed(getattr(ctx.uniform, "seed", None))
    return [tf.reshape(tf.cast(ctx.uniform(n), tf.float32), [n])], _seed(0)


class QSGDCodec(TFCodec):
    """QSGD: the norm and ``acc`` in one pass, the levels (TF's draws, block by block in
    cache) and the residual in a second; the decode is Int8's with ``norm_j / levels``."""

    def encode(self, x, r, ws, ctx):
        n = int(x.shape[0])
        u, seed = _draws(ctx, n)
        q, norm = self.ops.hvdc_qsgd_encode(x=x, r=self.residual_handles(r, ctx), u=u, seed=seed, n=n,
                                            levels=self.scheme.levels)
        return {"q": q, "norm": norm}

    def aggregate(self, payloads, numel, local, scale, out, ws):
        s, scaled = _scale_args(scale)
        steps = [tf.reshape(p["norm"], [1]) / float(self.scheme.levels) for p in payloads]
        return self.ops.hvdc_int8_decode_sum(qs=[p["q"] for p in payloads], scales=steps, s=s, n=numel,
                                             block=max(1, numel), scaled=scaled)


class TernGradCodec(TFCodec):
    """TernGrad: ``acc`` and ``max|acc|`` in one pass, the ternary draw, its 2-bit codes
    and the residual in a second."""

    def encode(self, x, r, ws, ctx):
        n = int(x.shape[0])
        u, seed = _draws(ctx, n)
        t, scale = self.ops.hvdc_tern_grad_encode(x=x, r=self.residual_handles(r, ctx), u=u, seed=seed, n=n)
        return {"t": t, "scale": scale}

    def aggregate(self, payloads, numel, local, scale, out, ws):
        s, scaled = _scale_args(scale)
        return self.ops.hvdc_tern_grad_decode_sum(ts=[p["t"] for p in payloads],
                                                  scales=[tf.reshape(p["scale"], [1]) for p in payloads], s=s,
                                                  n=numel, scaled=scaled)


class RandomKCodec(TFCodec):
    """Random-K: TF's shared indices (the k largest stateless draws) drawn in C, ``acc``
    formed in place, the k values gathered and their residual cleared, in one op; the
    decode scatters Horovod's reduced values at the indices of this trace's encode."""

    def encode(self, x, r, ws, ctx):
        n = int(x.shape[0])
        vals, idx = self.ops.hvdc_random_k_encode(x=x, r=self.residual_handles(r, ctx), seed=_seed(ctx.shared_seed),
                                                  n=n, k=_k_for(self.scheme.ratio, n))
        ws["randomk_idx"] = idx
        return {"reduce": vals, "_idx": idx}

    def decode_reduced(self, reduced, numel, out, ws):
        return self.ops.hvdc_scatter(idx=ws["randomk_idx"], vals=tf.reshape(reduced, [-1]), n=numel)


def _idx_dtype(code):
    return tf.int32 if code == "raw" else tf.uint8


def _on_cpu(x):
    """Placed on the CPU, or unplaced where TF has no GPU (the ops are CPU kernels)."""
    device = (x.device or "").upper()
    return "CPU" in device or (not device and not tf.config.list_logical_devices("GPU"))


def codec_for(scheme, memory, x, store):
    """The fused TF codec of ``scheme`` for the flat float32 tensor ``x``, or
    None where the eager path runs: kernels off or unbuilt, not a CPU float32
    tensor of a static size below 2**31, DGC's memory, a scheme not fused here (see the module's docstring), a
    sparsifier with a ``values=`` quantizer other than Top-K's ``BF16()``, or a Top-K keeping more than an
    eighth of the elements."""
    n = x.shape[0] if x.shape.rank == 1 else None
    if n is None or x.dtype != tf.float32 or not fits_fused(n) or not _on_cpu(x):
        return None
    if memory is not None and type(memory) not in (ResidualMemory, MomentumMemory):
        return None  # DGC's memory masks its momentum by what was sent: the eager path
    make = _maker(scheme, memory, n)
    ops = load() if make is not None else None
    return make(ops, store) if ops is not None else None


def _maker(scheme, memory, n):
    """(ops, store) -> the codec of this scheme, or None where none is fused."""
    cls = type(scheme)
    if cls is TopK:
        k = scheme.fixed_k(n)
        if (scheme.values is not None and type(scheme.values) is not BF16) or not fuses_topk(n, k):
            return None
        return lambda ops, store: TopKCodec(ops, store, scheme)
    if cls in (Threshold, DGC):
        if scheme.values is not None:
            return None
        return lambda ops, store: (DGCCodec if cls is DGC else SentSelectCodec)(ops, store, scheme)
    if cls is FP16 and memory is None:
        return None  # TF's own cast is one pass already
    if cls in (SignSGD, EFSignSGD, OneBit):
        mode = {SignSGD: SignMode.SIGNSGD, EFSignSGD: SignMode.EFSIGNSGD, OneBit: SignMode.ONEBIT}[cls]
        return lambda ops, store: SignCodec(ops, store, scheme, mode)
    if cls in (FP16, BF16):
        return lambda ops, store: HalfCodec(ops, store, scheme, cls is BF16)
    if cls is RandomK:
        return (lambda ops, store: RandomKCodec(ops, store, scheme)) if n > 0 else None
    if cls in (QSGD, TernGrad):
        return lambda ops, store: (QSGDCodec if cls is QSGD else TernGradCodec)(ops, store, scheme)
    return (lambda ops, store: Int8Codec(ops, store, scheme)) if cls is Int8 else None


class _TimingResidual:
    """Stands in for the state store where a codec is timed outside a step
    (Auto's calibration): every key's residual is one scratch variable."""

    def __init__(self, numel):
        from ..backend.tf_backend import state_variable  # made outside every trace: Auto times codecs at a trace
        self.variable = state_variable(lambda: tf.zeros([numel], tf.float32), tf.float32)

    def residual_variable(self, key):
        return self.variable


def timing_fn(scheme, feedback, numel, shape, size, inner):
    """A compiled function ``(x, start) -> tensor`` that runs ``inner`` fused
    encodes (error feedback into a scratch residual where ``feedback``) and
    decodes of ``size`` payloads of one tensor -- what a step pays where the
    transports use the fused codec -- or None where ``scheme`` is not fused
    for this size (Auto then times its eager code)."""
    from ..schemes.base import EncodeContext
    x0 = tf.zeros([int(numel)], tf.float32)
    holder = _TimingResidual(int(numel)) if feedback else None
    codec = codec_for(scheme, ResidualMemory() if feedback else None, x0, holder)
    if codec is None:
        return None
    ctx = EncodeContext(key="hvdc.auto.codec", step=1, rank=0, size=size, uniform=None, shared_seed=None,
                        shape=tuple(shape), state={})
    allgather = scheme.transport_for(shape) == "allgather"

    @tf.function(autograph=False)
    def run(x, start):
        def body(i, total):  # a loop, not ``inner`` unrolled copies: one copy of the codec to trace
            ws = {}  # Random-K's decode reads the indices its encode left there
            payload = codec.encode(x, start if feedback else None, ws, ctx)
            wire = {k: v for k, v in payload.items() if not k.startswith("_")}
            dense = (codec.aggregate([wire] * size, int(numel), {}, None, None, ws) if allgather
                     else codec.decode_reduced(wire["reduce"], int(numel), None, ws))
            return i + 1, total + dense[0]  # every repetition's result is used: nothing is pruned
        return tf.while_loop(lambda i, total: i < inner, body, [tf.constant(0), tf.zeros([], tf.float32)],
                             parallel_iterations=1)[1]
    return run
