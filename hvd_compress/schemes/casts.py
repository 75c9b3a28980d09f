"""Passthrough and floating-point casts."""
from __future__ import annotations

from .base import Scheme, register


@register(kind="none", examples={"none": "NoCompression()"}, horovod={"NoCompression": "NoCompression()"},
          table={"NoCompression()": "4n"})
class NoCompression(Scheme):
    """Dense fp32 (or the gradient's own dtype) through Horovod's allreduce."""
    transport = "allreduce"
    error_feedback_default = False
    passes_through = True

    def encode(self, B, x, ctx):
        return {"reduce": x}, x

    def decode_reduced(self, B, reduced, numel, ctx=None):
        return reduced

    def payload_nbytes(self, numel):
        return 4 * numel


@register(kind="quantizer", examples={"fp16": "FP16()"}, horovod={"FP16": "FP16()"}, table={"FP16()": "2n"})
class FP16(Scheme):
    """IEEE half precision through Horovod's allreduce (2 bytes an element).

    Like ``hvd.Compression.fp16`` but with optional error feedback for the
    rounding error (off by default: fp16's relative error of 2**-11 is far
    below gradient noise), and safe on Horovod's sparse path.  Values beyond
    fp16's range (65504) become inf, as with Horovod's fp16; sums are formed
    in fp16 by the collective.  Micikevicius et al., "Mixed Precision
    Training", ICLR 2018.
    """
    transport = "allreduce"
    error_feedback_default = False

    def encode(self, B, x, ctx):
        h = B.cast(x, "float16")
        # the round trip back to fp32 is a full pass: only error feedback reads it
        return {"reduce": h}, (B.cast(h, "float32") if ctx.need_sent else None)

    def decode_reduced(self, B, reduced, numel, ctx=None):
        return B.cast(reduced, "float32")

    def payload_nbytes(self, numel):
        return 2 * numel


@register(kind="quantizer", examples={"bf16": "BF16()"}, horovod={"BF16": "BF16()"}, table={"BF16()": "2n"})
class BF16(Scheme):
    """bfloat16 (8-bit exponent, fp32's range) -- 2 bytes an element.

    Horovod 0.28.1 cannot reduce bfloat16, so the bits travel by allgather as
    int16 and the sum is formed in fp32 on the receiver (more accurate than an
    fp16 ring sum).  Kalamkar et al., "A Study of BFLOAT16 for Deep Learning
    Training", 2019.
    """
    transport = "allgather"
    error_feedback_default = False
    per_element_parts = ("bits",)

    def encode(self, B, x, ctx):
        b = B.cast(x, "bfloat16")
        return {"bits": B.bitcast(b, "int16")}, (B.cast(b, "float32") if ctx.need_sent else None)

    def decode_one(self, B, payload, numel, ctx=None):
        return B.cast(B.bitcast(payload["bits"], "bfloat16"), "float32")

    def payload_nbytes(self, numel):
        return 2 * numel
