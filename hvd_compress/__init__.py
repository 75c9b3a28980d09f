"""hvd_compress: gradient compression with error feedback for stock Horovod.

Pass any of these as ``compression=`` to the unmodified
``hvd.DistributedOptimizer`` (PyTorch), ``hvd.DistributedGradientTape`` or the
TF/Keras ``DistributedOptimizer``::

    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                   compression=hvd_compress.TopK(0.01))

Each name builds a :class:`Compressor` around the scheme of the same name in
:mod:`hvd_compress.schemes`; keyword arguments ``error_feedback`` (default:
the scheme's) and ``seed`` go to the compressor, the rest to the scheme.
One object serves PyTorch and TensorFlow.
"""
from functools import wraps

from . import schemes as _s
from .auto_compressor import Auto
from .compressor import Compressor
from .memory import DGCMemory, MomentumMemory, ResidualMemory, momentum_memory
from .policy import Policy, Rule, Schedule, recipe

__version__ = "0.1.0"


def _factory(scheme_cls):
    @wraps(scheme_cls, assigned=("__doc__", "__name__", "__qualname__"), updated=())
    def make(*args, error_feedback=None, seed=0, transport="allgather", momentum=0.0, nesterov=False, **kwargs):
        if isinstance(kwargs.get("values"), Compressor):
            kwargs["values"] = kwargs["values"].scheme
        scheme = scheme_cls(*args, **kwargs)
        # momentum= moves the optimizer's momentum before the compressor (MomentumMemory)
        memory = momentum_memory(scheme, momentum, nesterov, error_feedback)
        return Compressor(scheme, error_feedback=error_feedback, seed=seed, transport=transport, memory=memory)
    make.__module__ = __name__
    return make


#: one compressor factory per registered scheme (hvd_compress.schemes.REGISTRY),
#: under the scheme's public name; DGC's own factory below adds its memory
_FACTORIES = {reg.name: _factory(reg.cls) for reg in _s.REGISTRY.values()}
globals().update(_FACTORIES)
none = _FACTORIES["NoCompression"]
_dgc_selection = _FACTORIES["DGC"]


def DGC(ratio=0.001, sample_ratio=0.01, values=None, *, momentum=0.0, clip_norm=None, error_feedback=None,
        seed=0):
    """Deep Gradient Compression (Lin et al., ICLR 2018): sampled-threshold
    Top-K selection (:class:`hvd_compress.schemes.DGC`) plus, with
    ``momentum > 0`` or ``clip_norm``, the paper's momentum correction, local
    gradient clipping and momentum factor masking (:class:`DGCMemory`); then
    use plain SGD without momentum in the optimizer."""
    memory = DGCMemory(momentum, clip_norm) if (momentum or clip_norm is not None) else None
    comp = _dgc_selection(ratio, sample_ratio, values=values, error_feedback=error_feedback, seed=seed)
    if memory is not None:
        comp = Compressor(comp.scheme, error_feedback=True if error_feedback is None else error_feedback,
                          seed=seed, memory=memory)
    return comp


_FACTORIES["DGC"] = DGC

__all__ = ["Auto", "Compressor", "DGCMemory", "MomentumMemory", "ResidualMemory", "Policy", "Rule", "Schedule", "recipe",
           "NoCompression", "none", *[name for name in _FACTORIES if name != "NoCompression"]]
