"""``hvd_compress.Auto()``: each tensor's scheme chosen online from the
measured link and encode cost (PyTorch and TensorFlow).

Life of an ``Auto``:

1. **Calibrate** (the first ``calibration_steps`` communications of each
   tensor) while the step time is measured.  At the first ``compress``
   every rank times a few small allreduces and fits the link; a tensor on
   which a plain allreduce clearly loses there is calibrated with a safe
   compressed candidate and error feedback
   (:func:`hvd_compress.auto.provisional.provisional_choice`), the others dense
   (``calibrate_compressed=False``: all dense).
2. **Decide** at the first ``compress`` of the next step, on every rank:
   time blocking allreduces of ``probe_numels`` elements
   (:func:`hvd_compress.auto.probe.probe_numels_for`; fit of latency and
   bandwidth, :func:`hvd_compress.auto.planner.fit_link`, the latency at least the
   wait for a core where ranks share them, :func:`hvd_compress.costmodel.machine.with_wait_floor`) and each candidate's
   error feedback + encode + decode on every distinct tensor shape (``none``:
   0, not timed); average them over ranks (one allreduce); rank 0 plans the step
   (:func:`hvd_compress.auto.planner.plan`) and broadcasts candidate indices in sorted key
   order; every rank allgathers a hash of the plan it is about to apply and raises
   :class:`~hvd_compress.auto.planner.PlanMismatchError` where they differ.
3. **Re-check** every ``recheck_every`` steps: re-probe the link (the codec
   costs are kept) and adopt rank 0's new plan where it is predicted more
   than ``replan_threshold`` faster than the plan in force.

Every lossy candidate runs with plain error feedback and one residual per
tensor that carries across changes of scheme; ``none`` runs without (exactly
plain Horovod) after one step that sends a left-over residual out in full:
``sum(sent) + residual == sum(gradients)`` holds across re-plans.  A plan
version is a phase, as in :class:`~hvd_compress.Schedule` (side collectives ``<key>@<version>``).

**TensorFlow** (:mod:`hvd_compress.auto.tf_auto`) runs the same life inside a
graph traced once: codecs timed at the first trace, every candidate behind a
per-tensor mode switch, measurements and agreement in a host callback.

Only the global process set, one framework per ``Auto``; tensors first seen after calibration are not planned.
"""
from __future__ import annotations

import json
import statistics
import threading
import time

from . import saved_plan
from .planner import (NONE_LABEL, check_codec_costs, choice_as, codec_table, default_candidates, fit_link,
                      format_plan, plan, propose)
from .probe import DEFAULT_PROBE_NUMELS, EARLY_PROBE_NUMELS, probe_numels_for
from .provisional import provisional_candidates, provisional_choice
from ..compressor import Compressor, Phase
from ..costmodel.model import LINK_ONLY
from ..costmodel.machine import with_wait_floor
from ..feedback.memory import ResidualMemory
from ..schemes.base import check_range



class Auto(Compressor):
    """Per-tensor compression chosen from measurements; see the module
    docstring, which also says how TensorFlow differs and its limits there.

    Args:
        rules: :class:`~hvd_compress.Rule` s that pin tensors (they win over the planner).
        calibration_steps: steps before the first plan (>= 1), dense or with a
            safe compressed candidate (``calibrate_compressed``); they time the
            step, which the plan does not use.
        recheck_every: steps between re-checks of the link (0: never).
        topk_ratios, min_topk_ratio, powersgd_rank, include_sign: the
            candidates (:func:`hvd_compress.auto.planner.default_candidates`); raise
            ``min_topk_ratio`` if accuracy suffers.
        min_gain: a compressed scheme must be predicted this much faster than
            ``none`` for a tensor (0.1 = 10%).
        replan_threshold: a re-check adopts a new plan only if it is predicted
            this much faster than the plan in force.
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
            + encode + decode on every distinct tensor shape at the first
            decision.  A dict ``{candidate label: seconds per element}`` is
            used instead of those timings: the plan then depends on the link
            alone, the same on any machine (a reproducible plan, or a test of
            the decisions).  A candidate without a cost is not chosen;
            ``none`` without one costs 0.
        calibrate_compressed: probe the link at the first ``compress`` and
            calibrate the tensors a plain allreduce clearly loses on with a
            safe compressed candidate (PyTorch; TensorFlow calibrates dense).
        two_phase: also offer each allgather scheme that can travel by the
            two-phase exchange as a candidate ``"<label>/two_phase"``, so the
            cost model chooses the transport by the number of ranks
            (PyTorch; TensorFlow never chooses the two-phase candidates).
    """

    def __init__(self, rules=(), calibration_steps=3, recheck_every=1000, topk_ratios=(0.1, 0.01),
                 min_topk_ratio=0.01, powersgd_rank=4, include_sign=False, min_gain=0.1, replan_threshold=0.1,
                 probe_numels=DEFAULT_PROBE_NUMELS, exclude=(), seed=0, momentum=0.0, nesterov=False,
                 codec_costs=None, calibrate_compressed=True, two_phase=True):
        from ..feedback.memory import MomentumMemory, momentum_memory
        from ..policy import Rule
        from ..schemes import NoCompression
        self.rules = list(rules)
        for r in self.rules:
            if not isinstance(r, Rule):
                raise ValueError(f"rules must be hvd_compress.Rule instances; got {r!r}")
        self.calibration_steps = check_range("calibration_steps", calibration_steps, 1, None, kind=int)
        self.recheck_every = check_range("recheck_every", recheck_every, 0, None, kind=int)
        self.min_gain = check_range("min_gain", min_gain, 0.0, 1.0, hi_open=True)
        self.replan_threshold = check_range("replan_threshold", replan_threshold, 0.0, 1.0, hi_open=True)
        if not isinstance(probe_numels, (list, tuple)) or len(set(probe_numels)) < 2:
            raise ValueError(f"probe_numels must list at least two distinct sizes; got {probe_numels!r}")
        for n in probe_numels:
            check_range("probe_numels", n, 1, None, kind=int)
        self.probe_numels = tuple(probe_numels)
        candidates = default_candidates(topk_ratios, min_topk_ratio, powersgd_rank, include_sign,
                                        two_phase=two_phase)
        labels = [c.label for c in candidates]
        if isinstance(exclude, str) or any(e not in labels[1:] for e in exclude):
            raise ValueError(f"exclude must be a list of candidate labels among {labels[1:]}; got {exclude!r}")
        # excluding a scheme excludes its two-phase candidate too
        self.candidates = [c for c in candidates if c.label not in exclude and c.base_label not in exclude]
        #: what a tensor may be calibrated with (built once: its phases hold these schemes)
        self._provisional_candidates = provisional_candidates(self.candidates)
        self.codec_costs = check_codec_costs(codec_costs, labels)
        if not isinstance(calibrate_compressed, bool):
            raise ValueError(f"calibrate_compressed must be True or False; got {calibrate_compressed!r}")
        self.calibrate_compressed = calibrate_compressed
        # the lossy phases keep a residual; the dense ones keep only the velocity, if any
        self._feedback = momentum_memory(NoCompression(), momentum, nesterov, error_feedback=True) or ResidualMemory()
        self._dense_memory = MomentumMemory(momentum, nesterov, error_feedback=False) if momentum else None
        super().__init__(NoCompression(), error_feedback=True, seed=seed, memory=self._feedback)
        self._process_set_checked = False
        self._framework = None
        self._tf_lock = threading.Lock()  # the TF host callbacks of one step
        self._tf_codec_local = {}  # TF: shape -> this rank's codec seconds per candidate, timed at the trace
        self._reset_plan()

    def _reset_plan(self):
        self.tensors = {}  # key -> (numel, shape), as first seen
        self._calls = {}  # key -> compress calls so far
        self._next_check = self.calibration_steps + 1
        self._step_times = []  # perf_counter at each call of the first key seen
        self.step_s = None
        self.codec_s = {}  # key -> {label: seconds}, averaged over ranks
        self.link = None
        self.machine = LINK_ONLY  # the host at the last check (host.machine_of)
        #: [(start, {key: Choice}, version)]: the plans adopted so far, in order
        self.history = []
        self._phases = {}
        self._tf_decided = self._tf_error = None  # TF: the check step decided last, and its error
        self._tf_plan_json = ""  # TF: the plan as last written to or read from its variable
        #: the early probe's link (None: not probed); each tensor's calibration label
        self.early_link = None
        self.provisional = {}
        self.check_seconds = None
        #: what measures and agrees (None: :mod:`hvd_compress.auto.calibration`, PyTorch)
        self._cal = None

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
        shape = tuple(int(d) for d in shape)
        self.tensors.setdefault(key, (int(numel), shape))
        if self._framework == "tensorflow":  # traced: the mode is chosen when the step runs
            from .tf_auto import modes
            return modes(self)
        calls = self._calls[key] = self._calls.get(key, 0) + 1
        if calls == 1 and not self.history and key not in self.provisional:
            self._calibrate_with(key, numel, shape)
        if key == next(iter(self.tensors)) and calls <= self.calibration_steps + 1:
            self._step_times.append(time.perf_counter())
        if self._next_check and calls >= self._next_check:
            self._decide(calls - 1)
            self._next_check = calls + self.recheck_every if self.recheck_every else 0
        return self._phases_of(key)

    def _phases_of(self, key):
        """The key's phases: dense first, then one per plan version.  ``none``
        runs without error feedback (exactly plain Horovod), except for one
        step after a lossy phase, in which it sends the residual out in full."""
        phases = self._phases.get(key)
        if phases is None:
            by_label = {c.label: c for c in self._provisional_candidates + self.candidates}
            first = self.provisional.get(key, NONE_LABEL)
            lossy_before = first != NONE_LABEL
            phases = [Phase(0, by_label[first].scheme, self._feedback if lossy_before else self._dense_memory,
                            by_label[first].transport)]
            for start, choices, _ in self.history:
                label = choices[key].label if key in choices else NONE_LABEL
                scheme = by_label[label].scheme
                if label != NONE_LABEL:
                    phases.append(Phase(start, scheme, self._feedback, by_label[label].transport))
                elif lossy_before:  # flush the residual once, then plain
                    phases += [Phase(start, scheme, self._feedback, "allgather"),
                               Phase(start + 1, scheme, self._dense_memory, "allgather")]
                else:
                    phases.append(Phase(start, scheme, self._dense_memory, "allgather"))
                lossy_before = label != NONE_LABEL
            self._phases[key] = phases
        return phases

    # --- calibrating ------------------------------------------------------------------
    def _calibration(self):
        if self._cal is None:
            from . import calibration
            return calibration
        return self._cal

    def _calibrate_with(self, key, numel, shape):
        """Choose the candidate ``key`` is calibrated with (at its first call,
        before any plan): probe the link once (at the first ``compress`` of
        this Auto on every rank, where the fingerprint check blocks too), then
        :func:`hvd_compress.auto.provisional.provisional_choice`."""
        cal = self._calibration()
        if not self.calibrate_compressed or not cal.ready():
            self.provisional[key] = NONE_LABEL
            return
        ps, size, _ = cal.world()
        if self.early_link is None:
            probes = cal.probe_early(EARLY_PROBE_NUMELS, ps)
            avg = cal.average_over_ranks(probes, "early", ps)
            self.early_link = fit_link([4 * n for n in EARLY_PROBE_NUMELS], avg, size)
        self.provisional[key] = provisional_choice(numel, shape, size, self.early_link, self.candidates)
        self._phases.pop(key, None)

    # --- deciding ---------------------------------------------------------------------
    def _decide(self, start, cal=None, step_times=None):
        """Measure, agree and (maybe) adopt a plan; the same steps on every rank.
        ``cal``: the framework's measurements (default :mod:`hvd_compress.auto.calibration`,
        PyTorch); ``step_times``: clock readings of the calibration steps."""
        if cal is None:
            cal = self._calibration()
        ps, size, rank = cal.world()
        version = len(self.history)
        keys = sorted(k for k in self.tensors if self._pinned(k) is None)
        first = self.link is None
        numels = self.probe_sizes(size)
        t0 = time.perf_counter()
        probes = cal.probe_link(numels, f"{version}.{start}", ps)
        t1 = time.perf_counter()
        codecs = codec_table(self.tensors, keys, self.candidates, size, self._framework == "tensorflow",
                             self.codec_costs, cal.measure_codecs) if first else []  # a re-check keeps them
        #: this rank's seconds in the last check: probing the link, timing the codecs
        self.check_seconds = {"probe": t1 - t0, "codecs": time.perf_counter() - t1, "probe_numels": list(numels)}
        stamps = self._step_times if step_times is None else step_times
        gaps = [b - a for a, b in zip(stamps, stamps[1:])]
        step_s = statistics.median(gaps) if gaps else 0.0
        flat = probes + [step_s] + [v for row in codecs for v in row]
        avg = cal.average_over_ranks(flat, f"{version}.{start}", ps)
        # probes flat in size show no bandwidth: the early probe's (made before any step) stands in
        known = self.early_link.bytes_per_s if self.early_link is not None else float("inf")
        self.link = fit_link([4 * n for n in numels], avg[:len(probes)], size, known)
        host = getattr(cal, "host_machine", None)
        self.machine = host(f"{version}.{start}", ps) if host is not None else LINK_ONLY
        self.link = with_wait_floor(self.link, self.machine, size)
        if first:
            self.step_s = avg[len(probes)]
            width = len(self.candidates)
            rest = avg[len(probes) + 1:]
            self.codec_s = {k: {c.label: rest[i * width + j] for j, c in enumerate(self.candidates)
                                if rest[i * width + j] >= 0} for i, k in enumerate(keys)}
        proposal = self._propose(keys, size) if rank == 0 else [0] * len(keys)
        indices = cal.broadcast_indices(proposal, f"{version}.{start}", ps)
        labels = self.labels_from_indices(keys, indices)
        cal.check_same_plan(labels, f"{version}.{start}", ps)
        current = self.history[-1][1] if self.history else None
        if current is None or {k: c.label for k, c in current.items()} != labels:
            choices = plan({k: self.tensors[k] for k in keys}, size, self.link, self.candidates, self.codec_s,
                           (), self.min_gain, self.machine)
            choices = {k: self._choice_as(choices[k], labels[k], k, size) for k in keys}
            self.history.append((start, choices, version))
            self._phases = {}
            if "torch" in self._adapters:  # two-phase owners' residuals join the whole tensor's
                self._adapters["torch"].fold_owned_chunks(rank, size)

    def probe_sizes(self, size):
        """The sizes a check times (:func:`hvd_compress.auto.probe.probe_numels_for`)
        on the link known so far: the last fit, else the early probe's; both
        averaged over ranks, so every rank probes the same sizes."""
        return probe_numels_for(self.probe_numels, self.link or self.early_link, size)

    def _propose(self, keys, size):
        """Rank 0: candidate indices of the new plan, or of the plan in force
        where the new one is not ``replan_threshold`` faster."""
        current = self.history[-1][1] if self.history else None
        return propose({k: self.tensors[k] for k in keys}, size, self.link, self.candidates, self.codec_s,
                       self.min_gain, current, self.replan_threshold, self.machine)

    def labels_from_indices(self, keys, indices):
        """``{key: candidate label}`` from the broadcast indices."""
        if len(indices) != len(keys) or any(not 0 <= i < len(self.candidates) for i in indices):
            raise ValueError(f"hvd_compress.Auto: the broadcast plan has {len(indices)} entries {indices}, "
                             f"expected {len(keys)} indices below {len(self.candidates)}")
        return {k: self.candidates[i].label for k, i in zip(keys, indices)}

    def _choice_as(self, choice, label, key, size):
        """The broadcast label with this rank's predictions of it."""
        return choice_as(choice, label, *self.tensors[key], size, self.link, self.candidates, self.codec_s[key],
                         self.machine)

    def _pinned(self, key):
        numel, shape = self.tensors[key]
        return next((i for i, r in enumerate(self.rules) if r.matches(key, numel, shape)), None)

    # --- showing, saving --------------------------------------------------------------
    def current_plan(self):
        """``{key: candidate label}`` in force ({} during calibration)."""
        self._sync_tf()
        return {k: c.label for k, c in self.history[-1][1].items()} if self.history else {}

    def describe(self):
        """A table per tensor: chosen scheme, predicted ms (and none's), the
        choice's measured encode + decode ms, bytes per step."""
        self._sync_tf()
        if not self.history:
            return f"Auto: calibrating ({self.calibration_steps} steps before the first plan)"
        start, choices, version = self.history[-1]
        head = f"Auto plan version {version}, in force from communication {start}\n"
        return head + format_plan(choices, self.tensors, self.link, self.step_s, self.codec_s)

    def config(self):
        return {"auto": [c.label for c in self.candidates], "rules": [r.config() for r in self.rules],
                "calibration_steps": self.calibration_steps, "recheck_every": self.recheck_every,
                "min_gain": self.min_gain, "replan_threshold": self.replan_threshold,
                "probe_numels": list(self.probe_numels), "seed": self.seed,
                "memory": self._feedback.config(),
                **({"codec_costs": dict(self.codec_costs)} if self.codec_costs is not None else {})}

    def _sync_tf(self):
        """TF: take up a plan restored into the checkpointed variable."""
        if "tensorflow" in self.adapters:
            from .tf_auto import sync_plan
            sync_plan(self)

    def state_dict(self):
        self._sync_tf()
        out = super().state_dict()
        out["auto_plan"] = json.dumps(saved_plan.plan_state(self))
        return out

    def load_state_dict(self, state, allow_other_rank=False):
        state = dict(state)
        saved = json.loads(state.pop("auto_plan", "null"))
        super().load_state_dict(state, allow_other_rank)
        self._reset_plan()
        if saved is not None:
            saved_plan.load_plan(self, saved)
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
        self._reset_plan()

    def _new_adapter(self, framework):
        if framework == "tensorflow":
            from .tf_auto import AutoTFAdapter
            return AutoTFAdapter()
        return super()._new_adapter(framework)

    def __repr__(self):
        return f"Auto(candidates={[c.label for c in self.candidates]}, rules={self.rules!r})"
