"""The math of each scheme, framework- and Horovod-free."""
from .base import EncodeContext, Scheme
from .casts import BF16, FP16, NoCompression
from .quantization import QSGD, EFSignSGD, Int8, OneBit, SignSGD, TernGrad
from .lossless import Lossless
from .lowrank import PowerSGD
from .sparsification import DGC, RandomK, Threshold, TopK

__all__ = ["Scheme", "EncodeContext", "NoCompression", "FP16", "BF16", "Int8", "QSGD", "TernGrad",
           "SignSGD", "EFSignSGD", "OneBit", "TopK", "RandomK", "Threshold", "DGC", "PowerSGD", "Lossless"]
