"""The planner behind :class:`hvd_compress.Auto`: per tensor, the scheme and
transport with the least predicted time, and never a compressed one that
does not beat a plain allreduce by a margin.

Pure Python (no framework import): the measurements come in as numbers.
The predictions come from the one cost model, :mod:`hvd_compress.costmodel.model`
(the one ``hvd-compress advise`` uses and ``scripts/scale_model_check.py``
checks against measurements):

* **link** -- :func:`fit_link` fits ``latency`` and ``bandwidth`` of
  ``t = 2 (N-1) latency + 2 (N-1)/N x bytes / bandwidth`` (Horovod's ring
  allreduce; Patarasuk & Yuan, JPDC 2009) to allreduces Auto times.  The fit
  holds the collective's own CPU cost and Horovod's cycle, so Auto uses the
  model with :data:`hvd_compress.costmodel.model.LINK_ONLY`, or ``machine``
  (:func:`hvd_compress.costmodel.model.shared_host`: ranks sharing cores);
* **transport** -- per candidate: allreduce, allgather (every rank receives
  ``(N-1) x payload``), two-phase (about ``2 x payload`` whatever ``N``, one
  more round) or PowerSGD's rounds; a scheme that can travel both ways is two
  candidates (``"TopK(0.01)"`` and ``"TopK(0.01)/two_phase"``), so the model
  chooses the transport by ``N``;
* **overhead** -- error feedback + encode + decode as the transport runs
  them, measured on the real tensor sizes (``codec_s``);
* **per tensor** ``t = comm + overhead``, no overlap with the backward pass
  assumed: an upper bound of the communication share, which makes the margin
  ``min_gain`` conservative.

A compressed scheme is chosen only where it is predicted at least
``min_gain`` (default 10%) faster than ``none``; with ``min_gain > 0``,
``Auto`` is never *predictably* slower than no compression.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

from ..costmodel.model import LINK_ONLY, Link, step_cost, tensor_cost
from ..costmodel.step_plan import plan_step
from ..schemes.base import Scheme, check_range

NONE_LABEL = "none"
#: a two-phase candidate's label is its scheme's label + this + ``two_phase``
TRANSPORT_SEPARATOR = "/"


class PlanMismatchError(RuntimeError):
    """Ranks would apply different Auto plans (raised on every rank)."""


@dataclass(frozen=True)
class Candidate:
    """One scheme Auto may choose and how it travels (``transport``: the
    compressor's ``transport=``, ``"allgather"`` -- the scheme's own -- or
    ``"two_phase"``); ``label`` names it in plans and tables."""
    label: str
    scheme: Scheme
    transport: str = "allgather"

    @property
    def base_label(self) -> str:
        """The label of the scheme without its transport suffix."""
        return self.label.split(TRANSPORT_SEPARATOR)[0]


@dataclass(frozen=True)
class Choice:
    """A tensor's decision: the candidate (or ``"rule <i>"``), its predicted
    seconds per step, those of ``none``, and the bytes it hands Horovod
    (:func:`plan`: with an equal share of what the step pays once)."""
    label: str
    predicted_s: float
    none_s: float
    payload_bytes: Optional[float]


def fit_link(nbytes: Sequence[float], seconds: Sequence[float], workers: int,
             known_bytes_per_s: float = math.inf) -> Link:
    """Least-squares fit of ``t = 2 (N-1) latency + 2 (N-1)/N x bytes / bw``
    to allreduce timings of at least two sizes.  A non-positive slope (sizes too small
    to see the bandwidth, or times flat in size: in a step every probe may wait alike
    for the step's other collectives) gives ``known_bytes_per_s``, one measured before
    (Auto's early probe), by default infinite: the fit never invents a slow link."""
    check_range("workers", workers, 1, None, kind=int)
    if len(nbytes) != len(seconds) or len(nbytes) < 2 or len(set(nbytes)) < 2:
        raise ValueError(f"fit_link needs timings of at least two distinct sizes; got sizes {list(nbytes)} "
                         f"and {len(seconds)} timings")
    if any(not math.isfinite(t) or t < 0 for t in seconds):
        raise ValueError(f"seconds must be finite and non-negative; got {list(seconds)}")
    if workers == 1:
        return Link(0.0, math.inf)
    mean_b, mean_t = sum(nbytes) / len(nbytes), sum(seconds) / len(seconds)
    var = sum((b - mean_b) ** 2 for b in nbytes)
    slope = sum((b - mean_b) * (t - mean_t) for b, t in zip(nbytes, seconds)) / var
    intercept = max(0.0, mean_t - slope * mean_b)
    hops = 2.0 * (workers - 1)
    return Link(intercept / hops, hops / workers / slope if slope > 0 else known_bytes_per_s)


def default_candidates(topk_ratios=(0.1, 0.01), min_topk_ratio=0.01, powersgd_rank=4, include_sign=False,
                       fp16=True, int8=True, two_phase=True) -> List[Candidate]:
    """``none``, FP16, Int8, TopK at each ratio of the ladder not below
    ``min_topk_ratio`` (an accuracy guard: fewer kept elements converge
    slower), PowerSGD (2-D tensors only), and EF-SignSGD only with
    ``include_sign=True`` (1 bit an element costs accuracy on many models;
    Karimireddy et al., "Error Feedback Fixes SignSGD", ICML 2019).  With
    ``two_phase`` (default), every allgather scheme that can travel by the
    two-phase exchange is also a candidate ``"<label>/two_phase"``."""
    from ..compressor import supports_two_phase
    from ..schemes import FP16, EFSignSGD, Int8, NoCompression, PowerSGD, TopK
    check_range("min_topk_ratio", min_topk_ratio, 0.0, 1.0)
    if not isinstance(topk_ratios, (list, tuple)):
        raise ValueError(f"topk_ratios must be a list of ratios in (0, 1]; got {topk_ratios!r}")
    for r in topk_ratios:
        check_range("topk_ratios", r, 0.0, 1.0, lo_open=True)
    if powersgd_rank is not None:
        check_range("powersgd_rank", powersgd_rank, 1, None, kind=int)
    if not isinstance(two_phase, bool):
        raise ValueError(f"two_phase must be True or False; got {two_phase!r}")
    out = [Candidate(NONE_LABEL, NoCompression())]
    if fp16:
        out.append(Candidate("FP16", FP16()))
    if int8:
        out.append(Candidate("Int8", Int8()))
    for r in sorted(set(topk_ratios), reverse=True):
        if r >= min_topk_ratio:
            out.append(Candidate(f"TopK({r:g})", TopK(r)))
    if powersgd_rank is not None:
        out.append(Candidate(f"PowerSGD({powersgd_rank})", PowerSGD(powersgd_rank)))
    if include_sign:
        out.append(Candidate("EFSignSGD", EFSignSGD()))
    if two_phase:
        out += [Candidate(c.label + TRANSPORT_SEPARATOR + "two_phase", c.scheme, "two_phase")
                for c in out[1:] if supports_two_phase(c.scheme)]
    return out


def applies(candidate: Candidate, shape) -> bool:
    """Whether a candidate may carry a tensor of this shape: PowerSGD only
    where its factors are smaller than the matrix (it would otherwise fall
    back to a plain allreduce, which ``none`` already is)."""
    scheme = candidate.scheme
    return not (scheme.transport == "powersgd" and scheme.transport_for(tuple(shape)) != "powersgd")


def model_transport(scheme: Scheme, shape, transport="allgather") -> str:
    """The cost model's transport of a tensor: the scheme's own, or
    ``two_phase`` where the candidate asks for it."""
    own = scheme.transport_for(tuple(shape))
    return "two_phase" if transport == "two_phase" and own == "allgather" else own


def model_payload(scheme: Scheme, numel: int, shape, workers: int, transport="allgather"):
    """Bytes a rank hands the collectives per step for one tensor (None where
    they depend on the data); two-phase: the ``N`` chunk payloads."""
    if model_transport(scheme, shape, transport) == "two_phase" and workers > 1:
        chunk = scheme.payload_nbytes(-(-int(numel) // workers))
        return None if chunk is None else 4 + workers * chunk
    return scheme.step_nbytes(numel, tuple(shape))


def predict_cost(scheme: Scheme, numel: int, shape, workers: int, link: Link, transport="allgather",
                 codec_s=0.0, machine=LINK_ONLY):
    """The cost model's :class:`~hvd_compress.costmodel.model.TensorCost` of one
    tensor under ``scheme`` and ``transport``, or None where the payload
    depends on the data."""
    payload = model_payload(scheme, numel, shape, workers, transport)
    if payload is None:
        return None
    tr = model_transport(scheme, shape, transport)
    extra = min(2, len(scheme.variable_parts)) if tr == "allgather" else 0
    # a half-precision allreduce (FP16): its own fusion buffer, half-precision sums
    half = tr == "allreduce" and scheme.payload_nbytes(1024) == 2048
    return tensor_cost(tr, payload, workers, link, machine, codec_s=codec_s, extra_allgathers=extra, half=half)


def predict_comm(scheme: Scheme, numel: int, shape, workers: int, link: Link, transport="allgather",
                 machine=LINK_ONLY):
    """(payload bytes, seconds) one tensor under ``scheme`` adds to a step's
    communication (:attr:`hvd_compress.costmodel.model.TensorCost.marginal_s`: the
    allreduce latency that tensor fusion shares is left out); payload None
    (and seconds inf) where the bytes depend on the data; ``machine``: the host."""
    cost = predict_cost(scheme, numel, shape, workers, link, transport, machine=machine)
    if cost is None:
        return None, math.inf
    return cost.payload_bytes, cost.marginal_s


def choose(numel, shape, workers, link, candidates, codec_s: Dict[str, float], min_gain=0.1,
           machine=LINK_ONLY) -> Choice:
    """One tensor's choice.  ``codec_s[label]``: measured error feedback +
    encode + decode seconds; a candidate without a measurement is not
    chosen.  ``none``'s own measured cost counts too (about nothing: Auto
    runs it without error feedback)."""
    options = tensor_options(numel, shape, workers, link, candidates, codec_s, machine)
    none = options[NONE_LABEL]
    best = Choice(NONE_LABEL, none.marginal_s, none.marginal_s, none.payload_bytes)
    for label, cost in options.items():  # in the candidates' order: the first of equals wins
        if cost.marginal_s < best.predicted_s:
            best = Choice(label, cost.marginal_s, none.marginal_s, cost.payload_bytes)
    if best.label != NONE_LABEL and best.predicted_s > none.marginal_s * (1.0 - min_gain):
        return Choice(NONE_LABEL, none.marginal_s, none.marginal_s, none.payload_bytes)
    return best


def check_codec_costs(codec_costs, labels):
    """``Auto(codec_costs=...)``: ``None``, or ``{candidate label: seconds per
    element}`` with labels among ``labels`` and finite, non-negative costs."""
    if codec_costs is None:
        return None
    if not isinstance(codec_costs, dict):
        raise ValueError(f"codec_costs must be None or a dict {{candidate label: seconds per element}}; "
                         f"got {codec_costs!r}")
    for label, cost in codec_costs.items():
        if label not in labels:
            raise ValueError(f"codec_costs: {label!r} is not a candidate label; the labels are {list(labels)}")
        if isinstance(cost, bool) or not isinstance(cost, (int, float)) or not math.isfinite(cost) or cost < 0:
            raise ValueError(f"codec_costs[{label!r}] must be a finite number of seconds per element >= 0; "
                             f"got {cost!r}")
    return {label: float(cost) for label, cost in codec_costs.items()}


def fixed_codec_seconds(tensors, keys, candidates, codec_costs):
    """Codec seconds from fixed per-element costs, laid out as measured ones
    (``[len(keys) x len(candidates)]``, -1 where a candidate does not apply
    or has no cost; ``none`` without a cost costs 0)."""
    rows = []
    for key in keys:
        numel, shape = tensors[key]
        row = []
        for cand in candidates:
            cost = codec_costs.get(cand.label, 0.0 if cand.label == NONE_LABEL else None)
            row.append(-1.0 if cost is None or not applies(cand, shape) else cost * numel)
        rows.append(row)
    return rows


def plan(tensors: Dict[str, tuple], workers: int, link: Link, candidates: List[Candidate],
         codec_s: Dict[str, Dict[str, float]], rules=(), min_gain=0.1, machine=LINK_ONLY,
         backward_s=0.0) -> Dict[str, Choice]:
    """``{key: Choice}`` for ``tensors = {key: (numel, shape)}``.  The first
    matching :class:`~hvd_compress.Rule` pins a tensor (label ``"rule <i>"``);
    the others take the step's cheapest plan
    (:func:`hvd_compress.costmodel.step_plan.plan_step`: rounds a step's tensors share
    are charged once).  A choice's ``predicted_s`` (``none_s``) is the
    tensor's own cost under its choice (under ``none``) plus an equal share
    of what the step (the all-``none`` step) pays once, so that they add up
    to the step's :func:`predicted_total`.  ``backward_s``: seconds of the
    backward pass the step's link time may hide behind
    (:func:`hvd_compress.costmodel.model.step_cost`)."""
    check_range("workers", workers, 1, None, kind=int)
    check_range("backward_s", backward_s, 0.0, None)
    check_range("min_gain", min_gain, 0.0, 1.0, hi_open=True)
    if not candidates or candidates[0].label != NONE_LABEL:
        raise ValueError(f"candidates must start with the '{NONE_LABEL}' candidate; got "
                         f"{[c.label for c in candidates]}")
    if not isinstance(link, Link) or not link.bytes_per_s > 0 or link.latency_s < 0:
        raise ValueError(f"link must be a Link with bytes_per_s > 0 and latency_s >= 0; got {link!r}")
    out, free = {}, []
    for key in sorted(tensors):
        numel, shape = tensors[key]
        pinned = next((i for i, rule in enumerate(rules) if rule.matches(key, numel, tuple(shape))), None)
        if pinned is not None:
            out[key] = Choice(f"rule {pinned}", math.nan, math.nan, None)
        else:
            free.append(key)
    options = [tensor_options(*tensors[k], workers, link, candidates, codec_s.get(k, {}), machine) for k in free]
    labels = plan_step(options, machine, min_gain, NONE_LABEL, [c.label for c in candidates], backward_s)
    share, share_none = (_shared_part([o[k] for o, k in zip(options, ks)], machine, backward_s)
                         for ks in (labels, [NONE_LABEL] * len(labels)))
    for key, opts, label in zip(free, options, labels):
        out[key] = Choice(label, opts[label].own_s + share, opts[NONE_LABEL].own_s + share_none,
                          opts[label].payload_bytes)
    return out


def _shared_part(costs, machine, backward_s=0.0):
    """Each tensor's equal share of what its step pays once (fused latencies,
    rounds' cycles) less what the backward pass hides: a plan's ``predicted_s``
    add up to its step."""
    return ((step_cost(costs, machine, backward_s).seconds - sum(c.own_s for c in costs)) / len(costs)
            if costs else 0.0)


def tensor_options(numel, shape, workers, link, candidates, codec_s, machine=LINK_ONLY):
    """``{label: TensorCost}`` of the candidates that may carry one tensor:
    ``none`` always, a compressed one where it applies, its payload does not
    depend on the data, and ``codec_s[label]`` (its measured error feedback +
    encode + decode seconds) is a finite number >= 0."""
    out = {NONE_LABEL: predict_cost(candidates[0].scheme, numel, shape, workers, link, codec_s=codec_s.get(
        NONE_LABEL, 0.0), machine=machine)}
    for cand in candidates[1:]:
        cost = codec_s.get(cand.label)
        if cost is None or not math.isfinite(cost) or cost < 0 or not applies(cand, shape):
            continue
        got = predict_cost(cand.scheme, numel, shape, workers, link, cand.transport, cost, machine)
        if got is not None:
            out[cand.label] = got
    return out


def predicted_total(choices: Dict[str, Choice], tensors, workers, link, candidates, codec_s,
                    machine=LINK_ONLY, backward_s=0.0) -> float:
    """Seconds per step of a plan's choices under ``link`` (pinned tensors
    excluded; :func:`hvd_compress.costmodel.model.step_cost`): how a re-check
    compares the plan in force with a new one."""
    by_label = {c.label: c for c in candidates}
    costs = []
    for key, choice in choices.items():
        cand = by_label.get(choice.label)
        if cand is None or key not in tensors:
            continue
        numel, shape = tensors[key]
        cost = predict_cost(cand.scheme, numel, shape, workers, link, cand.transport,
                            codec_s.get(key, {}).get(cand.label, 0.0), machine)
        if cost is not None:
            costs.append(cost)
    return step_cost(costs, machine, backward_s).seconds


def format_plan(choices: Dict[str, Choice], tensors, link: Optional[Link] = None, step_s=None, codec_s=None) -> str:
    """The table ``Auto.describe()`` prints: each tensor, its choice, the
    predicted ms of the choice and of ``none`` (:func:`plan`: with an equal
    share of what the step pays once, so each column adds up to its step), the measured encode + decode
    ms of the choice (``codec_s``: key -> label -> seconds, averaged over
    ranks, as calibration measured it), and the bytes per step."""
    w = max([len(k) for k in choices] + [6])
    cw = max([len(c.label) for c in choices.values()] + [12])
    lines = [f"{'tensor':<{w}}  {'shape':>14}  {'choice':>{cw}}  {'pred. ms':>9}  {'none ms':>9}  "
             f"{'codec ms':>9}  {'bytes/step':>11}"]
    tot = tot_none = 0.0
    for key in sorted(choices):
        c = choices[key]
        shape = "x".join(map(str, tensors.get(key, (0, ()))[1])) or "scalar"
        pb = "-" if c.payload_bytes is None else str(int(c.payload_bytes))
        measured = (codec_s or {}).get(key, {}).get(c.label)
        codec = "-" if measured is None or measured < 0 else f"{1e3 * measured:.3f}"
        lines.append(f"{key:<{w}}  {shape:>14}  {c.label:>{cw}}  {1e3 * c.predicted_s:>9.3f}  "
                     f"{1e3 * c.none_s:>9.3f}  {codec:>9}  {pb:>11}")
        if math.isfinite(c.predicted_s):
            tot, tot_none = tot + c.predicted_s, tot_none + c.none_s
    lines.append(f"predicted communication {1e3 * tot:.3f} ms per step (none: {1e3 * tot_none:.3f} ms); "
                 f"codec ms: measured at calibration")
    if link is not None:
        lines.append(f"link: latency {1e6 * link.latency_s:.1f} us, {link.bytes_per_s / 1e6:.1f} MB/s"
                     + (f"; measured step {1e3 * step_s:.2f} ms" if step_s else ""))
    return "\n".join(lines)



def propose(tensors, workers, link, candidates, codec_s, min_gain, current=None, replan_threshold=0.0,
            machine=LINK_ONLY, backward_s=0.0, fresh=None):
    """Candidate indices (in ``tensors``' order) of a fresh :func:`plan`, or of
    ``current`` (the plan in force) where the fresh one is not predicted
    ``replan_threshold`` faster; ``fresh``: that plan where the caller made it already."""
    if fresh is None:
        fresh = plan(tensors, workers, link, candidates, codec_s, (), min_gain, machine, backward_s)
    if current:
        now = predicted_total(current, tensors, workers, link, candidates, codec_s, machine, backward_s)
        new = predicted_total(fresh, tensors, workers, link, candidates, codec_s, machine, backward_s)
        if not new < now * (1.0 - replan_threshold):
            fresh = current
    index = {c.label: i for i, c in enumerate(candidates)}
    return [index[fresh[k].label] if k in fresh else 0 for k in tensors]


#: tensors whose element counts round up to the same power of two share one
#: codec timing (those at or below this many elements share the smallest class)
TIMING_CLASS_MIN_NUMEL = 1 << 12


def timing_class(numel, shape, candidates, usable):
    """The class whose codec timing a tensor shares: its element count rounded
    up to a power of two (at least :data:`TIMING_CLASS_MIN_NUMEL`), and which
    candidates may carry it.  A model of hundreds of tensors has a few dozen
    such classes, so Auto's start-up grows with the classes, not the tensors."""
    rounded = max(TIMING_CLASS_MIN_NUMEL, 1 << max(0, int(numel) - 1).bit_length())
    return rounded, tuple(bool(usable(c, tuple(shape))) for c in candidates)


def timed_row(store, numel, shape, candidates, usable, time_class=None):
    """One tensor's codec seconds per candidate (-1: not usable) from its
    class's timing in ``store`` (``{class: (numel timed, [seconds or None])}``),
    scaled by its element count (the codecs' work is per element; in the
    smallest class never below the timed tensor's: a tiny tensor's cost is
    mostly per call).  ``time_class(numel, shape)`` times a class not in
    ``store`` yet on this tensor."""
    cls = timing_class(numel, shape, candidates, usable)
    if cls not in store:
        if time_class is None:
            raise KeyError(f"no codec timing for a tensor of shape {tuple(shape)}: it was not timed")
        store[cls] = (int(numel), time_class(numel, shape))
    timed_numel, seconds = store[cls]
    scale = int(numel) / max(1, timed_numel)
    if cls[0] == TIMING_CLASS_MIN_NUMEL:
        scale = max(1.0, scale)
    return [-1.0 if t is None or t < 0 or not ok else t * scale for t, ok in zip(seconds, cls[1])]


def codec_table(tensors, keys, candidates, workers, allgather_only, codec_costs, measure):
    """Seconds of each candidate's error feedback + encode + decode per key
    (rows in ``keys``' order), -1 where the candidate does not apply:
    ``codec_costs`` fixed per element where given, else ``measure`` (the
    framework's timing, ``measure(tensors, keys, candidates, workers, usable)``).
    ``allgather_only``: TensorFlow, whose traced modes carry allgather only."""
    usable = codec_usable(allgather_only)
    if codec_costs is not None:
        rows = fixed_codec_seconds(tensors, keys, candidates, codec_costs)
    else:
        rows = measure(tensors, keys, candidates, workers, usable)
    return [[v if usable(c, tensors[k][1]) else -1.0 for c, v in zip(candidates, row)] for k, row in zip(keys, rows)]


def codec_usable(allgather_only):
    """Whether a candidate's codec is timed for a shape: where it applies
    (TensorFlow, ``allgather_only``: and travels by allgather)."""
    return (lambda c, shape: c.transport == "allgather" and applies(c, shape)) if allgather_only else applies


def choice_as(choice, label, numel, shape, workers, link, candidates, codec_s, machine=LINK_ONLY):
    """``choice`` as ``label`` (the plan rank 0 broadcast) with this rank's
    predictions of it; ``codec_s``: the tensor's ``{label: seconds}``."""
    if choice.label == label:
        return choice
    forced = [c for c in candidates if c.label in (NONE_LABEL, label)]
    got = choose(numel, shape, workers, link, forced, {label: codec_s.get(label, 0.0),
                                                       NONE_LABEL: codec_s.get(NONE_LABEL, 0.0)}, min_gain=0.0,
                 machine=machine)
    return Choice(label, got.predicted_s if got.label == label else float("nan"), got.none_s, None)


def candidate_families(candidates) -> List[str]:
    """The compressed candidates' scheme labels (``"TopK(0.01)"`` and
    ``"TopK(0.01)/two_phase"`` are one family), in the candidates' order."""
    out = []
    for cand in candidates[1:]:
        if cand.base_label not in out:
            out.append(cand.base_label)
    return out


def trial_plans(tensors, workers, link, candidates, codec_s, min_gain=0.1, machine=LINK_ONLY, backward_s=0.0,
                most=3, margin_s=0.0):
    """The plans worth timing in training, best predicted first, as
    ``[({key: label}, predicted seconds a step)]``: the fresh :func:`plan`,
    then for each candidate family (:func:`candidate_families`) the plan
    with the candidates restricted to ``none`` and that family, and (where
    ``backward_s`` hides part of the link) the plan made as if nothing hid.
    A plan predicted more than ``margin_s`` slower than the fresh one, or one
    with the same label on every tensor as a plan before it, is left out; at
    most ``most``.  Why: the cost model prices plans within its error of each
    other alike, and only the step can tell them apart.  Why the plan without
    hiding: how much of a dense allreduce the backward pass hides is the
    model's least certain term on CPU hosts, where the collective's copies
    and sums run on the cores the backward pass computes on.  On GPT-2 small
    at 2 ranks (PyTorch, unshaped link) the model hid all 0.85 s of the
    dense allreduce behind the 2.2 s backward pass and planned every tensor
    dense, with nothing to try; Top-K(0.01), which it priced within the
    margin, measured 2.22 s a step against dense's 2.42 s
    (docs/results/benchmarks.md, "GPT-2")."""
    check_range("most", most, 1, None, kind=int)
    fresh = plan(tensors, workers, link, candidates, codec_s, (), min_gain, machine, backward_s)
    found = [fresh]
    for family in candidate_families(candidates):
        only = [candidates[0]] + [c for c in candidates[1:] if c.base_label == family]
        found.append(plan(tensors, workers, link, only, codec_s, (), min_gain, machine, backward_s))
    if backward_s > 0:
        found.append(plan(tensors, workers, link, candidates, codec_s, (), min_gain, machine, 0.0))
    totals = [predicted_total(p, tensors, workers, link, candidates, codec_s, machine, backward_s) for p in found]
    out, seen = [], set()
    # the fresh plan first, then the others by predicted total (sorted() keeps the earlier of equals)
    for i in [0] + sorted(range(1, len(found)), key=lambda j: totals[j]):
        labels = {k: c.label for k, c in found[i].items()}
        signature = tuple(sorted(labels.items()))
        if signature in seen or totals[i] > totals[0] + max(margin_s, 0.0):
            continue
        seen.add(signature)
        out.append((labels, totals[i]))
    return out[:most]
