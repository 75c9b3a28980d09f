#!/usr/bin/env python
"""What a tensor costs per collective it enters, besides its bytes
(``cost_model.ENTRY_S``): Horovod's enqueue, negotiation and completion of
one entry, timed on tensors of 8 elements, ``--tensors`` at a time (as a
step's many small tensors arrive), under real horovodrun:

    horovodrun -np 2 -H localhost:2 --gloo .venv/bin/python scripts/collective_entry_cost.py \\
        [--out docs/results/collective_entry_cost.json]

Rank 0 prints, per kind and repeat, the microseconds per call to enqueue
(``*_async``) and to complete (``synchronize``, in the order enqueued).  The
names repeat from one repeat to the next, as a step's do (Horovod's response
cache); the first repeat is a warm-up, left out of the median.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", type=int, default=200, help="entries enqueued before the first is waited on")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", default=None, help="JSON file for rank 0's numbers")
    a = p.parse_args(argv)
    import torch
    import horovod.torch as hvd
    hvd.init()
    x = torch.zeros(8)
    calls = {"allreduce": lambda name: hvd.allreduce_async(x, name=name, op=hvd.Sum),
             "allgather": lambda name: hvd.allgather_async(x, name=name)}
    rows = []
    for kind, call in calls.items():
        for rep in range(a.reps):
            t0 = time.perf_counter()
            handles = [call(f"entry.{kind}.{i}") for i in range(a.tensors)]  # as a step repeats its names
            t1 = time.perf_counter()
            for h in handles:
                hvd.synchronize(h)
            t2 = time.perf_counter()
            rows.append({"kind": kind, "rep": rep, "enqueue_us": 1e6 * (t1 - t0) / a.tensors,
                         "complete_us": 1e6 * (t2 - t1) / a.tensors})
    if hvd.rank() == 0:
        for r in rows:
            print(f"{r['kind']:9s} rep {r['rep']}: enqueue {r['enqueue_us']:5.1f} us, complete {r['complete_us']:5.1f} us")
        total = [r["enqueue_us"] + r["complete_us"] for r in rows if r["rep"] > 0]  # rep 0: warm-up
        print(f"per entry: median {statistics.median(total):.1f} us, range {min(total):.1f}-{max(total):.1f} us "
              f"({hvd.size()} ranks, {a.tensors} entries at a time)")
        if a.out:
            with open(a.out, "w") as f:
                json.dump({"command": "horovodrun -np %d -H localhost:%d --gloo .venv/bin/python "
                           "scripts/collective_entry_cost.py" % (hvd.size(), hvd.size()),
                           "ranks": hvd.size(), "tensors": a.tensors, "rows": rows,
                           "median_us": statistics.median(total)}, f, indent=1)
    hvd.shutdown()


if __name__ == "__main__":
    main()
