"""Fused CPU kernels for the hot schemes: encode at memory speed.

The eager code in :mod:`hvd_compress.schemes` is the reference: it is written
once, in framework-neutral backend ops, and runs everywhere (CPU, CUDA, inside
``tf.function``).  On the CPU every one of those ops is a full pass over
memory into a fresh temporary, so a 16M-element Top-K with error feedback
costs tens of memory copies.  The kernels here do the same math in one or
two passes, in place, into buffers kept per parameter
(:attr:`hvd_compress.adapters.param_state.ParamState.workspace`):

* :mod:`.native` -- the C source ``hvdc_kernels.c``, compiled once per machine
  with the system C compiler into a cache directory and loaded with ctypes
  (no Python extension ABI: one shared object serves every framework); its
  exported functions and their enums are declared once, in ``hvdc_kernels.h``
  (mirrored by :mod:`.constants`), and its vector loops are written once over
  the layer of ``hvdc_simd.h``;
* :mod:`.topk_plan` -- the Top-K plans, the index codes' numbers and the size
  limits, framework-free, shared by the codecs and the eager backends;
* :mod:`.tf_native` -- the same C kernels linked into a TensorFlow op library
  (``hvdc_tf_ops.cc``, built once per machine with TensorFlow's compile flags);
* :mod:`.zstd_api` -- the zstd frame calls of the lossless scheme.

This package is the leaf layer: it imports nothing else of hvd_compress.  The
framework codecs that drive these kernels live one layer up, in
:mod:`hvd_compress.codecs`.

``HVDC_KERNELS=0`` turns them off (the eager reference runs instead); where no
compiler is found, the eager path runs and a warning says so once.
docs/design/kernels.md compares the mechanisms that were measured.
"""
from __future__ import annotations

from .native import available, load  # noqa: F401
