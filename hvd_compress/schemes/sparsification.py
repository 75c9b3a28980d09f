"""Sparsifiers: send a few values and where they go.

Each sparsifier can hand its kept values to a quantizer (``values=Int8()``):
Top-K, then INT8 on the kept values, sends 1 byte per kept value instead of 4,
next to its index (about 1.1-4 bytes, see :mod:`hvd_compress.schemes.bit_coding`).  The payload then holds the
indices plus the quantizer's parts for the values, prefixed ``v.``.
"""
from __future__ import annotations

import math

from .bit_coding import INDEX_CODES, choose_index_code, decode_indices, encode_indices, index_code_nbytes
from .base import Scheme, check_range, register


def _k_for(ratio, numel):
    return max(1, min(numel, int(math.ceil(ratio * numel)))) if numel else 0


def _variable_parts(self):
    """Parts of a variable-size selection whose length depends on the kept
    count: the indices, the values, and the parts of a ``values=`` quantizer
    that it declares per element (``per_element_parts``) or variable."""
    parts = ("idx", "val")
    if self.values is not None:
        parts += tuple("v." + p for p in tuple(self.values.per_element_parts) + tuple(self.values.variable_parts))
    return parts


class _Sparsifier(Scheme):
    error_feedback_default = True

    def __init__(self, values=None):
        if values is not None and (not isinstance(values, Scheme) or values.transport != "allgather"
                                   or not hasattr(values, "decode_one") or isinstance(values, _Sparsifier)):
            raise ValueError("values must be a quantizer scheme instance such as Int8(), QSGD(levels) "
                             f"or BF16(); got {values!r}")
        self.values = values

    @property
    def stochastic(self):
        return self.values is not None and self.values.stochastic

    def config(self):
        return {"values": None if self.values is None else repr(self.values)}

    # --- shared pieces ---------------------------------------------------
    def fixed_k(self, numel):
        """Kept count when it depends only on the size (Top-K), else None."""
        return None

    def index_code(self, numel):
        k = self.fixed_k(numel)
        return "raw" if k is None else choose_index_code(numel, k, self.index_codes)

    index_codes = ("raw",)

    def _pack(self, B, x, idx, ctx):
        """Payload and local contribution for the elements at ``idx``."""
        n = B.numel(x)
        code = self.index_code(n)
        if code != "raw":
            idx = B.sort(idx)  # the compact codes store sorted indices
        vals = B.gather(x, idx)
        payload = {"idx": encode_indices(B, idx, n, code)}
        if self.values is None:
            payload["val"] = vals
            sent_vals = vals
        else:
            vpayload, sent_vals = self.values.encode(B, vals, ctx)
            payload.update({"v." + k: v for k, v in vpayload.items()})
        if not ctx.need_sent:
            return payload, None  # no error feedback: skip building the dense ``sent``
        return payload, B.scatter_add(n, idx, sent_vals)

    def _unpack(self, B, payload, numel):
        """(indices, values) of one rank's payload."""
        k = self.fixed_k(numel)
        if k is None:
            idx = payload["idx"]
        else:
            idx = decode_indices(B, payload["idx"], numel, k, self.index_code(numel))
        if self.values is None:
            return idx, payload["val"]
        vp = {name[2:]: t for name, t in payload.items() if name.startswith("v.")}
        return idx, self.values.decode_one(B, vp, B.numel(idx) if k is None else k)

    def decode_one(self, B, payload, numel, ctx=None):
        return B.scatter_add(numel, *self._unpack(B, payload, numel))

    def aggregate(self, B, payloads, numel, ctx=None):
        # one scatter for all ranks: duplicate indices add up
        pairs = [self._unpack(B, p, numel) for p in payloads]
        return B.scatter_add(numel, B.concat([i for i, _ in pairs]), B.concat([v for _, v in pairs]))

    def kept_nbytes(self, numel, k):
        """The payload bytes of ``k`` kept elements of ``numel`` (their codes and values)."""
        idx = index_code_nbytes(self.index_code(numel), numel, k)
        val = 4 * k if self.values is None else self.values.payload_nbytes(k)
        return idx + val


@register(kind="sparsifier", compare="topk",
          examples={"topk1%": "TopK(0.01)", "topk30%": "TopK(0.3)", "topk100%": "TopK(1.0)",
                    "topk-raw": "TopK(0.01, index_coding='raw')", "topk-int8": "TopK(0.05, values=Int8())",
                    "topk-bf16": "TopK(0.1, values=BF16())", "topk-qsgd": "TopK(0.1, values=QSGD(16))"},
          horovod={"TopK": "TopK(0.05)", "TopK-Int8": "TopK(0.05, values=Int8())"},
          bench=("TopK(0.01)", "TopK(0.1, values=BF16())"),
          table={"TopK(0.01)": "4k + idx(k, n)", "TopK(0.01, values=Int8())": "k + 4 + idx(k, n)"})
class TopK(_Sparsifier):
    """Exact Top-K sparsification: the ``ratio`` fraction of largest magnitudes.

    Aji & Heafield, "Sparse Communication for Distributed Gradient Descent",
    EMNLP 2017; with error feedback as analysed by Stich et al., "Sparsified SGD
    with Memory", NeurIPS 2018.  Payload: k values (or the ``values``
    quantizer's parts) + the k indices in the smallest of raw int32, bitmap
    and Elias-Fano codes for this tensor's size (``index_coding="auto"``; see
    :mod:`hvd_compress.schemes.bit_coding`) -- about 1.1 bytes an index at 1%.

    Tuning: 0.01 with error feedback matches dense accuracy on most CNNs/MLPs
    after a short dense warmup; below 0.001 use :class:`DGC` with its
    corrections.  Without error feedback expect a visible accuracy loss.
    """

    def __init__(self, ratio=0.01, values=None, index_coding="auto"):
        check_range("ratio", ratio, 0.0, 1.0, lo_open=True)
        if index_coding != "auto" and index_coding not in INDEX_CODES:
            raise ValueError(f"index_coding must be 'auto' or one of {INDEX_CODES}; got {index_coding!r}")
        super().__init__(values)
        self.ratio = float(ratio)
        self.index_coding = index_coding
        self.index_codes = INDEX_CODES if index_coding == "auto" else (index_coding,)

    def config(self):
        return {"ratio": self.ratio, "index_coding": self.index_coding, **super().config()}

    def fixed_k(self, numel):
        return _k_for(self.ratio, numel)

    def encode(self, B, x, ctx):
        k = _k_for(self.ratio, B.numel(x))
        idx = B.topk_indices(B.abs(x), k)
        return self._pack(B, x, idx, ctx)

    def payload_nbytes(self, numel):
        return self.kept_nbytes(numel, _k_for(self.ratio, numel))


@register(kind="sparsifier",
          examples={"randomk": "RandomK(0.1)", "randomk1%": "RandomK(0.01)", "randomk-20%": "RandomK(0.2)",
                    "randomk-all": "RandomK(1.0)"},
          horovod={"RandomK": "RandomK(0.1)"}, bench=("RandomK(0.01)",),
          table={"RandomK(0.01)": "4k (shared-seed indices)"})
class RandomK(Scheme):
    """Random-K: k indices drawn from a seed shared by all ranks, so every rank
    keeps the same coordinates and the values travel by Horovod's allreduce
    (k values, no indices on the wire).  Stich et al., "Sparsified SGD with
    Memory", NeurIPS 2018; Wangni et al., NeurIPS 2018.  Biased without
    rescaling, so error feedback is on by default.
    """
    transport = "allreduce"
    error_feedback_default = True

    def __init__(self, ratio=0.01):
        check_range("ratio", ratio, 0.0, 1.0, lo_open=True)
        self.ratio = float(ratio)

    def config(self):
        return {"ratio": self.ratio}

    def encode(self, B, x, ctx):
        n = B.numel(x)
        idx = B.randperm_prefix(n, _k_for(self.ratio, n), ctx.shared_seed, like=x)
        vals = B.gather(x, idx)
        return {"reduce": vals, "_idx": idx}, B.scatter_add(n, idx, vals)

    def decode_reduced(self, B, reduced, numel, ctx=None):
        return B.scatter_add(numel, ctx["_idx"], reduced)

    def payload_nbytes(self, numel):
        return 4 * _k_for(self.ratio, numel)


@register(kind="sparsifier",
          examples={"threshold": "Threshold(1.0)", "threshold-int8b": "Threshold(1.5, values=Int8(block_size=8))",
                    "threshold-tern": "Threshold(1.0, values=TernGrad())",
                    "threshold-bf16": "Threshold(0.5, values=BF16())"},
          # tau 1.5 keeps ~13% of N(0, 1) gradients; 2.576 keeps 1% (the 99% two-sided quantile)
          horovod={"Threshold": "Threshold(1.5)"}, bench=("Threshold(2.576)",),
          table={"Threshold(2.5)": "8 kept + 8 (variable)"})
class Threshold(_Sparsifier):
    """Threshold sparsification: every element with ``|x| >= tau`` (Strom,
    "Scalable Distributed DNN Training Using Commodity GPU Cloud Computing",
    Interspeech 2015).  The payload's size varies with the data and between
    ranks (values + int32 indices).  ``tau`` is in gradient units; pick it from
    a few steps of gradient statistics, or use :class:`DGC`, which adapts.
    """
    variable_parts = property(_variable_parts)

    def __init__(self, tau=1e-3, values=None):
        check_range("tau", tau, 0.0, None, lo_open=True)
        super().__init__(values)
        self.tau = float(tau)

    def config(self):
        return {"tau": self.tau, **super().config()}

    def encode(self, B, x, ctx):
        idx = B.nonzero_indices(B.abs(x) >= self.tau)
        return self._pack(B, x, idx, ctx)


@register(kind="sparsifier",
          examples={"dgc": "DGC(0.01)", "dgc-qsgd": "DGC(0.05, sample_ratio=0.1, values=QSGD(8))",
                    "dgc-onebit": "DGC(0.1, values=OneBit())",
                    "dgc-int8": "DGC(0.05, sample_ratio=0.1, values=Int8())"},
          horovod={"DGC": "DGC(0.05)"}, bench=("DGC(0.01)",), table={"DGC(0.01)": "8 kept + 8 (variable)"})
class DGC(_Sparsifier):
    """Deep Gradient Compression's selection (Lin et al., ICLR 2018).

    The threshold is the ``ratio`` quantile of ``|x|`` estimated on a random
    sample of ``sample_ratio`` of the elements (no full sort); elements above
    it are kept, so the kept count is about ``ratio * n`` and varies between
    steps and ranks (the payload is variable-length).  The sample holds at least
    256 elements, and a sample of ``m`` cannot resolve a quantile finer than
    ``1 / m``: where ``ratio * m < 1`` the threshold is the sample's maximum and
    about ``n / (m + 1)`` elements are kept -- at ``ratio=0.001``, about 0.4% of
    any tensor under 100k elements (measured: 0.42% of 4096, 0.40% of 12288,
    0.105% of 100k).  The paper's second, exact Top-K over the kept elements is
    not done.  DGC's momentum correction, clipping and
    momentum-factor masking are training-side features (see
    :class:`hvd_compress.feedback.memory.DGCMemory`).
    """
    variable_parts = property(_variable_parts)

    def __init__(self, ratio=0.001, sample_ratio=0.01, values=None):
        check_range("ratio", ratio, 0.0, 1.0, lo_open=True)
        check_range("sample_ratio", sample_ratio, 0.0, 1.0, lo_open=True)
        super().__init__(values)
        self.ratio = float(ratio)
        self.sample_ratio = float(sample_ratio)

    def config(self):
        return {"ratio": self.ratio, "sample_ratio": self.sample_ratio, **super().config()}

    def encode(self, B, x, ctx):
        n = B.numel(x)
        a = B.abs(x)
        if n == 0:
            return self._pack(B, x, B.nonzero_indices(a > 0), ctx)
        m = min(n, max(_k_for(self.sample_ratio, n), 256))
        # stride sampling from a random offset: cheap, no gather of random indices
        stride = max(1, n // m)
        offset = B.cast(ctx.uniform(1) * float(stride), "int64")
        sample_idx = B.arange(m, "int64", like=x) * stride + offset
        sample_idx = B.clip(sample_idx, 0, n - 1)
        sample = B.gather(a, sample_idx)
        ks = _k_for(self.ratio, m)
        thr = B.kth_largest(sample, ks)
        idx = B.nonzero_indices(a >= thr)
        return self._pack(B, x, idx, ctx)
