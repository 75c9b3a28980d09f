"""What the fused kernels and the eager Top-K decide from sizes alone, in one
place and framework-free: the sampled Top-K plan, the index codes' numbers and
the size limits.

:mod:`hvd_compress.codecs.torch_fused`, :mod:`hvd_compress.codecs.tf_fused` and :mod:`hvd_compress.backend` (the eager
Top-K of both frameworks) all take them from here.

The sampled Top-K: a threshold taken from a strided sample of the magnitudes
(about :data:`SAMPLE_SIZE` of them) lets one pass keep about 2k candidates; as
long as at least k pass it, the k largest are all among them, so a selection
over the candidates alone is exact.
"""
from __future__ import annotations

import math

from .constants import IndexCode, TopKPlan

#: index code name (:data:`hvd_compress.schemes.bit_coding.INDEX_CODES`) -> its number in ``hvdc_kernels.h``
CODES = {"raw": IndexCode.RAW, "bitmap": IndexCode.BITMAP, "elias_fano": IndexCode.ELIAS_FANO}

#: how many magnitudes a Top-K threshold is estimated from, about
SAMPLE_SIZE = 65536
#: the eager Top-K samples from this many elements on (below, one plain top-k is as cheap)
EAGER_SAMPLE_MIN_NUMEL = 1 << 18
#: the fused kernels take tensors of fewer elements than this (int32 index payloads)
FUSED_NUMEL_LIMIT = 2**31
#: Top-K is fused, and the eager one samples, up to k = numel / this: a few k candidate
#: indices stay small next to the gradient, and above that a plain top-k is as cheap
TOPK_MAX_FRACTION = 8


def _sample_rank(n, k, stride):
    """``(stride, want)``: the ``want``-th largest of the ``ceil(n / stride)``
    sampled magnitudes, aiming at about 2k candidates."""
    m = -(-n // stride)  # the sample's length
    return stride, min(m, max(1, int(2.0 * k * m / n) + 8))


def fused_topk_plan(n, k):
    """``(stride, want)`` of the fused Top-K (torch and TF alike): sample every
    ``stride``-th magnitude and take the ``want``-th largest as the threshold.

    The stride is odd: a power-of-two row length would otherwise put every
    sample in the same few columns of a weight gradient.  ``want`` is the
    sample's share of k plus a margin of 8 standard deviations of a sampled
    count (``8 sqrt``), at least a quarter of it and at most all of it: about
    1.25k candidates where k is large (every candidate beyond k costs the
    exact selection), 2k where it is small (below 64 sampled)."""
    stride = max(1, n // SAMPLE_SIZE) | 1
    m = -(-n // stride)  # the sample's length
    share = k * m / n
    margin = min(share, max(8.0 * math.sqrt(share), share / 4.0))
    return stride, min(m, max(1, int(share + margin) + 8))


def fused_topk_sent_rank(n, k):
    """The rank, among the sample's ``want`` largest, of the sample's own estimate of the
    k-th largest (its share of k, no margin): where the fused candidate pass starts writing
    residuals as if sent (torch and TF alike)."""
    stride, want = fused_topk_plan(n, k)
    m = -(-n // stride)
    return max(1, min(want, round(k * m / n)))


def sampled_topk_plan(n, k):
    """``(stride, want)`` of the eager Top-K (``Backend.topk_indices``), or None
    where a plain top-k is as cheap (fewer than :data:`EAGER_SAMPLE_MIN_NUMEL`
    elements, or k above ``n / TOPK_MAX_FRACTION``).

    Its stride is ``n // SAMPLE_SIZE`` as it is, not made odd as the fused
    one's: the eager raw index code sends the indices in the order
    ``top_k`` returns them over the candidates, so the payload's bytes depend
    on the candidate set."""
    if n < EAGER_SAMPLE_MIN_NUMEL or k * TOPK_MAX_FRACTION > n:
        return None
    return _sample_rank(n, k, max(1, n // SAMPLE_SIZE))


def topk_candidate_room(k):
    """Candidate slots a fused Top-K encode starts with (the buffer grows where a step needs more)."""
    return TopKPlan.ROOM_PER_K * k + TopKPlan.ROOM_SLACK


def fits_fused(n):
    """Whether a tensor of ``n`` elements is small enough for the fused kernels."""
    return n < FUSED_NUMEL_LIMIT


def fuses_topk(n, k):
    """Whether Top-K keeping ``k`` of ``n`` elements runs fused: it keeps up to
    a few k candidate indices per tensor, worth it (and small next to the
    gradient) up to ``n / TOPK_MAX_FRACTION``."""
    return 0 < k and TOPK_MAX_FRACTION * k <= n
