"""Build and load ``hvdc_kernels.c``.

The shared object is compiled on first use (about a second) into
``$HVDC_KERNEL_CACHE`` (default ``~/.cache/hvd_compress/kernels``), under a
name that hashes the source and its headers, the flags, the compiler's version
and the CPU model, so a changed source or header, or another machine type,
builds its own copy, and
concurrent ranks never see a half-written file (built under a temporary name,
then renamed).  ``scripts/install.sh`` builds it ahead of time
(``python -m hvd_compress.kernels``).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

SOURCE = Path(__file__).with_name("hvdc_kernels.c")
#: the one declaration of every exported function and of the enums they take
HEADER = Path(__file__).with_name("hvdc_kernels.h")
#: the headers SOURCE includes: HEADER and the vector layer its loops are written over
HEADERS = (HEADER, Path(__file__).with_name("hvdc_simd.h"))
#: -O3 vectorises the loops; -march=native uses this CPU's vector width and
#: F16C conversions; no -ffast-math and no contraction into FMAs: NaN and Inf
#: handling, rounding and the order of the
#: float operations must stay those of the eager reference
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-mprefer-vector-width=512", "-std=gnu11", "-shared", "-fPIC")

_lock = threading.Lock()
_lib = None
_failed = None

i64, f32, ptr, c_int = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
#: a C enum of hvdc_kernels.h (its values: .constants)
enum = ctypes.c_int
#: name -> (argument types, return type): the prototypes of hvdc_kernels.h, in its
#: order (tests/unit/test_kernels_header.py fails where one differs)
SIGNATURES = {
    "hvdc_momentum": ((ptr, ptr, i64, f32, c_int, ptr), None),
    "hvdc_lowrank_first": ((ptr, ptr, i64, i64, c_int, ptr, ptr), c_int),
    "hvdc_lowrank_project": ((ptr, i64, i64, c_int, ptr, i64, i64, ptr), c_int),
    "hvdc_lowrank_finish": ((ptr, i64, i64, i64, i64, c_int, ptr, ptr, ptr, ptr), c_int),
    "hvdc_int8_encode": ((ptr, ptr, i64, i64, ptr, ptr), None),
    "hvdc_int8_encode_rcp": ((ptr, ptr, i64, i64, ptr, ptr), None),
    "hvdc_int8_decode_sum": ((c_int, ptr, ptr, i64, i64, f32, c_int, ptr), None),
    "hvdc_sign_encode": ((ptr, ptr, i64, enum, ptr, ptr), None),
    "hvdc_sign_decode_sum": ((c_int, ptr, ptr, i64, enum, f32, c_int, ptr), None),
    "hvdc_onebit_encode": ((ptr, ptr, i64, ptr, ptr), None),
    "hvdc_onebit_decode_sum": ((c_int, ptr, ptr, i64, f32, c_int, ptr), None),
    "hvdc_half_encode": ((ptr, ptr, i64, enum, ptr), None),
    "hvdc_bf16_decode_sum": ((c_int, ptr, i64, f32, c_int, ptr), None),
    "hvdc_compensate_select": ((ptr, ptr, i64, f32, enum, enum, ptr, ptr, i64), i64),
    "hvdc_compensate_select_sent": ((ptr, ptr, i64, f32, enum, enum, enum, f32, ptr, ptr, i64), i64),
    "hvdc_restore_candidates": ((ptr, ptr, ptr, i64, c_int), None),
    "hvdc_sample_magnitudes": ((ptr, ptr, i64, i64, enum, ptr), None),
    "hvdc_kth_largest": ((ptr, i64, i64), f32),
    "hvdc_topk_fixup": ((ptr, ptr, i64, i64, enum, ptr, ptr, ptr), None),
    "hvdc_topk_select_settle": ((ptr, ptr, i64, i64, enum, ptr, ptr, ptr, ptr, enum, f32), None),
    "hvdc_topk_select_pack": ((ptr, ptr, i64, i64, enum, ptr, ptr, enum, f32, enum, c_int, ptr, i64, c_int, ptr),
                              None),
    "hvdc_clear_sent": ((ptr, ptr, i64, ptr, ptr, i64), None),
    "hvdc_select_sent": ((ptr, ptr, i64, f32, enum, ptr, ptr, i64), i64),
    "hvdc_sparse_sum_i32": ((c_int, ptr, ptr, ptr, i64, f32, c_int, ptr), i64),
    "hvdc_unsend": ((ptr, ptr, ptr, i64), None),
    "hvdc_sparse_bf16_encode": ((ptr, i64, ptr, ptr, ptr), None),
    "hvdc_index_encode": ((ptr, i64, i64, enum, c_int, ptr, i64), None),
    "hvdc_index_decode": ((ptr, i64, i64, enum, c_int, ptr), None),
    "hvdc_is_ascending": ((ptr, i64), c_int),
    "hvdc_sparse_sum": ((c_int, ptr, ptr, ptr, i64, f32, c_int, ptr), None),
    "hvdc_sparse_decode_sum": ((c_int, ptr, enum, c_int, ptr, ptr, c_int, i64, f32, c_int, ptr), i64),
    # the randomised schemes
    "hvdc_uniform": ((enum, i64, i64, ptr), None),
    "hvdc_qsgd_encode": ((ptr, ptr, i64, c_int, ptr, enum, i64, ptr, ptr), None),
    "hvdc_terngrad_encode": ((ptr, ptr, i64, ptr, enum, i64, ptr, ptr), None),
    "hvdc_terngrad_decode_sum": ((c_int, ptr, ptr, i64, f32, c_int, ptr), None),
    "hvdc_randomk_indices_torch": ((i64, i64, i64, ptr, ptr, ptr), i64),
    "hvdc_randomk_indices_tf": ((i64, i64, i64, ptr, ptr), None),
    "hvdc_randomk_encode": ((ptr, ptr, i64, ptr, i64, ptr), None),
    "hvdc_scatter": ((ptr, i64, ptr, i64, ptr), None),
    # Lossless
    "hvdc_byte_shuffle": ((ptr, i64, i64, ptr), None),
    "hvdc_byte_unshuffle_add": ((ptr, i64, c_int, f32, c_int, ptr), None),
    "hvdc_lossless_encode": ((ptr, i64, i64, c_int, ptr, ptr, ptr, ptr, i64), i64),
    "hvdc_lossless_decode_add": ((ptr, i64, i64, i64, ptr, ptr, ptr, c_int, f32, c_int, ptr), i64),
}


def find_tool(env, *names):
    """The program named by ``$env``, else the first of ``names`` on the PATH (None if none)."""
    for cand in (os.environ.get(env), *names):
        if cand and shutil.which(cand):
            return shutil.which(cand)
    return None


def compiler():
    """The C compiler: ``$CC``, else cc or gcc on the PATH (None if neither)."""
    return find_tool("CC", "cc", "gcc")


def _cpu_model():
    """The CPU's model name and feature flags (-march=native builds for them:
    a machine that differs in either, e.g. a VM without AVX-512, builds its own)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags")
    return "\n".join(next((l for l in lines if l.startswith(w)), "") for w in wanted)


def cache_dir():
    return Path(os.environ.get("HVDC_KERNEL_CACHE") or Path.home() / ".cache" / "hvd_compress" / "kernels")


def source_bytes():
    """The C source and its headers, as bytes (what a build's cache name hashes)."""
    return tuple(p.read_bytes() for p in (SOURCE, *HEADERS))


def include_flags():
    """The -I flag for the directory of the headers."""
    return ("-I", str(SOURCE.parent))


def library_path(cc):
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    h = hashlib.blake2b(digest_size=8)
    for part in (*source_bytes(), " ".join(FLAGS).encode(), repr(version).encode(), _cpu_model().encode(),
                 platform.machine().encode()):
        h.update(part)
    return cache_dir() / f"hvdc_kernels-{h.hexdigest()}.so"


def build(cc=None):
    """Compile the kernels if this machine has no current build; returns the path."""
    cc = cc or compiler()
    if cc is None:
        raise RuntimeError("no C compiler found (set CC, or install gcc): hvd_compress runs its eager path")
    path = library_path(cc)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, *include_flags(), str(SOURCE), "-o", tmp, "-lm"], capture_output=True,
                              text=True)
        if done.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE.name} failed:\n{done.stderr[-2000:]}")
        os.replace(tmp, path)  # atomic: a concurrent rank sees the whole file or none
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def enabled():
    """False where ``HVDC_KERNELS=0`` asks for the eager reference path."""
    return os.environ.get("HVDC_KERNELS", "1") != "0"


def load():
    """The loaded kernel library, or None (disabled, or no compiler: warned once)."""
    global _lib, _failed
    if not enabled():
        return None
    if _lib is not None or _failed is not None:
        return _lib
    with _lock:
        if _lib is None and _failed is None:
            try:
                lib = ctypes.CDLL(str(build()))
                for name, (args, res) in SIGNATURES.items():
                    fn = getattr(lib, name)
                    fn.argtypes, fn.restype = args, res
                _lib = lib
            except (RuntimeError, OSError) as e:
                _failed = str(e)
                warnings.warn(f"hvd_compress: fused CPU kernels unavailable, using the eager path: {e}",
                              RuntimeWarning, stacklevel=3)
    return _lib


def available():
    return load() is not None
