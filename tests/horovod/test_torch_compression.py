"""hvd_compress through the stock, unpatched ``horovod.torch.DistributedOptimizer``.

Runs under ``horovodrun -np 2`` with Gloo and with MPI, and ``-np 3`` with MPI (see
scripts/run_tests.sh).  Every rank injects a rank-specific, deterministic
gradient through the loss ``sum(p * G_rank)`` (so ``p.grad == G_rank`` exactly),
lets the optimizer's hooks compress it, calls ``opt.synchronize()`` and reads
the aggregated ``p.grad``.  Since every rank can compute every rank's ``G``,
each rank checks the result against the independent numpy reference
(``tests/reference.py``) computed from all ranks' inputs -- over several steps,
with error feedback, and for the stochastic schemes by reproducing the
adapter's draws: ``torch.rand(n)`` from a private ``torch.Generator`` seeded
with ``TorchBackend.seed_for(stable_hash(seed, key, rank), step)`` (the rank
is the one in the optimizer's process set, ``step`` counts compress calls
per key from 1), and Random-K's coordinates from the shared seed
``seed_for(stable_hash(seed, key), step)``.  PowerSGD and Lossless, which the
reference has no math for, are checked by their own laws (conservation, rank,
exactness, byte formulas).  Horovod's options (op, gradient_predivide_factor,
backward_passes_per_step, groups; process_set in test_process_set_torch.py)
keep their meaning; op=Adasum must be rejected with a clear error.

Every rank runs the same tests in the same order and issues all collectives of
a test before asserting anything, so one rank's failure cannot leave another
waiting in a collective.
"""
import numpy as np
import pytest
import torch

import horovod.torch as hvd

from compression_cases import (EF_DEFAULT_OFF, EF_DEFAULT_ON, EXTRA, IDS, PATHS, SCHEMES, TRAIN_IDS, TRAIN_LR, G,
                               aggregate_conservation, assert_matches, conservation, covered_names,
                               exported_schemes, ref, residual_tolerance, shuffle_zstd_nbytes, train_scheme,
                               uncovered)
from torch_injection import SPECS, check_run, inject, run_injected, simulate
from torch_params import Params

import hvd_compress

# No static process set here: process_set= is tested in test_process_set_torch.py.  With
# one registered, a launch at np=3 with Gloo can abort on every rank (docs/development.md,
# "Static process sets and Gloo").
hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()


def test_every_scheme_is_covered():
    """Every scheme hvd_compress exports is exercised here: against tests/reference.py where it
    has the scheme's math, by the scheme's own laws otherwise (EXTRA)."""
    assert covered_names() <= exported_schemes()
    with_reference, not_at_all = uncovered()
    assert not with_reference, f"schemes with a reference but not covered by these tests: {with_reference}"
    assert not not_at_all, f"schemes not covered by these tests: {not_at_all}"


# --- one cached run per (scheme, error feedback) feeds several specific tests ---------------------------
_RUNS = {}


class Spy:
    """Records every tensor handed to Horovod's collectives (name, kind, bytes)."""

    def __init__(self, monkeypatch):
        import horovod.torch.optimizer as hopt
        self.calls = []
        orig_reduce, orig_gather = hopt.allreduce_async_, hvd.allgather_async

        def reduce_(tensor, *a, name=None, **kw):
            self.calls.append(("allreduce", name, tensor.numel() * tensor.element_size()))
            return orig_reduce(tensor, *a, name=name, **kw)

        def gather(tensor, *a, name=None, **kw):
            self.calls.append(("allgather", name, tensor.numel() * tensor.element_size()))
            return orig_gather(tensor, *a, name=name, **kw)

        monkeypatch.setattr(hopt, "allreduce_async_", reduce_)
        monkeypatch.setattr(hvd, "allgather_async", gather)


def cached_run(sid, ef=None):
    """3 steps, op=Average, of scheme ``sid`` (error feedback: the scheme's default, or ``ef``)."""
    key = (sid, ef)
    if key not in _RUNS:
        comp = SCHEMES[sid]() if ef is None else SCHEMES[sid](error_feedback=ef)
        mp = pytest.MonkeyPatch()
        spy = Spy(mp)
        try:
            got = run_injected(comp, op=hvd.Average)
        finally:
            mp.undo()
        _RUNS[key] = (comp, got, spy.calls)
    return _RUNS[key]


@pytest.mark.parametrize("sid", IDS)
def test_aggregate_matches_reference(sid):
    """Default error feedback, op=Average, 3 steps: p.grad after synchronize() == reference,
    and the residuals too."""
    comp, got, _ = cached_run(sid)
    residuals = comp.adapters["torch"].residuals
    for name in SPECS:
        sim, grads = simulate(comp, name)
        assert_matches(sid, [g[name] for g in got], sim.aggregated, f"{name} (rank {RANK} of {SIZE})")
        if comp.error_feedback:
            np.testing.assert_allclose(residuals[name].numpy(), sim.residuals[RANK],
                                       **residual_tolerance(sid, [g[RANK] for g in grads]),
                                       err_msg=f"{sid} residual of {name}")
        else:
            assert name not in residuals


@pytest.mark.parametrize("sid", EF_DEFAULT_OFF)
def test_error_feedback_switched_on(sid):
    comp, got, _ = cached_run(sid, ef=True)
    assert comp.error_feedback is True
    check_run(sid, comp, got, "error_feedback=True")


@pytest.mark.parametrize("sid", EF_DEFAULT_ON)
def test_error_feedback_switched_off(sid):
    comp, got, _ = cached_run(sid, ef=False)
    assert comp.error_feedback is False and not comp.adapters["torch"].residuals
    check_run(sid, comp, got, "error_feedback=False")


@pytest.mark.parametrize("sid", [s for s in IDS if s != "NoCompression"])
def test_error_feedback_conservation(sid):
    """For every rank and parameter: sum of what was sent over the steps + the final residual
    == sum of the gradients (see compression_cases.conservation)."""
    comp, got, _ = cached_run(sid, ef=True if sid in EF_DEFAULT_OFF else None)
    residuals = comp.adapters["torch"].residuals
    assert set(residuals) == set(SPECS), f"residual keys {sorted(residuals)}"
    mine = torch.cat([residuals[n].reshape(-1) for n in SPECS])
    everyone = hvd.allgather(mine.reshape(1, -1), name=f"conservation.{sid}").numpy()
    offset = 0
    for name in SPECS:
        n = int(np.prod(SPECS[name]))
        sim, grads = simulate(comp, name, ef=True)
        conservation(sid, [g[name] for g in got], residuals[name].numpy(), everyone[:, offset:offset + n],
                     sim, grads, RANK, SIZE)
        offset += n


@pytest.mark.parametrize("sid", IDS)
def test_bytes_counter(sid):
    """stats.per_tensor() counts what is handed to Horovod: equal to the reference's payload
    formula, and to the bytes of the tensors a spy saw enter Horovod's collectives."""
    comp, got, calls = cached_run(sid)
    stats = comp.stats.per_tensor()
    assert set(stats) == set(SPECS), f"keys {sorted(stats)}"
    for name in SPECS:
        numel = int(np.prod(SPECS[name]))
        sim, _ = simulate(comp, name)
        want = sim.nbytes[-1][RANK]  # the latest step, this rank (its kept count for Threshold/DGC)
        row = stats[name]
        assert row["payload_bytes"] == want, (name, row, want)
        assert row["dense_fp32_bytes"] == 4 * numel
        assert row["calls"] == 3
        assert row["scheme"] == comp.scheme.name
        mine = [c for c in calls if c[1] == name or (c[1] or "").startswith("hvdc." + name + ".")]
        per_step = len(mine) // 3
        assert per_step * 3 == len(mine), mine
        last = mine[-per_step:]
        assert sum(c[2] for c in last) == want, (name, last, want)
        if ref.transport(comp.scheme.name) == "allgather":
            assert [c[2] for c in last if c[0] == "allreduce"] == [4], last  # just the placeholder
            if not comp.scheme.variable_parts:  # the parts, packed into one allgather of bytes
                assert [c[0] for c in last].count("allgather") == 1, last
    totals = comp.stats.totals()
    if sid == "NoCompression":
        assert totals["payload_bytes"] == totals["dense_fp32_bytes"], totals
    else:
        assert totals["payload_bytes"] < totals["dense_fp32_bytes"], totals


# --- Horovod's options keep their meaning ------------------------------------------------------------------
@pytest.mark.parametrize("sid", IDS)
def test_op_sum(sid):
    comp = SCHEMES[sid]()
    got = run_injected(comp, op=hvd.Sum)
    check_run(sid, comp, got, "op=Sum", op="sum")


@pytest.mark.parametrize("sid", PATHS)
def test_gradient_predivide_factor(sid):
    comp = SCHEMES[sid]()
    got = run_injected(comp, steps=2, op=hvd.Average, gradient_predivide_factor=2.0)
    check_run(sid, comp, got, "gradient_predivide_factor=2", steps=2, op="average")


@pytest.mark.parametrize("sid", PATHS)
def test_backward_passes_per_step(sid):
    """Two backward passes accumulate into p.grad; one compress per step, of the sum."""
    comp = SCHEMES[sid]()
    got = run_injected(comp, steps=2, bpps=2)
    check_run(sid, comp, got, "backward_passes_per_step=2", steps=2, bpps=2)
    assert {k: v["calls"] for k, v in comp.stats.per_tensor().items()} == {n: 2 for n in SPECS}


@pytest.mark.parametrize("sid", PATHS)
def test_groups(sid):
    """groups=2: Horovod's grouped path compresses inside a list comprehension (and applies
    no pre/postscale); the keys must still be the parameter names."""
    comp = SCHEMES[sid]()
    got = run_injected(comp, steps=2, groups=2)
    assert set(comp.stats.per_tensor()) == set(SPECS)
    check_run(sid, comp, got, "groups=2", steps=2)


# --- keying -----------------------------------------------------------------------------------------------
TWINS = {"twin_a": (64,), "twin_b": (64,), "twin_c": (8, 8)}


def _shuffled(step, named):
    """A rank- and step-dependent order of the loss terms: autograd runs the most recently
    created node first, so the accumulate-grad hooks fire in a different order per rank."""
    rng = np.random.default_rng([RANK, step, 7])
    return [named[i] for i in rng.permutation(len(named))]


@pytest.mark.parametrize("sid", ["TopK", "Int8-block64", "EFSignSGD", "QSGD16", "RandomK", "DGC"])
def test_keying_shuffled_hooks_and_set_to_none(sid):
    """Three parameters of 64 elements (two of identical shape), hooks firing in a different
    order on every rank and step, grads set to None between steps: each residual, draw and
    side collective follows its own parameter."""
    comp = SCHEMES[sid](error_feedback=True)
    fired = []
    model = Params(TWINS)
    for n, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, n=n: fired.append(n))
    named = list(model.named_parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), named_parameters=named,
                                   compression=comp)
    got, nones = [], []
    steps = 4
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        nones.append(all(p.grad is None for _, p in named))
        inject(named, step, order=_shuffled)
        opt.synchronize()
        got.append({name: p.grad.detach().clone().numpy() for name, p in named})
    orders = hvd.allgather_object(fired, name=f"keying.order.{sid}")
    per_step = {tuple(o[i:i + 3]) for o in orders for i in range(0, 3 * steps, 3)}
    assert len(per_step) > 1, f"the hooks fired in one order everywhere ({per_step}): nothing was shuffled"
    assert all(nones)
    residuals = comp.adapters["torch"].residuals
    assert set(residuals) == set(TWINS) and set(comp.stats.per_tensor()) == set(TWINS)
    for name, shape in TWINS.items():
        sim, grads = simulate(comp, name, steps=steps, shape=shape)
        assert_matches(sid, [g[name] for g in got], sim.aggregated, f"{name} shuffled (rank {RANK})")
        np.testing.assert_allclose(residuals[name].numpy(), sim.residuals[RANK],
                                   **residual_tolerance(sid, [g[RANK] for g in grads]),
                                   err_msg=f"residual of {name} crossed")


# --- pass-through and direct calls ----------------------------------------------------------------------
@pytest.mark.parametrize("sid", IDS)
def test_non_float_passes_through_and_ctx_none(sid):
    comp = SCHEMES[sid]()
    for t in (torch.arange(6, dtype=torch.int32), torch.arange(6, dtype=torch.int64),
              torch.tensor([True, False]), torch.arange(4, dtype=torch.uint8)):
        out, ctx = comp.compress(t)
        assert out is t and ctx is None
    x = torch.randn(5)
    assert comp.decompress(x, None) is x
    s = hvd.allreduce(torch.full((3,), RANK + 1, dtype=torch.int64), op=hvd.Sum, compression=comp,
                      name=f"passthrough.{sid}")
    assert s.dtype == torch.int64 and s.tolist() == [SIZE * (SIZE + 1) // 2] * 3
    assert comp.stats.per_tensor() == {}


@pytest.mark.parametrize("sid", IDS)
def test_direct_hvd_allreduce(sid):
    """hvd.allreduce(x, compression=...) outside any optimizer: a fallback key, one call."""
    comp = SCHEMES[sid]()
    x = torch.from_numpy(G("mid.weight", RANK, 0, SPECS["mid.weight"]))
    out = hvd.allreduce(x, op=hvd.Average, compression=comp, name=f"direct.{sid}")
    (key,) = comp.stats.per_tensor()
    assert out.shape == x.shape and out.dtype == x.dtype
    sim, _ = simulate(comp, "mid.weight", steps=1, key=key)  # the fallback key seeds the draws
    assert_matches(sid, [out.numpy()], sim.aggregated, f"direct hvd.allreduce (rank {RANK})")


def test_half_and_double_gradients_keep_their_dtype():
    model = Params({"h": (32,), "d": (16,)})
    model.h.data = model.h.data.half()
    model.d.data = model.d.data.double()
    comp = hvd_compress.TopK(0.25)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(), compression=comp)
    ramp = torch.arange(1, 33, dtype=torch.float64)
    loss = ((model.h * ramp.half()).sum() + (model.d * ramp[:16]).sum()) * (RANK + 1.0)
    loss.backward()
    opt.synchronize()
    assert model.h.grad.dtype == torch.float16 and model.d.grad.dtype == torch.float64
    assert model.h.grad.shape == (32,) and model.d.grad.shape == (16,)
    # Top-K keeps the largest quarter; the mean over ranks of (r + 1) * ramp
    mean = (SIZE + 1) / 2.0
    want_d = torch.where(ramp[:16] > 12, ramp[:16] * mean, torch.zeros(16, dtype=torch.float64))
    want_h = torch.where(ramp > 24, ramp * mean, torch.zeros(32, dtype=torch.float64))
    assert torch.equal(model.d.grad, want_d), model.d.grad
    assert torch.equal(model.h.grad.double(), want_h), model.h.grad


# --- a large fixed-length payload between 2 ranks: swapped by a reduce-scatter where switched on -------------
SWAP_AT = 1 << 20  # HVDC_PAIR_SWAP_MIN_BYTES in these tests


@pytest.mark.skipif(SIZE != 2, reason="the swap is for 2 ranks; at others allgather_fixed is the allgather")
def test_large_fixed_payload_swapped_exactly(monkeypatch):
    """With HVDC_PAIR_SWAP_MIN_BYTES set, ``TorchCollectives.allgather_fixed`` gives hvd.allgather's bytes
    exactly (odd byte lengths, -0.0 and NaN payloads included) and moves a payload of that size by a
    reduce-scatter (a PairSwap handle); smaller ones, and any with it unset, by the allgather."""
    from hvd_compress.adapters.torch_adapter import PairSwap, TorchAdapter
    adapter = TorchAdapter()
    gen = torch.Generator().manual_seed(1234 + RANK)
    odd = torch.randint(0, 256, (SWAP_AT + 3,), dtype=torch.uint8, generator=gen)
    floats = torch.randint(-2 ** 31, 2 ** 31 - 1, (SWAP_AT // 4 + 5,), dtype=torch.int32, generator=gen)
    floats = floats.view(torch.float32)
    floats[:3] = torch.tensor([-0.0, float("nan"), float("-inf")])
    cases = {"odd": odd, "floats": floats, "small": odd[:1000], "unset": odd}
    handles = {}
    for k, t in cases.items():
        if k == "unset":
            monkeypatch.delenv("HVDC_PAIR_SWAP_MIN_BYTES", raising=False)
        else:
            monkeypatch.setenv("HVDC_PAIR_SWAP_MIN_BYTES", str(SWAP_AT))
        handles[k] = adapter.roles.collectives.allgather_fixed(t, f"swap.{k}", hvd.global_process_set, RANK, SIZE)
    got = {k: adapter.roles.collectives.wait(h) for k, h in handles.items()}
    want = {k: hvd.allgather(t, name=f"swap.want.{k}") for k, t in cases.items()}
    for k in cases:
        assert isinstance(handles[k], PairSwap) == (k in ("odd", "floats")), (k, type(handles[k]))
        assert got[k].dtype == want[k].dtype and got[k].shape == want[k].shape, (k, got[k].shape, want[k].shape)
        assert torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)), k


@pytest.mark.skipif(SIZE != 2, reason="the swap is for 2 ranks; at others allgather_fixed is the allgather")
def test_top_k_through_the_swap_matches_the_allgather(monkeypatch):
    """Top-K of a tensor whose packed payload is over 1 MiB: the aggregate and the residual after 2
    steps are bit-identical whether the payload travels by the 2-rank reduce-scatter
    (HVDC_PAIR_SWAP_MIN_BYTES set) or by the allgather (unset), and the reduce-scatter ran."""
    specs = {"wide": (1 << 19,)}
    swaps = []
    orig = hvd.reducescatter_async

    def spy(tensor, *a, name=None, **kw):
        swaps.append(name)
        return orig(tensor, *a, name=name, **kw)

    monkeypatch.setattr(hvd, "reducescatter_async", spy)
    runs = {}
    for way in ("swap", "allgather"):
        if way == "swap":
            monkeypatch.setenv("HVDC_PAIR_SWAP_MIN_BYTES", str(SWAP_AT))
        else:
            monkeypatch.delenv("HVDC_PAIR_SWAP_MIN_BYTES")
        comp = hvd_compress.TopK(0.5)
        runs[way] = (run_injected(comp, steps=2, specs=specs), comp.adapters["torch"].residuals["wide"].clone())
        assert comp.stats.per_tensor()["wide"]["payload_bytes"] > SWAP_AT + 4
    assert len(swaps) == 2, swaps
    (got, res), (want, want_res) = runs["swap"], runs["allgather"]
    for step in range(2):
        assert np.array_equal(got[step]["wide"].view(np.uint32), want[step]["wide"].view(np.uint32)), step
    assert torch.equal(res.view(torch.int32), want_res.view(torch.int32))


# --- schemes without a numpy reference: their own laws ------------------------------------------------------
def test_lossless_is_exact_and_counts_its_bytes():
    """Lossless: the aggregate is exactly the uncompressed one, and the counter is the placeholder,
    the blob's length (4) and the blob: byte planes of the floats, zstd level 1."""
    comp = EXTRA["Lossless"]()
    got = run_injected(comp)
    stats = comp.stats.per_tensor()
    for name, shape in SPECS.items():
        grads = [[G(name, r, s, shape).reshape(-1) for r in range(SIZE)] for s in range(3)]
        sim = ref.simulate("NoCompression", {}, grads, error_feedback=False, op="average")
        assert_matches("Lossless", [g[name] for g in got], sim.aggregated, f"{name} (rank {RANK})")
        assert stats[name]["payload_bytes"] == 8 + shuffle_zstd_nbytes(grads[-1][RANK]), (name, stats[name])
    assert not comp.adapters["torch"].residuals


def _powersgd_bytes(shape, rank=2):
    """Two factors of (n + m) * rank fp32 for a matrix n x m (+ the 4-byte placeholder), or the
    dense tensor where that would not save bytes (vectors, small matrices)."""
    if len(shape) < 2:
        return 4 * int(np.prod(shape))
    n, m = shape[0], int(np.prod(shape[1:]))
    return 4 + 4 * (n + m) * rank if (n + m) * rank < n * m else 4 * n * m


def _powersgd_check(comp, got, specs, what):
    residuals = comp.adapters["torch"].residuals
    mine = torch.cat([residuals[n].reshape(-1) for n in specs])
    everyone = hvd.allgather(mine.reshape(1, -1), name=f"powersgd.{what}").numpy()
    offset = 0
    for name, shape in specs.items():
        n = int(np.prod(shape))
        grads_all = [G(name, r, s, shape) for s in range(len(got)) for r in range(SIZE)]
        aggregate_conservation(f"PowerSGD {name} {what} (rank {RANK})", [g[name] for g in got],
                               everyone[:, offset:offset + n], grads_all)
        assert comp.stats.per_tensor()[name]["payload_bytes"] == _powersgd_bytes(shape), name
        offset += n


def test_powersgd_conservation_and_bytes():
    """PowerSGD (op=Sum, error feedback): what the ranks aggregate plus what they keep is
    everything they were given; factors cost (n + m) * rank floats."""
    comp = EXTRA["PowerSGD"]()
    got = run_injected(comp, op=hvd.Sum)
    assert set(comp.adapters["torch"].residuals) == set(SPECS)
    _powersgd_check(comp, got, SPECS, "op=Sum")
    low = [g["big.weight"].reshape(40, 25) for g in got]
    assert all(np.linalg.matrix_rank(m, tol=1e-4 * np.abs(m).max()) <= 2 for m in low), "not a rank-2 aggregate"


def test_powersgd_shuffled_hooks_and_set_to_none():
    """PowerSGD's two rounds with hooks firing in a different order on every rank and step
    (its second round must not deadlock) and grads set to None between steps."""
    comp = EXTRA["PowerSGD"]()
    specs = {"pa": (8, 8), "pb": (8, 8), "pc": (4, 16)}
    got = run_injected(comp, steps=3, specs=specs, order=_shuffled, op=hvd.Sum)
    _powersgd_check(comp, got, specs, "shuffled")


# --- training: replicas stay identical and the loss falls ----------------------------------------------------
def _dataset():
    rng = np.random.default_rng(2024)
    x = rng.standard_normal((96 * SIZE, 12)).astype(np.float32)
    w = rng.standard_normal((12, 1)).astype(np.float32)
    y = np.tanh(x @ w) + 0.05 * rng.standard_normal((96 * SIZE, 1)).astype(np.float32)
    return torch.from_numpy(x), torch.from_numpy(y.astype(np.float32))


@pytest.mark.parametrize("sid", TRAIN_IDS)
def test_training_replicas_identical_and_loss_falls(sid):
    torch.manual_seed(100 + RANK)  # deliberately different initial weights: the broadcast fixes them
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=TRAIN_LR.get(sid, 0.1)),
                                   named_parameters=model.named_parameters(), compression=train_scheme(sid))
    x, y = _dataset()

    def full_loss():
        with torch.no_grad():
            return torch.nn.functional.mse_loss(model(x), y).item()

    before = full_loss()
    for step in range(20):
        lo = RANK * 96 + (step % 3) * 32  # this rank's shard, 32 rows a step
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x[lo:lo + 32]), y[lo:lo + 32]).backward()
        opt.step()
    after = full_loss()
    w = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather(w.reshape(1, -1), name=f"replicas.{sid}")
    for r in range(SIZE):
        assert torch.equal(everyone[r], everyone[0]), f"{sid}: replica {r} differs from replica 0"
    assert after < 0.8 * before, f"{sid}: loss {before:.4f} -> {after:.4f}"


# --- Adasum (last: it leaves failed Horovod ops behind on some controllers) -----------------------------------
@pytest.mark.parametrize("sid", ["FP16", "TopK"])
def test_adasum_rejected_with_clear_error(sid):
    model = Params({"adasum_w": (16,)})
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), compression=SCHEMES[sid](),
                                   op=hvd.Adasum)
    with pytest.raises(ValueError, match="Adasum"):
        (model.adasum_w * (RANK + 1.0)).sum().backward()
        opt.step()
