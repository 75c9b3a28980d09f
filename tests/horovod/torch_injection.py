"""Driving the stock ``hvd.DistributedOptimizer`` with injected gradients, and the
numpy reference those runs are checked against: shared by the torch integration
files that run under horovodrun (test_torch_compression.py,
test_process_set_torch.py).  Each file calls ``hvd.init()`` itself -- with the
static process sets it needs -- before calling anything here."""
import torch

import horovod.torch as hvd

from compression_cases import G, assert_matches, check_indices
from compression_cases import simulate as ref_simulate

from hvd_compress.backend import backend_for
from hvd_compress.cross_rank import stable_hash
from hvd_compress.backend import TorchBackend
from torch_params import Params

TB = backend_for(torch.zeros(0))

SPECS = {  # name -> shape; 'big' has > 256 elements so DGC really samples with a random offset
    "big.weight": (40, 25),
    "mid.weight": (8, 16),
    "vec": (100,),
    "tiny": (7,),
}


# --- driving the stock optimizer -------------------------------------------------------------------


def inject(named, step, micro=0, order=None, grad=G):
    """backward() of sum(p * G_rank): afterwards p.grad == G_rank (accumulated over micro-batches).
    ``grad(name, rank, step, shape, micro)``: the gradients (default compression_cases.G)."""
    terms = named if order is None else order(step, named)
    loss = 0.0
    for name, p in terms:
        loss = loss + (p * torch.from_numpy(grad(name, hvd.rank(), step, tuple(p.shape), micro))).sum()
    loss.backward()


def run_injected(comp, steps=3, specs=SPECS, order=None, bpps=1, grad=G, **opt_kw):
    """Drive the stock DistributedOptimizer with injected gradients (``grad``, as in
    :func:`inject`); returns ``[{name: aggregated grad (numpy)} per step]``."""
    model = Params(specs)
    named = list(model.named_parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0), named_parameters=named,
                                   compression=comp, backward_passes_per_step=bpps, **opt_kw)
    out = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        for micro in range(bpps):
            inject(named, step, micro, order, grad)
        opt.synchronize()
        out.append({name: p.grad.detach().clone().numpy() for name, p in named})
    return out


# --- the reference -------------------------------------------------------------------------------------
def uniform_fn_for(comp, key):
    """The adapter's private draws, reproduced: ``uniform_fn(step, set_rank, n)``."""
    def fn(step, set_rank, n):
        seed = TorchBackend.seed_for(None, stable_hash(comp.seed, key, set_rank), step + 1)
        gen = torch.Generator().manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
        return torch.rand(n, generator=gen, dtype=torch.float32).numpy()
    return fn


def indices_fn_for(comp, key):
    """Random-K's shared-seed coordinates: drawn by the product's randperm_prefix from the
    documented shared seed (so equal on every rank), checked for sanity here."""
    def fn(step, numel, k):
        seed = TorchBackend.seed_for(None, stable_hash(comp.seed, key), step + 1)
        return check_indices(TB.randperm_prefix(numel, k, seed, like=torch.zeros(1)).numpy(), numel, k)
    return fn


def simulate(comp, name, steps=3, ranks=None, shape=None, key=None, **kw):
    ranks = list(range(hvd.size())) if ranks is None else list(ranks)
    key = name if key is None else key
    return ref_simulate(comp, name, SPECS[name] if shape is None else shape, ranks, steps=steps,
                        uniform_fn=uniform_fn_for(comp, key), indices_fn=indices_fn_for(comp, key), **kw)


def check_run(sid, comp, got, what, steps=3, **kw):
    for name in SPECS:
        sim, _ = simulate(comp, name, steps=steps, **kw)
        assert_matches(sid, [g[name] for g in got], sim.aggregated, f"{name} {what} (rank {hvd.rank()} of {hvd.size()})")
