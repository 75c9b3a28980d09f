"""The flow shared by the framework adapters: from Horovod's ``compress`` call
to a transport, and back in ``decompress``.

An adapter owns one framework's per-parameter state (residuals, step
counters, scheme state) and its collectives.  What moves a payload between
ranks is a :class:`~hvd_compress.transports.Transport`, picked per tensor;
subclasses supply finding the caller's parameter name and process set, state
storage, and the collectives.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

from ..cross_rank import stable_hash
from ..schemes.base import SeededDraws
from .param_state import StateTable
from ..transports import Call, transport_for
from ..transports.two_phase import choose_two_phase  # noqa: F401  (re-exported)


#: the environment variable that switches the 2-rank swap on (:func:`pair_swap_min_bytes`)
PAIR_SWAP_ENV = "HVDC_PAIR_SWAP_MIN_BYTES"


def pair_swap_min_bytes(chosen=None):
    """From how many bytes up an adapter's ``allgather_fixed`` between 2 ranks
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


class AdapterBase:
    B = None  # the framework's backend
    #: start second rounds of all pending tensors together (eager frameworks)
    defer_second_rounds = False
    #: the fused codecs encode views of a tensor and update state in place, so
    #: two-phase may run them chunk by chunk (torch; TF's codecs are graph ops
    #: bound to a whole residual variable)
    fused_codecs_on_chunks = False
    #: a payload of several fixed-length parts travels as one allgather of its bytes
    #: (``to_bytes``/``from_bytes``; torch); else one allgather per part (TF's graph)
    packs_gathers = False

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

    def allgather_fixed(self, tensor, name, process_set, rank, size):
        """An allgather of a tensor whose shape is the same on every rank (the
        caller knows it is: a fixed-length part, or a packed payload of them).
        The same result as :meth:`allgather`; an adapter may move it another way."""
        return self.allgather(tensor, name, process_set)

    def allreduce_sum(self, tensor, name, process_set):
        raise NotImplementedError

    def alltoall(self, tensor, name, process_set):
        """Equal splits along the first dimension."""
        raise NotImplementedError

    def get_state(self, key, name, init):
        """Scheme state that persists across steps (PowerSGD's Q)."""
        raise NotImplementedError

    def fused_codec(self, scheme, memory, x):
        """A fused kernel codec (:mod:`hvd_compress.kernels`) for this scheme,
        memory and flat tensor, or None: the eager scheme runs."""
        return None

    def lowrank_codec(self, scheme, memory, x):
        """PowerSGD's rounds in preallocated buffers for this flat tensor
        (:mod:`hvd_compress.codecs.torch_lowrank`), or None: the scheme's
        eager rounds run."""
        return None

    def fused_momentum(self, memory, key, numel, x, ws, out):
        """Momentum-aware error feedback's first half ahead of a fused codec
        (:class:`~hvd_compress.MomentumMemory`): ``u = m u + x`` into the stored
        velocity of ``key`` (kept finite) and the direction ``d`` returned
        (``u``, or ``x + m u`` with Nesterov).  The codec then compresses
        ``d + residual``, as the eager path does."""
        raise NotImplementedError

    def workspace(self, key):
        """Scratch buffers of one parameter, reused from step to step."""
        return self.params.of(key).workspace

    def set_state(self, key, name, value):
        raise NotImplementedError

    def defer_second_round(self, pending):
        """Remember a two-round tensor whose second round is not launched yet."""
        if self.defer_second_rounds:
            self.pending_rounds.append(pending)

    def launch_second_rounds(self, pending):
        """Start the second collective of two-round transports.  Torch starts
        those of *every* tensor compressed this round, in sorted key order,
        before waiting on any: decompress is called in hook order, which
        differs between ranks, and waiting on one tensor's second round before
        every rank has launched it would deadlock."""
        pending.transport.launch_second_round(pending)

    def wait(self, handle):
        raise NotImplementedError

    def nbytes(self, tensor):
        raise NotImplementedError

    def dynamic_length(self, tensor):
        """The element count of a 1-D tensor whose length is data-dependent."""
        return self.B.numel(tensor)

    def record_bytes(self, comp, key, scheme, numel, nbytes):
        comp.stats.record(key, scheme.name, 4 * numel, nbytes)

    def seed_for(self, base, step):
        raise NotImplementedError

    def check_fingerprint(self, comp, info):
        """Once per compressor: every rank compares its configuration with the others'."""
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
        raise NotImplementedError

    def step_counts(self):
        """{key: communications so far} (plain ints)."""
        raise NotImplementedError

    def set_step_counts(self, steps):
        """Adopt ``steps`` (from rank 0): keys absent there start again from 0."""
        raise NotImplementedError

    def reset(self):
        #: parameter key -> its ParamState
        self.params = StateTable()
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
        call = self._call(comp, key, B.cast(B.flatten(tensor), "float32"), self.next_step(key), info, shape, dtype,
                          numel)
        if len(phases) == 1:
            out, pending = self._compress_with(phases[0], call)
        else:
            out, pending = self._compress_scheduled(phases, call)
        self.compressed(key, info)
        return (B.identity_with_deps(out, [check]) if check is not None else out), pending

    def compressed(self, key, info):
        """Called after each tensor's ``compress`` (eager frameworks batch
        the two-phase first rounds of a round's tensors here)."""

    def _call(self, comp, key, x, step, info, shape, dtype, numel):
        """The :class:`~hvd_compress.transports.Call` of one tensor, before a
        phase has chosen its scheme and memory."""
        B = self.B
        private = stable_hash(comp.seed, key, info.rank)
        return Call(adapter=self, comp=comp, key=key, coll_key=key, x=x, step=step, rank=info.rank,
                    size=info.size, process_set=info.process_set, shape=shape, dtype=dtype, numel=numel,
                    scheme=None, memory=None, out=x if info.owns_input else None,
                    private_uniform=SeededDraws(B, self.seed_for(private, step), like=x),
                    shared_seed=self.seed_for(stable_hash(comp.seed, key), step),
                    scheme_state=self.params.of(key).scheme)

    def _compress_scheduled(self, phases, call):
        """Eager frameworks: the phase follows the Python step counter
        (communications done so far, the same on every rank)."""
        done = int(call.step) - 1
        i = max(j for j, phase in enumerate(phases) if phase.start <= done)
        return self._compress_with(phases[i], replace(call, coll_key=f"{call.key}@{i}"))

    def _compress_with(self, phase, call):
        transport = transport_for(phase.scheme, phase.transport, call.size, call.numel, call.shape)
        return transport.start(replace(call, scheme=phase.scheme, memory=phase.memory))

    def decompress(self, comp, output, pending):
        return pending.transport.finish(pending, output)

    def resolve_now(self, comp, out, pending):
        """The unscaled flat fp32 sum over ranks, right away (graph frameworks)."""
        return pending.transport.resolve_now(pending, out)

    def fallback_key(self, tensor, shape):
        """Shape plus occurrence count; only deterministic across ranks if
        tensors of equal shape are compressed in the same order."""
        raise NotImplementedError
