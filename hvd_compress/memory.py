"""Error-feedback memories (GRACE's "Memory" role): what a rank keeps between
steps so that nothing a lossy scheme drops is lost.

A memory turns the raw gradient into the tensor to compress
(:meth:`ResidualMemory.compensate`) and updates its state from what was actually sent
(:meth:`ResidualMemory.update`).  States are dicts of flat fp32 tensors; the adapters own
their storage (plain tensors in torch, ``tf.Variable`` in TF) and checkpoints.
"""
from __future__ import annotations

from .schemes.base import check_range


def finite_or_zero(B, r):
    """Without NaN/Inf entries: a non-finite value is sent like an uncompressed
    gradient would be, but never kept, so one bad step cannot poison later ones."""
    return B.finite_or_zero(r)


class ResidualMemory:
    """Plain error feedback (Seide et al. 2014; Stich et al. 2018;
    Karimireddy et al. 2019): ``acc = g + e``; ``e' = acc - sent``.
    Over any number of steps ``sum(sent) + e == sum(g)``."""
    names = ("residual",)

    def compensate(self, B, x, state):
        return x + state["residual"]

    def update(self, B, acc, sent, state):
        return {"residual": finite_or_zero(B, acc - sent)}

    def config(self):
        return {"memory": "residual"}


class DGCMemory:
    """Deep Gradient Compression's corrections (Lin et al., ICLR 2018, §3):

    * **local gradient clipping** -- ``g *= min(1, clip_norm / ||g||)`` before
      accumulation (the paper clips at the global threshold times N^-1/2);
    * **momentum correction** -- accumulate the *velocity* ``u = m u + g``
      instead of the gradient, ``v = v + u``, and compress ``v``;
    * **momentum factor masking** -- where an element was sent, zero both
      ``v`` (as plain error feedback does) and ``u``, so stale momentum does
      not push a coordinate that was already applied.

    Because momentum is applied here, the user's optimizer must be plain SGD
    **without** momentum (torch ``SGD(momentum=0)``, Keras ``SGD(momentum=0.0)``);
    an optimizer with its own momentum would apply it twice.  Adaptive
    optimizers (Adam) are outside what the paper analyses.  The conservation
    law holds for the velocities: ``sum(sent) + v == sum(u)``.
    """
    names = ("residual", "momentum")

    def __init__(self, momentum=0.9, clip_norm=None):
        check_range("momentum", momentum, 0.0, 1.0, hi_open=True)
        if clip_norm is not None:
            check_range("clip_norm", clip_norm, 0.0, None, lo_open=True)
        self.momentum = float(momentum)
        self.clip_norm = clip_norm

    def compensate(self, B, x, state):
        if self.clip_norm is not None:
            norm = B.norm(x)
            x = x * B.where(norm > self.clip_norm, self.clip_norm / B.maximum(norm, norm * 0 + 1e-30),
                            norm * 0 + 1.0)
        u = state["momentum"] * self.momentum + x
        state["_velocity"] = u
        return state["residual"] + u

    def update(self, B, acc, sent, state):
        kept = B.cast(sent == 0, "float32")  # 0 where the element was sent
        return {"residual": finite_or_zero(B, acc - sent),
                "momentum": finite_or_zero(B, state["_velocity"] * kept)}

    def config(self):
        return {"memory": "dgc", "momentum": self.momentum, "clip_norm": self.clip_norm}
