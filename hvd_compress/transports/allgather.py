"""Every rank's payload is gathered by side collectives launched inside
``compress`` (Top-K, quantizers with per-rank scales, sign votes); Horovod's
allreduce carries only a 1-element placeholder, whose value after the
allreduce is ``size * (the op's scaling)``, so ``finish`` applies exactly
the scaling Horovod would have.

Where the collectives pack bytes (torch) and the parts have the same lengths on
every rank, the parts travel as ONE allgather of their bytes (Top-K's indices
and values together); else one allgather per part, and parts whose length
differs between ranks (``scheme.variable_parts``) also gather their lengths.
What has the same length on every rank goes through the collectives'
``allgather_fixed``, which swaps a large one between 2 ranks by a
reduce-scatter where ``HVDC_PAIR_SWAP_MIN_BYTES`` is set
(docs/design/architecture.md, "Two ranks")."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..cross_rank import collective_name
from .base import (Pending, Transport, encode_with_feedback, local_and_wire, op_scale, pending_fields, placeholder,
                   split_per_rank, to_gradient)

#: bytes of the placeholder Horovod allreduces
PLACEHOLDER_NBYTES = 4
#: the largest payload packed into one allgather: packing copies the parts once, which at
#: a few MiB costs about what the saved collective's fixed cost does
PACKED_GATHER_MAX_BYTES = 4 << 20


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
    #: the one allgather of every part's bytes, where they are packed
    packed: Any = None


@dataclass(eq=False)
class PackedParts:
    """A payload's parts in one allgather of bytes: ``layout`` is
    ``[(part, dtype, elements)]`` in their order within every rank's segment
    of ``segment_nbytes`` bytes."""
    handle: Any
    layout: list
    segment_nbytes: int

    def per_rank(self, collectives, size):
        """``[{part: tensor}]``, one dict per rank's segment (views of the
        gathered bytes where a part's offset is aligned for its dtype)."""
        buf = collectives.wait(self.handle)
        out = []
        for r in range(size):
            offset, parts = r * self.segment_nbytes, {}
            for part, dtype, n in self.layout:
                parts[part] = collectives.bytes_view(buf, offset, dtype, n)
                offset += collectives.byte_length(dtype, n)
            out.append(parts)
        return out


def packs(collectives, scheme, wire) -> bool:
    """Whether ``wire``'s parts travel as one allgather of bytes: the collectives
    pack, there are several parts, every one of the same length on every
    rank, and at most :data:`PACKED_GATHER_MAX_BYTES` in all.  Decided from
    the scheme and the sizes alone, so every rank decides alike."""
    if not collectives.packs_gathers or len(wire) < 2 or set(wire) & set(scheme.variable_parts):
        return False
    return sum(collectives.nbytes(part) for part in wire.values()) <= PACKED_GATHER_MAX_BYTES


def launch_packed(call, wire, deps):
    """One allgather of the bytes of every part of ``wire``, packed into a
    buffer kept in the tensor's workspace; widest dtype first, then by name,
    so that the first rank's parts are aligned for a view."""
    coll, B, grad, group = call.roles.collectives, call.roles.B, call.grad, call.group
    order = sorted(wire, key=lambda part: (-coll.byte_length(B.dtype_name(wire[part]), 1), part))
    layout = [(part, B.dtype_name(wire[part]), B.numel(wire[part])) for part in order]
    buf = coll.pack_bytes([B.identity_with_deps(wire[part], deps) for part in order],
                          call.roles.store.workspace(grad.key), "packed_gather")
    handle = coll.allgather_fixed(buf, collective_name(grad.coll_key, "parts"), group.process_set, group.rank,
                                  group.size)
    return PackedParts(handle, layout, coll.nbytes(buf))


class AllgatherTransport(Transport):
    name = "allgather"

    def start(self, call):
        roles, grad = call.roles, call.grad
        codec = roles.codecs.fused_codec(call.scheme, call.memory, call.x)
        payload, deps = encode_with_feedback(call, codec)
        local, wire = local_and_wire(payload)
        pending = AllgatherPending(transport=self, local_parts=local, codec=codec, **pending_fields(call))
        if packs(roles.collectives, call.scheme, wire):
            pending.packed = launch_packed(call, wire, deps)
            nbytes = PLACEHOLDER_NBYTES + pending.packed.segment_nbytes
        else:
            nbytes = PLACEHOLDER_NBYTES + self._gather_parts(call, pending, wire, deps)
        roles.store.record_bytes(call.comp, grad.key, call.scheme, grad.numel, nbytes)
        return placeholder(call, deps), pending

    @staticmethod
    def _gather_parts(call, pending, wire, deps):
        """One allgather per part (and per variable part one of its length); returns their bytes."""
        coll, B, group = call.roles.collectives, call.roles.B, call.group
        nbytes = 0
        for part in sorted(wire):  # sorted: the same collective order on every rank
            sent = B.identity_with_deps(wire[part], deps)
            name = collective_name(call.grad.coll_key, part)
            variable = part in call.scheme.variable_parts
            pending.gathers[part] = (coll.allgather(sent, name, group.process_set) if variable else
                                     coll.allgather_fixed(sent, name, group.process_set, group.rank, group.size))
            nbytes = nbytes + coll.nbytes(sent)
            if variable:
                length = B.scalar(coll.dynamic_length(sent), "int32", like=call.x)
                pending.length_gathers[part] = coll.allgather(length, name + ".len", group.process_set)
                nbytes = nbytes + 4
            else:
                pending.fixed_lengths[part] = B.numel(sent)
        return nbytes

    def finish(self, pending, reduced):
        coll, B, grad, scheme = pending.roles.collectives, pending.roles.B, pending.grad, pending.scheme
        size = pending.group.size
        if pending.packed is not None:
            per_rank = pending.packed.per_rank(coll, size)
        else:
            gathered = {part: coll.wait(handle) for part, handle in pending.gathers.items()}
            lengths = dict(pending.fixed_lengths)
            lengths.update({part: coll.wait(handle) for part, handle in pending.length_gathers.items()})
            per_rank = split_per_rank(B, gathered, lengths, size)
        if pending.codec is not None:  # the fused decode applies the op's scaling in its pass
            scale = op_scale(B, reduced, size) if scheme.apply_op_scale else None
            dense = pending.codec.aggregate(per_rank, grad.numel, pending.local_parts, scale, grad.out,
                                            pending.roles.store.workspace(grad.key))
            return to_gradient(pending, dense)
        dense = scheme.aggregate(B, per_rank, grad.numel, pending.local_parts)
        return to_gradient(pending, dense, reduced if scheme.apply_op_scale else None)
