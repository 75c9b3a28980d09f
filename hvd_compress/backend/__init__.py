"""Framework-neutral tensor operations.

Every scheme's math is written once, against the vocabulary that
:class:`hvd_compress.protocols.Backend` writes down, and
runs unchanged on PyTorch tensors (CPU or CUDA) and on TensorFlow tensors
(eager or inside the ``tf.function`` that Horovod always traces).  Only
vectorised operations appear here: no Python loops over elements and no host
round trips, so the same code is valid on a GPU.

``backend_for(tensor)`` picks the implementation.  Neither framework is
imported unless a tensor of that framework is seen.  The two implementations
live in ``torch_backend.py`` and ``tf_backend.py``; ``common.py`` has what
they share.
"""
from __future__ import annotations

from .common import DTYPES, bits_for, ceil_div, index_dtype, sampled_topk_plan
from .torch_backend import TorchBackend
from .tf_backend import TensorFlowBackend

_BACKENDS = {}


def backend_for(tensor):
    """The backend that handles ``tensor``'s framework."""
    mod = type(tensor).__module__
    if mod.startswith("torch"):
        key = "torch"
    elif mod.startswith("tensorflow") or mod.startswith("tf_keras") or mod.startswith("keras"):
        key = "tensorflow"
    else:
        raise TypeError(f"hvd_compress: unsupported tensor type {type(tensor)!r}; "
                        "expected a torch.Tensor or a tf.Tensor")
    if key not in _BACKENDS:
        _BACKENDS[key] = TorchBackend() if key == "torch" else TensorFlowBackend()
    return _BACKENDS[key]


__all__ = ["DTYPES", "TorchBackend", "TensorFlowBackend", "backend_for", "bits_for", "ceil_div", "index_dtype",
           "sampled_topk_plan"]
