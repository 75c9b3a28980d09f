"""The fused TensorFlow ops (hvd_compress.codecs.tf_fused) against the eager TF
schemes, which are the reference: the same payload bytes, the same residual
and the same decoded sum, bit for bit, over hypothesis-drawn sizes (0, 1,
odd, large) and several steps of error feedback, with the encode inside a
``tf.function`` as Horovod runs it; and the adapter's whole flow (compress,
decompress, the residual variable) with the kernels on and off."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

tf = pytest.importorskip("tensorflow")

import hvd_compress as hc  # noqa: E402
from hvd_compress.backend import backend_for  # noqa: E402
from hvd_compress.kernels import tf_native  # noqa: E402
from hvd_compress.codecs.tf_fused import codec_for, fused_topk_plan  # noqa: E402
from hvd_compress.feedback.memory import ResidualMemory, finite_or_zero  # noqa: E402
from hvd_compress.schemes.base import EncodeContext, SeededDraws  # noqa: E402

pytestmark = pytest.mark.skipif(tf_native.load() is None, reason="the TF op library did not build")

B = backend_for(tf.zeros([1]))

SCHEMES = {
    "int8": lambda: hc.schemes.Int8(),
    "int8-b100": lambda: hc.schemes.Int8(block_size=100),
    "int8-b1": lambda: hc.schemes.Int8(block_size=1),
    "topk1%": lambda: hc.schemes.TopK(0.01),
    "topk-raw": lambda: hc.schemes.TopK(0.02, index_coding="raw"),
    "topk-bitmap": lambda: hc.schemes.TopK(0.1, index_coding="bitmap"),
    "topk-ef": lambda: hc.schemes.TopK(0.05, index_coding="elias_fano"),
    "topk-bf16": lambda: hc.schemes.TopK(0.1, values=hc.schemes.BF16()),
    "threshold": lambda: hc.schemes.Threshold(1.5),
    "dgc": lambda: hc.schemes.DGC(0.01, sample_ratio=0.1),
    "signsgd": lambda: hc.schemes.SignSGD(),
    "efsignsgd": lambda: hc.schemes.EFSignSGD(),
    "onebit": lambda: hc.schemes.OneBit(),
    "fp16": lambda: hc.schemes.FP16(),
    "bf16": lambda: hc.schemes.BF16(),
    "qsgd4": lambda: hc.schemes.QSGD(4),  # the same ops as QSGD(): one level count keeps the traces few
    "terngrad": lambda: hc.schemes.TernGrad(),
    "randomk1%": lambda: hc.schemes.RandomK(0.01),  # TF has one index path at every ratio (torch's tests: two)
}
#: payload parts that are reductions over the tensor (EFSignSGD's l1 scale, OneBit's
#: two means): the kernel sums in double, TF in float32 in its own order, so they agree
#: to rounding, not bit for bit; the element-wise rest is checked given the fused value
REDUCTIONS = {"efsignsgd": "scale", "onebit": "means", "qsgd4": "norm"}
SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True, max_examples=8)


class _Residuals:
    """What the codecs ask of the TF adapter: the residual variable of a key."""

    def __init__(self):
        self.vars = {}

    def residual_variable(self, key):
        return self.vars[key]


def _ctx(n, step, rank, size):
    # the adapters' draws: the fused ops draw TF's stateless stream for the seed themselves
    seed = tf.constant(1000 * step + rank, tf.int64)
    return EncodeContext(key=f"w{rank}", step=step, rank=rank, size=size, uniform=SeededDraws(B, seed, None),
                         shared_seed=tf.constant(step, tf.int64), shape=(n,))


def _bytes(t):
    return tf.io.serialize_tensor(t).numpy()


def _sorted_pairs(p):
    order = np.argsort(p["idx"].numpy(), kind="stable")
    return p["idx"].numpy()[order], p["val"].numpy()[order]


def _assert_payloads_equal(pe, pf, raw_topk, reduction=None):
    assert sorted(pe) == sorted(pf)
    if reduction is not None:
        np.testing.assert_allclose(pf[reduction].numpy(), pe[reduction].numpy(), rtol=1e-5, atol=0)
        pe = {k: v for k, v in pe.items() if k != reduction}
    if raw_topk:  # tf.math.top_k leaves the raw indices unsorted: compared as (index, value) pairs
        (ie, ve), (i_f, vf) = _sorted_pairs(pe), _sorted_pairs(pf)
        assert pe["idx"].dtype == pf["idx"].dtype and np.array_equal(ie, i_f)
        assert ve.tobytes() == vf.tobytes()
        return
    for part in pe:
        if part == "_idx":  # Random-K's indices, kept locally (int32 from top_k, int64 from the op)
            assert np.array_equal(pe[part].numpy(), pf[part].numpy())
            continue
        assert _bytes(pe[part]) == _bytes(pf[part]), part


class _GivenNorm:
    """The TF backend with ``norm`` answered by a given value: QSGD's eager graph given the
    kernel's norm."""

    def __init__(self, norm):
        self.value = norm

    def norm(self, x):
        return self.value

    def __getattr__(self, name):
        return getattr(B, name)


def _qsgd_given(scheme, ctx, n):
    @tf.function(input_signature=[tf.TensorSpec([n], tf.float32), tf.TensorSpec([], tf.float32)])
    def encode(acc, norm):
        payload, sent = scheme.encode(_GivenNorm(norm), acc, ctx)
        return payload, finite_or_zero(B, acc - sent)
    return encode


def _given_fused_scale(name, pe, pf, acc, ef, given=None):
    """The eager payload and residual of EFSignSGD, OneBit or QSGD (``given``: its traced
    encode given a norm), with the fused reduction."""
    part = REDUCTIONS[name]
    if name.startswith("qsgd"):
        pe, residual = given(acc, tf.reshape(pf[part], []))
        return pe, (residual if ef else None)
    pe = {**pe, part: pf[part]}
    if name == "efsignsgd":
        sent = tf.where(acc >= 0, 1.0, -1.0) * pf[part][0]
    else:
        pos = tf.cast(acc >= 0, tf.float32)
        sent = pos * pf[part][0] + (1.0 - pos) * pf[part][1]
    return pe, (finite_or_zero(B, acc - sent) if ef else None)


def _encoder(codec, residual, n, ctx):
    """The codec's encode in a tf.function, reading the residual first as the adapter does."""
    @tf.function(input_signature=[tf.TensorSpec([n], tf.float32)])
    def encode(x):
        r = residual.read_value() if residual is not None else None
        return codec.encode(x, r, {}, ctx)
    return encode


def _reference(scheme, n, ctx):
    """The eager scheme's error feedback, traced as Horovod traces it: TF's graph
    optimizer then turns Int8's amax / 127 into amax * (1 / 127), which the
    fused op reproduces (op by op, outside a tf.function, the division stays)."""
    @tf.function(input_signature=[tf.TensorSpec([n], tf.float32)])
    def encode(acc):
        payload, sent = scheme.encode(B, acc, ctx)
        return payload, finite_or_zero(B, acc - sent)
    return encode


def _run_steps(name, n, ranks, steps, seed, ef, scale):
    scheme = SCHEMES[name]()
    rng = np.random.default_rng(seed)
    store = _Residuals()
    res_e = [tf.constant(rng.standard_normal(n, dtype=np.float32) * 0.1) if ef else None for _ in range(ranks)]
    for rank, r in enumerate(res_e):
        if r is not None:
            store.vars[f"w{rank}"] = tf.Variable(r)
    codec = codec_for(scheme, ResidualMemory() if ef else None, tf.zeros([n]), store)
    if codec is None:  # only Top-K keeping over an eighth of the elements, and FP16 without EF, run eager
        assert (isinstance(scheme, hc.schemes.TopK) and 8 * scheme.fixed_k(n) > n) or (name == "fp16" and not ef)
        return
    raw_topk = isinstance(scheme, hc.schemes.TopK) and scheme.index_code(n) == "raw"
    encoders = [_encoder(codec, store.vars.get(f"w{rank}"), n, _ctx(n, 1, rank, ranks)) for rank in range(ranks)]
    references = [_reference(scheme, n, _ctx(n, 1, rank, ranks)) for rank in range(ranks)]
    givens = [_qsgd_given(scheme, _ctx(n, 1, rank, ranks), n) if name.startswith("qsgd") else None
              for rank in range(ranks)]
    for step in range(1, steps + 1):
        pes, pfs = [], []
        for rank in range(ranks):
            x = tf.constant(rng.standard_normal(n, dtype=np.float32))
            acc = x if res_e[rank] is None else x + res_e[rank]
            pe, new_residual = references[rank](acc)
            pf = encoders[rank](x)
            if name.startswith("qsgd"):  # the levels drawn given the kernel's norm
                np.testing.assert_allclose(pf["norm"].numpy(), pe["norm"].numpy(), rtol=1e-4, atol=0)
                pe, new_residual = _given_fused_scale(name, pe, pf, acc, ef, givens[rank])
            _assert_payloads_equal(pe, pf, raw_topk, REDUCTIONS.get(name))
            if name in REDUCTIONS and not name.startswith("qsgd"):
                pe, new_residual = _given_fused_scale(name, pe, pf, acc, ef)
            if ef:
                res_e[rank] = new_residual
                got = store.vars[f"w{rank}"]
                assert _bytes(res_e[rank]) == _bytes(got.read_value()), f"residual of rank {rank} at step {step}"
            pes.append(pe)
            pfs.append(pf)
        _assert_decodes_equal(scheme, codec, pes, pfs, n, scale)


def _assert_decodes_equal(scheme, codec, pes, pfs, n, scale):
    if scheme.transport == "allreduce":  # FP16, Random-K: Horovod sums the payloads; the decode places them
        reduced = tf.reduce_sum(tf.stack([p["reduce"] for p in pfs]), axis=0)
        ws = {"randomk_idx": pfs[0].get("_idx")}  # Random-K: the indices its encode left there
        want = scheme.decode_reduced(B, reduced, n, pes[0])
        assert _bytes(codec.decode_reduced(reduced, n, None, ws)) == _bytes(want)
        return
    if not scheme.apply_op_scale:  # SignSGD: a vote, never scaled
        assert _bytes(codec.aggregate(pfs, n, {}, None, None, {})) == _bytes(scheme.aggregate(B, pes, n))
        assert _bytes(codec.aggregate(pes, n, {}, None, None, {})) == _bytes(scheme.aggregate(B, pfs, n))
        return
    s = tf.constant(scale, tf.float32)
    want = scheme.aggregate(B, pes, n) * s
    assert _bytes(codec.aggregate(pfs, n, {}, s, None, {})) == _bytes(want)
    # eager payloads decoded by the fused op (receivers cannot tell), and the other way round
    assert _bytes(codec.aggregate(pes, n, {}, s, None, {})) == _bytes(want)
    assert _bytes(scheme.aggregate(B, pfs, n) * s) == _bytes(want)
    assert _bytes(codec.aggregate(pfs, n, {}, None, None, {})) == _bytes(scheme.aggregate(B, pes, n))


@pytest.mark.parametrize("name", sorted(SCHEMES))
@settings(**SETTINGS)
@given(n=st.one_of(st.sampled_from([0, 1, 2, 7, 9, 16, 17, 33, 1000, 4097]), st.integers(0, 6000)),
       ranks=st.integers(1, 3), seed=st.integers(0, 2**16), ef=st.booleans(),
       scale=st.sampled_from([1.0, 0.5, 1 / 3]))
def test_fused_equals_eager(name, n, ranks, seed, ef, scale):
    if n == 0 and name.startswith(("topk", "efsignsgd", "randomk")):
        n = 1  # the eager reference has no meaning for an empty top-k or l1 scale
    _run_steps(name, n, ranks, steps=3, seed=seed, ef=ef, scale=scale)


@pytest.mark.parametrize("name", ["int8", "int8-b100", "topk1%", "topk-ef", "topk-bf16", "threshold", "dgc", "signsgd",
                                  "efsignsgd", "onebit", "bf16", "fp16"])
def test_fused_equals_eager_large(name):
    """Sizes where the Top-K sample is strided and the vector loops dominate."""
    _run_steps(name, (1 << 18) + 77, ranks=2, steps=3, seed=5, ef=True, scale=0.5)


@pytest.mark.parametrize("case", ["ties", "sample_overshoots", "sample_far_above", "all_zero"])
def test_topk_exact_up_to_ties(case):
    """Exactly k kept, the largest magnitudes, even where the sample misses;
    what was sent plus the residual is the compensated gradient."""
    n = (1 << 18) + 3
    x = np.random.default_rng(3).standard_normal(n, dtype=np.float32)
    scheme = hc.schemes.TopK(0.01, index_coding="raw")
    k = scheme.fixed_k(n)
    if case == "ties":
        x = np.round(x * 3)
    elif case == "sample_overshoots":  # the threshold is lowered once
        x[::fused_topk_plan(n, k)[0]] *= 3
    elif case == "sample_far_above":  # lowered three times, then every element is a candidate
        x[::fused_topk_plan(n, k)[0]][:1000] = 1e30  # the threshold, and fewer than k above thr / 64
    else:
        x[:] = 0
    store = _Residuals()
    store.vars["w0"] = tf.Variable(tf.zeros([n]))
    p = codec_for(scheme, ResidualMemory(), tf.zeros([n]), store).encode(tf.constant(x), tf.zeros([n]), {},
                                                                        _ctx(n, 1, 0, 1))
    idx = p["idx"].numpy()
    assert len(np.unique(idx)) == k
    a, kept = np.abs(x), np.zeros(n, bool)
    kept[idx] = True
    assert a[kept].min() >= a[~kept].max()
    sent = np.zeros(n, np.float32)
    sent[idx] = p["val"].numpy()
    assert np.array_equal(sent + store.vars["w0"].numpy(), x)


@pytest.mark.parametrize("spec", ["Int8()", "TopK(0.01)", "Int8(block_size=4096)", "TopK(0.01, index_coding='raw')",
                                  "SignSGD()", "BF16()", "FP16(error_feedback=True)",
                                  # momentum-aware error feedback (MomentumMemory), and momentum without it
                                  "TopK(0.01, momentum=0.9)", "Int8(momentum=0.9, nesterov=True)",
                                  "EFSignSGD(momentum=0.9)", "SignSGD(momentum=0.9)", "FP16(momentum=0.9)",
                                  "OneBit()", "OneBit(momentum=0.9)", "TernGrad(error_feedback=True)",
                                  "RandomK(0.01)"])
def test_adapter_flow_fused_equals_eager(spec, monkeypatch):
    """compress + decompress through the TF adapter in a tf.function (one-rank
    collectives), kernels on and off (HVDC_KERNELS=0): the same gradients and
    the same residual and velocity variables after every step.  With a momentum,
    the fused path is the adapter's ``fused_momentum`` then the codec."""
    from hvd_compress.tools.bench.local import BENCH_KEY, local_compressor
    n = 100_003
    grads = [tf.constant(np.random.default_rng(i).standard_normal(n, dtype=np.float32)) for i in range(4)]
    results = {}
    for kernels in ("1", "0"):
        monkeypatch.setenv("HVDC_KERNELS", kernels)
        comp = local_compressor(eval("hc." + spec, {"hc": hc}), "tensorflow")

        @tf.function
        def step(g):
            out, ctx = comp.compress(g)
            return comp.decompress(out, ctx)
        outs = [step(g).numpy() for g in grads]
        adapter = comp.adapters["tensorflow"]
        residual = adapter.roles.store.residual_variable(BENCH_KEY)  # None without error feedback
        velocity = adapter.roles.store.params.of(BENCH_KEY).get_memory("momentum")  # None without a momentum
        results[kernels] = (outs, None if residual is None else residual.numpy(),
                            None if velocity is None else velocity.numpy())
        graph_ops = {op.type for op in step.get_concrete_function(grads[0]).graph.get_operations()}
        assert any(t.startswith("Hvdc") for t in graph_ops) == (kernels == "1"), graph_ops
    (fo, fr, fv), (eo, er, ev) = results["1"], results["0"]
    if spec.startswith(("EFSignSGD", "OneBit")):
        # its scale, mean |acc| (OneBit: the two means), is summed in another order by the kernel (as in test_fused_equals_eager):
        # equal to an ulp or so; the velocity, which does not depend on it, stays bit for bit
        for a, b in zip(fo + [fr], eo + [er]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        fo, eo, fr, er = [], [], None, None
    for a, b in zip(fo, eo):
        assert a.tobytes() == b.tobytes()
    assert (fr is None) == (er is None) and (fr is None or fr.tobytes() == er.tobytes())
    assert (fv is None) == ("momentum" not in spec) and (ev is None) == (fv is None)
    assert fv is None or (fv.tobytes() == ev.tobytes() and np.abs(fv).sum() > 0)


def test_codec_is_off_where_it_does_not_apply(monkeypatch):
    x = tf.zeros([1000])
    assert codec_for(hc.schemes.TopK(0.5), ResidualMemory(), x, _Residuals()) is None  # k > n / 8
    assert codec_for(hc.schemes.TopK(0.01, values=hc.schemes.Int8()), None, x, _Residuals()) is None
    assert codec_for(hc.schemes.PowerSGD(2), None, x, _Residuals()) is None
    assert codec_for(hc.schemes.FP16(), None, x, _Residuals()) is None  # TF's cast is one pass already
    assert codec_for(hc.schemes.FP16(), ResidualMemory(), x, _Residuals()) is not None
    assert codec_for(hc.schemes.TopK(0.01), hc.MomentumMemory(0.9), x, _Residuals()) is not None
    assert codec_for(hc.schemes.TopK(0.01), hc.DGCMemory(), x, _Residuals()) is None  # masks u by what was sent
    assert codec_for(hc.schemes.Int8(), None, tf.zeros([10], tf.float16), _Residuals()) is None
    assert codec_for(hc.schemes.Int8(), None, x, _Residuals()) is not None
    monkeypatch.setenv("HVDC_KERNELS", "0")
    assert codec_for(hc.schemes.Int8(), None, x, _Residuals()) is None


@pytest.mark.parametrize("name", ["int8", "topk1%", "efsignsgd", "onebit", "bf16", "qsgd4", "terngrad", "randomk1%"])
def test_non_finite_values_never_reach_the_residual(name):
    """NaN and +-Inf in the gradient: sent (as an uncompressed gradient would
    be), never kept in the residual, which stays finite."""
    n = 4096
    x = np.random.default_rng(1).standard_normal(n, dtype=np.float32)
    x[[3, 100, 2000]] = [np.nan, np.inf, -np.inf]
    scheme = SCHEMES[name]()
    store = _Residuals()
    store.vars["w0"] = tf.Variable(tf.zeros([n]))
    codec = codec_for(scheme, ResidualMemory(), tf.zeros([n]), store)
    _encoder(codec, store.vars["w0"], n, _ctx(n, 1, 0, 1))(tf.constant(x))
    r = store.vars["w0"].numpy()
    assert np.isfinite(r).all()
    assert (r[[3, 100, 2000]] == 0).all()


@pytest.mark.parametrize("scheme, fused", [("Int8()", True), ("TopK(0.01)", True), ("EFSignSGD()", True),
                                           ("FP16()", True), ("QSGD()", True), ("RandomK(0.01)", True),
                                           ("PowerSGD(2)", False)])
@pytest.mark.parametrize("kernels", ["1", "0"])
def test_auto_times_what_the_step_runs(scheme, fused, kernels, monkeypatch):
    """Auto's TF codec timing (calibration) runs the fused ops where the
    transports would use them, and the eager scheme code elsewhere."""
    from hvd_compress.auto import tf_auto as auto_tf
    from hvd_compress.backend import backend_for
    monkeypatch.setenv("HVDC_KERNELS", kernels)
    n, shape = 64 * 64, (64, 64)
    fn = auto_tf._fused_or_eager_fn(backend_for(tf.zeros([1])), eval("hc.schemes." + scheme, {"hc": hc}), n, shape,
                                    2, True)
    x = tf.constant(np.random.default_rng(0).standard_normal(n, dtype=np.float32))
    result = fn(x, tf.zeros_like(x))
    assert np.all(np.isfinite(result.numpy()))
    graph = fn.get_concrete_function(x, tf.zeros_like(x)).graph.as_graph_def()
    # the repetitions run in a loop: its body is a function of the graph's library
    graph_ops = {node.op for node in graph.node} | {node.op for f in graph.library.function for node in f.node_def}
    assert any(t.startswith("Hvdc") for t in graph_ops) == (fused and kernels == "1"), graph_ops


def _address(t):
    """The tensor's buffer (by DLPack, which shares it; numpy() may copy)."""
    import torch.utils.dlpack
    return torch.utils.dlpack.from_dlpack(tf.experimental.dlpack.to_dlpack(t)).data_ptr()


@pytest.mark.parametrize("name", ["int8", "topk1%", "efsignsgd", "bf16"])
def test_decode_output_is_reused_only_when_nobody_holds_it(name):
    """A decode keeps its output buffer across calls (a fresh 64 MB output faulted in every
    page on each call), but a result the caller still holds is never overwritten: the next
    call then writes a new buffer."""
    n = 50_000
    scheme = SCHEMES[name]()
    codec = codec_for(scheme, None, tf.zeros([n]), _Residuals())
    xs = [tf.constant(np.random.default_rng(i).standard_normal(n, dtype=np.float32)) for i in range(3)]
    payloads = [_encoder(codec, None, n, _ctx(n, 1, 0, 1))(x) for x in xs]

    @tf.function
    def decode(p):
        return codec.aggregate([p], n, {}, tf.constant(1.0), None, {})
    held = decode(payloads[0])
    held_values = held.numpy().copy()
    other = decode(payloads[1])  # `held` is still referenced: a new buffer
    assert _address(other) != _address(held)
    np.testing.assert_array_equal(held.numpy(), held_values)
    address = _address(other)
    del other
    # a tensor of the same size now: a freed output buffer would be handed to it, a kept one is not
    blocker = tf.random.normal([n])
    again = decode(payloads[2])  # nothing holds the last output: the same buffer again
    assert _address(again) == address != _address(blocker)
    np.testing.assert_array_equal(held.numpy(), held_values)


@pytest.mark.parametrize("seed", [0, 5, 2**31 - 1, 2**31, 123456789012345, 2**63 - 1])
def test_kernel_draws_are_tf_stateless_uniform(seed):
    """The kernels draw TF's own numbers for a seed (Philox4x32-10 keyed from the pair
    (seed // 2^31, seed % 2^31)), across their 624-draw blocks, as B.uniform gives them."""
    from hvd_compress.kernels import native
    from hvd_compress.kernels.constants import Framework
    lib = native.load()
    for n in (1, 623, 624, 625, 5000):
        u = np.empty(n, np.float32)
        lib.hvdc_uniform(Framework.TF, seed, n, u.ctypes.data)
        assert u.tobytes() == B.uniform(n, tf.constant(seed, tf.int64)).numpy().tobytes(), n


@pytest.mark.parametrize("n,k", [(10, 10), (1000, 500), (5000, 50), (100_000, 1000), (1 << 20, 1 << 13)])
def test_randomk_indices_are_tf_randperm_prefix(n, k):
    """Random-K's shared indices from the kernel are the TF backend's (the k largest
    stateless draws, ties to the lower index, ascending), index for index."""
    from hvd_compress.kernels import native
    lib = native.load()
    room = k + n // 64 + 4096
    idx, keys = np.empty(room, np.int64), np.empty(room, np.uint32)
    for seed in (1, 12345, 2**40 + 3):
        lib.hvdc_randomk_indices_tf(seed, n, k, idx.ctypes.data, keys.ctypes.data)
        assert np.array_equal(idx[:k], B.randperm_prefix(n, k, tf.constant(seed, tf.int64)).numpy()), seed


@pytest.mark.parametrize("floor_scale", ["0.5", "1e6"])
def test_randomk_indices_tf_when_the_floor_misses(tmp_path, floor_scale):
    """The kernel's floor aims at a few more than k draws; where it holds fewer than k
    (a scale below 1) or more than the room (a huge scale), the histogram pass places it
    and the indices are still TF's, index for index."""
    import ctypes
    import subprocess
    from hvd_compress.kernels import native
    cc = native.compiler()
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp_path / "kernels_floor.so"
    subprocess.run([cc, *native.FLAGS, f"-DHVDC_RANDOMK_TF_FLOOR_SCALE={floor_scale}", str(native.SOURCE), "-o",
                    str(out), "-lm"], check=True, capture_output=True)
    lib = ctypes.CDLL(str(out))
    fn = lib.hvdc_randomk_indices_tf
    fn.argtypes, fn.restype = native.SIGNATURES["hvdc_randomk_indices_tf"]
    for n, k in ((5000, 50), (100_000, 1000), (1 << 16, 1 << 15)):
        room = k + n // 64 + 4096
        idx, keys = np.empty(room, np.int64), np.empty(room, np.uint32)
        fn(77, n, k, idx.ctypes.data, keys.ctypes.data)
        assert np.array_equal(idx[:k], B.randperm_prefix(n, k, tf.constant(77, tf.int64)).numpy()), (n, k)
