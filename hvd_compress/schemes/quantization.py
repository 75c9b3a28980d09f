"""Quantizers: fewer bits per element, same dense structure."""
from __future__ import annotations

from ..backend import ceil_div
from .bit_coding import pack_bits, unpack_bits
from .base import Scheme, check_range, register


def _blocks(B, x, block):
    """View flat ``x`` as (blocks, block), zero-padded at the end (at least one
    block, so an empty ``x`` still has one scale and the part's length is fixed)."""
    n = B.numel(x)
    nb = max(1, ceil_div(n, block))
    pad = nb * block - n
    if pad:
        x = B.concat([x, B.zeros(pad, "float32", like=x)])
    return B.reshape(x, (nb, block)), n


@register(kind="quantizer",
          examples={"int8": "Int8()", "int8-b100": "Int8(block_size=100)", "int8-b1": "Int8(block_size=1)",
                    "int8-b4096": "Int8(block_size=4096)"},
          horovod={"Int8": "Int8()", "Int8-block64": "Int8(block_size=64)"},
          table={"Int8()": "n + 4", "Int8(block_size=4096)": "n + 4 ceil(n/b)"})
class Int8(Scheme):
    """Linear 8-bit quantization: ``q = clip(round(x / scale), -127, 127)``.

    The textbook quantizer: 4x fewer bytes than fp32.  ``scale = max|x| / 127`` per tensor
    (``block_size=None``) or per block of ``block_size`` elements, which keeps
    one outlier from flattening a whole tensor.  Payload: n int8 + one fp32
    scale per block.  Error feedback is on by default: rounding is biased for
    small values.  See Dettmers, "8-Bit Approximations for Parallelism in Deep
    Learning", ICLR 2016.

    Tuning: per-block scales (e.g. 4096) cost 1/1024 extra bytes and cut the
    error on tensors with heavy tails.
    """
    error_feedback_default = True

    def __init__(self, block_size=None):
        if block_size is not None:
            check_range("block_size", block_size, 1, None, kind=int)
        self.block_size = block_size

    def config(self):
        return {"block_size": self.block_size}

    @property
    def per_element_parts(self):
        # per-block scales: one per block_size elements, so their count follows the kept count too
        return ("q",) if self.block_size is None else ("q", "scale")

    def block_for(self, n):
        """The elements per scale of an ``n``-element tensor."""
        return max(1, n if self.block_size is None else min(self.block_size, n))

    def encode(self, B, x, ctx):
        n = B.numel(x)
        xb, _ = _blocks(B, x, self.block_for(n))
        amax = B.abs_max(xb, axis=1)
        # only an all-zero block gets the dummy scale 1; a NaN/Inf amax stays in the
        # scale so the non-finite value reaches the receivers (and equals ``sent``)
        scale = B.where(amax == 0, B.ones(B.numel(amax), "float32", like=x), amax / 127.0)
        q = B.round_clip(xb / B.reshape(scale, (-1, 1)), -127.0, 127.0)
        sent = B.flatten(q * B.reshape(scale, (-1, 1)))[:n]
        return {"q": B.cast(B.flatten(q)[:n], "int8"), "scale": scale}, sent

    def decode_one(self, B, payload, numel, ctx=None):
        q = B.cast(payload["q"], "float32")
        xb, _ = _blocks(B, q, self.block_for(numel))
        return B.flatten(xb * B.reshape(payload["scale"], (-1, 1)))[:numel]

    def payload_nbytes(self, numel):
        return numel + 4 * max(1, ceil_div(numel, self.block_for(numel)))


@register(kind="quantizer", compare="reducing",
          examples={"qsgd127": "QSGD()", "qsgd4": "QSGD(4)", "qsgd1": "QSGD(1)"}, single_step=("qsgd1",),
          horovod={"QSGD16": "QSGD(16)"}, table={"QSGD(127)": "n + 4"})
class QSGD(Scheme):
    """QSGD stochastic quantization with ``levels`` levels (Alistarh et al., NeurIPS 2017).

    ``x_i -> ||x||_2 * sign(x_i) * l_i / s`` with ``l_i`` rounded up or down at
    random so that the result is unbiased.  Levels up to 127 travel as int8
    (sign folded in) plus one fp32 norm.  Unbiased, so error feedback is off by
    default; its variance grows like ``min(n/s^2, sqrt(n)/s)``.

    Tuning: ``levels=127`` (8 bits) is near-lossless for training; 4-16 levels
    need error feedback or larger batches.
    """
    stochastic = True
    error_feedback_default = False
    per_element_parts = ("q",)

    def __init__(self, levels=127):
        check_range("levels", levels, 1, 127, kind=int)
        self.levels = levels

    def config(self):
        return {"levels": self.levels}

    def encode(self, B, x, ctx):
        n = B.numel(x)
        norm = B.norm(x)
        safe = B.where(norm == 0, B.ones(1, "float32", like=x)[0], norm)  # NaN norm propagates
        level = B.abs(x) / safe * float(self.levels)
        q = B.floor(level + ctx.uniform(n))  # P(round up) = fractional part
        q = B.clip(q, 0.0, float(self.levels)) * B.sign(x)
        sent = q * (safe / float(self.levels)) if ctx.need_sent else None
        return {"q": B.cast(q, "int8"), "norm": B.reshape(norm, (1,))}, sent

    def decode_one(self, B, payload, numel, ctx=None):
        return B.cast(payload["q"], "float32") * (payload["norm"][0] / float(self.levels))

    def payload_nbytes(self, numel):
        return numel + 4


@register(kind="quantizer", examples={"terngrad": "TernGrad()"}, horovod={"TernGrad": "TernGrad()"},
          table={"TernGrad()": "n/4 + 4"})
class TernGrad(Scheme):
    """TernGrad (Wen et al., NeurIPS 2017): ``s * sign(x) * Bernoulli(|x| / s)``
    with ``s = max|x|``; unbiased, 2 bits an element (packed 4 to a byte)
    plus one fp32 scale.  Error feedback off by default.
    """
    stochastic = True
    error_feedback_default = False
    per_element_parts = ("t",)

    def encode(self, B, x, ctx):
        n = B.numel(x)
        s = B.max(B.abs(x)) if n else B.zeros(1, "float32", like=x)[0]  # max of nothing is an error
        safe = B.where(s > 0, s, B.ones(1, "float32", like=x)[0])
        keep = B.cast(ctx.uniform(n) < B.abs(x) / safe, "float32")
        t = keep * B.sign(x)  # in {-1, 0, 1}
        codes = B.cast(t + 1.0, "int32")  # {0, 1, 2}
        return {"t": pack_bits(B, codes, 2), "scale": B.reshape(s, (1,))}, (t * s if ctx.need_sent else None)

    def decode_one(self, B, payload, numel, ctx=None):
        t = B.cast(unpack_bits(B, payload["t"], 2, numel), "float32") - 1.0
        return t * payload["scale"][0]

    def payload_nbytes(self, numel):
        return ceil_div(numel, 4) + 4


def _sign_bits(B, x):
    """1 where x >= 0 (a zero votes +, as in signSGD's reference code)."""
    return B.cast(x >= 0, "int32")


def _bits_to_sign(B, bits, numel):
    return B.cast(unpack_bits(B, bits, 1, numel), "float32") * 2.0 - 1.0


@register(kind="quantizer", examples={"signsgd": "SignSGD()"}, horovod={"SignSGD": "SignSGD()"},
          table={"SignSGD()": "n/8"})
class SignSGD(Scheme):
    """signSGD with majority vote (Bernstein et al., ICML 2018 / ICLR 2019).

    Each rank sends 1 bit an element; the result is the element-wise majority
    ``sign(sum_i sign(x_i))`` -- a vote, so Horovod's Average/Sum scaling does
    not apply and the optimizer's learning rate sets the step (use a small one,
    as for Adam-like steps).  Error feedback is off by default, as in the
    paper; :class:`EFSignSGD` is the variant that keeps it.
    """
    error_feedback_default = False
    apply_op_scale = False
    per_element_parts = ("bits",)

    def encode(self, B, x, ctx):
        bits = _sign_bits(B, x)
        sent = B.cast(bits, "float32") * 2.0 - 1.0 if ctx.need_sent else None
        return {"bits": pack_bits(B, bits, 1)}, sent

    def decode_one(self, B, payload, numel, ctx=None):
        return _bits_to_sign(B, payload["bits"], numel)

    def aggregate(self, B, payloads, numel, ctx=None):
        return B.sign(Scheme.aggregate(self, B, payloads, numel, ctx))

    def payload_nbytes(self, numel):
        return ceil_div(numel, 8)

    def stage2(self):
        # The owner's vote is in {-1, 0, +1}: a tie (even number of ranks) is 0,
        # which one bit cannot carry, so the second stage spends two.
        return TernaryVote()


class TernaryVote(Scheme):
    """A vote in {-1, 0, +1} carried exactly in 2 bits an element (packed 4 to
    a byte, no scale): the second stage of two-phase :class:`SignSGD`, so that
    a tied vote stays 0 as it does over allgather."""
    error_feedback_default = False
    apply_op_scale = False
    per_element_parts = ("t",)

    def encode(self, B, x, ctx):
        t = B.sign(x)
        return {"t": pack_bits(B, B.cast(t + 1.0, "int32"), 2)}, t

    def decode_one(self, B, payload, numel, ctx=None):
        return B.cast(unpack_bits(B, payload["t"], 2, numel), "float32") - 1.0

    def payload_nbytes(self, numel):
        return ceil_div(numel, 4)


@register(kind="quantizer", compare="reducing", examples={"efsignsgd": "EFSignSGD()"},
          horovod={"EFSignSGD": "EFSignSGD()"}, table={"EFSignSGD()": "n/8 + 4"})
class EFSignSGD(Scheme):
    """Scaled sign with error feedback (Karimireddy et al., "Error Feedback
    Fixes SignSGD", ICML 2019): sends ``(||x||_1 / n) * sign(x)`` -- 1 bit an
    element plus one fp32 scale -- and keeps the difference as residual.
    """
    error_feedback_default = True
    per_element_parts = ("bits",)

    def encode(self, B, x, ctx):
        n = B.numel(x)
        scale = B.sum(B.abs(x)) / float(n)
        bits = _sign_bits(B, x)
        sent = (B.cast(bits, "float32") * 2.0 - 1.0) * scale
        return {"bits": pack_bits(B, bits, 1), "scale": B.reshape(scale, (1,))}, sent

    def decode_one(self, B, payload, numel, ctx=None):
        return _bits_to_sign(B, payload["bits"], numel) * payload["scale"][0]

    def payload_nbytes(self, numel):
        return ceil_div(numel, 8) + 4


@register(kind="quantizer", compare="reducing", examples={"onebit": "OneBit()"}, horovod={"OneBit": "OneBit()"},
          table={"OneBit()": "n/8 + 8"})
class OneBit(Scheme):
    """1-bit SGD (Seide et al., Interspeech 2014): each element becomes the mean
    of the positive or of the negative elements, by its sign -- 1 bit an
    element plus two fp32 means.  Error feedback on (the paper's key point).
    """
    error_feedback_default = True
    per_element_parts = ("bits",)

    def encode(self, B, x, ctx):
        pos = B.cast(x >= 0, "float32")
        npos = B.sum(pos)
        nneg = float(B.numel(x)) - npos
        mpos = B.sum(x * pos) / B.maximum(npos, B.ones(1, "float32", like=x)[0])
        mneg = B.sum(x * (1.0 - pos)) / B.maximum(nneg, B.ones(1, "float32", like=x)[0])
        sent = pos * mpos + (1.0 - pos) * mneg
        means = B.stack([mpos, mneg])
        return {"bits": pack_bits(B, B.cast(pos, "int32"), 1), "means": means}, sent

    def decode_one(self, B, payload, numel, ctx=None):
        pos = B.cast(unpack_bits(B, payload["bits"], 1, numel), "float32")
        m = payload["means"]
        return pos * m[0] + (1.0 - pos) * m[1]

    def payload_nbytes(self, numel):
        return ceil_div(numel, 8) + 8
