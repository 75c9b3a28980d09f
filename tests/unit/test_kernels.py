"""The fused CPU kernels (hvd_compress.kernels) against the eager schemes, which
are the reference: the same payload bytes, the same residual and the same
decoded sum, bit for bit, over hypothesis-drawn sizes (0, 1, odd, large) and
several steps of error feedback; exact Top-K up to ties; no fresh buffer of
1 MiB or more on the hot path after warm-up."""
import math
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hvd_compress as hc
from hvd_compress.backend import backend_for
from hvd_compress.kernels import native
from hvd_compress.kernels.constants import Framework
from hvd_compress.codecs.torch_fused import _p, _ptrs, codec_for
from hvd_compress.feedback.memory import ResidualMemory, finite_or_zero
from hvd_compress.schemes.base import EncodeContext, SeededDraws

pytestmark = pytest.mark.skipif(not native.available(), reason="no C compiler: the fused kernels are not built")

B = backend_for(torch.zeros(1))

#: every fused scheme, by a label the failures print
SCHEMES = {
    "int8": lambda: hc.schemes.Int8(),
    "int8-b100": lambda: hc.schemes.Int8(block_size=100),
    "int8-b1": lambda: hc.schemes.Int8(block_size=1),
    "signsgd": lambda: hc.schemes.SignSGD(),
    "efsignsgd": lambda: hc.schemes.EFSignSGD(),
    "onebit": lambda: hc.schemes.OneBit(),
    "fp16": lambda: hc.schemes.FP16(),
    "bf16": lambda: hc.schemes.BF16(),
    "topk1%": lambda: hc.schemes.TopK(0.01),
    "topk-raw": lambda: hc.schemes.TopK(0.02, index_coding="raw"),
    "topk-bitmap": lambda: hc.schemes.TopK(0.1, index_coding="bitmap"),
    "topk-ef": lambda: hc.schemes.TopK(0.05, index_coding="elias_fano"),
    "topk-int8": lambda: hc.schemes.TopK(0.05, values=hc.schemes.Int8()),
    "topk-bf16": lambda: hc.schemes.TopK(0.1, values=hc.schemes.BF16()),
    "threshold": lambda: hc.schemes.Threshold(1.5),
    "dgc": lambda: hc.schemes.DGC(0.01, sample_ratio=0.1),
    "dgc-int8": lambda: hc.schemes.DGC(0.05, sample_ratio=0.1, values=hc.schemes.Int8()),
    "qsgd": lambda: hc.schemes.QSGD(),
    "qsgd4": lambda: hc.schemes.QSGD(4),
    "terngrad": lambda: hc.schemes.TernGrad(),
    "randomk1%": lambda: hc.schemes.RandomK(0.01),
    "randomk-20%": lambda: hc.schemes.RandomK(0.2),  # 8 k >= n: torch's whole permutation, then the kernels
    "lossless": lambda: hc.schemes.Lossless(),
}
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


def _ctx(n, step=1, rank=0, size=1):
    # the adapters' draws: the fused kernels draw torch's stream for the seed themselves
    gen = SeededDraws(B, 1000 * step + rank, like=torch.zeros(1))
    return EncodeContext(key="w", step=step, rank=rank, size=size, uniform=gen, shared_seed=step, shape=(n,))


def _eager_step(scheme, x, r, ctx):
    """The reference: eager error feedback around scheme.encode."""
    if r is None:
        from dataclasses import replace
        payload, _ = scheme.encode(B, x, replace(ctx, need_sent=False))
        return payload, None
    acc = x + r
    payload, sent = scheme.encode(B, acc, ctx)
    return payload, finite_or_zero(B, acc - sent)


def _wire(payload):
    return {k: v for k, v in payload.items() if not k.startswith("_")}


def _same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8) if a.dtype != torch.bool
                                                                     else a, b.view(torch.uint8))


#: payload parts that are reductions over the tensor (EFSignSGD's l1 scale, OneBit's
#: two means): the kernel sums in double, torch in float32 in its own order, so they
#: agree to rounding, not bit for bit; the element-wise rest is checked given the fused value
REDUCTIONS = {"efsignsgd": "scale", "onebit": "means", "qsgd": "norm", "qsgd4": "norm"}


def _qsgd_given(scheme, acc, norm, ctx):
    """QSGD's payload and ``sent`` for ``acc`` given the kernel's norm: the eager formula."""
    safe = torch.where(norm == 0, torch.ones(1), norm)
    level = acc.abs() / safe * float(scheme.levels)
    q = torch.floor(level + ctx.uniform(acc.numel())).clamp(0.0, float(scheme.levels)) * acc.sign()
    return {"q": q.to(torch.int8), "norm": norm}, q * (safe / float(scheme.levels))


def _sent_given(name, acc, reduced):
    """What the scheme sends for ``acc`` given the kernel's reduction: its eager formula."""
    if name == "efsignsgd":
        return torch.where(acc >= 0, 1.0, -1.0) * reduced[0]
    pos = (acc >= 0).float()
    return pos * reduced[0] + (1.0 - pos) * reduced[1]


def _assert_payloads_equal(pe, pf, raw_topk, reduction=None):
    assert sorted(_wire(pe)) == sorted(_wire(pf))
    for part in _wire(pe):
        a, b = pe[part].contiguous(), pf[part].contiguous()
        if part == reduction:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=0, equal_nan=True)
            continue
        if raw_topk and part in ("idx", "val"):
            continue  # raw Top-K indices leave torch.topk unsorted: compared as (index, value) pairs below
        assert a.dtype == b.dtype and a.numel() == b.numel(), part
        assert _same(a, b), part
    if raw_topk:
        oe, of = torch.argsort(pe["idx"]), torch.argsort(pf["idx"])
        assert torch.equal(pe["idx"][oe], pf["idx"][of]) and torch.equal(pe["val"][oe], pf["val"][of])


def _run_steps(name, n, ranks, steps, seed, ef, scale):
    """``steps`` steps of ``ranks`` ranks, fused and eager side by side."""
    scheme = SCHEMES[name]()
    ef = ef and scheme.error_feedback_default if ef is None else ef
    gen = torch.Generator().manual_seed(seed)
    res_e = [torch.randn(n, generator=gen) * 0.1 if ef else None for _ in range(ranks)]
    res_f = [None if r is None else r.clone() for r in res_e]
    ws = [dict() for _ in range(ranks)]
    raw_topk = isinstance(scheme, hc.schemes.TopK) and scheme.index_code(n) == "raw"
    for step in range(1, steps + 1):
        pes, pfs = [], []
        for rank in range(ranks):
            x = torch.randn(n, generator=gen)
            codec = codec_for(scheme, ResidualMemory() if ef else None, x)
            if codec is None:  # only Top-K keeping over an eighth of the elements, and Lossless with a memory, run eager
                assert ((isinstance(scheme, hc.schemes.TopK) and 8 * scheme.fixed_k(n) > n)
                        or (name == "lossless" and ef)), (name, n)
                return
            ctx = _ctx(n, step, rank, ranks)
            acc = x if res_e[rank] is None else x + res_e[rank]
            pe, res_e[rank] = _eager_step(scheme, x, res_e[rank], ctx)
            pf = codec.encode(x, res_f[rank], ws[rank], ctx)
            if name.startswith("qsgd"):  # the levels drawn given the kernel's norm
                # torch sums the squares in float32 in its own order, the kernel in double
                torch.testing.assert_close(pf["norm"], pe["norm"], rtol=1e-4, atol=0)
                pe, sent = _qsgd_given(scheme, acc, pf["norm"].clone(), ctx)
                res_e[rank] = finite_or_zero(B, acc - sent) if ef else None
            _assert_payloads_equal(pe, pf, raw_topk, REDUCTIONS.get(name))
            if "_idx" in pe:  # Random-K's shared indices, kept for the decode
                assert torch.equal(pe["_idx"], pf["_idx"])
            if name in REDUCTIONS:  # the eager math, given the fused reduction
                part = REDUCTIONS[name]
                pe = {**pe, part: pf[part].clone()}
                if ef and not name.startswith("qsgd"):
                    res_e[rank] = finite_or_zero(B, acc - _sent_given(name, acc, pf[part]))
            if ef:
                assert _same(res_e[rank], res_f[rank]), f"residual of rank {rank} at step {step}"
            pes.append(pe)
            pfs.append({k: v.clone() for k, v in _wire(pf).items()})
        _assert_decodes_equal(scheme, codec, pes, pfs, n, scale, ws[0])


def _assert_decodes_equal(scheme, codec, pes, pfs, n, scale, ws):
    if scheme.transport == "allreduce":  # FP16, Random-K: Horovod sums the payloads; the decode places them
        reduced = torch.stack([p["reduce"] for p in pfs]).sum(0)
        want = scheme.decode_reduced(B, reduced, n, pes[0])  # Random-K: the shared indices, kept locally
        assert _same(codec.decode_reduced(reduced, n, None, ws), want)
        return
    s = torch.tensor(scale, dtype=torch.float32) if scheme.apply_op_scale else None
    want = scheme.aggregate(B, [_wire(p) for p in pes], n)
    want = want * s if s is not None else want
    # the fused decode of fused payloads, of eager ones (receivers cannot tell), into a
    # caller's buffer and into a fresh one
    assert _same(codec.aggregate(pfs, n, {}, s, None, {}), want)
    assert _same(codec.aggregate([_wire(p) for p in pes], n, {}, s, torch.full((n,), 7.0), {}), want)
    assert _same(scheme.aggregate(B, pfs, n) * (s if s is not None else 1.0), want)


@pytest.mark.parametrize("name", sorted(SCHEMES))
@settings(max_examples=12, **SETTINGS)
@given(n=st.one_of(st.sampled_from([0, 1, 2, 7, 8, 9, 15, 16, 17, 33, 1000, 4097]), st.integers(0, 6000)),
       ranks=st.integers(1, 3), seed=st.integers(0, 2**16), ef=st.sampled_from([None, True, False]),
       scale=st.sampled_from([1.0, 0.5, 1 / 3]))
def test_fused_equals_eager(name, n, ranks, seed, ef, scale):
    if n == 0 and name.startswith(("topk", "dgc", "efsignsgd", "randomk")):
        n = 1  # the eager reference itself has no meaning for an empty top-k or l1 scale
    _run_steps(name, n, ranks, steps=3, seed=seed, ef=ef, scale=scale)


@pytest.mark.parametrize("name", ["int8", "efsignsgd", "onebit", "topk1%", "topk-ef", "topk-int8", "topk-bf16", "dgc",
                                  "threshold", "bf16", "qsgd4", "terngrad", "randomk1%", "lossless"])
def test_fused_equals_eager_large(name):  # noqa: D103
    """Sizes where the Top-K sample is strided and the vector loops dominate."""
    _run_steps(name, (1 << 18) + 77, ranks=2, steps=3, seed=5, ef=True, scale=0.5)


def _kept_magnitudes_exact(x, idx, k):
    a = x.abs()
    kept = torch.zeros(x.numel(), dtype=torch.bool)
    kept[idx] = True
    assert idx.numel() == k and int(kept.sum()) == k
    if 0 < k < x.numel():
        assert a[kept].min() >= a[~kept].max()


@pytest.mark.parametrize("values", ["float32", "bf16"])
@pytest.mark.parametrize("case", ["ties", "sample_overshoots", "sample_undershoots", "all_zero", "mostly_zero",
                                  "denormal"])
def test_topk_exact_up_to_ties(case, values):
    """Exact k even where the sample misses: ties at the k-th magnitude, a
    sample that sees only large values (the threshold lowered, then the eager
    fallback), one that sees only small ones (more candidates than the room: collected
    again with room), zeros, magnitudes below the smallest normal float (the selection's
    scalar compaction); and the residual the candidate pass writes as if sent is
    put back wherever a candidate is not sent."""
    from hvd_compress.kernels.topk_plan import fused_topk_plan
    n = (1 << 18) + 3
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(n, generator=gen)
    scheme = hc.schemes.TopK(0.01, index_coding="raw", values=hc.schemes.BF16() if values == "bf16" else None)
    k = scheme.fixed_k(n)
    if case == "ties":
        x = torch.round(x * 3)
    elif case == "sample_overshoots":
        x[::4] = 1000 + x[::4]
    elif case == "sample_undershoots":
        x[::fused_topk_plan(n, k)[0]] *= 0.5
    elif case == "all_zero":
        x.zero_()
    elif case == "denormal":
        x *= 1e-39
    else:
        x[torch.rand(n, generator=gen) > 0.005] = 0.0
    r = torch.zeros(n)
    acc = x.clone()
    payload = codec_for(scheme, ResidualMemory(), x).encode(x, r, {}, _ctx(n))
    _kept_magnitudes_exact(acc, payload["idx"].long(), k)
    # conservation: what was sent plus the residual is the gradient
    val = payload["val"] if values == "float32" else payload["v.bits"].view(torch.bfloat16).float()
    sent = torch.zeros(n).index_add_(0, payload["idx"].long(), val)
    assert torch.equal(sent + r, acc)


def test_non_finite_values_are_sent_never_kept():
    n = 4096
    x = torch.randn(n)
    x[[3, 100, 2000]] = torch.tensor([math.nan, math.inf, -math.inf])
    for name in ("int8", "efsignsgd", "onebit", "topk1%", "dgc", "threshold", "bf16", "fp16", "qsgd", "terngrad",
                 "randomk1%"):
        scheme = SCHEMES[name]()
        r = torch.zeros(n)
        codec_for(scheme, ResidualMemory(), x).encode(x, r, {}, _ctx(n))
        assert bool(torch.isfinite(r).all()), name


@pytest.mark.parametrize("seed", [0, 7, 2**31 + 5, 2**63 - 1])
def test_kernel_draws_are_torch_rand(seed):
    """The kernels draw torch's own numbers for a seed (mt19937 on the seed's low 32 bits),
    across the boundaries of its 624-word blocks, so a fused encode sends what the eager
    one sends."""
    lib = native.load()
    for n in (1, 623, 624, 625, 5000):
        u = torch.empty(n)
        lib.hvdc_uniform(Framework.TORCH, seed, n, _p(u))
        assert torch.equal(u, torch.rand(n, generator=torch.Generator().manual_seed(seed))), n


@pytest.mark.parametrize("n,ratio", [(1000, 0.01), (5003, 0.1), (1 << 20, 0.01), (100, 0.05), (1000, 0.2)])
def test_randomk_indices_are_torch_randperm_prefix(n, ratio):
    """Random-K's shared indices from the kernel are the backend's, index for index; where
    torch draws a whole permutation (8 k >= n) the kernel declines (-1) and the codec asks
    torch."""
    from hvd_compress.schemes.sparsification import _k_for
    lib, k = native.load(), _k_for(ratio, n)
    idx, seen = torch.empty(k, dtype=torch.int64), torch.empty((n + 63) // 64, dtype=torch.int64)
    scratch = torch.empty(2 * (2 * k + 64), dtype=torch.int64)
    for seed in (1, 99, 12345678901):
        got = lib.hvdc_randomk_indices_torch(seed, n, k, _p(idx), _p(seen), _p(scratch))
        if 8 * k >= n:
            assert got == -1
            continue
        assert got == k and torch.equal(idx, B.randperm_prefix(n, k, seed, like=torch.zeros(1))), seed


def test_which_calls_are_fused(monkeypatch):
    x = torch.randn(1000)
    assert codec_for(hc.schemes.Int8(), None, x) is not None
    assert codec_for(hc.schemes.Int8(), ResidualMemory(), x) is not None
    assert codec_for(hc.schemes.Int8(), hc.MomentumMemory(0.9), x) is not None
    # DGC's memory, other dtypes, non-contiguous or CUDA-like (host reads not free) tensors: eager
    assert codec_for(hc.schemes.Int8(), hc.DGCMemory(0.9), x) is None
    assert codec_for(hc.schemes.Int8(), None, x.double()) is None
    assert codec_for(hc.schemes.Int8(), None, torch.randn(10, 10).t()) is None
    assert codec_for(hc.schemes.PowerSGD(2), None, x) is None  # not a codec of its own: the eager scheme runs
    assert codec_for(hc.schemes.TopK(0.5), None, x) is None  # over an eighth kept: eager
    monkeypatch.setenv("HVDC_KERNELS", "0")
    assert codec_for(hc.schemes.Int8(), None, x) is None


def test_build_is_cached_per_source_and_atomic(tmp_path, monkeypatch):
    monkeypatch.setenv("HVDC_KERNEL_CACHE", str(tmp_path))
    path = native.build()
    assert path.parent == tmp_path and path.exists()
    mtime = path.stat().st_mtime_ns
    assert native.build() == path and path.stat().st_mtime_ns == mtime  # built once
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left behind


def test_missing_compiler_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HVDC_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setattr(native, "compiler", lambda: None)
    with pytest.raises(RuntimeError, match="no C compiler"):
        native.build()


# --- the selection kernels against numpy ---------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 17, 4096 + 13, (1 << 16) + 5])
@pytest.mark.parametrize("room", ["enough", "short"])
def test_select_sent_equals_numpy(n, room):
    """hvdc_select_sent: every |acc| >= thr sent (never a NaN), int32 indices ascending, the
    residual 0 where stored and at a NaN, acc elsewhere; out of room: the count, the first
    `room` stored, and hvdc_unsend puts their residual back."""
    import ctypes
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    r = (rng.standard_normal(n) * 0.5).astype(np.float32)
    x[rng.integers(0, n, 3)] = [np.nan, np.inf, -np.inf]
    acc = x + r
    with np.errstate(invalid="ignore"):
        want = np.flatnonzero(np.abs(acc) >= 1.0)
    cap = n + 16 if room == "enough" else max(1, len(want) // 2)
    rt, xt = torch.from_numpy(r.copy()), torch.from_numpy(x)
    idx, val = torch.zeros(n + 16, dtype=torch.int32), torch.zeros(n + 16)
    c = native.load().hvdc_select_sent(_p(xt), _p(rt), n, ctypes.c_float(1.0), 0, _p(idx), _p(val), cap)
    assert c == len(want)
    stored = want[:cap]
    assert np.array_equal(idx[:len(stored)].numpy(), stored)
    assert val[:len(stored)].numpy().tobytes() == acc[stored].tobytes()
    res = np.where(np.isnan(acc), np.float32(0), acc)
    res[stored] = 0
    assert rt.numpy().tobytes() == res.tobytes()
    native.load().hvdc_unsend(_p(rt), _p(idx), _p(val), len(stored))
    assert rt.numpy().tobytes() == np.where(np.isnan(acc), np.float32(0), acc).tobytes()


@pytest.mark.parametrize("ranks", [1, 3])
@pytest.mark.parametrize("s", [None, 0.25, -0.0, np.inf, np.nan], ids=["unscaled", "0.25", "-0", "inf", "nan"])
def test_sparse_sum_equals_numpy(ranks, s):
    """hvdc_sparse_sum (int64 indices) and hvdc_sparse_sum_i32: zeros, each rank's values added
    onto 0 in rank order at its indices, times s where touched (an untouched element stays +0
    whatever s is: a finite s that is not negative scales whole blocks, the others only the
    touched elements); hvdc_sparse_sum_i32 returns -1 for indices out of order, -2 for one out
    of range."""
    import ctypes
    rng = np.random.default_rng(ranks)
    n = 3 * 4096 + 77
    idxs = [np.sort(rng.choice(n, rng.integers(0, n // 3), replace=False)).astype(np.int32) for _ in range(ranks)]
    vals = [rng.standard_normal(len(i)).astype(np.float32) for i in idxs]
    scaled, s = int(s is not None), np.float32(0.0 if s is None else s)
    want = np.zeros(n, np.float32)
    touched = np.zeros(n, bool)
    for i, v in zip(idxs, vals):
        want[i] += v
        touched[i] = True
    if scaled:
        want[touched] *= s
    it, vt = [torch.from_numpy(i) for i in idxs], [torch.from_numpy(v) for v in vals]
    ks, out = torch.tensor([len(i) for i in idxs], dtype=torch.int64), torch.full((n,), 7.0)
    lib = native.load()
    assert lib.hvdc_sparse_sum_i32(ranks, _ptrs(it), _ptrs(vt), _p(ks), n, ctypes.c_float(s), scaled, _p(out)) == 0
    assert out.numpy().tobytes() == want.tobytes()
    wide, out64 = [t.to(torch.int64) for t in it], torch.full((n,), 7.0)
    lib.hvdc_sparse_sum(ranks, _ptrs(wide), _ptrs(vt), _p(ks), n, ctypes.c_float(s), scaled, _p(out64))
    assert out64.numpy().tobytes() == want.tobytes()
    bad = torch.from_numpy(np.array([5, 3], np.int32)), torch.from_numpy(np.array([1, n], np.int32))
    two, v2 = torch.tensor([2], dtype=torch.int64), torch.ones(2)
    for t, status in zip(bad, (-1, -2)):
        assert lib.hvdc_sparse_sum_i32(1, _ptrs([t]), _ptrs([v2]), _p(two), n, ctypes.c_float(1.0), 0, _p(out)) == status


@pytest.mark.parametrize("case", ["magnitudes", "ties", "zeros", "signed", "small"])
def test_kth_largest_equals_numpy(case):
    """The k-th largest (the radix select on many magnitudes, quickselect on signed values or few),
    with the k largest left in front, so that a second call among them selects from the same values."""
    rng = np.random.default_rng(2)
    m = 1000 if case == "small" else 70_000
    v = np.abs(rng.standard_normal(m)).astype(np.float32)
    if case == "ties":
        v = np.round(v * 4).astype(np.float32)
    elif case == "zeros":
        v[rng.random(m) < 0.9] = 0.0
    elif case == "signed":
        v = rng.standard_normal(m).astype(np.float32)
    for k in (1, 9, m // 8, m - 1, m):
        t = torch.from_numpy(v.copy())
        got = native.load().hvdc_kth_largest(_p(t), m, k)
        want = np.sort(v)[::-1]
        assert np.float32(got).tobytes() == want[k - 1].tobytes(), (case, k)
        assert np.array_equal(np.sort(t.numpy()[:k]), np.sort(want[:k])), (case, k)


@pytest.mark.parametrize("case", ["random", "ties", "nan_inf", "all_equal"])
def test_topk_fixup_equals_numpy(case):
    """The radix selection: the k largest magnitudes, ties in index order (a NaN counts as
    +Inf), indices ascending; and the bfloat16 values with their residual."""
    rng = np.random.default_rng(1)
    c = 20_000
    v = rng.standard_normal(c).astype(np.float32)
    if case == "ties":
        v = np.round(v * 2).astype(np.float32)
    elif case == "nan_inf":
        v[[5, 50, 500]] = [np.nan, np.inf, -np.inf]
    elif case == "all_equal":
        v[:] = -2.0
    cand = np.sort(rng.choice(10 * c, c, replace=False)).astype(np.int64)
    for k in (1, 7, c // 2, c - 1, c):
        mag = np.where(np.isnan(v), np.float32(np.inf), np.abs(v))
        order = np.lexsort((np.arange(c), -mag))  # by magnitude descending, then index
        want = np.sort(order[:k])
        kept, kval, tmp = torch.zeros(k, dtype=torch.int64), torch.zeros(k), torch.empty(c)
        candt, vt = torch.from_numpy(cand), torch.from_numpy(v)  # held across the call
        native.load().hvdc_topk_fixup(_p(candt), _p(vt), c, k, 1, _p(kept), _p(kval), _p(tmp))
        assert np.array_equal(kept.numpy(), cand[want]), (case, k)
        assert kval.numpy().tobytes() == v[want].tobytes()
        acc = torch.ones(10 * c)
        bits = torch.zeros(k, dtype=torch.int16)
        native.load().hvdc_sparse_bf16_encode(_p(kval), k, _p(kept), _p(acc), _p(bits))
        want_bits = torch.from_numpy(v[want]).to(torch.bfloat16)
        nan = torch.from_numpy(np.isnan(v[want]))  # a NaN's bits: 0x7FC0 here, torch's own differ by version
        assert torch.equal(bits[~nan], want_bits.view(torch.int16)[~nan]) and bool((bits[nan] == 0x7FC0).all())
        sent = want_bits.float()
        assert torch.equal(acc[kept], finite_or_zero(B, torch.from_numpy(v[want]) - sent))


@pytest.mark.parametrize("code", ["raw", "bitmap", "elias_fano"])
@pytest.mark.parametrize("values", ["float32", "bf16"])
def test_sparse_decode_sum_equals_numpy(code, values):
    """The one-pass decode of sparse payloads (index code and values, each rank's added in
    rank order onto 0, scaled where touched) against numpy, across its 4096-element
    blocks, 512-index chunks and the streamed-output size; and its answers to malformed
    payloads: raw indices out of order (-1: the caller sorts), an index outside [0, n)
    or a code with fewer indices than declared (-2)."""
    import ctypes
    from hvd_compress.schemes.bit_coding import _ef_low_bits, index_code_nbytes
    from hvd_compress.kernels.topk_plan import CODES
    lib = native.load()
    rng = np.random.default_rng(3)
    for n, k, nr, scale in ((1, 1, 1, None), (9000, 1000, 3, 0.5), ((1 << 20) + 77, 70_000, 1, 1 / 3),
                            ((1 << 20) + 77, 5000, 2, None)):
        low = _ef_low_bits(n, k) if code == "elias_fano" else 0
        nbytes = index_code_nbytes(code, n, k)
        codes, vals, want = [], [], np.zeros(n, np.float32)
        touched = np.zeros(n, bool)
        for _ in range(nr):
            idx = np.sort(rng.choice(n, k, replace=False)).astype(np.int64)
            if values == "bf16":
                val = torch.from_numpy(rng.standard_normal(k).astype(np.float32)).to(torch.bfloat16)
                vals.append(val.view(torch.int16).contiguous())
                v = val.float().numpy()
            else:
                v = rng.standard_normal(k).astype(np.float32)
                vals.append(torch.from_numpy(v))
            coded = torch.zeros(nbytes, dtype=torch.uint8)
            lib.hvdc_index_encode(_p(torch.from_numpy(idx)), k, n, CODES[code], low, _p(coded), nbytes)
            codes.append(coded)
            want[idx] += v
            touched[idx] = True
        if scale is not None:
            want[touched] *= np.float32(scale)
        out, ks = torch.full((n,), 7.0), torch.full((max(nr, 2),), k, dtype=torch.int64)
        s, scaled = (ctypes.c_float(0.0), 0) if scale is None else (ctypes.c_float(scale), 1)
        status = lib.hvdc_sparse_decode_sum(nr, _ptrs(codes), CODES[code], low, _p(ks), _ptrs(vals),
                                            int(values == "bf16"), n, s, scaled, _p(out))
        assert status == 0 and out.numpy().tobytes() == want.tobytes(), (n, k, nr)
        if k < 2:
            continue
        bad = codes[0].clone()

        def status_of(bad):  # the bad payload alone (the one-rank path), and after a good one (the general path)
            got = []
            for nb, cs in ((1, [bad]), (2, [codes[-1], bad])):
                got.append(lib.hvdc_sparse_decode_sum(nb, _ptrs(cs), CODES[code], low, _p(ks), _ptrs(vals[:1] * nb),
                                                      int(values == "bf16"), n, s, scaled, _p(out)))
            return got

        if code == "raw":  # out of order, then an index past n
            r = bad.view(torch.int32)
            r[[0, 1]] = r[[1, 0]].clone()
            assert status_of(bad) == [-1, -1]
            r[[0, 1]] = r[[1, 0]].clone()
            r[-1] = n
        else:  # the last set bit cleared: fewer indices than k
            area = bad[nbytes - (k + (n >> low) + 1 + 7) // 8:] if code == "elias_fano" else bad
            nz = int(torch.nonzero(area).max())
            area[nz] = 0
        assert status_of(bad) == [-2, -2], (n, k)


# --- no fresh large buffers on the hot path ------------------------------------------------------------
def _large_allocations(fn, threshold=1 << 20):
    """``(op, bytes)`` of every torch op in ``fn`` that allocates at least
    ``threshold`` bytes that outlive it (torch's profiler books a tensor's
    allocation to the op that made it, as its self CPU memory)."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return [(e.name, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage >= threshold]


def test_profiler_sees_large_allocations():
    """The check below can fail: a 4 MiB temporary is seen."""
    x = torch.randn(1 << 20)
    assert _large_allocations(lambda: x * 2.0)


@pytest.mark.parametrize("spec", ["TopK(0.01)", "Int8()", "EFSignSGD()", "SignSGD()", "OneBit()", "FP16()", "BF16()",
                                  "DGC(0.01)", "Threshold(2.0)", "TopK(0.1, values=BF16())", "TopK(0.01, values=Int8())",
                                  "Int8(block_size=4096)", "QSGD()", "TernGrad()", "RandomK(0.01)"])
def test_hot_path_allocates_no_large_buffer_after_warmup(spec):
    """compress + decompress through the real adapter flow (one-rank
    collectives), as under Horovod's optimizer: after two warm-up steps,
    neither the encode nor the decode allocates 1 MiB or more."""
    from hvd_compress.tools.bench.local import local_compressor
    comp = local_compressor(eval("hc." + spec, {"hc": hc, "Int8": hc.schemes.Int8, "BF16": hc.schemes.BF16}), "torch")
    n = 4 << 20
    grads = [torch.randn(n) for _ in range(3)]
    grad = torch.empty(n)
    for i in range(2):
        grad.copy_(grads[i])
        out, ctx = comp.compress(grad)
        comp.decompress(out, ctx)
    grad.copy_(grads[2])
    box = {}
    assert _large_allocations(lambda: box.update(r=comp.compress(grad))) == [], "encode"
    assert _large_allocations(lambda: comp.decompress(*box["r"])) == [], "decode"
    assert os.environ.get("HVDC_KERNELS", "1") != "0"


# --- the whole adapter flow, fused against eager ------------------------------------------------------
def _flow(spec, monkeypatch, fused, steps=3, n=20_000, owned=True):
    """Outputs and kept state of ``steps`` compress/decompress calls through the
    real torch adapter with one-rank collectives, fused or eager."""
    from hvd_compress.tools.bench.local import local_compressor
    monkeypatch.setenv("HVDC_KERNELS", "1" if fused else "0")
    comp = local_compressor(eval("hc." + spec, {"hc": hc, "Int8": hc.schemes.Int8, "BF16": hc.schemes.BF16}), "torch")
    adapter = comp.adapters["torch"]
    if not owned:  # a direct hvd.allreduce(t, compression=...): the caller keeps t
        info = adapter._caller_info

        def not_owned(tensor):
            from dataclasses import replace
            return replace(info(tensor), owns_input=False)
        adapter._caller_info = not_owned
    gen = torch.Generator().manual_seed(9)
    outs, inputs = [], []
    for _ in range(steps):
        g = torch.randn(n, generator=gen)
        inputs.append((g, g.clone()))
        out, ctx = comp.compress(g)
        outs.append(comp.decompress(out, ctx).clone())
    states = {name: view for name, view in adapter.memories.items()}
    states["residual"] = adapter.residuals
    kept = {name: {k: v.clone() for k, v in view.items()} for name, view in states.items()}
    return outs, kept, inputs


@pytest.mark.parametrize("spec", ["TopK(0.01)", "Int8()", "SignSGD()", "FP16()", "BF16(error_feedback=True)",
                                  "DGC(0.01)", "TopK(0.01, momentum=0.9)", "Int8(momentum=0.9, nesterov=True)",
                                  "SignSGD(momentum=0.9)", "TopK(0.05, values=Int8(), momentum=0.5)",
                                  "TernGrad(error_feedback=True)", "RandomK(0.01)"])
@pytest.mark.parametrize("owned", [True, False])
def test_adapter_flow_fused_equals_eager(spec, owned, monkeypatch):
    """Momentum in the compressor included: one pass makes u = m u + g and the
    direction, then the codec compresses direction + residual, as
    MomentumMemory does; the velocity and residual kept are the eager ones."""
    fo, fk, fin = _flow(spec, monkeypatch, fused=True, owned=owned)
    eo, ek, _ = _flow(spec, monkeypatch, fused=False, owned=owned)
    for a, b in zip(fo, eo):
        assert _same(a, b)
    assert fk.keys() == ek.keys()
    for name in ek:
        assert fk[name].keys() == ek[name].keys()
        for key in ek[name]:
            assert _same(fk[name][key], ek[name][key]), (name, key)
    if not owned:  # the caller's tensor is left as it was
        assert all(torch.equal(g, copy) for g, copy in fin)


# --- the source's other vector paths ---------------------------------------------------------------------
def _library(path):
    import ctypes
    lib = ctypes.CDLL(str(path))
    for name, (args, res) in native.SIGNATURES.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


#: flags -> the library built with them, once per test session (each build takes seconds)
_BUILT = {}


def _library_built_with(tmp_path, *flags):
    """The kernels built for this CPU with ``flags`` after the usual ones (flags after
    -march=native win, so -mno-... switches a vector extension off); built once per
    session, into the first test's ``tmp_path``."""
    import subprocess
    cc = native.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    if flags not in _BUILT:
        out = tmp_path / f"kernels{''.join(flags)}.so"
        subprocess.run([cc, *native.FLAGS, *flags, str(native.SOURCE), "-o", str(out), "-lm"],
                       check=True, capture_output=True)
        _BUILT[flags] = _library(out)
    return _BUILT[flags]


def _portable_library(tmp_path):
    """The kernels built for this CPU with its vector extensions switched off (flags after
    -march=native win): the plain-C paths a CPU without AVX2 or AVX-512 runs."""
    return _library_built_with(tmp_path, "-mno-avx512f", "-mno-avx2")


def _vector_path_results(lib, n):
    """What each kernel with a vector loop gives on one input of ``n`` elements with NaN
    and +-Inf in it: candidates, residuals, sign bits, OneBit's means, Int8 and the half
    encodes, and the decodes."""
    import ctypes
    gen = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=gen)
    x[torch.randint(0, n, (3,), generator=gen)] = torch.tensor([math.nan, math.inf, -math.inf])
    r0 = torch.randn(n, generator=gen) * 0.1
    out = {}
    for strict, nan_large in ((0, 0), (1, 1)):
        r = r0.clone()
        cand, val = torch.zeros(n, dtype=torch.int64), torch.zeros(n)
        c = lib.hvdc_compensate_select(_p(x), _p(r), n, ctypes.c_float(1.5), strict, nan_large,
                                       _p(cand), _p(val), n)
        out[f"select{strict}"] = (r, cand[:c].clone(), val[:c].clone())
        for sent in (1, 2):  # the residual as if sent: 0, or acc - float(bfloat16(acc)); with room and short of it
            for room in (n, max(1, n // 50)):
                r = r0.clone()
                c = lib.hvdc_compensate_select_sent(_p(x), _p(r), n, ctypes.c_float(1.5), strict, nan_large, sent,
                                                    ctypes.c_float(2.0), _p(cand), _p(val), room)
                out[f"select_sent{strict}{sent}{room}"] = (r, cand[:min(c, room)].clone(), val[:min(c, room)].clone())
    for mode in (0, 1):
        r, bits, scale = r0.clone(), torch.zeros((n + 7) // 8, dtype=torch.uint8), torch.zeros(1)
        lib.hvdc_sign_encode(_p(x), _p(r), n, mode, _p(bits), _p(scale))
        dec, scales = torch.empty(n), torch.cat([scale, scale * 2])  # kept alive across the call
        lib.hvdc_sign_decode_sum(2, _ptrs([bits, bits]), _p(scales), n, mode, ctypes.c_float(0.5), 1, _p(dec))
        out[f"sign{mode}"] = (r, bits, scale, dec)
    y = torch.randn(n, generator=torch.Generator().manual_seed(n + 1))  # finite: OneBit's means stay finite
    r, bits, means = r0.clone(), torch.zeros((n + 7) // 8, dtype=torch.uint8), torch.zeros(2)
    lib.hvdc_onebit_encode(_p(y), _p(r), n, _p(bits), _p(means))
    dec = torch.empty(n)
    lib.hvdc_onebit_decode_sum(1, _ptrs([bits]), _p(means), n, ctypes.c_float(1.0), 0, _p(dec))
    out["onebit"] = (r, bits, means, dec)
    for block in (5, 24, n):  # blocks shorter than a vector, of whole vectors and a tail, and one block
        for source, name in ((x, "x"), (y, "y")):  # a NaN makes its block's scale NaN
            r, q = r0.clone(), torch.zeros(n, dtype=torch.int8)
            scales = torch.zeros(max(1, -(-n // block)))
            lib.hvdc_int8_encode(_p(source), _p(r), n, block, _p(q), _p(scales))
            out[f"int8/{block}/{name}"] = (r, q, scales)
    dec = torch.empty(n)  # OneBit's decode over two ranks, scaled
    means2 = torch.cat([means, means * 3])  # held across the call
    lib.hvdc_onebit_decode_sum(2, _ptrs([bits, bits]), _p(means2), n, ctypes.c_float(0.5), 1, _p(dec))
    out["onebit2"] = (dec,)
    for room in (n + 16, max(1, n // 3)):  # Threshold's select-and-send, with room and out of it
        r, idx, val = r0.clone(), torch.zeros(n + 16, dtype=torch.int32), torch.zeros(n + 16)
        c = lib.hvdc_select_sent(_p(x), _p(r), n, ctypes.c_float(1.0), 0, _p(idx), _p(val), room)
        stored = min(c, room)
        out[f"select_sent{room > n}"] = (r, idx[:stored].clone(), val[:stored].clone(), torch.tensor([c]))
    cand, cval = out["select1"][1], out["select1"][2]
    k = max(1, cand.numel() // 2)
    kept, kval = torch.zeros(k, dtype=torch.int64), torch.zeros(k)
    if cand.numel():
        tmp = torch.empty(cand.numel())  # held: a temporary's pointer would dangle
        lib.hvdc_topk_fixup(_p(cand), _p(cval), cand.numel(), k, 1, _p(kept), _p(kval), _p(tmp))
        r, bits16 = r0.clone(), torch.zeros(k, dtype=torch.int16)
        lib.hvdc_sparse_bf16_encode(_p(kval), k, _p(kept), _p(r), _p(bits16))
        out["fixup"] = (kept, kval, r, bits16)
    for fw in (Framework.TORCH, Framework.TF):  # the randomised schemes, each framework's draws
        u = torch.empty(n)
        lib.hvdc_uniform(fw, 12345, n, _p(u))
        out[f"uniform/{fw}"] = (u,)
        for source, name in ((x, "x"), (y, "y")):
            r, q, norm = r0.clone(), torch.zeros(n, dtype=torch.int8), torch.zeros(1)
            lib.hvdc_qsgd_encode(_p(source), _p(r), n, 5, None, fw, 99, _p(q), _p(norm))
            out[f"qsgd/{fw}/{name}"] = (r, q, norm)
            r, t, scale = r0.clone(), torch.zeros((n + 3) // 4, dtype=torch.uint8), torch.zeros(1)
            lib.hvdc_terngrad_encode(_p(source), _p(r), n, None, fw, 99, _p(t), _p(scale))
            dec, scales = torch.empty(n), torch.cat([scale, scale * 2])
            lib.hvdc_terngrad_decode_sum(2, _ptrs([t, t]), _p(scales), n, ctypes.c_float(0.5), 1, _p(dec))
            out[f"terngrad/{fw}/{name}"] = (r, t, scale, dec)
    for block in (0, 5, 100):  # Lossless's byte planes: one block, blocks shorter than a step, and with a tail
        planes = torch.zeros(4 * n, dtype=torch.uint8)
        lib.hvdc_byte_shuffle(_p(x), n, block, _p(planes))
        dec = torch.full((n,), 2.0)
        lib.hvdc_byte_unshuffle_add(_p(planes), n, 0, ctypes.c_float(0.5), 1, _p(dec))
        out[f"planes/{block}"] = (planes, dec)
    for dtype in (0, 1):  # IEEE half, bfloat16
        r, h = r0.clone(), torch.zeros(n, dtype=torch.int16)
        lib.hvdc_half_encode(_p(x), _p(r), n, dtype, _p(h))
        h0 = torch.zeros(n, dtype=torch.int16)
        lib.hvdc_half_encode(_p(x), None, n, dtype, _p(h0))
        out[f"half{dtype}"] = (r, h, h0)
    return out


def _assert_same_vector_results(want, got):
    """Bit for bit, but the scales (sums whose lanes may differ: 16 under AVX-512, 8
    otherwise, compared to 1e-6) and what depends on them."""
    for key in want:
        for a, b in zip(want[key], got[key]):
            if a.dtype == torch.float32 and a.numel() <= 2:  # a scale or OneBit's means
                torch.testing.assert_close(b, a, rtol=1e-6, atol=0, equal_nan=True)
            elif (key in ("sign1", "onebit") or key.startswith("qsgd")) and a.dtype == torch.float32:
                torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, equal_nan=True)  # depends on the scale
            elif key.startswith("qsgd"):  # QSGD's levels, drawn given its norm: a level apart at most
                assert a.numel() == 0 or int((a.int() - b.int()).abs().max()) <= 1, key
            else:
                assert _same(a, b), key


@pytest.mark.parametrize("n", [1, 7, 8, 23, 4096 + 13, (1 << 16) + 5])
def test_plain_c_paths_equal_this_cpus_vector_paths(tmp_path, n):
    """Each kernel with a path per instruction set (AVX-512, AVX2, plain C) gives the same
    results from the plain path as from the one this CPU runs: candidates, residuals, sign
    bits, OneBit's means and the decodes, with NaN and +-Inf in the input.  The scales are
    sums whose lanes may differ (16 under AVX-512, 8 otherwise): compared to 1e-6."""
    here, plain = native.load(), _portable_library(tmp_path)
    assert here is not None
    _assert_same_vector_results(_vector_path_results(here, n), _vector_path_results(plain, n))


@pytest.mark.parametrize("n", [1, 7, 8, 23, 4096 + 13, (1 << 16) + 5])
def test_avx2_paths_equal_this_cpus_vector_paths(tmp_path, n):
    """The same for the AVX2 layer (the source built with -mno-avx512f), which a CPU with
    AVX-512 does not run otherwise."""
    here, avx2 = native.load(), _library_built_with(tmp_path, "-mno-avx512f")
    assert here is not None
    _assert_same_vector_results(_vector_path_results(here, n), _vector_path_results(avx2, n))


@pytest.mark.parametrize("spec, name, config", [("QSGD()", "QSGD", {"levels": 127}), ("QSGD(4)", "QSGD", {"levels": 4}),
                                                ("TernGrad()", "TernGrad", {}),
                                                ("RandomK(0.01)", "RandomK", {"ratio": 0.01})])
def test_randomised_kernels_match_the_numpy_reference(spec, name, config):
    """The fused codecs' decoded contribution against tests/reference.py (numpy, written
    from the papers), given torch's draws for the same seed: exact for TernGrad and
    Random-K; QSGD to its norm's rounding (float64 there, a level apart at most at an
    element on a rounding boundary)."""
    import reference
    n, seed = 70_001, 4242
    scheme = eval("hc.schemes." + spec)
    x = torch.randn(n, generator=torch.Generator().manual_seed(1))
    ctx = EncodeContext(key="w", step=1, rank=0, size=1, uniform=SeededDraws(B, seed, like=x), shared_seed=seed,
                        shape=(n,))
    codec = codec_for(scheme, None, x)
    payload = codec.encode(x, None, {}, ctx)
    if name == "RandomK":
        got = codec.decode_reduced(payload["reduce"], n, None, {"randomk_idx": payload["_idx"]})
        want = reference.sent(name, config, x.numpy(), indices=B.randperm_prefix(n, payload["_idx"].numel(), seed,
                                                                                  like=x).numpy())
    else:
        got = codec.aggregate([payload], n, {}, None, None, {})
        want = reference.sent(name, config, x.numpy(), uniform=torch.rand(n, generator=torch.Generator().manual_seed(seed)).numpy())
    if name == "QSGD":  # the levels, each side given its own norm
        norm_ref = np.float32(np.linalg.norm(x.numpy().astype(np.float64)))
        np.testing.assert_allclose(float(payload["norm"][0]), norm_ref, rtol=1e-6)
        lg = np.rint(got.numpy() / (float(payload["norm"][0]) / config["levels"]))
        lw = np.rint(want / (norm_ref / config["levels"]))
        assert np.abs(lg - lw).max() <= 1 and np.mean(lg != lw) < 1e-3
    else:
        assert np.array_equal(got.numpy(), want.astype(np.float32))  # the reference keeps -0.0 where a code sends 0
