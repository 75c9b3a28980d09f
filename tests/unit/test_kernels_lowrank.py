"""PowerSGD's C passes (``hvdc_lowrank_first``, ``_project``, ``_finish`` in
hvd_compress/kernels/hvdc_kernels.c) against numpy references.

The projection and the finish are element-wise sums in a fixed order (the
rows one after the other; the rank's terms from the first), so the numpy
references below take that order in float32 and the kernels must give the
same bits, on this CPU's vector layer and on the AVX2 and plain-C layers.
The first pass's products are sums over a row, split over vector lanes: they
are held to float32 rounding of the float64 product.  Shapes cover a single
element, rows shorter than a vector, several column blocks, every rank up to
the limit, both layouts of P, NaN and Inf, and an output large enough to be
streamed past the caches."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from hvd_compress.kernels import native
from hvd_compress.kernels.constants import LowRankLimit

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler: the fused kernels are not built")


def _p(a):
    return ctypes.c_void_p(a.ctypes.data) if a is not None else None


def _inputs(n, m, rank, seed, p_layout="F"):
    rng = np.random.default_rng(seed)
    f32 = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    x, r = f32(n, m), f32(n, m)
    qt = f32(rank, m)  # Q^T, row-major: Q column-major as the codec keeps it
    p = np.asarray(f32(n, rank), order=p_layout)
    return x, r, qt, p


def _strides(p):
    return p.strides[0] // 4, p.strides[1] // 4


def ref_project(mat, p):
    """qt[k] = sum_i p[i, k] mat[i], the rows added one after the other in float32."""
    qt = np.zeros((p.shape[1], mat.shape[1]), np.float32)
    for i in range(mat.shape[0]):
        qt = qt + p[i][:, None] * mat[i][None, :]
    return qt


def ref_outer(p, qt):
    """p qt, the rank's terms added from the first, in float32."""
    s = p[:, 0:1] * qt[0:1]
    for k in range(1, p.shape[1]):
        s = s + p[:, k:k + 1] * qt[k:k + 1]
    return s


def keep_finite(v):
    return np.where(np.isfinite(v), v, np.float32(0))


def same_bits(a, b):
    return a.shape == b.shape and np.array_equal(np.ascontiguousarray(a).view(np.uint32),
                                                 np.ascontiguousarray(b).view(np.uint32))


def run_first(lib, x, r, qt):
    n, m = x.shape
    p = np.full((n, qt.shape[0]), np.nan, np.float32)
    assert lib.hvdc_lowrank_first(_p(x), _p(r), n, m, qt.shape[0], _p(qt), _p(p)) == 0
    return p


def run_project(lib, mat, p):
    n, m = mat.shape
    qt = np.full((p.shape[1], m), np.nan, np.float32)
    assert lib.hvdc_lowrank_project(_p(mat), n, m, p.shape[1], _p(p), *_strides(p), _p(qt)) == 0
    return qt


def run_finish(lib, p, q_agg, q_local, mat, out):
    n, m = out.shape
    assert lib.hvdc_lowrank_finish(_p(p), *_strides(p), n, m, p.shape[1], _p(q_agg), _p(q_local), _p(mat),
                                   _p(out)) == 0


SHAPES = [(1, 1, 1), (3, 7, 2), (5, 17, 3), (9, 40, 4), (33, 2100, 4), (6, 2100, 8), (7, 1031, 16), (4, 33, 5)]


@pytest.mark.parametrize("n, m, rank", SHAPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_first_forms_acc_and_p(n, m, rank, with_residual):
    lib = native.load()
    x, r, qt, _ = _inputs(n, m, rank, seed=n * m + rank)
    x0, r0 = x.copy(), r.copy()
    p = run_first(lib, x, r if with_residual else None, qt)
    acc = x0 + r0 if with_residual else x0
    assert same_bits(x, x0), "x is read only"
    assert same_bits(r, acc if with_residual else r0), "acc = x + r into r, bit for bit"
    want = acc.astype(np.float64) @ qt.T.astype(np.float64)
    bound = np.abs(acc).astype(np.float64) @ np.abs(qt.T).astype(np.float64)
    assert np.all(np.abs(p - want) <= 1e-5 * bound + 1e-30), "P = acc Q to float32 rounding"


@pytest.mark.parametrize("n, m, rank", SHAPES)
@pytest.mark.parametrize("p_layout", ["F", "C"])
def test_project_equals_the_row_order_reference(n, m, rank, p_layout):
    lib = native.load()
    mat, _, _, p = _inputs(n, m, rank, seed=7 + n, p_layout=p_layout)
    assert same_bits(run_project(lib, mat, p), ref_project(mat, p))


@pytest.mark.parametrize("n, m, rank", SHAPES)
@pytest.mark.parametrize("p_layout", ["F", "C"])
def test_finish_writes_the_aggregate_and_the_residual(n, m, rank, p_layout):
    lib = native.load()
    mat, _, q_agg, p = _inputs(n, m, rank, seed=11 + m, p_layout=p_layout)
    q_local = np.random.default_rng(5).standard_normal((rank, m)).astype(np.float32)
    mat0 = mat.copy()
    out = np.full((n, m), np.nan, np.float32)
    run_finish(lib, p, q_agg, q_local, mat, out)
    assert same_bits(out, ref_outer(p, q_agg))
    assert same_bits(mat, keep_finite(mat0 - ref_outer(p, q_local)))
    out2 = np.full((n, m), np.nan, np.float32)
    run_finish(lib, p, q_agg, None, None, out2)  # no residual: only the aggregate
    assert same_bits(out2, out)


def test_nonfinite_values_reach_the_aggregate_never_the_residual():
    lib = native.load()
    n, m, rank = 6, 37, 2
    mat, _, q_agg, p = _inputs(n, m, rank, seed=3)
    q_local = q_agg.copy()
    mat[1, 3], mat[4, 20], q_agg[0, 5], q_local[1, 30] = np.nan, np.inf, np.nan, -np.inf
    mat0 = mat.copy()
    out = np.empty((n, m), np.float32)
    run_finish(lib, p, q_agg, q_local, mat, out)
    assert np.isnan(out[:, 5]).all() and same_bits(out, ref_outer(p, q_agg))
    assert np.isfinite(mat).all() and mat[1, 3] == 0 and mat[4, 20] == 0 and (mat[:, 30] == 0).all()
    assert same_bits(mat, keep_finite(mat0 - ref_outer(p, q_local)))


def test_a_large_aggregate_is_streamed_with_the_same_bits():
    """An output of 4M floats (16 MB) is written with stores that bypass the caches
    where it is aligned; an output one float off that alignment takes the ordinary
    stores: both equal the reference."""
    lib = native.load()
    n, m, rank = 4096, 1024, 2
    mat, _, q_agg, p = _inputs(n, m, rank, seed=1)
    q_local = q_agg * np.float32(0.5)
    want_out, want_mat = ref_outer(p, q_agg), keep_finite(mat - ref_outer(p, q_local))
    for offset in (0, 1):
        room = np.empty(n * m + 16 + offset, np.float32)
        start = (-room.ctypes.data // 4) % 16 + offset  # 64-byte aligned, then offset
        out, m2 = room[start:start + n * m].reshape(n, m), mat.copy()
        run_finish(lib, p, q_agg, q_local, m2, out)
        assert same_bits(out, want_out) and same_bits(m2, want_mat), f"offset {offset}"


@pytest.mark.parametrize("rank", [0, LowRankLimit.MAX_RANK + 1])
def test_a_rank_outside_the_limit_is_refused(rank):
    lib = native.load()
    x = np.ones((4, 4), np.float32)
    qt, p = np.ones((max(rank, 1), 4), np.float32), np.zeros((4, max(rank, 1)), np.float32)
    assert lib.hvdc_lowrank_first(_p(x), None, 4, 4, rank, _p(qt), _p(p)) == -1
    assert lib.hvdc_lowrank_project(_p(x), 4, 4, rank, _p(p), 1, 4, _p(qt)) == -1
    assert lib.hvdc_lowrank_finish(_p(p), 1, 4, 4, 4, rank, _p(qt), _p(qt), _p(x), _p(x)) == -1
    assert (p == 0).all() and (x == 1).all(), "nothing written"


def _library_built_with(tmp_path, *flags):
    """The kernels built with ``flags`` after the usual ones (-mno-... after -march=native
    switches a vector extension off)."""
    import subprocess
    cc = native.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp_path / f"kernels{''.join(flags)}.so"
    subprocess.run([cc, *native.FLAGS, *flags, *native.include_flags(), str(native.SOURCE), "-o", str(out), "-lm"],
                   check=True, capture_output=True)
    lib = ctypes.CDLL(str(out))
    for name, (args, res) in native.SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


@pytest.mark.parametrize("flags", [("-mno-avx512f",), ("-mno-avx512f", "-mno-avx2")], ids=["avx2", "plain-c"])
def test_other_vector_layers_give_the_same_results(tmp_path, flags):
    """The AVX2 and plain-C layers: the projection and the finish bit for bit, the
    first pass's products to float32 rounding (their lane split differs)."""
    here, other = native.load(), _library_built_with(tmp_path, *flags)
    for n, m, rank in [(5, 17, 3), (33, 2100, 4), (7, 1031, 16)]:
        x, r, qt, p = _inputs(n, m, rank, seed=m)
        r_here, r_other = r.copy(), r.copy()
        p_here, p_other = run_first(here, x, r_here, qt), run_first(other, x, r_other, qt)
        assert same_bits(r_here, r_other)
        np.testing.assert_allclose(p_other, p_here, rtol=1e-4, atol=1e-4)
        assert same_bits(run_project(here, x, p), run_project(other, x, p))
        outs, mats = [], []
        for lib in (here, other):
            out, mat = np.empty((n, m), np.float32), r.copy()
            run_finish(lib, p, qt, qt * np.float32(0.5), mat, out)
            outs.append(out)
            mats.append(mat)
        assert same_bits(*outs) and same_bits(*mats)


def test_the_torch_codec_runs_the_c_passes(monkeypatch):
    """On the CPU the preallocated torch rounds call the three passes (a spy around the
    library counts the calls), and above the kernels' rank limit none of them."""
    import hvd_compress
    from hvd_compress.codecs import torch_lowrank as tl
    from hvd_compress.tools.bench.local import local_compressor
    monkeypatch.setenv("HVDC_KERNELS", "1")
    real, calls = native.load(), []

    class Spy:
        def __getattr__(self, name):
            fn = getattr(real, name)

            def counted(*args):
                calls.append(name)
                return fn(*args)
            return counted

    monkeypatch.setattr(tl.native, "load", lambda: Spy())
    for rank, want in ((4, ["hvdc_lowrank_first", "hvdc_lowrank_project", "hvdc_lowrank_finish"]),
                       (LowRankLimit.MAX_RANK + 1, [])):
        calls.clear()
        comp = local_compressor(hvd_compress.PowerSGD(rank), "torch")
        grad = torch.randn(64, 48)
        out, ctx = comp.compress(grad)
        comp.decompress(out, ctx)
        assert [c for c in calls if c.startswith("hvdc_lowrank")] == want, rank
