"""TensorFlow side of :class:`hvd_compress.Auto`: measurements, agreement
and a plan that the traced step already holds, or that a retrace puts in.

Horovod traces ``compress`` once per trace of the step function, so Python
there cannot see the steps.  Instead, per tensor, the graph holds:

* a **mode** variable (checkpointed with the other state), read once the
  step's host callback has run, and, where the trace holds more than
  ``none``, a ``tf.switch_case`` over the modes the trace holds
  (:func:`traced_modes`): ``none`` without error feedback, the one-step
  ``none`` flush of a residual (where a plan or a quantized warmup made the
  tensor lossy), and lossy candidates with error feedback (one residual per
  tensor, shared by all lossy modes, so it carries across plan changes): the
  plan's, once a plan is in force, and before that the candidate the first
  decision is predicted to choose (:func:`predict_label`) and, during a
  warmup, the quantizer the tensor warms up with (:func:`warmup_label`).  A tensor whose trace holds
  ``none`` alone runs it without a switch, and only the host callback
  writes its mode variable.  TensorFlow traces, optimizes and instantiates
  every branch and every ``tf.cond`` as a function of its own, which is
  most of what a first step costs: a trace of every candidate for every
  tensor costs MobileNetV2's 158 tensors several times a fixed scheme's
  first step; instead, a plan whose modes a trace lacks has every
  ``tf.function`` holding these ops traced again at its next call
  (:func:`request_retrace`), which costs about a first step again, and the
  step that adopted it runs ``none`` where the mode is not traced yet.  So
  the first decision keeps the plan the trace holds (:func:`traced_plan`)
  unless a fresh one is predicted ``replan_threshold`` faster.

Once per step, in the function around Horovod's ``tf.cond`` of each
gradient (built at the first tensor's trace, and captured by every tensor's
branch, so every Auto op of the step waits for it):

* ``tf.timestamp()`` at each calibration step (the measured step time);
* a **host callback** (``tf.py_function``) behind one ``tf.cond`` that runs
  only at check steps (communication ``calibration_steps + 1``, then every
  ``recheck_every``) or after the plan variable changed outside a decision
  (a ``tf.train.Checkpoint`` restored after the trace: it asks for a retrace
  where a mode variable holds a mode its trace lacks).  At a check step it
  measures and agrees eagerly, before any of the step's gradient
  collectives of Auto's tensors: blocking Horovod allreduces of the probe
  sizes, one allreduce of the measurements, rank 0's plan broadcast, an
  allgathered hash of the plan and of every tensor's traced modes
  (:class:`~hvd_compress.auto.planner.PlanMismatchError` on every rank
  where any differs: no rank has issued a collective of Auto's tensors for
  that step), then writes every tensor's new mode into its variable and
  asks for a retrace where one is not traced (:func:`decide_at`).

Where a tensor's graph has no enclosing function (``compress`` called
outside Horovod's ``tf.cond``), each such tensor has a callback of its own
instead, behind its own ``tf.cond``, which returns its mode (the first of
the step's callbacks decides, the others wait for it), and the first tensor
takes the stamp.  A tensor behind a switch runs its mode's collectives in
the branch and hands Horovod a one-element placeholder of a fixed name; a
tensor whose trace holds ``none`` alone hands Horovod the tensor itself, as a
fixed ``NoCompression`` would, so Horovod fuses it with the step's other
dense tensors.  Every rank traces the same modes (the predictions' inputs
are agreed over ranks, below), and each tensor's traced modes are agreed at
the trace (:func:`agree_traced_modes`: one allgather per planned tensor, once
per change), so the names Horovod takes from them match.

At the first trace, eagerly while no step runs (inside ``tf.init_scope()``;
every rank traces the same call): each trace checks that every rank builds
it from the same plan (:func:`check_same_trace`); the first one probes the
link as PyTorch's first ``compress`` does (:func:`probe_at_first_trace`:
the early probe averaged over ranks, the agreed host); the codecs are timed
once per class of tensors (:func:`time_codecs`), each candidate as a compiled
``tf.function`` on random tensors of the real shapes (not at all where no
compressed candidate could pay on that link, :func:`lossy_may_pay`), and each class is
agreed by one allgather (:func:`agree_class_timing`: a hash of the class,
:class:`~hvd_compress.auto.planner.PlanMismatchError` on every rank where
ranks traced different tensors, else the ranks' average timings).  A
tensor's predicted mode therefore comes from inputs every rank shares, and
every rank traces the same modes: a rank running a lossy branch's
collectives where another runs ``none``'s would wait forever.  Running a
function from the callback, inside a running step, can wait forever for the
step's own executor threads, which is why the codecs are timed at the trace.

The plan itself (history, link, codec costs) is kept as JSON in a string
variable of :meth:`~hvd_compress.Compressor.tf_checkpointable`, so a
``tf.train.Checkpoint`` carries it and a resumed job keeps it.
"""
from __future__ import annotations

import json
import math
import threading
import weakref
import time
from dataclasses import dataclass, field, replace
from typing import Any

import tensorflow as tf

from .planner import NONE_LABEL, PlanMismatchError
from .probe import fastest_of
from ..compressor import Phase
from ..cross_rank import stable_hash
from ..schemes.base import EncodeContext
from ..adapters.tf_adapter import TFAdapter, tf_checkpoint_slot
from ..adapters.tf_traces import state_variable
from ..transports import RESOLVED, ResolvedPending
from ..transports.base import pending_fields

#: repetitions of each probe and codec timing; the minimum is kept
REPEATS = 3
#: codec repetitions chained in one compiled call
INNER = 5
#: modes 0 and 1; candidate ``j >= 1`` of ``Auto.candidates`` is mode ``j + 1``
PLAIN, FLUSH = 0, 1


class AutoModes(list):
    """The phases ``Auto.plan_for`` returns in TF: one per mode, chosen at run
    time by the mode variable (their ``start`` is unused)."""


def modes(auto):
    """``[none, none + flush, candidate 1 + feedback, ...]`` as Phases."""
    none = auto.candidates[0].scheme
    feedback = auto.feedback_memory
    out = AutoModes([Phase(0, none, auto.dense_memory, "allgather"), Phase(0, none, feedback, "allgather")])
    out += [Phase(0, c.scheme, feedback, "allgather") for c in auto.candidates[1:]]
    return out


def mode_for(auto, label, previous):
    """A tensor's mode under ``label``, given its mode before: ``none`` after
    a lossy mode flushes the residual for one step."""
    index = [c.label for c in auto.candidates].index(label)
    if index:
        return index + 1
    return FLUSH if previous > FLUSH else PLAIN


def is_check_step(step, steps_before_plan, recheck_every):
    """Whether communication ``step`` (1-based, a tensor) decides: the first
    after calibration (and warmup), then every ``recheck_every`` (0: never again)."""
    first = tf.constant(steps_before_plan + 1, tf.int64)
    if not recheck_every:
        return tf.equal(step, first)
    return tf.logical_and(step >= first, tf.equal(tf.math.floormod(step - first, recheck_every), 0))


def require_global_process_set(tensor):
    """As in PyTorch: Auto's collectives run on the global process set."""
    from ..integration import horovod_internals
    ps = horovod_internals.find_tf_caller(tensor).process_set
    if ps is not None and getattr(ps, "process_set_id", 0) != 0:
        raise NotImplementedError(f"hvd_compress.Auto supports the global process set only; this optimizer "
                                  f"reduces over process set {getattr(ps, 'process_set_id', ps)}: use a fixed "
                                  f"compressor or hvd_compress.Policy there")


# --- measurements and agreement (eager; called from the host callback) ---------------
def host_machine(version, process_set):
    """As :func:`hvd_compress.auto.calibration.host_machine`, in TensorFlow."""
    import horovod.tensorflow as hvd
    from ..costmodel.machine import agreed_machine, this_rank
    rows = hvd.allgather(tf.constant([this_rank(hvd.local_size())], tf.int64), name=f"hvdc.auto.kernel.{version}",
                         process_set=process_set, ignore_name_scope=True).numpy().tolist()
    return agreed_machine(rows)


def world():
    import horovod.tensorflow as hvd
    return hvd.global_process_set, hvd.size(), hvd.rank()


def _time_allreduces(numels, prefix, process_set):
    """As PyTorch's (:func:`hvd_compress.auto.calibration._time_allreduces`)."""
    import horovod.tensorflow as hvd
    out = []
    for numel in numels:
        x = tf.ones([int(numel)], tf.float32)

        def run(i):
            hvd.allreduce(x, name=f"{prefix}.{numel}.{i}", op=hvd.Sum, process_set=process_set,
                          ignore_name_scope=True).numpy()

        def agree_max(seconds):
            got = hvd.allreduce(tf.constant([seconds], tf.float64), name=f"{prefix}.{numel}.first", op=hvd.Max,
                                process_set=process_set, ignore_name_scope=True)
            return float(got.numpy()[0])
        out.append(fastest_of(run, REPEATS, agree_max))
    return out


def probe_link(numels, version, process_set):
    """Seconds of a blocking fp32 allreduce of each size (the fastest of up to
    :data:`REPEATS`, as PyTorch's), under names ``hvdc.auto.probe.<version>.<numel>.<i>``."""
    return _time_allreduces(numels, f"hvdc.auto.probe.{version}", process_set)


def probe_early(numels, process_set):
    """The same timings at the first trace, for the trace's predictions
    (names ``hvdc.auto.probe_early.<numel>.<i>``, as PyTorch's early probe)."""
    return _time_allreduces(numels, "hvdc.auto.probe_early", process_set)


def _codec_fn(B, scheme, shape, size, feedback):
    """A compiled function that runs :data:`INNER` chained error feedbacks
    (if ``feedback``) + encodes + decodes of one tensor of ``shape``, as the
    transport would run them in the step (``scheme`` None: nothing, the
    baseline of a call)."""
    ctx = EncodeContext(key="hvdc.auto.codec", step=1, rank=0, size=size, uniform=lambda n: tf.random.uniform([n]),
                        shared_seed=tf.constant(1, tf.int64), shape=tuple(shape), state={})

    @tf.function(autograph=False)
    def run(x, residual):
        if scheme is None:
            return residual

        def body(i, r):  # a loop, not INNER unrolled copies: one copy of the codec to trace
            return i + 1, tf.reshape(_codec_once(B, scheme, x, r, shape, size, ctx, feedback), tf.shape(r))
        return tf.while_loop(lambda i, r: i < INNER, body, [tf.constant(0), residual], parallel_iterations=1)[1]
    return run


def _codec_once(B, scheme, x, residual, shape, size, ctx, feedback):
    """One error feedback + encode + decode; the new residual (without
    feedback, the decoded tensor: it chains the repetitions all the same)."""
    acc = x + residual if feedback else residual
    if scheme.transport_for(shape) == "powersgd":
        n, m = scheme.matrix_shape(shape)
        p_local, matrix = scheme.first_round(B, acc, tf.random.normal([m, scheme.rank]), shape)
        p, q_local = scheme.second_round(B, p_local * size, matrix)
        sent = scheme.finish(B, p, q_local, q_local * size)[1]
    else:
        payload, sent = scheme.encode(B, acc, replace(ctx, need_sent=feedback))
        local = {k: v for k, v in payload.items() if k.startswith("_")}
        wire = {k: v for k, v in payload.items() if not k.startswith("_")}
        if scheme.transport_for(shape) == "allgather":
            out = scheme.aggregate(B, [wire] * size, B.numel(acc), local)
        else:
            out = scheme.decode_reduced(B, wire["reduce"], B.numel(acc), local)
        sent = out if sent is None else sent
    return acc - sent if feedback else sent


def _fused_or_eager_fn(B, scheme, numel, shape, size, feedback):
    """The timing function of what a step runs: the fused TF ops where the
    transports would use them (hvd_compress.codecs.tf_fused), else the eager code."""
    from ..kernels import native
    if native.enabled():
        from ..codecs.tf_fused import timing_fn
        fn = timing_fn(scheme, feedback, numel, shape, size, INNER)
        if fn is not None:
            return fn
    return _codec_fn(B, scheme, shape, size, feedback)


def codec_seconds(schemes, numel, shape, size, seed=0):
    """Seconds per tensor of each scheme's work (None: not timed), as
    ``calibration.codec_seconds`` in PyTorch: the schemes take turns, one
    warm-up round (which also compiles) then :data:`REPEATS` timed rounds,
    each keeping its minimum.  A call runs :data:`INNER` repetitions in one
    graph and the cost of an empty call is subtracted, so what is left is the
    in-graph cost that a step pays, not the call overhead of a function.
    ``none`` without feedback does no work beyond what every mode does (the
    gradient passes through): 0.0, not timed, where timing it would only
    add noise that can exceed the whole cost of a cast on a small tensor."""
    from ..backend import backend_for
    B = backend_for(tf.zeros([0]))
    x = tf.random.stateless_normal([int(numel)], seed=[seed, 1])
    feedback = [s is not None and s.name != "NoCompression" for s in schemes]
    free = [s is not None and not f for s, f in zip(schemes, feedback)]  # none: nothing to time
    fns = [_codec_fn(B, None, (), size, False)]  # the baseline: an empty call
    fns += [None if s is None or z else _fused_or_eager_fn(B, s, numel, tuple(shape), size, f)
            for s, f, z in zip(schemes, feedback, free)]
    starts = [x] + [tf.zeros_like(x) if f else x for f in feedback]  # chained: a residual, or the tensor
    best = [float("inf")] * len(fns)
    for i in range(REPEATS + 1):
        for j, fn in enumerate(fns):
            if fn is None:
                continue
            t0 = time.perf_counter()
            fn(x, starts[j]).numpy()
            if i:
                best[j] = min(best[j], time.perf_counter() - t0)
    return [0.0 if z else None if fn is None else max(0.0, b - best[0]) / INNER
            for fn, b, z in zip(fns[1:], best[1:], free)]


def codec_seconds_that_may_win(auto, numel, shape, size, usable):
    """:func:`codec_seconds` of the candidates that could carry one tensor
    best, None for the others (and for those not ``usable``).  First the
    candidates cheapest at no codec cost on the early probe's link and on
    one :data:`TIMING_LINK_MARGIN` times slower are timed; then every other
    candidate whose cost on that tensor, at no codec cost, is below the best
    timed one's on either link.  A candidate that loses even with a free
    codec is not worth the seconds its timing costs at the first trace (on
    a slow link FP16 and Int8 lose to Top-K's bytes whatever they cost).
    ``none`` is not a rival here: the step's plan may move a tensor off it
    to save a round (:func:`predict_label`).  Without an early probe, every
    usable candidate is timed."""
    from .planner import tensor_options
    cands = auto.candidates
    schemes = [c.scheme if usable(c, shape) else None for c in cands]
    lossy = [c.label for c, sch in zip(cands[1:], schemes[1:]) if sch is not None]
    state = auto.plan_state
    if state.early_link is None or len(lossy) < 2:
        return codec_seconds(schemes, numel, shape, size)
    links = [_early_link(auto, size), _early_link(auto, size, TIMING_LINK_MARGIN)]

    def costs(link, codec_s):  # {label: the tensor's own seconds a step} of the lossy candidates
        opts = tensor_options(numel, shape, size, link, cands, codec_s, state.machine)
        return {label: opts[label].marginal_s for label in codec_s if label in opts and label != NONE_LABEL}
    free = [costs(link, {label: 0.0 for label in lossy}) for link in links]
    first = {min(f, key=f.get) for f in free if f}
    got = {}

    def time_these(labels):
        seconds = codec_seconds([sch if c.label in labels else None for c, sch in zip(cands, schemes)], numel,
                                shape, size)
        got.update({c.label: t for c, t in zip(cands, seconds) if c.label in labels and t is not None})
    time_these(first)
    best = [min(costs(link, got).values(), default=math.inf) for link in links]
    time_these({label for label in lossy if label not in got
                and any(label in f and f[label] < b for f, b in zip(free, best))})
    return [0.0 if c.label == NONE_LABEL else got.get(c.label) for c in cands]


def add_check_seconds(auto, part, seconds):
    """Add ``seconds`` to ``part`` of the plan state's ``check_seconds`` (what
    ``bench models`` reports as Auto's start-up)."""
    spent = auto.plan_state.check_seconds = auto.plan_state.check_seconds or {}
    spent[part] = spent.get(part, 0.0) + seconds


def time_codecs(auto, key, size, timings, process_set):
    """At the trace (eagerly, while no step runs): each usable candidate's
    cost on this tensor, timed once per class of tensors
    (:func:`hvd_compress.auto.planner.timed_row`), agreed over ranks
    (:func:`agree_class_timing`) and kept in ``timings`` for the trace's
    prediction and the first decision (nothing to time where the Auto has
    fixed ``codec_costs``).  Timing them later, inside the host callback of a
    running step, would need the step's own executor threads and can deadlock."""
    from .planner import codec_usable, timed_row, timing_class
    if auto.codec_costs is not None:
        return
    usable = codec_usable(True)  # the two-phase candidates are not timed: TensorFlow plans allgather only
    run = auto.adapters["tensorflow"].run

    def time_class(numel, shape):
        t0 = time.perf_counter()
        with tf.init_scope():
            if lossy_may_pay(auto, key, size):
                mine = codec_seconds_that_may_win(auto, numel, shape, size, usable)
            else:  # dense whatever its codecs cost: nothing to time, but the class is still agreed
                run.classes_not_timed += 1
                mine = [0.0 if c.label == NONE_LABEL else None for c in auto.candidates]
            t1 = time.perf_counter()
            out = agree_class_timing(run, timing_class(numel, shape, auto.candidates, usable), numel, mine,
                                     process_set)
        add_check_seconds(auto, "trace_codecs", t1 - t0)
        add_check_seconds(auto, "trace_agree", time.perf_counter() - t1)
        return out
    timed_row(timings, *auto.plan_state.tensors[key], auto.candidates, usable, time_class)


def class_timing_row(cls, numel, seconds):
    """What a rank sends for a class timed at the trace: a hash of the class
    and the tensor timed (in two exact float64 halves) and its timings (-1:
    not timed)."""
    mine = stable_hash(json.dumps([int(cls[0]), [bool(f) for f in cls[1]], int(numel), len(seconds)]))
    return [float(mine >> 32), float(mine & 0xFFFF_FFFF)] + [-1.0 if t is None else float(t) for t in seconds]


def agreed_class_timing(rows, index):
    """The ranks' rows of :func:`class_timing_row` (in rank order): every
    timing's average over ranks (None where not timed), the same on every rank
    that has the same rows; :class:`~hvd_compress.auto.planner.PlanMismatchError`
    where any rank's class differs from rank 0's."""
    differ = [r for r, row in enumerate(rows) if row[:2] != rows[0][:2]]
    if differ:
        raise PlanMismatchError(f"hvd_compress.Auto: ranks traced different tensors: codec timing class {index} "
                                f"of this Auto differs on ranks {differ} from rank 0's; every rank must build "
                                f"the same model and Auto and trace the same step")
    return [None if rows[0][j] < 0 else sum(row[j] for row in rows) / len(rows) for j in range(2, len(rows[0]))]


def agree_class_timing(run, cls, numel, seconds, process_set):
    """One allgather per class timed at the trace, named by the class's place
    in this Auto's trace order (``hvdc.auto.trace_codecs.<n>``): every rank
    must have traced the same class there, and every rank keeps the ranks'
    average of the timings (:func:`agreed_class_timing`).  So the trace's
    predictions, and the modes they put into it, are the same on every rank;
    timings of one rank alone would differ and a rank tracing a lossy mode
    the others lack would wait on their collectives forever."""
    import horovod.tensorflow as hvd
    index = run.classes_agreed
    run.classes_agreed += 1
    rows = hvd.allgather(tf.constant([class_timing_row(cls, numel, seconds)], tf.float64),
                         name=f"hvdc.auto.trace_codecs.{index}", process_set=process_set,
                         ignore_name_scope=True).numpy().tolist()
    return agreed_class_timing(rows, index)


def average_over_ranks(values, version, process_set):
    import horovod.tensorflow as hvd
    x = tf.constant(values, tf.float64)
    return hvd.allreduce(x, name=f"hvdc.auto.measure.{version}", op=hvd.Average, process_set=process_set,
                         ignore_name_scope=True).numpy().tolist()


def broadcast_indices(indices, version, process_set):
    import horovod.tensorflow as hvd
    x = tf.constant(indices, tf.int64)
    return hvd.broadcast(x, root_rank=0, name=f"hvdc.auto.plan.{version}", process_set=process_set,
                         ignore_name_scope=True).numpy().tolist()


def check_same_plan(labels, version, process_set):
    """Allgather a hash of each rank's plan; PlanMismatchError on every rank if any differs."""
    import horovod.tensorflow as hvd
    mine = stable_hash(json.dumps(labels, sort_keys=True))
    hashes = hvd.allgather(tf.constant([mine], tf.int64), name=f"hvdc.auto.plan_hash.{version}",
                           process_set=process_set, ignore_name_scope=True).numpy().tolist()
    if any(h != hashes[0] for h in hashes):
        differ = [r for r, h in enumerate(hashes) if h != hashes[0]]
        raise PlanMismatchError(f"hvd_compress.Auto: ranks would apply different plans at plan version {version} "
                                f"(ranks {differ} differ from rank 0; plan hashes {hashes}); every rank must "
                                f"build the same Auto and see the same tensors")


class Calibration:
    """What ``Auto.decide`` calls, in TensorFlow (:mod:`hvd_compress.auto.calibration` in PyTorch).
    ``traced``: {key: the modes its latest trace holds}."""

    world = staticmethod(world)
    probe_link = staticmethod(lambda *a: probe_link(*a))  # looked up at call time: tests replace it
    probe_early = staticmethod(lambda *a: probe_early(*a))  # the same
    host_machine = staticmethod(lambda *a: host_machine(*a))  # the same
    average_over_ranks = staticmethod(average_over_ranks)
    broadcast_indices = staticmethod(broadcast_indices)

    def __init__(self, timings, traced=None):
        self.timings = timings
        self.traced = traced or {}

    def check_same_plan(self, labels, version, process_set):
        """The plan to adopt and the modes each tensor's trace holds must be
        every rank's.  The modes are checked here, before a plan is adopted,
        not at the trace: a trace adds each tensor's predicted mode as it
        reaches it, so the whole map exists only after the trace, and until a
        check step returns a mode every rank runs ``none`` (branch 0 of every
        trace) whatever else its trace holds."""
        traced = {k: list(v) for k, v in self.traced.items()}
        check_same_plan({"plan": labels, "traced_modes": traced}, version, process_set)

    def measure_codecs(self, tensors, keys, candidates, size, usable):
        """The rows :func:`time_codecs` measured at the trace, in ``keys`` order."""
        from .planner import timed_row
        return [timed_row(self.timings, *tensors[k], candidates, usable) for k in keys]


# --- the host callback ------------------------------------------------------------------
def sync_plan(auto):
    """Load the plan from the TF variable where it differs from the one this
    object last wrote or read (a restored ``tf.train.Checkpoint``)."""
    adapter = auto.adapters.get("tensorflow")
    if adapter is None:
        return
    saved = adapter.run.plan_var.numpy().decode()
    if saved and saved != auto.plan_state.synced_json:
        auto.plan_state = type(auto.plan_state).from_json(json.loads(saved))
        auto.plan_state.synced_json = saved


def publish_plan(auto):
    """Write the plan to the TF variable (checkpointed with the residuals)."""
    adapter = auto.adapters.get("tensorflow")
    if adapter is not None:
        auto.plan_state.synced_json = json.dumps(auto.plan_state.to_json())
        adapter.run.plan_var.assign(auto.plan_state.synced_json)


# --- which modes a trace holds -----------------------------------------------------------
def traced_modes(auto, key, predicted=NONE_LABEL):
    """The modes a trace of ``key`` holds: ``none``; its flush, where a plan
    adopted so far or a quantized warmup made it lossy (only a lossy mode
    leaves a residual); and the mode of the plan in force, if lossy, else
    (before the first plan) the ``predicted`` one (:func:`predict_label`), if
    lossy, and the warmup's quantizer (:func:`warmup_label`), if any.  A trace of every
    candidate behind the switch (hundreds of tensors x every candidate) costs
    several times a fixed scheme's first step; a plan that needs a mode not
    traced has the step traced again (:func:`request_retrace`), which costs
    about as much again."""
    history = auto.plan_state.history
    choice = (auto.plan_state.in_force() or {}).get(key)
    warmup = auto.plan_state.provisional.get(key, NONE_LABEL)
    wanted = (predicted, warmup) if not history else (NONE_LABEL if choice is None else choice.label,)
    labels = [c.label for c in auto.candidates]
    lossy_before = warmup != NONE_LABEL or any(key in choices and choices[key].label != NONE_LABEL
                                               for _, choices, _ in history)
    return ((PLAIN,) + ((FLUSH,) if lossy_before else ())
            + tuple(sorted({labels.index(label) + 1 for label in wanted if label in labels[1:]})))


def warmup_label(auto, key, size):
    """Before the first plan, at the trace: the quantizer ``key`` warms up
    with (``Auto(warmup_with=...)`` during ``warmup_steps``), chosen as
    PyTorch's first ``compress`` chooses it
    (:func:`~hvd_compress.auto.provisional.provisional_choice` on the early
    probe's link, among that warmup's quantizers by allgather: TensorFlow's
    Auto runs no two-phase candidate); ``none`` where a plain allreduce does not clearly
    lose, outside a warmup, or before the early probe.  Made once a tensor
    and kept in the plan state (``provisional``, checkpointed with the plan);
    its inputs are agreed over ranks, so every rank traces the same modes."""
    state = auto.plan_state
    if key not in state.provisional:
        label = NONE_LABEL
        if state.warmup and not state.history and state.early_link is not None:
            numel, shape = state.tensors[key]
            label = auto.warmup_choice(numel, shape, size, state.early_link, two_phase=False)
        state.provisional[key] = label
    return state.provisional[key]


def probe_at_first_trace(auto, process_set, size):
    """At the first trace, before any plan (eagerly; every rank traces the
    same call): the early probe PyTorch makes at its first ``compress``
    (:data:`~hvd_compress.auto.probe.EARLY_PROBE_NUMELS`, averaged over ranks)
    and the agreed host, kept in the plan state for :func:`predict_label`."""
    state = auto.plan_state
    if state.early_link is not None or state.history:
        return
    from .planner import fit_link
    from .probe import EARLY_PROBE_NUMELS
    t0 = time.perf_counter()
    with tf.init_scope():
        probes = Calibration.probe_early(EARLY_PROBE_NUMELS, process_set)
        avg = average_over_ranks(probes, "early", process_set)
        state.machine = Calibration.host_machine("early", process_set)
    state.early_link = fit_link([4 * n for n in EARLY_PROBE_NUMELS], avg, size)
    add_check_seconds(auto, "early_probe", time.perf_counter() - t0)


def _early_link(auto, size, slower=1.0):
    """The early probe's link as the planner sees it (with the wait floor of
    ranks sharing cores), ``slower`` times its bandwidth less."""
    from ..costmodel.machine import with_wait_floor
    from ..costmodel.model import Link
    state = auto.plan_state
    link = with_wait_floor(state.early_link, state.machine, size)
    return Link(link.latency_s, link.bytes_per_s / slower)


def _early_plan(auto, size, codec_s, slower=1.0):
    """The plan of the tensors traced so far (``state.tensors``, in trace order)
    on :func:`_early_link`, with ``codec_s`` ({key: {label: seconds}}): what
    the first decision would choose, from what the trace knows."""
    from .planner import plan
    state = auto.plan_state
    return plan(dict(state.tensors), size, _early_link(auto, size, slower), auto.candidates, codec_s, (),
                auto.min_gain, state.machine)


#: a tensor's codecs are timed at the trace only where a compressed candidate
#: could carry it, at no codec cost, on a link this many times slower than the
#: early probe's (:func:`lossy_may_pay`)
TIMING_LINK_MARGIN = 4.0


def lossy_may_pay(auto, key, size):
    """Whether the first decision could give ``key`` a compressed candidate:
    whether :func:`_early_plan` does, with every codec free, on a link
    :data:`TIMING_LINK_MARGIN` times slower than the early probe's.  Where it
    cannot (a fast link: dense rounds cost latency alone), timing the codecs
    at the trace would cost seconds of the first step for nothing, so the
    class is not timed and its tensors stay dense for the rest of the job
    (TensorFlow cannot time them later: see the module docstring).  Its
    inputs are agreed over ranks (the averaged probe, the agreed host), so
    every rank times the same classes; each class, timed or not, is still
    agreed (:func:`agree_class_timing`), which is where ranks that traced
    different tensors find out."""
    from .planner import codec_usable
    if auto.plan_state.early_link is None:
        return True
    usable = codec_usable(True)
    free = {k: {c.label: 0.0 for c in auto.candidates if usable(c, shape)}
            for k, (_, shape) in auto.plan_state.tensors.items()}
    return _early_plan(auto, size, free, TIMING_LINK_MARGIN)[key].label != NONE_LABEL


def predict_label(auto, key, size, timings):
    """Before the first plan, at the trace: the candidate the first decision
    is likely to give ``key``, so that the trace holds it and that decision
    needs no retrace: its label in :func:`_early_plan` of the tensors traced
    so far, with the agreed codec costs.  The step's plan, not the tensor's
    own best (:func:`~hvd_compress.auto.planner.choose`): a small tensor
    that joins the others' compressed round, to save a dense round of its own,
    was predicted dense and asked for a retrace at the decision.  Its inputs
    are agreed over ranks (the averaged probe, the agreed host,
    :func:`agree_class_timing`), so every rank predicts, and traces, the same
    modes."""
    from .planner import codec_table
    state = auto.plan_state
    if state.history or state.early_link is None:
        return NONE_LABEL
    keys = list(state.tensors)
    rows = codec_table(state.tensors, keys, auto.candidates, size, True, auto.codec_costs,
                       Calibration(timings).measure_codecs)
    codec_s = {k: {c.label: v for c, v in zip(auto.candidates, row) if v >= 0} for k, row in zip(keys, rows)}
    return _early_plan(auto, size, codec_s)[key].label


def traced_plan(auto, keys, size):
    """The plan without a retrace: :func:`~hvd_compress.auto.planner.plan` on
    the measured link and codec costs with each tensor's choices limited to
    the modes its trace holds (``none`` or its traced lossy mode).  The first
    decision compares a fresh plan with it (``Auto._propose``), as a re-check
    compares with the plan in force: a retrace costs about a whole first step."""
    from .planner import plan
    state, run = auto.plan_state, auto.adapters["tensorflow"].run
    labels = [c.label for c in auto.candidates]
    codec_s = {}
    for key in keys:
        held = {NONE_LABEL} | {labels[m - 1] for m in run.traced.get(key, ()) if m > FLUSH}
        codec_s[key] = {label: v for label, v in state.codec_s.get(key, {}).items() if label in held}
    return plan({k: state.tensors[k] for k in keys}, size, state.link, auto.candidates, codec_s, (), auto.min_gain,
                state.machine, state.backward_s)


#: the steps a plan's saving is counted over when a retrace must pay for itself
#: (:func:`retrace_pays`): the job's length is unknown, and a plan that wins on
#: the link seen at the first decision usually stays in force past later checks
RETRACE_HORIZON_STEPS = 1000


def needs_retrace(auto, choices):
    """Whether a plan ``{key: Choice}`` needs a mode some tensor's trace lacks."""
    return not all_traced(auto.adapters["tensorflow"].run,
                          {k: mode_for(auto, c.label, PLAIN) for k, c in choices.items()})


def retrace_pays(auto, current, fresh, keys, size):
    """Whether the plan ``fresh`` is worth a retrace over ``current`` (the plan
    the trace holds), at the first decision: its predicted saving a step, over
    :data:`RETRACE_HORIZON_STEPS` steps, must exceed what the first trace cost (:meth:`AutoTFRun.trace_seconds`): on
    MobileNetV2 a retrace costs as much as 150 of its steps, more than a plan a
    few percent faster saves in 1000.  Auto's own probe and codec timings at
    the first trace are not counted: a retrace does not repeat them.  Both numbers are kept in
    ``check_seconds`` (``retrace_s``, ``retrace_saving_s``)."""
    from .planner import predicted_total
    state, run = auto.plan_state, auto.adapters["tensorflow"].run
    tensors = {k: state.tensors[k] for k in keys}

    def total(choices):
        return predicted_total(choices, tensors, size, state.link, auto.candidates, state.codec_s, state.machine,
                               state.backward_s)
    saving = (total(current) - total(fresh)) * RETRACE_HORIZON_STEPS
    # a retrace repeats the trace, not Auto's probe and codec timings at it
    spent = state.check_seconds or {}
    cost = max(0.0, run.trace_seconds() - sum(spent.get(k, 0.0) for k in ("early_probe", "trace_codecs",
                                                                          "trace_agree")))
    state.check_seconds = {**(state.check_seconds or {}), "retrace_s": cost, "retrace_saving_s": saving}
    return saving > cost


def branch_of_mode(modes_traced, count):
    """``[branch index of mode m]`` for every mode ``m < count``: a mode the
    trace lacks runs ``none`` (branch 0, without error feedback: the residual
    waits, nothing is lost) until the retrace it asked for."""
    return [modes_traced.index(m) if m in modes_traced else 0 for m in range(count)]


def request_retrace(auto):
    """Make every ``tf.function`` holding hvd_compress's ops (the user's step,
    Horovod's allreduce function, Keras' ``train_function``) trace again at
    its next call, so that the next step's trace holds the plan in force."""
    from ..adapters.tf_traces import drop_traces, functions_holding_our_ops
    t0 = time.perf_counter()
    for function in functions_holding_our_ops():
        drop_traces(function)
    add_check_seconds(auto, "retrace_request", time.perf_counter() - t0)


def check_same_trace(auto, run, process_set):
    """At each trace of the first tensor (eagerly: every rank traces the same
    call): the plan the trace is built from must be every rank's, else their
    branches' collectives would differ and wait on each other forever."""
    run.traces += 1
    labels = {k: c.label for k, c in (auto.plan_state.in_force() or {}).items()}
    with tf.init_scope():
        check_same_plan(labels, f"trace.{run.traces}", process_set)


def settle_step(auto, step, check):
    """The first host callback of communication ``step`` on each rank; the
    step's other callbacks wait for it and reuse what it did.  At a check
    step it decides (:func:`decide_at`: collectives, the same on every rank),
    else it takes up a plan restored after the trace (:func:`check_restored`).
    An error is raised again, without collectives, by the step's other callbacks."""
    run = auto.adapters["tensorflow"].run
    with run.lock:
        if run.decided != step:
            run.decided, run.error = step, None
            try:
                decide_at(auto, step) if check else check_restored(auto)
            except Exception as err:  # noqa: BLE001 - kept, raised again below
                run.error = err
                raise
        if run.error is not None:
            raise RuntimeError(f"hvd_compress.Auto: this step's plan failed: {run.error!r}")


def decide_at(auto, step):
    """Check step ``step``: measure, agree and maybe adopt a plan; every
    tensor's mode variable gets its new mode before any op of the step reads
    it (the step's Auto ops wait for this callback), and a plan needing a
    mode some tensor's trace lacks (a lossy mode, or the flush after one) has
    the step traced again: until then such a tensor runs ``none``."""
    run = auto.adapters["tensorflow"].run
    sync_plan(auto)
    auto.decide(step - 1, Calibration(run.codec_timings, run.traced), run.step_times())
    publish_plan(auto)
    run.new_modes = next_modes(auto, run)
    for key, mode in run.new_modes.items():
        if key in run.mode_vars:
            run.mode_vars[key].assign(float(mode))
    if not all_traced(run, run.new_modes):
        run.retrace_asked = len(auto.plan_state.history)
        auto.plan_state.check_seconds.setdefault("retraced_plans", []).append(run.retrace_asked - 1)
        request_retrace(auto)
    run.plan_seen.assign(run.plan_var.read_value())


def next_modes(auto, run):
    """{key: its mode from this step on}: its mode under the plan in force,
    after the mode its variable holds (``none`` after a lossy mode: the flush)."""
    plan = auto.plan_state.in_force() or {}
    now = current_modes(run)
    return {k: mode_for(auto, plan[k].label if k in plan else NONE_LABEL, now.get(k, PLAIN))
            for k in sorted(set(plan) | set(now))}


def current_modes(run):
    """{key: the mode its variable holds} (eagerly)."""
    return {k: int(v.numpy()) for k, v in run.mode_vars.items()}


def all_traced(run, modes_by_key):
    """Whether every key's mode is among the modes its latest trace holds."""
    return all(m in run.traced.get(k, (PLAIN,)) for k, m in modes_by_key.items())


def agree_traced_modes(run, key, held, process_set):
    """At the trace (eagerly), each time a tensor's traced modes change: every
    rank must trace the same modes, else
    :class:`~hvd_compress.auto.planner.PlanMismatchError` on every rank
    before the step runs.  A tensor whose trace holds ``none`` alone
    hands Horovod the tensor itself, where a switch hands it a placeholder
    (whose allreduce TensorFlow's constant folding runs while it optimizes
    the graph) and runs its own collectives: traces that differ would wait on
    each other's collectives forever.  The predictions' inputs are agreed
    over ranks, so traces differ only where ranks built different steps.
    Named by how many such agreements came before (every rank traces the
    same tensors in the same order), so ranks that traced different tensors
    still meet, and raise."""
    index = run.modes_agreed
    run.modes_agreed += 1
    with tf.init_scope():  # eagerly, as check_same_trace: the allgather runs now, not in the traced step
        check_same_plan({"key": key, "traced_modes": list(held)}, f"traced.{index}", process_set)
    run.agreed[key] = held


def check_restored(auto):
    """A step after the plan variable changed outside a decision (a
    ``tf.train.Checkpoint`` restored after the trace, ``load_state_dict``):
    take the plan up and, once per plan, ask for a retrace where a mode
    variable holds a mode its trace lacks (it runs ``none`` until then)."""
    run = auto.adapters["tensorflow"].run
    sync_plan(auto)
    if not all_traced(run, current_modes(run)) and run.retrace_asked != len(auto.plan_state.history):
        run.retrace_asked = len(auto.plan_state.history)
        request_retrace(auto)
    run.plan_seen.assign(run.plan_var.read_value())


def tensor_mode(auto, key, step, check, previous):
    """The host callback of ``key`` where its step has no shared one
    (:meth:`AutoTFAdapter._step_token`): its mode from this step on."""
    step, check, previous = int(step.numpy()), bool(check.numpy()), int(previous.numpy())
    settle_step(auto, step, check)
    return tf.constant(auto.adapters["tensorflow"].run.new_modes.get(key, previous) if check else previous,
                       tf.int32)


def step_callback(auto, step, check):
    """The host callback shared by every tensor of a step (:meth:`AutoTFAdapter._step_token`)."""
    settle_step(auto, int(step.numpy()), bool(check.numpy()))
    return tf.constant(0, tf.int32)


@dataclass(eq=False)
class AutoTFRun:
    """Auto's TensorFlow run state, one object on its adapter: the plan
    variable (checkpointed) and the plan last decided or taken up here (not
    checkpointed: a restored plan differs from it), the per-tensor mode
    variables and calibration stamps, the host callbacks' lock, the check
    step decided last, its error and its modes, and this rank's codec timings
    by class of tensors (:func:`hvd_compress.auto.planner.timed_row`), made at
    the trace and kept across resets: the graph is not traced again."""
    plan_var: Any
    plan_seen: Any
    lock: Any = field(default_factory=threading.Lock)
    codec_timings: dict = field(default_factory=dict)
    mode_vars: dict = field(default_factory=dict)
    timestamps: Any = None
    decided: Any = None
    error: Any = None
    #: enclosing function graph -> the name of its step's callback token (:meth:`AutoTFAdapter._step_token`)
    step_tokens: Any = field(default_factory=weakref.WeakKeyDictionary)
    #: key -> its mode from the last check step on (:func:`next_modes`)
    new_modes: dict = field(default_factory=dict)
    #: key -> the modes its latest trace holds (:func:`traced_modes`)
    traced: dict = field(default_factory=dict)
    #: traces of the first tensor so far (names the check of each); the plan (its index in the history)
    #: for which a retrace was asked last
    traces: int = 0
    retrace_asked: Any = None
    #: classes of ``codec_timings`` agreed so far (names the allgather of the next, :func:`agree_class_timing`)
    classes_agreed: int = 0
    #: wall clock (``time.time()``, as ``tf.timestamp()``) at Auto's first ``compress`` at the first trace
    trace_started: Any = None
    #: key -> the label :func:`predict_label` gave it at its first trace: every later trace before the
    #: first plan holds the same modes (a trace predicts from the tensors traced before it, and every
    #: trace a rank may run must issue the same collectives as every other rank's)
    predicted: dict = field(default_factory=dict)
    #: classes of tensors whose codecs were not timed at the trace (:func:`lossy_may_pay`)
    classes_not_timed: int = 0
    #: key -> the traced modes agreed over ranks last (:func:`agree_traced_modes`), and how many agreements ran
    agreed: dict = field(default_factory=dict)
    modes_agreed: int = 0

    def restart(self):
        """After an elastic reset: nothing decided, every variable zero."""
        self.decided = self.error = self.retrace_asked = None
        self.new_modes, self.predicted, self.agreed = {}, {}, {}
        self.plan_var.assign("")
        self.plan_seen.assign("")
        for v in list(self.mode_vars.values()) + ([self.timestamps] if self.timestamps is not None else []):
            v.assign(tf.zeros_like(v))

    def trace_seconds(self):
        """What the first trace of the step cost, about: from Auto's first
        ``compress`` at the trace (``trace_started``, wall clock) to the first
        step's stamp; 0 where either is unknown (a restored plan, a trace
        before the stamps)."""
        stamps = self.step_times()
        if self.trace_started is None or not stamps:
            return 0.0
        return max(0.0, stamps[0] - self.trace_started)

    def step_times(self):
        """perf-counter-like stamps of the calibration steps recorded so far."""
        if self.timestamps is None:
            return []
        stamps = self.timestamps.numpy().tolist()
        end = next((i for i, t in enumerate(stamps) if t <= 0), len(stamps))
        return stamps[:end]  # up to the first step not stamped yet


class AutoTFAdapter(TFAdapter):
    """The TF adapter with Auto's run-time mode switch (see the module docstring)."""

    def reset(self):
        super().reset()
        if getattr(self, "run", None) is None:
            self.run = AutoTFRun(state_variable("", tf.string, name="hvdc_auto_plan"),
                                 state_variable("", tf.string, name="hvdc_auto_plan_seen"))
            self.state_module.auto_plan = self.run.plan_var
        else:
            self.run.restart()

    def _stamp(self, auto, step):
        """``tf.timestamp()`` of the calibration steps (the first tensor's)."""
        n = auto.calibration_steps + 1
        if self.run.timestamps is None:
            self.run.timestamps = state_variable(lambda: tf.zeros([n], tf.float64), tf.float64, name="hvdc_auto_stamps")
        index = tf.minimum(step - 1, n - 1)
        value = tf.where(step <= n, tf.timestamp(), tf.gather(self.run.timestamps, index))
        return self.run.timestamps.scatter_nd_update(tf.reshape(index, [1, 1]), tf.reshape(value, [1]))

    def _asks(self, auto, step, first):
        """(whether the host callback runs at communication ``step``: a check
        step, or, for the ``first`` callback of a step, a plan restored since
        the last callback; whether it is a check step)."""
        check = is_check_step(step, auto.steps_before_plan, auto.recheck_every)
        if not first:
            return check, check
        restored = tf.not_equal(self.run.plan_var.read_value(), self.run.plan_seen.read_value())
        return tf.logical_or(check, restored), check

    def _step_token(self, auto, key):
        """A tensor that the step's shared host callback has run (or was not
        needed) when it is ready, built once per enclosing function in that
        function's graph, around Horovod's ``tf.cond`` of each gradient: one
        ``tf.cond`` a step instead of one a tensor.  None where this graph has
        no enclosing function (the tensor then asks on its own, :meth:`_mode`)."""
        from tensorflow.python.framework.func_graph import FuncGraph
        outer = getattr(tf.compat.v1.get_default_graph(), "outer_graph", None)
        if not isinstance(outer, FuncGraph):
            return None
        name = self.run.step_tokens.get(outer)  # a name: a tensor would keep its graph alive
        if name is None:
            with outer.as_default():
                name = self.run.step_tokens[outer] = self._step_callback_op(auto, key).name
        return tf.identity(outer.get_tensor_by_name(name))  # captured: this tensor's ops wait for it

    def _step_callback_op(self, auto, key):
        """In the enclosing function: this communication's number (``key``'s,
        read before its ``tf.cond`` adds one), its stamp (first tensor) and the
        shared host callback where :meth:`_asks` says so."""
        step = self.roles.store.params.of(key).step.read_value() + 1
        stamp = self._stamp(auto, step) if key == next(iter(auto.plan_state.tensors)) else None
        ask, check = self._asks(auto, step, first=True)
        with tf.control_dependencies([stamp] if stamp is not None else []):
            step_in = tf.identity(step)
        done = tf.cond(ask, lambda: tf.reshape(tf.py_function(lambda s, c: step_callback(auto, s, c),
                                                              [step_in, check], tf.int32), []),
                       lambda: tf.constant(0, tf.int32))
        with tf.control_dependencies([stamp] if stamp is not None else []):
            return tf.identity(done)

    def _mode(self, auto, key, step):
        """This step's mode of ``key``, read once the step's host callback has
        run (it writes the mode variables at check steps), its variable, and
        whether that callback is the step's shared one (every tensor's ops wait
        for it)."""
        store, slot = tf_checkpoint_slot(self.state_module, "scheme", key, "auto_mode")
        # a quantized warmup starts in its quantizer's mode (the first decision then flushes or switches)
        first = mode_for(auto, auto.plan_state.provisional.get(key, NONE_LABEL), PLAIN)
        self.run.mode_vars[key] = variable = self._var(store, slot, float(first), tf.float32)
        token = self._step_token(auto, key)
        if token is None:
            return self._own_callback_mode(auto, key, step, variable), variable, False
        with tf.control_dependencies([token]):
            return tf.cast(variable.read_value(), tf.int32), variable, True

    def _own_callback_mode(self, auto, key, step, variable):
        """Without an enclosing function: ``key``'s own host callback where
        :meth:`_asks` says so, else its variable's mode."""
        first = key == next(iter(auto.plan_state.tensors))
        stamp = self._stamp(auto, step) if first else None
        current = tf.cast(variable.read_value(), tf.int32)
        ask, check = self._asks(auto, step, first)
        with tf.control_dependencies([stamp] if stamp is not None else []):
            step_in = tf.identity(step)

        def callback():
            mode = tf.py_function(lambda s, c, m: tensor_mode(auto, key, s, c, m), [step_in, check, current],
                                  tf.int32)
            return tf.reshape(mode, [])
        return tf.cond(ask, callback, lambda: current)

    def _trace_modes(self, auto, key, size, process_set):
        """At the trace (eagerly): check the plan it is built from, probe the
        link (first trace), time the codecs (new classes), predict ``key``'s
        choice; the modes its switch holds (:func:`traced_modes`)."""
        if self.run.trace_started is None:
            self.run.trace_started = time.time()
        with tf.init_scope():
            sync_plan(auto)  # a plan restored before this trace: trace its modes
        if key == next(iter(auto.plan_state.tensors)):
            check_same_trace(auto, self.run, process_set)
            probe_at_first_trace(auto, process_set, size)
        if key not in self.run.predicted:
            time_codecs(auto, key, size, self.run.codec_timings, process_set)
            self.run.predicted[key] = predict_label(auto, key, size, self.run.codec_timings)
            warmup_label(auto, key, size)
        held = self.run.traced[key] = traced_modes(auto, key, self.run.predicted[key])
        if self.run.agreed.get(key) != held:
            agree_traced_modes(self.run, key, held, process_set)
        return held

    def _compress_scheduled(self, phases, call):
        if not isinstance(phases, AutoModes):
            return super()._compress_scheduled(phases, call)
        auto = call.comp
        held = self._trace_modes(auto, call.key, call.size, call.group.process_set)
        mode, variable, shared = self._mode(auto, call.key, tf.cast(call.step, tf.int64))
        if held == (PLAIN,) and shared:
            # none only: no switch, and the mode variable is the callback's alone.  The tensor itself goes
            # to Horovod's allreduce, fused with the step's other dense tensors, as a fixed NoCompression
            # would send it: a placeholder beside an allreduce of its own cost a collective more per tensor
            # (TF CNN, 4 ranks, every tensor dense: 0.041-0.046 s steps against none's 0.023-0.038 s).
            # Traces that differ between ranks would issue different collectives: the predictions' inputs
            # are agreed, and each tensor's traced modes are agreed at the trace (agree_traced_modes).
            with tf.control_dependencies([mode]):
                return self._compress_with(phases[PLAIN], call.renamed(f"{call.key}@m{PLAIN}"))
        if held == (PLAIN,):  # each tensor its own callback: run none's collective here, as a switch's branch would
            with tf.control_dependencies([mode]):
                dense, apply_scale = self._resolved_branch(call, f"@m{PLAIN}", phases[PLAIN])()
            return self._placeholder(call, dense, apply_scale, [dense])
        branch = tf.gather(tf.constant(branch_of_mode(held, len(phases)), tf.int32), mode)
        dense, apply_scale = tf.switch_case(branch, [self._resolved_branch(call, f"@m{m}", phases[m]) for m in held])
        # a flush lasts one step; one the trace lacks waits for the retrace (the residual stays)
        with tf.control_dependencies([dense]):
            after_flush = PLAIN if FLUSH in held else FLUSH
            deps = [dense, variable.assign(tf.cast(tf.where(tf.equal(mode, FLUSH), after_flush, mode), tf.float32))]
        return self._placeholder(call, dense, apply_scale, deps)

    @staticmethod
    def _placeholder(call, dense, apply_scale, deps):
        """The one-element tensor handed to Horovod where the collectives ran in compress."""
        pending = ResolvedPending(transport=RESOLVED, dense=dense, apply_scale=apply_scale, **pending_fields(call))
        # Horovod names its allreduce of this placeholder after it: a fixed name, not one numbered by the ops
        # before it (the branches' own collectives are named by key and mode)
        with tf.control_dependencies(deps):
            return tf.identity(tf.ones([1], tf.float32), name="hvdc_auto_placeholder"), pending
