"""Every rank's payload is gathered by side collectives launched inside
``compress`` (Top-K, quantizers with per-rank scales, sign votes); Horovod's
allreduce carries only a 1-element placeholder, whose value after the
allreduce is ``size * (the op's scaling)``, so ``finish`` applies exactly
the scaling Horovod would have.  Parts whose length differs between ranks
(``scheme.variable_parts``) also gather their lengths."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..naming import collective_name
from .base import (Pending, Transport, encode_context, encode_with_feedback, fused_codec, local_and_wire,
                   op_scale, pending_fields, placeholder, split_per_rank, to_gradient)

#: bytes of the placeholder Horovod allreduces
PLACEHOLDER_NBYTES = 4


@dataclass(eq=False, kw_only=True)
class AllgatherPending(Pending):
    #: payload parts the scheme keeps on this rank for decoding
    local_parts: dict = field(default_factory=dict)
    #: part -> handle of the allgather of every rank's part
    gathers: dict = field(default_factory=dict)
    #: variable-length part -> handle of the allgather of every rank's length
    length_gathers: dict = field(default_factory=dict)
    #: fixed-length part -> its length, the same on every rank
    fixed_lengths: dict = field(default_factory=dict)


class AllgatherTransport(Transport):
    name = "allgather"

    def start(self, call):
        adapter, B = call.adapter, call.backend
        codec = fused_codec(call)
        payload, deps = encode_with_feedback(adapter, call.scheme, call.x, encode_context(call), call.memory,
                                             call.key, call.numel, codec, call.out)
        local, wire = local_and_wire(payload)
        pending = AllgatherPending(transport=self, local_parts=local, codec=codec, **pending_fields(call))
        nbytes = PLACEHOLDER_NBYTES
        for part in sorted(wire):  # sorted: the same collective order on every rank
            sent = B.identity_with_deps(wire[part], deps)
            name = collective_name(call.coll_key, part)
            pending.gathers[part] = adapter.allgather(sent, name, call.process_set)
            nbytes = nbytes + adapter.nbytes(sent)
            if part in call.scheme.variable_parts:
                length = B.scalar(adapter.dynamic_length(sent), "int32", like=call.x)
                pending.length_gathers[part] = adapter.allgather(length, name + ".len", call.process_set)
                nbytes = nbytes + 4
            else:
                pending.fixed_lengths[part] = B.numel(sent)
        adapter.record_bytes(call.comp, call.key, call.scheme, call.numel, nbytes)
        return placeholder(call, deps), pending

    def finish(self, pending, reduced):
        adapter, scheme = pending.adapter, pending.scheme
        gathered = {part: adapter.wait(handle) for part, handle in pending.gathers.items()}
        lengths = dict(pending.fixed_lengths)
        lengths.update({part: adapter.wait(handle) for part, handle in pending.length_gathers.items()})
        per_rank = split_per_rank(adapter.B, gathered, lengths, pending.size)
        if pending.codec is not None:  # the fused decode applies the op's scaling in its pass
            scale = op_scale(adapter.B, reduced, pending.size) if scheme.apply_op_scale else None
            dense = pending.codec.aggregate(per_rank, pending.numel, pending.local_parts, scale, pending.out,
                                            adapter.workspace(pending.key))
            return to_gradient(pending, dense)
        dense = scheme.aggregate(adapter.B, per_rank, pending.numel, pending.local_parts)
        return to_gradient(pending, dense, reduced if scheme.apply_op_scale else None)
