"""The payload is one part whose element-wise sum means something (casts,
shared-index Random-K, PowerSGD's uncompressed fallback): Horovod's own
allreduce carries it, with its op, scale factors and process set."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..cross_rank import collective_name
from .base import Pending, Transport, as_float32, encode_with_feedback, local_and_wire, pending_fields, to_gradient


@dataclass(eq=False, kw_only=True)
class AllreducePending(Pending):
    #: payload parts the scheme keeps on this rank for decoding (Random-K's indices)
    local_parts: dict = field(default_factory=dict)


class AllreduceTransport(Transport):
    name = "allreduce"

    def start(self, call):
        roles, grad = call.roles, call.grad
        codec = roles.codecs.fused_codec(call.scheme, call.memory, call.x)
        payload, deps = encode_with_feedback(call, codec)
        local, wire = local_and_wire(payload)
        out = roles.B.identity_with_deps(wire["reduce"], deps)
        roles.store.record_bytes(call.comp, grad.key, call.scheme, grad.numel, roles.collectives.nbytes(out))
        return out, AllreducePending(transport=self, local_parts=local, codec=codec, **pending_fields(call))

    def finish(self, pending, reduced):
        roles, grad = pending.roles, pending.grad
        if pending.codec is not None:
            dense = pending.codec.decode_reduced(reduced, grad.numel, grad.out, roles.store.workspace(grad.key))
            return to_gradient(pending, dense)
        dense = pending.scheme.decode_reduced(roles.B, reduced, grad.numel, pending.local_parts)
        return to_gradient(pending, dense)

    def resolve_now(self, pending, out):
        """Horovod's allreduce has not run: reduce (sum) here, under the name
        Horovod's op would not use."""
        roles, grad = pending.roles, pending.grad
        reduced = roles.collectives.allreduce_sum(out, collective_name(grad.coll_key, "reduce"),
                                                  pending.group.process_set)
        return roles.B.flatten(self.finish(as_float32(pending), reduced))
