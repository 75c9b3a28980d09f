"""Lossless coding of the integer parts of a payload: bit packing and sparse indices.

Sparse indices are sent in whichever of three codes is cheapest for the tensor
at hand (decided per tensor, per step, per rank; one header byte says which):

* ``raw``    -- int32 (int64 past 2**31 elements): 4 bytes an index;
* ``bitmap`` -- one bit per element of the dense tensor: n/8 bytes, wins once
  more than 1/32 of the elements are kept;
* ``delta``  -- sorted indices, first differences, packed at the width of the
  largest gap: about log2(n/k) bits an index, which for Top-1% is ~7-10 bits
  instead of 32.

All functions take a backend ``B`` (see :mod:`hvd_compress.backend`) and use
only vectorised operations.
"""
from __future__ import annotations

from .backend import ceil_div

RAW, BITMAP, DELTA = 0, 1, 2
CODE_NAMES = {RAW: "raw", BITMAP: "bitmap", DELTA: "delta"}


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


def index_code_sizes(numel, k, max_gap_bits):
    """Bytes of each index code (without the header byte)."""
    return {RAW: k * (4 if numel < 2**31 else 8),
            BITMAP: ceil_div(numel, 8),
            DELTA: ceil_div(k * max_gap_bits, 8) + 1}
