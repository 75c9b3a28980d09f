"""Per-layer policies and warmup schedules.  One compression setting for
every layer is a common mistake: small tensors (biases, norms) are bound by
latency and gain nothing from fewer bytes, while a few large matrices carry
most of the traffic; and aggressive compression early in training makes the
first epochs oscillate (Lin et al., DGC, ICLR 2018, warm up for this reason).

Both are Horovod Compression objects themselves (subclasses of
:class:`~hvd_compress.Compressor`), so they go straight into
``compression=``::

    policy = hvd_compress.Policy([
        hvd_compress.Rule(max_numel=16384, compression=hvd_compress.none()),    # small tensors: latency-bound
        hvd_compress.Rule(name=["*bias", "*norm*"], compression=hvd_compress.none()),
        hvd_compress.Rule(name="*embed*", compression=hvd_compress.FP16()),
        hvd_compress.Rule(min_ndim=2, compression=hvd_compress.Schedule.dgc_warmup(
            warmup_steps=200, steps_per_stage=500, final_ratio=0.001)),
    ], default=hvd_compress.Int8())
    print(policy.describe(model.named_parameters()))

Names reach the policy through Horovod's stock optimizers: the torch
parameter names given as ``named_parameters=`` (else Horovod's
``allreduce.noname.<i>``), and TF variable names (``dense/kernel:0``).  Where
no name is available -- a direct ``compress`` call, or Horovod's grouped TF
path -- the key is ``anon:<shape>#<n>`` or ``tensor:<graph tensor name>``:
name patterns then match nothing and only the size/dimension conditions of a
rule decide.
"""
from __future__ import annotations

import fnmatch
import re

from .compressor import Compressor, Phase


def _as_compressor(c, what):
    if not isinstance(c, Compressor):
        raise ValueError(f"{what} must be an hvd_compress compression object such as hvd_compress.TopK(0.01); "
                         f"got {c!r}")
    return c


class Rule:
    """Match tensors by name pattern (glob, or ``re:<regex>``), element count
    and number of dimensions; all given conditions must hold."""

    def __init__(self, compression, name=None, min_numel=None, max_numel=None, min_ndim=None, max_ndim=None):
        self.compression = _as_compressor(compression, "compression")
        if name is not None and not isinstance(name, (str, list, tuple)):
            raise ValueError(f"name must be a glob string, 're:<regex>' or a list of those; got {name!r}")
        names = [name] if isinstance(name, str) else list(name or [])
        for pat in names:
            if not isinstance(pat, str):
                raise ValueError(f"name must be a glob string, 're:<regex>' or a list of those; got {pat!r}")
        # globs must match the whole name; "re:" patterns may match anywhere (re.search)
        self._patterns = [(re.compile(p[3:]), False) if p.startswith("re:") else
                          (re.compile(fnmatch.translate(p)), True) for p in names]
        self.name = names
        for label, v in (("min_numel", min_numel), ("max_numel", max_numel),
                         ("min_ndim", min_ndim), ("max_ndim", max_ndim)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"{label} must be a non-negative integer or None; got {v!r}")
        self.min_numel, self.max_numel, self.min_ndim, self.max_ndim = min_numel, max_numel, min_ndim, max_ndim

    def matches(self, key, numel, shape):
        if self._patterns and not any(p.match(key) if whole else p.search(key) for p, whole in self._patterns):
            return False
        if self.min_numel is not None and numel < self.min_numel:
            return False
        if self.max_numel is not None and numel > self.max_numel:
            return False
        if self.min_ndim is not None and len(shape) < self.min_ndim:
            return False
        if self.max_ndim is not None and len(shape) > self.max_ndim:
            return False
        return True

    def config(self):
        return {"name": self.name, "min_numel": self.min_numel, "max_numel": self.max_numel,
                "min_ndim": self.min_ndim, "max_ndim": self.max_ndim, "compression": self.compression.config()}

    def __repr__(self):
        conds = {k: v for k, v in self.config().items() if v not in (None, []) and k != "compression"}
        return f"Rule({self.compression!r}, {conds})"


class Schedule(Compressor):
    """Phases of compression by communication step: ``[(0, none()),
    (200, TopK(0.25)), (700, TopK(0.0625)), ...]``.

    The step is the tensor's own count of communications, which is the same on
    every rank (each rank compresses each tensor once per communication,
    ``backward_passes_per_step`` included) and is saved with the state.  The
    error-feedback residual carries over between phases.
    """

    def __init__(self, phases, seed=0):
        phases = list(phases)
        if not phases or phases[0][0] != 0:
            raise ValueError("phases must be a non-empty list of (start_step, compression) starting at step 0; "
                             f"got {phases!r}")
        starts = [s for s, _ in phases]
        if any(not isinstance(s, int) or s < 0 for s in starts) or starts != sorted(set(starts)):
            raise ValueError(f"phase start steps must be distinct, increasing non-negative integers; got {starts}")
        self.phases = [(s, _as_compressor(c, "each phase's compression")) for s, c in phases]
        last = self.phases[-1][1]
        super().__init__(last.scheme, last.error_feedback, seed, memory=last.memory)

    @classmethod
    def dgc_warmup(cls, warmup_steps, steps_per_stage, final_ratio=0.001, start_ratio=0.25, factor=4.0,
                   values=None, seed=0, momentum=0.0, nesterov=False):
        """Dense for ``warmup_steps``, then DGC's exponential ramp of Top-K
        ratios (Lin et al. 2018: 25%, 6.25%, 1.5625%, 0.4%, 0.1%), each held
        ``steps_per_stage`` steps, ending at ``final_ratio``.  ``momentum=``
        puts momentum-aware error feedback (:class:`~hvd_compress.MomentumMemory`)
        in every phase, the dense warmup included, and one velocity carries
        through all of them; the optimizer's momentum is then 0."""
        from .factories import NoCompression, TopK
        from .schemes.base import check_range
        check_range("warmup_steps", warmup_steps, 0, None, kind=int)
        check_range("steps_per_stage", steps_per_stage, 1, None, kind=int)
        check_range("factor", factor, 1.0, None, lo_open=True)
        check_range("start_ratio", start_ratio, 0.0, 1.0, lo_open=True)
        check_range("final_ratio", final_ratio, 0.0, 1.0, lo_open=True)
        mom = dict(momentum=momentum, nesterov=nesterov)
        phases = [(0, NoCompression(**mom))] if warmup_steps > 0 else []
        for i, ratio in enumerate(ramp_ratios(final_ratio, start_ratio, factor)):
            phases.append((warmup_steps + i * steps_per_stage, TopK(ratio, values=values, **mom)))
        return cls(phases, seed=seed)

    def plan_for(self, key, numel, shape):
        return [Phase(s, c.scheme, c.memory, c.transport) for s, c in self.phases]

    def config(self):
        return {"schedule": [(s, c.config()) for s, c in self.phases], "seed": self.seed}

    def __repr__(self):
        return "Schedule(" + ", ".join(f"{s}: {c!r}" for s, c in self.phases) + ")"


class Policy(Compressor):
    """First matching :class:`Rule` decides a tensor's compression; ``default``
    (dense by default) covers the rest."""

    def __init__(self, rules, default=None, seed=0):
        from .factories import NoCompression
        self.rules = [r if isinstance(r, Rule) else _bad_rule(r) for r in rules]
        self.default = _as_compressor(default, "default") if default is not None else NoCompression()
        super().__init__(self.default.scheme, self.default.error_feedback, seed, memory=self.default.memory)

    def rule_for(self, key, numel, shape):
        for rule in self.rules:
            if rule.matches(key, numel, shape):
                return rule
        return None

    def plan_for(self, key, numel, shape):
        rule = self.rule_for(key, numel, shape)
        comp = rule.compression if rule is not None else self.default
        return comp.plan_for(key, numel, shape)

    def config(self):
        return {"rules": [r.config() for r in self.rules], "default": self.default.config(), "seed": self.seed}

    def describe(self, named_tensors):
        """A table: each parameter, the rule it got and its expected bytes per
        step (first phase of a schedule).  Accepts torch ``named_parameters()``,
        a list of TF variables, or ``(name, shape)`` pairs."""
        rows = []
        total_dense = total_payload = 0
        for item in named_tensors:
            if isinstance(item, tuple):
                name, t = item
                shape = tuple(t.shape) if hasattr(t, "shape") else tuple(t)
            else:
                name, shape = item.name, tuple(item.shape)
            numel = 1
            for d in shape:
                numel *= int(d)
            rule = self.rule_for(name, numel, shape)
            comp = rule.compression if rule is not None else self.default
            phases = comp.plan_for(name, numel, shape)
            scheme = phases[-1][1]
            payload = scheme.step_nbytes(numel, shape)
            total_dense += 4 * numel
            total_payload += payload or 0
            rows.append((name, "x".join(map(str, shape)) or "scalar", numel,
                         "default" if rule is None else f"rule {self.rules.index(rule)}",
                         repr(comp), payload))
        w = max([len(r[0]) for r in rows] + [9])
        lines = [f"{'parameter':<{w}}  {'shape':>14}  {'elements':>10}  {'rule':>8}  {'bytes/step':>11}  compression"]
        for name, shape, numel, rule, comp, payload in rows:
            pb = "variable" if payload is None else str(payload)
            lines.append(f"{name:<{w}}  {shape:>14}  {numel:>10}  {rule:>8}  {pb:>11}  {comp}")
        ratio = total_dense / total_payload if total_payload else float("nan")
        lines.append(f"total dense fp32 {total_dense} bytes, compressed {total_payload} bytes "
                     f"(final phase; variable-size tensors not counted), ratio {ratio:.1f}x")
        return "\n".join(lines)

    def __repr__(self):
        return f"Policy({self.rules!r}, default={self.default!r})"


def ramp_ratios(final_ratio, start_ratio=0.25, factor=4.0):
    """DGC's exponential ramp of kept fractions (Lin et al. 2018): ``start_ratio``,
    divided by ``factor`` while it stays above ``final_ratio``, then ``final_ratio``
    (0.01: ``[0.25, 0.0625, 0.015625, 0.01]``)."""
    ratios, r = [], start_ratio
    while r > final_ratio * (1 + 1e-9):
        ratios.append(r)
        r /= factor
    return ratios + [final_ratio]


def with_ratio(compression, ratio):
    """``compression`` keeping the ``ratio`` fraction instead: a copy of its scheme
    with that ratio, and the **same** memory object, so the phases of a ramp share one
    residual and one velocity per tensor."""
    import copy
    from .schemes.base import check_range
    check_range("ratio", ratio, 0.0, 1.0, lo_open=True)
    scheme = copy.copy(compression.scheme)
    scheme.ratio = float(ratio)
    return Compressor(scheme, error_feedback=compression.error_feedback, seed=compression.seed,
                      memory=compression.memory, transport=compression.transport)


def recipe(compression, dense_below=1024, warmup_steps=0, dense_names=None, ramp_steps=0):
    """The recipe measured in docs/guide/schemes.md around one scheme: tensors of at
    most ``dense_below`` elements, and those whose name matches ``dense_names``
    (globs or ``re:`` patterns, as :class:`Rule` takes them), are sent dense at
    every step, and every tensor is sent dense for its first ``warmup_steps``
    communications, then with ``compression``.

    Why: small tensors (biases, norm scales) are a few percent of the bytes, and
    compressing them costs accuracy for nothing; aggressive compression in the first
    steps makes training oscillate (Lin et al., ICLR 2018, warm up DGC for the same
    reason).  On the row transformer the two took Top-K(0.01) from 11.6 points below
    dense to within the seed spread.

    ``ramp_steps``: after the dense warmup, a sparsifier (TopK, DGC, RandomK) keeps
    25%, 6.25%, ... for ``ramp_steps`` communications each, then its own ratio
    (:func:`ramp_ratios`; DGC's "warm-up training").  Why: from dense straight to 1%,
    error feedback suddenly holds back 99% of each tensor (docs/guide/schemes.md).

    ``dense_names``: the input layers (embeddings, positions) every token passes
    through.  A sparsifier sends a few of their values a step and error feedback
    holds the rest back; sending the transformer's 1792-element embedding and
    positions dense took Top-K(0.01) from 1.00 points below dense to 0.47 above
    (docs/guide/schemes.md).  Names reach the policy through Horovod's stock optimizers
    and ``DistributedGradientTape`` (torch: with ``named_parameters=``); check the
    match with ``recipe(...).describe(model.named_parameters())``.

    The dense parts apply the momentum of ``compression``'s memory
    (``TopK(0.01, momentum=0.9)``, ``DGC(..., momentum=0.9)``): the optimizer has
    none then, so without it they would run without momentum.  Returns a
    :class:`Policy` (a compression object for Horovod)::

        hc.recipe(hc.TopK(0.01, momentum=0.9), dense_below=1024, warmup_steps=63)
        # == Policy([Rule(none(momentum=0.9), max_numel=1024)],
        #           default=Schedule([(0, none(momentum=0.9)), (63, TopK(0.01, momentum=0.9))]))
    """
    from .factories import NoCompression
    from .schemes.base import check_range
    if type(compression) is not Compressor:  # Policy, Schedule and Auto are subclasses
        raise ValueError("compression must be one scheme's compression object such as "
                         f"hvd_compress.TopK(0.01, momentum=0.9), not a Policy, Schedule or Auto; got {compression!r}")
    check_range("dense_below", dense_below, 0, None, kind=int)
    check_range("warmup_steps", warmup_steps, 0, None, kind=int)
    dense_names = _name_patterns("dense_names", dense_names)
    momentum = float(getattr(compression.memory, "momentum", 0.0) or 0.0)
    nesterov = bool(getattr(compression.memory, "nesterov", False))
    dense = NoCompression(momentum=momentum, nesterov=nesterov, seed=compression.seed)
    default = _warmed_up(compression, dense, warmup_steps, ramp_steps)
    rules = ([Rule(dense, max_numel=dense_below)] if dense_below else []) + \
        ([Rule(dense, name=dense_names)] if dense_names else [])
    return Policy(rules, default=default, seed=compression.seed)


def _warmed_up(compression, dense, warmup_steps, ramp_steps):
    """``compression`` after ``warmup_steps`` of ``dense`` and a ratio ramp of ``ramp_steps`` a stage
    (a :class:`Schedule`), or ``compression`` itself where there is neither."""
    from .schemes.base import check_range
    check_range("ramp_steps", ramp_steps, 0, None, kind=int)
    if ramp_steps and not hasattr(compression.scheme, "ratio"):
        raise ValueError("ramp_steps ramps a sparsifier's ratio: it needs TopK, DGC or RandomK; "
                         f"got {compression!r}")
    ratios = ramp_ratios(compression.scheme.ratio) if ramp_steps else [None]
    phases = [(warmup_steps + i * ramp_steps, with_ratio(compression, r) if r != ratios[-1] else compression)
              for i, r in enumerate(ratios)]
    phases = ([(0, dense)] if warmup_steps else []) + phases
    return Schedule(phases, seed=compression.seed) if len(phases) > 1 else compression


def _name_patterns(param, names):
    """``names`` (None, one pattern, or a non-empty list of them) as a list, or a ValueError naming ``param``."""
    if isinstance(names, str):
        names = [names]
    if names is not None and (not isinstance(names, (list, tuple)) or not names
                              or not all(isinstance(n, str) and n for n in names)):
        raise ValueError(f"{param} must be None or a non-empty list of glob strings ('*embed*') or "
                         f"'re:<regex>' patterns; got {names!r}")
    return list(names) if names is not None else None


def _bad_rule(r):
    raise ValueError(f"rules must be hvd_compress.Rule instances; got {r!r}")
