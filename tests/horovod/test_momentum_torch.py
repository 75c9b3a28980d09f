"""Momentum-aware error feedback (hvd_compress.MomentumMemory) through the stock
torch ``hvd.DistributedOptimizer`` under horovodrun, and the recipe warnings.

* With a lossless exchange, ``NoCompression(momentum=0.9)`` + ``SGD(momentum=0)``
  trains exactly like Horovod's dense ``SGD(momentum=0.9)``: the momentum only
  moved in front of the exchange.
* Every lossy scheme (allgather, allreduce, PowerSGD's two rounds, two-phase)
  trains with ``momentum=``: the loss falls, the replicas stay identical, and the
  velocity is kept per parameter.
* The velocity is checkpointed with ``state_dict`` like the residual: a resumed
  run is bit-identical to an uninterrupted one, and not without the state.
* The optimizer's momentum is read from Horovod's frame at the first step: a sign
  scheme or Random-K with error feedback under ``SGD(momentum=0.9)`` or Adam
  warns, momentum given twice warns, the recommended placement does not.
"""
import io
import warnings

import numpy as np
import pytest
import torch

import horovod.torch as hvd

import hvd_compress as hc
from hvd_compress.feedback.momentum_check import RecipeWarning

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()


def _mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))


def _data(step):
    """This rank's batch for a step (ranks see different data)."""
    gen = torch.Generator().manual_seed(1000 * step + RANK)
    x = torch.randn(16, 12, generator=gen)
    return x, (x[:, :3].sum(1) > 0).long() + (x[:, 3] > 1).long()


def _build(make, seed=1, momentum=0.0, optimizer=None):
    model = _mlp(seed)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    comp = make() if callable(make) else make
    inner = optimizer(model.parameters()) if optimizer else torch.optim.SGD(model.parameters(), lr=0.1,
                                                                             momentum=momentum)
    opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), compression=comp)
    return model, opt, comp


def _train(model, opt, steps, first=0):
    losses = []
    for step in range(first, first + steps):
        x, y = _data(step)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


def _same_on_every_rank(model, what):
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = hvd.allgather(flat.unsqueeze(0), name=f"check.{what}")
    for r in range(SIZE):
        assert torch.equal(every[r], every[0]), f"{what}: rank {r}'s weights differ from rank 0's"


def test_lossless_momentum_in_the_compressor_is_momentum_sgd():
    model_a, opt_a, _ = _build(hvd.Compression.none, momentum=0.9)
    _train(model_a, opt_a, 6)
    model_b, opt_b, comp = _build(hc.NoCompression(momentum=0.9), momentum=0.0)
    _train(model_b, opt_b, 6)
    for a, b in zip(_weights(model_a), _weights(model_b)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    assert set(comp.adapters["torch"].memories) == {"momentum"}
    assert not comp.adapters["torch"].residuals  # no error feedback: no residual
    # each rank keeps its own velocity (its gradients differ), not the buffer Horovod
    # reduced in place (which would hold the same average on every rank)
    for name, u in comp.adapters["torch"].memories["momentum"].items():
        every = hvd.allgather(u.detach().reshape(1, -1), name=f"check.velocity.{name}")
        assert not torch.equal(every[0], every[1]), f"{name}: the velocity is the reduced buffer"


SCHEMES = {
    "TopK": lambda: hc.TopK(0.1, momentum=0.9),
    "EFSignSGD": lambda: hc.EFSignSGD(momentum=0.9),
    "RandomK": lambda: hc.RandomK(0.1, momentum=0.9),
    "OneBit-nesterov": lambda: hc.OneBit(momentum=0.9, nesterov=True),
    "PowerSGD": lambda: hc.PowerSGD(2, momentum=0.9),
    "TopK-two-phase": lambda: hc.TopK(0.1, momentum=0.9, transport="two_phase"),
    "SignSGD-signum": lambda: hc.SignSGD(momentum=0.9),
    "dgc_warmup-schedule": lambda: hc.Schedule.dgc_warmup(warmup_steps=4, steps_per_stage=5, final_ratio=0.1,
                                                          momentum=0.9),
    "Policy": lambda: hc.Policy([hc.Rule(hc.none(momentum=0.9), name="*bias")],
                                default=hc.EFSignSGD(momentum=0.9)),
}


@pytest.mark.parametrize("sid", list(SCHEMES))
def test_every_scheme_trains_with_momentum_in_the_compressor(sid):
    model, opt, comp = _build(SCHEMES[sid], momentum=0.0,
                              optimizer=(lambda ps: torch.optim.SGD(ps, lr=0.005)) if "SignSGD" in sid else None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RecipeWarning)  # the recommended placement does not warn
        losses = _train(model, opt, 30)
    assert np.isfinite(losses).all()
    assert np.mean(losses[-5:]) < np.mean(losses[:5]), (sid, losses)
    _same_on_every_rank(model, sid)
    ad = comp.adapters["torch"]
    names = [n for n, _ in model.named_parameters()]
    assert set(ad.memories["momentum"]) == set(names)
    assert all(torch.count_nonzero(v) > 0 for v in ad.memories["momentum"].values())
    if comp.error_feedback:  # the policy's biases go dense, with momentum and without a residual
        # (two-phase also keeps the owner's stage-2 residual, "<name>#owned_chunk")
        assert {k for k in ad.residuals if "#" not in k} == {
            n for n in names if not (sid == "Policy" and n.endswith("bias"))}


CKPT = {
    "TopK": lambda: hc.TopK(0.1, momentum=0.9),
    "EFSignSGD-nesterov": lambda: hc.EFSignSGD(momentum=0.9, nesterov=True),
    "PowerSGD": lambda: hc.PowerSGD(2, momentum=0.9),
}
N_BEFORE, M_AFTER = 3, 3


@pytest.mark.parametrize("cid", list(CKPT))
def test_momentum_state_checkpoint_resume_is_bit_identical(cid):
    model, opt, comp = _build(CKPT[cid])
    _train(model, opt, N_BEFORE + M_AFTER)
    straight = _weights(model)

    model, opt, comp = _build(CKPT[cid])
    _train(model, opt, N_BEFORE)
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "hvd_compress": comp.state_dict()}, buf)

    model, opt, comp = _build(CKPT[cid], seed=2)
    blob = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    keys = set(blob["hvd_compress"]["torch"])
    names = {n for n, _ in model.named_parameters()}
    assert {k for k in keys if k.startswith("memory/momentum/")} == {f"memory/momentum/{n}" for n in names}, keys
    model.load_state_dict(blob["model"])
    opt.load_state_dict(blob["optimizer"])
    comp.load_state_dict(blob["hvd_compress"])
    _train(model, opt, M_AFTER, first=N_BEFORE)
    for a, b in zip(_weights(model), straight):
        assert torch.equal(a, b), f"{cid}: resumed weights differ from the uninterrupted run"

    model, opt, comp = _build(CKPT[cid], seed=2)  # control: the velocity and residual left out
    model.load_state_dict(blob["model"])
    opt.load_state_dict(blob["optimizer"])
    _train(model, opt, M_AFTER, first=N_BEFORE)
    assert any(not torch.equal(a, b) for a, b in zip(_weights(model), straight)), \
        f"{cid}: the run without the compressor state is identical -- the test would not catch a lost state"


# --- warnings -----------------------------------------------------------------------------------------------
def _first_step_warnings(make, **build):
    model, opt, _ = _build(make, **build)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train(model, opt, 2)
    return [str(w.message) for w in caught if issubclass(w.category, RecipeWarning)]


@pytest.mark.parametrize("scheme", ["EFSignSGD", "OneBit", "RandomK"])
def test_large_residual_scheme_under_sgd_momentum_warns_once(scheme):
    make = (lambda: hc.RandomK(0.1)) if scheme == "RandomK" else getattr(hc, scheme)
    got = _first_step_warnings(make, momentum=0.9)
    assert len(got) == 1, got  # once, not per tensor or per step
    assert scheme in got[0] and "momentum 0.9" in got[0] and f"hvd_compress.{scheme}(..., momentum=0.9)" in got[0]


def test_sign_scheme_under_adam_warns_with_beta1():
    got = _first_step_warnings(hc.EFSignSGD, optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-3, betas=(0.8, 0.99)))
    assert len(got) == 1 and "Adam" in got[0] and "momentum 0.8" in got[0], got


def test_momentum_twice_warns():
    got = _first_step_warnings(lambda: hc.TopK(0.1, momentum=0.9), momentum=0.9)
    assert len(got) == 1 and "compounds" in got[0] and "momentum to 0" in got[0], got


@pytest.mark.parametrize("make, momentum", [
    (hc.EFSignSGD, 0.0),                                   # plain SGD: error feedback is safe
    (lambda: hc.EFSignSGD(momentum=0.9), 0.0),             # the recommended placement
    (lambda: hc.TopK(0.1), 0.9),                           # Top-K's residual is small: trains under momentum
    (lambda: hc.EFSignSGD(error_feedback=False), 0.9),     # no error feedback, nothing released late
])
def test_no_warning_where_the_recipe_trains(make, momentum):
    assert _first_step_warnings(make, momentum=momentum) == []


def test_policy_warns_for_its_sign_rule():
    pol = hc.Policy([hc.Rule(hc.OneBit(), min_ndim=2)], default=hc.none())
    got = _first_step_warnings(pol, momentum=0.9)
    assert len(got) == 1 and "OneBit" in got[0], got
