"""Check family 1a (and 1c, TensorFlow): every case on both sides with the
same inputs and the same random draws, compared by the case's rule."""
from __future__ import annotations

import time
import traceback

import numpy as np

from .catalogue import each_case
from .sides import run_case, run_powersgd, tie_free

def _bits(a):
    a = np.asarray(a)
    if a.dtype.kind == "f":
        return a.view({2: np.int16, 4: np.int32, 8: np.int64}[a.dtype.itemsize])
    return a

def compare(ref, got, how, n):
    """``(ok, detail)`` for one array.  ``how``: ``exact`` (bitwise, same
    dtype and shape), ``close`` (float noise of the scale: within
    ``1e-5 * max|ref|`` except for at most ``max(3, n/10000)`` elements; the
    same count of integer mismatches), ``lowrank`` (relative L2 error <= 1e-4)."""
    ref, got = np.asarray(ref), np.asarray(got)
    if ref.shape != got.shape:
        return False, f"shape {got.shape} != {ref.shape}"
    if how == "exact":
        if ref.dtype != got.dtype:
            return False, f"dtype {got.dtype} != {ref.dtype}"
        bad = int(np.count_nonzero(_bits(ref) != _bits(got)))
        return bad == 0, ("bit-identical" if bad == 0 else f"{bad} of {ref.size} elements differ "
                          f"(max |diff| {np.max(np.abs(ref.astype(np.float64) - got)):.3g})")
    if how == "lowrank":
        r, g = ref.astype(np.float64), got.astype(np.float64)
        rel = float(np.linalg.norm(r - g) / max(np.linalg.norm(r), 1e-30))
        return rel <= 1e-4, f"relative L2 error {rel:.2g}"
    # close
    if ref.size == 0:
        return True, "empty"
    allowed = max(3, n // 10000)
    if ref.dtype.kind in "iub":
        bad = int(np.count_nonzero(ref != got))
        return bad <= allowed, f"{bad} integer elements differ (allowed {allowed})"
    r, g = ref.astype(np.float64), got.astype(np.float64)
    scale = float(np.max(np.abs(r))) or 1.0
    diff = np.abs(r - g)
    bad = int(np.count_nonzero(diff > 1e-5 * scale))
    return bad <= allowed, (f"max |diff| {diff.max():.3g} (scale {scale:.3g}); {bad} elements beyond "
                            f"1e-5 of the scale (allowed {allowed})")

def _k_boundary_ties(acc, k):
    """How many elements share the k-th largest magnitude of ``acc``."""
    a = np.abs(np.asarray(acc, np.float64))
    kth = np.partition(a, a.size - k)[a.size - k]
    return int(np.count_nonzero(a == kth))

def compare_runs(ref_steps, got_steps, how, scheme, n):
    """Compare two :func:`~hvd_compress.tools.bench.gpu_check.sides.run_case` results step by step; returns (ok, [messages])."""
    msgs, ok = [], True
    per_part = {"exact": "exact", "reducing": "close", "topk": "exact", "topk-reducing": "close",
                "lowrank": "lowrank", "lossless": "exact"}[how]
    for s, (ref, got) in enumerate(zip(ref_steps, got_steps)):
        for key in ref:
            if key.endswith(".acc"):
                continue
            rule = per_part
            if how.startswith("topk") and key.endswith((".idx", ".val")) and scheme.index_code(n) == "raw":
                # torch.topk(sorted=False) order is the kernel's: compare as (index, value) sets
                rule = "set"
            if rule == "set":
                r_idx, g_idx = ref[key.rsplit(".", 1)[0] + ".idx"], got[key.rsplit(".", 1)[0] + ".idx"]
                ro, go = np.argsort(r_idx, kind="stable"), np.argsort(g_idx, kind="stable")
                good, detail = compare(ref[key][ro], got[key][go], "exact", n)
            else:
                good, detail = compare(ref[key], got[key], rule, n)
            if not good and how.startswith("topk"):
                rank = key.split(".")[0]
                k = scheme.fixed_k(n)
                ties = _k_boundary_ties(ref.get(f"{rank}.acc", ref.get("r0.acc")), k)
                if ties > 1:
                    msgs.append(f"step {s + 1} {key}: differs, but the reference has {ties} equal magnitudes "
                                f"at the k-th place (a tie: both answers are right); later steps not compared")
                    return ok, msgs
            if not good:
                ok = False
                msgs.append(f"step {s + 1} {key}: {detail}")
    if ok:
        msgs.append(f"{len(ref_steps)} steps x {sum(1 for k in ref_steps[0] if not k.endswith('.acc'))} arrays: "
                    + {"exact": "bit-identical", "close": "equal within float noise",
                       "lowrank": "equal to 1e-4 relative"}[per_part])
    return ok, msgs

def check_same_draws(ref_side, dut_side, shapes, steps=3, only=None, log=print):
    """Part 1a: every scheme on both sides with the same inputs and draws."""
    results = []
    for cid, factory, how in each_case(only, results, log):
        for shape in shapes:
            n = int(np.prod(shape))
            scheme = factory()
            xs = [[tie_free(n, 100 * s + r) for r in range(2)] for s in range(steps)]
            t0 = time.perf_counter()
            try:
                runner = run_powersgd if how == "lowrank" else run_case
                ref = runner(ref_side, scheme, xs, shape)
                got = runner(dut_side, scheme, xs, shape)
                ok, msgs = compare_runs(ref, got, how, scheme, n)
            except Exception as e:  # a crash on one side is a failure to report, not to hide
                ok, msgs = False, [f"{type(e).__name__}: {e}", traceback.format_exc(limit=-3)]
            status = "ok" if ok else "FAILED"
            results.append({"case": cid, "scheme": repr(scheme), "numel": n, "rule": how, "status": status,
                            "detail": msgs, "seconds": round(time.perf_counter() - t0, 3)})
            log(f"  {cid:<16} n={n:<9} {status:<6} {msgs[0] if msgs else ''}"
                + ("" if ok else "".join("\n      " + m for m in msgs[1:4])))
    return results
