"""PowerSGD's two allreduces (Vogels, Karimireddy & Jaggi, NeurIPS 2019):
``P = sum_i M_i Q`` in ``compress``, then ``Q = sum_i M_i^T orth(P)`` once P
has arrived; the gradient is ``orth(P) Q^T``.  Both factors are sums, so they
travel by allreduce, and error feedback keeps what the rank-r approximation
left out, through the memory like every other transport."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..compressor import collective_name, stable_hash
from .base import TwoRoundPending, Transport, compensate, pending_fields, to_gradient, update


def starting_q(B, seed, shape, like):
    """PowerSGD's first Q, from a seed shared by all ranks; also the value a
    non-finite Q entry falls back to."""
    return B.reshape(B.uniform(shape[0] * shape[1], seed, like=like) - 0.5, shape)


@dataclass(eq=False, kw_only=True)
class LowRankPending(TwoRoundPending):
    matrix: Any  # this rank's gradient plus feedback as the n x m matrix M_i
    acc: Any  # the same, flat: the memory's update compares it with what was sent
    memory: Any  # the error-feedback memory, or None
    memory_state: Optional[dict]  # its state as compensate left it, for update
    p_shape: tuple  # (n, rank)
    q_seed: int  # seeds the starting Q, which non-finite Q entries fall back to
    p_reduce: Any = None  # handle: sum over ranks of P_i = M_i Q
    p: Any = None  # orth(sum of P), set by the second round
    q_local: Any = None  # this rank's Q_i = M_i^T orth(P), set by the second round
    q_reduce: Any = None  # handle: sum over ranks of Q_i, set by the second round


class LowRankTransport(Transport):
    name = "powersgd"

    def start(self, call):
        adapter, B, scheme, memory = call.adapter, call.backend, call.scheme, call.memory
        acc, state = (call.x, None) if memory is None else compensate(adapter, memory, call.key, call.numel, call.x)
        n, m = scheme.matrix_shape(call.shape)
        # warm start: Q persists; its first value comes from a seed shared by all ranks
        q_seed = stable_hash(call.comp.seed, call.key, "Q0")
        q = adapter.get_state(call.key, "Q", lambda: starting_q(B, q_seed, (m, scheme.rank), call.x))
        p_local, matrix = scheme.first_round(B, acc, q, call.shape)
        pending = LowRankPending(transport=self, matrix=matrix, acc=acc, memory=memory, memory_state=state,
                                 p_shape=(n, scheme.rank), q_seed=q_seed, **pending_fields(call))
        pending.p_reduce = adapter.allreduce_sum(B.flatten(p_local), collective_name(call.coll_key, "p"),
                                                 call.process_set)
        adapter.defer_second_round(pending)
        adapter.record_bytes(call.comp, call.key, scheme, call.numel, 4 + 4 * (n + m) * scheme.rank)
        return B.ones(1, "float32", like=call.x), pending

    def launch_second_round(self, pending):
        adapter, B = pending.adapter, pending.adapter.B
        p_sum = B.reshape(adapter.wait(pending.p_reduce), pending.p_shape)
        pending.p_reduce = None
        pending.p, pending.q_local = pending.scheme.second_round(B, p_sum, pending.matrix)
        pending.q_reduce = adapter.allreduce_sum(B.flatten(pending.q_local), collective_name(pending.coll_key, "q"),
                                                 pending.process_set)
        pending.second_round_launched = True

    def finish(self, pending, reduced):
        adapter, B = pending.adapter, pending.adapter.B
        if not pending.second_round_launched:
            adapter.launch_second_rounds(pending)
        q_sum = B.reshape(adapter.wait(pending.q_reduce), B.shape(pending.q_local))
        agg, sent = pending.scheme.finish(B, pending.p, pending.q_local, q_sum)
        # The warm start must not keep a NaN/Inf from one bad step forever:
        # non-finite entries fall back to the seeded starting values.
        q_next = q_sum / float(pending.size)
        q_start = starting_q(B, pending.q_seed, B.shape(q_next), q_next)
        deps = [adapter.set_state(pending.key, "Q", B.where(B.isfinite(q_next), q_next, q_start))]
        if pending.memory is not None:
            deps += update(adapter, pending.memory, pending.key, pending.acc, sent, pending.memory_state)
        return to_gradient(pending, agg, reduced if pending.scheme.apply_op_scale else None, deps)
