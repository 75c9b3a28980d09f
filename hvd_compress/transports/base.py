"""What every transport shares: the call it starts from, the pending state it
hands Horovod as ``ctx``, and the steps all of them take (error feedback
around an encode, splitting gathered payloads per rank, the final scale, cast
and reshape).

A transport moves one tensor's payload between ranks.  ``start`` runs inside
Horovod's ``compress``: it encodes, launches the side collectives and returns
the tensor Horovod allreduces (the payload itself, or a 1-element
placeholder) with a typed :class:`Pending`.  ``finish`` runs inside
``decompress`` with what Horovod's allreduce returned and gives back the dense
gradient in the caller's shape and dtype.  Transports hold no state of their
own: everything framework-specific is handed to them in :class:`Roles` --
the collectives, the per-parameter state store, the codec provider and when
second rounds start -- so the same transport serves PyTorch and TensorFlow,
and reads top to bottom without calling back into the adapter.
"""

from dataclasses import dataclass, replace
from typing import Any, Optional, Tuple

from ..feedback.memory import RESIDUAL, MOMENTUM, compensate, update
from ..schemes.base import EncodeContext


@dataclass(eq=False)
class Roles:
    """What a framework hands a transport, role by role
    (:mod:`hvd_compress.protocols` writes each contract down)."""
    B: Any  # the backend: tensor operations
    collectives: Any  # Collectives: allgather, allreduce, alltoall, wait, byte packing
    store: Any  # StateStore: per-parameter memory, scheme state, workspaces, byte counts
    codecs: Any  # CodecProvider: the fused codec of a scheme and memory, or None
    rounds: Any  # SecondRounds: when a two-round transport's second collective starts


@dataclass(eq=False)
class Gradient:
    """The gradient of one call as ``finish`` gives it back, and its names."""
    key: str  # the parameter's key; names its state
    coll_key: str  # names its collectives (the key, plus "@<phase>" under a schedule)
    shape: tuple  # restored by ``finish``
    dtype: str  # restored by ``finish``
    numel: int
    #: where a fused decode may write the result: the flat gradient itself when
    #: Horovod's optimizer replaces the gradient by the result (as Horovod's own
    #: in-place allreduce does), else None (a fresh output)
    out: Any = None


@dataclass(eq=False)
class Group:
    """The ranks a tensor is reduced over."""
    rank: int  # this process's rank in the process set
    size: int  # number of ranks in the process set
    process_set: Any


@dataclass(eq=False)
class Call:
    """One ``compress`` call of one tensor, as a transport receives it."""
    roles: Roles
    comp: Any  # the Compressor: its seed
    grad: Gradient
    group: Group
    x: Any  # the gradient, flat, in float32
    #: what the scheme may know besides the tensor: key, step (a Python int or a TF
    #: tensor), rank, size, draws private to this rank, the shared seed, its state
    context: EncodeContext
    scheme: Any = None
    memory: Any = None  # what error feedback keeps between steps (a Memory), or None

    @property
    def key(self):
        return self.grad.key

    @property
    def size(self):
        return self.group.size

    @property
    def step(self):
        return self.context.step

    def renamed(self, coll_key):
        """This call with its collectives named by ``coll_key``."""
        return replace(self, grad=replace(self.grad, coll_key=coll_key))


@dataclass(eq=False)
class Pending:
    """What crosses from ``compress`` to ``decompress`` (Horovod's ``ctx``).

    Compared by identity: two tensors in flight are never the same pending."""
    transport: Any  # the Transport whose ``finish`` resolves this
    roles: Roles
    grad: Gradient
    group: Group
    scheme: Any
    #: the fused codec that encoded the payload (None: the eager scheme)
    codec: Any = None

    @property
    def key(self):
        return self.grad.key


@dataclass(eq=False)
class TwoRoundPending(Pending):
    """A pending whose ``finish`` needs a second collective, launched after
    the first one's result has arrived (PowerSGD's Q, two-phase's gather)."""
    second_round_launched: bool = False


def pending_fields(call: Call):
    """The :class:`Pending` fields every transport fills from its call."""
    return dict(roles=call.roles, grad=call.grad, group=call.group, scheme=call.scheme)


class Transport:
    """A strategy for moving one tensor's payload between ranks."""
    #: the transport's name (error messages, docs)
    name = ""

    def start(self, call: Call) -> Tuple[Any, Pending]:
        """Encode, launch the side collectives; return (what Horovod allreduces, pending)."""
        raise NotImplementedError

    def finish(self, pending: Pending, reduced) -> Any:
        """The dense gradient, from Horovod's allreduce result and the side collectives."""
        raise NotImplementedError

    def launch_second_round(self, pending: TwoRoundPending) -> None:
        """Start the second collective (two-round transports only)."""
        raise TypeError(f"the {self.name} transport has no second round")

    def launch_second_rounds(self, pendings: list) -> None:
        """Start the second collectives of several pendings of this transport,
        in the order given (a transport may share work between them)."""
        for pending in pendings:
            self.launch_second_round(pending)

    def resolve_now(self, pending: Pending, out) -> Any:
        """The unscaled flat float32 sum over ranks, right away, from ``out``
        (what ``start`` returned): graph frameworks, inside one branch of a
        schedule.  The placeholder Horovod would have scaled is replaced by
        ``size``, which means scale 1."""
        B = pending.roles.B
        pending = as_float32(pending)
        unscaled = B.full(1, float(pending.group.size), "float32", like=out)
        return B.flatten(self.finish(pending, unscaled))


# --- the steps every transport shares ------------------------------------------------------
def as_float32(pending: Pending) -> Pending:
    """``pending`` whose ``finish`` returns float32 (a schedule's branches agree on the dtype)."""
    return replace(pending, grad=replace(pending.grad, dtype="float32"))


def encode_with_feedback(call: Call, codec=None):
    """get memory -> compensate -> encode -> update -> set memory; returns
    (payload, dependencies).  Without a memory the scheme is told that
    nobody reads its dense ``sent`` (``need_sent=False``).  A fused ``codec``
    does all of it in its kernels, updating the stored state in place."""
    store, memory, key, numel = call.roles.store, call.memory, call.grad.key, call.grad.numel
    if codec is not None:
        return fused_encode(call, codec), []
    if memory is None:
        payload, _ = call.scheme.encode(call.roles.B, call.x, replace(call.context, need_sent=False))
        return payload, []
    acc, state = compensate(store, memory, key, numel, call.x)
    payload, sent = call.scheme.encode(call.roles.B, acc, call.context)
    return payload, update(store, memory, key, acc, sent, state)


def fused_encode(call: Call, codec):
    """:func:`encode_with_feedback` by a fused codec: the momentum pass first
    where the memory keeps a velocity, then the codec on ``d + residual``
    (the gradient buffer ``call.grad.out`` may serve as scratch)."""
    store, memory, key, numel, x = call.roles.store, call.memory, call.grad.key, call.grad.numel, call.x
    ws = store.workspace(key)
    if memory is not None and MOMENTUM in memory.names:
        x = call.roles.codecs.fused_momentum(memory, key, numel, x, ws, call.grad.out)
    keeps_residual = memory is not None and RESIDUAL in memory.names
    residual = store.get_memory(RESIDUAL, key, numel, x) if keeps_residual else None
    return codec.encode(x, residual, ws, call.context)


def local_and_wire(payload: dict):
    """(parts the scheme keeps on this rank, named with a leading "_";
    parts that travel)."""
    local = {k: v for k, v in payload.items() if k.startswith("_")}
    return local, {k: v for k, v in payload.items() if not k.startswith("_")}


def split_per_rank(B, gathered: dict, lengths: dict, size: int) -> list:
    """``[{part: rank r's piece}, ...]`` from each part's concatenation over
    ranks; ``lengths[part]`` is one length for every rank (an int) or each
    rank's length (a list or a gathered tensor)."""
    per_rank = [dict() for _ in range(size)]
    for part, concatenated in gathered.items():
        sizes = lengths[part]
        if isinstance(sizes, int):
            sizes = [sizes] * size
        for r, piece in enumerate(B.split(concatenated, sizes, size)):
            per_rank[r][part] = piece
    return per_rank


def op_scale(B, reduced, size: int):
    """Horovod's total scaling of this op (Average's 1/size, pre/post-scale
    factors): the placeholder of value 1 it reduced holds ``size * scale``."""
    return B.cast(reduced, "float32")[0] / float(size)


def to_gradient(pending: Pending, dense, reduced=None, deps: Optional[list] = None):
    """Scale by the op's factor (when ``reduced`` is given), wait on ``deps``,
    and cast and reshape to the gradient's dtype and shape."""
    B = pending.roles.B
    if reduced is not None:
        dense = dense * op_scale(B, reduced, pending.group.size)
    if deps:
        dense = B.identity_with_deps(dense, deps)
    return B.reshape(B.cast(dense, pending.grad.dtype), pending.grad.shape)


def placeholder(call: Call, deps: list):
    """The 1-element float32 tensor of value 1 handed to Horovod's allreduce,
    after ``deps``: whatever Horovod scales it by is the op's scaling."""
    B = call.roles.B
    ones = B.ones(1, "float32", like=call.x)
    return B.identity_with_deps(ones, deps) if deps else ones
