"""Which candidate each tensor takes so that the *step* is fastest, by the one
cost model (:mod:`hvd_compress.costmodel.model`); ``Auto``'s planner and
``hvd-compress advise`` both choose here.

Why not tensor by tensor: Horovod fuses a step's collectives of one kind
(the fp32 allreduces, the allgathers, two-phase's rounds, PowerSGD's P and Q
rounds), so a transport's rounds cost their latency and their wait for a
core once per step, however many tensors use them.  Charged to each tensor
(:attr:`~hvd_compress.costmodel.model.TensorCost.marginal_s`), PowerSGD's two
extra rounds on a model of ``M`` matrices look ``M`` times as dear as they
are; where latency dominates (many ranks, ranks sharing cores) the
tensor-by-tensor choice then prefers a scheme with fewer rounds and more
bytes.  Here each tensor is charged only what is its own
(:attr:`~hvd_compress.costmodel.model.TensorCost.own_s`), and each set of
transports a step may use is scored whole by
:func:`~hvd_compress.costmodel.model.step_cost`.

The search is exact over the candidates that matter: every subset of the
candidates that win some tensor (by their own cost, or charged their rounds
in full), each tensor taking the cheapest of the subset where it beats
``none`` by the margin, the plan whose step is cheapest winning.  A second
plan per subset puts every tensor on the subset wherever one of it applies:
dense tensors among compressed ones cost a fused allreduce round of their
own (:data:`hvd_compress.costmodel.model.PLACEHOLDER_GROUP`), which at many
ranks can outweigh compressing the small ones.  ``min_gain`` is the margin against the model's
error, twice:

* per tensor, a compressed candidate is taken only where its own cost is at
  least ``min_gain`` below ``none``'s;
* per step, each candidate a plan uses beyond a smaller plan's must make the
  step at least ``min_gain`` faster, and so must the second plan of a subset
  against its first.  Every transport a step adds brings
  collectives and Horovod cycles of its own, which cost most where the model
  is least sure (ranks sharing cores).  Measured on 4 emulated hosts sharing
  2 cores at 100 Mbit/s: a plan of PowerSGD(4) on the two large weights and
  allgather Top-K on three small tensors, predicted 8% faster than PowerSGD(4)
  alone, ran at 221 ms a step against PowerSGD(4)'s 141 ms
  (docs/results/scale_measured.json).
"""
from __future__ import annotations

from itertools import combinations
from typing import Dict, List, Sequence

from .model import LINK_ONLY, Machine, TensorCost, step_cost

#: at most this many candidates (besides ``none``) enter the subset search
#: (2**8 step evaluations); beyond it, those that win the most tensors
MAX_SEARCHED = 8


def _cheapest(options: Dict[str, TensorCost], allowed, none_label, keep) -> str:
    """The label of ``allowed`` with the least own cost; a compressed one only
    where it is below ``keep`` x ``none``'s own cost."""
    base = options[none_label].own_s
    best, best_s = none_label, base
    for label in allowed:
        cost = options.get(label)
        if cost is None or label == none_label:
            continue
        if cost.own_s <= base * keep and cost.own_s < best_s:
            best, best_s = label, cost.own_s
    return best


def _without_none(options: Dict[str, TensorCost], allowed, none_label) -> str:
    """The label of ``allowed`` with the least own cost, ``none`` only where
    none of them may carry the tensor: the plan that keeps a step's dense
    tensors off the link where each of them would cost little compressed, but
    would cost a fused allreduce round of their own (see the module docstring)."""
    usable = [label for label in allowed if label != none_label and label in options]
    return min(usable, key=lambda label: options[label].own_s) if usable else none_label


def _subset_plans(options: Sequence[Dict[str, TensorCost]], subset, none_label, keep) -> List[List[str]]:
    """The plans a subset of candidates makes: each tensor on the cheapest of
    them where it beats ``none`` by the margin, then (where that differs)
    each tensor on the cheapest of them wherever one applies."""
    with_none = [_cheapest(opts, subset, none_label, keep) for opts in options]
    without = [_without_none(opts, subset, none_label) for opts in options]
    return [with_none] if without == with_none else [with_none, without]


def _searched(options: Sequence[Dict[str, TensorCost]], order, none_label, keep) -> List[str]:
    """The candidates worth a subset: each one that wins some tensor by its own
    cost or by its cost with its rounds in full, in ``order``."""
    wins: Dict[str, int] = {}
    for opts in options:
        for label in (_cheapest(opts, order, none_label, keep),
                      min(opts, key=lambda k: (opts[k].marginal_s, order.index(k) if k in order else 0))):
            if label != none_label:
                wins[label] = wins.get(label, 0) + 1
    ranked = sorted(wins, key=lambda k: (-wins[k], order.index(k) if k in order else len(order)))
    kept = set(ranked[:MAX_SEARCHED])
    return [k for k in order if k in kept]


def plan_step(options: Sequence[Dict[str, TensorCost]], machine: Machine = LINK_ONLY, min_gain=0.1,
              none_label="none", order: Sequence[str] = (), backward_s: float = 0.0) -> List[str]:
    """One label per tensor (``options[i]``: ``{label: TensorCost}`` of the
    candidates that may carry tensor ``i``, ``none_label`` among them) whose
    step has the least :func:`~hvd_compress.costmodel.model.step_cost` on
    ``machine`` (the link's time hidden up to ``backward_s``).  ``order``: the
    candidates' order, for ties (default: as they first appear)."""
    if not 0.0 <= min_gain < 1.0:
        raise ValueError(f"min_gain must be in [0, 1); got {min_gain!r}")
    for i, opts in enumerate(options):
        if none_label not in opts:
            raise ValueError(f"options[{i}] lacks the {none_label!r} candidate; it has {sorted(opts)}")
    order = list(order) or list(dict.fromkeys(k for opts in options for k in opts))
    keep = 1.0 - min_gain
    searched = _searched(options, order, none_label, keep)
    best_labels, best_size = [none_label] * len(options), 0
    best_s = step_cost([opts[none_label] for opts in options], machine, backward_s).seconds
    for size in range(1, len(searched) + 1):
        for subset in combinations(searched, size):
            bar = float("inf")  # the plan without `none` must pay min_gain of the one with it
            for labels in _subset_plans(options, subset, none_label, keep):
                seconds = step_cost([opts[k] for opts, k in zip(options, labels)], machine, backward_s).seconds
                valid = set(labels) == set(subset) | ({none_label} & set(labels))  # else a smaller subset's
                # each candidate beyond the best plan's must pay min_gain of the step
                if valid and seconds < min(bar, best_s * keep ** (size - best_size)) * (1.0 - 1e-12):
                    best_labels, best_s, best_size = labels, seconds, size
                bar = seconds * keep
    return best_labels
