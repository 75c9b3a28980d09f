"""Transport shared by the framework adapters.

An adapter owns one framework's per-parameter state (residuals, step
counters, scheme state) and its collectives.  The flow of a call is the same
for both frameworks and lives here; subclasses supply: finding the caller's
parameter name and process set, state storage, and the collectives.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .compressor import collective_name, encode_with_feedback, stable_hash
from .schemes.base import EncodeContext


@dataclass
class CallerInfo:
    key: Any  # parameter name, or None when it cannot be found
    process_set: Any
    rank: int
    size: int


@dataclass
class Ctx:
    adapter: Any
    key: str
    scheme: Any
    shape: tuple
    dtype: str
    numel: int
    size: int
    local: dict = field(default_factory=dict)
    handles: dict = field(default_factory=dict)
    part_lengths: dict = field(default_factory=dict)


class AdapterBase:
    B = None  # the framework's backend

    def __init__(self):
        self.reset()

    # --- framework specifics -------------------------------------------------
    def caller_info(self, tensor) -> CallerInfo:
        raise NotImplementedError

    def next_step(self, key):
        raise NotImplementedError

    def get_residual(self, key, numel, like):
        raise NotImplementedError

    def set_residual(self, key, value):
        """Store the new residual; return a dependency the outputs must wait on."""
        raise NotImplementedError

    def allgather(self, tensor, name, process_set):
        raise NotImplementedError

    def wait(self, handle):
        raise NotImplementedError

    def nbytes(self, tensor):
        raise NotImplementedError

    def record_bytes(self, comp, key, scheme, numel, nbytes):
        comp.stats.record(key, scheme.name, 4 * numel, nbytes)

    def seed_for(self, base, step):
        raise NotImplementedError

    def reset(self):
        self.scheme_state = {}

    # --- the shared flow ----------------------------------------------------------
    def compress(self, comp, tensor):
        B = self.B
        info = self.caller_info(tensor)
        shape, numel, dtype = B.shape(tensor), B.numel(tensor), B.dtype_name(tensor)
        key = info.key if info.key is not None else self.fallback_key(tensor, shape)
        scheme, ef = comp.scheme_for(key, numel, shape)
        x = B.cast(B.flatten(tensor), "float32")
        step = self.next_step(key)
        private = stable_hash(comp.seed, key, info.rank)
        shared = stable_hash(comp.seed, key)
        ectx = EncodeContext(
            key=key, step=step, rank=info.rank, size=info.size,
            uniform=lambda n: B.uniform(n, self.seed_for(private, step), like=x),
            shared_seed=self.seed_for(shared, step), shape=shape,
            state=self.scheme_state.setdefault(key, {}))
        residual = self.get_residual(key, numel, x) if ef else None
        payload, new_residual = encode_with_feedback(B, scheme, x, residual, ectx)
        deps = [self.set_residual(key, new_residual)] if ef else []
        ctx = Ctx(self, key, scheme, shape, dtype, numel, info.size,
                  local={k: v for k, v in payload.items() if k.startswith("_")})
        wire = {k: v for k, v in payload.items() if not k.startswith("_")}
        if scheme.transport == "allreduce":
            out = B.identity_with_deps(wire["reduce"], deps)
            self.record_bytes(comp, key, scheme, numel, self.nbytes(out))
            return out, ctx
        nbytes = 4  # the placeholder
        for part in sorted(wire):
            t = B.identity_with_deps(wire[part], deps)
            name = collective_name(key, part)
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
        if ctx.scheme.transport == "allreduce":
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

    # --- helpers ----------------------------------------------------------------------
    def _length(self, t):
        return self.B.numel(t)

    def fallback_key(self, tensor, shape):
        """Shape plus occurrence count; only deterministic across ranks if
        tensors of equal shape are compressed in the same order."""
        raise NotImplementedError
