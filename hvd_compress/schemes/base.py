"""The scheme interface: the math of one compression method, nothing else.

A scheme turns a flat gradient (already corrected by error feedback) into a
*payload* -- a dict of named 1-D tensors -- and says how payloads from all
ranks combine back into one dense tensor.  It does not know about Horovod,
parameters, residuals or frameworks: :class:`hvd_compress.Compressor` and the
framework adapters do that, so every scheme is written once and is testable
against numpy without any collective.

Two transports exist:

* ``"allreduce"`` -- the payload is a single part named ``"reduce"`` whose
  element-wise sum is meaningful (casts, shared-seed Random-K, PowerSGD
  factors).  Horovod's own allreduce carries it; ``decode_reduced`` turns the
  sum back into a dense gradient.
* ``"allgather"`` -- every rank's payload is gathered and ``aggregate`` sums
  the decoded contributions.  Parts whose length differs between ranks are
  listed in ``variable_parts``; the transport sends their lengths too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

Payload = Dict[str, Any]


def check_range(name, value, lo, hi, lo_open=False, hi_open=False, kind=float):
    """Raise a ValueError naming the parameter and the allowed range."""
    ok_type = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind is int:
        ok_type = isinstance(value, int) and not isinstance(value, bool)
    lo_ok = ok_type and (value > lo if lo_open else value >= lo)
    hi_ok = ok_type and (hi is None or (value < hi if hi_open else value <= hi))
    if not (lo_ok and hi_ok):
        left = "(" if lo_open else "["
        right = ")" if hi_open or hi is None else "]"
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"{name} must be {what} in {left}{lo}, {'inf' if hi is None else hi}{right}; "
                         f"got {value!r}")
    return value


@dataclass
class EncodeContext:
    """What a scheme may know about the call, beyond the tensor itself.

    ``uniform(n)`` draws U[0,1) from a generator seeded by (seed, key, step,
    rank) -- private to this call, so no global RNG state changes.
    ``shared_seed`` is the same on every rank for this key and step
    (Random-K needs that).  ``state`` is the scheme's per-key state dict
    (PowerSGD keeps its warm-started Q there).  ``need_sent`` is False when
    nothing will read the dense ``sent`` that ``encode`` returns (no error
    feedback): a scheme whose ``sent`` costs a pass of its own may return None.
    """
    key: str
    step: Any
    rank: int
    size: int
    uniform: Callable[[int], Any]
    shared_seed: Any
    shape: tuple
    state: Optional[dict] = None
    need_sent: bool = True


class Scheme:
    """Base class.  Subclasses set ``transport`` and implement the math."""

    transport = "allgather"
    #: error feedback on by default (the literature requires it for biased schemes)
    error_feedback_default = True
    #: stochastic schemes draw from ``ctx.uniform``
    stochastic = False
    #: parts whose length may differ between ranks
    variable_parts: tuple = ()
    #: whether Horovod's Average/Sum scaling applies to the aggregate
    #: (a majority vote is a sign, not a sum, so it opts out)
    apply_op_scale = True

    def stage2(self):
        """The scheme a two-phase owner re-encodes its combined chunk with
        (itself, unless the combination leaves the scheme's alphabet)."""
        return self

    @property
    def name(self):
        return type(self).__name__

    def config(self) -> dict:
        """Constructor arguments, for fingerprints, ``describe()`` and checkpoints."""
        return {}

    def __repr__(self):
        args = ", ".join(f"{k}={v!r}" for k, v in self.config().items())
        return f"{self.name}({args})"

    # --- math ----------------------------------------------------------------
    def encode(self, B, x, ctx: EncodeContext):
        """Return ``(payload, sent)``: the parts to transmit and the dense,
        flat tensor this rank contributes (what the others will decode)."""
        raise NotImplementedError

    def decode_one(self, B, payload: Payload, numel: int, ctx=None):
        """Dense flat tensor from one rank's payload."""
        raise NotImplementedError

    def aggregate(self, B, payloads, numel, ctx=None):
        """Sum of the decoded payloads of all ranks (vectorise where possible),
        in rank order on every rank, so that every replica rounds alike."""
        return B.sum_in_order(self.decode_one(B, p, numel, ctx) for p in payloads)

    def decode_reduced(self, B, reduced, numel, ctx=None):
        """For allreduce transport: the dense tensor from the summed payload."""
        raise NotImplementedError

    def payload_nbytes(self, numel: int) -> Optional[int]:
        """Bytes a rank hands to collectives for a tensor of ``numel``
        elements, or None where it depends on the data."""
        return None
