"""The one cost model of hvd_compress: what a step's gradient exchange costs,
per tensor and per transport.  ``Auto``'s planner
(:mod:`hvd_compress.auto.planner`), ``hvd-compress advise``
(:mod:`hvd_compress.tools.advise`), the validation against measured rows
(``scripts/scale_model_check.py``) and the projection to large clusters
(``scripts/scale_projection.py``) all call this module; none keeps a formula
of its own.  Pure Python: numbers in, seconds and bytes out.

For one tensor whose payload (the bytes one rank hands to the collectives:
values, indices, scales) is ``p``, on ``N`` workers and a link of per-step
latency ``a`` and bandwidth ``B`` (bytes/s):

=============  ===========================  ====================================
transport      bytes each rank receives     latency steps (each ``a``)
=============  ===========================  ====================================
allreduce      ``2 (N-1)/N p`` (ring)       ``2 (N-1)``
allgather      ``(N-1) p``                  ``(N-1) (1 + length gathers)`` + ``2 (N-1)`` (placeholder allreduce)
two_phase      ``2 (N-1)/N p``              ``(N-1)`` alltoall + ``(N-1)`` allgather + ``2 (N-1)`` placeholder
powersgd       ``2 (N-1)/N p`` (P and Q)    ``2 x 2 (N-1)`` + ``2 (N-1)`` placeholder
=============  ===========================  ====================================

(two_phase: ``p`` is the sum of the ``N`` chunk payloads; powersgd: ``p`` is
both factors.)  On top of the link:

* **codec** -- error feedback + encode + decode.  The decode counts differ:
  allgather decodes all ``N`` payloads, two-phase decodes one tensor's worth
  twice (the owner's ``N`` chunk payloads, then the ``N`` owned chunks) and
  encodes ``1 + 1/N`` tensors' worth, allreduce and powersgd decode once;
* **the collective's own CPU work** -- Gloo sums and copies on the CPU: a
  cost per byte received, one constant for fp32 sums, one for fp16 sums
  (x86 CPUs have no native half-precision arithmetic) and one for the copies
  of gathered bytes (:class:`Machine`), zero to first order on GPUs with
  NCCL; and :data:`ENTRY_S` per collective a tensor enters (any device);
* **Horovod's cycle** -- a collective waits for the background thread's next
  cycle (``HOROVOD_CYCLE_TIME``, 1 ms by default), once per dependent round of
  a step: two-phase and PowerSGD issue a second round after the first
  completes, so a step with any of them waits ``Machine.cycle_s`` once more
  (per tensor, :attr:`TensorCost.rounds_s` charges that cycle to each such
  tensor: the conservative side for a per-tensor choice);
* **tensor fusion** -- Horovod fuses the allreduces of one cycle into buffers
  of up to ``HOROVOD_FUSION_THRESHOLD`` bytes (128 MiB by default): in a
  step, the allreduce latency is paid once per fusion buffer, not once per
  tensor (:func:`step_cost`).  Horovod fuses tensors of one dtype, the
  half-precision payloads among themselves.  The fp32 allreduces and the
  allgather and two-phase placeholders are one dtype but rarely one cycle:
  a dense gradient is handed to Horovod at its hook, a placeholder only after
  its tensor's encode, so a step that mixes them pays a round for each
  (:data:`PLACEHOLDER_GROUP`).  Horovod fuses the allgathers of a cycle too, the
  two-phase transport sends one alltoall and one allgather for all the
  tensors of a round, and PowerSGD launches a step's Q rounds together, so
  those rounds' latency is also paid once per step (per tensor,
  :attr:`TensorCost.marginal_s` keeps it: a tensor alone on its transport
  pays it in full; :mod:`hvd_compress.costmodel.step_plan` chooses for the step);
* **ranks sharing a host's cores** (:class:`Machine`) -- where ``R`` ranks
  share ``C`` cores (the emulated cluster), CPU work takes ``max(1, R/C)``
  times as long, and each ring step (each latency step above) waits
  ``core_wait_s x max(0, (R + L)/C - 1)`` for the next rank's turn on a core
  (``L``: runnable tasks of other work): the wait adds to the link's
  latency, and is shared as it is.  Default: no sharing, no wait;
* no overlap with the backward pass: an upper bound of the communication
  share of a step.

:func:`tensor_cost` gives one tensor's cost, :func:`step_cost` a step's
(fusion, cycle); ``Auto`` and ``advise`` choose by the step's.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, List, Optional, Tuple

#: the transports the model knows
TRANSPORTS = ("allreduce", "allgather", "two_phase", "powersgd")
#: the fusion group of the allgather and two-phase transports' fp32 placeholders:
#: apart from the dense fp32 allreduces, which reach Horovod at their hooks while a
#: placeholder waits for its tensor's encode.  Measured side by side on 8 emulated
#: hosts at 1 Gbit/s (4M-parameter MLP; ``hvd-compress bench scale --workers 8
#: --rates 1000``): Top-K 1% on every tensor 0.279 s a step, the same with the
#: tensors under 16384 elements dense 0.319 s.  PowerSGD's placeholders stay in the
#: dense tensors' group: its N = 8 rows (biases dense) fit within 7% that way and
#: 16-27% too high with a round of their own (``scripts/scale_model_check.py``)
PLACEHOLDER_GROUP = "float32:placeholder"
#: Horovod's defaults (horovodrun --help: --cycle-time-ms 1, --fusion-threshold-mb 128)
HOROVOD_CYCLE_S = 1e-3
HOROVOD_FUSION_BYTES = 128 * 1024 * 1024


@dataclass(frozen=True)
class Link:
    """A link: per-step latency (s) and bandwidth (bytes/s) of one rank."""
    latency_s: float
    bytes_per_s: float

#: a tensor's cost per collective it enters, besides its bytes: Horovod's
#: enqueue, negotiation and completion of one entry (median 16 us, 10-77 us,
#: 200 small tensors at a time on 2 ranks: ``scripts/collective_entry_cost.py``,
#: docs/results/collective_entry_cost.json); it keeps a tiny tensor dense
ENTRY_S = 16e-6


@dataclass(frozen=True)
class Machine:
    """What the collective itself costs on a machine, besides the link.

    ``reduce_s_per_byte``: CPU seconds per byte a rank receives in an fp32
    allreduce (the sums and the copies in and out of the fusion buffer);
    ``reduce_half_s_per_byte``: the same for fp16 payloads;
    ``gather_s_per_byte``: per byte received by an allgather or an alltoall
    (the copies into the output); ``cycle_s``: the wait for Horovod's next
    cycle, paid once per dependent round of collectives in a step;
    ``fusion_bytes``: Horovod's fusion buffer (0: no fusion)."""
    reduce_s_per_byte: float = 0.0
    reduce_half_s_per_byte: float = 0.0
    gather_s_per_byte: float = 0.0
    cycle_s: float = 0.0
    fusion_bytes: float = HOROVOD_FUSION_BYTES
    name: str = "link only"
    #: CPU cores the ranks of one host share; None (the default): each rank
    #: has cores of its own (a GPU cluster, one rank a GPU): no sharing
    cpus: Optional[int] = None
    #: ranks on one host sharing those cores; None: all ``workers`` (the
    #: emulated cluster: every rank on this one machine)
    ranks_per_host: Optional[int] = None
    #: runnable tasks of other work on the host (its load average without
    #: the ranks): they take turns on the cores too
    background_load: float = 0.0
    #: seconds a ring step waits for the next rank's turn on a core, per
    #: runnable task beyond one a core (:data:`CORE_WAIT_S`); only with ``cpus``
    core_wait_s: float = 0.0
    #: CPU seconds per collective a tensor enters (:func:`phases`), :data:`ENTRY_S`
    entry_s: float = ENTRY_S

    def ranks_sharing(self, workers) -> int:
        return int(self.ranks_per_host or workers)

    def cpu_share(self, workers) -> float:
        """How much longer CPU work takes with the ranks sharing the cores:
        ``max(1, R / C)``."""
        return 1.0 if not self.cpus else max(1.0, self.ranks_sharing(workers) / self.cpus)

    def step_wait_s(self, workers) -> float:
        """The wait of one ring step for the next rank's turn on a core:
        ``core_wait_s`` per runnable task beyond one a core,
        ``core_wait_s x max(0, (R + L) / C - 1)`` (0 without ``cpus``: a rank
        that has a core to itself runs when its data arrives)."""
        if not self.cpus or workers <= 1:
            return 0.0
        runnable = self.ranks_sharing(workers) + max(0.0, self.background_load)
        return self.core_wait_s * max(0.0, runnable / self.cpus - 1.0)


#: the link and each collective entry: what ``Auto`` uses on a host whose ranks
#: have cores of their own, whose link is fitted to allreduces it times (the fit
#: already holds the collective's CPU cost and the cycle)
LINK_ONLY = Machine()

#: a ring step's wait for a core per runnable task beyond one a core (``Machine.core_wait_s``):
#: fitted once to every bench scale row (emulated hosts sharing 2
#: cores): ``.venv/bin/python scripts/scale_model_check.py --fit``
CORE_WAIT_S = 1.5e-3


def shared_host(ranks_per_host, cpus, base: "Machine" = LINK_ONLY, background_load=0.0,
                core_wait_s=CORE_WAIT_S) -> "Machine":
    """``base`` on a host where ``ranks_per_host`` ranks share ``cpus`` cores:
    ``base`` itself where every rank has a core of its own (``ranks_per_host
    <= cpus``, or either unknown), else with the sharing and
    :data:`CORE_WAIT_S`."""
    from dataclasses import replace
    if not ranks_per_host or not cpus or ranks_per_host <= cpus:
        return base
    return replace(base, cpus=int(cpus), ranks_per_host=int(ranks_per_host),
                   background_load=float(background_load), core_wait_s=float(core_wait_s))


#: GPUs with NCCL (the projection): sums and copies run on the GPU at memory
#: bandwidth, negligible next to the network; Horovod's default cycle
GPU_NCCL = Machine(cycle_s=HOROVOD_CYCLE_S, name="GPU, NCCL")


def _check(workers, payload):
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"workers must be an integer >= 1; got {workers!r}")
    if payload is None or not payload >= 0:
        raise ValueError(f"payload must be a number of bytes >= 0; got {payload!r}")


def _transport(transport):
    if transport not in TRANSPORTS:
        raise ValueError(f"transport must be one of {TRANSPORTS}; got {transport!r}")
    return transport


def wire_bytes(transport, payload, workers) -> float:
    """Bytes each rank receives (and about as many sends) for one tensor."""
    _check(workers, payload)
    n = workers
    if n == 1:
        return 0.0
    if _transport(transport) == "allgather":
        return float(n - 1) * payload
    return 2.0 * (n - 1) / n * payload


def latency_steps(transport, workers, extra_allgathers=0) -> int:
    """Latency-bound steps of one tensor's collectives (see the table above)."""
    n1 = workers - 1
    if n1 <= 0:
        return 0
    t = _transport(transport)
    if t == "allreduce":
        return 2 * n1
    if t == "allgather":
        return n1 * (1 + extra_allgathers) + 2 * n1
    if t == "two_phase":
        return n1 + n1 + 2 * n1
    return 2 * 2 * n1 + 2 * n1  # powersgd: P, Q, and the placeholder


def rounds(transport) -> int:
    """Dependent rounds of collectives: the second waits for the first."""
    return 2 if _transport(transport) in ("two_phase", "powersgd") else 1


def phases(transport, extra_allgathers=0, half=False) -> Tuple[str, ...]:
    """The phases of collectives one tensor takes part in, by kind (each
    negotiated by Horovod and run as one ring or gather; a step's tensors
    share a phase of one kind): the fp32 allreduce (dense tensors, the
    allgather schemes' placeholders), ``allreduce:float16``, the allgather
    (and its length allgather where the payload's size varies), two-phase's
    alltoall and allgather, PowerSGD's P and Q allreduces."""
    t = _transport(transport)
    if t == "allreduce":
        return ("allreduce:float16",) if half else ("allreduce:float32",)
    if t == "allgather":
        return ("allreduce:float32", "allgather") + (("allgather:lengths",) if extra_allgathers else ())
    if t == "two_phase":
        return ("allreduce:float32", "two_phase:alltoall", "two_phase:allgather")
    return ("allreduce:float32", "powersgd:P", "powersgd:Q")


def comm_time(transport, payload, workers, bw, latency, extra_allgathers=0) -> Tuple[float, float]:
    """(bytes each rank receives, seconds on the link) of one tensor:
    ``latency_steps x latency + wire_bytes / bw``."""
    wire = wire_bytes(transport, payload, workers)
    if workers <= 1:
        return 0.0, 0.0
    return wire, latency_steps(transport, workers, extra_allgathers) * latency + wire / bw


def codec_seconds(transport, encode_s, decode_s, workers) -> float:
    """Error feedback + encode + decode seconds of one tensor per step, from
    one encode and one decode of the whole tensor (see the module docstring)."""
    n = workers
    t = _transport(transport)
    if t == "allgather":
        return encode_s + n * decode_s
    if t == "two_phase":
        return encode_s * (1.0 + 1.0 / n) + 2.0 * decode_s
    return encode_s + decode_s


def collective_cpu_seconds(transport, payload, workers, machine: Machine, half=False) -> float:
    """The collective's own CPU seconds (sums, copies) for one tensor."""
    wire = wire_bytes(transport, payload, workers) * machine.cpu_share(workers)
    if _transport(transport) in ("allreduce", "powersgd"):
        return wire * (machine.reduce_half_s_per_byte if half else machine.reduce_s_per_byte)
    return wire * machine.gather_s_per_byte


@dataclass(frozen=True)
class TensorCost:
    """One tensor's predicted cost per step under one scheme and transport."""
    transport: str
    payload_bytes: float
    wire_bytes: float
    link_s: float
    codec_s: float
    collective_s: float
    #: the extra rounds' wait for Horovod's cycle
    rounds_s: float
    #: the allreduce part's latency (the tensor itself, or the allgather's
    #: placeholder): what tensor fusion shares across a step's tensors
    fusable_latency_s: float = 0.0
    fusable_bytes: float = 0.0
    #: the fusion group of the fusable part: its dtype (Horovod fuses tensors of
    #: one dtype only), or :data:`PLACEHOLDER_GROUP` for a placeholder
    fusion_dtype: str = "float32"
    #: the latency of the tensor's rounds beyond its allreduce part (the
    #: allgathers, two-phase's alltoall and allgather, PowerSGD's P and Q),
    #: which a step shares across its tensors of one transport (Horovod fuses
    #: the collectives of one kind in a cycle; the two-phase transport sends
    #: one alltoall and one allgather for every tensor of a round; PowerSGD
    #: launches a step's Q rounds together): counted in full per tensor, once
    #: per step by :func:`step_cost`
    shared_latency_s: float = 0.0
    #: the phases of collectives the tensor takes part in (:func:`phases`)
    phases: Tuple[str, ...] = ()
    #: of ``link_s``, the ring steps' waits for a core (:meth:`Machine.step_wait_s`)
    wait_s: float = 0.0
    #: the share of each latency step that is the wait for a core
    wait_share: float = 0.0

    @property
    def total_s(self) -> float:
        return self.link_s + self.codec_s + self.collective_s + self.rounds_s

    @property
    def marginal_s(self) -> float:
        """What this tensor adds to a step whose fp32 allreduces (placeholders) Horovod fuses:
        the total less its allreduce part's latency (paid once per fusion
        buffer, :func:`step_cost`).  Every transport has one such part (the
        tensor's allreduce or the allgather's placeholder), so per-tensor
        comparisons of schemes use this; a half-precision payload keeps its
        latency (it shares a buffer only with other half-precision tensors,
        which a per-tensor choice cannot count on)."""
        return self.total_s - (self.fusable_latency_s if self.fusion_dtype != "float16" else 0.0)

    @property
    def own_s(self) -> float:
        """What only this tensor costs: the total less everything a step pays
        once per phase whoever takes part (the latencies fusion shares, with
        their waits for a core, and the extra round's cycle);
        :func:`hvd_compress.costmodel.step_plan.plan_step` adds those back per step."""
        return self.total_s - self.fusable_latency_s - self.shared_latency_s - self.rounds_s


def tensor_cost(transport, payload, workers, link: Link, machine: Machine = LINK_ONLY, encode_s=0.0,
                decode_s=0.0, codec_s=None, extra_allgathers=0, half=False) -> TensorCost:
    """One tensor's cost.  ``codec_s`` (seconds, as measured for this
    transport) replaces ``encode_s``/``decode_s`` where given."""
    waited = machine.step_wait_s(workers)
    link = Link(link.latency_s + waited, link.bytes_per_s)  # a ring step waits for the next rank's core
    wire, link_s = comm_time(transport, payload, workers, link.bytes_per_s, link.latency_s, extra_allgathers)
    codec = codec_seconds(transport, encode_s, decode_s, workers) if codec_s is None else float(codec_s)
    extra_rounds = rounds(transport) - 1 if workers > 1 else 0
    fusable = 2 * (workers - 1) * link.latency_s
    # Horovod fuses tensors of one dtype (half-precision payloads apart), and the
    # allgather schemes' placeholders come after their encodes, apart from the dense tensors
    if transport == "allreduce":
        dtype = "float16" if half else "float32"
    else:
        dtype = PLACEHOLDER_GROUP if transport in ("allgather", "two_phase") else "float32"
    gather = 0.0
    if transport != "allreduce" and workers > 1:
        gather = (latency_steps(transport, workers, extra_allgathers) - 2 * (workers - 1)) * link.latency_s
    kinds = phases(transport, extra_allgathers, dtype == "float16") if workers > 1 else ()
    share = waited / link.latency_s if link.latency_s > 0 else 0.0
    return TensorCost(transport, float(payload), wire, link_s, codec,
                      collective_cpu_seconds(transport, payload, workers, machine, half)
                      + len(kinds) * machine.entry_s * machine.cpu_share(workers),
                      extra_rounds * machine.cycle_s, fusable,
                      float(payload) if transport == "allreduce" else 4.0, dtype, gather,
                      kinds, latency_steps(transport, workers, extra_allgathers) * waited, share)


@dataclass(frozen=True)
class StepCost:
    """A step's predicted communication: the tensors' costs summed, less the
    latency tensor fusion saves, plus one cycle per step."""
    seconds: float
    wire_bytes: float
    payload_bytes: float
    link_s: float
    codec_s: float
    collective_s: float
    cycle_s: float
    fusion_saved_s: float
    tensors: List[TensorCost] = field(default_factory=list)
    #: ranks sharing cores: of ``seconds``, the ring steps' waits for a core
    #: (shared by fusion as the latency is; ``link_s`` is without them)
    wait_s: float = 0.0
    #: of the link's time (latency, waits and bytes), what the backward pass hid
    #: (``step_cost``'s ``backward_s``); not in ``seconds``
    hidden_s: float = 0.0


def step_cost(costs: Iterable[TensorCost], machine: Machine = LINK_ONLY, backward_s: float = 0.0) -> StepCost:
    """Sum of :func:`tensor_cost` over a step's tensors.  ``backward_s``: the
    seconds of backward pass during which the step's collectives already run
    (Horovod's hooks start each gradient's as it is ready); up to that much of
    the link's time hides behind it, the codecs' and the collectives' CPU work
    never (they run on the cores the backward pass uses), nor two-phase's
    rounds (launched together after the step's last compress).  Fusion: the
    allreduce parts of one fusion group (fp32 tensors, fp16 ones, placeholders) share fusion
    buffers of ``machine.fusion_bytes``, so their latency is paid once per
    buffer, and so do the allgathers, two-phase's and PowerSGD's rounds; the
    step waits one cycle of Horovod's per dependent round (two where any
    tensor travels two-phase or by PowerSGD: the tensors' second rounds
    share a cycle); where ranks share cores, the ring steps' waits for a core
    are in the latency, and shared with it."""
    costs = list(costs)
    if not costs:
        return StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, [])
    saved = 0.0
    for transport in ("allgather", "two_phase", "powersgd"):
        group = [c for c in costs if c.transport == transport and c.shared_latency_s > 0]
        if group and machine.fusion_bytes > 0:
            buffers = max(1, math.ceil(sum(c.payload_bytes for c in group) / machine.fusion_bytes))
            saved += max(0.0, sum(c.shared_latency_s for c in group)
                         - buffers * max(c.shared_latency_s for c in group))
    for dtype in sorted({c.fusion_dtype for c in costs}):
        fusable = [c for c in costs if c.fusable_latency_s > 0 and c.fusion_dtype == dtype]
        if fusable and machine.fusion_bytes > 0:
            buffers = max(1, math.ceil(sum(c.fusable_bytes for c in fusable) / machine.fusion_bytes))
            per = max(c.fusable_latency_s for c in fusable)
            saved += max(0.0, sum(c.fusable_latency_s for c in fusable) - buffers * per)
    cycle = machine.cycle_s * (1 + max(1 if c.rounds_s > 0 else 0 for c in costs))
    link_s = sum(c.link_s for c in costs)
    codec = sum(c.codec_s for c in costs)
    coll = sum(c.collective_s for c in costs)
    wait = sum(c.wait_s for c in costs) - saved * max(c.wait_share for c in costs)
    # Two-phase never hides: the torch transport launches a step's first rounds
    # together once every tensor of it has been compressed (one alltoall for
    # all, adapters.base.DeferredRounds), that is after the backward pass, and
    # the second rounds after those.
    after_backward = sum(c.link_s for c in costs if c.transport == "two_phase")
    hidden = min(max(0.0, backward_s), max(0.0, link_s - saved - after_backward))
    return StepCost(link_s - saved - hidden + codec + coll + cycle, sum(c.wire_bytes for c in costs),
                    sum(c.payload_bytes for c in costs), link_s - saved - wait, codec, coll, cycle, saved, costs,
                    wait, hidden)


def fit_constant(xs, ys) -> Optional[float]:
    """Least-squares slope through the origin of ``y = c x`` (None without data):
    how a global machine constant is fitted to measured rows."""
    xs, ys = list(xs), list(ys)
    den = sum(x * x for x in xs)
    if not xs or den <= 0:
        return None
    return max(0.0, sum(x * y for x, y in zip(xs, ys)) / den)
