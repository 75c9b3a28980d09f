"""Fused PyTorch CPU codecs of the sparse schemes: Top-K (exact selection by
the plan of :mod:`hvd_compress.kernels.topk_plan`) and the select-what-passes family, Threshold and DGC.
Each sends indices and values with the eager scheme's names, dtypes and bytes;
:func:`.torch_fused.codec_for` chooses them."""
from __future__ import annotations

import ctypes
import math

import torch

from ..backend import backend_for, ceil_div
from ..schemes.bit_coding import _ef_low_bits, index_code_nbytes
from ..schemes.casts import BF16
from ..schemes.sparsification import _k_for
from ..kernels.constants import NanRule, SentRule, ThresholdRule, TopKPlan
from ..kernels.topk_plan import CODES, fused_topk_plan, fused_topk_sent_rank, topk_candidate_room
from .torch_base import Codec, _p, _ptrs, _scale_args, buffer, ctx_float, output


class SparseCodec(Codec):
    """Top-K, Threshold and DGC: one pass that forms ``acc = x + r`` in place and
    collects the candidates above a threshold, then an exact selection among
    the candidates only (Top-K), gathering, and the index code."""
    nan_rule = NanRule.DROPPED

    def threshold(self, x, r, ws, ctx):
        raise NotImplementedError

    def encode(self, x, r, ws, ctx):
        n = x.numel()
        thr, cap, *sent_from = self.threshold(x, r, ws, ctx)
        thr_sent = sent_from[0] if sent_from else thr
        kept_room = ws.get("cand")
        if kept_room is not None:  # the room a past step needed: a data-dependent count collects in one pass
            cap = max(cap, min(kept_room.numel(), self.max_candidates(n)))
        cand, cval = buffer(ws, "cand", cap, torch.int64), buffer(ws, "cand_val", cap, torch.float32)
        # with a sent rule, the pass writes the residual of each candidate at or above thr_sent (the
        # sample's estimate of the k-th largest) as if it were sent, and the selection settles only the
        # candidates on the wrong side of it (a retry puts all back)
        sent = self.sent_rule() if r is not None else SentRule.KEPT
        c = self.collect(x, r, n, thr, sent, thr_sent, cand, cval, cap)
        acc = r if r is not None else x

        def collect_again(cand, cval, room):  # from acc, as it is in r (or x without error feedback)
            return self.collect(None, r, n, thr, sent, thr_sent, cand, cval, room) if sent else \
                self.collect(acc, None, n, thr, sent, thr_sent, cand, cval, room)

        for _ in range(self.retries + 1):
            if c > cap:  # more candidates than room: collect again from acc, with room
                if c > self.max_candidates(n):
                    break
                if sent:
                    self.lib.hvdc_restore_candidates(_p(r), _p(cand), _p(cval), cap, 0)
                cap = c
                # grown with headroom: the count is data-dependent, and a buffer grown to the exact
                # count would be allocated again at the next step that collects a few more
                cand = buffer(ws, "cand", c, torch.int64, headroom=True)
                cval = buffer(ws, "cand_val", c, torch.float32, headroom=True)
                collect_again(cand, cval, c)
            kept = self.select(cand[:c], cval[:c], n, ws, (r, sent, thr_sent) if sent else None)
            if isinstance(kept, dict):  # the payload itself: the selection packed what it kept
                return kept
            if kept is not None:
                idx, vals = kept
                if r is not None and not sent:
                    # values=BF16(): its kernel writes the residual where sent, so only the non-finite candidates here
                    cleared = 0 if type(self.scheme.values) is BF16 else idx.numel()
                    self.lib.hvdc_clear_sent(_p(acc), _p(idx), cleared, _p(cand), _p(cval), c)
                return self.pack(acc, idx, vals, r is not None and not sent, ws, ctx)
            # the sample overshot (fewer than k candidates): a lower threshold, one more read of acc
            if sent:
                self.lib.hvdc_restore_candidates(_p(r), _p(cand), _p(cval), c, 0)
            thr = thr / 4.0
            c = collect_again(cand, cval, cap)
        if sent:  # acc back in r where a candidate's residual was written
            self.lib.hvdc_restore_candidates(_p(r), _p(cand), _p(cval), min(c, cap), 0)
        return self.encode_eager(acc, r is not None, ctx)

    def collect(self, x, r, n, thr, sent, thr_sent, cand, cval, room):
        """The candidate pass (``x`` None: acc is ``r``'s content); how many pass ``thr``."""
        return self.lib.hvdc_compensate_select_sent(_p(x), _p(r), n, ctx_float(thr), ThresholdRule.AT_LEAST,
                                                    self.nan_rule, sent, ctx_float(thr_sent), _p(cand), _p(cval), room)

    def sent_rule(self):
        """What the candidate pass writes as a recorded candidate's residual
        (:class:`~hvd_compress.kernels.constants.SentRule`): ``KEPT`` (acc) unless
        :meth:`select` settles the residuals of the candidates it keeps and drops."""
        return SentRule.KEPT

    #: times a threshold that left too few candidates is lowered before the eager selection runs
    retries = TopKPlan.LOWERINGS

    def max_candidates(self, n):
        """The most candidate indices kept in the workspace (beyond it: the eager path)."""
        return n

    def select(self, cand, cval, n, ws, settle=None):
        """(indices, values) kept among the candidates, the payload itself where the
        selection packs what it keeps, or None: too few.  ``settle``:
        ``(acc, sent rule, thr_sent)`` of a candidate pass that wrote residuals as if sent
        (:meth:`sent_rule`), which the selection then settles."""
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
        k = self.scheme.fixed_k(numel)
        code = "raw" if k is None else self.scheme.index_code(numel)
        low = _ef_low_bits(numel, k) if code == "elias_fano" else 0
        values, bf16 = self.scheme.values, type(self.scheme.values) is BF16
        codes, vals, ks = [], [], []
        for j, p in enumerate(payloads):  # checked here: the kernel reads exactly these lengths
            coded = p["idx"].contiguous()
            kj = coded.numel() if k is None else k
            if code == "raw":
                coded = coded.to(torch.int32)
                if coded.numel() != kj:
                    raise ValueError(f"rank {j}'s raw indices hold {coded.numel()} entries, expected {kj}")
            elif coded.dtype != torch.uint8 or coded.numel() < index_code_nbytes(code, numel, kj):
                raise ValueError(f"rank {j}'s {code} index code holds {coded.numel()} bytes ({coded.dtype}), expected "
                                 f"{index_code_nbytes(code, numel, kj)} uint8")
            if values is None:
                val = p["val"].to(torch.float32).contiguous()
            elif bf16:
                val = p["v.bits"].contiguous()
            else:
                vp = {name[2:]: t for name, t in p.items() if name.startswith("v.")}
                val = values.decode_one(backend_for(coded), vp, kj).to(torch.float32).contiguous()
            if val.numel() != kj or (bf16 and val.element_size() != 2):
                raise ValueError(f"rank {j}'s values hold {val.numel()} {val.dtype} entries, expected {kj}"
                                 + (" bfloat16 bits" if bf16 else ""))
            codes.append(coded)
            vals.append(val)
            ks.append(kj)
        kt = torch.tensor(ks, dtype=torch.int64)
        status = self.lib.hvdc_sparse_decode_sum(len(codes), _ptrs(codes), CODES[code], low, _p(kt), _ptrs(vals),
                                                 int(bf16), numel, *_scale_args(scale), _p(out))
        if status == -1:  # an eager encoder's raw Top-K indices come in torch.topk's order: sorted, then summed
            return self.aggregate_sorted(payloads, numel, scale, out, ws)
        if status != 0:
            raise ValueError(f"a {type(self.scheme).__name__} payload holds an index outside [0, {numel}) or fewer "
                             f"indices than its {code} code declares")
        return out

    def aggregate_sorted(self, payloads, numel, scale, out, ws):
        """The sum by decoded, sorted index arrays (raw indices in any order)."""
        idxs, vals, ks = [], [], []
        for j, p in enumerate(payloads):
            idx, val = self.unpack(p, numel, ws, j)
            if idx.numel() and (int(idx[0]) < 0 or int(idx[-1]) >= numel):  # sorted: its ends bound it
                raise ValueError(f"rank {j}'s payload holds an index outside [0, {numel})")
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
        # the sample's own estimate of the k-th largest (no margin), among the `want` largest the
        # partial sort above left in front: where the candidate pass starts writing residuals as if sent
        thr_sent = self.lib.hvdc_kth_largest(_p(sample), want, fused_topk_sent_rank(n, k))
        return thr, topk_candidate_room(k), thr_sent

    def sent_rule(self):
        values = self.scheme.values
        return SentRule.ZERO if values is None else SentRule.BF16 if type(values) is BF16 else SentRule.KEPT

    def select(self, cand, cval, n, ws, settle=None):
        k = self.scheme.fixed_k(n)
        c = cand.numel()
        if c < k:
            return None
        tmp = buffer(ws, "tmp", c, torch.float32, headroom=True)  # c: data-dependent
        values = self.scheme.values
        if values is None or type(values) is BF16:  # packed as kept: the index code and the values, one pass
            return self.select_packed(cand, cval, n, k, tmp, ws, settle)
        idx, vals = buffer(ws, "kept", k, torch.int64), buffer(ws, "val", k, torch.float32)
        if settle is None:
            self.lib.hvdc_topk_fixup(_p(cand), _p(cval), c, k, self.nan_rule, _p(idx), _p(vals), _p(tmp))
        else:
            acc, sent, thr_sent = settle
            self.lib.hvdc_topk_select_settle(_p(cand), _p(cval), c, k, self.nan_rule, _p(idx), _p(vals), _p(tmp),
                                             _p(acc), sent, ctx_float(thr_sent))
        return idx, vals

    def select_packed(self, cand, cval, n, k, tmp, ws, settle):
        """The payload of the k kept candidates, written by the selection as it keeps them
        (``hvdc_topk_select_pack``): the same bytes as :meth:`pack` of its (indices, values)."""
        code = self.scheme.index_code(n)
        nbytes = index_code_nbytes(code, n, k)
        coded = buffer(ws, "idx", k if code == "raw" else nbytes, torch.int32 if code == "raw" else torch.uint8)
        bf16 = self.scheme.values is not None
        vals = buffer(ws, "v.bits", k, torch.int16) if bf16 else buffer(ws, "val", k, torch.float32)
        acc, sent, thr_sent = settle if settle is not None else (None, SentRule.KEPT, 0.0)
        self.lib.hvdc_topk_select_pack(_p(cand), _p(cval), cand.numel(), k, self.nan_rule, _p(tmp), _p(acc), sent,
                                       ctx_float(thr_sent), CODES[code], _ef_low_bits(n, k), _p(coded), nbytes,
                                       int(bf16), _p(vals))
        return {"idx": coded, "v.bits" if bf16 else "val": vals}


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
