"""Error-feedback memories (GRACE's "Memory" role): what a rank keeps between
steps so that nothing a lossy scheme drops is lost.

A memory turns the raw gradient into the tensor to compress
(:meth:`ResidualMemory.compensate`) and updates its state from what was actually sent
(:meth:`ResidualMemory.update`).  States are dicts of flat fp32 tensors, kept
between steps by a state store (plain tensors in torch, ``tf.Variable`` in TF;
:class:`hvd_compress.protocols.StateStore`) under the slot names below;
:func:`compensate` and :func:`update` run a memory on the stored state of one
parameter.
"""
from __future__ import annotations

from typing import Any, Tuple

from ..schemes.base import check_range

#: the state slot of the error-feedback residual
RESIDUAL = "residual"
#: the state slot of the velocity of DGC's and of the momentum memory
MOMENTUM = "momentum"
#: the state slot of the two-phase owner's second-stage residual (the chunk it owns)
OWNED_CHUNK_RESIDUAL = "owned_chunk_residual"


def finite_or_zero(B, r):
    """Without NaN/Inf entries: a non-finite value is sent like an uncompressed
    gradient would be, but never kept, so one bad step cannot poison later ones."""
    return B.finite_or_zero(r)


class ResidualMemory:
    """Plain error feedback (Seide et al. 2014; Stich et al. 2018;
    Karimireddy et al. 2019): ``acc = g + e``; ``e' = acc - sent``.
    Over any number of steps ``sum(sent) + e == sum(g)``."""
    names = (RESIDUAL,)

    def compensate(self, B, x, state):
        return x + state["residual"]

    def update(self, B, acc, sent, state):
        return {"residual": finite_or_zero(B, acc - sent)}

    def config(self):
        return {"memory": "residual"}


class MomentumMemory:
    """Momentum-aware error feedback: the optimizer's momentum moves into the
    compressor, before compression, and error feedback keeps the error of the
    momentum, not of the gradient.

    Per tensor and per rank, at each communication::

        u   <- m u + g                    velocity (torch SGD's momentum buffer)
        d    = u            (heavy ball)  or  g + m u  (nesterov=True)
        acc  = e + d                      compress acc; send C(acc)
        e   <- acc - C(acc)               error feedback, on the momentum

    This is momentum error feedback as analysed by Zheng, Huang and Kwok,
    "Communication-Efficient Distributed Blockwise Momentum SGD with
    Error-Feedback" (NeurIPS 2019), and DGC's momentum correction (Lin et al.,
    ICLR 2018, §3.2) without DGC's momentum factor masking, which only makes
    sense for sparsifiers (a sign or quantizer sends every element, so masking
    would erase the momentum; :class:`DGCMemory` keeps it for DGC).

    **Conservation law.**  Over any number of steps, per rank,
    ``sum(sent) + e == sum(d)``: everything the momentum asked for is either
    applied or still in the residual ``e``; nothing is dropped.  Without error
    feedback (``error_feedback=False``: SignSGD's Signum, Bernstein et al.
    2018; QSGD; casts) only ``u`` is kept and ``d`` itself is compressed.

    **Why this form and not EF21-SGDM** (Fatkhullin, Tyurin, Richtárik,
    "Momentum Provably Improves Error Feedback!", NeurIPS 2023): both put the
    momentum before the compressor, which is what cures the failure measured in
    docs/results/convergence.md (the optimizer's momentum multiplying every late
    release of the residual by up to 1/(1-m)).  EF21-SGDM however sends
    compressed *differences* to a running estimate that every rank must add
    after the exchange, a state on the receiving side that no Horovod
    ``decompress`` keeps; this form needs state on the sending side only, works
    with every scheme and transport unchanged, and with a lossless compressor
    it *is* torch's ``SGD(momentum=m, nesterov=...)`` step for step (tested),
    so the learning rate tuned for momentum SGD carries over unchanged.
    docs/guide/schemes.md has the measured recipes.

    **Use.**  ``hvd_compress.TopK(0.01, momentum=0.9)`` (every factory takes
    ``momentum=`` and ``nesterov=``) with the optimizer's own momentum set to 0:
    torch ``SGD(params, lr, momentum=0)``, Keras ``SGD(learning_rate,
    momentum=0.0)``.  Keep the learning rate of momentum SGD.  Weight decay
    given to the optimizer is then applied after the exchange, without
    momentum; put it in the loss to have it inside the momentum.  Adaptive
    optimizers (Adam) keep their own first moment: leave ``momentum=0`` there.

    Tuning: ``m`` as for SGD (0.9).  A scheme whose residual is large (Random-K
    at 1%, the sign family) gains most; for Top-K at 1% the optimizer's momentum
    already works and the two placements measure alike (docs/results/convergence.md).
    """

    def __init__(self, momentum=0.9, nesterov=False, error_feedback=True):
        check_range("momentum", momentum, 0.0, 1.0, hi_open=True)
        if not isinstance(nesterov, bool):
            raise ValueError(f"nesterov must be True or False; got {nesterov!r}")
        if not isinstance(error_feedback, bool):
            raise ValueError(f"error_feedback must be True or False; got {error_feedback!r}")
        self.momentum = float(momentum)
        self.nesterov = nesterov
        #: whether the residual ``e`` is kept (error feedback) or only the velocity
        self.error_feedback = error_feedback
        self.names = ("residual", "momentum") if error_feedback else ("momentum",)

    def compensate(self, B, x, state):
        u = state["momentum"] * self.momentum + x
        state["_velocity"] = u
        d = x + u * self.momentum if self.nesterov else u
        if self.error_feedback:
            return state["residual"] + d
        # Horovod's torch optimizer reduces what compress returns in place; where a
        # scheme sends its input as is (NoCompression), the kept velocity must not be
        # that buffer, or it would become the sum over ranks
        return B.copy(d) if d is u else d

    def update(self, B, acc, sent, state):
        # A NaN/Inf gradient is sent like an uncompressed one would be, but kept
        # in neither the velocity nor the residual.
        out = {"momentum": finite_or_zero(B, state["_velocity"])}
        if self.error_feedback:
            out["residual"] = finite_or_zero(B, acc - sent)
        return out

    def config(self):
        return {"memory": "momentum", "momentum": self.momentum, "nesterov": self.nesterov,
                "error_feedback": self.error_feedback}


class DGCMemory:
    """Deep Gradient Compression's corrections (Lin et al., ICLR 2018, §3):

    * **local gradient clipping** -- ``g *= min(1, clip_norm / ||g||)`` before
      accumulation (the paper clips at the global threshold times N^-1/2);
    * **momentum correction** -- accumulate the *velocity* ``u = m u + g``
      instead of the gradient, ``v = v + u``, and compress ``v``;
    * **momentum factor masking** -- where an element was sent, zero both
      ``v`` (as plain error feedback does) and ``u``, so stale momentum does
      not push a coordinate that was already applied.

    Because momentum is applied here, the training script's optimizer must be plain SGD
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


def momentum_memory(scheme, momentum=0.0, nesterov=False, error_feedback=None):
    """The memory a factory's ``momentum=`` / ``nesterov=`` ask for: None for
    ``momentum=0`` (plain error feedback, or nothing), else a
    :class:`MomentumMemory` that keeps a residual where error feedback is on
    (``error_feedback``, or the scheme's default when None)."""
    check_range("momentum", momentum, 0.0, 1.0, hi_open=True)
    if not isinstance(nesterov, bool):
        raise ValueError(f"nesterov must be True or False; got {nesterov!r}")
    if nesterov and momentum == 0:
        raise ValueError("nesterov=True needs momentum > 0 (as torch.optim.SGD requires); got momentum=0")
    if momentum == 0:
        return None
    ef = scheme.error_feedback_default if error_feedback is None else error_feedback
    if ef not in (True, False):
        raise ValueError(f"error_feedback must be True, False or None (scheme default); got {error_feedback!r}")
    return MomentumMemory(momentum, nesterov, error_feedback=ef)


def compensate(store, memory, key: str, numel: int, x, slots=None) -> Tuple[Any, dict]:
    """``memory.compensate`` on the stored state of ``key``: (what to encode, state).

    ``store`` keeps the state between steps (:class:`hvd_compress.protocols.StateStore`);
    ``slots`` maps a memory state name to the slot it is stored in (the
    two-phase owner keeps its residual in :data:`OWNED_CHUNK_RESIDUAL`).  The
    state dict goes unchanged to :func:`update`: a memory may leave values
    there for its update (the velocity of DGC's and the momentum memory)."""
    slots = slots or {}
    state = {name: store.get_memory(slots.get(name, name), key, numel, x) for name in memory.names}
    return memory.compensate(store.B, x, state), state


def update(store, memory, key: str, acc, sent, state: dict, slots=None) -> list:
    """``memory.update`` and storing the new state (the slots as in
    :func:`compensate`); returns the dependencies (TF assign ops) that the
    outputs must wait on."""
    slots = slots or {}
    new_state = memory.update(store.B, acc, sent, state)
    return [store.set_memory(slots.get(name, name), key, new_state[name]) for name in memory.names]
