"""Bad tensors through the stock, unpatched ``horovod.torch.DistributedOptimizer``.

Runs under ``horovodrun -np 2`` with Gloo and with MPI (scripts/run_tests.sh).

* **Layouts and dtypes** -- non-contiguous (transposed) and channels-last
  parameters, empty tensors, 0-d scalars, fp16/bf16/fp64 parameters: for every
  scheme, the aggregated gradient has the parameter's shape and dtype and is
  *exactly* what the same compressor gives for a plain contiguous fp32
  parameter of the same name fed the same values (cast through the dtype).
  That run is itself checked against the numpy reference by
  test_torch_compression.py, so nothing is lost or reordered by the layout.
* **Integer and bool tensors** pass through ``compress`` untouched, and
  ``hvd.allreduce(..., compression=...)`` behaves exactly as without
  compression (Horovod itself refuses bool/uint8/int8/int16 on torch).
* **NaN/Inf gradients** -- one rank injects a non-finite element at one step.
  Policy: like uncompressed Horovod, the non-finite value reaches every rank's
  aggregated gradient (for the schemes that can carry it; see PROPAGATE), every
  rank sees the same aggregate, the error-feedback state stays finite, and the
  next steps are finite again (AMP-style "skip the step if the gradient is not
  finite" then just works).  Compression can *widen* a non-finite element: a
  per-tensor scale (Int8, EF-sign, QSGD) or a matrix product (PowerSGD) turns
  the whole tensor non-finite at that step; uncompressed Horovod and Top-K
  affect only that element.

Every rank runs the same tests in the same order and issues all collectives of a
test before asserting anything.
"""
import numpy as np
import pytest
import torch

import horovod.torch as hvd

import hvd_compress

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()

SCHEMES = {
    "NoCompression": lambda: hvd_compress.NoCompression(),
    "FP16": lambda: hvd_compress.FP16(),
    "BF16": lambda: hvd_compress.BF16(),
    "Int8": lambda: hvd_compress.Int8(),
    "Int8-block8": lambda: hvd_compress.Int8(block_size=8),
    "QSGD": lambda: hvd_compress.QSGD(16),
    "TernGrad": lambda: hvd_compress.TernGrad(),
    "SignSGD": lambda: hvd_compress.SignSGD(),
    "EFSignSGD": lambda: hvd_compress.EFSignSGD(),
    "OneBit": lambda: hvd_compress.OneBit(),
    "TopK": lambda: hvd_compress.TopK(0.25),
    "TopK-Int8": lambda: hvd_compress.TopK(0.25, values=hvd_compress.Int8()),
    "RandomK": lambda: hvd_compress.RandomK(0.25),
    "Threshold": lambda: hvd_compress.Threshold(0.5),
    "DGC": lambda: hvd_compress.DGC(0.1),
    "PowerSGD": lambda: hvd_compress.PowerSGD(rank=1),
    "Lossless": lambda: hvd_compress.Lossless(),
}
IDS = list(SCHEMES)
REQUIRED = ["TopK", "Int8", "EFSignSGD", "PowerSGD"]  # the minimum set every reliability check must cover



def grad_values(name, rank, step, shape):
    """Deterministic rank-specific gradient (numpy fp32), the same wherever computed."""
    rng = np.random.default_rng([sum(name.encode()), len(name), rank, step])
    return (rng.standard_normal(int(np.prod(shape, dtype=np.int64))) * (1.0 + rank)).astype(np.float32).reshape(shape)


def inject(params, step, transform=None):
    """backward() of sum(p * G): afterwards p.grad == G (in p's dtype and layout)."""
    loss = 0.0
    for name, p in params.items():
        g = torch.from_numpy(grad_values(name, RANK, step, tuple(p.shape))).to(p.dtype)
        if transform is not None:
            g = transform(name, step, g)
        loss = loss + (p * g).sum()
    loss.backward()


def make_optimizer(params, comp):
    return hvd.DistributedOptimizer(torch.optim.SGD(params.values(), lr=0.0), named_parameters=params.items(),
                                    compression=comp)


# --- layouts and dtypes ------------------------------------------------------------------------------------
def _param(shape, dtype=torch.float32, layout=None):
    if layout == "transposed":
        t = torch.zeros(tuple(reversed(shape)), dtype=dtype).t()
    elif layout == "channels_last":
        t = torch.zeros(shape, dtype=dtype).to(memory_format=torch.channels_last)
    else:
        t = torch.zeros(shape, dtype=dtype)
    return torch.nn.Parameter(t)


# name -> (shape, dtype, layout)
ODD = {
    "transposed": ((6, 10), torch.float32, "transposed"),
    "channels_last": ((2, 3, 4, 5), torch.float32, "channels_last"),
    "empty": ((0,), torch.float32, None),
    "empty2d": ((0, 5), torch.float32, None),
    "scalar": ((), torch.float32, None),
    "half": ((6, 8), torch.float16, None),
    "bf16": ((6, 8), torch.bfloat16, None),
    "double": ((6, 8), torch.float64, None),
}
STEPS = 2


def _run_layout(sid):
    odd = {n: _param(s, d, lay) for n, (s, d, lay) in ODD.items()}
    plain = {n: _param(s) for n, (s, d, lay) in ODD.items()}
    got, want, layouts = [], [], []
    for params, out in ((odd, got), (plain, want)):
        opt = make_optimizer(params, SCHEMES[sid]())
        for step in range(STEPS):
            opt.zero_grad()
            # the plain run sees the very values the odd run's compress sees: G cast through the dtype
            inject(params, step, None if params is odd else
                   (lambda name, st, g: g.to(ODD[name][1]).to(torch.float32)))
            if params is odd and step == 0:
                layouts.append({n: (p.grad.is_contiguous(), p.grad.stride()) for n, p in params.items()})
            opt.synchronize()
            out.append({n: p.grad.detach().clone() for n, p in params.items()})
    return odd, got, want, layouts[0]


_LAYOUT = {}


def layout_run(sid):
    if sid not in _LAYOUT:
        _LAYOUT[sid] = _run_layout(sid)
    return _LAYOUT[sid]


def test_odd_parameters_really_are_odd():
    """The gradients handed to compress have the layouts under test."""
    _, _, _, layouts = layout_run("TopK")
    assert layouts["transposed"][0] is False
    assert layouts["channels_last"][0] is False
    p = _param((2, 3, 4, 5), layout="channels_last")
    (p * torch.ones(2, 3, 4, 5)).sum().backward()
    assert p.grad.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("sid", IDS)
def test_layouts_and_dtypes_keep_shape_dtype_and_values(sid):
    odd, got, want, _ = layout_run(sid)
    for step in range(STEPS):
        for name, (shape, dtype, _) in ODD.items():
            g, w = got[step][name], want[step][name]
            assert tuple(g.shape) == tuple(shape), (sid, name, g.shape)
            assert g.dtype == dtype, (sid, name, g.dtype)
            assert w.dtype == torch.float32
            assert torch.equal(g, w.to(dtype)), f"{sid} {name} step {step}: {g} != {w}"
            assert bool(torch.isfinite(g).all()), (sid, name)
    # the empty and 0-d ones went through as what they are
    assert got[0]["empty"].numel() == 0 and got[0]["scalar"].dim() == 0


@pytest.mark.parametrize("sid", ["NoCompression", "FP16"])
def test_layout_reference_values(sid):
    """Sanity of the comparison run: a dense scheme gives the mean of the ranks' gradients."""
    _, got, _, _ = layout_run(sid)
    for name, (shape, dtype, _) in ODD.items():
        mean = torch.stack([torch.from_numpy(grad_values(name, r, 0, shape)).to(dtype).to(torch.float64)
                            for r in range(SIZE)]).mean(0)
        tol = 1e-2 if dtype in (torch.float16, torch.bfloat16) or sid == "FP16" else 1e-6
        torch.testing.assert_close(got[0][name].to(torch.float64), mean, rtol=tol, atol=tol * 4)


def test_real_conv_model_channels_last_trains():
    """A real Conv2d model in channels_last through Top-K, a few optimizer steps, replicas identical."""
    torch.manual_seed(7 + RANK)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3),
                                torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 1))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # (Horovod's broadcast needs contiguous tensors)
    model = model.to(memory_format=torch.channels_last)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(), compression=hvd_compress.TopK(0.1))
    gen = torch.Generator().manual_seed(RANK)
    x = torch.randn(16, 3, 8, 8, generator=gen).to(memory_format=torch.channels_last)
    y = torch.randn(16, 1, generator=gen)
    assert not model[0].weight.is_contiguous()
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    w = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather(w.reshape(1, -1), name="rel.convcl")
    assert torch.isfinite(w).all()
    for r in range(SIZE):
        assert torch.equal(everyone[r], everyone[0])


def test_stock_horovod_refuses_what_hvd_compress_handles():
    """Baseline: uncompressed Horovod refuses a non-contiguous gradient ("Tensor is required to be
    contiguous"); hvd_compress flattens it into a fresh payload, so the same model works."""
    p = _param((2, 3, 4, 5), layout="channels_last")
    opt = make_optimizer({"stock_cl": p}, hvd.Compression.none)
    with pytest.raises(ValueError, match="contiguous"):
        (p * torch.ones(2, 3, 4, 5)).sum().backward()
    q = _param((2, 3, 4, 5), layout="channels_last")
    opt = make_optimizer({"hvdc_cl": q}, hvd_compress.NoCompression())
    (q * (RANK + 1.0)).sum().backward()
    opt.synchronize()
    assert torch.equal(q.grad, torch.full((2, 3, 4, 5), (SIZE + 1) / 2.0))


# --- integer and bool tensors ----------------------------------------------------------------------------------------
INT_DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64]


@pytest.mark.parametrize("sid", IDS)
def test_integer_and_bool_pass_through_compress(sid):
    comp = SCHEMES[sid]()
    for dt in INT_DTYPES:
        t = torch.ones(5, dtype=dt)
        out, ctx = comp.compress(t)
        assert out is t and ctx is None
        assert comp.decompress(out, ctx) is t
    empty = torch.zeros(0, dtype=torch.int64)
    assert comp.compress(empty)[0] is empty
    assert comp.stats.per_tensor() == {}


@pytest.mark.parametrize("dtype", INT_DTYPES)
def test_integer_allreduce_same_as_uncompressed(dtype):
    """With or without hvd_compress, Horovod's own behaviour: int32/int64 sum, the rest refused by Horovod."""
    outcomes = []
    for i, comp in enumerate((hvd.Compression.none, hvd_compress.TopK(0.1))):
        try:
            r = hvd.allreduce(torch.full((3,), RANK + 1).to(dtype), op=hvd.Sum, compression=comp,
                              name=f"rel.int.{dtype}.{i}")
            outcomes.append(("ok", r.dtype, r.tolist()))
        except ValueError as e:
            outcomes.append(("refused", type(e).__name__, str(e)))
    assert outcomes[0] == outcomes[1], outcomes
    if dtype in (torch.int32, torch.int64):
        assert outcomes[0] == ("ok", dtype, [SIZE * (SIZE + 1) // 2] * 3)


# --- NaN / Inf --------------------------------------------------------------------------------------------------------
NF_SPECS = {"w": (16, 12), "v": (40,)}
BAD_AT = {"w": (3, 4), "v": (7,)}
BAD_STEP, NF_STEPS = 1, 4
BAD_RANK = SIZE - 1
#: schemes whose aggregate must carry the bad element (as uncompressed Horovod does).  Not here:
#: the sign vote (a bit cannot carry NaN), Random-K (the element may not be drawn), and for NaN
#: Threshold/DGC (|NaN| >= t is false: the element is dropped and forgotten).
NO_PROPAGATION = {"nan": {"SignSGD", "RandomK", "Threshold", "DGC"}, "inf": {"SignSGD", "RandomK"}}


def _bad(kind):
    return {"nan": float("nan"), "inf": float("inf")}[kind]


def _run_nonfinite(sid, kind):
    params = {n: _param(s) for n, s in NF_SPECS.items()}
    comp = SCHEMES[sid]()
    opt = make_optimizer(params, comp)

    def poison(name, step, g):
        if step == BAD_STEP and RANK == BAD_RANK:
            g = g.clone()
            g[BAD_AT[name]] = _bad(kind)
        return g

    grads, state_finite = [], []
    for step in range(NF_STEPS):
        opt.zero_grad()
        inject(params, step, poison)
        opt.synchronize()
        grads.append({n: p.grad.detach().clone() for n, p in params.items()})
        ad = comp.adapters["torch"]
        tensors = list(ad.residuals.values()) + [v for st in ad.memories.values() for v in st.values()]
        scheme_state = [v for param in ad.roles.store.params.values() for v in param.scheme.values()
                        if isinstance(v, torch.Tensor)]
        state_finite.append((all(bool(torch.isfinite(t).all()) for t in tensors),
                             all(bool(torch.isfinite(t).all()) for t in scheme_state)))
    # every rank's aggregate, to check they agree (NaN-aware)
    flat = torch.cat([torch.cat([g[n].reshape(-1) for n in NF_SPECS]) for g in grads])
    everyone = hvd.allgather(flat.reshape(1, -1), name=f"rel.nf.{sid}.{kind}")
    return grads, state_finite, everyone


_NF = {}


def nonfinite_run(sid, kind):
    if (sid, kind) not in _NF:
        _NF[(sid, kind)] = _run_nonfinite(sid, kind)
    return _NF[(sid, kind)]


@pytest.mark.parametrize("kind", ["nan", "inf"])
@pytest.mark.parametrize("sid", IDS)
def test_non_finite_step_propagates_like_horovod_and_ranks_agree(sid, kind):
    grads, _, everyone = nonfinite_run(sid, kind)
    for r in range(SIZE):
        a, b = everyone[r], everyone[0]
        assert torch.equal(torch.isfinite(a), torch.isfinite(b)), f"{sid}: rank {r}'s aggregate differs"
        assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)), f"{sid}: rank {r}'s aggregate differs"
    bad = grads[BAD_STEP]
    for name in NF_SPECS:
        nonfinite = ~torch.isfinite(bad[name])
        if sid not in NO_PROPAGATION[kind]:
            assert bool(nonfinite[BAD_AT[name]]), f"{sid}: the {kind} of {name}{BAD_AT[name]} did not arrive"
        if sid in ("NoCompression", "TopK", "Lossless"):  # element-wise schemes: only that element
            assert int(nonfinite.sum()) == 1, (sid, name, int(nonfinite.sum()))
    for step in range(BAD_STEP):
        assert all(bool(torch.isfinite(g).all()) for g in grads[step].values())


@pytest.mark.parametrize("kind", ["nan", "inf"])
@pytest.mark.parametrize("sid", IDS)
def test_error_feedback_state_clean_after_non_finite_step(sid, kind):
    _, state_finite, _ = nonfinite_run(sid, kind)
    for step, (memories_ok, _) in enumerate(state_finite):
        assert memories_ok, f"{sid}: an error-feedback memory is not finite after step {step}"


@pytest.mark.parametrize("kind", ["nan", "inf"])
@pytest.mark.parametrize("sid", IDS)
def test_next_steps_finite_after_non_finite_step(sid, kind):
    grads, state_finite, _ = nonfinite_run(sid, kind)
    for step in range(BAD_STEP + 1, NF_STEPS):
        for name, g in grads[step].items():
            assert bool(torch.isfinite(g).all()), f"{sid}: {name} at step {step} after the bad step: {g}"
        assert state_finite[step][1], f"{sid}: scheme state not finite at step {step}"


def _skip_step_training(sid):
    """AMP-style loop: a step whose aggregated gradient is not finite is skipped on every rank."""
    torch.manual_seed(11)
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1 if sid != "EFSignSGD" else 0.05),
                                   named_parameters=model.named_parameters(), compression=SCHEMES[sid]())
    rng = np.random.default_rng(5)
    x = torch.from_numpy(rng.standard_normal((64 * SIZE, 12)).astype(np.float32))
    y = torch.tanh(x @ torch.from_numpy(rng.standard_normal((12, 1)).astype(np.float32)))

    def full_loss():
        with torch.no_grad():
            return torch.nn.functional.mse_loss(model(x), y).item()

    before, skipped = full_loss(), []
    for step in range(25):
        lo = RANK * 64 + (step % 2) * 32
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[lo:lo + 32]), y[lo:lo + 32])
        if step == 3 and RANK == BAD_RANK:
            loss = loss * float("nan")  # every gradient of this rank is NaN
        loss.backward()
        opt.synchronize()
        if all(bool(torch.isfinite(p.grad).all()) for p in model.parameters()):
            with opt.skip_synchronize():
                opt.step()
        else:
            skipped.append(step)
    after = full_loss()
    w = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone = hvd.allgather(w.reshape(1, -1), name=f"rel.skip.{sid}")
    return before, after, skipped, w, everyone


@pytest.mark.parametrize("sid", REQUIRED)
def test_training_recovers_after_a_nan_step(sid):
    before, after, skipped, w, everyone = _skip_step_training(sid)
    for r in range(SIZE):
        assert torch.equal(everyone[r], everyone[0]), f"{sid}: replica {r} differs"
    assert skipped == [3], f"{sid}: skipped steps {skipped} (expected only the NaN step)"
    assert bool(torch.isfinite(w).all())
    assert after < 0.8 * before, f"{sid}: loss {before:.4f} -> {after:.4f}"
