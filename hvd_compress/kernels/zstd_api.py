"""zstd's C functions for Lossless's kernels (``hvdc_lossless_encode`` and
``hvdc_lossless_decode_add``), which call zstd through a table of function
pointers filled here.

The library is the zstd the ``zstandard`` package bundles: its cffi extension
exports zstd's API, and it is the same zstd as the package's C backend, so a
frame is byte for byte the one ``zstandard.ZstdCompressor`` writes (a test
holds the two to it).  Where that extension is missing, the system's
``libzstd``; where neither loads, :func:`load` returns None and Lossless runs
python-zstandard block by block.  ``HVDC_ZSTD_LIBRARY`` names another library
to load instead.  Contexts are kept per thread (a context is not thread-safe,
and a fresh one per call would allocate its tables every call).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import threading

#: the functions the kernels take, in the order of their table (hvdc_kernels.h)
TABLE = ("ZSTD_compressCCtx", "ZSTD_decompressDCtx", "ZSTD_findFrameCompressedSize", "ZSTD_isError")

_lock = threading.Lock()
_loaded = {}


def candidates():
    """Paths or names of zstd libraries to try, best first."""
    named = os.environ.get("HVDC_ZSTD_LIBRARY")
    if named:
        return [named]
    out = []
    try:
        import zstandard
        out += sorted(glob.glob(os.path.join(os.path.dirname(zstandard.__file__), "_cffi*.so")))
    except ImportError:
        pass
    system = ctypes.util.find_library("zstd")
    return out + ([system] if system else [])


class Zstd:
    """One loaded zstd library: the kernels' function table, ``compressBound``
    and this thread's kept contexts."""

    def __init__(self, lib, path):
        self.lib, self.path = lib, path
        self.table = (ctypes.c_void_p * len(TABLE))(*[ctypes.cast(getattr(lib, n), ctypes.c_void_p).value
                                                          for n in TABLE])
        lib.ZSTD_compressBound.argtypes, lib.ZSTD_compressBound.restype = (ctypes.c_size_t,), ctypes.c_size_t
        lib.ZSTD_versionNumber.restype = ctypes.c_uint
        for kind in ("C", "D"):
            create, free = getattr(lib, f"ZSTD_create{kind}Ctx"), getattr(lib, f"ZSTD_free{kind}Ctx")
            create.restype, free.argtypes, free.restype = ctypes.c_void_p, (ctypes.c_void_p,), ctypes.c_size_t
        self.version = lib.ZSTD_versionNumber()
        self._contexts = threading.local()

    def bound(self, numel: int, block: int) -> int:
        """The most bytes the frames of ``numel`` floats in blocks of ``block`` can take."""
        full, rest = divmod(numel, block)
        return full * self.lib.ZSTD_compressBound(4 * block) + (self.lib.ZSTD_compressBound(4 * rest) if rest else 0)

    def context(self, kind: str) -> int:
        """This thread's ``ZSTD_CCtx`` (``kind`` "C") or ``ZSTD_DCtx`` ("D"), as an address."""
        ctx = getattr(self._contexts, kind, None)
        if ctx is None:
            ctx = _Context(self.lib, kind)
            setattr(self._contexts, kind, ctx)
        return ctx.address


class _Context:
    """A zstd context, freed with its thread's storage."""

    def __init__(self, lib, kind):
        self.free = getattr(lib, f"ZSTD_free{kind}Ctx")
        self.address = getattr(lib, f"ZSTD_create{kind}Ctx")()
        if not self.address:
            raise MemoryError(f"ZSTD_create{kind}Ctx failed")

    def __del__(self):
        self.free(self.address)


def load():
    """The first of :func:`candidates` that loads with every function the kernels
    call, or None."""
    named = os.environ.get("HVDC_ZSTD_LIBRARY", "")
    if named not in _loaded:
        with _lock:
            if named not in _loaded:
                _loaded[named] = _first_loadable()
    return _loaded[named]


def _first_loadable():
    for path in candidates():
        try:
            return Zstd(ctypes.CDLL(path), path)
        except (OSError, AttributeError):
            continue
    return None
