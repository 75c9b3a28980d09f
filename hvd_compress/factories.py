"""The public compressor factories, ``hvd_compress.TopK(0.01)`` and the rest:
one per registered scheme (:data:`hvd_compress.schemes.REGISTRY`), under the
scheme's public name, and :func:`DGC` with its memory.

Each builds a :class:`~hvd_compress.Compressor` around the scheme of the same
name; keyword arguments ``error_feedback`` (default: the scheme's), ``seed``,
``transport``, ``momentum`` and ``nesterov`` go to the compressor, the rest to
the scheme.  ``hvd_compress`` re-exports them all; ``policy.py`` builds its
dense and Top-K phases with them.
"""
from __future__ import annotations

from functools import wraps

from . import schemes as _s
from .compressor import Compressor
from .feedback.memory import DGCMemory, momentum_memory


def _factory(scheme_cls):
    @wraps(scheme_cls, assigned=("__doc__", "__name__", "__qualname__"), updated=())
    def make(*args, error_feedback=None, seed=0, transport="allgather", momentum=0.0, nesterov=False, **kwargs):
        if isinstance(kwargs.get("values"), Compressor):
            kwargs["values"] = kwargs["values"].scheme
        scheme = scheme_cls(*args, **kwargs)
        # momentum= moves the optimizer's momentum before the compressor (MomentumMemory)
        memory = momentum_memory(scheme, momentum, nesterov, error_feedback)
        return Compressor(scheme, error_feedback=error_feedback, seed=seed, transport=transport, memory=memory)
    make.__module__ = "hvd_compress"  # documented and shown where users call it
    return make


#: one compressor factory per registered scheme, under the scheme's public
#: name; DGC's own factory below replaces the plain one and adds its memory
FACTORIES = {reg.name: _factory(reg.cls) for reg in _s.REGISTRY.values()}
_dgc_selection = FACTORIES["DGC"]


def DGC(ratio=0.001, sample_ratio=0.01, values=None, *, momentum=0.0, clip_norm=None, error_feedback=None,
        seed=0):
    """Deep Gradient Compression (Lin et al., ICLR 2018): sampled-threshold
    Top-K selection (:class:`hvd_compress.schemes.DGC`) plus, with
    ``momentum > 0`` or ``clip_norm``, the paper's momentum correction, local
    gradient clipping and momentum factor masking (:class:`~hvd_compress.DGCMemory`); then
    use plain SGD without momentum in the optimizer."""
    memory = DGCMemory(momentum, clip_norm) if (momentum or clip_norm is not None) else None
    comp = _dgc_selection(ratio, sample_ratio, values=values, error_feedback=error_feedback, seed=seed)
    if memory is not None:
        comp = Compressor(comp.scheme, error_feedback=True if error_feedback is None else error_feedback,
                          seed=seed, memory=memory)
    return comp


DGC.__module__ = "hvd_compress"
FACTORIES["DGC"] = DGC
globals().update(FACTORIES)
none = FACTORIES["NoCompression"]

__all__ = ["FACTORIES", "none", *FACTORIES]
