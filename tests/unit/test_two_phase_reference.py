"""tests/two_phase_reference.py (the two-phase oracle of the Horovod tests) checked on its
own, and against the library's two-phase code path driven in one process.

The in-process emulation: N ``TorchAdapter`` objects, one per emulated rank, whose
collectives are replaced by an exchange through Python lists -- every rank compresses,
then every rank launches its second phase, then every rank decompresses with the
placeholder Horovod's Average would return (1.0).  That runs ``TwoPhaseTransport``'s
``start``, ``launch_second_round`` and ``finish`` unchanged at sizes horovodrun tests do not
reach on a 2-core machine (N = 5, 6) in well under a second.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

import reference as R
import two_phase_reference as T
from in_process_world import InProcessAdapter, World
import hvd_compress
from hvd_compress.cross_rank import stable_hash
from hvd_compress.adapters.torch_adapter import TorchAdapter
from hvd_compress.backend import TorchBackend

SUM_SCHEMES = ["Int8", "Int8-block64", "EFSignSGD", "OneBit", "TopK", "TopK-Int8", "BF16", "QSGD16", "TernGrad"]


def _uniform1(step, rank, j, n):
    return np.random.default_rng([step, rank, j, 1]).random(n, dtype=np.float32)


def _uniform2(step, owner, n):
    return np.random.default_rng([step, owner, 2]).random(n, dtype=np.float32)


# --- the oracle on its own ---------------------------------------------------------------------
@pytest.mark.parametrize("size", [2, 3, 4, 5])
@pytest.mark.parametrize("numel", [1, 2, 7, 100, 1001])
@pytest.mark.parametrize("sid", SUM_SCHEMES)
def test_conservation_law_holds_in_the_reference(sid, numel, size):
    scheme, config = T.REF[sid]
    grads = T.grads_for(f"c{numel}", (numel,), size, 3)
    sim = T.simulate(scheme, config, grads, True, op="sum", uniform1=_uniform1, uniform2=_uniform2)
    assert [r.shape for r in sim.r1] == [(numel,)] * size
    assert [r.shape for r in sim.r2] == [(T.chunk_size(numel, size),)] * size
    lhs, rhs = T.conservation_gap(sim.aggregated, sim.r1, sim.r2, grads)
    np.testing.assert_allclose(lhs, rhs, rtol=1e-5, atol=1e-5 * np.abs(rhs).max())


def test_without_error_feedback_nothing_is_kept():
    grads = T.grads_for("x", (10,), 3, 2)
    sim = T.simulate("Int8", {}, grads, False)
    assert sim.r1 == [None] * 3 and sim.r2 == [None] * 3


def test_average_scales_like_the_allgather_transport():
    grads = T.grads_for("x", (50,), 3, 1)
    s = T.simulate("Int8", {}, grads, True, op="sum").aggregated[0]
    a = T.simulate("Int8", {}, grads, True, op="average").aggregated[0]
    np.testing.assert_array_equal(a, (s * (np.float32(1.0) / np.float32(3))).astype(np.float32))


def test_bf16_two_phase_is_a_double_rounding():
    """BF16: each rank rounds, the owner sums in fp32 and rounds again (chunking is irrelevant)."""
    grads = T.grads_for("x", (37,), 4, 1)
    got = T.simulate("BF16", {}, grads, False, op="sum").aggregated[0]
    want = R.bf16_round(R.aggregate("BF16", [R.bf16_round(g) for g in grads[0]]))
    np.testing.assert_array_equal(got, want)


def test_signsgd_tie_stays_zero():
    """The owner's vote goes out in 2 bits, so a tie (sum of signs 0, frequent at an even
    number of ranks) stays 0, as the allgather transport's vote does."""
    g = [np.array([1.0, -1.0, 2.0, -3.0], np.float32), np.array([-1.0, -2.0, 5.0, 3.0], np.float32)]
    two = T.simulate("SignSGD", {}, [g], False).aggregated[0]
    one = R.simulate("SignSGD", {}, [g], error_feedback=False).aggregated[0]
    np.testing.assert_array_equal(one, [0.0, -1.0, 1.0, 0.0])
    np.testing.assert_array_equal(two, one)


def test_topk_select_hook_changes_only_ties():
    x = np.array([3.0, -3.0, 1.0, 0.5], np.float32)
    g = [[x]]
    first = T.simulate("TopK", {"ratio": 0.25}, g, False, op="sum").aggregated[0]
    last = T.simulate("TopK", {"ratio": 0.25}, g, False, op="sum",
                      select=lambda a, k: np.argsort(a, kind="stable")[::-1][:k]).aggregated[0]
    np.testing.assert_array_equal(first, [3.0, 0, 0, 0])  # stable: lower index first
    np.testing.assert_array_equal(last, [0, -3.0, 0, 0])


def test_two_phase_bytes_model():
    # Int8, 1000 elements, 4 ranks: chunks of 250 -> 250 codes + 1 scale a chunk payload
    assert T.payload_bytes_two_phase("Int8", {}, 1000, 4) == 4 + 4 * 254 + 254
    # the per-rank bytes of two-phase shrink towards one payload as N grows; allgather's stay
    p1 = R.payload_bytes("Int8", {}, 4_200_000)
    ratios = [T.payload_bytes_two_phase("Int8", {}, 4_200_000, n) / p1 for n in (2, 3, 4, 8)]
    assert ratios == sorted(ratios, reverse=True) and 1.1 < ratios[-1] < ratios[0] < 1.51


def test_reference_is_independent_of_the_library():
    src = open(T.__file__).read()
    assert "import hvd_compress" not in src and "from hvd_compress" not in src


# --- the library's two-phase path, emulated in one process --------------------------------------
def emulate(sid, size, shape, steps, key="w"):
    """``steps`` steps of the library's two-phase path on ``size`` emulated ranks; returns
    (aggregated[step][rank], compressors)."""
    world = World(size)
    comps = [T.make_compressor(hvd_compress, sid, transport="two_phase") for _ in range(size)]
    adapters = []
    for rank, comp in enumerate(comps):
        comp.use_adapter("torch", InProcessAdapter(world, rank, key))
        adapters.append(comp.adapters["torch"])
    out = []
    for step in range(steps):
        world.posted.clear()
        ctxs = [comp.compress(torch.from_numpy(T.G(key, r, step, shape))) for r, comp in enumerate(comps)]
        for ad, (_, ctx) in zip(adapters, ctxs):
            ad.roles.rounds.launch(ctx)
        out.append([comp.decompress(torch.ones(1), ctx).numpy().reshape(-1) for comp, (_, ctx) in zip(comps, ctxs)])
    return out, comps


def _draws(comp, key):
    def rand(seed, n):
        gen = torch.Generator().manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
        return torch.rand(n, generator=gen, dtype=torch.float32).numpy()

    def u1(step, i, j, n):
        return rand(TorchBackend.seed_for(None, stable_hash(comp.seed, key, i, "two_phase") + j, step + 1), n)

    def u2(step, j, n):
        return rand(TorchBackend.seed_for(None, stable_hash(comp.seed, key, j, "phase2"), step + 1), n)
    return u1, u2


def _torch_topk(a, k):
    return torch.topk(torch.from_numpy(a), k, sorted=False).indices.numpy()


@pytest.mark.parametrize("size", [2, 3, 5, 6])
@pytest.mark.parametrize("shape", [(1,), (4,), (13,), (30, 7)], ids=["1", "4", "13", "30x7"])
@pytest.mark.parametrize("sid", list(T.CASES))
def test_library_two_phase_matches_the_reference_in_process(sid, shape, size):
    steps = 3
    got, comps = emulate(sid, size, shape, steps)
    scheme, config = T.REF[sid]
    n = int(np.prod(shape))
    grads = T.grads_for("w", shape, size, steps)
    u1, u2 = _draws(comps[0], "w")
    sim = T.simulate(scheme, config, grads, comps[0].error_feedback, uniform1=u1, uniform2=u2, select=_torch_topk)
    for step in range(steps):
        for r in range(size):
            assert got[step][r].tobytes() == got[step][0].tobytes(), f"rank {r} differs at step {step}"
    T.assert_steps_match(sid, [g[0] for g in got], sim.aggregated, f"in-process N={size} shape={shape}")
    if comps[0].error_feedback:
        mag = max(float(np.abs(g).max()) for st in grads for g in st)
        for r, comp in enumerate(comps):
            res = comp.adapters["torch"].residuals
            np.testing.assert_allclose(res["w"].numpy(), sim.r1[r], **T.residual_tolerance(sid, mag))
            np.testing.assert_allclose(res["w#owned_chunk"].numpy(), sim.r2[r], **T.residual_tolerance(sid, size * mag))
            assert res["w"].numel() == n


def _kernels_encode(sid, chunk):
    """Whether the torch kernels have a codec for this case's scheme and memory at ``chunk`` elements."""
    from hvd_compress.codecs.torch_fused import codec_for
    comp = T.make_compressor(hvd_compress, sid, transport="two_phase")
    return codec_for(comp.scheme, comp.memory, torch.zeros(chunk)) is not None


@pytest.mark.parametrize("shape,size", [((300, 70), 3), ((1001,), 4)], ids=["21000-N3", "1001-N4-padded"])
@pytest.mark.parametrize("sid", list(T.CASES))
def test_fused_chunks_match_the_reference(sid, shape, size):
    """Chunks large enough for the fused kernels (Top-K fuses from 8k elements
    a chunk), one case with a zero-padded tail chunk: the kernels' path agrees
    with the reference like the eager one, and runs wherever a codec exists."""
    from hvd_compress.kernels import native
    if native.load() is None:
        pytest.skip("the C kernels are not built (HVDC_KERNELS=0 or no compiler): only the eager path runs")
    test_library_two_phase_matches_the_reference_in_process(sid, shape, size)
    _, comps = emulate(sid, size, shape, 1)
    used = "two_phase.chunk0" in comps[0].adapters["torch"].roles.store.workspace("w")
    chunk = -(-int(np.prod(shape)) // size)
    assert used == _kernels_encode(sid, chunk), f"{sid}: fused chunk encode used={used}"
    if sid in ("Int8", "TopK", "EFSignSGD"):
        assert used, f"{sid} has a fused codec: its chunks must use it"
