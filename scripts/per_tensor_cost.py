#!/usr/bin/env python
"""What hvd_compress's path costs per tensor and step, over Horovod's own
``none``: a model of ``--tensors`` parameters of ``--numel`` elements each
(a real model's many small tensors: ResNet-50 has 161), trained by Horovod's
stock ``DistributedOptimizer`` under real horovodrun, each compression in
its own optimizer, the cases alternating over ``--rounds`` (every other
round reversed):

    horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python scripts/per_tensor_cost.py \\
        [--out docs/results/per_tensor_cost.json]

Rank 0 prints each case's median step and ``(step - none's step) / tensors``
in microseconds.  The codecs' own work on 1000 elements is a few
microseconds, so what is left is the per-call path: finding the parameter,
the plan, error feedback and the transport's bookkeeping.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

#: (scheme spec as ``hvd-compress bench`` reads it, the optimizer's momentum): momentum
#: in the compressor where the optimizer's is 0 (Auto's advice for sparsifiers)
CASES = (("none", 0.9), ("NoCompression()", 0.9), ("NoCompression(momentum=0.9)", 0.0), ("TopK(0.01)", 0.9),
         ("Auto()", 0.9), ("Auto(momentum=0.9)", 0.0))


def _compression(spec):
    from hvd_compress.tools.bench.specs import HOROVOD_SPECS, horovod_compression, parse_spec
    return horovod_compression(spec, "torch") if spec in HOROVOD_SPECS else parse_spec(spec)


def median_step(spec, momentum, tensors, numel, steps, warmup):
    """Median seconds of one optimizer step after ``warmup`` steps."""
    import torch
    import horovod.torch as hvd
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(numel)) for _ in range(tensors)]
    opt = hvd.DistributedOptimizer(torch.optim.SGD(params, lr=0.01, momentum=momentum),
                                   named_parameters=[(f"p{i}", p) for i, p in enumerate(params)],
                                   compression=_compression(spec))
    times = []
    for _ in range(warmup + steps):
        t0 = time.perf_counter()
        opt.zero_grad()
        sum((p * p).sum() for p in params).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warmup:])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", type=int, default=160)
    p.add_argument("--numel", type=int, default=1000)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10, help="untimed steps (Auto's calibration and decision among them)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None, help="JSON file for rank 0's numbers")
    a = p.parse_args(argv)
    import torch
    import horovod.torch as hvd
    hvd.init()
    torch.set_num_threads(1)
    steps = {spec: [] for spec, _ in CASES}
    for r in range(a.rounds):
        for spec, momentum in (CASES if r % 2 == 0 else CASES[::-1]):
            steps[spec].append(median_step(spec, momentum, a.tensors, a.numel, a.steps, a.warmup))
    if hvd.rank() == 0:
        base = statistics.median(steps["none"])
        rows = [{"case": spec, "optimizer_momentum": momentum, "round_median_step_s": steps[spec],
                 "median_step_s": statistics.median(steps[spec]),
                 "per_tensor_us": 1e6 * (statistics.median(steps[spec]) - base) / a.tensors} for spec, momentum in CASES]
        for r in rows:
            print(f"{r['case']:28s} step {1e3 * r['median_step_s']:7.2f} ms, per tensor over Horovod's none "
                  f"{r['per_tensor_us']:7.1f} us (rounds {[round(1e3 * s, 1) for s in r['round_median_step_s']]} ms)")
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"command": f"horovodrun -np {hvd.size()} -H localhost:{hvd.size()} --gloo "
                           f".venv/bin/python scripts/per_tensor_cost.py --out {a.out}",
                           "ranks": hvd.size(), "tensors": a.tensors, "numel": a.numel, "steps": a.steps,
                           "rounds": a.rounds, "rows": rows}, f, indent=1)
    hvd.shutdown()


if __name__ == "__main__":
    main()
