"""Smoke test of the Horovod stack for PyTorch.

Runs under ``horovodrun -np 2`` (scripts/run_tests.sh launches it with Gloo and
with MPI): ``hvd.allreduce`` and ``hvd.allgather`` give the right numbers, and a
3-step ``hvd.DistributedOptimizer`` with ``hvd.Compression.fp16`` keeps the
replicas bitwise identical.

Every rank runs every test in the same order and issues the same collectives
before it asserts anything, so one rank's failure cannot leave another waiting.
"""
import numpy as np
import pytest
import torch

import horovod.torch as hvd

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()


def test_world():
    assert SIZE >= 2, "the smoke test must run under horovodrun with at least 2 processes"
    assert 0 <= RANK < SIZE
    assert hvd.local_size() == SIZE  # all on localhost
    ranks = hvd.allgather(torch.tensor([RANK], dtype=torch.int64), name="smoke.ranks")
    assert ranks.tolist() == list(range(SIZE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int32, torch.int64])
def test_allreduce_sum_and_average(dtype):
    x = (torch.arange(12, dtype=torch.float64).reshape(3, 4) * (RANK + 1)).to(dtype)
    s = hvd.allreduce(x, op=hvd.Sum, name=f"smoke.sum.{dtype}")
    want_sum = torch.arange(12, dtype=torch.float64).reshape(3, 4) * (SIZE * (SIZE + 1) // 2)
    assert s.dtype == dtype and s.shape == x.shape
    assert torch.equal(s.to(torch.float64), want_sum)
    if dtype.is_floating_point:
        a = hvd.allreduce(x, op=hvd.Average, name=f"smoke.avg.{dtype}")
        np.testing.assert_allclose(a.numpy(), (want_sum / SIZE).numpy(), rtol=1e-6)


def test_allreduce_min_max_and_inplace():
    x = torch.tensor([float(RANK), -float(RANK), 5.0])
    mn = hvd.allreduce(x, op=hvd.Min, name="smoke.min")
    mx = hvd.allreduce(x, op=hvd.Max, name="smoke.max")
    y = torch.full((5,), float(RANK + 1))
    hvd.allreduce_(y, op=hvd.Sum, name="smoke.inplace")
    assert mn.tolist() == [0.0, -(SIZE - 1.0), 5.0]
    assert mx.tolist() == [SIZE - 1.0, 0.0, 5.0]
    assert y.tolist() == [SIZE * (SIZE + 1) / 2] * 5


def test_allreduce_fp16_compression_of_small_integers_is_exact():
    x = torch.full((7,), float(RANK + 1))
    s = hvd.allreduce(x, op=hvd.Sum, name="smoke.fp16", compression=hvd.Compression.fp16)
    assert s.dtype == torch.float32  # decompressed back to the input's dtype
    assert s.tolist() == [SIZE * (SIZE + 1) / 2] * 7


def test_allgather_variable_first_dimension():
    # rank r contributes r + 1 rows filled with r
    x = torch.full((RANK + 1, 3), float(RANK))
    g = hvd.allgather(x, name="smoke.gather")
    want = torch.cat([torch.full((r + 1, 3), float(r)) for r in range(SIZE)])
    assert torch.equal(g, want)
    b = hvd.allgather(torch.tensor([RANK, -RANK], dtype=torch.int8), name="smoke.gather.int8")
    assert b.dtype == torch.int8
    assert b.tolist() == [v for r in range(SIZE) for v in (r, -r)]


def test_broadcast_and_allgather_object():
    x = torch.full((4,), float(RANK + 10))
    hvd.broadcast_(x, root_rank=SIZE - 1, name="smoke.bcast")
    objs = hvd.allgather_object({"rank": RANK}, name="smoke.obj")
    assert x.tolist() == [SIZE - 1 + 10.0] * 4
    assert objs == [{"rank": r} for r in range(SIZE)]


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_distributed_optimizer_fp16_three_steps_replicas_identical():
    torch.manual_seed(1234 + RANK)  # different initial weights and data on every rank
    model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hvd.Compression.fp16, op=hvd.Average)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    start = _flat(model).clone()
    gen = torch.Generator().manual_seed(99 + RANK)
    losses = []
    for _ in range(3):
        x = torch.randn(32, 10, generator=gen)
        y = x.sum(dim=1, keepdim=True)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    w = _flat(model)
    everyone = hvd.allgather(w.reshape(1, -1), name="smoke.replicas")
    assert everyone.shape == (SIZE, w.numel())
    for r in range(SIZE):
        assert torch.equal(everyone[r], everyone[0]), f"replica {r} differs from replica 0"
    assert not torch.equal(w, start), "the weights did not move"
    assert all(np.isfinite(losses))
