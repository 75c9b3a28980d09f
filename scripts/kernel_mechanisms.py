#!/usr/bin/env python
"""Which mechanism should run the fused kernels?  One measurement, side by side.

    .venv/bin/python scripts/kernel_mechanisms.py [--numel 16M] [--reps 7] [--out docs/results/kernel_mechanisms.json]

The same work -- Int8 with error feedback on one flat float32 tensor
(``acc = x + r``; ``scale = max|acc| / 127``; ``q = clip(rint(acc / scale))``;
``r = acc - q * scale`` with non-finite values zeroed), then its decode
``q * scale`` -- by each candidate mechanism, in one process, one thread,
against ``dst.copy_(src)`` of the same tensor measured in the same loop:

* ``torch-eager``: hvd_compress's eager reference (the scheme's backend ops);
* ``torch-compile``: the same math as one function under ``torch.compile``
  (inductor, C++ codegen); its first call compiles;
* ``c-ctypes``: hvd_compress.kernels (the C source built with the system
  compiler, called through ctypes) -- what hvd_compress uses;
* ``numba``: the same two loops under ``numba.njit`` (only if numba imports;
  it is not a dependency);
* ``tf-graph`` / ``tf-xla``: the scheme's eager TF ops in a ``tf.function``,
  without and with ``jit_compile=True``.

Reported: the median time as a multiple of the copy, and the first call's
time (compilation included), in seconds.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np


def _median_ratio(fn, copy, reps):
    ts, cs = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        copy()
        cs.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), statistics.median(cs)


def _first(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def torch_rows(n, reps):
    import torch
    torch.set_num_threads(1)
    from hvd_compress.backend import backend_for
    from hvd_compress.kernels import native
    from hvd_compress.codecs.torch_fused import codec_for
    from hvd_compress.feedback.memory import finite_or_zero
    from hvd_compress.schemes.base import EncodeContext
    from hvd_compress.schemes.quantization import Int8

    x = torch.from_numpy(np.random.default_rng(0).standard_normal(n).astype(np.float32))
    r = torch.zeros(n)
    dst = torch.empty(n)
    out = torch.empty(n)
    scheme, B = Int8(), backend_for(x)
    ctx = EncodeContext("w", 1, 0, 1, None, 0, (n,))

    def copy():
        dst.copy_(x)

    def eager():
        acc = x + r
        payload, sent = scheme.encode(B, acc, ctx)
        r.copy_(finite_or_zero(B, acc - sent))
        scheme.decode_one(B, payload, n)

    def int8_ef(x, r):
        acc = x + r
        amax = acc.abs().max()
        scale = torch.where(amax == 0, torch.ones_like(amax), amax / 127.0)
        q = torch.round(acc / scale).clamp(-127.0, 127.0)
        e = acc - q * scale
        r.copy_(torch.where(torch.isfinite(e), e, torch.zeros_like(e)))
        return q.to(torch.int8), scale

    def dec(q, scale):
        return q.to(torch.float32) * scale

    rows = []
    for name, fn in (("torch-eager", eager),):
        first = _first(fn)
        t, c = _median_ratio(fn, copy, reps)
        rows.append({"mechanism": name, "ratio_to_copy": t / c, "seconds": t, "copy_s": c, "first_call_s": first})

    compiled, cdec = torch.compile(int8_ef, dynamic=False), torch.compile(dec, dynamic=False)
    first = _first(lambda: cdec(*compiled(x, r)))
    t, c = _median_ratio(lambda: cdec(*compiled(x, r)), copy, reps)
    rows.append({"mechanism": "torch-compile", "ratio_to_copy": t / c, "seconds": t, "copy_s": c,
                 "first_call_s": first})

    if native.available():
        codec = codec_for(scheme, None, x)
        ws = {}

        def fused():
            payload = codec.encode(x, r, ws, ctx)
            codec.aggregate([payload], n, {}, None, out, ws)
        first = _first(fused)
        t, c = _median_ratio(fused, copy, reps)
        rows.append({"mechanism": "c-ctypes", "ratio_to_copy": t / c, "seconds": t, "copy_s": c,
                     "first_call_s": first, "build_s": _build_seconds(native)})
    rows += numba_rows(x.numpy(), r.numpy(), copy, reps)
    return rows


def _build_seconds(native):
    """A fresh build of the C kernels into an empty cache directory."""
    import tempfile
    old = os.environ.get("HVDC_KERNEL_CACHE")
    with tempfile.TemporaryDirectory() as d:
        os.environ["HVDC_KERNEL_CACHE"] = d
        try:
            t0 = time.perf_counter()
            native.build()
            return time.perf_counter() - t0
        finally:
            if old is None:
                del os.environ["HVDC_KERNEL_CACHE"]
            else:
                os.environ["HVDC_KERNEL_CACHE"] = old


def numba_rows(x, r, copy, reps):
    try:
        import numba
    except ImportError:
        return [{"mechanism": "numba", "skipped": "numba is not installed"}]

    @numba.njit(cache=False, fastmath=False)
    def enc(x, r, q):
        amax, nan = np.float32(0.0), False
        for i in range(x.size):
            a = x[i] + r[i]
            r[i] = a
            m = abs(a)
            amax = m if m > amax else amax
            nan |= a != a
        scale = np.float32(np.nan) if nan else (np.float32(1.0) if amax == 0 else amax / np.float32(127.0))
        for i in range(x.size):
            a = r[i]
            v = np.rint(a / scale)
            v = min(max(v, np.float32(-127.0)), np.float32(127.0))
            q[i] = np.int8(v) if v == v else 0
            e = a - v * scale
            r[i] = e if (e - e) == 0 else np.float32(0.0)
        return scale

    @numba.njit(cache=False)
    def dec(q, scale, out):
        for i in range(q.size):
            out[i] = np.float32(q[i]) * scale

    q, out = np.empty(x.size, np.int8), np.empty(x.size, np.float32)
    fn = lambda: dec(q, enc(x, r, q), out)  # noqa: E731
    first = _first(fn)
    t, c = _median_ratio(fn, copy, reps)
    return [{"mechanism": "numba", "ratio_to_copy": t / c, "seconds": t, "copy_s": c, "first_call_s": first,
             "version": numba.__version__}]


def tf_rows(n, reps):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf
    import torch
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    from hvd_compress.backend import backend_for
    from hvd_compress.schemes.base import EncodeContext
    from hvd_compress.schemes.quantization import Int8

    src = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    x = tf.constant(src)
    r = tf.Variable(tf.zeros(n))
    tsrc, tdst = torch.from_numpy(src), torch.empty(n)
    scheme, B = Int8(), backend_for(x)
    ctx = EncodeContext("w", 1, 0, 1, None, 0, (n,))

    def body(x):
        acc = x + r
        payload, sent = scheme.encode(B, acc, ctx)
        r.assign(B.finite_or_zero(acc - sent))
        return scheme.decode_one(B, payload, n)[:1]

    rows = []
    for name, jit in (("tf-graph", False), ("tf-xla", True)):
        f = tf.function(body, jit_compile=jit)
        first = _first(lambda: f(x).numpy())
        t, c = _median_ratio(lambda: f(x).numpy(), lambda: tdst.copy_(tsrc), reps)
        rows.append({"mechanism": name, "ratio_to_copy": t / c, "seconds": t, "copy_s": c, "first_call_s": first})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", default="16M")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default="docs/results/kernel_mechanisms.json")
    args = ap.parse_args(argv)
    from hvd_compress.tools.units import parse_count
    n = parse_count(args.numel)
    rows = torch_rows(n, args.reps) + tf_rows(n, args.reps)
    for row in rows:
        if "skipped" in row:
            print(f"{row['mechanism']:>14}: skipped ({row['skipped']})")
        else:
            print(f"{row['mechanism']:>14}: {row['ratio_to_copy']:6.2f}x copy, first call {row['first_call_s']:.2f} s")
    meta = {"what": "Int8 + error feedback encode and decode, one thread", "numel": n, "reps": args.reps,
            "command": " ".join(["scripts/kernel_mechanisms.py"] + (argv if argv is not None else sys.argv[1:])),
            "cpus": os.cpu_count(), "loadavg_1m": os.getloadavg()[0]}
    with open(args.out, "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
