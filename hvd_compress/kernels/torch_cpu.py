"""Fused codecs for PyTorch CPU tensors: the hot schemes' error feedback,
encode and decode in one or two passes of :mod:`.native`'s kernels.

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
import math

import torch

from ..backend import backend_for, ceil_div
from ..coding import _ef_low_bits, index_code_nbytes
from ..memory import MomentumMemory, ResidualMemory
from ..schemes.casts import BF16, FP16
from ..schemes.lossless import Lossless
from ..schemes.quantization import QSGD, EFSignSGD, Int8, OneBit, SignSGD, TernGrad
from ..schemes.sparsification import DGC, RandomK, TopK, Threshold, _k_for
from .constants import Framework, HalfDtype, NanRule, SignMode, ThresholdRule, TopKPlan
from .native import load
from .plan import CODES, fits_fused, fused_topk_plan, fuses_topk, topk_candidate_room


def _p(t):
    return ctypes.c_void_p(t.data_ptr()) if t is not None else None


def _ptrs(ts):
    return (ctypes.c_void_p * len(ts))(*[t.data_ptr() for t in ts])


def buffer(ws, name, n, dtype, headroom=False):
    """The workspace buffer ``name`` of ``n`` elements, allocated once and reused
    (``headroom``: a data-dependent size, grown by half again when it grows)."""
    t = ws.get(name)
    if t is None or t.numel() < n or t.dtype != dtype:
        t = ws[name] = torch.empty(max(n + (n // 2 if headroom else 0), 1), dtype=dtype)
    return t[:n]


def output(ws, out, n):
    """Where a decode writes: the caller's buffer (the gradient Horovod will
    replace by the result), else a fresh tensor, since the caller keeps it."""
    return out if out is not None else torch.empty(n, dtype=torch.float32)


class Codec:
    """Encode (with error feedback) and decode of one scheme, fused."""

    def __init__(self, lib, scheme):
        self.lib, self.scheme = lib, scheme

    def encode(self, x, r, ws, ctx):
        raise NotImplementedError

    def aggregate(self, payloads, numel, local, scale, out, ws):
        """The sum over ranks, times ``scale`` unless it is None, into ``out``."""
        raise NotImplementedError

    def decode_reduced(self, reduced, numel, out, ws):
        raise NotImplementedError


def _scale_args(scale):
    return (ctypes.c_float(0.0), 0) if scale is None else (ctypes.c_float(float(scale)), 1)


class Int8Codec(Codec):
    def encode(self, x, r, ws, ctx):
        n = x.numel()
        block = self.scheme._block(n)
        q = buffer(ws, "q", n, torch.int8)
        scales = buffer(ws, "scale", max(1, ceil_div(n, block)), torch.float32)
        self.lib.hvdc_int8_encode(_p(x), _p(r), n, block, _p(q), _p(scales))
        return {"q": q, "scale": scales}

    def aggregate(self, payloads, numel, local, scale, out, ws):
        out = output(ws, out, numel)
        qs = [p["q"] for p in payloads]
        ss = [p["scale"] for p in payloads]
        self.lib.hvdc_int8_decode_sum(len(qs), _ptrs(qs), _ptrs(ss), numel, self.scheme._block(numel),
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


class SparseCodec(Codec):
    """Top-K, Threshold and DGC: one pass that forms ``acc = x + r`` in place and
    collects the candidates above a threshold, then an exact selection among
    the candidates only (Top-K), gathering, and the index code."""
    nan_rule = NanRule.DROPPED

    def threshold(self, x, r, ws, ctx):
        raise NotImplementedError

    def encode(self, x, r, ws, ctx):
        n = x.numel()
        thr, cap = self.threshold(x, r, ws, ctx)
        kept_room = ws.get("cand")
        if kept_room is not None:  # the room a past step needed: a data-dependent count collects in one pass
            cap = max(cap, min(kept_room.numel(), self.max_candidates(n)))
        cand, cval = buffer(ws, "cand", cap, torch.int64), buffer(ws, "cand_val", cap, torch.float32)
        c = self.lib.hvdc_compensate_select(_p(x), _p(r), n, ctx_float(thr), ThresholdRule.AT_LEAST, self.nan_rule,
                                            _p(cand), _p(cval), cap)
        acc = r if r is not None else x
        for _ in range(self.retries + 1):
            if c > cap:  # more candidates than room: collect again from acc, with room
                if c > self.max_candidates(n):
                    break
                cap = c
                cand, cval = buffer(ws, "cand", c, torch.int64), buffer(ws, "cand_val", c, torch.float32)
                self.lib.hvdc_compensate_select(_p(acc), None, n, ctx_float(thr), ThresholdRule.AT_LEAST,
                                                self.nan_rule, _p(cand), _p(cval), c)
            kept = self.select(cand[:c], cval[:c], n, ws)
            if kept is not None:
                idx, vals = kept
                if r is not None:
                    # values=BF16(): its kernel writes the residual where sent, so only the non-finite candidates here
                    cleared = 0 if type(self.scheme.values) is BF16 else idx.numel()
                    self.lib.hvdc_clear_sent(_p(acc), _p(idx), cleared, _p(cand), _p(cval), c)
                return self.pack(acc, idx, vals, r is not None, ws, ctx)
            # the sample overshot (fewer than k candidates): a lower threshold, one more read of acc
            thr = thr / 4.0
            c = self.lib.hvdc_compensate_select(_p(acc), None, n, ctx_float(thr), ThresholdRule.AT_LEAST,
                                                self.nan_rule, _p(cand), _p(cval), cap)
        return self.encode_eager(acc, r is not None, ctx)

    #: times a threshold that left too few candidates is lowered before the eager selection runs
    retries = TopKPlan.LOWERINGS

    def max_candidates(self, n):
        """The most candidate indices kept in the workspace (beyond it: the eager path)."""
        return n

    def select(self, cand, cval, n, ws):
        """(indices, values) kept among the candidates, or None: too few."""
        return cand, cval

    def pack(self, acc, idx, vals, ef, ws, ctx):
        n, k = acc.numel(), idx.numel()
        code = self.scheme.index_code(n)
        nbytes = index_code_nbytes(code, n, k)
        coded = buffer(ws, "idx", k if code == "raw" else nbytes, torch.int32 if code == "raw" else torch.uint8)
        self.lib.hvdc_index_encode(_p(idx), k, n, CODES[code], _ef_low_bits(n, k), _p(coded), nbytes)
        payload = {"idx": coded}
        values = self.scheme.values
        if values is None:
            payload["val"] = vals
            return payload
        if type(values) is BF16:  # one kernel: the bits and the residual where sent
            bits = buffer(ws, "v.bits", k, torch.int16)
            self.lib.hvdc_sparse_bf16_encode(_p(vals), k, _p(idx), _p(acc) if ef else None, _p(bits))
            payload["v.bits"] = bits
            return payload
        B = backend_for(acc)
        vpayload, sent = values.encode(B, vals, ctx)
        payload.update({"v." + name: part for name, part in vpayload.items()})
        if ef:
            acc[idx] = B.finite_or_zero(vals - sent)
        return payload

    def encode_eager(self, acc, ef, ctx):
        """The reference selection on the formed ``acc`` (rare: a sample that
        missed, or a tensor too small to sample)."""
        B = backend_for(acc)
        payload, sent = self.scheme.encode(B, acc, ctx)
        if ef:
            acc.copy_(B.finite_or_zero(acc - sent))
        return payload

    def aggregate(self, payloads, numel, local, scale, out, ws):
        out = output(ws, out, numel)
        idxs, vals, ks = [], [], []
        for j, p in enumerate(payloads):
            idx, val = self.unpack(p, numel, ws, j)
            idxs.append(idx)
            vals.append(val.contiguous())
            ks.append(idx.numel())
        kt = torch.tensor(ks, dtype=torch.int64)
        self.lib.hvdc_sparse_sum(len(idxs), _ptrs(idxs), _ptrs(vals), _p(kt), numel, *_scale_args(scale), _p(out))
        return out

    def unpack(self, payload, numel, ws, j):
        k = self.scheme.fixed_k(numel)
        code = "raw" if k is None else self.scheme.index_code(numel)
        coded = payload["idx"]
        variable = k is None
        if variable:
            k = coded.numel()
        idx = buffer(ws, f"didx{j}", k, torch.int64, headroom=variable)
        self.lib.hvdc_index_decode(_p(coded), k, numel, CODES[code], _ef_low_bits(numel, k), _p(idx))
        values = self.scheme.values
        if values is None:
            vals = payload["val"]
        elif type(values) is BF16:
            bits = payload["v.bits"].contiguous()
            vals = buffer(ws, f"dval{j}", k, torch.float32)
            self.lib.hvdc_bf16_decode_sum(1, _ptrs([bits]), k, ctypes.c_float(0.0), 0, _p(vals))
        else:
            vp = {name[2:]: t for name, t in payload.items() if name.startswith("v.")}
            vals = values.decode_one(backend_for(coded), vp, k)
        if code == "raw" and not self.lib.hvdc_is_ascending(_p(idx), k):
            # an eager encoder's raw Top-K indices come in torch.topk's order; the merge needs them ascending
            idx, order = torch.sort(idx)
            vals = vals[order]
        return idx, vals


def apply_momentum(x, u, memory, ws, out):
    """Momentum-aware error feedback's first half, in one pass: ``u = m u + x``
    in place and the direction ``d`` (``u``, or ``x + m u`` with Nesterov)
    written into ``out`` (the gradient Horovod replaces anyway) or a workspace
    buffer; the codec then compresses ``d + residual``."""
    n = x.numel()
    d = out if out is not None else buffer(ws, "momentum_d", n, torch.float32)
    load().hvdc_momentum(_p(x), _p(u), n, ctypes.c_float(memory.momentum), int(memory.nesterov), _p(d))
    return d


def ctx_float(v):
    return ctypes.c_float(float(v))


class TopKCodec(SparseCodec):
    nan_rule = NanRule.LARGEST  # torch.topk orders NaN above everything: it is sent, never kept

    def max_candidates(self, n):
        return n // 4  # a threshold this low has met ties or zeros: the eager selection handles them

    def threshold(self, x, r, ws, ctx):
        n = x.numel()
        k = self.scheme.fixed_k(n)
        stride, want = fused_topk_plan(n, k)
        sample = buffer(ws, "sample", ceil_div(n, stride), torch.float32)
        self.lib.hvdc_sample_magnitudes(_p(x), _p(r), n, stride, self.nan_rule, _p(sample))
        thr = self.lib.hvdc_kth_largest(_p(sample), sample.numel(), want)
        return thr, topk_candidate_room(k)

    def select(self, cand, cval, n, ws):
        k = self.scheme.fixed_k(n)
        c = cand.numel()
        if c < k:
            return None
        idx, vals = buffer(ws, "kept", k, torch.int64), buffer(ws, "val", k, torch.float32)
        tmp = buffer(ws, "tmp", c, torch.float32)
        self.lib.hvdc_topk_fixup(_p(cand), _p(cval), c, k, self.nan_rule, _p(idx), _p(vals), _p(tmp))
        return idx, vals


#: elements a packing kernel may write past its count (the widest vector: AVX-512's 16 lanes)
VECTOR_SLACK = 16


class SentSelectCodec(SparseCodec):
    """Threshold and DGC: every element past the threshold is sent.  Without a
    ``values=`` quantizer one pass (``hvdc_select_sent``) forms ``acc``, packs
    the kept int32 indices (the raw index code itself) and values, and zeroes
    the residual where sent; the room is the most a past step kept, plus a
    half.  With ``values=`` the candidates go through :class:`SparseCodec`."""

    def encode(self, x, r, ws, ctx):
        if self.scheme.values is not None:
            return super().encode(x, r, ws, ctx)
        n = x.numel()
        thr, room = self.threshold(x, r, ws, ctx)
        kept = ws.get("sent_idx")
        room = max(room, 0 if kept is None else kept.numel() - VECTOR_SLACK)
        idx, val = buffer(ws, "sent_idx", room + VECTOR_SLACK, torch.int32), buffer(ws, "sent_val",
                                                                                      room + VECTOR_SLACK, torch.float32)
        c = self.lib.hvdc_select_sent(_p(x), _p(r), n, ctx_float(thr), ThresholdRule.AT_LEAST, _p(idx), _p(val), room)
        if c > room:  # out of room: undo the stored part, and select again from acc with room
            if r is not None:
                self.lib.hvdc_unsend(_p(r), _p(idx), _p(val), room)
            room = min(n, c + c // 2 + 1024)  # headroom: under error feedback the count grows for a few steps
            idx = buffer(ws, "sent_idx", room + VECTOR_SLACK, torch.int32)
            val = buffer(ws, "sent_val", room + VECTOR_SLACK, torch.float32)
            src = None if r is not None else x
            c = self.lib.hvdc_select_sent(_p(src), _p(r), n, ctx_float(thr), ThresholdRule.AT_LEAST, _p(idx),
                                          _p(val), room)
        return {"idx": idx[:c], "val": val[:c]}

    def aggregate(self, payloads, numel, local, scale, out, ws):
        if self.scheme.values is not None:
            return super().aggregate(payloads, numel, local, scale, out, ws)
        out = output(ws, out, numel)
        idxs = [p["idx"].to(torch.int32).contiguous() for p in payloads]
        vals = [p["val"].contiguous() for p in payloads]
        ks = torch.tensor([i.numel() for i in idxs], dtype=torch.int64)
        status = self.lib.hvdc_sparse_sum_i32(len(idxs), _ptrs(idxs), _ptrs(vals), _p(ks), numel, *_scale_args(scale),
                                              _p(out))
        if status == -1:  # indices not ascending (not a selection's order): sorted, then summed
            pairs = [torch.sort(i) for i in idxs]
            idxs = [sorted_idx for sorted_idx, _ in pairs]
            vals = [v[order] for v, (_, order) in zip(vals, pairs)]
            status = self.lib.hvdc_sparse_sum_i32(len(idxs), _ptrs(idxs), _ptrs(vals), _p(ks), numel,
                                                  *_scale_args(scale), _p(out))
        if status != 0:
            raise ValueError(f"a {type(self.scheme).__name__} payload holds an index outside [0, {numel}) or a "
                             "repeated index")
        return out


class ThresholdCodec(SentSelectCodec):
    def threshold(self, x, r, ws, ctx):
        n = x.numel()
        return self.scheme.tau, max(1024, n // 64)


class DGCCodec(SentSelectCodec):
    def threshold(self, x, r, ws, ctx):
        n = x.numel()
        s = self.scheme
        if n == 0:
            return math.inf, 1
        # the eager scheme's sample, drawn alike (same offset, same indices), of acc = x + r
        m = min(n, max(_k_for(s.sample_ratio, n), 256))
        stride = max(1, n // m)
        offset = (ctx.uniform(1) * float(stride)).to(torch.int64)
        sample_idx = (torch.arange(m, dtype=torch.int64) * stride + offset).clamp_(0, n - 1)
        sample = x[sample_idx] if r is None else x[sample_idx] + r[sample_idx]
        ks = _k_for(s.ratio, m)
        thr = torch.kthvalue(sample.abs(), m - ks + 1).values
        return float(thr), max(1024, 2 * _k_for(s.ratio, n) + 1024)


# --- the randomised schemes: the kernels draw torch's own numbers for the seed ---------------------------
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
    """Lossless: the byte shuffle into a kept buffer (one pass), zstd on it, and
    its output handed over without a copy; the decode reads zstd's output into
    the kept buffer and un-shuffles every rank's planes into the sum, scaled in
    the last rank's pass.  Beyond zstd's own time: one pass each way."""

    def encode(self, x, r, ws, ctx):
        import warnings
        import zstandard
        n = x.numel()
        planes = buffer(ws, "planes", 4 * n, torch.uint8)
        self.lib.hvdc_byte_shuffle(_p(x), n, _p(planes))
        blob = zstandard.ZstdCompressor(level=self.scheme.level).compress(planes.numpy())
        if not blob:
            return {"bytes": torch.zeros(0, dtype=torch.uint8)}
        with warnings.catch_warnings():  # zstd's bytes are read-only; nothing writes to a payload
            warnings.simplefilter("ignore", UserWarning)
            return {"bytes": torch.frombuffer(blob, dtype=torch.uint8)}

    def aggregate(self, payloads, numel, local, scale, out, ws):
        from ..schemes.lossless import decompress_planes
        out = output(ws, out, numel)
        s, scaled = _scale_args(scale)
        if not payloads:
            return out
        for j, p in enumerate(payloads):
            planes = decompress_planes(p["bytes"].contiguous().numpy(), numel)
            last = j == len(payloads) - 1
            self.lib.hvdc_byte_unshuffle_add(planes.ctypes.data, numel, int(j == 0), s, scaled if last else 0,
                                             _p(out))
        return out


FUSED = {Int8: Int8Codec, TopK: TopKCodec, Threshold: ThresholdCodec, DGC: DGCCodec, OneBit: OneBitCodec,
         QSGD: QSGDCodec, TernGrad: TernGradCodec, RandomK: RandomKCodec, Lossless: LosslessCodec}


def codec_for(scheme, memory, x):
    """The fused codec of ``scheme`` for the flat float32 tensor ``x``, or None
    where the eager path runs: kernels off or unbuilt, not a CPU float32
    tensor, DGC's memory, or more elements than int32 offsets cover."""
    if not (isinstance(x, torch.Tensor) and x.dtype == torch.float32 and x.is_contiguous() and fits_fused(x.numel())
            and backend_for(x).host_reads_are_free(x)):  # CPU memory (and not the CUDA stand-in of the sync test)
        return None
    if memory is not None and type(memory) not in (ResidualMemory, MomentumMemory):
        return None  # DGC's memory masks its momentum by what was sent: the eager path
    if type(scheme) is Lossless and memory is not None:
        return None  # exact: nothing to feed back; a memory asked for anyway runs the eager code
    lib = load()
    if lib is None:
        return None
    cls = type(scheme)
    if cls is TopK and not fuses_topk(x.numel(), scheme.fixed_k(x.numel())):
        return None
    if cls in FUSED:
        return FUSED[cls](lib, scheme)
    if cls is SignSGD:
        return SignCodec(lib, scheme, SignMode.SIGNSGD)
    if cls is EFSignSGD:
        return SignCodec(lib, scheme, SignMode.EFSIGNSGD)
    if cls is FP16:
        return HalfCodec(lib, scheme, HalfDtype.FP16)
    if cls is BF16:
        return HalfCodec(lib, scheme, HalfDtype.BF16)
    return None
