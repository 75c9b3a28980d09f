"""The GPU check's catalogue: the cases it runs (every registered example of
:data:`hvd_compress.schemes.REGISTRY`), how each is compared, the host syncs
known to be needed, the speed targets, and the one loop over the cases that
every check family shares (:func:`each_case`)."""
from __future__ import annotations

import functools

import numpy as np

f32 = np.float32

#: the device under test in CUDA mode (the unit tests' dry run of the CUDA path points it at the CPU)
CUDA_DEVICE = "cuda"

#: the CUDA targets at 256M elements (encode + decode + error feedback, in copies)
TARGETS = {"topk_dgc": 8.0, "quantizer": 4.0}

TARGET_NUMEL = 256_000_000

#: known host syncs in fixed-size schemes, by registered scheme name, and why
#: (see tests/unit/test_backend_sync.py)
KNOWN_SYNCS = {
    "RandomK": "TorchBackend.randperm_prefix deduplicates with torch.unique (data-dependent size)",
    "Lossless": "host codec: zstandard runs on the CPU (a deliberate device-to-host copy)",
}


def is_variable_size(cid):
    """Whether case ``cid`` is a sparsifier whose payload length depends on
    the data (Threshold, DGC), so that the lengths must reach the host
    (``nonzero`` and the transport's split)."""
    from ....schemes import build, registration
    scheme = build(sync_specs()[cid])
    return registration(scheme).kind == "sparsifier" and bool(scheme.variable_parts)

def comparison_rule(scheme):
    """The comparison rule of a scheme for the *same draws* check, from its
    registered ``compare``: a sparsifier whose ``values=`` quantizer reduces
    in float (QSGD) compares within float noise too."""
    from ....schemes import registration
    how = registration(scheme).compare
    values = getattr(scheme, "values", None)
    if values is not None and registration(values).compare == "reducing":
        return {"topk": "topk-reducing", "exact": "reducing"}.get(how, how)
    return how

def cases():
    """``[(id, factory, how)]``: the schemes checked, every registered
    example (:data:`hvd_compress.schemes.REGISTRY`) but the ``single_step`` ones.  ``how`` is the comparison
    rule for the *same draws* check: ``exact``, ``reducing`` (a float
    reduction inside), ``topk`` (exact, ties reported), ``topk-reducing``
    (Top-K with QSGD values), ``lowrank`` or ``lossless`` (see
    :func:`~hvd_compress.tools.bench.gpu_check.same_draws.compare_runs`)."""
    from ....schemes import REGISTRY, build
    return [(cid, functools.partial(build, spec), comparison_rule(build(spec)))
            for reg in REGISTRY.values() for cid, spec in reg.examples.items() if cid not in reg.single_step]

def sync_specs():
    """Case id -> spec, for the compressor-level sync check (the same flow
    bench micro times): the same registered examples as :func:`cases`."""
    from ....schemes import REGISTRY
    return {cid: spec for reg in REGISTRY.values() for cid, spec in reg.examples.items()
            if cid not in reg.single_step}


def each_case(only=None, results=None, log=None):
    """The one case loop of every check: ``(id, factory, how)`` of each case in
    :func:`cases` (those in ``only``, when given).  A case whose codec is not
    installed (Lossless without ``zstandard``) is appended to ``results`` as
    skipped, with a line to ``log``, instead of being yielded."""
    for cid, factory, how in cases():
        if only and cid not in only:
            continue
        if how == "lossless" and not _has("zstandard"):
            if results is not None:
                results.append({"case": cid, "status": "skipped", "detail": "zstandard is not installed"})
            if log is not None:
                log(f"  {cid:<16} SKIPPED: zstandard is not installed")
            continue
        yield cid, factory, how


#: extra micro specs: the quantizers whose error feedback is off by default,
#: with it on (the speed targets are for encode + decode + error feedback)
EF_SPECS = ("FP16(error_feedback=True)", "BF16(error_feedback=True)", "QSGD(error_feedback=True)",
            "TernGrad(error_feedback=True)", "SignSGD(error_feedback=True)")

def _has(module):
    import importlib.util
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
