"""Lossless coding of the integer parts of a payload: bit packing and sparse indices.

Sparse indices of a fixed-size selection (Top-K: ``k`` of ``n``) travel in
whichever of three codes is smallest for that tensor.  The sizes depend only
on ``n`` and ``k``, so the choice is made per tensor without looking at the
data, every rank makes the same one, and no length has to be sent or read
back to the host:

* ``raw``    -- int32 (int64 past 2**31 elements): 4 bytes an index;
* ``bitmap`` -- one bit per element: ``n/8`` bytes, best once more than about
  1/4 of the elements are kept;
* ``elias_fano`` -- the sorted indices as a quasi-succinct delta code
  (Elias 1974, Fano 1971; Vigna, "Quasi-succinct indices", WSDM 2013): the
  low ``L = floor(log2(n/k))`` bits of each index packed at fixed width, the
  high parts as gaps in unary.  ``k * (2 + log2(n/k))`` bits: about 8.6 bits
  an index at 1% density instead of 32.  Decoding uses a prefix sum and a
  binary search, no data-dependent shapes, so it is also sync-free on GPUs.

Variable-size selections (Threshold, DGC) send raw indices.

All functions take a backend ``B`` (see :mod:`hvd_compress.backend`) and use
only vectorised operations.
"""
from __future__ import annotations

import functools
import math

from ..backend import ceil_div

INDEX_CODES = ("raw", "bitmap", "elias_fano")


def pack_bits(B, codes, bits):
    """Pack non-negative integer ``codes`` (< 2**bits, bits in 1/2/4/8) into uint8."""
    if bits == 8:
        return B.cast(codes, "uint8")
    per = 8 // bits
    n = B.numel(codes)
    padded = ceil_div(n, per) * per
    c = B.cast(codes, "int32")
    if padded != n:
        c = B.concat([c, B.zeros(padded - n, "int32", like=codes)])
    c = B.reshape(c, (padded // per, per))
    shifts = B.reshape(B.arange(per, "int32", like=codes) * bits, (1, per))
    return B.cast(B.sum(B.shift_left(c, shifts), axis=1), "uint8")


def unpack_bits(B, packed, bits, n):
    """Inverse of :func:`pack_bits`: the first ``n`` codes, as int32."""
    p = B.cast(packed, "int32")
    if bits == 8:
        return p[:n]
    per = 8 // bits
    shifts = B.reshape(B.arange(per, "int32", like=p) * bits, (1, per))
    c = B.bit_and(B.shift_right(B.reshape(p, (-1, 1)), shifts), (1 << bits) - 1)
    return B.flatten(c)[:n]


def pack_varwidth(B, values, width):
    """Pack int64 ``values`` at ``width`` bits each (width a Python int)."""
    v = B.cast(values, "int64")
    shifts = B.reshape(B.arange(width, "int64", like=v), (1, width))
    bits = B.bit_and(B.shift_right(B.reshape(v, (-1, 1)), shifts), 1)
    return pack_bits(B, B.flatten(bits), 1)


def unpack_varwidth(B, packed, width, n):
    bits = B.cast(unpack_bits(B, packed, 1, n * width), "int64")
    bits = B.reshape(bits, (n, width))
    shifts = B.reshape(B.arange(width, "int64", like=bits), (1, width))
    return B.sum(B.shift_left(bits, shifts), axis=1)


def _ef_low_bits(numel, k):
    return max(0, int(math.floor(math.log2(numel / k)))) if k else 0


def index_code_nbytes(code, numel, k):
    """Bytes of ``k`` sorted indices into ``numel`` elements in ``code``."""
    if code == "raw":
        return k * (4 if numel < 2**31 else 8)
    if code == "bitmap":
        return ceil_div(numel, 8)
    if code == "elias_fano":
        low = _ef_low_bits(numel, k)
        return ceil_div(k * low, 8) + ceil_div(k + (numel >> low) + 1, 8)
    raise ValueError(f"index_coding must be one of {INDEX_CODES} or 'auto'; got {code!r}")


def choose_index_code(numel, k, allowed=INDEX_CODES):
    """The smallest code for this tensor (ties go to the simpler code)."""
    return _smallest_code(int(numel), int(k), tuple(allowed))


@functools.lru_cache(maxsize=4096)  # asked several times per tensor per step, always of the same few sizes
def _smallest_code(numel, k, allowed):
    return min(allowed, key=lambda c: (index_code_nbytes(c, numel, k), INDEX_CODES.index(c)))


def encode_indices(B, idx, numel, code):
    """``idx``: sorted, distinct indices.  Returns the coded tensor
    (int32/int64 for raw, uint8 otherwise)."""
    if code == "raw":
        return B.cast(idx, "int32" if numel < 2**31 else "int64")
    k = B.numel(idx)
    if code == "bitmap":
        ones = B.ones(k, "int32", like=idx)
        return pack_bits(B, B.scatter_add(numel, idx, ones), 1)
    low = _ef_low_bits(numel, k)
    idx = B.cast(idx, "int64")
    high = B.shift_right(idx, low) + B.arange(k, "int64", like=idx)
    high_len = k + (numel >> low) + 1
    high_bits = pack_bits(B, B.scatter_add(high_len, high, B.ones(k, "int32", like=idx)), 1)
    if low == 0:
        return high_bits
    low_bits = pack_varwidth(B, B.bit_and(idx, (1 << low) - 1), low)
    return B.concat([low_bits, high_bits])


def _positions_of_set_bits(B, bits, k):
    """Indices of the k set bits of a 0/1 vector, without data-dependent shapes."""
    counts = B.cumsum(B.cast(bits, "int64"))
    return B.searchsorted(counts, B.arange(k, "int64", like=counts) + 1)


def decode_indices(B, coded, numel, k, code):
    """Inverse of :func:`encode_indices`: sorted int64 indices."""
    if code == "raw":
        return B.cast(coded, "int64")
    if code == "bitmap":
        return _positions_of_set_bits(B, unpack_bits(B, coded, 1, numel), k)
    low = _ef_low_bits(numel, k)
    high_len = k + (numel >> low) + 1
    low_nbytes = ceil_div(k * low, 8)
    high = _positions_of_set_bits(B, unpack_bits(B, coded[low_nbytes:], 1, high_len), k)
    high = high - B.arange(k, "int64", like=high)
    if low == 0:
        return high
    return B.shift_left(high, low) + unpack_varwidth(B, coded[:low_nbytes], low, k)
