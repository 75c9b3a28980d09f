#!/usr/bin/env python
"""Where a fused encode + decode spends its time, kernel by kernel.

    .venv/bin/python scripts/kernel_breakdown.py [--numel 16M] [--reps 7] [--e2e docs/results/e2e.json] \
        [--out docs/results/kernel_breakdown.json] [--schemes SPECS] [--clock wall|cpu]

For each hot scheme, ``compress`` + ``decompress`` of one 16M-element torch
gradient through the real adapter flow with one-rank collectives (as
``bench micro``), one thread, with every call into the C kernels timed
(a timing proxy around the loaded library).  Per scheme: the total as a
multiple of ``dst.copy_(src)`` (same loop), each kernel's share of the total,
and the rest (Python, workspace lookups, the adapter).  With ``--e2e``, the
share of a training step spent outside the model's compute -- the codec and the collectives (``comm_s_measured /
median_step_s`` of that scheme's unshaped row).
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time

import numpy as np
import torch

SCHEMES = ("TopK(0.01)", "Int8()", "EFSignSGD()", "FP16()", "DGC(0.01)", "TopK(0.01, values=Int8())")

#: what each kernel reads and writes per element of the gradient, in float32-sized units
#: (a copy reads 1 and writes 1): the passes over memory
PASSES = {
    "hvdc_compensate_select": "reads x, r; writes r (3)",
    "hvdc_compensate_select_sent": "reads x, r; writes r (3)",
    "hvdc_sparse_decode_sum": "writes out (1), reads the codes and values",
    "hvdc_topk_select_pack": "reads the candidates (12 bytes each); writes the index code and values",
    "hvdc_int8_encode": "pass 1 reads x, r, writes r; pass 2 reads r, writes r and q (5.25)",
    "hvdc_int8_decode_sum": "reads q per rank, writes out (1.25 for one rank)",
    "hvdc_sign_encode": "pass 1 reads x, r, writes r; pass 2 reads r, writes r (5)",
    "hvdc_sign_decode_sum": "writes out (1)",
    "hvdc_sparse_sum": "zeroes out (1), then k writes",
    "hvdc_half_encode": "reads x, r, writes r and h (3.5)",
}


#: the clock every time is read from: wall time, or this thread's CPU time (--clock cpu: steadier on a loaded machine)
CLOCK = {"wall": time.perf_counter, "cpu": time.thread_time}
clock = CLOCK["wall"]


class TimedLibrary:
    """Forwards attribute access to the kernel library, timing every call."""

    def __init__(self, lib):
        self._lib, self.seconds = lib, collections.Counter()

    def __getattr__(self, name):
        fn = getattr(self._lib, name)

        def timed(*args):
            t0 = clock()
            try:
                return fn(*args)
            finally:
                self.seconds[name] += clock() - t0
        return timed


#: the passes over memory of each fused scheme, by design (encode + decode, one rank)
SCHEME_PASSES = {
    "TopK(0.01)": "encode 1 (acc into r, candidates), decode 1 (zero the output); the rest touches ~2k elements",
    "Int8()": "encode 2 (acc and max; quantize and residual), decode 1",
    "EFSignSGD()": "encode 2 (acc and sum; bits and residual), decode 1",
    "FP16()": "encode 1 (cast), decode 1 (cast back)",
    "DGC(0.01)": "encode 1 (+ a 1% sample), decode 1",
    "TopK(0.01, values=Int8())": "as Top-K, plus Int8 of the k kept values (eager ops)",
}
#: kernel -> the phase it belongs to
PHASES = {"hvdc_compensate_select": "selection", "hvdc_compensate_select_sent": "selection",
          "hvdc_topk_select_settle": "selection", "hvdc_topk_select_pack": "selection",
          "hvdc_restore_candidates": "selection",
          "hvdc_sparse_decode_sum": "decode", "hvdc_sample_magnitudes": "selection",
          "hvdc_kth_largest": "selection", "hvdc_topk_fixup": "selection", "hvdc_clear_sent": "selection",
          "hvdc_int8_encode": "quantize", "hvdc_sign_encode": "quantize", "hvdc_half_encode": "quantize",
          "hvdc_momentum": "quantize", "hvdc_index_encode": "packing", "hvdc_int8_decode_sum": "decode",
          "hvdc_sign_decode_sum": "decode", "hvdc_bf16_decode_sum": "decode", "hvdc_sparse_sum": "decode",
          "hvdc_index_decode": "decode", "hvdc_is_ascending": "decode"}


def markdown(rows, build_s=None):
    """The table docs/results/benchmarks.md shows."""
    head = ("| scheme | x copy | passes over memory | selection | quantize / cast | packing | decode | "
            "Python and torch ops | an unshaped e2e step outside compute (codec + collectives) |")
    out = [head, "|---|---:|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        share = collections.Counter()
        for k, v in r["kernels"].items():
            share[PHASES.get(k, "other")] += v["share"]
        cells = [f"{share[p]:.0%}" if share[p] else "-" for p in ("selection", "quantize", "packing", "decode")]
        if r["scheme"] == "FP16()":  # torch's own casts, not a C kernel
            cells[1] = "(in the next column)"
        coll = r.get("unshaped_outside_compute_share")
        out.append(f"| {r['scheme']} | {r['ratio_to_copy']:.2f}x | {SCHEME_PASSES.get(r['scheme'], '-')} | "
                   + " | ".join(cells) + f" | {r['rest_share']:.0%} | {'-' if coll is None else f'{coll:.0%}'} |")
    if build_s is not None:
        out += ["", f"Compile cost: the C kernels build once per machine in {build_s:.1f} s (cached); "
                    "no per-shape or per-run compilation."]
    return "\n".join(out)


def breakdown(spec, n, reps):
    import hvd_compress as hc
    from hvd_compress.kernels import native
    from hvd_compress.tools.bench.local import local_compressor
    torch.set_num_threads(1)
    comp = local_compressor(eval("hc." + spec, {"hc": hc, "Int8": hc.schemes.Int8, "BF16": hc.schemes.BF16}), "torch")
    xs = [torch.from_numpy(np.random.default_rng(s).standard_normal(n).astype(np.float32)) for s in range(3)]
    grad, dst = torch.empty(n), torch.empty(n)
    timed = TimedLibrary(native.load())
    import hvd_compress.codecs.torch_fused as tc
    real_load = tc.load
    totals, copies = [], []
    per_call = []
    try:
        tc.load = lambda: timed  # the codecs look the library up per call (codec_for)
        for i in range(reps + 2):
            grad.copy_(xs[i % 3])
            t0 = clock()
            dst.copy_(xs[(i + 1) % 3])
            c = clock() - t0
            before = dict(timed.seconds)
            t0 = clock()
            out, ctx = comp.compress(grad)
            comp.decompress(out, ctx)
            total = clock() - t0
            if i >= 2:  # warm-up: the workspaces are allocated in the first calls
                totals.append(total)
                copies.append(c)
                per_call.append({k: v - before.get(k, 0.0) for k, v in timed.seconds.items()})
    finally:
        tc.load = real_load
    total, copy = statistics.median(totals), statistics.median(copies)
    names = sorted({k for d in per_call for k in d})
    kernels = {k: statistics.median([d.get(k, 0.0) for d in per_call]) for k in names}
    return {"scheme": spec, "numel": n, "total_s": total, "copy_s": copy, "ratio_to_copy": total / copy,
            "kernels": {k: {"seconds": s, "share": s / total, "in_copies": s / copy, "passes": PASSES.get(k, "-")}
                        for k, s in kernels.items()},
            # per call, what is left besides the kernels, as a share of that call
            "rest_share": statistics.median([1.0 - sum(d.values()) / t for d, t in zip(per_call, totals)])}


def main(argv=None):
    from hvd_compress.tools.units import parse_count
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", default="16M")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--e2e", default=None, help="an e2e.json: adds each scheme's collective share of a step")
    ap.add_argument("--out", default="docs/results/kernel_breakdown.json")
    ap.add_argument("--schemes", default=None,
                    help="specs, e.g. 'TopK(0.1, values=BF16())' (default: " + ", ".join(SCHEMES) + ")")
    ap.add_argument("--clock", choices=sorted(CLOCK), default="wall",
                    help="wall time, or this thread's CPU time (steadier beside other work)")
    args = ap.parse_args(argv)
    global clock
    clock = CLOCK[args.clock]
    n = parse_count(args.numel)
    from hvd_compress.tools.bench.specs import split_specs
    rows = [breakdown(s, n, args.reps) for s in (split_specs(args.schemes) if args.schemes else SCHEMES)]
    if args.e2e:
        e2e = json.load(open(args.e2e))
        for r in rows:
            m = [x for x in e2e if x["link_mbit"] is None and x["scheme"] in (r["scheme"], r["scheme"].replace("()", ""))]
            if m and m[0].get("comm_s_measured") is not None:
                r["unshaped_outside_compute_share"] = m[0]["comm_s_measured"] / m[0]["median_step_s"]
    for r in rows:
        parts = ", ".join(f"{k.replace('hvdc_', '')} {v['share']:.0%}" for k, v in
                          sorted(r["kernels"].items(), key=lambda kv: -kv[1]["share"]))
        print(f"{r['scheme']:>26}: {r['ratio_to_copy']:.2f}x copy = {parts}, rest {r['rest_share']:.0%}")
    from hvd_compress.kernels import native
    t0 = time.perf_counter()
    from kernel_mechanisms import _build_seconds  # scripts/kernel_mechanisms.py, next to this one
    build_s = _build_seconds(native)
    print(markdown(rows, build_s))
    with open(args.out, "w") as f:
        json.dump({"command": " ".join(["scripts/kernel_breakdown.py"] + (argv if argv is not None else sys.argv[1:])),
                   "build_s": build_s, "rows": rows}, f, indent=1)
    print(f"wrote {args.out} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
