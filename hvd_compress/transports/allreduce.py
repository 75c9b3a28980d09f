"""The payload is one part whose element-wise sum means something (casts,
shared-index Random-K, PowerSGD's uncompressed fallback): Horovod's own
allreduce carries it, with its op, scale factors and process set."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..cross_rank import collective_name
from .base import (Pending, Transport, encode_context, encode_with_feedback, fused_codec, local_and_wire,
                   pending_fields, to_gradient)


@dataclass(eq=False, kw_only=True)
class AllreducePending(Pending):
    #: payload parts the scheme keeps on this rank for decoding (Random-K's indices)
    local_parts: dict = field(default_factory=dict)


class AllreduceTransport(Transport):
    name = "allreduce"

    def start(self, call):
        adapter = call.adapter
        codec = fused_codec(call)
        payload, deps = encode_with_feedback(adapter, call.scheme, call.x, encode_context(call), call.memory,
                                             call.key, call.numel, codec, call.out)
        local, wire = local_and_wire(payload)
        out = adapter.B.identity_with_deps(wire["reduce"], deps)
        adapter.record_bytes(call.comp, call.key, call.scheme, call.numel, adapter.nbytes(out))
        return out, AllreducePending(transport=self, local_parts=local, codec=codec, **pending_fields(call))

    def finish(self, pending, reduced):
        if pending.codec is not None:
            dense = pending.codec.decode_reduced(reduced, pending.numel, pending.out,
                                                 pending.adapter.workspace(pending.key))
            return to_gradient(pending, dense)
        dense = pending.scheme.decode_reduced(pending.adapter.B, reduced, pending.numel, pending.local_parts)
        return to_gradient(pending, dense)

    def resolve_now(self, pending, out):
        """Horovod's allreduce has not run: reduce (sum) here, under the name
        Horovod's op would not use."""
        adapter = pending.adapter
        reduced = adapter.allreduce_sum(out, collective_name(pending.coll_key, "reduce"), pending.process_set)
        return adapter.B.flatten(self.finish(replace(pending, dtype="float32"), reduced))

