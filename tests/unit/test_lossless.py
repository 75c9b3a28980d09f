"""Lossless's payload (hvd_compress/schemes/lossless.py): one zstd frame per block of
byte planes, the same bytes from the kernels (hvdc_lossless_encode through the zstd
library of kernels/zstd_api.py) as from python-zstandard on numpy's planes; both
decoders give the floats back bit for bit and refuse a malformed payload."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from hvd_compress.codecs.torch_fused import codec_for
from hvd_compress.schemes import lossless as L

zstandard = pytest.importorskip("zstandard")


def _values(n, seed=0):
    x = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
    if n > 3:
        x[:3] = [math.nan, math.inf, -0.0]
    return x


def _python_frames(x, level=1):
    """The payload by its definition: numpy's planes of each block, compressed by python-zstandard."""
    planes, c = L.shuffle_planes(x), zstandard.ZstdCompressor(level=level)
    return b"".join(c.compress(planes[4 * lo:4 * (lo + m)].tobytes()) for lo, m in L.blocks(x.size))


def _needs_kernels():
    if L.native_coder() is None:
        pytest.skip("the kernels or a zstd library do not load here")


@pytest.mark.parametrize("n", [0, 1, 17, 4096 + 13, L.PLANE_BLOCK, 2 * L.PLANE_BLOCK + 77])
def test_kernels_write_python_zstandards_frames_and_both_decode_them(n, monkeypatch):
    _needs_kernels()
    x = _values(n)
    blob = L.shuffle_compress(x, 3)
    assert blob.tobytes() == _python_frames(x, 3)
    assert L.shuffle_decompress(blob, n).view(np.uint32).tolist() == x.view(np.uint32).tolist()
    monkeypatch.setattr(L, "native_coder", lambda: None)  # python-zstandard's path, both ways
    assert L.shuffle_compress(x, 3).tobytes() == blob.tobytes()
    assert L.shuffle_decompress(blob, n).view(np.uint32).tolist() == x.view(np.uint32).tolist()


@pytest.mark.parametrize("native", [True, False])
def test_malformed_payloads_are_refused(native, monkeypatch):
    if native:
        _needs_kernels()
    else:
        monkeypatch.setattr(L, "native_coder", lambda: None)
    n = L.PLANE_BLOCK + 5
    blob = np.frombuffer(_python_frames(_values(n)), np.uint8)
    other = np.frombuffer(_python_frames(_values(n + 1)), np.uint8)
    cases = {"cut short": blob[:-1], "trailing bytes": np.concatenate([blob, blob[:3]]),
             "a frame too long": other, "empty": blob[:0]}
    for what, bad in cases.items():
        with pytest.raises(ValueError, match="Lossless payload"):
            L.shuffle_decompress(bad, n)
            pytest.fail(what)


def test_the_fused_decode_streams_a_large_sum_bit_for_bit():
    """Past LOSSLESS_STREAM_MIN (4M floats) the fused decode writes past the caches:
    two ranks' payloads, summed and scaled, as the eager decode gives them."""
    _needs_kernels()
    n = (1 << 22) + 77
    x0, x1 = torch.from_numpy(_values(n, 1)), torch.from_numpy(_values(n, 2))
    import hvd_compress as hc
    scheme = hc.schemes.Lossless()
    codec = codec_for(scheme, None, x0)
    assert codec is not None
    payloads = [{"bytes": codec.encode(x, None, {}, None)["bytes"].clone()} for x in (x0, x1)]
    got = codec.aggregate(payloads, n, {}, torch.tensor(0.5), None, {})
    want = (x0 + x1) * 0.5
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
