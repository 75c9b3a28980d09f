"""Check family 2: host syncs in every case's hot paths -- under
``torch.cuda.set_sync_debug_mode`` on CUDA, by recording every
tensor-to-host conversion on the CPU."""
from __future__ import annotations

import traceback
import warnings
from pathlib import Path

import numpy as np

from ....compressor import encode_with_residual
from ....schemes.base import EncodeContext
from . import catalogue
from .catalogue import KNOWN_SYNCS, each_case, is_variable_size, sync_specs
from .sides import _wire, tie_free

def _hvdc_chain(stack):
    """``file:line function`` of the hvd_compress frames of a stack, outermost first."""
    here = Path(__file__).resolve().parent  # the GPU check itself: not part of a chain
    pkg = here.parents[2]  # hvd_compress/
    chain = []
    for fr in stack:
        fn = Path(fr.filename).resolve()
        if pkg in fn.parents and here not in fn.parents:
            chain.append(f"{fn.relative_to(pkg.parent)}:{fr.lineno} {fr.name}")
    return chain

def _scheme_hot_path(B, scheme, shape, x, residual, step):
    """encode with error feedback for two ranks, then the aggregate (what
    tests/unit/test_backend_sync.py runs)."""
    n = B.numel(x)
    ctx = EncodeContext(key="w", step=step, rank=0, size=2, uniform=lambda k: B.uniform(k, 1000 + step, like=x),
                        shared_seed=77 + step, shape=tuple(shape), state={})
    if scheme.transport == "powersgd":
        import torch
        q = torch.ones(scheme.matrix_shape(shape)[1], scheme.rank, device=x.device)
        acc = x + residual
        p_local, mat = scheme.first_round(B, acc, q, tuple(shape))
        p, q_local = scheme.second_round(B, p_local + p_local, mat)
        agg, sent = scheme.finish(B, p, q_local, q_local + q_local)
        return agg, acc - sent
    payload, new_residual = encode_with_residual(B, scheme, x, residual, ctx)
    payload2, _ = encode_with_residual(B, scheme, x * 0.5, residual, ctx)
    if scheme.transport == "allreduce":
        local = {k: v for k, v in payload.items() if k.startswith("_")}
        out = scheme.decode_reduced(B, payload["reduce"] + payload2["reduce"], n, local)
    else:
        out = scheme.aggregate(B, [_wire(payload), _wire(payload2)], n)
    return out, new_residual

def _compressor_hot_path(comp, xt):
    out, ctx = comp.compress(xt)
    return comp.decompress(out, ctx)

def _sync_paths(cid, factory, shape, device):
    """The two hot paths of one case as zero-argument callables (after one
    warm-up call each, which may initialise lazily)."""
    import torch
    from ....backend import TorchBackend
    from ..local import local_compressor
    from ..specs import parse_spec
    B = TorchBackend()
    scheme = factory()
    n = int(np.prod(shape))
    x = torch.from_numpy(np.array(tie_free(n, 3))).to(device)
    state = {"residual": torch.zeros_like(x), "step": 0}

    def scheme_path():
        state["step"] += 1
        out, state["residual"] = _scheme_hot_path(B, scheme, shape, x, state["residual"], state["step"])
        return out

    comp = local_compressor(parse_spec(sync_specs()[cid]), "torch")
    xs = x.reshape(shape)

    def compressor_path():
        return _compressor_hot_path(comp, xs)

    return {"scheme": scheme_path, "compressor": compressor_path}

def check_sync_cuda(shape, only=None, log=print, device=None):
    """Part 2 on CUDA: each hot path under set_sync_debug_mode('error'); the
    ones that raise are run again under 'warn' to list every sync.  (``device``
    is for the unit test, which emulates the debug mode on the CPU.)"""
    import torch
    results = []
    for cid, factory, _ in each_case(only, results):
        try:
            paths = _sync_paths(cid, factory, shape, device or catalogue.CUDA_DEVICE)
        except Exception as e:
            results.append({"case": cid, "status": "FAILED", "detail": f"setup: {type(e).__name__}: {e}"})
            continue
        for level, fn in paths.items():
            row = {"case": cid, "level": level, "variable_size": is_variable_size(cid)}
            try:
                fn()  # warm-up
                torch.cuda.synchronize()
                prev = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    fn()
                    row.update(status="no sync")
                except RuntimeError as e:
                    row.update(status="SYNC", first=str(e).splitlines()[0][:200],
                               first_at=_hvdc_chain(traceback.extract_tb(e.__traceback__)))
                finally:
                    torch.cuda.set_sync_debug_mode(prev)
                torch.cuda.synchronize()
                if row["status"] == "SYNC":
                    row["all_syncs"] = _list_syncs_warn(fn)
            except Exception as e:
                row.update(status="FAILED", detail=f"{type(e).__name__}: {e}",
                           traceback=traceback.format_exc()[-2000:])
            row["expected"] = _expected_sync(cid)
            results.append(row)
            _log_sync(row, log)
    return results

def _list_syncs_warn(fn):
    """Every synchronizing call of ``fn`` (sync debug mode 'warn'), as
    hvd_compress call chains, in order, deduplicated."""
    import torch
    seen, found = set(), []

    def hook(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" not in str(message):
            return
        chain = _hvdc_chain(traceback.extract_stack()[:-1])
        key = tuple(chain)
        if key not in seen:
            seen.add(key)
            found.append(" -> ".join(chain[-3:]) or f"{filename}:{lineno}")

    prev = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(prev)
    torch.cuda.synchronize()
    return found

def _expected_sync(cid):
    if is_variable_size(cid):
        return "variable-size payload: nonzero() and the transport's split read lengths on the host"
    from ....schemes import build, registration
    return KNOWN_SYNCS.get(registration(build(sync_specs()[cid])).name)

def _log_sync(row, log):
    tail = ""
    if row["status"] == "SYNC":
        tail = " at " + " -> ".join(row.get("first_at", [])[-2:])
        if row.get("all_syncs"):
            tail += "".join("\n        sync: " + s for s in row["all_syncs"][:6])
    elif row["status"] == "FAILED":
        tail = " " + row.get("detail", "")
    exp = f"  [expected: {row['expected']}]" if row.get("expected") and row["status"] == "SYNC" else ""
    log(f"  {row['case']:<16} {row['level']:<10} {row['status']}{exp}{tail}")

def check_host_reads_cpu(shape, only=None, log=print):
    """Part 2 without CUDA: the same hot paths with every tensor-to-host
    conversion recorded (call chains), on the CPU."""
    import torch
    names = ("item", "cpu", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")
    results = []
    for cid, factory, _ in each_case(only, results):
        paths = _sync_paths(cid, factory, shape, "cpu")
        for level, fn in paths.items():
            row = {"case": cid, "level": level, "variable_size": is_variable_size(cid)}
            fn()  # warm-up
            reads, originals = [], {nm: getattr(torch.Tensor, nm) for nm in names}

            def wrap(nm):
                orig = originals[nm]

                def recorder(self, *a, **k):
                    reads.append((nm, _hvdc_chain(traceback.extract_stack()[:-1])))
                    return orig(self, *a, **k)
                return recorder
            from ....backend import TorchBackend
            free = TorchBackend.host_reads_are_free
            try:
                # walk the CUDA path: the backend's CPU-only shortcuts read the host freely
                TorchBackend.host_reads_are_free = lambda self, x: False
                for nm in names:
                    setattr(torch.Tensor, nm, wrap(nm))
                fn()
            except Exception as e:
                row.update(status="FAILED", detail=f"{type(e).__name__}: {e}")
            finally:
                TorchBackend.host_reads_are_free = free
                for nm, orig in originals.items():
                    setattr(torch.Tensor, nm, orig)
            if "status" not in row:
                uniq = list(dict.fromkeys(f".{nm}() at " + " -> ".join(ch[-2:]) for nm, ch in reads if ch))
                row.update(status="HOST READ" if uniq else "no host read", all_syncs=uniq,
                           first_at=reads[0][1] if reads else [])
            row["expected"] = _expected_sync(cid)
            results.append(row)
            r = dict(row, status="SYNC" if row["status"] == "HOST READ" else row["status"])
            _log_sync(r, log)
    return results
