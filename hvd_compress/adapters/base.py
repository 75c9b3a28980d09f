"""The flow shared by the framework adapters: from Horovod's ``compress`` call
to a transport, and back in ``decompress``.

An adapter finds the caller's parameter and process set, and composes the
roles a :class:`~hvd_compress.transports.Transport` is handed
(:class:`~hvd_compress.transports.base.Roles`): the framework's collectives,
its per-parameter state store, its codec provider, and when second rounds
start (:class:`SecondRounds`).  The transport, picked per tensor, moves the
payload with those and never calls back here.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ..cross_rank import stable_hash
from ..feedback.memory import MomentumMemory
from ..schemes.base import EncodeContext, SeededDraws
from ..transports import Call, transport_for
from ..transports.base import Gradient, Group
from ..transports.two_phase import choose_two_phase  # noqa: F401  (re-exported)


#: the environment variable that switches the 2-rank swap on (:func:`pair_swap_min_bytes`)
PAIR_SWAP_ENV = "HVDC_PAIR_SWAP_MIN_BYTES"


def pair_swap_min_bytes(chosen=None):
    """From how many bytes up the collectives' ``allgather_fixed`` between 2 ranks
    travels as a reduce-scatter instead of an allgather: ``HVDC_PAIR_SWAP_MIN_BYTES``
    (a byte count; it must be the same on every rank) where set, else
    ``chosen`` (what ``Auto``'s link probe chose, the same on every rank; None:
    never).  Off by default: it pays on a slow link and costs on a fast one
    (docs/design/architecture.md, "Two ranks")."""
    value = os.environ.get(PAIR_SWAP_ENV, "").strip()
    if not value:
        return chosen
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"{PAIR_SWAP_ENV} must be a byte count (an integer >= 0) or empty, got {value!r}")
    return n


def phase_index(phases, step):
    """Which of ``phases`` is in force at communication ``step`` (1-based, a
    Python int): the last one started by then."""
    done = int(step) - 1
    return max(j for j, phase in enumerate(phases) if phase.start <= done)


@dataclass
class CallerInfo:
    key: Any  # parameter name, or None when it cannot be found
    process_set: Any
    rank: int
    size: int
    params: Any = None  # [(name, shape)] of every tensor the optimizer reduces, when known
    #: the tensor is a gradient that Horovod's optimizer replaces by the result
    #: (``p.grad.set_(decompress(...))``), so a decode may write into it
    owns_input: bool = False


class SecondRounds:
    """When a two-round transport's second collective starts: at its own
    ``finish`` (graph frameworks, where every round is an op of one step)."""
    defers = False

    def defer(self, pending):
        """Remember a two-round tensor whose second round is not launched yet."""

    def launch(self, pending):
        """Start ``pending``'s second round."""
        pending.transport.launch_second_round(pending)

    def compressed(self, key, info):
        """Called after each tensor's ``compress``."""

    def forget(self):
        """Drop whatever is waiting (an elastic reset)."""


class DeferredRounds(SecondRounds):
    """Eager frameworks (torch): second rounds wait for the first
    ``decompress`` of a step, then start together, in sorted key order,
    before anyone waits: ``decompress`` is called in hook order, which
    differs between ranks, and waiting on one tensor's second round before
    every rank has launched it would deadlock."""
    defers = True

    def __init__(self):
        self.waiting = []
        self._round_keys = set()

    def defer(self, pending):
        self.waiting.append(pending)

    def compressed(self, key, info):
        """Once every tensor the optimizer reduces has been compressed this
        round (the count from its parameter list; unknown: right away), launch
        the two-phase first rounds waiting, together: one alltoall for all.
        The set is the same on every rank (all of the optimizer's tensors), so
        is the batch; tensors never compressed here (sparse gradients) leave
        the batch to the first decompress (:meth:`launch`)."""
        self._round_keys.add(key)
        if info.params and len(self._round_keys) < len(info.params):
            return
        self._round_keys = set()
        waiting = sorted((p for p in self.waiting if getattr(p, "chunk_payloads", None) is not None),
                         key=lambda p: p.key)
        for transport in dict.fromkeys(p.transport for p in waiting):
            transport.launch_first_rounds([p for p in waiting if p.transport is transport])

    def launch(self, pending):
        waiting = sorted(self.waiting, key=lambda p: p.key)
        if not any(p is pending for p in waiting):
            waiting.append(pending)
        self.forget()
        waiting = [p for p in waiting if not p.second_round_launched]
        # each transport launches its own together (PowerSGD batches its QRs), in key order
        for transport in dict.fromkeys(p.transport for p in waiting):
            transport.launch_second_rounds([p for p in waiting if p.transport is transport])

    def forget(self):
        self.waiting = []
        self._round_keys = set()


class AdapterBase:
    """Subclasses hand :meth:`__init__` their roles and supply finding the
    caller (``_caller_info``, ``_fallback_key``, ``_check_fingerprint``)
    and the elastic hooks."""

    def __init__(self, roles):
        #: what every transport is handed (:class:`~hvd_compress.transports.base.Roles`)
        self.roles = roles
        #: the framework's backend
        self.B = roles.B
        self._fingerprint_checked = False
        self.reset()

    # --- framework specifics -------------------------------------------------
    def _caller_info(self, tensor) -> CallerInfo:
        raise NotImplementedError

    def _pin_shape(self, tensor, info):
        """The tensor, with its static shape completed where the framework
        lost it and the caller knows it (eager frameworks: always known)."""
        return tensor

    def _check_fingerprint(self, comp, info):
        """Once per compressor: every rank compares its configuration with the others'."""
        raise NotImplementedError

    def _fallback_key(self, tensor, shape):
        """Shape plus occurrence count; only deterministic across ranks if
        tensors of equal shape are compressed in the same order."""
        raise NotImplementedError

    # --- elastic Horovod (hvd_compress.elastic) ----------------------------------------
    def residual_mass(self, rank, size):
        """(residual tensors holding anything, their squared norm) on this
        rank, two-phase owners' stage-2 residuals folded in (chunks cut for
        ``rank`` of ``size``)."""
        raise NotImplementedError

    def fold_owned_chunks(self, rank, size):
        """Add each two-phase stage-2 residual (the chunk ``rank`` owned when
        the tensor was cut into ``size`` chunks) into this rank's stage-1
        residual at that chunk's place, and drop it: the sum of residuals over
        ranks is unchanged, and the chunks can be cut again."""
        raise NotImplementedError

    def forget_in_flight(self):
        """Drop what belongs to the world before a reset: second rounds not
        launched, the fingerprint agreement."""
        self.roles.rounds.forget()
        self._fingerprint_checked = False

    def step_counts(self):
        """{key: communications so far} (plain ints)."""
        raise NotImplementedError

    def set_step_counts(self, steps):
        """Adopt ``steps`` (from rank 0): keys absent there start again from 0."""
        raise NotImplementedError

    def reset(self):
        """Forget every parameter's state and what is in flight."""
        self.roles.store.reset()
        self.forget_in_flight()

    # --- the shared flow ----------------------------------------------------------
    def compress(self, comp, tensor):
        B = self.B
        info = self._caller_info(tensor)
        tensor = self._pin_shape(tensor, info)
        shape, numel, dtype = B.shape(tensor), B.numel(tensor), B.dtype_name(tensor)
        key = info.key if info.key is not None else self._fallback_key(tensor, shape)
        check = self._check_fingerprint(comp, info)
        phases = comp.plan_for(key, numel, shape)
        step = self.roles.store.next_step(key)
        phase = self._handed_over_as_is(phases, step, info, tensor) if check is None else None
        if phase is not None:
            # Horovod's own ``none``: the gradient itself (where the phase keeps a
            # velocity, overwritten by it in one pass), nothing to undo.  The call,
            # transport and codec below cost about as much again as Horovod's own
            # call (docs/results/benchmarks.md, per-tensor cost).
            if phase.memory is not None:
                flat = B.flatten(tensor)
                self.roles.codecs.fused_momentum(phase.memory, key, numel, flat, self.roles.store.workspace(key), flat)
            self.roles.store.record_bytes(comp, key, phase.scheme, numel, 4 * numel)
            self.roles.rounds.compressed(key, info)
            return tensor, None
        call = self._call(comp, key, B.cast(B.flatten(tensor), "float32"), step, info, shape, dtype, numel)
        if len(phases) == 1:
            out, pending = self._compress_with(phases[0], call)
        else:
            out, pending = self._compress_scheduled(phases, call)
        self.roles.rounds.compressed(key, info)
        return (B.identity_with_deps(out, [check]) if check is not None else out), pending

    def _call(self, comp, key, x, step, info, shape, dtype, numel):
        """The :class:`~hvd_compress.transports.Call` of one tensor, before a
        phase has chosen its scheme and memory."""
        B = self.B
        private = stable_hash(comp.seed, key, info.rank)
        context = EncodeContext(key=key, step=step, rank=info.rank, size=info.size,
                                uniform=SeededDraws(B, lambda: B.seed_for(private, step), like=x),
                                shared_seed=B.seed_for(stable_hash(comp.seed, key), step), shape=shape,
                                state=self.roles.store.params.of(key).scheme)
        grad = Gradient(key=key, coll_key=key, shape=shape, dtype=dtype, numel=numel,
                        out=x if info.owns_input else None)
        return Call(roles=self.roles, comp=comp, grad=grad, group=Group(info.rank, info.size, info.process_set),
                    x=x, context=context)

    def _horovod_takes_as_is(self, tensor):
        """Whether Horovod's own allreduce may be handed ``tensor`` itself, with
        the phase in force known at ``compress``: eager frameworks (a
        contiguous float32 tensor); a traced step chooses its phase when it
        runs (TensorFlow: ``tf.switch_case``)."""
        return False

    def _handed_over_as_is(self, phases, step, info, tensor):
        """The phase in force, where it sends the gradient as it is (a
        ``passes_through`` scheme) with no memory, or with a velocity alone
        that a fused pass writes into the gradient Horovod replaces anyway;
        else None.  Only for an optimizer's parameter (a direct call's
        fallback key is released by ``decompress``, so it keeps the full path)."""
        if info.key is None or not self._horovod_takes_as_is(tensor):
            return None
        phase = phases[phase_index(phases, step)]
        if not phase.scheme.passes_through:
            return None
        if phase.memory is None:
            return phase
        velocity_only = isinstance(phase.memory, MomentumMemory) and not phase.memory.error_feedback
        if velocity_only and info.owns_input and self.roles.codecs.fuses_momentum(tensor):
            return phase
        return None

    def _compress_scheduled(self, phases, call):
        """Eager frameworks: the phase follows the Python step counter
        (communications done so far, the same on every rank)."""
        i = phase_index(phases, call.step)
        return self._compress_with(phases[i], call.renamed(f"{call.key}@{i}"))

    def _compress_with(self, phase, call):
        """Start ``phase`` on ``call``, which must be this phase's own (built or
        renamed for it): it is filled in place, because ``dataclasses.replace``
        on every tensor's call costs about as much as the rest of a dense
        tensor's path."""
        transport = transport_for(phase.scheme, phase.transport, call.group.size, call.grad.numel, call.grad.shape)
        call.scheme, call.memory = phase.scheme, phase.memory
        return transport.start(call)

    def decompress(self, comp, output, pending):
        return pending.transport.finish(pending, output)
