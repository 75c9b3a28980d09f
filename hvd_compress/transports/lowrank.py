"""PowerSGD's two allreduces (Vogels, Karimireddy & Jaggi, NeurIPS 2019):
``P = sum_i M_i Q`` in ``compress``, then ``Q = sum_i M_i^T orth(P)`` once P
has arrived; the gradient is ``orth(P) Q^T``.  Both factors are sums, so they
travel by allreduce, and error feedback keeps what the rank-r approximation
left out, through the memory like every other transport.

Where the codec provider has one (PyTorch, :mod:`hvd_compress.codecs.torch_lowrank`),
a codec runs the three steps in preallocated buffers with the residual
updated in place; elsewhere (TensorFlow, ``HVDC_KERNELS=0``) the scheme's
eager ``first_round`` / ``second_round`` / ``finish`` run.  The payloads are
the same either way.

How the two allreduces run under Horovod's ``Compression`` interface, which
hands the compressor one tensor at a time: ``compress`` launches P's
allreduce and returns a 1-element placeholder; the first ``decompress`` of a
step launches the second round of every tensor compressed so far (torch's
deferred rounds; hook order differs between ranks, so none may wait on a Q that
another rank has not launched), waiting for their P's, orthonormalising the
P's of one shape together, and launching every Q before any is waited on.
Q needs P's sum, and Horovod's ``synchronize`` is the only way to have it:
the host waits for P's allreduce before Q's can be launched (on a GPU too;
Horovod has no collective that starts on a device-side event)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..cross_rank import collective_name, stable_hash
from ..feedback.memory import compensate, update
from .base import TwoRoundPending, Transport, op_scale, pending_fields, to_gradient


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
    codec: Any = None  # the provider's preallocated rounds, or None: the scheme's eager ones
    workspace: Any = None  # the parameter's buffers (codec only)


class LowRankTransport(Transport):
    name = "powersgd"

    def start(self, call):
        roles, grad, scheme, memory = call.roles, call.grad, call.scheme, call.memory
        B, store = roles.B, roles.store
        n, m = scheme.matrix_shape(grad.shape)
        # warm start: Q persists; its first value comes from a seed shared by all ranks
        q_seed = stable_hash(call.comp.seed, grad.key, "Q0")
        q = store.get_state(grad.key, "Q", lambda: starting_q(B, q_seed, (m, scheme.rank), call.x))
        codec = roles.codecs.lowrank_codec(scheme, memory, call.x)
        if codec is not None:
            ws = store.workspace(grad.key)
            q = codec_q(store, grad.key, q, (m, scheme.rank), q_seed, call.x)
            p_flat, matrix, acc, state = codec.first_round(store, grad.key, call.x, q, grad.shape, ws)
        else:
            ws = None
            acc, state = (call.x, None) if memory is None else compensate(store, memory, grad.key, grad.numel, call.x)
            p_local, matrix = scheme.first_round(B, acc, q, grad.shape)
            p_flat = B.flatten(p_local)
        pending = LowRankPending(transport=self, matrix=matrix, acc=acc, memory=memory, memory_state=state,
                                 p_shape=(n, scheme.rank), q_seed=q_seed, codec=codec, workspace=ws,
                                 **pending_fields(call))
        pending.p_reduce = roles.collectives.allreduce_sum(p_flat, collective_name(grad.coll_key, "p"),
                                                           call.group.process_set)
        roles.rounds.defer(pending)
        store.record_bytes(call.comp, grad.key, scheme, grad.numel, 4 + 4 * (n + m) * scheme.rank)
        return B.ones(1, "float32", like=call.x), pending

    def launch_second_round(self, pending):
        self.launch_second_rounds([pending])

    def launch_second_rounds(self, pendings):
        """Wait for every P, orthonormalise (the codec's P's of one shape in one
        batched QR), then compute and launch each Q in the order given."""
        B = pendings[0].roles.B
        p_sums = []
        for pending in pendings:
            p_sums.append(B.reshape(pending.roles.collectives.wait(pending.p_reduce), pending.p_shape))
            pending.p_reduce = None
        fused = [i for i, pending in enumerate(pendings) if pending.codec is not None]
        if fused:
            orth = pendings[fused[0]].codec.orthonormalize([p_sums[i] for i in fused])
            for i, p in zip(fused, orth):
                pendings[i].p = p
        for pending, p_sum in zip(pendings, p_sums):
            if pending.codec is not None:
                q_flat, pending.q_local = pending.codec.second_round(pending.p, pending.matrix, pending.workspace)
            else:
                pending.p, pending.q_local = pending.scheme.second_round(B, p_sum, pending.matrix)
                q_flat = B.flatten(pending.q_local)
            pending.q_reduce = pending.roles.collectives.allreduce_sum(
                q_flat, collective_name(pending.grad.coll_key, "q"), pending.group.process_set)
            pending.second_round_launched = True

    def finish(self, pending, reduced):
        roles, grad = pending.roles, pending.grad
        B, store = roles.B, roles.store
        if not pending.second_round_launched:
            roles.rounds.launch(pending)
        q_flat = roles.collectives.wait(pending.q_reduce)
        if pending.codec is not None:
            return self._finish_codec(pending, reduced, q_flat)
        q_sum = B.reshape(q_flat, B.shape(pending.q_local))
        agg, sent = pending.scheme.finish(B, pending.p, pending.q_local, q_sum)
        # The warm start must not keep a NaN/Inf from one bad step forever:
        # non-finite entries fall back to the seeded starting values.
        q_next = q_sum / float(pending.group.size)
        q_start = starting_q(B, pending.q_seed, B.shape(q_next), q_next)
        deps = [store.set_state(grad.key, "Q", B.where(B.isfinite(q_next), q_next, q_start))]
        if pending.memory is not None:
            deps += update(store, pending.memory, grad.key, pending.acc, sent, pending.memory_state)
        return to_gradient(pending, agg, reduced if pending.scheme.apply_op_scale else None, deps)

    def _finish_codec(self, pending, reduced, q_flat):
        B, store, codec, ws, grad = pending.roles.B, pending.roles.store, pending.codec, pending.workspace, pending.grad
        scale = op_scale(B, reduced, pending.group.size) if pending.scheme.apply_op_scale else None
        out, deps = codec.finish(store, grad.key, pending.p, pending.q_local, q_flat, scale, pending.acc,
                                 pending.matrix, pending.memory_state, ws, grad.out)
        q_state = store.get_state(grad.key, "Q", None)
        codec.next_q(q_state, q_flat, pending.group.size, ws["lowrank.Q0"], B.host_reads_are_free(q_state))
        return to_gradient(pending, out, None, deps)


def codec_q(store, key, q, shape, q_seed, like):
    """The stored Q as the codec keeps it: ``m x r`` whose transpose is
    contiguous (a fresh start, a loaded checkpoint or another rank's shape
    are laid out again), and the seeded start kept for the non-finite fallback."""
    B, ws = store.B, store.workspace(key)
    laid_out = q
    if tuple(B.shape(q)) != tuple(shape):  # another PowerSGD rank for this key (a schedule): start again
        laid_out = starting_q(B, q_seed, shape, like)
    if not laid_out.t().is_contiguous() or laid_out.device != like.device:
        laid_out = laid_out.t().contiguous().to(like.device).t()
    if laid_out is not q:
        store.set_state(key, "Q", laid_out)
    q0 = ws.get("lowrank.Q0")
    if q0 is None or tuple(q0.shape) != tuple(shape) or q0.device != like.device:
        ws["lowrank.Q0"] = starting_q(B, q_seed, shape, like)
    return laid_out
