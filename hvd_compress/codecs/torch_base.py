"""The fused PyTorch CPU codecs' common parts: the base :class:`Codec`, the
workspace buffers every codec encodes into (allocated once per parameter and
reused every step) and the ctypes argument helpers.  The codecs are in
:mod:`.torch_fused` and :mod:`.torch_sparse`."""
from __future__ import annotations

import ctypes

import torch


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


def ctx_float(v):
    return ctypes.c_float(float(v))
