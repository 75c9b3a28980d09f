"""Transports: how one tensor's payload moves between ranks (see
:mod:`hvd_compress.transports.base`).  A scheme names its transport; the
compressor's ``transport=`` may turn an allgather into the two-phase
exchange."""
from __future__ import annotations

from .allgather import AllgatherTransport
from .allreduce import AllreduceTransport
from .base import Call, Pending, Transport, TwoRoundPending
from .lowrank import LowRankTransport
from .already_reduced import ResolvedPending, ResolvedTransport
from .two_phase import TwoPhaseTransport, choose_two_phase

ALLREDUCE = AllreduceTransport()
ALLGATHER = AllgatherTransport()
TWO_PHASE = TwoPhaseTransport()
LOW_RANK = LowRankTransport()
RESOLVED = ResolvedTransport()

#: a scheme's ``transport_for(shape)`` -> the transport that carries it
BY_SCHEME_TRANSPORT = {"allreduce": ALLREDUCE, "allgather": ALLGATHER, "powersgd": LOW_RANK}


def transport_for(scheme, mode, n_ranks, numel, shape) -> Transport:
    """The transport of one tensor: the scheme's, except that an allgather
    becomes two-phase where the compressor's ``transport=`` mode asks for it."""
    transport = BY_SCHEME_TRANSPORT[scheme.transport_for(shape)]
    if transport is ALLGATHER and choose_two_phase(mode, n_ranks, numel):
        return TWO_PHASE
    return transport


__all__ = ["Call", "Pending", "TwoRoundPending", "Transport", "ResolvedPending", "transport_for", "ALLREDUCE",
           "ALLGATHER", "TWO_PHASE", "LOW_RANK", "RESOLVED", "choose_two_phase", "AllreduceTransport",
           "AllgatherTransport", "TwoPhaseTransport", "LowRankTransport", "ResolvedTransport"]
