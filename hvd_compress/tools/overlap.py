"""A step with the gradient exchange overlapping the backward pass, as Horovod's hooks allow.

The cost model (:mod:`hvd_compress.costmodel.model`) gives two bounds of a step: nothing overlaps
(``compute + communication``) and everything hides (``max(compute, communication)``).
Neither is what Horovod does.  :func:`simulate` plays one step out, on one device:

* **backward** runs after the forward pass (``forward_share`` of the compute), one tensor at
  a time in reverse order, each taking a share of the backward time proportional to its
  ``weights`` (its FLOPs where known, else its elements);
* **encode** (error feedback included) runs in the tensor's hook, on the same device, so it
  delays the rest of the backward pass (``compress`` is called inside the hook);
* **the link** carries one collective at a time.  Horovod's background thread wakes every
  ``cycle_s`` and sends everything enqueued by then as one fused collective per transport
  (up to ``fusion_bytes``): the fused collective pays its latency steps once and its bytes at
  the link's bandwidth (:mod:`hvd_compress.costmodel.model`'s latency steps and wire bytes);
* **a second round** (PowerSGD's Q, two-phase's allgather) is issued when the optimizer
  synchronizes, after the backward pass, once the first round has come back, one cycle later;
* **decode** runs on the device after the backward pass, as each tensor's last round returns.

The step ends when the last decode (or, for Horovod's own allreduce, the last collective)
finishes.  Dense training thus hides its allreduce behind the backward pass where the link
keeps up; a compressed one pays its codec on the critical path and its second rounds after
the backward pass.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence

from ..costmodel.model import HOROVOD_CYCLE_S, HOROVOD_FUSION_BYTES, latency_steps, wire_bytes

#: the forward pass's share of a step's compute (backward about twice the forward)
FORWARD_SHARE = 1.0 / 3.0


@dataclass(frozen=True)
class Exchange:
    """One tensor's exchange: its transport, the bytes each rank receives, and the device
    seconds of its encode (in the hook) and decode (after the backward pass)."""
    transport: str
    wire_bytes: float
    encode_s: float = 0.0
    decode_s: float = 0.0
    extra_allgathers: int = 0


@dataclass(frozen=True)
class StepTimeline:
    step_s: float
    backward_end_s: float
    link_busy_s: float
    exposed_comm_s: float


def second_round_share(transport: str) -> float:
    """The share of a two-round transport's bytes that travels in the second round (PowerSGD's
    Q, two-phase's allgather): half; 0 for one-round transports."""
    return 0.5 if transport in ("powersgd", "two_phase") else 0.0


def second_round_steps(transport: str, workers: int) -> int:
    """Latency steps of the second round: PowerSGD's Q allreduce ``2(N-1)``, two-phase's allgather ``N-1``."""
    return {"powersgd": 2 * (workers - 1), "two_phase": workers - 1}.get(transport, 0)


def _send(items, start_floor, workers, latency_s, bytes_per_s, cycle_s, fusion_bytes, link_free, second=False):
    """Schedule ``items`` ([(ready_s, index, Exchange)]) on the link: fused per cycle and
    transport, one collective at a time.  Returns ({index: done_s}, link_free, busy_s)."""
    done, busy = {}, 0.0
    pending = sorted(items, key=lambda x: x[0])
    while pending:
        first = max(pending[0][0], link_free, start_floor)
        tick = math.ceil(first / cycle_s - 1e-9) * cycle_s if cycle_s > 0 else first
        ready = [x for x in pending if x[0] <= tick]
        for transport in dict.fromkeys(x[2].transport for x in ready):
            group, size = [], 0.0
            for x in (x for x in ready if x[2].transport == transport):
                share = second_round_share(transport)
                b = x[2].wire_bytes * (share if second else 1.0 - share)
                if group and fusion_bytes and size + b > fusion_bytes:
                    break
                group.append(x)
                size += b
            ex = group[0][2]
            steps = (second_round_steps(transport, workers) if second
                     else latency_steps(transport, workers, ex.extra_allgathers)
                     - second_round_steps(transport, workers))
            dur = steps * latency_s + size / bytes_per_s
            begin = max(tick, link_free)
            link_free = begin + dur
            busy += dur
            for x in group:
                done[x[1]] = link_free
                pending.remove(x)
            ready = [x for x in ready if x in pending]
    return done, link_free, busy


def simulate(exchanges: Sequence[Exchange], compute_s: float, workers: int, bytes_per_s: float, latency_s: float,
             weights: Optional[Sequence[float]] = None, cycle_s: float = HOROVOD_CYCLE_S,
             fusion_bytes: float = HOROVOD_FUSION_BYTES, forward_share: float = FORWARD_SHARE) -> StepTimeline:
    """One step's timeline (see the module docstring).  ``exchanges`` in the model's order
    (the backward pass visits them last to first); ``weights``: each tensor's share of the
    backward pass (default: its wire bytes' share, i.e. its size)."""
    if compute_s < 0 or workers < 1 or bytes_per_s <= 0:
        raise ValueError(f"compute_s >= 0, workers >= 1 and bytes_per_s > 0 needed; got {compute_s}, {workers}, "
                         f"{bytes_per_s}")
    n = len(exchanges)
    weights = list(weights) if weights is not None else [max(e.wire_bytes, 1.0) for e in exchanges]
    if len(weights) != n:
        raise ValueError(f"weights must have one entry per exchange ({n}); got {len(weights)}")
    total_w = sum(weights) or 1.0
    t = forward_share * compute_s
    backward = (1.0 - forward_share) * compute_s
    first_round = []
    for i in reversed(range(n)):
        t += backward * weights[i] / total_w + exchanges[i].encode_s
        first_round.append((t, i, exchanges[i]))
    backward_end = t
    done, link_free, busy = _send(first_round, 0.0, workers, latency_s, bytes_per_s, cycle_s, fusion_bytes, 0.0)
    twice = [(done[i] + cycle_s, i, e) for i, e in enumerate(exchanges) if second_round_share(e.transport)]
    if twice:
        done2, link_free, busy2 = _send(twice, backward_end, workers, latency_s, bytes_per_s, cycle_s, fusion_bytes,
                                        link_free, second=True)
        done.update(done2)
        busy += busy2
    device = backward_end
    for i in sorted(range(n), key=lambda i: done.get(i, 0.0)):
        if exchanges[i].decode_s:
            device = max(device, done.get(i, 0.0)) + exchanges[i].decode_s
    end = max(device, max(done.values(), default=backward_end), backward_end)
    return StepTimeline(end, backward_end, busy, end - backward_end)


def exchanges_for(choices: Sequence[str], numels: Sequence[int], workers: int, shapes=None,
                  codec_of=None) -> List[Exchange]:
    """The :class:`Exchange` of each tensor under the spec chosen for it (``"none"``,
    ``"TopK(0.01)/two_phase"``, ...), from the cost model's payloads and transports and
    ``codec_of(spec, numel) -> (encode_s, decode_s)`` (as ``advise`` takes it)."""
    from ..costmodel.model import codec_seconds
    from .advise import predict
    out = []
    for k, (spec, n) in enumerate(zip(choices, numels)):
        shape = shapes[k] if shapes is not None else None
        codec = codec_of(spec.split("/")[0], n) if codec_of is not None and spec != "none" else None
        p = predict(spec, n, workers, 1e9, 0.0, None, None, codec=codec or (0.0, 0.0), shape=shape)
        enc, dec = codec or (0.0, 0.0)
        total = codec_seconds(p.transport, enc, dec, workers)
        hook = enc * (1.0 + 1.0 / workers) if p.transport == "two_phase" else enc
        extra = p.cost.phases.count("allgather:lengths") if p.cost is not None else 0
        out.append(Exchange(p.transport, wire_bytes(p.transport, p.payload_bytes, workers), hook, total - hook,
                            extra))
    return out
