"""What both backends share: the dtype names, integer helpers, and the
sampled top-k plan."""
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


def index_dtype(numel):
    """int32 indices while they fit, int64 beyond 2**31 - 1 elements."""
    return "int32" if numel < 2**31 else "int64"


def ceil_div(a, b):
    return -(-a // b)


def bits_for(max_value):
    return max(1, int(math.ceil(math.log2(max_value + 1))))
