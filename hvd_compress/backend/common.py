"""What both backends share: the dtype names, integer helpers, and the
sampled top-k plan (:func:`hvd_compress.kernels.topk_plan.sampled_topk_plan`, the
one place the eager and the fused Top-K take their plans from)."""
from __future__ import annotations

import math

from ..kernels.topk_plan import sampled_topk_plan  # noqa: F401 -- the backends' Top-K plan

DTYPES = ("float16", "bfloat16", "float32", "float64",
          "int8", "uint8", "int16", "int32", "int64", "bool")


def index_dtype(numel):
    """int32 indices while they fit, int64 beyond 2**31 - 1 elements."""
    return "int32" if numel < 2**31 else "int64"


def ceil_div(a, b):
    return -(-a // b)


def bits_for(max_value):
    return max(1, int(math.ceil(math.log2(max_value + 1))))
