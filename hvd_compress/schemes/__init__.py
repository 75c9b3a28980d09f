"""The math of each scheme, framework- and Horovod-free.

Every module of this package is imported here, and each scheme class records
itself with :func:`~hvd_compress.schemes.base.register`, so a new scheme is one
class in one new file (docs/design/adding_a_scheme.md): it appears here, as
``hvd_compress.<Name>`` and in every catalogue without further edits.
"""
import importlib as _importlib
import pkgutil as _pkgutil

from .base import REGISTRY, EncodeContext, Registration, Scheme, build, register, registration
# the built-in schemes, in the order of the catalogues
from .casts import BF16, FP16, NoCompression
from .quantization import QSGD, EFSignSGD, Int8, OneBit, SignSGD, TernGrad
from .sparsification import DGC, RandomK, Threshold, TopK
from .lowrank import PowerSGD
from .lossless import Lossless

# any other module in this package registers its schemes on import
for _module in _pkgutil.iter_modules(__path__):
    _importlib.import_module(f"{__name__}.{_module.name}")
globals().update({_reg.name: _reg.cls for _reg in REGISTRY.values()})

__all__ = ["Scheme", "EncodeContext", "Registration", "REGISTRY", "register", "registration", "build",
           *REGISTRY]
