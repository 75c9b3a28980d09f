"""Two-phase compressed allreduce.

Allgathering everybody's payload makes each rank receive N-1 payloads.  Here
each rank owns one of N chunks: phase 1 sends every chunk's payload to its
owner (alltoall), the owner decodes and sums its chunk, re-encodes the sum
with its own (second-stage) error feedback, and phase 2 allgathers the N
chunk payloads.  Each rank sends and receives about 2 payloads whatever N is
(as in 1-bit Adam, Tang et al. 2021; ByteGrad; and CGX, Markov et al. 2022).
Conservation holds end to end: sum(applied) + sum(stage-1 residuals) +
sum(stage-2 residuals) == sum(gradients).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ..backend import ceil_div
from ..cross_rank import collective_name, stable_hash
from ..feedback.memory import OWNED_CHUNK_RESIDUAL, RESIDUAL, ResidualMemory, compensate, update
from ..schemes.base import EncodeContext
from .base import TwoRoundPending, Transport, op_scale, pending_fields, placeholder, split_per_rank, to_gradient

#: the owner's second-stage error feedback keeps its residual in its own slot
OWNER_SLOTS = {RESIDUAL: OWNED_CHUNK_RESIDUAL}


def choose_two_phase(mode, n_ranks, numel):
    """``auto``: two-phase once there are 3+ ranks (allgather makes each rank
    receive N-1 payloads, two-phase about 2) and the tensor is large enough
    (64Ki elements) for the extra round's latency not to dominate."""
    if mode == "two_phase":
        return n_ranks > 1
    if mode == "auto":
        return n_ranks >= 3 and numel >= 65536
    return False


def _chunk_codec(codecs, scheme, memory, x, chunk):
    """The fused codec (:mod:`hvd_compress.kernels`) for ``scheme`` on chunks
    of ``chunk`` elements of ``x``, or None where the eager scheme runs: no
    kernels for this framework or scheme, or a memory other than plain
    error feedback (momentum and DGC's memories keep more than a residual)."""
    if not codecs.on_chunks or chunk == 0 or (memory is not None and type(memory) is not ResidualMemory):
        return None
    return codecs.fused_codec(scheme, memory, x[:chunk])


def _owned_chunk_codec(codecs, stage2, memory, x, chunk):
    """:func:`_chunk_codec` for the owner's re-encode of its chunk's sum, except
    for a sparsifier with quantized values (``TopK(values=Int8())``): its owner
    selects among sums of quantized values, where magnitudes tie at the k-th
    place, and the eager path breaks ties the way the framework's top-k does
    (docs/design/two_phase.md)."""
    if getattr(stage2, "values", None) is not None:
        return None
    return _chunk_codec(codecs, stage2, memory, x, chunk)


def _empty_like(like, n):
    import torch  # the fused codecs run on chunks only under torch (CodecProvider.on_chunks)
    return torch.empty(n, dtype=torch.float32, device=like.device)


@dataclass(eq=False, kw_only=True)
class TwoPhasePending(TwoRoundPending):
    chunk: int  # elements per owned chunk (the last one is zero-padded)
    step: Any  # the communication count, for the owner's private draws
    rank: int  # this rank: the owner of chunk ``rank``
    owner_seed: int  # seeds the owner's private draws when it re-encodes its chunk
    owner_feedback: bool  # whether the owner keeps a second-stage residual
    #: part -> handle of the alltoall that brings every rank's payload of the owned chunk
    exchanges: dict = field(default_factory=dict)
    #: part -> length of one chunk's part in phase 1
    chunk_lengths: dict = field(default_factory=dict)
    #: part -> handle of the phase-2 allgather of the owners' payloads (set by the second round)
    owned_gathers: dict = field(default_factory=dict)
    #: part -> length of one owner's part in phase 2
    owned_lengths: Optional[dict] = None
    #: the fused codec (:mod:`hvd_compress.kernels`) of the chunks' encode and the owner's
    #: combine (None: the eager scheme), and that of the owner's re-encode and the final decode
    chunk_codec: Any = None
    owned_codec: Any = None
    #: batched rounds (where second rounds are deferred): the chunk payloads until the
    #: batch's alltoall is launched, the alltoall's batch, and the allgather's
    chunk_payloads: Optional[list] = None
    first_round: Any = None
    second_round: Any = None


@dataclass(eq=False)
class ByteBatch:
    """Several tensors' payloads in one collective of bytes: ``layout[i]`` is
    member i's ``[(part, dtype, elements)]`` within every rank's segment of
    ``segment_nbytes`` bytes.  The result is waited for once, by whichever
    member needs it first."""
    handle: Any
    layout: list
    segment_nbytes: int
    size: int
    result: Any = None

    def received(self, collectives):
        if self.result is None:
            self.result = collectives.wait(self.handle)
            self.handle = None
        return self.result

    def member_parts(self, collectives, index):
        """``[{part: tensor}]`` of member ``index``, one dict per rank's segment."""
        buf = self.received(collectives)
        start = sum(collectives.byte_length(dtype, n) for entry in self.layout[:index] for _, dtype, n in entry)
        per_rank = []
        for r in range(self.size):
            offset, parts = r * self.segment_nbytes + start, {}
            for part, dtype, n in self.layout[index]:
                parts[part] = collectives.from_bytes(buf, offset, dtype, n)
                offset += collectives.byte_length(dtype, n)
            per_rank.append(parts)
        return per_rank


def launch_byte_batch(roles, members_parts, name, process_set, size):
    """One collective for several tensors: ``members_parts[i][r]`` is member i's
    payload dict for destination rank r (alltoall, ``size`` of them) or a
    single dict (allgather).  Returns the :class:`ByteBatch`."""
    coll, B = roles.collectives, roles.B
    alltoall = isinstance(members_parts[0], list)
    layout = []
    for parts in members_parts:
        first = parts[0] if alltoall else parts
        layout.append([(part, B.dtype_name(first[part]), B.numel(first[part])) for part in sorted(first)])
    segment = sum(coll.byte_length(dtype, n) for entry in layout for _, dtype, n in entry)
    if alltoall:
        pieces = [parts[r][part] for r in range(size) for parts in members_parts for part in sorted(parts[r])]
        handle = coll.alltoall(coll.to_bytes(pieces), name, process_set)
    else:
        pieces = [parts[part] for parts in members_parts for part in sorted(parts)]
        handle = coll.allgather(coll.to_bytes(pieces), name, process_set)
    return ByteBatch(handle, layout, segment, size)


def _by_process_set(pendings):
    """Lists of pendings sharing a process set, each in the order given."""
    groups = {}
    for p in pendings:
        groups.setdefault(id(p.group.process_set), []).append(p)
    return list(groups.values())


def batch_name(pendings, what):
    """The same on every rank: one tensor keeps its own key in the name."""
    keys = [p.grad.coll_key for p in pendings]
    if len(keys) == 1:
        return collective_name(keys[0], what)
    return collective_name(f"two_phase.batch{len(keys)}-{stable_hash(*keys):016x}", what)


class TwoPhaseTransport(Transport):
    name = "two_phase"

    def start(self, call):
        roles, grad, scheme, memory = call.roles, call.grad, call.scheme, call.memory
        B, store = roles.B, roles.store
        chunk = ceil_div(grad.numel, call.group.size)
        stage2 = scheme.stage2()
        codec = _chunk_codec(roles.codecs, scheme, memory, call.x, chunk)
        if codec is not None:
            payloads, deps = self._encode_chunks_fused(call, codec, chunk), []
        else:
            acc, state = (call.x, None) if memory is None else compensate(store, memory, grad.key, grad.numel, call.x)
            payloads, sent = self._encode_chunks(call, acc, chunk)
            deps = [] if memory is None else update(store, memory, grad.key, acc, sent, state)
        pending = TwoPhasePending(
            transport=self, chunk=chunk, step=call.step, rank=call.group.rank, owner_feedback=memory is not None,
            owner_seed=stable_hash(call.comp.seed, grad.key, call.group.rank, "phase2"), chunk_codec=codec,
            owned_codec=None if codec is None else _owned_chunk_codec(roles.codecs, stage2, memory, call.x, chunk),
            **pending_fields(call))
        nbytes = self._exchange_chunks(call, pending, payloads, deps, stage2)
        roles.rounds.defer(pending)
        store.record_bytes(call.comp, grad.key, scheme, grad.numel, nbytes)
        return placeholder(call, deps), pending

    @staticmethod
    def _exchange_chunks(call, pending, payloads, deps, stage2):
        """Phase 1: the chunk payloads to their owners, one alltoall per part
        (or, where second rounds are deferred, kept for the round's one
        alltoall: :meth:`launch_first_rounds`); returns the step's bytes.
        Phase 2 sends the owned chunk's payload: as large as one of phase 1's
        chunks, unless the owner re-encodes with another scheme."""
        coll, B, same_scheme = call.roles.collectives, call.roles.B, stage2 is call.scheme
        nbytes = 4 if same_scheme else 4 + stage2.payload_nbytes(pending.chunk)
        if call.roles.rounds.defers:
            pending.chunk_payloads = payloads
            for part in sorted(payloads[0]):
                pending.chunk_lengths[part] = B.numel(payloads[0][part])
                nbytes += sum(coll.nbytes(p[part]) for p in payloads)
                nbytes += coll.nbytes(payloads[0][part]) if same_scheme else 0
            return nbytes
        for part in sorted(payloads[0]):
            send = B.identity_with_deps(B.concat([p[part] for p in payloads]), deps)
            pending.chunk_lengths[part] = B.numel(payloads[0][part])
            name = collective_name(call.grad.coll_key, "a2a." + part)
            pending.exchanges[part] = coll.alltoall(send, name, call.group.process_set)
            nbytes += coll.nbytes(send) + (coll.nbytes(payloads[0][part]) if same_scheme else 0)
        return nbytes

    @staticmethod
    def _encode_chunks(call, acc, chunk):
        """One encode per destination chunk (a loop over ranks, not elements),
        each with its own private draws; returns (payloads, dense sent)."""
        B, n_ranks, numel = call.roles.B, call.group.size, call.grad.numel
        pad = chunk * n_ranks - numel
        padded = B.concat([acc, B.zeros(pad, "float32", like=call.x)]) if pad else acc
        private = stable_hash(call.comp.seed, call.grad.key, call.group.rank, "two_phase")
        payloads, sents = [], []
        for j in range(n_ranks):
            context = TwoPhaseTransport._chunk_context(call, chunk, j, private)
            payload, sent = call.scheme.encode(B, padded[j * chunk:(j + 1) * chunk], context)
            payloads.append(payload)
            sents.append(sent)
        if call.memory is None:
            return payloads, None
        return payloads, (B.concat(sents)[:numel] if pad else B.concat(sents))

    @staticmethod
    def _chunk_context(call, chunk, j, private):
        B = call.roles.B
        return EncodeContext(
            key=call.grad.key, step=call.step, rank=call.group.rank, size=call.group.size, shape=(chunk,),
            uniform=lambda n: B.uniform(n, B.seed_for(private + j, call.step), like=call.x),
            shared_seed=call.context.shared_seed, state={})

    def _encode_chunks_fused(self, call, codec, chunk):
        """:meth:`_encode_chunks` by a fused codec, chunk by chunk on views of
        the gradient and of the residual (updated in place); the zero-padded
        tail goes through a padded copy.  Each chunk encodes into its own
        workspace, since every payload is still needed when the next is made."""
        B, store, grad = call.roles.B, call.roles.store, call.grad
        numel = grad.numel
        ws = store.workspace(grad.key)
        residual = store.get_memory(RESIDUAL, grad.key, numel, call.x) if call.memory is not None else None
        private = stable_hash(call.comp.seed, grad.key, call.group.rank, "two_phase")
        payloads = []
        for j in range(call.group.size):
            lo, hi = min(j * chunk, numel), min((j + 1) * chunk, numel)
            cws = ws.setdefault(f"two_phase.chunk{j}", {})
            context = self._chunk_context(call, chunk, j, private)
            if hi - lo == chunk:
                payloads.append(codec.encode(call.x[lo:hi], None if residual is None else residual[lo:hi], cws,
                                             context))
                continue
            pad = B.zeros(chunk - (hi - lo), "float32", like=call.x)
            x = B.concat([call.x[lo:hi], pad])
            r = None if residual is None else B.concat([residual[lo:hi], pad])
            payloads.append(codec.encode(x, r, cws, context))
            if r is not None:
                residual[lo:hi] = r[:hi - lo]
        return payloads

    def launch_first_rounds(self, pendings):
        """Batched rounds: one alltoall of bytes carries every given tensor's
        chunk payloads (per process set, in the order given).  Horovod runs
        alltoalls one at a time and never fuses them; one per tensor and part
        made the first round's cost grow with the number of tensors."""
        for group in _by_process_set(p for p in pendings if p.chunk_payloads is not None):
            ranks = group[0].group
            batch = launch_byte_batch(group[0].roles, [p.chunk_payloads for p in group], batch_name(group, "a2a"),
                                      ranks.process_set, ranks.size)
            for i, p in enumerate(group):
                p.first_round, p.chunk_payloads = (batch, i), None

    def launch_second_rounds(self, pendings):
        batched = [p for p in pendings if p.first_round is not None or p.chunk_payloads is not None]
        for pending in pendings:
            if not any(pending is b for b in batched):
                self.launch_second_round(pending)
        if not batched:
            return
        self.launch_first_rounds(batched)  # those whose round was not complete before
        for group in _by_process_set(batched):
            owned = []
            for pending in group:
                batch, index = pending.first_round
                payload, deps = self._owner_round(pending, batch.member_parts(pending.roles.collectives, index))
                owned.append(payload)  # eager frameworks: deps are empty
                pending.first_round = None
            ranks = group[0].group
            second = launch_byte_batch(group[0].roles, owned, batch_name(group, "ag"), ranks.process_set, ranks.size)
            for i, pending in enumerate(group):
                pending.second_round = (second, i)
                pending.second_round_launched = True

    def launch_second_round(self, pending):
        """The owner sums its chunk over ranks, re-encodes it (with its own
        error feedback) and allgathers the result."""
        coll, B, n_ranks = pending.roles.collectives, pending.roles.B, pending.group.size
        received = {part: coll.wait(handle) for part, handle in pending.exchanges.items()}
        pending.exchanges = {}  # the received buffers are not needed past this point
        payload, deps = self._owner_round(pending, split_per_rank(B, received, pending.chunk_lengths, n_ranks))
        pending.owned_lengths = {part: B.numel(t) for part, t in payload.items()}
        for part in sorted(payload):
            sent = B.identity_with_deps(payload[part], deps)
            name = collective_name(pending.grad.coll_key, "ag." + part)
            pending.owned_gathers[part] = coll.allgather(sent, name, pending.group.process_set)
        pending.second_round_launched = True

    def _owner_round(self, pending, per_rank):
        """Combine every rank's payload of the owned chunk and re-encode the
        sum (with the owner's error feedback): (payload, dependencies)."""
        B, store, chunk, key = pending.roles.B, pending.roles.store, pending.chunk, pending.grad.key
        if pending.chunk_codec is not None:
            ws = store.workspace(key).setdefault("two_phase.combine", {})
            chunk_sum = pending.chunk_codec.aggregate(per_rank, chunk, {}, None, None, ws)
        else:
            chunk_sum = pending.scheme.aggregate(B, per_rank, chunk)
        seed, step = pending.owner_seed, pending.step
        context = EncodeContext(key=key, step=step, rank=pending.rank, size=pending.group.size, shape=(chunk,),
                                uniform=lambda n: B.uniform(n, B.seed_for(seed, step), like=chunk_sum),
                                shared_seed=0, state={})
        stage2 = pending.scheme.stage2()
        if pending.owned_codec is not None:
            ws = store.workspace(key).setdefault("two_phase.owned", {})
            owned_residual = (store.get_memory(OWNED_CHUNK_RESIDUAL, key, chunk, chunk_sum)
                              if pending.owner_feedback else None)
            return pending.owned_codec.encode(chunk_sum, owned_residual, ws, context), []
        if pending.owner_feedback:
            # plain error feedback on the owned chunk's sum, with the owner's own residual
            memory = ResidualMemory()
            acc, state = compensate(store, memory, key, chunk, chunk_sum, OWNER_SLOTS)
            payload, sent = stage2.encode(B, acc, context)
            return payload, update(store, memory, key, acc, sent, state, OWNER_SLOTS)
        return stage2.encode(B, chunk_sum, context)[0], []

    def finish(self, pending, reduced):
        roles, grad = pending.roles, pending.grad
        if not pending.second_round_launched:
            roles.rounds.launch(pending)
        B, stage2 = roles.B, pending.scheme.stage2()
        if pending.second_round is not None:
            batch, index = pending.second_round
            per_chunk = batch.member_parts(roles.collectives, index)
            pending.second_round = None
        else:
            gathered = {part: roles.collectives.wait(handle) for part, handle in pending.owned_gathers.items()}
            per_chunk = split_per_rank(B, gathered, pending.owned_lengths, pending.group.size)
        if pending.owned_codec is not None:  # each owner's payload decoded into its chunk, scaled in the pass
            return self._decode_owned_chunks(pending, reduced, per_chunk)
        dense = B.concat([stage2.decode_one(B, p, pending.chunk) for p in per_chunk])[:grad.numel]
        return to_gradient(pending, dense, reduced if pending.scheme.apply_op_scale else None)

    @staticmethod
    def _decode_owned_chunks(pending, reduced, per_chunk):
        """The fused decode of each owner's payload into its chunk, with the op's scaling."""
        B, grad = pending.roles.B, pending.grad
        scale = op_scale(B, reduced, pending.group.size) if pending.scheme.apply_op_scale else None
        ws = pending.roles.store.workspace(grad.key).setdefault("two_phase.decode", {})
        chunk, numel = pending.chunk, grad.numel
        # into the gradient buffer where Horovod replaces the gradient by the result (every
        # element is written), else a fresh tensor; the zero-padded tail through a copy
        dense = grad.out if grad.out is not None else _empty_like(reduced, numel)
        for j, p in enumerate(per_chunk):
            lo, hi = min(j * chunk, numel), min((j + 1) * chunk, numel)
            if hi - lo == chunk:
                pending.owned_codec.aggregate([p], chunk, {}, scale, dense[lo:hi], ws)
            elif hi > lo:
                dense[lo:hi] = pending.owned_codec.aggregate([p], chunk, {}, scale, None, ws)[:hi - lo]
        return to_gradient(pending, dense)
