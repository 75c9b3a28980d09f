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
import sys as _sys

from . import factories as _factories
from .auto import Auto
from .compressor import Compressor
from .feedback.memory import DGCMemory, MomentumMemory, ResidualMemory
from .integration import elastic
from .integration.horovod_internals import use_tf_keras_in_horovod_callbacks
from .policy import Policy, Rule, Schedule, recipe

# ``hvd_compress.elastic`` is public (README, docs/guide/elastic.md): ``import
# hvd_compress.elastic`` finds the module here, as ``import os.path`` finds ``posixpath``.
_sys.modules[__name__ + ".elastic"] = elastic

__version__ = "0.1.0"

#: one compressor factory per registered scheme (hvd_compress.schemes.REGISTRY),
#: under the scheme's public name, DGC's with its memory (hvd_compress/factories.py)
globals().update(_factories.FACTORIES)
none = _factories.none

__all__ = ["Auto", "Compressor", "DGCMemory", "MomentumMemory", "ResidualMemory", "Policy", "Rule", "Schedule", "recipe",
           "elastic", "use_tf_keras_in_horovod_callbacks", "NoCompression", "none", *[name for name in _factories.FACTORIES if name != "NoCompression"]]
