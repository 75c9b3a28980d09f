"""The transports (hvd_compress/transports/), driven through the torch
adapter with collectives emulated in one process: every rank's compress,
then every rank's second round, then every rank's decompress, as the torch
adapter orders them under Horovod.

Here: the choice of transport, the typed pendings, and error feedback through
the memory on every transport, PowerSGD's included (a memory passed with
PowerSGD used to be replaced by a plain residual without a word)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import hvd_compress
from hvd_compress import Compressor, DGCMemory, ResidualMemory, schemes
from hvd_compress.transports import (ALLGATHER, ALLREDUCE, LOW_RANK, TWO_PHASE, Pending, TwoRoundPending,
                                     transport_for)
from in_process_world import InProcessAdapter, InProcessCollectives, World


def run(make, grads, size):
    """``grads[step][rank]`` through ``size`` emulated ranks; returns
    (aggregate[step] of rank 0, compressors).  Horovod's Average is emulated on
    what compress returns, so the placeholder carries the 1/size."""
    world = World(size)
    comps = [make() for _ in range(size)]
    adapters = [InProcessAdapter(world, r) for r in range(size)]
    for comp, adapter in zip(comps, adapters):
        comp.use_adapter("torch", adapter)
    out = []
    for step_grads in grads:
        world.posted.clear()
        started = [comp.compress(torch.from_numpy(g)) for comp, g in zip(comps, step_grads)]
        for adapter, (_, pending) in zip(adapters, started):
            if isinstance(pending, TwoRoundPending):
                adapter.roles.rounds.launch(pending)
        reduced = sum(t for t, _ in started) / size
        got = [comp.decompress(reduced.clone(), pending) for comp, (_, pending) in zip(comps, started)]
        for g in got[1:]:
            assert g.numpy().tobytes() == got[0].numpy().tobytes(), "replicas differ"
        out.append(got[0].numpy())
    return out, comps


def _grads(shape, size, steps, scale=1.0, seed=0):
    rng = np.random.default_rng(seed)
    return [[(rng.standard_normal(shape) * scale).astype(np.float32) for _ in range(size)] for _ in range(steps)]


# --- which transport carries what -----------------------------------------------------------
@pytest.mark.parametrize("scheme, shape, mode, size, expected", [
    (schemes.FP16(), (10,), "allgather", 2, ALLREDUCE),
    (schemes.RandomK(0.1), (100,), "allgather", 2, ALLREDUCE),
    (schemes.Int8(), (10,), "allgather", 2, ALLGATHER),
    (schemes.Int8(), (10,), "two_phase", 2, TWO_PHASE),
    (schemes.Int8(), (10,), "two_phase", 1, ALLGATHER),
    (schemes.Int8(), (65536,), "auto", 3, TWO_PHASE),
    (schemes.Int8(), (65535,), "auto", 3, ALLGATHER),
    (schemes.Int8(), (65536,), "auto", 2, ALLGATHER),
    (schemes.PowerSGD(2), (64, 64), "allgather", 2, LOW_RANK),
    (schemes.PowerSGD(2), (64,), "allgather", 2, ALLREDUCE),  # 1-D: sent as it is
    (schemes.PowerSGD(2), (3, 3), "allgather", 2, ALLREDUCE),  # too small for rank 2 to save bytes
])
def test_transport_for(scheme, shape, mode, size, expected):
    assert transport_for(scheme, mode, size, int(np.prod(shape)), shape) is expected


@pytest.mark.parametrize("make, shape, pending_type", [
    (lambda: hvd_compress.FP16(), (5, 4), "AllreducePending"),
    (lambda: hvd_compress.TopK(0.2), (5, 4), "AllgatherPending"),
    (lambda: hvd_compress.Int8(transport="two_phase"), (5, 4), "TwoPhasePending"),
    (lambda: hvd_compress.PowerSGD(1), (16, 16), "LowRankPending"),
])
def test_pendings_are_typed_and_hold_no_untyped_bags(make, shape, pending_type):
    """What crosses from compress to decompress is a dataclass of named
    fields: no string-keyed ``local`` dict, no handle names with prefixes."""
    world = World(2)
    comp = make()
    comp.use_adapter("torch", InProcessAdapter(world, 0))
    _, pending = comp.compress(torch.zeros(shape))
    assert type(pending).__name__ == pending_type and isinstance(pending, Pending)
    names = {f.name for f in dataclasses.fields(pending)}
    assert not names & {"local", "handles", "part_lengths"}


# --- torch packs a payload's parts into one allgather ---------------------------------------
@pytest.mark.parametrize("make, gathers_per_step", [
    (lambda: hvd_compress.TopK(0.1), 1),  # indices and values in one allgather
    (lambda: hvd_compress.TopK(0.1, values=schemes.Int8()), 1),
    (lambda: hvd_compress.EFSignSGD(), 1),
    (lambda: hvd_compress.Threshold(1.0), 4),  # lengths differ by rank: a gather per part and per length
], ids=["topk", "topk-int8", "efsignsgd", "threshold"])
def test_packed_gather_gives_the_per_part_gathers_result(make, gathers_per_step, monkeypatch):
    """The torch collectives send a payload's fixed-length parts as one allgather
    of their bytes (3 ranks: the second and third ranks' parts sit at
    offsets not aligned for their dtype); the aggregates and residuals are
    those of one allgather per part, bit for bit."""
    shape, size = (37, 29), 3
    grads = _grads(shape, size, 3)
    names = []
    gather = InProcessCollectives.allgather

    def counting(self, tensor, name, process_set):
        names.append(name)
        return gather(self, tensor, name, process_set)

    monkeypatch.setattr(InProcessCollectives, "allgather", counting)
    packed, packed_comps = run(make, grads, size)
    assert len(names) == 3 * size * gathers_per_step, names
    monkeypatch.setattr(InProcessCollectives, "packs_gathers", False)
    per_part, per_part_comps = run(make, grads, size)
    for a, b in zip(packed, per_part):
        assert a.tobytes() == b.tobytes()
    for a, b in zip(packed_comps, per_part_comps):
        ra, rb = a.adapters["torch"].residuals["w"], b.adapters["torch"].residuals["w"]
        assert ra.numpy().tobytes() == rb.numpy().tobytes()


# --- error feedback through the memory, on every transport ----------------------------------
class _CountingMemory(ResidualMemory):
    """Plain error feedback that counts its calls."""

    def __init__(self):
        self.calls = {"compensate": 0, "update": 0}

    def compensate(self, B, x, state):
        self.calls["compensate"] += 1
        return super().compensate(B, x, state)

    def update(self, B, acc, sent, state):
        self.calls["update"] += 1
        return super().update(B, acc, sent, state)


@pytest.mark.parametrize("scheme, transport, shape", [
    (schemes.FP16(), "allgather", (6, 5)),
    (schemes.TopK(0.2), "allgather", (6, 5)),
    (schemes.Int8(), "two_phase", (6, 5)),
    (schemes.PowerSGD(1), "allgather", (16, 16)),
])
def test_every_transport_calls_the_memory(scheme, transport, shape):
    memories = []

    def make():
        memories.append(_CountingMemory())
        return Compressor(scheme, error_feedback=True, memory=memories[-1], transport=transport)

    run(make, _grads(shape, 2, 3), 2)
    for memory in memories:
        assert memory.calls == {"compensate": 3, "update": 3}


def test_powersgd_uses_dgc_memory_clipping():
    """DGCMemory(momentum=0, clip_norm=c) with PowerSGD equals plain error
    feedback on gradients clipped beforehand, bit for bit: the memory is used,
    not replaced by a plain residual."""
    shape, size, clip = (16, 12), 2, 0.5
    grads = _grads(shape, size, 4, scale=3.0)
    with_memory, comps = run(lambda: Compressor(schemes.PowerSGD(2), error_feedback=True,
                                                memory=DGCMemory(momentum=0.0, clip_norm=clip)), grads, size)

    def clipped(g):
        x = torch.from_numpy(g).reshape(-1)
        norm = torch.linalg.vector_norm(x)
        factor = torch.where(norm > clip, clip / torch.maximum(norm, norm * 0 + 1e-30), norm * 0 + 1.0)
        return (x * factor).reshape(shape).numpy()

    pre_clipped, _ = run(lambda: Compressor(schemes.PowerSGD(2), error_feedback=True),
                         [[clipped(g) for g in step] for step in grads], size)
    unclipped, _ = run(lambda: Compressor(schemes.PowerSGD(2), error_feedback=True), grads, size)
    for step in range(len(grads)):
        np.testing.assert_array_equal(with_memory[step], pre_clipped[step])
        assert not np.array_equal(with_memory[step], unclipped[step])
    assert "memory/momentum/w" in comps[0].state_dict()["torch"]


def test_powersgd_refuses_dgc_momentum():
    """DGC's momentum factor masking would reset the momentum at every step,
    since a low-rank approximation sends every element: refused, naming the
    parameter, instead of accepted and dropped."""
    with pytest.raises(ValueError, match=r"DGCMemory\(momentum=0.9\).*PowerSGD"):
        Compressor(schemes.PowerSGD(2), error_feedback=True, memory=DGCMemory(momentum=0.9))
    Compressor(schemes.PowerSGD(2), error_feedback=True, memory=DGCMemory(momentum=0.0, clip_norm=1.0))
