#!/usr/bin/env python
"""PowerSGD's products on this CPU, each as a multiple of a copy.

    .venv/bin/python scripts/powersgd_products.py [--rows 15625] [--cols 1024] [--rank 4] [--reps 7] \
        [--out docs/results/powersgd_products.json]

One thread.  Each operation runs between two ``dst.copy_(src)`` of the same
``rows x cols`` float32 matrix, and its thread CPU time is divided by the
mean of theirs (median over ``--reps`` rounds, each round running every
operation once, so they alternate): the load of other processes
inflates it less than wall time.  What ``hvd_compress.codecs.torch_lowrank``
chose from, one after the other in one process: the layouts of the two thin products, the outer product by a
``gemm`` of inner dimension ``rank`` against ``rank`` multiply-adds over
cache-sized row blocks, the torch finish it runs where the C kernels are
not built, and the three passes of the C kernels (``hvdc_lowrank_*``) it runs
on the CPU: M = g + residual with P = M Q, Q^T = P^T M, and the finish.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=15625)
    ap.add_argument("--cols", type=int, default=1024)
    ap.add_argument("--rank", type=int, default=4)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import torch
    torch.set_num_threads(1)
    from hvd_compress.codecs import torch_lowrank as tl
    n, m, r = args.rows, args.cols, args.rank
    gen = torch.Generator().manual_seed(0)
    src, dst = torch.randn(n, m, generator=gen), torch.empty(n, m)
    mat, grad, out = torch.randn(n, m, generator=gen), torch.randn(n, m, generator=gen), torch.empty(n, m)
    q_row = torch.randn(m, r, generator=gen)
    q_col = q_row.t().contiguous().t()
    p_row = torch.linalg.qr(torch.randn(n, r, generator=gen)).Q.contiguous()
    p_col = torch.linalg.qr(p_row).Q  # column-major, as the QR returns it
    qt = torch.randn(r, m, generator=gen)
    p_out, q_out = torch.empty(n, r), torch.empty(m, r)
    ws = {}

    def ratio(f):
        t0 = time.thread_time()
        dst.copy_(src)
        t1 = time.thread_time()
        f()
        t2 = time.thread_time()
        dst.copy_(src)
        t3 = time.thread_time()
        return (t2 - t1) / ((t1 - t0 + t3 - t2) / 2)

    def finish():
        tl._outer_and_residual(p_col, qt, qt, out, mat, ws, True)

    lib = tl.native.load()
    P = tl._ptr
    qt_out = torch.empty(r, m)

    def c_first():  # the residual is mat: M = g + mat, written into mat, and P = M Q
        tl._check(lib.hvdc_lowrank_first(P(grad), P(mat), n, m, r, P(q_col), P(p_out)), "first")

    def c_project():
        tl._check(lib.hvdc_lowrank_project(P(mat), n, m, r, P(p_col), p_col.stride(0), p_col.stride(1), P(qt_out)),
                  "project")

    def c_finish():
        tl._check(lib.hvdc_lowrank_finish(P(p_col), p_col.stride(0), p_col.stride(1), n, m, r, P(qt), P(qt),
                                          P(mat), P(out)), "finish")

    ops = [
        ("M += g, in place (the torch rounds)", lambda: mat.add_(grad)),
        ("P = M Q, Q column-major (the torch rounds)", lambda: torch.mm(mat, q_col, out=p_out)),
        ("P = M Q, Q row-major", lambda: torch.mm(mat, q_row, out=p_out)),
        ("Q^T = P^T M, P column-major (the torch rounds)", lambda: torch.mm(p_col.t(), mat)),
        ("Q = M^T P (the eager chain)", lambda: torch.mm(mat.t(), p_row, out=q_out)),
        ("out = P Q^T by gemm", lambda: torch.mm(p_row, qt, out=out)),
        ("out = P Q^T by gemm, P column-major", lambda: torch.mm(p_col, qt, out=out)),
        ("out = P Q^T, rank 1, by gemm", lambda: torch.mm(p_row[:, :1], qt[:1], out=out)),
        ("out = P Q^T by multiply-adds in row blocks (the torch rounds)", lambda: tl._outer(p_col, qt, out, ws)),
        ("finish: aggregate + residual + NaN test (the torch rounds)", finish),
    ]
    if lib is not None:
        ops += [
            ("C: M = g + residual into the residual, and P = M Q (one pass)", c_first),
            ("C: Q^T = P^T M, P column-major (one pass)", c_project),
            ("C: finish: aggregate + residual - P Q^T, non-finite to 0 (one pass)", c_finish),
        ]
    for _, f in ops:  # warm-up
        f()
    seen = {name: [] for name, _ in ops}
    for _ in range(args.reps):  # every op once per round, so the machine's load falls on all alike
        for name, f in ops:
            seen[name].append(ratio(f))
    rows = []
    print(f"{n} x {m} float32, rank {r}, one thread: thread CPU time / dst.copy_(src), "
          f"median of {args.reps} rounds (load average {os.getloadavg()[0]:.1f})")
    for name, _ in ops:
        x = sorted(seen[name])[len(seen[name]) // 2]
        rows.append({"op": name, "ratio_to_copy": x})
        print(f"  {x:6.2f}  {name}")
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"rows": n, "cols": m, "rank": r, "reps": args.reps, "loadavg_1m": os.getloadavg()[0],
                       "torch": torch.__version__, "blas": "mkl" if torch.backends.mkl.is_available() else "other",
                       "ops": rows}, fh, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
