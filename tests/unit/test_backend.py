"""Unit tests of :mod:`hvd_compress.backend` that the scheme tests do not reach:
the exact top-k's sampled-threshold path only runs on tensors of 2^18 elements
or more, larger than any scheme test uses."""
import numpy as np
import pytest

from unit_helpers import FRAMEWORKS, framework

N = 1 << 19


def _inputs():
    rng = np.random.default_rng(7)
    yield "normal", rng.standard_normal(N).astype(np.float32)
    # heavy ties: the k-th magnitude is shared by many elements
    yield "ties", np.round(rng.standard_normal(N) * 4).astype(np.float32)
    # the strided sample sees only the large values (every 8th element at this
    # size): the threshold overshoots, fewer than k candidates pass, and the
    # backend must fall back to the full top-k
    x = rng.standard_normal(N).astype(np.float32)
    x[::8] = 1000 + rng.standard_normal(N // 8).astype(np.float32)
    yield "sample_overshoots", x


@pytest.mark.parametrize("fwname", FRAMEWORKS)
@pytest.mark.parametrize("k", [1, 100, N // 100, N // 9])
@pytest.mark.parametrize("case", ["normal", "ties", "sample_overshoots"])
def test_topk_indices_exact_on_large_tensors(fwname, k, case):
    x = dict(_inputs())[case]
    fw = framework(fwname)
    idx = np.asarray(fw.np(fw.B.topk_indices(fw.tensor(np.abs(x)), k))).astype(np.int64)
    assert idx.size == k and np.unique(idx).size == k
    kth = np.sort(np.abs(x))[::-1][k - 1]
    # exactly the k largest magnitudes (any of the tied ones at the k-th place)
    assert np.all(np.abs(x)[idx] >= kth)
    assert np.sum(np.abs(x) > kth) <= k
