"""Transport shared by the framework adapters.

An adapter owns one framework's per-parameter state (residuals, step
counters, scheme state) and its collectives.  The flow of a call is the same
for both frameworks and lives here; subclasses supply: finding the caller's
parameter name and process set, state storage, and the collectives.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from .backend import ceil_div
from .compressor import collective_name, encode_with_memory, finite_or_zero, stable_hash
from .memory import ResidualMemory


def choose_two_phase(mode, n_ranks, numel):
    """``auto``: two-phase once there are 3+ ranks (allgather makes each rank
    receive N-1 payloads, two-phase about 2) and the tensor is large enough
    (64Ki elements) for the extra round's latency not to dominate."""
    if mode == "two_phase":
        return n_ranks > 1
    if mode == "auto":
        return n_ranks >= 3 and numel >= 65536
    return False
from .schemes.base import EncodeContext


@dataclass
class CallerInfo:
    key: Any  # parameter name, or None when it cannot be found
    process_set: Any
    rank: int
    size: int
    params: Any = None  # [(name, shape)] of every tensor the optimizer reduces, when known


@dataclass
class Ctx:
    adapter: Any
    key: str
    scheme: Any
    shape: tuple
    dtype: str
    numel: int
    size: int
    transport: str = "allgather"
    process_set: Any = None
    local: dict = field(default_factory=dict)
    handles: dict = field(default_factory=dict)
    part_lengths: dict = field(default_factory=dict)
    coll_key: str = ""


def _starting_q(B, seed, shape, like):
    """PowerSGD's first Q, from a seed shared by all ranks; also the value a
    non-finite Q entry falls back to."""
    return B.reshape(B.uniform(shape[0] * shape[1], seed, like=like) - 0.5, shape)


class AdapterBase:
    B = None  # the framework's backend
    #: start second rounds of all pending tensors together (eager frameworks)
    defer_second_rounds = False

    def __init__(self):
        self.reset()

    # --- framework specifics -------------------------------------------------
    def caller_info(self, tensor) -> CallerInfo:
        raise NotImplementedError

    def pin_shape(self, tensor, info):
        """The tensor, with its static shape completed where the framework
        lost it and the caller knows it (eager frameworks: always known)."""
        return tensor

    def next_step(self, key):
        raise NotImplementedError

    def get_memory(self, name, key, numel, like):
        """Error-feedback state ``name`` ("residual", "momentum") of a tensor."""
        raise NotImplementedError

    def set_memory(self, name, key, value):
        """Store new state; return a dependency the outputs must wait on."""
        raise NotImplementedError

    def allgather(self, tensor, name, process_set):
        raise NotImplementedError

    def allreduce_sum(self, tensor, name, process_set):
        raise NotImplementedError

    def alltoall(self, tensor, name, process_set):
        """Equal splits along the first dimension."""
        raise NotImplementedError

    def get_state(self, key, name, init):
        """Scheme state that persists across steps (PowerSGD's Q)."""
        raise NotImplementedError

    def set_state(self, key, name, value):
        raise NotImplementedError

    def launch_second_rounds(self, ctx):
        """Start the second collective of two-round schemes.  Torch starts
        those of *every* tensor compressed this round, in sorted key order,
        before waiting on any: decompress is called in hook order, which
        differs between ranks, and waiting on one tensor's second round before
        every rank has launched it would deadlock."""
        self._second_round(ctx)

    def wait(self, handle):
        raise NotImplementedError

    def nbytes(self, tensor):
        raise NotImplementedError

    def record_bytes(self, comp, key, scheme, numel, nbytes):
        comp.stats.record(key, scheme.name, 4 * numel, nbytes)

    def seed_for(self, base, step):
        raise NotImplementedError

    def check_fingerprint(self, comp, info):
        """Once per compressor: every rank compares its configuration with the others'."""
        raise NotImplementedError

    def reset(self):
        self.scheme_state = {}
        self.pending_rounds = []

    # --- the shared flow ----------------------------------------------------------
    def compress(self, comp, tensor):
        B = self.B
        info = self.caller_info(tensor)
        tensor = self.pin_shape(tensor, info)
        shape, numel, dtype = B.shape(tensor), B.numel(tensor), B.dtype_name(tensor)
        key = info.key if info.key is not None else self.fallback_key(tensor, shape)
        check = self.check_fingerprint(comp, info)
        phases = comp.plan_for(key, numel, shape)
        x = B.cast(B.flatten(tensor), "float32")
        step = self.next_step(key)
        call = dict(comp=comp, key=key, x=x, step=step, info=info, shape=shape, dtype=dtype, numel=numel)
        if len(phases) == 1:
            out, ctx = self._compress_with(phases[0], coll_key=key, **call)
        else:
            out, ctx = self._compress_scheduled(phases, **call)
        return (B.identity_with_deps(out, [check]) if check is not None else out), ctx

    def _compress_scheduled(self, phases, step, **call):
        """Eager frameworks: the phase follows the Python step counter
        (communications done so far, the same on every rank)."""
        done = int(step) - 1
        i = max(j for j, phase in enumerate(phases) if phase.start <= done)
        return self._compress_with(phases[i], coll_key=f"{call['key']}@{i}", step=step, **call)

    def _compress_with(self, phase, comp, key, coll_key, x, step, info, shape, dtype, numel):
        B = self.B
        scheme, memory = phase.scheme, phase.memory
        transport = scheme.transport_for(shape) if hasattr(scheme, "transport_for") else scheme.transport
        if transport == "allgather" and choose_two_phase(phase.transport, info.size, numel):
            transport = "two_phase"
        private = stable_hash(comp.seed, key, info.rank)
        shared = stable_hash(comp.seed, key)
        ectx = EncodeContext(
            key=key, step=step, rank=info.rank, size=info.size,
            uniform=lambda n: B.uniform(n, self.seed_for(private, step), like=x),
            shared_seed=self.seed_for(shared, step), shape=shape,
            state=self.scheme_state.setdefault(key, {}))
        if transport == "two_phase":
            return self._compress_two_phase(comp, scheme, memory, key, coll_key, x, step, info, shape, dtype,
                                            numel, ectx)
        if transport == "powersgd":
            return self._compress_powersgd(comp, scheme, memory, key, coll_key, x, info, shape, dtype, numel)
        if memory is None:
            payload, _ = scheme.encode(B, x, replace(ectx, need_sent=False))
            deps = []
        else:
            state = {n: self.get_memory(n, key, numel, x) for n in memory.names}
            payload, new_state = encode_with_memory(B, scheme, x, state, ectx, memory)
            deps = [self.set_memory(n, key, new_state[n]) for n in memory.names]
        ctx = Ctx(self, key, scheme, shape, dtype, numel, info.size, transport, info.process_set,
                  local={k: v for k, v in payload.items() if k.startswith("_")}, coll_key=coll_key)
        wire = {k: v for k, v in payload.items() if not k.startswith("_")}
        if transport == "allreduce":
            out = B.identity_with_deps(wire["reduce"], deps)
            self.record_bytes(comp, key, scheme, numel, self.nbytes(out))
            return out, ctx
        nbytes = 4  # the placeholder
        for part in sorted(wire):
            t = B.identity_with_deps(wire[part], deps)
            name = collective_name(coll_key, part)
            ctx.handles[part] = self.allgather(t, name, info.process_set)
            nbytes = nbytes + self.nbytes(t)
            if part in scheme.variable_parts:
                length = B.scalar(self._length(t), "int32", like=x)
                ctx.handles["#" + part] = self.allgather(length, name + ".len", info.process_set)
                nbytes = nbytes + 4
            else:
                ctx.part_lengths[part] = B.numel(t)
        self.record_bytes(comp, key, scheme, numel, nbytes)
        placeholder = B.identity_with_deps(B.ones(1, "float32", like=x), deps)
        return placeholder, ctx

    def decompress(self, comp, output, ctx):
        B = self.B
        if ctx.transport == "resolved":  # aggregated inside compress (TF schedules)
            dense, apply_scale = ctx.local["dense"], ctx.local["apply_scale"]
            scale = B.cast(output, "float32")[0] / float(ctx.size)
            dense = dense * (apply_scale * scale + (1.0 - apply_scale))
            return B.reshape(B.cast(dense, ctx.dtype), ctx.shape)
        if ctx.transport == "powersgd":
            return self._finish_powersgd(output, ctx)
        if ctx.transport == "two_phase":
            return self._finish_two_phase(output, ctx)
        if ctx.transport == "allreduce":
            dense = ctx.scheme.decode_reduced(B, output, ctx.numel, ctx.local)
        else:
            gathered = {p: self.wait(h) for p, h in ctx.handles.items()}
            per_rank = [dict() for _ in range(ctx.size)]
            for part, g in gathered.items():
                if part.startswith("#"):
                    continue
                sizes = gathered.get("#" + part)
                if sizes is None:
                    sizes = [ctx.part_lengths[part]] * ctx.size
                for r, piece in enumerate(B.split(g, sizes, ctx.size)):
                    per_rank[r][part] = piece
            dense = ctx.scheme.aggregate(B, per_rank, ctx.numel, ctx.local)
            if ctx.scheme.apply_op_scale:
                # the placeholder carries Horovod's total scaling times size
                dense = dense * (B.cast(output, "float32")[0] / float(ctx.size))
        return B.reshape(B.cast(dense, ctx.dtype), ctx.shape)

    def resolve_now(self, comp, out, ctx):
        """The unscaled flat fp32 sum over ranks, right away (graph frameworks)."""
        B = self.B
        if ctx.transport == "allreduce":
            out = self.allreduce_sum(out, collective_name(ctx.coll_key, "reduce"), ctx.process_set)
            ctx = Ctx(**{**ctx.__dict__, "dtype": "float32"})
            return B.flatten(self.decompress(comp, out, ctx))
        ctx.dtype = "float32"
        return B.flatten(self.decompress(comp, B.full(1, float(ctx.size), "float32", like=out), ctx))

    # --- two-phase compressed allreduce ------------------------------------------------------
    # Allgathering everybody's payload makes each rank receive (N-1) payloads.
    # Here each rank owns one of N chunks: phase 1 sends every chunk's payload
    # to its owner (alltoall), the owner decodes and sums its chunk, re-encodes
    # the sum with its own (second-stage) error feedback, and phase 2 allgathers
    # the N chunk payloads.  Each rank sends and receives about 2 payloads
    # whatever N is (as in 1-bit Adam, ByteGrad and CGX).  Conservation holds
    # end to end: sum(applied) + sum(stage-1 residuals) + sum(stage-2
    # residuals) == sum(gradients).
    def _compress_two_phase(self, comp, scheme, memory, key, coll_key, x, step, info, shape, dtype, numel, ectx):
        B = self.B
        n_ranks = info.size
        chunk = ceil_div(numel, n_ranks)
        if memory is not None:
            # one dict for compensate and update: a memory may pass values between them (the velocity)
            state = {n: self.get_memory(n, key, numel, x) for n in memory.names}
            acc = memory.compensate(B, x, state)
        else:
            acc = x
        pad = chunk * n_ranks - numel
        padded = B.concat([acc, B.zeros(pad, "float32", like=x)]) if pad else acc
        private = stable_hash(comp.seed, key, info.rank, "two_phase")
        payloads, sents = [], []
        for j in range(n_ranks):  # one encode per destination chunk (a loop over ranks, not elements)
            cctx = EncodeContext(key=key, step=step, rank=info.rank, size=n_ranks, shape=(chunk,),
                                 uniform=lambda n, j=j: B.uniform(n, self.seed_for(private + j, step), like=x),
                                 shared_seed=ectx.shared_seed, state={})
            p, s = scheme.encode(B, padded[j * chunk:(j + 1) * chunk], cctx)
            payloads.append(p)
            sents.append(s)
        deps = []
        if memory is not None:
            sent = B.concat(sents)[:numel] if pad else B.concat(sents)
            new_state = memory.update(B, acc, sent, state)
            deps = [self.set_memory(n, key, new_state[n]) for n in memory.names]
        ctx = Ctx(self, key, scheme, shape, dtype, numel, n_ranks, "two_phase", info.process_set, coll_key=coll_key)
        ctx.local.update(chunk=chunk, step=step, seed=stable_hash(comp.seed, key, info.rank, "phase2"),
                         rank=info.rank, stage2=memory is not None)
        stage2 = scheme.stage2()
        # phase 2 sends the owned chunk's payload: as large as one of phase 1's
        # chunks, unless the owner re-encodes with another scheme
        nbytes = 4 if stage2 is scheme else 4 + stage2.payload_nbytes(chunk)
        for part in sorted(payloads[0]):
            send = B.identity_with_deps(B.concat([p[part] for p in payloads]), deps)
            ctx.part_lengths[part] = B.numel(payloads[0][part])
            ctx.handles["1." + part] = self.alltoall(send, collective_name(coll_key, "a2a." + part), info.process_set)
            nbytes += self.nbytes(send) + (self.nbytes(payloads[0][part]) if stage2 is scheme else 0)
        if self.defer_second_rounds:
            self.pending_rounds.append(ctx)
        self.record_bytes(comp, key, scheme, numel, nbytes)
        return B.identity_with_deps(B.ones(1, "float32", like=x), deps), ctx

    def _second_phase(self, ctx):
        B = self.B
        n_ranks, chunk = ctx.size, ctx.local["chunk"]
        received = [dict() for _ in range(n_ranks)]
        for part, length in ctx.part_lengths.items():
            got = self.wait(ctx.handles.pop("1." + part))
            for r, piece in enumerate(B.split(got, [length] * n_ranks, n_ranks)):
                received[r][part] = piece
        chunk_sum = ctx.scheme.aggregate(B, received, chunk)
        seed, step = ctx.local["seed"], ctx.local["step"]
        c2 = EncodeContext(key=ctx.key, step=step, rank=ctx.local["rank"], size=n_ranks, shape=(chunk,),
                           uniform=lambda n: B.uniform(n, self.seed_for(seed, step), like=chunk_sum),
                           shared_seed=0, state={})
        key2 = ctx.key + "#owned_chunk"
        stage2 = ctx.scheme.stage2()
        if ctx.local["stage2"]:
            state = {"residual": self.get_memory("residual", key2, chunk, chunk_sum)}
            payload2, new_state = encode_with_memory(B, stage2, chunk_sum, state, c2, ResidualMemory())
            deps = [self.set_memory("residual", key2, new_state["residual"])]
        else:
            payload2, _ = stage2.encode(B, chunk_sum, c2)
            deps = []
        ctx.local["part_lengths2"] = {part: B.numel(t) for part, t in payload2.items()}
        for part in sorted(payload2):
            t = B.identity_with_deps(payload2[part], deps)
            ctx.handles["2." + part] = self.allgather(t, collective_name(ctx.coll_key, "ag." + part), ctx.process_set)

    def _finish_two_phase(self, output, ctx):
        B = self.B
        if not any(h.startswith("2.") for h in ctx.handles):
            self.launch_second_rounds(ctx)
        n_ranks, chunk = ctx.size, ctx.local["chunk"]
        stage2 = ctx.scheme.stage2()
        per_chunk = [dict() for _ in range(n_ranks)]
        for part, length in ctx.local["part_lengths2"].items():
            got = self.wait(ctx.handles["2." + part])
            for r, piece in enumerate(B.split(got, [length] * n_ranks, n_ranks)):
                per_chunk[r][part] = piece
        dense = B.concat([stage2.decode_one(B, p, chunk) for p in per_chunk])[:ctx.numel]
        if ctx.scheme.apply_op_scale:
            dense = dense * (B.cast(output, "float32")[0] / float(ctx.size))
        return B.reshape(B.cast(dense, ctx.dtype), ctx.shape)

    # --- PowerSGD's two rounds ------------------------------------------------------------
    def _compress_powersgd(self, comp, scheme, memory, key, coll_key, x, info, shape, dtype, numel):
        B = self.B
        state = {n: self.get_memory(n, key, numel, x) for n in memory.names} if memory is not None else None
        acc = x if memory is None else memory.compensate(B, x, state)
        n, m = scheme.matrix_shape(shape)
        r = scheme.rank
        # warm start: Q persists; its first value comes from a seed shared by all ranks
        q_seed = stable_hash(comp.seed, key, "Q0")
        q = self.get_state(key, "Q", lambda: _starting_q(B, q_seed, (m, r), x))
        p_local, mat = scheme.first_round(B, acc, q, shape)
        ctx = Ctx(self, key, scheme, shape, dtype, numel, info.size, "powersgd", info.process_set,
                  local={"mat": mat, "acc": acc, "memory": memory, "memory_state": state}, coll_key=coll_key)
        ctx.handles["p"] = self.allreduce_sum(B.flatten(p_local), collective_name(coll_key, "p"), info.process_set)
        ctx.local["p_shape"] = (n, r)
        ctx.local["q_seed"] = q_seed
        if self.defer_second_rounds:
            self.pending_rounds.append(ctx)
        self.record_bytes(comp, key, scheme, numel, 4 + 4 * (n + m) * r)
        return B.ones(1, "float32", like=x), ctx

    def _second_round(self, ctx):
        if ctx.transport == "two_phase":
            return self._second_phase(ctx)
        B = self.B
        p_sum = B.reshape(self.wait(ctx.handles.pop("p")), ctx.local["p_shape"])
        p, q_local = ctx.scheme.second_round(B, p_sum, ctx.local["mat"])
        ctx.local.update(p=p, q_local=q_local)
        ctx.handles["q"] = self.allreduce_sum(B.flatten(q_local), collective_name(ctx.coll_key, "q"), ctx.process_set)

    def _finish_powersgd(self, output, ctx):
        B = self.B
        if "q" not in ctx.handles:
            self.launch_second_rounds(ctx)
        q_local = ctx.local["q_local"]
        q_sum = B.reshape(self.wait(ctx.handles["q"]), B.shape(q_local))
        agg, sent = ctx.scheme.finish(B, ctx.local["p"], q_local, q_sum)
        # The warm start must not keep a NaN/Inf from one bad step forever:
        # non-finite entries fall back to the seeded starting values.
        q_next = q_sum / float(ctx.size)
        q_start = _starting_q(B, ctx.local["q_seed"], B.shape(q_next), q_next)
        deps = [self.set_state(ctx.key, "Q", B.where(B.isfinite(q_next), q_next, q_start))]
        memory = ctx.local["memory"]
        if memory is not None:
            new_state = memory.update(B, ctx.local["acc"], sent, ctx.local["memory_state"])
            deps += [self.set_memory(n, ctx.key, new_state[n]) for n in memory.names]
        dense = agg * (B.cast(output, "float32")[0] / float(ctx.size))
        dense = B.identity_with_deps(dense, deps)
        return B.reshape(B.cast(dense, ctx.dtype), ctx.shape)

    # --- helpers ----------------------------------------------------------------------
    def _length(self, t):
        return self.B.numel(t)

    def fallback_key(self, tensor, shape):
        """Shape plus occurrence count; only deterministic across ranks if
        tensors of equal shape are compressed in the same order."""
        raise NotImplementedError
