"""PowerSGD's preallocated torch rounds (hvd_compress/codecs/torch_lowrank.py;
on the CPU its C passes, tested alone in test_kernels_lowrank.py) against the
scheme's eager chain (``HVDC_KERNELS=0``), through the real transport and
torch adapter with ranks emulated in one process (in_process_world): the same
aggregates, residuals, Q and payloads to a relative 1e-5 over several steps
with every memory, NaN handled alike, the buffers reused, the batched QR
equal to one QR per matrix bit for bit."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import hvd_compress
from hvd_compress import Compressor, DGCMemory, MomentumMemory, schemes
from hvd_compress.codecs.torch_lowrank import LowRankCodec
from hvd_compress.transports import TwoRoundPending
from hvd_compress.transports.lowrank import starting_q
from in_process_world import InProcessAdapter, World

#: relative to the norm of the compared tensor: float32 sums in another order
TOL = 1e-5


def run(make, grads, kernels, monkeypatch, shape):
    """``grads[step][rank]`` through emulated ranks, Horovod's Average applied
    to the placeholder; returns per step the aggregate of every rank, the
    P and Q payloads of rank 0, and at the end the compressors and pendings."""
    monkeypatch.setenv("HVDC_KERNELS", "1" if kernels else "0")
    size = len(grads[0])
    world = World(size)
    comps = [make() for _ in range(size)]
    for r, comp in enumerate(comps):
        comp.use_adapter("torch", InProcessAdapter(world, r))
    steps = []
    for step_grads in grads:
        world.posted.clear()
        started = [comp.compress(torch.from_numpy(g.copy()).reshape(shape)) for comp, g in zip(comps, step_grads)]
        for comp, (_, pending) in zip(comps, started):
            if isinstance(pending, TwoRoundPending):
                comp.adapters["torch"].roles.rounds.launch(pending)
        reduced = sum(t for t, _ in started) / size
        got = [comp.decompress(reduced.clone(), pending).numpy().copy() for comp, (_, pending) in zip(comps, started)]
        wire = {name[-1]: t[0].numpy().copy() for (kind, name), t in world.posted.items()}
        steps.append((got, wire))
    return steps, comps, [p for _, p in started]


def close(a, b, what):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, what
    err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
    assert err <= TOL, f"{what}: relative error {err:.2e}"


MEMORIES = {
    "none": lambda: dict(error_feedback=False),
    "residual": lambda: dict(error_feedback=True),
    "momentum": lambda: dict(error_feedback=True, memory=MomentumMemory(0.9)),
    "dgc-clip": lambda: dict(error_feedback=True, memory=DGCMemory(momentum=0.0, clip_norm=5.0)),
}


@pytest.mark.parametrize("memory", list(MEMORIES))
@pytest.mark.parametrize("shape, rank", [((64, 48), 4), ((20, 6, 5), 1), ((96, 40), 2)])
def test_equals_the_eager_chain(memory, shape, rank, monkeypatch):
    size, steps = 3, 4
    rng = np.random.default_rng(7)
    grads = [[rng.standard_normal(int(np.prod(shape))).astype(np.float32) for _ in range(size)] for _ in range(steps)]

    def make():
        return Compressor(schemes.PowerSGD(rank), **MEMORIES[memory]())

    fused, fused_comps, fused_pending = run(make, grads, True, monkeypatch, shape)
    eager, eager_comps, eager_pending = run(make, grads, False, monkeypatch, shape)
    assert all(p.codec is not None for p in fused_pending) and all(p.codec is None for p in eager_pending)
    for step, ((f_got, f_wire), (e_got, e_wire)) in enumerate(zip(fused, eager)):
        for r in range(size):
            assert f_got[r].tobytes() == f_got[0].tobytes(), "replicas differ"
        close(f_got[0], e_got[0], f"aggregate at step {step}")
        # the payloads are laid out as the eager path's: ranks on either path add up
        assert sorted(f_wire) == sorted(e_wire) == ["p", "q"]
        close(f_wire["p"], e_wire["p"], f"P sent at step {step}")
        close(f_wire["q"], e_wire["q"], f"Q sent at step {step}")
    for fc, ec in zip(fused_comps, eager_comps):
        fs, es = fc.state_dict()["torch"], ec.state_dict()["torch"]
        assert sorted(fs) == sorted(es)
        for name in fs:
            assert fs[name].shape == es[name].shape, name
            if fs[name].is_floating_point():
                close(fs[name].numpy(), es[name].numpy(), name)
            else:
                assert torch.equal(fs[name], es[name]), name


def test_nonfinite_gradient_handled_as_the_eager_chain(monkeypatch):
    """A NaN in one rank's gradient: the aggregate is NaN, as an uncompressed
    one would be, but neither the residual nor Q keeps it (Q falls back to the
    seeded start), exactly as the eager chain."""
    shape, size = (32, 24), 2
    rng = np.random.default_rng(3)
    grads = [[rng.standard_normal(32 * 24).astype(np.float32) for _ in range(size)] for _ in range(3)]
    grads[1][0][5] = np.nan

    def make():
        return Compressor(schemes.PowerSGD(2), error_feedback=True)

    fused, fcomps, _ = run(make, grads, True, monkeypatch, shape)
    eager, ecomps, _ = run(make, grads, False, monkeypatch, shape)
    assert np.isnan(fused[1][0][0]).all() and np.isnan(eager[1][0][0]).all()
    close(fused[2][0][0], eager[2][0][0], "aggregate after the NaN")
    for fc, ec in zip(fcomps, ecomps):
        fs, es = fc.state_dict()["torch"], ec.state_dict()["torch"]
        assert torch.isfinite(fs["residual/w"]).all() and torch.isfinite(fs["scheme/w/Q"]).all()
        close(fs["residual/w"].numpy(), es["residual/w"].numpy(), "residual")
        close(fs["scheme/w/Q"].numpy(), es["scheme/w/Q"].numpy(), "Q")


def test_first_q_is_the_seeded_start(monkeypatch):
    """Before the first step's finish, the Q both paths multiply by is the
    seeded starting Q, laid out for the codec (its transpose contiguous)."""
    monkeypatch.setenv("HVDC_KERNELS", "1")
    comp = Compressor(schemes.PowerSGD(3), error_feedback=True)
    adapter = comp.use_adapter("torch", InProcessAdapter(World(1), 0))
    _, pending = comp.compress(torch.ones(40, 30))
    q = adapter.roles.store.params.of("w").scheme["Q"]
    expected = starting_q(adapter.B, pending.q_seed, (30, 3), torch.zeros(1))
    assert torch.equal(q, expected) and q.t().is_contiguous()


def test_buffers_are_reused_and_the_result_written_into_the_gradient(monkeypatch):
    """From the second step on, the residual, Q and the workspace buffers are
    the same tensors, and the aggregate lands in the gradient's own buffer
    (Horovod's optimizer replaces the gradient by it)."""
    monkeypatch.setenv("HVDC_KERNELS", "1")
    from hvd_compress.tools.bench.local import BENCH_KEY, local_compressor
    comp = local_compressor(hvd_compress.PowerSGD(4), "torch")
    grad = torch.randn(128, 96)
    seen = []
    for _ in range(3):
        grad.copy_(torch.randn(128, 96))
        out, ctx = comp.compress(grad)
        dense = comp.decompress(out, ctx)
        assert dense.data_ptr() == grad.data_ptr()
        state = comp.adapters["torch"].roles.store.params.of(BENCH_KEY)
        seen.append({"residual": state.residual.data_ptr(), "Q": state.scheme["Q"].data_ptr(),
                     **{k: v.data_ptr() for k, v in state.workspace.items()}})
    assert seen[1] == seen[2] and {"lowrank.P", "lowrank.Q", "lowrank.Qt_local"} <= set(seen[2])


def test_batched_qr_equals_one_qr_per_matrix():
    gen = torch.Generator().manual_seed(0)
    ps = [torch.randn(50, 4, generator=gen), torch.randn(30, 2, generator=gen), torch.randn(50, 4, generator=gen),
          torch.randn(50, 4, generator=gen)]
    got = LowRankCodec.orthonormalize(ps)
    for p, q in zip(ps, got):
        assert torch.equal(q, torch.linalg.qr(p).Q)


def test_row_blocks_cover_every_row(monkeypatch):
    """The torch finish (what runs where the C passes do not: no compiler, a rank
    above their limit): more rows than one CPU block holds, and a last partial
    block; the aggregate equals the eager chain's."""
    import hvd_compress.codecs.torch_lowrank as tl
    monkeypatch.setattr(tl, "BLOCK_ELEMENTS", 7 * 16)
    monkeypatch.setattr(tl, "_kernels_for", lambda t, rank: None)
    shape = (45, 16)
    rng = np.random.default_rng(1)
    grads = [[rng.standard_normal(45 * 16).astype(np.float32) for _ in range(2)] for _ in range(2)]

    def make():
        return Compressor(schemes.PowerSGD(2), error_feedback=True)

    fused, _, _ = run(make, grads, True, monkeypatch, shape)
    eager, _, _ = run(make, grads, False, monkeypatch, shape)
    for (f, _), (e, _) in zip(fused, eager):
        close(f[0], e[0], "aggregate")
