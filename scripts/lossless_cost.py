"""Lossless's cost beside zstd's own: one process, one thread, a 16M-element
fp32 gradient, the three timed alternately (medians of --reps):

* ``copy``      -- ``dst.copy_(src)`` of the gradient;
* ``zstd``      -- zstd alone on the payload: compress the gradient's byte
                   planes (level 1) and decompress them into a kept buffer;
* ``lossless``  -- ``compress`` + ``decompress`` of ``Lossless()`` through the
                   real torch adapter flow with one-rank collectives (as
                   ``bench micro``): the shuffle, zstd both ways, the un-shuffle.

Prints the three times and ``(lossless - zstd) / copy``: what Lossless costs
beyond zstd, in copies.  ``--clock cpu`` times each call by the thread's CPU time
and takes the fastest of the repetitions instead of the median wall time: on a
machine loaded by other work, where the wall times of zstd (tens of copies) vary
by more than the copies being measured.  Usage:
``python scripts/lossless_cost.py [--numel N] [--reps R] [--clock wall|cpu]``.
"""
import argparse
import json
import os
import statistics
import time

import numpy as np
import torch
import zstandard

import hvd_compress as hc
from hvd_compress.schemes.lossless import decompress_planes, shuffle_planes
from hvd_compress.tools.bench.local import local_compressor


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=16_000_000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall: median of perf_counter times; cpu: fastest thread CPU time (default wall)")
    args = ap.parse_args()
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    pick = statistics.median if args.clock == "wall" else min
    torch.set_num_threads(1)
    n = args.numel
    src = torch.randn(n // 1000, 1000, generator=torch.Generator().manual_seed(0))
    dst, grad = torch.empty_like(src), torch.empty_like(src)
    comp = local_compressor(hc.Lossless(), "torch")
    planes = shuffle_planes(src.numpy()).copy()
    cctx = zstandard.ZstdCompressor(level=1)

    def copy():
        dst.copy_(src)

    def zstd_alone():
        blob = cctx.compress(planes)
        decompress_planes(blob, n)

    def lossless():
        grad.copy_(src)  # untimed below: the gradient as Horovod hands it over
        t0 = clock()
        out, ctx = comp.compress(grad)
        comp.decompress(out, ctx)
        return clock() - t0

    def timed(fn):
        t0 = clock()
        fn()
        return clock() - t0

    for _ in range(2):
        copy(), zstd_alone(), lossless()
    times = {"copy": [], "zstd": [], "lossless": []}
    for _ in range(args.reps):
        times["copy"].append(timed(copy))
        times["zstd"].append(timed(zstd_alone))
        times["lossless"].append(lossless())
    med = {k: pick(v) for k, v in times.items()}
    result = {**{k + "_s": v for k, v in med.items()}, "numel": n, "reps": args.reps, "clock": args.clock,
              "beyond_zstd_in_copies": (med["lossless"] - med["zstd"]) / med["copy"],
              "loadavg_1m": os.getloadavg()[0]}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
