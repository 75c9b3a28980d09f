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
own: per-parameter state lives in the adapter, which also issues every
collective, so the same transport serves PyTorch and TensorFlow.
"""

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Tuple

from ..schemes.base import EncodeContext


@dataclass(eq=False)
class Call:
    """One ``compress`` call of one tensor, as a transport receives it."""
    adapter: Any  # the framework adapter: collectives and per-parameter state
    comp: Any  # the Compressor: seed and stats
    key: str  # the parameter's key; names its state
    coll_key: str  # names its collectives (the key, plus "@<phase>" under a schedule)
    x: Any  # the gradient, flat, in float32
    step: Any  # this tensor's communication count (a Python int, or a TF tensor)
    rank: int  # this process's rank in the process set
    size: int  # number of ranks in the process set
    process_set: Any
    shape: tuple  # the gradient's shape, restored by ``finish``
    dtype: str  # the gradient's dtype, restored by ``finish``
    numel: int
    scheme: Any
    memory: Any  # what error feedback keeps between steps (a Memory), or None
    private_uniform: Callable[[int], Any]  # n -> U[0,1) draws private to this rank, key and step
    shared_seed: Any  # the same on every rank for this key and step (Random-K's indices)
    scheme_state: dict  # the scheme's state kept across steps, handed to it as EncodeContext.state
    #: where a fused decode may write the result: ``x`` itself when it is the
    #: gradient Horovod's optimizer replaces by the result (as Horovod's own
    #: in-place allreduce does), else None (a fresh output)
    out: Any = None

    @property
    def backend(self):
        return self.adapter.B


@dataclass(eq=False)
class Pending:
    """What crosses from ``compress`` to ``decompress`` (Horovod's ``ctx``).

    Compared by identity: two tensors in flight are never the same pending."""
    transport: Any  # the Transport whose ``finish`` resolves this
    adapter: Any
    key: str
    coll_key: str
    scheme: Any
    shape: tuple
    dtype: str
    numel: int
    size: int
    process_set: Any
    #: the fused codec that encoded the payload (None: the eager scheme), and
    #: the buffer its decode writes into (see :attr:`Call.out`)
    codec: Any = None
    out: Any = None


@dataclass(eq=False)
class TwoRoundPending(Pending):
    """A pending whose ``finish`` needs a second collective, launched after
    the first one's result has arrived (PowerSGD's Q, two-phase's gather)."""
    second_round_launched: bool = False


def pending_fields(call: Call):
    """The :class:`Pending` fields every transport fills from its call."""
    return dict(adapter=call.adapter, key=call.key, coll_key=call.coll_key, scheme=call.scheme,
                shape=call.shape, dtype=call.dtype, numel=call.numel, size=call.size,
                process_set=call.process_set, out=call.out)


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
        B = pending.adapter.B
        pending = replace(pending, dtype="float32")
        unscaled = B.full(1, float(pending.size), "float32", like=out)
        return B.flatten(self.finish(pending, unscaled))


# --- the steps every transport shares ------------------------------------------------------
def encode_context(call: Call) -> EncodeContext:
    """What the scheme may know about this call besides the tensor."""
    return EncodeContext(key=call.key, step=call.step, rank=call.rank, size=call.size,
                         uniform=call.private_uniform, shared_seed=call.shared_seed, shape=call.shape,
                         state=call.scheme_state)


def compensate(adapter, memory, key: str, numel: int, x) -> Tuple[Any, dict]:
    """``memory.compensate`` on the stored state of ``key``: (what to encode, state).

    The state dict goes unchanged to :func:`update`: a memory may leave values
    there for its update (the velocity of DGC's and the momentum memory)."""
    state = {name: adapter.get_memory(name, key, numel, x) for name in memory.names}
    return memory.compensate(adapter.B, x, state), state


def update(adapter, memory, key: str, acc, sent, state: dict) -> list:
    """``memory.update`` and storing the new state; returns the dependencies
    (TF assign ops) that the outputs must wait on."""
    new_state = memory.update(adapter.B, acc, sent, state)
    return [adapter.set_memory(name, key, new_state[name]) for name in memory.names]


def fused_codec(call: Call):
    """The fused kernel codec for this call (:mod:`hvd_compress.kernels`), or
    None where the eager scheme runs."""
    return call.adapter.fused_codec(call.scheme, call.memory, call.x)


def encode_with_feedback(adapter, scheme, x, context: EncodeContext, memory, key: str, numel: int, codec=None,
                         out=None):
    """get memory -> compensate -> encode -> update -> set memory; returns
    (payload, dependencies).  Without a memory the scheme is told that
    nobody reads its dense ``sent`` (``need_sent=False``).  A fused ``codec``
    does all of it in its kernels, updating the stored state in place (``out``:
    the gradient buffer it may use as scratch, see :attr:`Call.out`)."""
    if codec is not None:
        return fused_encode(adapter, codec, x, context, memory, key, numel, out), []
    if memory is None:
        payload, _ = scheme.encode(adapter.B, x, replace(context, need_sent=False))
        return payload, []
    acc, state = compensate(adapter, memory, key, numel, x)
    payload, sent = scheme.encode(adapter.B, acc, context)
    return payload, update(adapter, memory, key, acc, sent, state)


def fused_encode(adapter, codec, x, context, memory, key, numel, out):
    """:func:`encode_with_feedback` by a fused codec: the momentum pass first
    where the memory keeps a velocity, then the codec on ``d + residual``."""
    ws = adapter.workspace(key)
    if memory is not None and "momentum" in memory.names:
        x = adapter.fused_momentum(memory, key, numel, x, ws, out)
    keeps_residual = memory is not None and "residual" in memory.names
    residual = adapter.get_memory("residual", key, numel, x) if keeps_residual else None
    return codec.encode(x, residual, ws, context)


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
    B = pending.adapter.B
    if reduced is not None:
        dense = dense * op_scale(B, reduced, pending.size)
    if deps:
        dense = B.identity_with_deps(dense, deps)
    return B.reshape(B.cast(dense, pending.dtype), pending.shape)


def placeholder(call: Call, deps: list):
    """The 1-element float32 tensor of value 1 handed to Horovod's allreduce,
    after ``deps``: whatever Horovod scales it by is the op's scaling."""
    B = call.backend
    ones = B.ones(1, "float32", like=call.x)
    return B.identity_with_deps(ones, deps) if deps else ones
