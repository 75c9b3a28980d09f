"""The named values of ``hvdc_kernels.h``, for the Python side of the kernels.

Each class mirrors one enum of the header, member for member (the member is
the enum constant without its prefix); tests/unit/test_kernels_header.py
parses the header and fails where a name or a value differs.  The members are
ints, so they go straight into a ctypes call or a TF op attribute.
No framework is imported here.
"""
from __future__ import annotations

import enum


class SignMode(enum.IntEnum):
    """``enum hvdc_sign_mode``: what the sign encode sends."""
    SIGNSGD = 0
    EFSIGNSGD = 1
    ONEBIT = 2


class HalfDtype(enum.IntEnum):
    """``enum hvdc_half_dtype``: the 16-bit float of ``hvdc_half_encode``."""
    FP16 = 0
    BF16 = 1


class IndexCode(enum.IntEnum):
    """``enum hvdc_index_code``: the index codes of :mod:`hvd_compress.schemes.bit_coding`."""
    RAW = 0
    BITMAP = 1
    ELIAS_FANO = 2


class NanRule(enum.IntEnum):
    """``enum hvdc_nan_rule``: where a NaN magnitude stands in a selection."""
    DROPPED = 0  # never selected; its residual becomes 0 (Threshold, DGC)
    LARGEST = 1  # the largest magnitude, so always selected (torch.topk's order: Top-K)


class SentRule(enum.IntEnum):
    """``enum hvdc_sent_rule``: the residual a candidate pass writes for each recorded candidate."""
    KEPT = 0  # acc, as every other element's
    ZERO = 1  # 0: acc sent as it is
    BF16 = 2  # acc - float(bfloat16(acc)), non-finite -> 0


class ThresholdRule(enum.IntEnum):
    """``enum hvdc_threshold_rule``: how a magnitude is compared with the threshold."""
    AT_LEAST = 0
    ABOVE = 1


class TopKPlan:
    """``enum hvdc_topk_plan``: Top-K's candidate room and how often its threshold is
    lowered (quantities, not choices: plain ints, two of them equal)."""
    ROOM_PER_K = 3
    ROOM_SLACK = 1024
    LOWERINGS = 3


class LowRankLimit:
    """``enum hvdc_lowrank_limit``: the largest rank the PowerSGD passes run."""
    MAX_RANK = 16


class Framework(enum.IntEnum):
    """``enum hvdc_framework``: whose seeded draws and NaN conventions a randomised kernel reproduces."""
    TORCH = 0
    TF = 1


#: each mirrored enum's C name and the prefix of its constants
HEADER_ENUMS = {
    "hvdc_sign_mode": (SignMode, "HVDC_SIGN_"),
    "hvdc_half_dtype": (HalfDtype, "HVDC_HALF_"),
    "hvdc_index_code": (IndexCode, "HVDC_CODE_"),
    "hvdc_nan_rule": (NanRule, "HVDC_NAN_"),
    "hvdc_sent_rule": (SentRule, "HVDC_SENT_"),
    "hvdc_threshold_rule": (ThresholdRule, "HVDC_"),
    "hvdc_topk_plan": (TopKPlan, "HVDC_TOPK_"),
    "hvdc_lowrank_limit": (LowRankLimit, "HVDC_LOWRANK_"),
    "hvdc_framework": (Framework, "HVDC_FW_"),
}
