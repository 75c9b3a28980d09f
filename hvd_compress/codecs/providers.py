"""Codec providers: which fused codec (if any) runs a scheme and memory on a
tensor, per framework (:class:`hvd_compress.protocols.CodecProvider`).  A
provider is built over its framework's state store, whose state the codecs
update in place."""
from __future__ import annotations

from ..feedback.memory import MOMENTUM


class NoCodecs:
    """No fused codecs: every scheme runs its eager code."""
    #: the codecs encode views of a tensor and update state in place, so
    #: two-phase may run them chunk by chunk
    on_chunks = False

    def __init__(self, store=None):
        self.store = store

    def fused_codec(self, scheme, memory, x):
        """A fused kernel codec for this scheme, memory and flat tensor, or None."""
        return None

    def lowrank_codec(self, scheme, memory, x):
        """PowerSGD's rounds in preallocated buffers for this flat tensor, or None."""
        return None

    def fused_momentum(self, memory, key, numel, x, ws, out):
        """Momentum-aware error feedback's first half ahead of a fused codec
        (:class:`~hvd_compress.MomentumMemory`): ``u = m u + x`` into the stored
        velocity of ``key`` (kept finite) and the direction ``d`` returned
        (``u``, or ``x + m u`` with Nesterov).  The codec then compresses
        ``d + residual``, as the eager path does."""
        raise TypeError("no fused codec runs here, so no fused momentum pass either")

    def fuses_momentum(self, x):
        """Whether :meth:`fused_momentum` runs on the tensor ``x``."""
        return False


class TorchCodecs(NoCodecs):
    """The PyTorch CPU codecs (:mod:`.torch_fused`, :mod:`.torch_lowrank`)."""
    on_chunks = True

    def fused_codec(self, scheme, memory, x):
        from .torch_fused import codec_for
        return codec_for(scheme, memory, x)

    def lowrank_codec(self, scheme, memory, x):
        from .torch_lowrank import codec_for
        return codec_for(scheme, memory, x)

    def fused_momentum(self, memory, key, numel, x, ws, out):
        from .torch_fused import apply_momentum
        return apply_momentum(x, self.store.get_memory(MOMENTUM, key, numel, x), memory, ws, out)

    def fuses_momentum(self, x):
        from .torch_fused import fuses
        return fuses(x)


class TFCodecs(NoCodecs):
    """The TensorFlow CPU codecs (:mod:`.tf_fused`): graph ops bound to a
    whole residual variable, so never on chunks."""

    def fused_codec(self, scheme, memory, x):
        from ..kernels import native
        if not native.enabled():  # HVDC_KERNELS=0: no import of the op library at all
            return None
        from .tf_fused import codec_for
        return codec_for(scheme, memory, x, self.store)

    def fuses_momentum(self, x):
        from ..kernels import native
        return native.enabled()

    def fused_momentum(self, memory, key, numel, x, ws, out):
        # One op (the torch path's C kernel) updates the velocity variable in
        # place and returns d; as TF ops (u * m + x, the finite check, the
        # assign) the same step cost 5x the codec's own pass (bench micro).
        import tensorflow as tf

        from ..kernels.tf_native import load
        u = self.store.memory_variable(MOMENTUM, key, lambda: tf.zeros([numel]))
        return load().hvdc_momentum(x=x, u=u.handle, n=int(numel), m=memory.momentum, nesterov=memory.nesterov)
