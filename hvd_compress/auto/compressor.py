"""``hvd_compress.Auto()``: each tensor's scheme chosen online from the
measured link and encode cost (PyTorch and TensorFlow).

Life of an ``Auto``:

1. **Calibrate** (the first ``calibration_steps`` communications of each
   tensor) while the step time is measured.  At the first ``compress``
   every rank times a few small allreduces and fits the link; a tensor on
   which a plain allreduce clearly loses there is calibrated with a safe
   compressed candidate and error feedback
   (:func:`hvd_compress.auto.provisional.provisional_choice`; during a
   warmup only a quantizer, ``warmup_with``), the others dense
   (``calibrate_compressed=False``: all dense).
2. **Decide** at the first ``compress`` of the next step, on every rank:
   time blocking allreduces of ``probe_numels`` elements
   (:func:`hvd_compress.auto.probe.probe_numels_for`; fit of latency and
   bandwidth, :func:`hvd_compress.auto.planner.fit_link`, the latency at least the
   wait for a core where ranks share them, :func:`hvd_compress.costmodel.machine.with_wait_floor`) and each candidate's
   error feedback + encode + decode once per class of tensor sizes (``none``:
   0, not timed); average them over ranks (one allreduce); rank 0 plans the step
   (:func:`hvd_compress.auto.planner.plan`) and broadcasts candidate indices in sorted key
   order; every rank allgathers a hash of the plan it is about to apply and raises
   :class:`~hvd_compress.auto.planner.PlanMismatchError` where they differ.
   PyTorch, the first decision (and an elastic re-plan's): rank 0 also plans
   with the candidates restricted to ``none`` and one family each
   (:func:`hvd_compress.auto.planner.trial_plans`), and where plans other than the
   fresh one are predicted within a tenth of the calibrated step of it, broadcasts
   up to ``trial_plans`` of them (one flat list, hashed on every rank).
   **Try** them: each runs ``trial_steps`` steps, best predicted first, timed by
   the first tensor's ``compress`` calls (:func:`trial_step_s`: the mean gap
   less the slowest third, the plan's first step left out: it pays new
   collective names and allocations); after the last, those are averaged
   over ranks and rank 0's pick of the fastest (of
   equals the one predicted better) is broadcast, hashed and adopted.  Why:
   the cost model prices compression's in-step cost low, and plans predicted
   within its error of each other can differ in the step by more than it;
   only the step tells them apart.  Where the steps before the decision ran
   every planned tensor dense (a dense warmup, ``calibrate_compressed=False``),
   the dense plan is one more trial, timed on the last ``trial_steps`` of those
   steps at no cost: a compressed plan that steps slower than dense did is not
   kept.  Each trial plan is a plan version (a phase), so error feedback
   carries across them as across any re-plan; the pick, where it is the plan
   the last trial ran, stays in force as it is.
3. **Re-check** every ``recheck_every`` steps: re-probe the link (the codec
   costs are kept); where rank 0's new plan is predicted more than
   ``replan_threshold`` faster than the plan in force, PyTorch tries it: it
   runs ``trial_steps`` steps against the plan in force, timed on the last
   ``trial_steps`` before the re-check, and the faster is kept (a plan the
   first decision's trials measured faster is not undone by the prediction
   alone); TensorFlow adopts it.

Every lossy candidate runs with plain error feedback and one residual per
tensor that carries across changes of scheme; ``none`` runs without (exactly
plain Horovod) after one step that sends a left-over residual out in full:
``sum(sent) + residual == sum(gradients)`` holds across re-plans.  A plan
version is a phase, as in :class:`~hvd_compress.Schedule` (side collectives ``<key>@<version>``).

**TensorFlow** (:mod:`hvd_compress.auto.tf_auto`) runs the same life inside a
graph: the link probed and the codecs timed and agreed at the first trace,
a per-tensor mode switch over the modes the plan in force needs (before the
first plan: ``none`` and the tensor's label in the step's plan of the
tensors traced so far, predicted from those measurements; the step traced
again when a plan needs others, which the first decision avoids unless the
new plan is ``replan_threshold`` faster; a tensor traced with ``none`` alone
has no switch and goes to Horovod's own allreduce), measurements and
agreement in one host callback a step, which every tensor's ops of the step
wait for.

Only the global process set, one framework per ``Auto``; tensors first seen after calibration are not planned.
"""
from __future__ import annotations

import collections
import json
import math
import statistics
import time
from dataclasses import astuple, dataclass, field
from typing import Dict, List, Optional, Tuple

from .planner import (NONE_LABEL, Choice, Link, check_codec_costs, choice_as, codec_table, default_candidates,
                      fit_link, format_plan, plan, predicted_total, propose, trial_plans)
from .probe import DEFAULT_PROBE_NUMELS, EARLY_PROBE_NUMELS, pair_swap_for, probe_numels_for
from .provisional import WARMUP_CHOICES, provisional_candidates, provisional_choice
from ..compressor import Compressor, Phase
from ..costmodel.model import LINK_ONLY, Machine
from ..costmodel.machine import with_wait_floor
from ..feedback.memory import ResidualMemory
from ..schemes.base import check_range


@dataclass
class AutoPlan:
    """What an :class:`Auto` has measured and decided: the plan in force and
    how it came about.  :meth:`to_json` is what ``state_dict()`` saves; a
    reset starts a fresh one."""
    #: the call count of a tensor at which the next check runs (0: never again)
    next_check: int = 0
    #: key -> (numel, shape), as first seen
    tensors: Dict[str, Tuple[int, tuple]] = field(default_factory=dict)
    #: key -> compress calls so far
    calls: Dict[str, int] = field(default_factory=dict)
    #: perf_counter at each calibration call of the first key seen
    step_times: List[float] = field(default_factory=list)
    #: the calibration steps' median, averaged over ranks
    step_s: Optional[float] = None
    #: PyTorch: the calibration steps' median span from the first to the last
    #: gradient handed to ``compress`` (the backward pass the link's time can hide
    #: behind), averaged over ranks; 0 in TensorFlow (compress runs at trace time)
    backward_s: float = 0.0
    #: [first, last] perf_counter of the compress calls of each calibration step
    spans: List[list] = field(default_factory=list, repr=False)
    #: key -> {label: seconds} of error feedback + encode + decode, averaged over ranks
    codec_s: Dict[str, Dict[str, float]] = field(default_factory=dict)
    #: the link at the last check, and the host (:func:`hvd_compress.costmodel.machine.machine_of`)
    link: Optional[Link] = None
    machine: Machine = LINK_ONLY
    #: [(start, {key: Choice}, version)]: the plans adopted so far, in order
    history: list = field(default_factory=list)
    #: the early probe's link (None: not probed); each tensor's calibration label
    early_link: Optional[Link] = None
    provisional: Dict[str, str] = field(default_factory=dict)
    #: whether the steps before the first plan are a warmup (an elastic re-plan's are not)
    warmup: bool = False
    #: the 2-rank swap chosen from the link (bytes from which it applies; 0: off)
    pair_swap_bytes: int = 0
    #: this rank's seconds in the checks so far (probing, timing codecs, the whole decision)
    check_seconds: Optional[dict] = None
    #: key -> its phases, built from ``provisional`` and ``history`` (dropped where they change)
    phases: Dict[str, list] = field(default_factory=dict, repr=False)
    #: PyTorch, the trial plans of the last decision that ran any (the first, or a
    #: re-check's: the fresh plan against the plan in force), in the order they run, each a dict:
    #: ``labels`` ({key: label}), ``predicted_s`` (its predicted seconds a step), ``start``
    #: (the communication it runs from; None: not yet), ``local_s`` (this rank's step,
    #: :func:`trial_step_s`; None: not timed), ``step_s`` (that averaged over ranks, once all ran) and,
    #: for the plan timed on the steps before the decision (the dense plan at the first,
    #: the plan in force at a re-check), ``before`` (True)
    trials: List[dict] = field(default_factory=list)
    #: the trial adopted as the final plan (its index; None: no trial finished)
    trial_pick: Optional[int] = None
    #: the trials of earlier decisions, oldest first: ``[{"trials": [...], "trial_pick": i}]``
    earlier_trials: List[dict] = field(default_factory=list)
    #: [communication, perf_counter] of the first key's calls during the trials (this
    #: process's clock: not saved)
    trial_stamps: List[list] = field(default_factory=list, repr=False)
    #: TensorFlow: the plan's JSON as this object last took it from or wrote it to the
    #: checkpointed plan variable (an Auto a retrace built shares the variable, not this)
    synced_json: str = field(default="", repr=False)

    def in_force(self) -> Optional[Dict[str, Choice]]:
        """``{key: Choice}`` of the plan in force (None during calibration)."""
        return self.history[-1][1] if self.history else None

    def trials_run(self) -> List[dict]:
        """The trial plans that run steps of their own (not the dense plan
        timed on the steps before the decision)."""
        return [t for t in self.trials if not t.get("before")]

    def trial_running(self) -> bool:
        """Whether a decision's trial plans are still being timed."""
        return bool(self.trials) and self.trial_pick is None

    def to_json(self) -> dict:
        """The plan as JSON-ready data (what :meth:`Auto.state_dict` saves)."""
        def link(x):
            return None if x is None else [x.latency_s, x.bytes_per_s]
        return {"tensors": {k: [n, list(s)] for k, (n, s) in self.tensors.items()}, "calls": self.calls,
                "next_check": self.next_check, "step_s": self.step_s, "backward_s": self.backward_s,
                "codec_s": self.codec_s,
                "link": link(self.link), "early_link": link(self.early_link), "provisional": self.provisional,
                "warmup": self.warmup,
                "pair_swap_bytes": self.pair_swap_bytes,
                # only where trials ran: TensorFlow's checkpointed plan stays as it was
                **({"trials": self.trials, "trial_pick": self.trial_pick} if self.trials else {}),
                **({"earlier_trials": self.earlier_trials} if self.earlier_trials else {}),
                "history": [[start, {k: list(astuple(c)) for k, c in ch.items()}, v]
                            for start, ch, v in self.history]}

    @classmethod
    def from_json(cls, saved) -> "AutoPlan":
        """The plan :meth:`to_json` returned."""
        def link(x):
            return None if x is None else Link(*x)
        return cls(next_check=saved["next_check"], calls=dict(saved["calls"]), step_s=saved["step_s"],
                   backward_s=saved.get("backward_s", 0.0),
                   tensors={k: (n, tuple(s)) for k, (n, s) in saved["tensors"].items()},
                   codec_s=saved["codec_s"], link=link(saved["link"]), early_link=link(saved.get("early_link")),
                   provisional=dict(saved.get("provisional", {})), warmup=saved.get("warmup", False),
                   pair_swap_bytes=saved.get("pair_swap_bytes", 0),
                   trials=[dict(t) for t in saved.get("trials", [])], trial_pick=saved.get("trial_pick"),
                   earlier_trials=[dict(t) for t in saved.get("earlier_trials", [])],
                   history=[(start, {k: Choice(*c) for k, c in ch.items()}, v) for start, ch, v in saved["history"]])


def trial_step_s(gaps):
    """A trial plan's step from its timed step gaps: the mean of the gaps
    less the slowest third (``len(gaps) // 3`` of them; none of one or two).

    Why not the median or the minimum: on hosts whose cores also run other
    work, interference only ever slows a step, so the slowest gaps carry it
    and are dropped; the minimum would reward a plan's one lucky step where
    the plan's own steps vary.  On GPT-2 small (PyTorch, 2 ranks, unshaped)
    the dense plan's timed steps were 2.81, 2.46 and 2.70 s and Top-K's 2.34,
    2.72 and 4.34 s: the medians (2.70 against 2.72 s) kept dense, which the
    fixed schemes' alternating rounds measured 1.1-1.3x slower than Top-K(0.01);
    the mean of the faster two thirds (2.58 against 2.53 s) picks Top-K's
    plan (docs/results/benchmarks.md, "GPT-2")."""
    ordered = sorted(gaps)
    if not ordered:
        raise ValueError("trial_step_s needs at least one timed gap")
    kept = ordered[:len(ordered) - len(ordered) // 3]
    return sum(kept) / len(kept)


def without_excluded(candidates, exclude):
    """``candidates`` less ``exclude`` (labels among them; excluding a scheme
    excludes its two-phase candidate too); an error names what is allowed."""
    labels = [c.label for c in candidates]
    if isinstance(exclude, str) or any(e not in labels[1:] for e in exclude):
        raise ValueError(f"exclude must be a list of candidate labels among {labels[1:]}; got {exclude!r}")
    return [c for c in candidates if c.label not in exclude and c.base_label not in exclude]


class Auto(Compressor):
    """Per-tensor compression chosen from measurements; see the module
    docstring, which also says how TensorFlow differs and its limits there.

    Args:
        rules: :class:`~hvd_compress.Rule` s that pin tensors (they win over the planner).
        calibration_steps: steps before the first plan (>= 1), dense or with a
            safe compressed candidate (``calibrate_compressed``); they time the
            step, which the plan does not use.
        warmup_steps: communications of each tensor sent without leaving any
            of it out (with Auto's momentum) before the first plan: dense, or
            rounded where ``warmup_with`` says; the calibration runs
            inside them, so the warmup costs no extra start-up.  Why: on a slow
            link Auto picks the most aggressive candidates, and aggressive
            compression from the first step makes training oscillate (Lin et
            al., ICLR 2018, warm up DGC for the same reason); the recipes of
            Top-K, DGC, PowerSGD and the sign schemes warm up dense for an
            epoch.  Tuning: about one epoch of steps.  An elastic re-plan
            calibrates only.
        warmup_with: what the warmup sends a tensor as where the early
            probe's link shows a plain allreduce clearly losing
            (:data:`hvd_compress.auto.provisional.WARMUP_CHOICES`), with
            error feedback, instead of dense (needs ``calibrate_compressed``):
            ``"none"`` (default), always dense; ``"FP16"``, half precision
            where predicted at least 1.67x faster; ``"Int8"``, Int8 or FP16
            where predicted at least 2x faster, by the transport the cost model
            prefers (TensorFlow: by allgather; its trace then holds that mode
            too).  Rounding leaves no element out, and on such a link the dense
            warmup costs most of a short run: on the MNIST CNN at 4 ranks and
            17 Mbit/s the FP16 warmup epoch ran 1.7-1.9x faster than the dense one.
            Why dense by default: a warmup exists because early training is
            fragile, and there the rounding can tip it; in TensorFlow one seed
            of three diverged during an FP16 warmup where the dense one
            recovered (in two runs of it), and the Int8 warmup's runs took more
            steps to dense's accuracy (docs/results/tta.md, "Auto()'s warmup").
            Tuning: ``"FP16"`` where the model's first epoch is known to be
            stable; on the PyTorch CNN at that link it reached dense's accuracy
            1.47x sooner than the dense warmup.  Horovod sums FP16 in half
            precision (its range ends at 65504).
        dense_below: tensors of at most this many elements are always sent
            dense (with Auto's momentum) and not planned.  Why: biases and norm
            scales are a few percent of the bytes, and compressing them costs
            accuracy for little time; the recipes send them dense (1024).
        recheck_every: steps between re-checks of the link (0: never).
        topk_ratios, min_topk_ratio, powersgd_rank, include_sign: the
            candidates (:func:`hvd_compress.auto.planner.default_candidates`); raise
            ``min_topk_ratio`` if accuracy suffers.
        min_gain: a compressed scheme must be predicted this much faster than
            ``none`` for a tensor (0.1 = 10%).
        replan_threshold: a re-check tries (PyTorch: ``trial_steps`` steps
            against the plan in force, the faster kept) or adopts (TensorFlow)
            a new plan only if it is predicted this much faster than the plan
            in force.
        probe_numels: fp32 allreduce sizes timed to fit the link, capped by
            :func:`hvd_compress.auto.probe.probe_numels_for`.
        exclude: labels of candidates to leave out (``("FP16",)`` where a
            half-precision sum would overflow; ``"none"`` always stays; a
            scheme's label also leaves out its ``"/two_phase"`` candidate).
        momentum, nesterov: momentum-aware error feedback
            (:class:`~hvd_compress.MomentumMemory`) in every phase, dense ones
            included, with one velocity per tensor carried across plans; then
            give the optimizer momentum 0 (docs/guide/schemes.md, 'Momentum placement').  Why:
            Auto may pick a sign scheme, whose residual the optimizer's
            momentum would amplify.
        codec_costs: ``None`` (default) times each candidate's error feedback
            + encode + decode once per class of tensor sizes at the first
            decision.  A dict ``{candidate label: seconds per element}`` is
            used instead of those timings: the plan then depends on the link
            alone, the same on any machine (a reproducible plan, or a test of
            the decisions).  A candidate without a cost is not chosen;
            ``none`` without one costs 0.
        calibrate_compressed: probe the link at the first ``compress`` and
            calibrate the tensors a plain allreduce clearly loses on with a
            safe compressed candidate (PyTorch; TensorFlow calibrates dense,
            but for a rounded warmup, ``warmup_with``).
        two_phase: also offer each allgather scheme that can travel by the
            two-phase exchange as a candidate ``"<label>/two_phase"``, so the
            cost model chooses the transport by the number of ranks
            (PyTorch; TensorFlow never chooses the two-phase candidates).
        trial_plans: PyTorch, at the first decision: how many plans, the fresh
            one and per candidate family the plan restricted to that family,
            predicted within a tenth of the calibrated step of the fresh one,
            to run in training and time; the fastest measured is adopted (module
            docstring, **Try**).  Why: plans the cost model predicts that close
            can differ in the step by more than that; only the step separates
            them.  Where the steps before the decision ran dense, the dense
            plan joins the trials, timed on those steps (it costs no step).
            0 or 1: the fresh plan at once, no trial steps, and a re-check
            adopts its new plan on the prediction; where only the fresh plan
            is predicted that close and it is dense, no trial runs either.
            TensorFlow never runs trials.
        trial_steps: steps each trial plan runs (>= 2: the first is left out of
            its timing).  Tuning: the trials cost up to ``trial_plans x
            trial_steps`` steps under plans predicted within a tenth of a step of
            the best; more steps time each plan against more noise.  A
            checkpoint taken during the trials resumes them: the trials timed
            before it keep their timings, the one it cut is timed on its steps
            after the resume (clock readings are not saved), and a trial
            left without a timed step is not adopted (all of them without
            one: the best predicted).
    """

    def __init__(self, rules=(), calibration_steps=3, recheck_every=1000, topk_ratios=(0.1, 0.01),
                 min_topk_ratio=0.01, powersgd_rank=4, include_sign=False, min_gain=0.1, replan_threshold=0.1,
                 probe_numels=DEFAULT_PROBE_NUMELS, exclude=(), seed=0, momentum=0.0, nesterov=False,
                 codec_costs=None, calibrate_compressed=True, two_phase=True, warmup_steps=0, dense_below=0,
                 trial_plans=3, trial_steps=4, warmup_with="none"):
        from ..feedback.memory import MomentumMemory, momentum_memory
        from ..policy import Rule
        from ..schemes import NoCompression
        self.rules = list(rules)
        for r in self.rules:
            if not isinstance(r, Rule):
                raise ValueError(f"rules must be hvd_compress.Rule instances; got {r!r}")
        self.calibration_steps = check_range("calibration_steps", calibration_steps, 1, None, kind=int)
        self.warmup_steps = check_range("warmup_steps", warmup_steps, 0, None, kind=int)
        self.dense_below = check_range("dense_below", dense_below, 0, None, kind=int)
        self.recheck_every = check_range("recheck_every", recheck_every, 0, None, kind=int)
        self.trial_plans = check_range("trial_plans", trial_plans, 0, None, kind=int)
        self.trial_steps = check_range("trial_steps", trial_steps, 2, None, kind=int)
        self.min_gain = check_range("min_gain", min_gain, 0.0, 1.0, hi_open=True)
        self.replan_threshold = check_range("replan_threshold", replan_threshold, 0.0, 1.0, hi_open=True)
        if not isinstance(probe_numels, (list, tuple)) or len(set(probe_numels)) < 2:
            raise ValueError(f"probe_numels must list at least two distinct sizes; got {probe_numels!r}")
        for n in probe_numels:
            check_range("probe_numels", n, 1, None, kind=int)
        self.probe_numels = tuple(probe_numels)
        candidates = default_candidates(topk_ratios, min_topk_ratio, powersgd_rank, include_sign, two_phase=two_phase)
        labels = [c.label for c in candidates]
        self.candidates = without_excluded(candidates, exclude)
        #: what a tensor may be calibrated with (built once: its phases hold these schemes)
        self._provisional_candidates = provisional_candidates(self.candidates)
        self.codec_costs = check_codec_costs(codec_costs, labels)
        if not isinstance(calibrate_compressed, bool):
            raise ValueError(f"calibrate_compressed must be True or False; got {calibrate_compressed!r}")
        if not isinstance(warmup_with, str) or warmup_with not in WARMUP_CHOICES:
            raise ValueError(f"warmup_with must be one of {list(WARMUP_CHOICES)}; got {warmup_with!r}")
        self.calibrate_compressed, self.warmup_with = calibrate_compressed, warmup_with
        # the lossy phases keep a residual; the dense ones keep only the velocity, if any
        self.feedback_memory = (momentum_memory(NoCompression(), momentum, nesterov, error_feedback=True)
                                or ResidualMemory())
        self.dense_memory = MomentumMemory(momentum, nesterov, error_feedback=False) if momentum else None
        #: the phases of a tensor of at most ``dense_below`` elements: dense, with Auto's momentum
        self._small_phases = [Phase(0, NoCompression(), self.dense_memory, "allgather")]
        super().__init__(NoCompression(), error_feedback=True, seed=seed, memory=self.feedback_memory)
        self._process_set_checked = False
        self._framework = None
        #: what measures and agrees (None: :mod:`hvd_compress.auto.calibration`, PyTorch)
        self.measurements = None
        self._reset_plan()

    @property
    def steps_before_plan(self):
        """Communications of each tensor before the first plan: the calibration,
        or the dense warmup where that is longer (the calibration runs inside it)."""
        return max(self.calibration_steps, self.warmup_steps)

    @property
    def most_trial_steps(self):
        """PyTorch: the most communications the first decision's trial plans
        can run (``trial_plans x trial_steps``; 0 where trials are off), a
        bound: fewer plans may qualify."""
        return self.trial_plans * self.trial_steps if self.trial_plans > 1 else 0

    def _reset_plan(self, warmup=True):
        first = (self.steps_before_plan if warmup else self.calibration_steps) + 1
        self.plan_state = AutoPlan(next_check=first, warmup=warmup and self.warmup_steps > 0)
        self._use_pair_swap(0)

    # --- Horovod's interface ----------------------------------------------------------
    def compress(self, tensor):
        from ..backend import backend_for
        name = backend_for(tensor).name
        if self._framework not in (None, name):
            raise ValueError(f"hvd_compress.Auto: one Auto serves one framework; this one runs in "
                             f"{self._framework} and was handed a {name} tensor: build one Auto per framework")
        self._framework = name
        if not self._process_set_checked:
            self._process_set_checked = True
            if name == "tensorflow":
                from .tf_auto import require_global_process_set as require_global_tf
                require_global_tf(tensor)
            else:
                from .calibration import require_global_process_set
                require_global_process_set()
        return super().compress(tensor)

    def plan_for(self, key, numel, shape):
        rule = next((r for r in self.rules if r.matches(key, numel, shape)), None)
        if rule is not None:
            return rule.compression.plan_for(key, numel, shape)
        if numel <= self.dense_below:
            return self._small_phases
        shape = tuple(int(d) for d in shape)
        state = self.plan_state
        state.tensors.setdefault(key, (int(numel), shape))
        if self._framework == "tensorflow":  # traced: the mode is chosen when the step runs
            from .tf_auto import modes
            return modes(self)
        calls = state.calls[key] = state.calls.get(key, 0) + 1
        if calls == 1 and not state.history and key not in state.provisional:
            self._calibrate_with(key, numel, shape)
        first_key = key == next(iter(state.tensors))
        if first_key and calls <= self.calibration_steps + 1:
            state.step_times.append(time.perf_counter())
        if not state.history and calls <= self.steps_before_plan:
            self._stretch_span(first_key)
        if first_key and (state.trial_running() or self._times_the_steps_before_the_plan(calls)):
            state.trial_stamps.append([calls - 1, time.perf_counter()])
        if state.next_check and calls >= state.next_check:
            self._check(calls)
        return self._phases_of(key)

    def _times_the_steps_before_the_plan(self, calls):
        """PyTorch: whether communication ``calls`` is among the last
        ``trial_steps`` before a decision (and the decision's own), which time
        the plan that ran before it: at the first decision the dense plan's
        trial where every planned tensor ran dense (:meth:`_agree_trials`), at
        a re-check the plan in force (:meth:`_try_against_the_plan_in_force`)."""
        state = self.plan_state
        return (self.trial_plans > 1 and bool(state.next_check) and not state.trial_running()
                and calls >= state.next_check - self.trial_steps)

    def _check(self, calls):
        """At communication ``calls`` (the same on every rank): end a trial, or
        decide; then set the next check (the next trial's end, or a re-check)."""
        state = self.plan_state
        if state.trial_running():
            self._next_trial(calls - 1)
        else:
            self.decide(calls - 1)
        if state.trial_running():
            state.next_check = calls + self.trial_steps
        else:
            state.next_check = calls + self.recheck_every if self.recheck_every else 0

    def _stretch_span(self, first_key):
        """The backward pass as the hooks see it: a step's span opens at its
        first tensor's compress and ends at its last one's."""
        now, spans = time.perf_counter(), self.plan_state.spans
        if first_key:
            spans.append([now, now])
        elif spans:
            spans[-1][1] = now

    def _phases_of(self, key):
        """The key's phases: dense first, then one per plan version.  ``none``
        runs without error feedback (exactly plain Horovod), except for one
        step after a lossy phase, in which it sends the residual out in full."""
        state = self.plan_state
        phases = state.phases.get(key)
        if phases is None:
            feedback, dense = self.feedback_memory, self.dense_memory
            by_label = {c.label: c for c in self._provisional_candidates + self.candidates}
            first = state.provisional.get(key, NONE_LABEL)
            lossy_before = first != NONE_LABEL
            phases = [Phase(0, by_label[first].scheme, feedback if lossy_before else dense,
                            by_label[first].transport)]
            for start, choices, _ in state.history:
                label = choices[key].label if key in choices else NONE_LABEL
                scheme = by_label[label].scheme
                if label != NONE_LABEL:
                    phases.append(Phase(start, scheme, feedback, by_label[label].transport))
                elif lossy_before:  # flush the residual once, then plain
                    phases += [Phase(start, scheme, feedback, "allgather"),
                               Phase(start + 1, scheme, dense, "allgather")]
                else:
                    phases.append(Phase(start, scheme, dense, "allgather"))
                lossy_before = label != NONE_LABEL
            state.phases[key] = phases
        return phases

    # --- calibrating ------------------------------------------------------------------
    def _calibration(self):
        if self.measurements is None:
            from . import calibration
            return calibration
        return self.measurements

    def _calibrate_with(self, key, numel, shape):
        """Choose the candidate ``key`` is calibrated with (at its first call,
        before any plan): probe the link once (at the first ``compress`` of
        this Auto on every rank, where the fingerprint check blocks too), then
        :func:`hvd_compress.auto.provisional.provisional_choice` (during a
        warmup, among the quantizers only; ``none`` in a dense warmup, which
        probes all the same: the probe caps the decision's probe sizes at what
        the link moves in :data:`~hvd_compress.auto.probe.PROBE_BUDGET_S`, and
        uncapped, 4 MB allreduces at 17 Mbit/s took a decision 11.8 s:
        docs/results/tta_auto_warmup_seed2.json)."""
        cal, state = self._calibration(), self.plan_state
        if not self.calibrate_compressed or not cal.ready():
            state.provisional[key] = NONE_LABEL
            return
        ps, size, _ = cal.world()
        if state.early_link is None:
            t0 = time.perf_counter()
            probes = cal.probe_early(EARLY_PROBE_NUMELS, ps)
            avg = cal.average_over_ranks(probes, "early", ps)
            state.early_link = fit_link([4 * n for n in EARLY_PROBE_NUMELS], avg, size)
            state.check_seconds = {"early_probe": time.perf_counter() - t0}
        if state.warmup:
            state.provisional[key] = self.warmup_choice(numel, shape, size, state.early_link)
        else:
            state.provisional[key] = provisional_choice(numel, shape, size, state.early_link,
                                                        self._provisional_candidates)
        state.phases.pop(key, None)

    def warmup_choice(self, numel, shape, size, link, two_phase=True):
        """What a tensor of ``numel`` elements warms up with on ``link`` at
        ``size`` ranks: ``none``, or with ``calibrate_compressed`` the
        quantizer of ``warmup_with`` that
        :func:`~hvd_compress.auto.provisional.provisional_choice` picks at that
        warmup's margin (``two_phase=False``: by allgather only, as TensorFlow
        runs them)."""
        if not self.calibrate_compressed or self.warmup_with == NONE_LABEL:
            return NONE_LABEL
        safe = [c for c in provisional_candidates(self.candidates, warmup=self.warmup_with)
                if two_phase or c.transport == "allgather"]
        return provisional_choice(numel, shape, size, link, safe, min_gain=WARMUP_CHOICES[self.warmup_with][1])

    # --- deciding ---------------------------------------------------------------------
    def decide(self, start, cal=None, step_times=None):
        """Measure, agree and (maybe) adopt a plan; the same steps on every rank.
        ``cal``: the framework's measurements (default :mod:`hvd_compress.auto.calibration`,
        PyTorch); ``step_times``: clock readings of the calibration steps."""
        cal = self._calibration() if cal is None else cal
        state = self.plan_state
        t0 = time.perf_counter()
        ps, size, rank = cal.world()
        version = f"{len(state.history)}.{start}"
        keys = self._planned_keys()
        self._measure(cal, keys, version, size, step_times)
        current = state.in_force()
        if current is None and self.trial_plans > 1 and self._framework != "tensorflow":
            labels = self._agree_trials(cal, keys, version, start)
        else:
            # rank 0's plan, and its choice of the 2-rank swap, are every rank's
            proposal = (self._propose(keys, size) + [pair_swap_for(state.link, size)] if rank == 0
                        else [0] * (len(keys) + 1))
            indices = cal.broadcast_indices(proposal, version, ps)
            labels = self.labels_from_indices(keys, indices[:-1])
            cal.check_same_plan(labels, version, ps)
            self._use_pair_swap(indices[-1])
            if current is not None and self._framework != "tensorflow" and self.trial_plans > 1:
                self._try_against_the_plan_in_force(start, labels, current, size)
        if current is None or {k: c.label for k, c in current.items()} != labels:
            self._adopt(start, labels, rank, size)
        state.check_seconds["decide"] = time.perf_counter() - t0

    def _adopt(self, start, labels, rank, size):
        """Append ``{key: label}`` to the history as the plan from communication
        ``start``, with this rank's predictions of it; its phases are rebuilt."""
        state = self.plan_state
        keys = sorted(labels)
        choices = plan({k: state.tensors[k] for k in keys}, size, state.link, self.candidates, state.codec_s,
                       (), self.min_gain, state.machine)
        choices = {k: self._choice_as(choices[k], labels[k], k, size) for k in keys}
        state.history.append((start, choices, len(state.history)))
        state.phases = {}
        if "torch" in self._adapters:  # two-phase owners' residuals join the whole tensor's
            self._adapters["torch"].fold_owned_chunks(rank, size)

    # --- trial plans (PyTorch) --------------------------------------------------------
    def _agree_trials(self, cal, keys, version, start):
        """The first decision's plans to time (PyTorch): rank 0's
        :func:`hvd_compress.auto.planner.trial_plans` and 2-rank swap, broadcast as one
        flat list ``[count, swap, indices of plan 1, ..., of plan trial_plans]``
        (``hvdc.auto.plan.trials.<version>``) and hashed on every rank.  Returns
        the first plan's labels; where there are more, they are kept in
        ``trials``, the first running from ``start``."""
        state, (ps, size, rank) = self.plan_state, cal.world()
        width, head = len(keys), 3
        dense = {k: NONE_LABEL for k in keys}
        flat = [0] * (head + self.trial_plans * width)
        if rank == 0:
            index = {c.label: i for i, c in enumerate(self.candidates)}
            found = trial_plans({k: state.tensors[k] for k in keys}, size, state.link, self.candidates,
                                state.codec_s, self.min_gain, state.machine, state.backward_s, self.trial_plans,
                                0.1 * (state.step_s or 0.0))
            dense_ran = (all(state.provisional.get(k, NONE_LABEL) == NONE_LABEL for k in keys)
                         and all(labels != dense for labels, _ in found))
            flat[:head] = [len(found), pair_swap_for(state.link, size), int(dense_ran)]
            for i, (labels, _) in enumerate(found):
                flat[head + i * width:head + (i + 1) * width] = [index[labels[k]] for k in keys]
        flat = cal.broadcast_indices(flat, f"trials.{version}", ps)
        if not 1 <= flat[0] <= self.trial_plans or flat[2] not in (0, 1):
            raise ValueError(f"hvd_compress.Auto: the broadcast trials hold {flat[0]} plans (expected 1 to "
                             f"{self.trial_plans}) and dense flag {flat[2]} (expected 0 or 1)")
        found = [self.labels_from_indices(keys, flat[head + i * width:head + (i + 1) * width])
                 for i in range(flat[0])]
        cal.check_same_plan(found + [flat[2]], f"trials.{version}", ps)
        self._use_pair_swap(flat[1])
        if len(found) > 1 or flat[2]:
            state.trials = [{"labels": labels, "predicted_s": self._predicted_s(labels, size), "start": None,
                             "local_s": None, "step_s": None} for labels in found]
            state.trials[0]["start"] = start
            if flat[2]:
                # the dense plan ran the steps before this decision: its trial is timed
                # on them, as a trial is (the first left out), and costs no step
                before = start - self.trial_steps
                state.trials.append({"labels": dense, "predicted_s": self._predicted_s(dense, size),
                                     "start": before, "local_s": self._trial_step_s(before), "step_s": None,
                                     "before": True})
        # what the trials go on timing from here (nothing where none runs)
        state.trial_stamps = [s for s in state.trial_stamps if s[0] >= start] if state.trials else []
        return found[0]

    def _try_against_the_plan_in_force(self, start, labels, current, size):
        """A re-check's new plan ``labels`` (PyTorch) is a trial against the
        plan in force, not adopted on the prediction alone: the plan in force
        is timed on the last ``trial_steps`` before the re-check at no cost,
        the new plan runs ``trial_steps`` steps from ``start``, and
        :meth:`_pick_trial` keeps the faster.  Why: the first decision's
        trials may have kept a plan the cost model ranks below the one it
        proposes again now (it prices compression's in-step cost low); only
        a measured step that is faster, such as on a link that slowed, moves
        the plan.  Every rank runs this on the broadcast plan, so the
        collectives it adds are named alike everywhere."""
        state = self.plan_state
        in_force = {k: c.label for k, c in current.items()}
        if in_force != labels:
            if state.trials:
                state.earlier_trials.append({"trials": state.trials, "trial_pick": state.trial_pick})
            before = start - self.trial_steps
            state.trials = [{"labels": labels, "predicted_s": self._predicted_s(labels, size), "start": start,
                             "local_s": None, "step_s": None},
                            {"labels": in_force, "predicted_s": self._predicted_s(in_force, size), "start": before,
                             "local_s": self._trial_step_s(before), "step_s": None, "before": True,
                             "in_force": True}]
            state.trial_pick = None
        # what the trial goes on timing from here (nothing where the plan stays)
        state.trial_stamps = [s for s in state.trial_stamps if s[0] >= start] if state.trial_running() else []

    def _predicted_s(self, labels, size):
        """The cost model's seconds a step of the plan ``{key: label}``."""
        state = self.plan_state
        return predicted_total({k: Choice(label, 0.0, 0.0, None) for k, label in labels.items()}, state.tensors,
                               size, state.link, self.candidates, state.codec_s, state.machine, state.backward_s)

    def _next_trial(self, start):
        """At a trial's end, the same communication on every rank: keep this
        rank's step of it (:func:`trial_step_s`), then run the next trial plan from ``start``,
        or after the last adopt the fastest (:meth:`_pick_trial`)."""
        state = self.plan_state
        ran = [t for t in state.trials_run() if t["start"] is not None]
        ran[-1]["local_s"] = self._trial_step_s(ran[-1]["start"])
        waiting = [t for t in state.trials if t["start"] is None]
        if not waiting:
            self._pick_trial(start)
            return
        _, size, rank = self._calibration().world()
        waiting[0]["start"] = start
        self._adopt(start, waiting[0]["labels"], rank, size)

    def _trial_step_s(self, first):
        """This rank's step over a trial from communication ``first``: the
        gaps between the first key's calls, its first step left out (a new
        plan's first step pays new collective names and allocations), as
        :func:`trial_step_s`; None where no gap was timed (its stamps came
        before a resume)."""
        stamps = {int(step): t for step, t in self.plan_state.trial_stamps}
        gaps = [stamps[j + 1] - stamps[j] for j in range(first + 1, first + self.trial_steps)
                if j in stamps and j + 1 in stamps]
        return trial_step_s(gaps) if gaps else None

    def _pick_trial(self, start):
        """After the last trial: the trials' steps averaged over ranks, rank
        0's pick of the fastest (of equals the earlier: predicted better)
        broadcast and hashed, and adopted from ``start``."""
        cal, state = self._calibration(), self.plan_state
        ps, size, rank = cal.world()
        version = f"{len(state.history)}.{start}"
        local = [math.inf if t["local_s"] is None else t["local_s"] for t in state.trials]
        measured = cal.average_over_ranks(local, f"trials.{version}", ps)
        for trial, seconds in zip(state.trials, measured):
            trial["step_s"] = seconds if math.isfinite(seconds) else None
        pick = min(range(len(measured)), key=measured.__getitem__) if rank == 0 else 0
        pick = cal.broadcast_indices([pick], f"trial_pick.{version}", ps)[0]
        if not 0 <= pick < len(state.trials):
            raise ValueError(f"hvd_compress.Auto: the broadcast trial {pick} is not among {len(state.trials)}")
        labels = state.trials[pick]["labels"]
        cal.check_same_plan(labels, f"trial_pick.{version}", ps)
        state.trial_pick, state.trial_stamps = pick, []
        current = state.in_force()
        if {k: c.label for k, c in current.items()} != labels:  # the last trial's plan stays as it is
            self._adopt(start, labels, rank, size)

    def _measure(self, cal, keys, version, size, step_times):
        """Probe the link, time the codecs (first check only: a re-check keeps
        them) and the calibration steps, average them over ranks, and keep
        the link, the host and the costs in the plan state."""
        state, ps = self.plan_state, cal.world()[0]
        first = state.link is None
        host = getattr(cal, "host_machine", None)
        state.machine = host(version, ps) if host is not None else LINK_ONLY
        numels = self.probe_sizes(size)
        t0 = time.perf_counter()
        probes = cal.probe_link(numels, version, ps)
        t1 = time.perf_counter()
        codecs = codec_table(state.tensors, keys, self.candidates, size, self._framework == "tensorflow",
                             self.codec_costs, cal.measure_codecs) if first else []
        state.check_seconds = {**(state.check_seconds or {}), "probe": t1 - t0, "codecs": time.perf_counter() - t1,
                               "probe_numels": list(numels)}
        stamps = state.step_times if step_times is None else step_times
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        spans = [b - a for a, b in state.spans]
        flat = (probes + [statistics.median(gaps) if gaps else 0.0, statistics.median(spans) if spans else 0.0]
                + [v for row in codecs for v in row])
        avg = cal.average_over_ranks(flat, version, ps)
        # probes flat in size show no bandwidth: the early probe's (made before any step) stands in
        known = state.early_link.bytes_per_s if state.early_link is not None else float("inf")
        link = fit_link([4 * n for n in numels], avg[:len(probes)], size, known)
        state.link = with_wait_floor(link, state.machine, size)
        if first:
            state.step_s, state.backward_s = avg[len(probes)], avg[len(probes) + 1]
            width, rest = len(self.candidates), avg[len(probes) + 2:]
            state.codec_s = {k: {c.label: rest[i * width + j] for j, c in enumerate(self.candidates)
                                 if rest[i * width + j] >= 0} for i, k in enumerate(keys)}

    def probe_sizes(self, size):
        """The sizes a check times (:func:`hvd_compress.auto.probe.probe_numels_for`)
        on the link known so far (the last fit, else the early probe's) and
        the host, none larger than the planned tensors together: all agreed
        by collectives, and the tensors the same on every rank (the
        fingerprint check), so every rank probes the same sizes."""
        state = self.plan_state
        most = sum(state.tensors[k][0] for k in self._planned_keys()) or None
        return probe_numels_for(self.probe_numels, state.link or state.early_link, size, state.machine, most)

    def _propose(self, keys, size):
        """Rank 0: candidate indices of the new plan, or of the plan in force
        where the new one is not ``replan_threshold`` faster.  TensorFlow's
        first decision compares with the plan its trace already holds
        (:func:`hvd_compress.auto.tf_auto.traced_plan`), and a plan that needs
        modes the trace lacks, which has the step traced again, is adopted only
        where its saving over 1000 steps pays for that trace
        (:func:`hvd_compress.auto.tf_auto.retrace_pays`)."""
        state = self.plan_state
        tensors = {k: state.tensors[k] for k in keys}
        current, fresh = state.in_force(), None
        if self._framework == "tensorflow" and current is None:  # re-checks: the threshold alone, as in PyTorch
            from .tf_auto import needs_retrace, retrace_pays, traced_plan
            current = traced_plan(self, keys, size)
            fresh = plan(tensors, size, state.link, self.candidates, state.codec_s, (), self.min_gain, state.machine,
                         state.backward_s)
            if needs_retrace(self, fresh) and not retrace_pays(self, current, fresh, keys, size):
                fresh = current  # keep the traced plan
        return propose(tensors, size, state.link, self.candidates, state.codec_s, self.min_gain, current,
                       self.replan_threshold, state.machine, state.backward_s, fresh)

    def _use_pair_swap(self, min_bytes):
        """Switch the 2-rank swap of the torch adapter (:func:`hvd_compress.auto.probe.pair_swap_for`)
        on from ``min_bytes`` up, or off (0); TensorFlow's is fixed when the step is traced."""
        self.plan_state.pair_swap_bytes = int(min_bytes)
        if "torch" in self._adapters:
            self._adapters["torch"].roles.collectives.pair_swap_chosen = int(min_bytes) or None

    def labels_from_indices(self, keys, indices):
        """``{key: candidate label}`` from the broadcast indices."""
        if len(indices) != len(keys) or any(not 0 <= i < len(self.candidates) for i in indices):
            raise ValueError(f"hvd_compress.Auto: the broadcast plan has {len(indices)} entries {indices}, "
                             f"expected {len(keys)} indices below {len(self.candidates)}")
        return {k: self.candidates[i].label for k, i in zip(keys, indices)}

    def _choice_as(self, choice, label, key, size):
        """The broadcast label with this rank's predictions of it."""
        state = self.plan_state
        return choice_as(choice, label, *state.tensors[key], size, state.link, self.candidates,
                         state.codec_s[key], state.machine)

    def _planned_keys(self):
        """The keys a decision plans, sorted: every tensor seen that no rule pins."""
        return sorted(k for k in self.plan_state.tensors if self._pinned(k) is None)

    def _pinned(self, key):
        numel, shape = self.plan_state.tensors[key]
        return next((i for i, r in enumerate(self.rules) if r.matches(key, numel, shape)), None)

    # --- showing, saving --------------------------------------------------------------
    def current_plan(self):
        """``{key: candidate label}`` in force ({} during calibration)."""
        self._sync_tf()
        return {k: c.label for k, c in (self.plan_state.in_force() or {}).items()}

    def describe(self):
        """A table per tensor: chosen scheme, predicted ms (and none's), the
        choice's measured encode + decode ms, bytes per step."""
        self._sync_tf()
        state = self.plan_state
        if not state.history:
            return f"Auto: calibrating ({self.steps_before_plan} steps before the first plan)"
        start, choices, version = state.history[-1]
        head = f"Auto plan version {version}, in force from communication {start}\n"
        return head + format_plan(choices, state.tensors, state.link, state.step_s, state.codec_s) + self._trial_lines()

    def _trial_lines(self):
        """One line per trial plan: its {label: tensors}, its measured step
        (:func:`trial_step_s`) and its predicted communication ('' where no trial ran)."""
        state = self.plan_state
        if not state.trials:
            return ""
        lines = [f"trial plans, {self.trial_steps} steps each (mean step less the slowest third, averaged "
                 f"over ranks, its first step left out):"]
        for i, trial in enumerate(state.trials):
            counts = dict(sorted(collections.Counter(trial["labels"].values()).items()))
            seconds = trial["step_s"] if trial["step_s"] is not None else trial["local_s"]
            measured = ("not timed" if seconds is None else f"{1e3 * seconds:.1f} ms"
                        + (" (this rank)" if trial["step_s"] is None else ""))
            mark = "  <- adopted" if state.trial_pick == i else ""
            when = ((" (the plan in force, the steps before the re-check)" if trial.get("in_force")
                     else " (the steps before the first plan)") if trial.get("before") else "")
            lines.append(f"  {i + 1}. {counts}: step {measured}{when}, predicted communication "
                         f"{1e3 * trial['predicted_s']:.1f} ms{mark}")
        return "\n" + "\n".join(lines)

    def config(self):
        return {"auto": [c.label for c in self.candidates], "rules": [r.config() for r in self.rules],
                "calibration_steps": self.calibration_steps, "warmup_steps": self.warmup_steps,
                "warmup_with": self.warmup_with,
                "dense_below": self.dense_below, "recheck_every": self.recheck_every,
                "trial_plans": self.trial_plans, "trial_steps": self.trial_steps,
                "min_gain": self.min_gain, "replan_threshold": self.replan_threshold,
                "probe_numels": list(self.probe_numels), "seed": self.seed,
                "memory": self.feedback_memory.config(),
                **({"codec_costs": dict(self.codec_costs)} if self.codec_costs is not None else {})}

    def _sync_tf(self):
        """TF: take up a plan restored into the checkpointed variable."""
        if "tensorflow" in self.adapters:
            from .tf_auto import sync_plan
            sync_plan(self)

    def state_dict(self):
        self._sync_tf()
        out = super().state_dict()
        out["auto_plan"] = json.dumps(self.plan_state.to_json())
        return out

    def load_state_dict(self, state, allow_other_rank=False):
        state = dict(state)
        saved = json.loads(state.pop("auto_plan", "null"))
        super().load_state_dict(state, allow_other_rank)
        self._reset_plan()
        if saved is not None:
            self.plan_state = AutoPlan.from_json(saved)
            self._use_pair_swap(self.plan_state.pair_swap_bytes)
        if "tensorflow" in self.adapters:
            from .tf_auto import publish_plan
            publish_plan(self)

    def reset_state(self):
        super().reset_state()
        self._reset_plan()

    def replan_after_reset(self):
        """Elastic Horovod, after a membership change: measure and plan again
        for the new world (dense calibration steps first), keeping every
        residual; the step counters are agreed by the elastic sync."""
        if self._framework == "tensorflow":
            raise ValueError("hvd_compress.Auto under elastic Horovod is supported in PyTorch only "
                             "(hvd_compress.elastic.register refuses it with a TensorFlow state); use a fixed "
                             "scheme such as hvd_compress.TopK(0.01) with hvd.elastic.TensorFlowKerasState")
        self._reset_plan(warmup=False)  # the model is past its warmup: calibrate only

    def _new_adapter(self, framework):
        if framework == "tensorflow":
            from .tf_auto import AutoTFAdapter
            return AutoTFAdapter()
        return super()._new_adapter(framework)

    def __repr__(self):
        return f"Auto(candidates={[c.label for c in self.candidates]}, rules={self.rules!r})"
