"""Every scheme, on both backends (torch and TensorFlow eager), against the
independent numpy reference in ``tests/reference.py``: what a rank sends, what
one payload decodes to, what the ranks' payloads aggregate to, and the bytes
handed to collectives.  Stochastic schemes get the same uniform draws on both
sides through a recording ``ctx.uniform``.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

import reference as R
import hvd_compress
from hvd_compress import schemes as S
from unit_helpers import (CASE_IDS, CASES, FRAMEWORKS, Draws, assert_same, data, f32, framework,
                          kept_count, make_ctx, ref_name_config, wire, wire_bytes)

SIZES = (0, 1, 7, 1000, 4097)


def encode(fw, scheme, x, seed=0, shared_seed=1234):
    draws = Draws(fw, seed)
    payload, sent = scheme.encode(fw.B, fw.tensor(x), make_ctx(fw, draws, shared_seed))
    return payload, sent, draws


def topk_kept(fw, scheme, x):
    """Indices the library's Top-K keeps for ``x`` (its selection does not
    depend on ``values=``, so read it from a plain Top-K's nonzeros; the
    data has no exact zeros)."""
    plain = S.TopK(scheme.ratio)
    _, sent, _ = encode(fw, plain, x)
    return np.nonzero(fw.np(sent))[0]


def ref_sent(scheme, x, draws, payload=None, fw=None):
    name, cfg = ref_name_config(scheme)
    indices = None
    if name == "RandomK":
        indices = fw.np(payload["_idx"])
    return R.sent(name, cfg, x, uniform=list(draws.arrays), indices=indices)


def decode(fw, scheme, payload, n):
    if scheme.transport == "allreduce":
        return scheme.decode_reduced(fw.B, payload["reduce"], n, {k: v for k, v in payload.items()
                                                                   if k.startswith("_")})
    return scheme.decode_one(fw.B, wire(payload), n)


# --- encode / decode_one / bytes -------------------------------------------------------------------
@pytest.mark.parametrize("fwname", FRAMEWORKS)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("case", CASE_IDS)
def test_encode_decode_bytes(case, n, fwname):
    fw = framework(fwname)
    scheme = CASES[case]()
    x = data(n, seed=n + 17)
    payload, sent, draws = encode(fw, scheme, x, seed=n)
    if scheme.name == "TopK":
        # the library's kept set must be a valid top-k set (ties aside); then
        # the reference encodes exactly that set
        got_idx = topk_kept(fw, scheme, x)
        want_idx = R.kept_indices("TopK", scheme.config(), x)
        np.testing.assert_array_equal(np.sort(np.abs(x[got_idx])), np.sort(np.abs(x[want_idx])))
        want = R.sent("TopK", scheme.config(), x, uniform=list(draws.arrays), indices=got_idx)
    else:
        want = ref_sent(scheme, x, draws, payload, fw)
    got_sent = fw.np(sent)
    assert got_sent.dtype == np.float32 and got_sent.shape == (n,)
    assert_same(scheme, got_sent, want, "sent")
    # what another rank decodes is exactly what this rank says it sent
    dec = fw.np(decode(fw, scheme, payload, n))
    np.testing.assert_array_equal(dec, got_sent, err_msg="decode_one(payload) != sent")
    # bytes
    name, cfg = ref_name_config(scheme)
    kept = kept_count(fw, scheme, payload, sent) if name in R.VARIABLE_SIZE else None
    want_bytes = R.payload_bytes(name, cfg, n, kept=kept)
    assert wire_bytes(fw, scheme, payload) == want_bytes
    formula = scheme.payload_nbytes(n)
    if name in R.VARIABLE_SIZE:
        assert formula is None
    else:
        assert formula + (4 if scheme.transport == "allgather" else 0) == want_bytes


@pytest.mark.parametrize("fwname", FRAMEWORKS)
@pytest.mark.parametrize("case", ["int8-b100", "qsgd127", "terngrad", "efsignsgd", "onebit", "bf16",
                                  "topk1%", "topk-int8", "randomk", "threshold", "dgc", "dgc-qsgd"])
def test_one_million(case, fwname):
    fw = framework(fwname)
    scheme = CASES[case]()
    n = 1_000_003
    x = data(n, seed=5)
    payload, sent, draws = encode(fw, scheme, x, seed=9)
    got = fw.np(sent)
    if scheme.name == "TopK":
        got_idx = np.nonzero(got)[0]
        assert got_idx.size == R.k_for(scheme.ratio, n)
        thr = np.abs(x[got_idx]).min()
        assert np.count_nonzero(np.abs(x) > thr) < got_idx.size  # nothing larger was left out
        want = R.sent("TopK", scheme.config(), x, indices=got_idx)
    else:
        want = ref_sent(scheme, x, draws, payload, fw)
    assert_same(scheme, got, want, "sent at 1M")
    name, cfg = ref_name_config(scheme)
    kept = kept_count(fw, scheme, payload, sent) if name in R.VARIABLE_SIZE else None
    assert wire_bytes(fw, scheme, payload) == R.payload_bytes(name, cfg, n, kept=kept)


@pytest.mark.parametrize("fwname", FRAMEWORKS)
@pytest.mark.parametrize("case", ["int8", "qsgd4", "terngrad", "signsgd", "efsignsgd", "onebit", "topk1%",
                                  "bf16", "fp16"])
def test_zero_dim_tensor(case, fwname):
    """A 0-d gradient (a scalar parameter) flattens to one element."""
    fw = framework(fwname)
    scheme = CASES[case]()
    x0 = fw.tensor(np.array(-2.75, f32))
    x = fw.B.flatten(x0)
    assert fw.B.numel(x) == 1
    draws = Draws(fw, 3)
    payload, sent = scheme.encode(fw.B, x, make_ctx(fw, draws))
    want = R.sent(scheme.name, scheme.config(), np.array([-2.75], f32), uniform=list(draws.arrays))
    assert_same(scheme, fw.np(sent), want)


# --- aggregation over ranks -----------------------------------------------------------------------
@pytest.mark.parametrize("fwname", FRAMEWORKS)
@pytest.mark.parametrize("n", (1, 7, 1000))
@pytest.mark.parametrize("case", CASE_IDS)
def test_aggregate(case, n, fwname):
    fw, nranks = framework(fwname), 3
    scheme = CASES[case]()
    xs = [data(n, seed=100 * r + n) for r in range(nranks)]
    payloads, ref_sents = [], []
    for r, x in enumerate(xs):
        payload, _, draws = encode(fw, scheme, x, seed=r, shared_seed=77)  # shared seed: same on all ranks
        payloads.append(payload)
        ref_sents.append(ref_sent(scheme, x, draws, payload, fw))
    if scheme.transport == "allreduce":
        reduced = payloads[0]["reduce"]
        for p in payloads[1:]:
            reduced = fw.add(reduced, p["reduce"])
        local = {k: v for k, v in payloads[0].items() if k.startswith("_")}
        got = scheme.decode_reduced(fw.B, reduced, n, local)
    else:
        got = scheme.aggregate(fw.B, [wire(p) for p in payloads], n)
    want = R.aggregate(scheme.name, ref_sents)
    assert_same(scheme, fw.np(got), want, "aggregate")


@pytest.mark.parametrize("fwname", FRAMEWORKS)
def test_signsgd_vote(fwname):
    """Majority vote: zero votes +, a tie between two ranks gives 0."""
    fw = framework(fwname)
    scheme = S.SignSGD()
    xs = [np.array([1, -1, 0, -3, 2], f32), np.array([2, 1, -1, -1, 0], f32)]
    payloads = [scheme.encode(fw.B, fw.tensor(x), make_ctx(fw, Draws(fw, 0)))[0] for x in xs]
    got = fw.np(scheme.aggregate(fw.B, payloads, 5))
    np.testing.assert_array_equal(got, [1, 0, 0, -1, 1])
    np.testing.assert_array_equal(got, R.aggregate("SignSGD", [R.sent("SignSGD", {}, x) for x in xs]))
    assert scheme.apply_op_scale is False


@pytest.mark.parametrize("fwname", FRAMEWORKS)
def test_int8_rounds_half_to_even(fwname):
    fw = framework(fwname)
    x = np.array([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -126.5, 3.49], f32)  # scale is exactly 1
    payload, sent, _ = encode(fw, S.Int8(), x)
    np.testing.assert_array_equal(fw.np(payload["q"]), [127, 0, 2, 2, 0, -2, -126, 3])
    np.testing.assert_array_equal(fw.np(sent), R.sent("Int8", {}, x))


@pytest.mark.parametrize("fwname", FRAMEWORKS)
def test_bf16_round_to_nearest_even(fwname):
    fw = framework(fwname)
    bits = np.array([0x3F808000, 0x3F818000, 0x3F80FFFF, 0x7F7FFFFF, 0x00008000, 0xBF808001], np.uint32)
    x = bits.view(f32)
    payload, sent, _ = encode(fw, S.BF16(), x)
    want = np.array([0x3F80, 0x3F82, 0x3F81, 0x7F80, 0x0000, 0xBF81], np.uint16).view(np.int16)
    np.testing.assert_array_equal(fw.np(payload["bits"]), want)
    np.testing.assert_array_equal(R.bf16_bits(x), want)
    np.testing.assert_array_equal(fw.np(sent), R.bf16_round(x))


@pytest.mark.parametrize("fwname", FRAMEWORKS)
@pytest.mark.parametrize("n", (1, 7, 100, 4097))
@pytest.mark.parametrize("ratio", (0.001, 0.01, 0.07, 0.5, 1.0))
def test_topk_keeps_exactly_the_k_largest(ratio, n, fwname):
    fw = framework(fwname)
    rng = np.random.default_rng(n)
    # distinct magnitudes, so the top-k set is unique
    x = ((rng.permutation(n) + 1).astype(f32) * rng.choice([-1, 1], n).astype(f32)) / f32(n)
    payload, sent, _ = encode(fw, S.TopK(ratio), x)
    kept = np.nonzero(fw.np(sent))[0]
    k = R.k_for(ratio, n)
    assert kept.size == k
    np.testing.assert_array_equal(kept, np.sort(np.argsort(-np.abs(x))[:k]))
    np.testing.assert_array_equal(fw.np(sent)[kept], x[kept])


@pytest.mark.parametrize("fwname", FRAMEWORKS)
@pytest.mark.parametrize("case", ["threshold", "threshold-int8b", "threshold-tern", "threshold-bf16",
                                  "dgc", "dgc-qsgd", "dgc-onebit"])
def test_variable_parts_declared(case, fwname):
    """Every part whose length depends on the data is declared variable, so
    the transport sends its length (else ranks would split the gathered
    buffer at the wrong places)."""
    fw = framework(fwname)
    scheme = CASES[case]()
    lengths = []
    for seed, scale in ((1, 1.0), (2, 3.0), (3, 0.01)):
        payload, _, _ = encode(fw, scheme, data(1000, seed) * f32(scale), seed=seed)
        lengths.append({p: int(np.asarray(fw.np(t)).size) for p, t in wire(payload).items()})
    for part in lengths[0]:
        if len({ln[part] for ln in lengths}) > 1:
            assert part in scheme.variable_parts, (part, lengths)


@pytest.mark.parametrize("fwname", FRAMEWORKS)
def test_randomk_indices_shared_and_distinct(fwname):
    fw = framework(fwname)
    scheme = S.RandomK(0.05)
    a, _, _ = encode(fw, scheme, data(4097, 1), seed=1, shared_seed=99)
    b, _, _ = encode(fw, scheme, data(4097, 2), seed=2, shared_seed=99)
    c, _, _ = encode(fw, scheme, data(4097, 1), seed=1, shared_seed=100)
    ia, ib, ic = (fw.np(p["_idx"]) for p in (a, b, c))
    np.testing.assert_array_equal(ia, ib)
    assert ia.size == R.k_for(0.05, 4097) == np.unique(ia).size
    assert ia.min() >= 0 and ia.max() < 4097
    assert not np.array_equal(ia, ic)


# --- bad input ---------------------------------------------------------------------------------------
RANGE_ERRORS = [
    (lambda: S.TopK(0), "ratio", r"\(0(\.0)?, 1(\.0)?\]"),
    (lambda: S.TopK(1.5), "ratio", r"\(0(\.0)?, 1(\.0)?\]"),
    (lambda: S.TopK(-0.1), "ratio", r"\(0(\.0)?, 1(\.0)?\]"),
    (lambda: S.TopK("0.1"), "ratio", r"\(0(\.0)?, 1(\.0)?\]"),
    (lambda: S.TopK(float("nan")), "ratio", r"\(0(\.0)?, 1(\.0)?\]"),
    (lambda: S.RandomK(0.0), "ratio", r"\(0(\.0)?, 1(\.0)?\]"),
    (lambda: S.RandomK(2), "ratio", r"\(0(\.0)?, 1(\.0)?\]"),
    (lambda: S.DGC(0), "ratio", r"\(0(\.0)?, 1(\.0)?\]"),
    (lambda: S.DGC(0.01, sample_ratio=0), "sample_ratio", r"\(0(\.0)?, 1(\.0)?\]"),
    (lambda: S.DGC(0.01, sample_ratio=1.01), "sample_ratio", r"\(0(\.0)?, 1(\.0)?\]"),
    (lambda: S.QSGD(0), "levels", r"\[1, 127\]"),
    (lambda: S.QSGD(-4), "levels", r"\[1, 127\]"),
    (lambda: S.QSGD(128), "levels", r"\[1, 127\]"),
    (lambda: S.QSGD(4.5), "levels", r"\[1, 127\]"),
    (lambda: S.QSGD(True), "levels", r"\[1, 127\]"),
    (lambda: S.Int8(block_size=0), "block_size", r"\[1, inf\)"),
    (lambda: S.Int8(block_size=-8), "block_size", r"\[1, inf\)"),
    (lambda: S.Int8(block_size=2.5), "block_size", r"\[1, inf\)"),
    (lambda: S.Threshold(0), "tau", r"\(0(\.0)?, inf\)"),
    (lambda: S.Threshold(-1e-3), "tau", r"\(0(\.0)?, inf\)"),
    (lambda: hvd_compress.TopK(2.0), "ratio", r"\(0(\.0)?, 1(\.0)?\]"),
    (lambda: hvd_compress.QSGD(levels=0), "levels", r"\[1, 127\]"),
]


@pytest.mark.parametrize("make,param,rng", RANGE_ERRORS,
                         ids=[f"{p}-{i}" for i, (_, p, _) in enumerate(RANGE_ERRORS)])
def test_bad_parameters_name_the_range(make, param, rng):
    with pytest.raises(ValueError) as e:
        make()
    msg = str(e.value)
    assert param in msg and re.search(rng, msg), msg


NOT_QUANTIZERS = [
    ("topk-in-topk", lambda: S.TopK(0.1, values=S.TopK(0.5))),
    ("dgc-in-threshold", lambda: S.Threshold(1.0, values=S.DGC(0.1))),
    ("threshold-in-dgc", lambda: S.DGC(0.1, values=S.Threshold(1.0))),
    ("randomk", lambda: S.TopK(0.1, values=S.RandomK(0.5))),
    ("fp16-allreduce", lambda: S.TopK(0.1, values=S.FP16())),
    ("none", lambda: S.TopK(0.1, values=S.NoCompression())),
    ("string", lambda: S.TopK(0.1, values="Int8")),
    ("class", lambda: S.TopK(0.1, values=S.Int8)),
    ("compressor-of-topk", lambda: hvd_compress.TopK(0.1, values=hvd_compress.TopK(0.5))),
]


@pytest.mark.parametrize("make", [m for _, m in NOT_QUANTIZERS], ids=[i for i, _ in NOT_QUANTIZERS])
def test_values_must_be_a_quantizer(make):
    with pytest.raises(ValueError, match="values"):
        make()


def test_values_accepts_quantizers():
    for q in (S.Int8(), S.Int8(block_size=64), S.QSGD(8), S.TernGrad(), S.BF16(), S.OneBit(), S.EFSignSGD()):
        for cls in (S.TopK, S.Threshold, S.DGC):
            assert cls(values=q).values is q
    assert hvd_compress.TopK(0.1, values=hvd_compress.Int8()).scheme.values.name == "Int8"


def test_unknown_things():
    with pytest.raises(ValueError, match="scheme"):
        hvd_compress.Compressor("TopK")
    with pytest.raises(ValueError, match="error_feedback"):
        hvd_compress.Compressor(S.TopK(), error_feedback="yes")
    with pytest.raises(ValueError, match="seed"):
        hvd_compress.Compressor(S.TopK(), seed=-1)
    with pytest.raises(TypeError):  # an unknown keyword is Python's TypeError
        hvd_compress.TopK(0.1, ratoi=0.2)


# --- DGC's kept fraction: the sampled threshold's floor ------------------------------------------------
@pytest.mark.parametrize("n, low, high", [(4096, 0.003, 0.0055), (12288, 0.003, 0.0050), (100_000, 0.0008, 0.0014)])
def test_dgc_keeps_about_one_over_the_sample_size_where_the_sample_cannot_resolve_its_ratio(n, low, high):
    """DGC(0.001)'s sample holds max(1% of n, 256) elements; under 100k elements a
    0.1% quantile of it is its maximum, so about n / 257 elements pass (0.4%), as
    the docstring of hvd_compress.schemes.DGC says; at 100k the sample (1000) resolves 0.1%."""
    fw = framework("torch")
    rng = np.random.default_rng(n)
    kept = [np.count_nonzero(fw.np(encode(fw, S.DGC(0.001), rng.standard_normal(n).astype(f32), seed=s)[1])) / n
            for s in range(40)]
    assert low < np.mean(kept) < high


@pytest.mark.parametrize("shape, matrix", [
    ((64, 32, 3, 3), (64, 288)),      # a PyTorch conv weight (out, in, kh, kw): after the first dimension
    ((3, 3, 32, 64), (288, 64)),      # a TensorFlow conv kernel (kh, kw, in, out): before the last
    ((128, 64), (128, 64)),           # a matrix is itself
    ((4, 3, 4), (4, 12)),             # a tie in the shorter side keeps the first split
    ((7,), None),
])
def test_powersgd_matrix_shape_takes_the_split_with_the_longer_short_side(shape, matrix):
    scheme = hvd_compress.PowerSGD(4).scheme
    assert scheme.matrix_shape(shape) == matrix
    if matrix is not None and len(shape) == 4:
        # both layouts of the same 3x3 conv compress: neither falls back to a dense allreduce
        assert scheme.transport_for(shape) == "powersgd"
