"""The two-phase compressed allreduce through the stock ``horovod.torch.DistributedOptimizer``.

Runs under ``horovodrun -np 2`` and ``-np 3`` (Gloo and MPI, scripts/run_tests.sh) and
at 3 and 4 ranks on the emulated cluster (tests/testing/test_two_phase_cluster.py).
Every rank injects a rank-specific deterministic gradient through the loss
``sum(p * G_rank)``, lets the optimizer's hooks compress it with
``transport="two_phase"``, calls ``opt.synchronize()`` and reads ``p.grad``; every rank
can compute every rank's ``G``, so each checks the result against the numpy reference
of the two-phase math (tests/two_phase_reference.py, built on tests/reference.py) over
3 steps with error feedback: the aggregated gradient, its own stage-1 residual and the
stage-2 residual of the chunk it owns.  QSGD's and TernGrad's draws are reproduced:
stage 1, chunk ``j`` on rank ``i``: ``torch.rand(c)`` from a generator seeded with
``TorchBackend.seed_for(stable_hash(seed, key, i, "two_phase") + j, step)``; stage 2 on
owner ``j``: ``seed_for(stable_hash(seed, key, j, "phase2"), step)``.  So is Top-K's
tie-break (frequent among an owner's sums of Int8-quantized values): the reference selects
with torch.topk on the same fp32 magnitudes.

Every rank runs the same tests in the same order and issues all collectives of a test
before asserting anything.
"""
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import horovod.torch as hvd

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import reference as ref  # noqa: E402  (tests/reference.py)
import two_phase_reference as tpr  # noqa: E402  (tests/two_phase_reference.py)

import hvd_compress  # noqa: E402
from hvd_compress.compressor import Compressor  # noqa: E402
from hvd_compress.cross_rank import stable_hash  # noqa: E402
from hvd_compress.schemes import DGC, FP16, Int8, PowerSGD, RandomK, Threshold, TopK  # noqa: E402
from hvd_compress.backend import TorchBackend  # noqa: E402
from torch_params import Params  # noqa: E402


# No static process set here: process_set= with two_phase is tested in
# test_process_set_torch.py, the one file that registers a set (docs/development.md,
# "Static process sets and Gloo").
hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
torch.set_num_threads(1)

# 1000 elements (a pad of 2 at N=3), 100, 7 (padded at every N), 2 (fewer elements than
# ranks at N=3 and 4: whole chunks of padding)
SPECS = {"big.weight": (40, 25), "vec": (100,), "tiny": (7,), "pair": (2,)}
STEPS = 3
# schemes whose combination is a sum and that keep residuals by default
SUM_EF_DEFAULT = ["Int8", "Int8-block64", "EFSignSGD", "OneBit", "TopK", "TopK-Int8"]


def run_injected(comp, specs=SPECS, steps=STEPS, rank=None, **opt_kw):
    """Drive the stock DistributedOptimizer; returns [{name: aggregated grad (numpy)} per step]."""
    rank = RANK if rank is None else rank
    model = Params(specs)
    named = list(model.named_parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), named_parameters=named,
                                   compression=comp, **opt_kw)
    out = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        loss = sum((p * torch.from_numpy(tpr.G(name, rank, step, tuple(p.shape)))).sum() for name, p in named)
        loss.backward()
        opt.synchronize()
        out.append({name: p.grad.detach().clone().numpy() for name, p in named})
    return out


# --- the seeded draws, reproduced ------------------------------------------------------------------
def _rand(seed, n):
    gen = torch.Generator().manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
    return torch.rand(n, generator=gen, dtype=torch.float32).numpy()


def draws(comp, key):
    """(uniform1, uniform2) for tests/two_phase_reference.simulate (ranks in the global set)."""
    def u1(step, i, j, n):
        base = stable_hash(comp.seed, key, i, "two_phase") + j
        return _rand(TorchBackend.seed_for(None, base, step + 1), n)

    def u2(step, j, n):
        return _rand(TorchBackend.seed_for(None, stable_hash(comp.seed, key, j, "phase2"), step + 1), n)
    return u1, u2


def torch_topk(a, k):
    """torch's own top-k on the same fp32 magnitudes: ties (frequent among the owner's sums of
    Int8-quantized values) are broken as the library's torch.topk breaks them."""
    return torch.topk(torch.from_numpy(a), k, sorted=False).indices.numpy()


def simulate(sid, comp, name, shape, size=SIZE, op="average", ef=None):
    scheme, config = tpr.REF[sid]
    grads = tpr.grads_for(name, shape, size, STEPS)
    u1, u2 = draws(comp, name)
    sim = tpr.simulate(scheme, config, grads, comp.error_feedback if ef is None else ef, op=op,
                       uniform1=u1, uniform2=u2, select=torch_topk)
    return sim, grads


# --- cached runs ------------------------------------------------------------------------------------------
_RUNS = {}


class AlltoallSpy:
    """Names of the tensors handed to hvd.alltoall_async (the adapter looks it up at call time)."""

    def __init__(self, monkeypatch):
        self.names = []
        orig = hvd.alltoall_async

        def spy(tensor, *a, name=None, **kw):
            self.names.append(name)
            return orig(tensor, *a, name=name, **kw)
        monkeypatch.setattr(hvd, "alltoall_async", spy)


# HVDC_TWO_PHASE_QUICK=1 (the emulated-cluster runs at 3 and 4 ranks): representative cases only
QUICK = os.environ.get("HVDC_TWO_PHASE_QUICK") == "1"
QUICK_IDS = ("Int8", "TopK-Int8", "QSGD16")


def cached_run(sid, ef=None, op="average"):
    if QUICK and (sid not in QUICK_IDS or ef is not None or op != "average"):
        pytest.skip(f"HVDC_TWO_PHASE_QUICK=1 runs only {QUICK_IDS} with default options")
    key = (sid, ef, op)
    if key not in _RUNS:
        kw = {} if ef is None else {"error_feedback": ef}
        comp = tpr.make_compressor(hvd_compress, sid, transport="two_phase", **kw)
        mp = pytest.MonkeyPatch()
        spy = AlltoallSpy(mp)
        try:
            got = run_injected(comp, op=hvd.Average if op == "average" else hvd.Sum)
        finally:
            mp.undo()
        _RUNS[key] = (comp, got, spy.names)
    return _RUNS[key]


def residuals_of(comp):
    return {k: v.numpy().copy() for k, v in comp.adapters["torch"].residuals.items()}


# --- numerical agreement ----------------------------------------------------------------------------------
@pytest.mark.parametrize("sid", list(tpr.CASES))
def test_aggregate_and_residuals_match_reference(sid):
    """op=Average, default error feedback, 3 steps: p.grad after synchronize() == the
    two-phase reference; this rank's stage-1 residual and its owned chunk's stage-2
    residual too (without error feedback: neither exists)."""
    comp, got, a2a = cached_run(sid)
    assert a2a, "two_phase must use alltoall"
    res = residuals_of(comp)
    for name, shape in SPECS.items():
        sim, grads = simulate(sid, comp, name, shape)
        tpr.assert_steps_match(sid, [g[name] for g in got], sim.aggregated, f"{name} (rank {RANK} of {SIZE})")
        mag = max(float(np.abs(g).max()) for step in grads for g in step)
        if comp.error_feedback:
            np.testing.assert_allclose(res[name], sim.r1[RANK], **tpr.residual_tolerance(sid, mag),
                                       err_msg=f"{sid} stage-1 residual of {name}")
            np.testing.assert_allclose(res[name + "#owned_chunk"], sim.r2[RANK],
                                       **tpr.residual_tolerance(sid, SIZE * mag),
                                       err_msg=f"{sid} stage-2 residual of {name}")
        else:
            assert name not in res and name + "#owned_chunk" not in res, sorted(res)


@pytest.mark.parametrize("sid", ["BF16", "QSGD16", "TernGrad"])
def test_error_feedback_switched_on(sid):
    comp, got, _ = cached_run(sid, ef=True)
    res = residuals_of(comp)
    for name, shape in SPECS.items():
        sim, _ = simulate(sid, comp, name, shape)
        tpr.assert_steps_match(sid, [g[name] for g in got], sim.aggregated, f"{name} error_feedback=True")
        assert res[name].shape == (int(np.prod(shape)),)
        assert res[name + "#owned_chunk"].shape == (tpr.chunk_size(int(np.prod(shape)), SIZE),)


@pytest.mark.parametrize("sid", ["TopK", "Int8"])
def test_error_feedback_switched_off(sid):
    comp, got, _ = cached_run(sid, ef=False)
    assert residuals_of(comp) == {}
    for name, shape in SPECS.items():
        sim, _ = simulate(sid, comp, name, shape)
        tpr.assert_steps_match(sid, [g[name] for g in got], sim.aggregated, f"{name} error_feedback=False")


@pytest.mark.parametrize("sid", ["Int8", "TopK", "EFSignSGD"])
def test_op_sum(sid):
    comp, got, _ = cached_run(sid, op="sum")
    for name, shape in SPECS.items():
        sim, _ = simulate(sid, comp, name, shape, op="sum")
        tpr.assert_steps_match(sid, [g[name] for g in got], sim.aggregated, f"{name} op=Sum")


# --- replicas and conservation -------------------------------------------------------------------------------
@pytest.mark.parametrize("sid", list(tpr.CASES))
def test_replicas_bitwise_identical(sid):
    comp, got, _ = cached_run(sid)
    mine = np.concatenate([g[name].reshape(-1) for g in got for name in SPECS])
    everyone = hvd.allgather(torch.from_numpy(mine).reshape(1, -1), name=f"tp.replicas.{sid}").numpy()
    for r in range(SIZE):
        assert everyone[r].tobytes() == everyone[0].tobytes(), f"{sid}: rank {r} differs from rank 0"


CONSERVATION = [(s, None, "average") for s in SUM_EF_DEFAULT] + \
    [(s, True, "average") for s in ("BF16", "QSGD16", "TernGrad")] + \
    [(s, None, "sum") for s in ("Int8", "TopK", "EFSignSGD")]


@pytest.mark.parametrize("sid,ef,op", CONSERVATION, ids=[f"{s}-{o}" + ("-ef" if e else "") for s, e, o in CONSERVATION])
def test_conservation_end_to_end(sid, ef, op):
    """From the product's outputs alone: sum over steps of the aggregated gradient (times N
    for Average) + every rank's stage-1 residual + every owner's stage-2 residual (laid
    over its chunk, cut to n) == sum over steps and ranks of the gradients."""
    comp, got, _ = cached_run(sid, ef=ef, op=op)
    res = residuals_of(comp)
    mine = np.concatenate([np.concatenate([res[n], res[n + "#owned_chunk"]]) for n in SPECS]).astype(np.float32)
    everyone = hvd.allgather(torch.from_numpy(mine).reshape(1, -1), name=f"tp.conservation.{sid}.{op}.{ef}").numpy()
    offset = 0
    for name, shape in SPECS.items():
        n = int(np.prod(shape))
        c = tpr.chunk_size(n, SIZE)
        r1 = [everyone[r, offset:offset + n] for r in range(SIZE)]
        r2 = [everyone[r, offset + n:offset + n + c] for r in range(SIZE)]
        offset += n + c
        grads = tpr.grads_for(name, shape, SIZE, STEPS)
        scale = SIZE if op == "average" else 1
        sent = [np.asarray(g[name], np.float64).reshape(-1) * scale for g in got]
        lhs, rhs = tpr.conservation_gap(sent, r1, r2, grads)
        np.testing.assert_allclose(lhs, rhs, rtol=1e-5, atol=1e-5 * np.abs(rhs).max(),
                                   err_msg=f"{sid} {name} op={op}: conservation")


# --- bytes, 'auto' -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sid", tpr.DETERMINISTIC + tpr.STOCHASTIC)
def test_bytes_at_the_horovod_call(sid):
    """stats count the placeholder + N chunk payloads (alltoall) + 1 chunk payload (allgather)."""
    comp, _, a2a = cached_run(sid)
    per = comp.stats.per_tensor()
    scheme, config = tpr.REF[sid]
    for name, shape in SPECS.items():
        n = int(np.prod(shape))
        assert per[name]["payload_bytes"] == tpr.payload_bytes_two_phase(scheme, config, n, SIZE), (name, per[name])
        assert per[name]["calls"] == STEPS
    # one alltoall a step carries every tensor's chunk payloads (Horovod never fuses alltoalls)
    assert len(a2a) == STEPS, a2a


AUTO_SPECS = {"large": (256, 256), "below": (65535,), "small": (100,)}


def test_auto_picks_two_phase_from_3_ranks_and_64ki_elements():
    """'auto': two_phase for tensors of >= 65536 elements once there are 3+ ranks,
    allgather otherwise -- seen in the alltoall calls, the byte counters and the values."""
    comp = hvd_compress.Int8(transport="auto")
    mp = pytest.MonkeyPatch()
    spy = AlltoallSpy(mp)
    try:
        got = run_injected(comp, specs=AUTO_SPECS, steps=2)
    finally:
        mp.undo()
    per = comp.stats.per_tensor()
    for name, shape in AUTO_SPECS.items():
        n = int(np.prod(shape))
        two = SIZE >= 3 and n >= 65536
        used_a2a = any(nm and nm.startswith(f"hvdc.{name}.") for nm in spy.names)
        assert used_a2a == two, (name, SIZE, spy.names)
        want_bytes = tpr.payload_bytes_two_phase("Int8", {}, n, SIZE) if two else ref.payload_bytes("Int8", {}, n)
        assert per[name]["payload_bytes"] == want_bytes, (name, per[name])
        grads = tpr.grads_for(name, shape, SIZE, 2)
        if two:
            want = tpr.simulate("Int8", {}, grads, True).aggregated
        else:
            want = ref.simulate("Int8", {}, grads, error_feedback=True).aggregated
        tpr.assert_steps_match("Int8", [g[name] for g in got], want, f"auto {name} at N={SIZE}")


# --- the vote's tie ----------------------------------------------------------------------------------------------
def test_signsgd_vote_equals_the_allgather_vote():
    """The majority vote is the same whichever transport carries it."""
    comp, got, _ = cached_run("SignSGD")
    for name, shape in SPECS.items():
        grads = tpr.grads_for(name, shape, SIZE, STEPS)
        want = ref.simulate("SignSGD", {}, grads, error_feedback=False).aggregated
        tpr.assert_steps_match("SignSGD", [g[name] for g in got], want, f"{name} vote at N={SIZE}")


# --- construction ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda: hvd_compress.Threshold(1e-3, transport="two_phase"),
    lambda: hvd_compress.Threshold(1e-3, transport="auto"),
    lambda: hvd_compress.Int8(transport="bogus"),
    lambda: hvd_compress.TopK(0.01, transport="Two_Phase"),
    lambda: hvd_compress.Int8(transport=None),
    lambda: hvd_compress.RandomK(0.1, transport="two_phase"),
    lambda: hvd_compress.FP16(transport="two_phase"),
    lambda: hvd_compress.NoCompression(transport="two_phase"),
    lambda: hvd_compress.PowerSGD(transport="two_phase"),
    lambda: hvd_compress.Lossless(transport="two_phase"),
    lambda: Compressor(DGC(0.01), transport="two_phase"),
    lambda: Compressor(Threshold(1e-3), transport="two_phase"),
    lambda: Compressor(RandomK(0.1), transport="auto"),
    lambda: Compressor(FP16(), transport="two_phase"),
    lambda: Compressor(PowerSGD(), transport="two_phase"),
], ids=["Threshold-two_phase", "Threshold-auto", "bogus", "wrong-case", "None", "RandomK", "FP16",
        "NoCompression", "PowerSGD", "Lossless", "DGC-scheme", "Threshold-scheme", "RandomK-auto",
        "FP16-scheme", "PowerSGD-scheme"])
def test_invalid_transport_raises_at_construction(make):
    with pytest.raises(ValueError, match="transport"):
        make()


@pytest.mark.parametrize("sid", list(tpr.CASES))
def test_valid_transports_construct(sid):
    for t in ("allgather", "two_phase", "auto"):
        comp = tpr.make_compressor(hvd_compress, sid, transport=t)
        assert comp.transport == t and comp.config()["transport"] == t
    assert Compressor(Int8(), transport="two_phase").transport == "two_phase"
    assert Compressor(TopK(0.01, values=Int8()), transport="auto").transport == "auto"
