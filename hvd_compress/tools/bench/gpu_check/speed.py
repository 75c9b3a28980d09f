"""Check family 3: bench micro on the device, a CUDA-events copy as a
cross-check, and the speed targets."""
from __future__ import annotations

import sys
import time

import numpy as np

from .catalogue import EF_SPECS, TARGETS, TARGET_NUMEL, _has

def copy_with_events(numel, reps=20):
    """Median of a device-to-device ``dst.copy_(src)`` of ``numel`` fp32 elements
    timed with CUDA events (a cross-check of bench micro's wall-clock copy)."""
    import torch
    src = torch.randn(numel, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    t = float(np.median(ts))
    return {"numel": numel, "copy_s_cuda_events": t, "bandwidth_GBps": 2 * 4 * numel / t / 1e9}

def micro_specs(include_lossless=True, include_horovod=False):
    """bench micro's default list (only the entries that build a compressor:
    ``hvd_compress.__all__`` also exports memories such as ``DGCMemory``), plus
    :data:`~hvd_compress.tools.bench.gpu_check.catalogue.EF_SPECS`."""
    from ....compressor import Compressor
    from ..micro import default_schemes
    from ..specs import HOROVOD_SPECS, parse_spec
    specs = [s for s in default_schemes()
             if (s in HOROVOD_SPECS and include_horovod) or isinstance(parse_spec(s), Compressor)]
    if not include_lossless:
        specs = [s for s in specs if s != "Lossless"]
    return specs + list(EF_SPECS)

def target_of(spec):
    """('topk_dgc' | 'quantizer' | None, the bar in copies)."""
    from ..micro import scheme_kind
    if spec.startswith(("TopK", "DGC")):
        return "topk_dgc", TARGETS["topk_dgc"]
    if spec != "hvd_fp16" and scheme_kind(spec) == "quantizer":
        return "quantizer", TARGETS["quantizer"]
    return None, None

def judge_targets(rows, numel=TARGET_NUMEL):
    """The CUDA targets on the rows of ``numel`` elements."""
    out = []
    for r in rows:
        if r["numel"] != numel:
            continue
        kind, bar = target_of(r["scheme"])
        if kind is None:
            continue
        out.append({"scheme": r["scheme"], "target": kind, "bar_x_copy": bar,
                    "ratio_to_copy": r["ratio_to_copy"], "met": bool(r["ratio_to_copy"] <= bar)})
    return out

def run_micro(device, sizes, reps, threads, out_json, schemes=None, log=print, deadline=None):
    """Part 3: bench micro (torch) on ``device``; sizes above 100M elements
    leave the host codec (Lossless) out; a size that would start after
    ``deadline`` (time.monotonic()) is left out.  Returns (rows, errors)."""
    from ..micro import run
    from ..report import write_json
    horovod = _has("horovod.torch") and _has("horovod")
    if not horovod:
        log("  hvd_fp16 (Horovod's own fp16) left out: Horovod is not importable here")
    if not _has("zstandard"):
        log("  Lossless left out: zstandard is not installed")
    rows, errors = [], []
    for n in sizes:
        if deadline is not None and time.monotonic() > deadline:
            errors.append(f"size {n} left out: the time budget (--budget-s) was spent")
            log(f"  {n}: LEFT OUT: the time budget (--budget-s) was spent")
            continue
        specs = schemes or micro_specs(include_lossless=_has("zstandard") and n <= 100_000_000,
                                       include_horovod=horovod)
        if schemes is None and n > 100_000_000 and _has("zstandard"):
            log(f"  {n}: Lossless left out (its codec runs on the host; it is timed at the smaller size)")
        res = run(schemes=specs, frameworks=("torch",), sizes=[n], devices=(device,), threads=threads,
                  reps=reps, warmup=1, out_json=None, progress=True, stream=sys.stdout)
        rows.extend(res)
        errors.extend(res.errors)
        write_json(out_json, rows)  # after every size: a later crash keeps what was measured
    return rows, errors
