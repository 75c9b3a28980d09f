"""Tensors with more than 2**31 elements, without allocating one.

What is checked here (torch and TF backends):

* ``hvd_compress.backend.index_dtype`` and the raw index code widen from int32 to
  int64 exactly at 2**31 elements (index 2**31 - 1 is the largest int32);
* the coded sizes (``hvd_compress.schemes.bit_coding.index_code_nbytes``) and the code that
  ``choose_index_code`` picks for a 6.4-billion-element tensor, and
  ``TopK.payload_nbytes`` for it;
* sorted indices above 2**31 survive the raw and the Elias-Fano codes
  (Elias-Fano's buffers are O(k), not O(numel), so this runs in a few MB).

What is *not* run anywhere (documented in docs/design/reliability.md): a full step on a
tensor of more than 2**31 elements -- a dense fp32 copy is 8 GiB and a step holds
several (gradient, residual, aggregate).
"""
import math

import numpy as np
import pytest

import hvd_compress
from hvd_compress.backend import index_dtype
from hvd_compress.schemes.bit_coding import INDEX_CODES, choose_index_code, decode_indices, encode_indices, index_code_nbytes
from unit_helpers import FRAMEWORKS, framework


def tensor(fwname, a):
    fw = framework(fwname)
    return fw.B, fw.tensor(a)


def to_numpy(t):
    return np.asarray(t.numpy() if hasattr(t, "numpy") else t)

N_BIG = 3 * 2**31 + 7  # 6.4e9 elements: a 25.8 GB fp32 tensor


def test_index_dtype_widens_exactly_at_2_31():
    assert index_dtype(0) == "int32"
    assert index_dtype(2**31 - 1) == "int32"   # largest index 2**31 - 2
    assert index_dtype(2**31) == "int64"       # largest index 2**31 - 1 would still fit: widening is conservative
    assert index_dtype(N_BIG) == "int64"


def test_raw_index_bytes_widen():
    assert index_code_nbytes("raw", 2**31 - 1, 1000) == 4000
    assert index_code_nbytes("raw", 2**31, 1000) == 8000
    assert index_code_nbytes("raw", N_BIG, 1000) == 8000


@pytest.mark.parametrize("ratio", [1e-4, 1e-3, 1e-2, 0.1, 0.5])
def test_index_code_choice_for_a_huge_tensor(ratio):
    k = max(1, math.ceil(ratio * N_BIG))
    sizes = {c: index_code_nbytes(c, N_BIG, k) for c in INDEX_CODES}
    code = choose_index_code(N_BIG, k)
    assert sizes[code] == min(sizes.values())
    assert sizes["raw"] == 8 * k
    assert sizes["bitmap"] == math.ceil(N_BIG / 8)
    low = int(math.floor(math.log2(N_BIG / k)))
    assert sizes["elias_fano"] == math.ceil(k * low / 8) + math.ceil((k + (N_BIG >> low) + 1) / 8)
    # Elias-Fano stays within its bound of 2 + log2(n/k) bits an index (+ 2 bytes of rounding)
    assert sizes["elias_fano"] <= k * (2 + math.log2(N_BIG / k)) / 8 + 2
    if ratio <= 0.1:
        assert code == "elias_fano"
    else:
        assert code == "bitmap"


def test_topk_payload_nbytes_for_a_huge_tensor():
    comp = hvd_compress.TopK(0.01)
    k = math.ceil(0.01 * N_BIG)
    idx = index_code_nbytes(choose_index_code(N_BIG, k), N_BIG, k)
    assert comp.scheme.payload_nbytes(N_BIG) == idx + 4 * k
    assert comp.scheme.payload_nbytes(N_BIG) < 0.013 * 4 * N_BIG  # ~1.1 bytes an index + 4 a value
    raw = hvd_compress.TopK(0.01, index_coding="raw").scheme.payload_nbytes(N_BIG)
    assert raw == 12 * k  # int64 indices + fp32 values


def _big_indices(k, seed=0):
    rng = np.random.default_rng(seed)
    idx = np.unique(rng.integers(0, N_BIG, size=k, dtype=np.int64))
    return np.unique(np.concatenate([idx, [0, 2**31 - 1, 2**31, 2**32 + 1, N_BIG - 1]]).astype(np.int64))


@pytest.mark.parametrize("fwname", FRAMEWORKS)
def test_raw_indices_beyond_2_31_are_int64(fwname):
    idx = _big_indices(100)
    B, t = tensor(fwname, idx)
    enc = encode_indices(B, t, N_BIG, "raw")
    assert B.dtype_name(enc) == "int64"
    np.testing.assert_array_equal(to_numpy(decode_indices(B, enc, N_BIG, idx.size, "raw")), idx)
    small = np.array([0, 5, 2**31 - 2], dtype=np.int64)
    B, t = tensor(fwname, small)
    enc = encode_indices(B, t, 2**31 - 1, "raw")
    assert B.dtype_name(enc) == "int32"
    np.testing.assert_array_equal(to_numpy(decode_indices(B, enc, 2**31 - 1, 3, "raw")), small)


@pytest.mark.parametrize("fwname", FRAMEWORKS)
def test_elias_fano_beyond_2_31_round_trip(fwname):
    idx = _big_indices(3000, seed=1)
    B, t = tensor(fwname, idx)
    enc = encode_indices(B, t, N_BIG, "elias_fano")
    assert B.dtype_name(enc) == "uint8"
    assert B.numel(enc) == index_code_nbytes("elias_fano", N_BIG, idx.size)
    np.testing.assert_array_equal(to_numpy(decode_indices(B, enc, N_BIG, idx.size, "elias_fano")), idx)
