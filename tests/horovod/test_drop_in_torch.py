"""Drop-in fidelity on the torch side, under ``horovodrun -np 2``.

Residuals and collective names follow Horovod's parameter names
(``optimizer._parameter_names``).  Horovod itself makes them unique: it names
the parameters of an optimizer built without ``named_parameters``
``allreduce.noname.<group>.<index>``, and refuses duplicate or missing names.
These tests check that hvd_compress keeps one residual per parameter in each
of those cases, finds the names in the grouped path too (a comprehension
frame, inlined by Python 3.12), and that the names do not change the numbers.
"""
import warnings

import pytest
import torch

import horovod.torch as hvd

import hvd_compress

hvd.init()
RANK = hvd.rank()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))


def _train(named, steps=4, **kwargs):
    """SGD on rank-specific data through the stock DistributedOptimizer; returns
    (weights, the compressor's residual keys, warnings raised)."""
    model = _model()
    comp = hvd_compress.TopK(0.5)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters() if named else None,
                                   compression=comp, **kwargs)
    gen = torch.Generator().manual_seed(100 + RANK)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            x, y = torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    keys = sorted(k[len("residual/"):] for k in comp.state_dict()["torch"] if k.startswith("residual/"))
    return [p.detach().clone() for p in model.parameters()], keys, [str(w.message) for w in caught]


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_unnamed_parameters_get_horovods_unique_names():
    unnamed, keys, caught = _train(named=False)
    assert keys == [f"allreduce.noname.0.{j}" for j in range(4)], keys
    assert not [w for w in caught if "fallback key" in w], caught
    named, named_keys, _ = _train(named=True)
    assert named_keys == ["0.bias", "0.weight", "2.bias", "2.weight"]
    _same(unnamed, named)  # names key the state; they must not change a single bit


def test_grouped_path_finds_every_name():
    grouped, keys, caught = _train(named=True, groups=2)
    assert keys == ["0.bias", "0.weight", "2.bias", "2.weight"], keys
    assert not [w for w in caught if "fallback key" in w], caught
    _same(grouped, _train(named=True)[0])


def test_duplicate_names_are_refused_by_horovod():
    """Two parameters can never share a residual through a repeated name:
    Horovod refuses the optimizer before any gradient is compressed."""
    model = _model()
    params = list(model.parameters())
    with pytest.raises(ValueError, match="must be unique"):
        hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.1),
                                 named_parameters=[("same", p) for p in params],
                                 compression=hvd_compress.TopK(0.5))
