"""Build and load the TensorFlow op library ``hvdc_tf_ops.cc`` + ``hvdc_kernels.c``.

Both include ``hvdc_kernels.h``, the one declaration of the C functions the ops call.

The C kernels are compiled with the C compiler and the flags of
:mod:`.native` (the same code the torch codecs run), the ops with the C++
compiler and TensorFlow's own compile and link flags, and both are linked
into one shared object loaded by ``tf.load_op_library``.  It is cached next
to the C library, under a name that hashes both sources and the headers, the flags, the
compilers' versions, the TensorFlow version and the CPU model; it is built
under a temporary name and then renamed, so concurrent ranks never load a
half-written file.  ``python -m hvd_compress.kernels`` builds it ahead of time.
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

from . import native

SOURCE = Path(__file__).with_name("hvdc_tf_ops.cc")
#: the C flags of .native, for an object file (no -shared)
C_FLAGS = tuple(f for f in native.FLAGS if f != "-shared") + ("-c",)
#: the ops only move pointers (the vector code is the C object's): no -march,
#: which would also switch on Eigen's AVX512-FP16 headers that g++ 12 rejects
CXX_FLAGS = ("-O2", "-shared", "-fPIC", "-Wno-deprecated-declarations")

_lock = threading.Lock()
_ops = None
_failed = None


def cxx_compiler():
    """The C++ compiler: ``$CXX``, else c++ or g++ on the PATH (None if neither)."""
    return native.find_tool("CXX", "c++", "g++")


def _tf_flags():
    import tensorflow as tf
    return tuple(tf.sysconfig.get_compile_flags()), tuple(tf.sysconfig.get_link_flags()), tf.__version__


def library_path(cc, cxx, tf_flags):
    h = hashlib.blake2b(digest_size=8)
    versions = [subprocess.run([c, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
                for c in (cc, cxx)]
    for part in (*native.source_bytes(), SOURCE.read_bytes(), repr((C_FLAGS, CXX_FLAGS, tf_flags)).encode(),
                 repr(versions).encode(), native.library_path(cc).name.encode()):  # the latter: the CPU model
        h.update(part)
    return native.cache_dir() / f"hvdc_tf_ops-{h.hexdigest()}.so"


def _run(cmd, what):
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"compiling {what} failed:\n{done.stderr[-2000:]}")


def build(cc=None, cxx=None):
    """Compile the op library if this machine has no current build; returns the path."""
    cc, cxx = cc or native.compiler(), cxx or cxx_compiler()
    if cc is None or cxx is None:
        raise RuntimeError("no C and C++ compiler found (set CC and CXX, or install gcc and g++): "
                           "hvd_compress runs its eager TensorFlow path")
    compile_flags, link_flags, version = tf_flags = _tf_flags()
    path = library_path(cc, cxx, tf_flags)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        obj, so = os.path.join(tmp, "hvdc_kernels.o"), os.path.join(tmp, "ops.so")
        _run([cc, *C_FLAGS, *native.include_flags(), str(native.SOURCE), "-o", obj], native.SOURCE.name)
        _run([cxx, *CXX_FLAGS, *compile_flags, *native.include_flags(), str(SOURCE), obj, "-o", so, *link_flags,
              "-lm"], SOURCE.name)
        os.replace(so, path)  # atomic: a concurrent rank sees the whole file or none
    return path


def load():
    """The loaded op module, or None (disabled, or it did not build: warned once)."""
    global _ops, _failed
    if not native.enabled():
        return None
    if _ops is not None or _failed is not None:
        return _ops
    with _lock:
        if _ops is None and _failed is None:
            try:
                import tensorflow as tf
                _ops = tf.load_op_library(str(build()))
            except Exception as e:  # noqa: BLE001 -- any failure means: the eager path runs
                _failed = str(e)
                warnings.warn(f"hvd_compress: fused TensorFlow kernels unavailable, using the eager path: {e}",
                              RuntimeWarning, stacklevel=3)
    return _ops
