"""PyTorch measurements and agreement for :class:`hvd_compress.Auto`.

Every function here issues its collectives under fixed names that carry the
plan version, and is called at the same step on every rank (the first
``compress`` of the step, before any other collective of that step), so the
blocking collectives cannot interleave with a rank's gradients in flight.
"""
from __future__ import annotations

import json
import time

import torch

from .planner import PlanMismatchError, timed_row
from .probe import fastest_of
from ..cross_rank import stable_hash
from ..schemes.base import EncodeContext

#: repetitions of each probe and codec timing; the minimum is kept (the
#: usual estimator of a cost under noise from other processes)
REPEATS = 3
#: a shape's codec timing stops after the timed round that brings its timed
#: rounds to this many seconds (at least one timed round): a large tensor's
#: round is long against the noise, and each round costs the decision step
#: as much as the codecs of several training steps
CODEC_TIMING_BUDGET_S = 0.1


def require_global_process_set():
    """Auto's measurement and agreement collectives run on the global process
    set; an optimizer on a smaller set would leave them waiting for ranks
    that never call them, so refuse it (on every rank of that set)."""
    from ..integration import horovod_internals
    caller = horovod_internals.find_torch_caller()
    ps = caller.process_set if caller.optimizer is not None else None
    if ps is not None and getattr(ps, "process_set_id", 0) != 0:
        raise NotImplementedError(f"hvd_compress.Auto supports the global process set only; this optimizer "
                                  f"reduces over process set {getattr(ps, 'process_set_id', ps)}: use a fixed "
                                  f"compressor or hvd_compress.Policy there")


def _time_allreduces(numels, prefix, process_set):
    """Each size's fastest blocking allreduce (:func:`~hvd_compress.auto.probe.fastest_of`),
    repeated only where its first took at most
    :data:`~hvd_compress.auto.probe.REPEAT_BELOW_S` on every rank (agreed
    under ``<prefix>.<numel>.first``)."""
    import horovod.torch as hvd
    out = []
    for numel in numels:
        x = torch.ones(int(numel), dtype=torch.float32)

        def run(i):
            hvd.allreduce(x, name=f"{prefix}.{numel}.{i}", op=hvd.Sum, process_set=process_set)

        def agree_max(seconds):
            got = hvd.allreduce(torch.tensor([seconds], dtype=torch.float64), name=f"{prefix}.{numel}.first",
                                op=hvd.Max, process_set=process_set)
            return float(got[0])
        out.append(fastest_of(run, REPEATS, agree_max))
    return out


def probe_link(numels, version, process_set):
    """Seconds of a blocking fp32 allreduce of each size, the fastest of up to
    :data:`REPEATS`, under names ``hvdc.auto.probe.<version>.<numel>.<i>``."""
    return _time_allreduces(numels, f"hvdc.auto.probe.{version}", process_set)


def probe_early(numels, process_set):
    """The same timings at the first ``compress``, to choose how to
    calibrate (names ``hvdc.auto.probe_early.<numel>.<i>``)."""
    return _time_allreduces(numels, "hvdc.auto.probe_early", process_set)


def _codec_once(B, scheme, x, residual, shape, size, ctx, ws):
    """Encode and decode one tensor as the transport would, with error
    feedback where ``residual`` is given (Auto runs ``none`` without): by the
    fused kernels where the transports would use them (``ws``: the scheme's
    workspace, kept across the timing rounds as across training steps)."""
    transport = scheme.transport_for(shape)
    if transport == "powersgd":
        return _powersgd_once(scheme, x, residual, shape, size, ws)
    from ..codecs.torch_fused import codec_for
    from ..feedback.memory import ResidualMemory
    codec = codec_for(scheme, None if residual is None else ResidualMemory(), x)
    if codec is not None:
        return _fused_codec_once(codec, transport, x, residual, size, ctx, ws)
    acc = x if residual is None else x + residual
    payload, sent = scheme.encode(B, acc, ctx)
    local = {k: v for k, v in payload.items() if k.startswith("_")}
    wire = {k: v for k, v in payload.items() if not k.startswith("_")}
    if transport == "allgather":
        scheme.aggregate(B, [wire] * size, acc.numel(), local)
    else:
        scheme.decode_reduced(B, wire["reduce"], acc.numel(), local)
    return None if residual is None else acc - sent


class _Residual:
    """What a timed PowerSGD codec asks its adapter for: the one memory
    state, and the backend (``B``)."""

    def __init__(self, residual, backend):
        self.residual = residual
        self.B = backend

    def get_memory(self, name, key, numel, like):
        return self.residual


def _powersgd_once(scheme, x, residual, shape, size, ws):
    """PowerSGD's rounds as the transport runs them in PyTorch
    (:mod:`hvd_compress.codecs.torch_lowrank`; the eager chain where that is
    off), with ``size`` identical ranks standing in for the sums."""
    from ..codecs.torch_lowrank import codec_for
    from ..feedback.memory import ResidualMemory
    memory = None if residual is None else ResidualMemory()
    codec = codec_for(scheme, memory, x)
    n, m = scheme.matrix_shape(shape)
    if codec is None:
        from ..backend import backend_for
        B = backend_for(x)
        acc = x if residual is None else x + residual
        p_local, matrix = scheme.first_round(B, acc, torch.randn(m, scheme.rank), shape)
        p, q_local = scheme.second_round(B, p_local * size, matrix)
        _, sent = scheme.finish(B, p, q_local, q_local * size)
        return None if residual is None else acc - sent
    q = ws.get("_timing_q")
    if q is None:
        q = ws["_timing_q"] = torch.randn(scheme.rank, m).t()  # laid out as the transport keeps Q
    from ..backend import backend_for
    adapter = _Residual(residual, backend_for(x))
    p_flat, mat, acc, state = codec.first_round(adapter, "hvdc.auto.codec", x, q, shape, ws)
    p = codec.orthonormalize([p_flat.reshape(n, scheme.rank) * size])[0]
    q_flat, qt_local = codec.second_round(p, mat, ws)
    out = ws.setdefault("_timing_out", torch.empty_like(x))
    codec.finish(adapter, "hvdc.auto.codec", p, qt_local, q_flat * size, None, acc, mat, state, ws, out)
    return residual


def _fused_codec_once(codec, transport, x, residual, size, ctx, ws):
    """The fused codec's encode (the residual updated in place) and decode of
    ``size`` copies of the payload into a kept output buffer."""
    payload = codec.encode(x, residual, ws, ctx)
    local = {k: v for k, v in payload.items() if k.startswith("_")}
    wire = {k: v for k, v in payload.items() if not k.startswith("_")}
    out = ws.setdefault("_timing_out", torch.empty_like(x))
    if transport == "allgather":
        codec.aggregate([wire] * size, x.numel(), local, 1.0, out, ws)
    else:
        codec.decode_reduced(wire["reduce"], x.numel(), out, ws)
    return residual


def _codec_inputs(numel, shape, size, seed=0):
    """A gradient, a zero residual and an encode context for timing one shape."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(int(numel), generator=gen)
    ctx = EncodeContext(key="hvdc.auto.codec", step=1, rank=0, size=size,
                        uniform=lambda n: torch.rand(int(n), generator=gen), shared_seed=seed,
                        shape=tuple(shape), state={})
    return x, torch.zeros_like(x), ctx


def is_free(scheme):
    """``none`` as Auto runs it (without error feedback): the gradient passes
    through to Horovod untouched, so it has no codec cost to time.  Both
    frameworks count it as 0.0 (what ``Auto(codec_costs=...)`` assumes
    without a cost for it too), instead of timing the Python overhead of a
    call, which is not in a step and can exceed a cast's whole cost on a small
    tensor."""
    return scheme is not None and scheme.name == "NoCompression"


def codec_seconds(schemes, numel, shape, size, seed=0, decodes=None):
    """Error feedback + encode + decoding ``size`` payloads of one tensor of
    this shape, in seconds, for each scheme (None: not timed; ``none``: 0.0,
    see :func:`is_free`; ``decodes``: per scheme, how many payloads to decode
    instead of ``size``).  The schemes take turns, one warm-up round then
    :data:`REPEATS` rounds (fewer where the timed rounds reach
    :data:`CODEC_TIMING_BUDGET_S`), and each keeps its minimum: a burst of
    load from another process then slows every scheme's round alike instead
    of one scheme's whole measurement."""
    from ..backend import backend_for
    timed = [s is not None and not is_free(s) for s in schemes]
    if not any(timed):
        return [0.0 if is_free(s) else None for s in schemes]
    B = backend_for(torch.zeros(0))
    x, residual, ctx = _codec_inputs(numel, shape, size, seed)
    best = [float("inf")] * len(schemes)
    workspaces = [dict() for _ in schemes]
    residuals = [residual.clone() if t else None for t in timed]  # a fused codec updates its residual in place
    spent = 0.0
    for i in range(REPEATS + 1):
        for j, scheme in enumerate(schemes):
            if not timed[j]:
                continue
            t0 = time.perf_counter()
            _codec_once(B, scheme, x, residuals[j], tuple(shape), size if decodes is None else decodes[j], ctx,
                        workspaces[j])
            if i:
                seconds = time.perf_counter() - t0
                best[j] = min(best[j], seconds)
                spent += seconds
        if spent >= CODEC_TIMING_BUDGET_S:
            break
    return [b if t else 0.0 if is_free(s) else None for s, b, t in zip(schemes, best, timed)]


def measure_codecs(tensors, keys, candidates, size, applies):
    """``[len(keys) x len(candidates)]`` seconds, -1 where a candidate does
    not apply; timed once per class of tensors
    (:func:`hvd_compress.auto.planner.timing_class`: sizes within a factor 2,
    the same candidates usable), largest tensors first, the others scaled by
    their element count.  A two-phase candidate decodes two tensors' worth
    (the owner's chunk payloads, then the owned chunks:
    :func:`hvd_compress.costmodel.model.codec_seconds`), an allgather one ``size``
    payloads."""
    decodes = [min(size, 2) if getattr(c, "transport", "allgather") == "two_phase" else size for c in candidates]
    # a scheme timed once per number of decodes (at 2 ranks both transports decode 2)
    first = {}
    for j, c in enumerate(candidates):
        first.setdefault((id(c.scheme), decodes[j]), j)

    def time_class(numel, shape):
        timed = codec_seconds([c.scheme if applies(c, shape) and first[(id(c.scheme), decodes[j])] == j else None
                               for j, c in enumerate(candidates)], numel, shape, size, decodes=decodes)
        return [timed[first[(id(c.scheme), decodes[j])]] if applies(c, shape) else None
                for j, c in enumerate(candidates)]
    store = {}
    for key in sorted(keys, key=lambda k: -tensors[k][0]):  # a class is timed on its largest tensor
        timed_row(store, *tensors[key], candidates, applies, time_class)
    return [timed_row(store, *tensors[key], candidates, applies) for key in keys]


def average_over_ranks(values, version, process_set):
    """The element-wise mean over ranks of a list of floats (one allreduce)."""
    import horovod.torch as hvd
    x = torch.tensor(values, dtype=torch.float64)
    return hvd.allreduce(x, name=f"hvdc.auto.measure.{version}", op=hvd.Average,
                         process_set=process_set).tolist()


def broadcast_indices(indices, version, process_set):
    """Rank 0's candidate indices (one per tensor, sorted key order) on every rank."""
    import horovod.torch as hvd
    x = torch.tensor(indices, dtype=torch.int64)
    return hvd.broadcast(x, root_rank=0, name=f"hvdc.auto.plan.{version}", process_set=process_set).tolist()


def check_same_plan(labels, version, process_set):
    """Allgather a hash of the plan each rank is about to apply; raise
    :class:`~hvd_compress.auto.planner.PlanMismatchError` on every rank where any differs."""
    import horovod.torch as hvd
    mine = stable_hash(json.dumps(labels, sort_keys=True))
    hashes = hvd.allgather(torch.tensor([mine], dtype=torch.int64), name=f"hvdc.auto.plan_hash.{version}",
                           process_set=process_set).tolist()
    if any(h != hashes[0] for h in hashes):
        differ = [r for r, h in enumerate(hashes) if h != hashes[0]]
        raise PlanMismatchError(f"hvd_compress.Auto: ranks would apply different plans at plan version {version} "
                                f"(ranks {differ} differ from rank 0; plan hashes {hashes}); every rank must "
                                f"build the same Auto and see the same tensors")


def ready():
    """Whether Horovod runs (a direct call of ``plan_for`` outside training
    has nothing to probe: its calibration stays dense)."""
    try:
        import horovod.torch as hvd
        return bool(hvd.is_initialized())
    except (ImportError, ValueError):
        return False


def host_machine(version, process_set):
    """The host as the cost model sees it, the same on every rank: the most
    ranks sharing one machine's kernel sharing the fewest cores a rank has
    (:func:`hvd_compress.costmodel.machine.agreed_machine`; one allgather of each rank's
    :func:`~hvd_compress.costmodel.machine.this_rank`, named ``hvdc.auto.kernel.<version>``);
    ``LINK_ONLY`` where each rank has a core."""
    import horovod.torch as hvd
    from ..costmodel.machine import agreed_machine, this_rank
    rows = hvd.allgather(torch.tensor([this_rank(hvd.local_size())], dtype=torch.int64),
                         name=f"hvdc.auto.kernel.{version}", process_set=process_set).tolist()
    return agreed_machine(rows)


def world():
    """(process set, size, rank) of Auto's collectives: the global set."""
    import horovod.torch as hvd
    return hvd.global_process_set, hvd.size(), hvd.rank()
