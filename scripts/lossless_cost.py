"""Lossless's cost beside zstd's own: one process, one thread, a 16M-element
fp32 gradient, timed alternately:

* ``copy``        -- ``dst.copy_(src)`` of the gradient (64 MB read, 64 MB written);
* ``zstd_frames`` -- zstd alone on Lossless's payload: compress the gradient's
                     byte planes (kept, already shuffled) block by block, one frame
                     per block as Lossless frames them, level 1, into a kept buffer;
                     decompress all frames (one call) into a kept buffer;
* ``zstd_1frame`` -- the same planes as one frame (one call each way): zstd's
                     cost without Lossless's framing;
* ``lossless``    -- ``compress`` + ``decompress`` of ``Lossless()`` through the
                     real torch adapter flow with one-rank collectives (as ``bench
                     micro``): the shuffle, zstd both ways, the un-shuffle, the
                     adapter's own work.

Both zstd runs call the zstd library Lossless calls (``hvd_compress.kernels.zstd_api``)
with kept contexts, so neither side pays for fresh output pages.  Prints the
times (``_enc``/``_dec``: the two halves) and ``beyond_zstd_in_copies`` =
``(lossless - min(zstd_frames, zstd_1frame)) / copy`` (``encode_``/``decode_beyond_in_copies``:
the same per half), Lossless's own two passes without zstd (``shuffle_alone``,
``unshuffle_alone``: :func:`kernel_passes`) in copies, and beside them the memory traffic
those passes cannot avoid: reading the gradient alone (``read_alone``: ``src.sum()``) and
writing one alone (``write_alone``: ``dst.fill_(1.0)``).  ``--clock cpu`` times
each call by the thread's CPU time and takes the fastest of the repetitions
instead of the median wall time: on a machine loaded by other work, where the
wall times of zstd (tens of copies) vary by more than the copies being
measured.  Usage:
``python scripts/lossless_cost.py [--numel N] [--reps R] [--clock wall|cpu]``.
"""
import argparse
import ctypes
import json
import os
import statistics
import time

import numpy as np
import torch

import hvd_compress as hc
from hvd_compress.kernels import native, zstd_api
from hvd_compress.schemes.lossless import PLANE_BLOCK, blocks, planes_buffer, shuffle_planes
from hvd_compress.tools.bench.local import local_compressor


def zstd_runs(planes, n):
    """``{name: (compress, decompress)}``: zstd alone on the planes, framed as Lossless and as one frame."""
    z = zstd_api.load()
    lib, cctx, dctx = z.lib, z.context("C"), z.context("D")
    lib.ZSTD_compressCCtx.restype = lib.ZSTD_decompressDCtx.restype = ctypes.c_size_t
    lib.ZSTD_compressCCtx.argtypes = (ctypes.c_void_p,) * 2 + (ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                                                               ctypes.c_int)
    lib.ZSTD_decompressDCtx.argtypes = (ctypes.c_void_p,) * 2 + (ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t)
    cap = z.bound(n, PLANE_BLOCK) + z.lib.ZSTD_compressBound(4 * n)
    blob, back = np.empty(cap, np.uint8), np.empty(4 * n, np.uint8)
    size = {}

    def compress_frames():
        off = 0
        for lo, m in blocks(n):
            off += lib.ZSTD_compressCCtx(cctx, blob.ctypes.data + off, cap - off, planes.ctypes.data + 4 * lo, 4 * m, 1)
        size["frames"] = off

    def compress_one():
        size["one"] = lib.ZSTD_compressCCtx(cctx, blob.ctypes.data, cap, planes.ctypes.data, 4 * n, 1)

    def decompress(kind):
        def run():
            got = lib.ZSTD_decompressDCtx(dctx, back.ctypes.data, 4 * n, blob.ctypes.data, size[kind])
            assert got == 4 * n, got
        return run

    return {"zstd_frames": (compress_frames, decompress("frames")), "zstd_1frame": (compress_one, decompress("one"))}


def kernel_passes(x, out):
    """``{name: run}``: Lossless's own passes without zstd, through the kernels it calls:
    ``shuffle_alone`` shuffles the gradient block by block into the 512 KiB buffer (the
    encode's pass); ``unshuffle_alone`` is ``hvdc_lossless_decode_add`` with zstd's functions
    replaced by no-ops (the buffer's planes un-shuffled into the output, block by block,
    as the decode writes it; the no-op callbacks cost about 0.05 ms in all)."""
    lib = native.load()
    n, scratch = x.numel(), planes_buffer(4 * PLANE_BLOCK)
    call = ctypes.CFUNCTYPE
    noop = (call(ctypes.c_size_t, *(ctypes.c_void_p,) * 2, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t)(
        lambda dctx, dst, cap, src, size: cap), call(ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t)(lambda src, size: 1),
        call(ctypes.c_uint, ctypes.c_size_t)(lambda code: 0))
    table = (ctypes.c_void_p * 4)(None, *(ctypes.cast(f, ctypes.c_void_p).value for f in noop))

    def shuffle_alone():
        for lo, m in blocks(n):
            lib.hvdc_byte_shuffle(x.data_ptr() + 4 * lo, m, m, scratch.ctypes.data)

    def unshuffle_alone():
        got = lib.hvdc_lossless_decode_add(None, len(blocks(n)), n, PLANE_BLOCK, table, None, scratch.ctypes.data, 1,
                                           0.0, 0, out.data_ptr())
        assert got == 0 and noop, got  # noop: the callbacks stay alive with this closure

    return {"shuffle_alone": shuffle_alone, "unshuffle_alone": unshuffle_alone}


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
    runs = zstd_runs(shuffle_planes(src.numpy()), n)
    passes = kernel_passes(src.reshape(-1), dst.reshape(-1))
    passes.update({"read_alone": src.sum, "write_alone": lambda: dst.fill_(1.0)})


    def lossless():
        grad.copy_(src)  # untimed: the gradient as Horovod hands it over
        t0 = clock()
        out, ctx = comp.compress(grad)
        t1 = clock()
        got = comp.decompress(out, ctx)
        return t1 - t0, clock() - t1, got

    def timed(fn):
        t0 = clock()
        fn()
        return clock() - t0

    times = {k: [] for k in ("copy", "lossless_enc", "lossless_dec", *(f"{r}_{h}" for r in runs for h in ("enc", "dec")),
                             *passes)}
    for rep in range(args.reps + 2):  # two warm-up rounds
        t = {"copy": timed(lambda: dst.copy_(src))}
        for name, (enc, dec) in runs.items():
            t[name + "_enc"], t[name + "_dec"] = timed(enc), timed(dec)
        t.update({name: timed(run) for name, run in passes.items()})
        t["lossless_enc"], t["lossless_dec"], got = lossless()
        assert torch.equal(got.view(torch.int32), src.view(torch.int32)), "Lossless did not decode bit for bit"
        if rep >= 2:
            for k, v in t.items():
                times[k].append(v)
    best = {k: pick(v) for k, v in times.items()}
    for name in ("lossless", *runs):
        best[name] = pick([e + d for e, d in zip(times[name + "_enc"], times[name + "_dec"])])
    def beyond(part=""):
        return (best["lossless" + part] - min(best[r + part] for r in runs)) / best["copy"]

    result = {**{k + "_s": v for k, v in best.items()}, "numel": n, "reps": args.reps, "clock": args.clock,
              "beyond_zstd_in_copies": beyond(), "encode_beyond_in_copies": beyond("_enc"),
              "decode_beyond_in_copies": beyond("_dec"),
              **{name + "_in_copies": best[name] / best["copy"] for name in passes}, "loadavg_1m": os.getloadavg()[0]}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
