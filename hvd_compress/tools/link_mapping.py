"""Links of the emulated cluster that stand for real clusters.

Our CPU ranks compute slowly and our models are small, so a raw 1 Gbit/s link between
emulated hosts gives the wrong ratio of communication to compute.  For a model of ours we
choose instead the link rate at which dense training's communication-to-compute ratio, by the
project's one cost model (:mod:`hvd_compress.costmodel.model`, through
:func:`hvd_compress.tools.advise.advise`), equals that of a named real setup:

* the real setup's ratio: ``none``'s predicted step communication for the architecture's
  tensors (:mod:`hvd_compress.tools.projection`: ResNet-50, BERT-large) on ``workers`` A100s
  with NCCL at the link rate, ``REFERENCE_LATENCY_S`` a ring step, over its compute per step;
* ours: ``none``'s predicted communication for our model's tensors on the emulated cluster
  (``workers`` ranks sharing this machine's cores, Gloo's CPU work: ``advise.CPU_GLOO``), at a
  latency measured on the cluster, over our measured compute-only step.

:func:`link_for_ratio` solves ours = theirs for the rate by bisection (the communication falls
monotonically as the rate rises).  Where even the fastest rate leaves ours above theirs (our
latency and Gloo's CPU work alone are too large) there is no such rate: the mapping says so,
and the row runs on the unshaped link.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

#: the real setups a link can stand for: the projection's architectures on 8 A100s
REFERENCE_MODELS = ("resnet50", "bert-large")
REFERENCE_GBIT = {"1gbit": 1, "10gbit": 10, "100gbit": 100}
REFERENCE_WORKERS = 8
#: the fastest rate the bisection tries, and the slowest
MAX_MBIT = 100_000.0
MIN_MBIT = 1.0


def reference_ratio(model: str, gbit: float, workers: int = REFERENCE_WORKERS) -> float:
    """Dense communication / compute of ``model`` (a key of ``projection.MODELS``) on
    ``workers`` A100s with NCCL at ``gbit`` Gbit/s, by the cost model."""
    from ..costmodel.model import GPU_NCCL
    from . import advise
    from .projection import MODELS, REFERENCE_LATENCY_S, gpu_codec
    if model not in MODELS:
        raise ValueError(f"model must be one of {sorted(MODELS)}; got {model!r}")
    m = MODELS[model]
    adv = advise.advise(m.layers(), workers, gbit * 1e9 / 8, REFERENCE_LATENCY_S, None, ["none"], 0.1, GPU_NCCL,
                        codec_of=gpu_codec)
    return adv.totals["none"]["total_s"] / m.compute_s


def emulated_comm_s(layer_numels: Sequence[int], workers: int, mbit: float, latency_s: float, machine=None) -> float:
    """``none``'s predicted communication per step of a model with these tensors on the
    emulated cluster at ``mbit`` Mbit/s (``machine``: default, ``workers`` ranks on this
    machine's cores with Gloo's CPU work)."""
    from . import advise
    machine = machine if machine is not None else emulated_machine(workers)
    layers = [(f"t{i}", int(n)) for i, n in enumerate(layer_numels)]
    adv = advise.advise(layers, workers, mbit * 1e6 / 8, latency_s, None, ["none"], 0.1, machine)
    return adv.totals["none"]["total_s"]


def emulated_machine(workers: int, cpus: Optional[int] = None):
    """The emulated cluster's machine: every rank on this machine's cores, Gloo's CPU costs."""
    import os
    from ..costmodel.model import shared_host
    from .advise import CPU_GLOO
    return shared_host(workers, cpus or os.cpu_count(), CPU_GLOO)


@dataclass(frozen=True)
class Mapping:
    """The rate (Mbit/s; None: none reaches the ratio, run unshaped) at which our dense
    ratio equals ``target_ratio``, and the ratio reached there."""
    stands_for: str
    target_ratio: float
    link_mbit: Optional[float]
    ratio_at_link: float
    why: str = ""


def link_for_ratio(target_ratio: float, comm_at, compute_s: float, stands_for: str = "",
                   lo: float = MIN_MBIT, hi: float = MAX_MBIT, iterations: int = 60) -> Mapping:
    """The rate in [lo, hi] Mbit/s at which ``comm_at(rate) / compute_s`` equals
    ``target_ratio`` (3 significant digits).  ``comm_at`` must fall as the rate rises."""
    if not (target_ratio > 0 and compute_s > 0):
        raise ValueError(f"target_ratio and compute_s must be > 0; got {target_ratio!r}, {compute_s!r}")
    if comm_at(hi) / compute_s > target_ratio:
        return Mapping(stands_for, target_ratio, None, comm_at(hi) / compute_s,
                       f"even at {hi:g} Mbit/s dense communication is {comm_at(hi) / compute_s:.3g}x compute "
                       f"(latency and CPU work alone): no rate gives {target_ratio:.3g}x; unshaped")
    if comm_at(lo) / compute_s < target_ratio:
        return Mapping(stands_for, target_ratio, lo, comm_at(lo) / compute_s, f"slower than {lo:g} Mbit/s needed")
    a, b = math.log(lo), math.log(hi)
    for _ in range(iterations):
        mid = 0.5 * (a + b)
        if comm_at(math.exp(mid)) / compute_s > target_ratio:
            a = mid
        else:
            b = mid
    rate = float(f"{math.exp(0.5 * (a + b)):.3g}")
    return Mapping(stands_for, target_ratio, rate, comm_at(rate) / compute_s)


def map_links(layer_numels, workers, compute_s, latency_s, links=("1gbit", "10gbit", "100gbit"),
              references=REFERENCE_MODELS, machine=None):
    """{reference: {link: Mapping}} for our model (its tensors, measured compute and latency)."""
    def comm_at(mbit):
        return emulated_comm_s(layer_numels, workers, mbit, latency_s, machine)
    out = {}
    for ref in references:
        out[ref] = {}
        for link in links:
            if link not in REFERENCE_GBIT:
                raise ValueError(f"link must be one of {sorted(REFERENCE_GBIT)}; got {link!r}")
            ratio = reference_ratio(ref, REFERENCE_GBIT[link])
            out[ref][link] = link_for_ratio(ratio, comm_at, compute_s, f"{ref} on 8xA100 at {link}")
    return out
