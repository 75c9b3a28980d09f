"""The link probes of :class:`hvd_compress.Auto`: which allreduce sizes it
times, before the first step and at each decision, to fit the link
(:func:`hvd_compress.auto.planner.fit_link`)."""
from __future__ import annotations

import math
import time

from ..costmodel.machine import with_wait_floor
from ..costmodel.model import LINK_ONLY

#: the allreduces timed at the first ``compress`` to choose how to calibrate:
#: 4 KB and 1 MB, so that the larger one's time is mostly bandwidth on a slow
#: link (84 ms at 100 Mbit/s, above the milliseconds a loaded machine adds to
#: any collective) and costs little on a fast one
EARLY_PROBE_NUMELS = (1 << 10, 1 << 18)
#: where ranks share cores, the largest probe's bytes take this many times its
#: latency steps (their waits for a core included), so that the waits' scatter
#: cannot hide the bandwidth (:func:`probe_numels_for`)
SHARED_BYTES_TO_LATENCY = 4.0
#: the largest probe where ranks share cores (64 MB)
MAX_PROBE_NUMEL = 1 << 24
#: the allreduce sizes a decision times, before :func:`probe_numels_for` caps them
DEFAULT_PROBE_NUMELS = (1 << 10, 1 << 16, 1 << 20)
#: a check's probe sizes are capped at what the link known so far (the early
#: probe's fit, or the last decision's) moves in this many seconds per
#: allreduce: on a slow link the largest default size alone would cost seconds
PROBE_BUDGET_S = 0.1
#: a probe (early or a decision's) times a size again only where its first
#: allreduce took at most this long on every rank: at 17 Mbit/s and 4 ranks
#: one 1 MB allreduce takes about 0.7 s, so the early probe's three took 2.6-3.0
#: s of a 45 s training run, and where 4 ranks share 2 cores a decision's
#: largest probe (up to 16M elements, 64 MB) took 2.1 s in three
#: (docs/results/tta_auto_warmup_fp16_run1.json, ``auto_check_seconds``); an
#: allreduce that long is mostly bandwidth, timed well enough once
REPEAT_BELOW_S = 0.2


def fastest_of(run, repeats, agree_max):
    """Seconds of the fastest of up to ``repeats`` calls ``run(i)``.  The
    first call's time is agreed on by ``agree_max`` (the largest of every
    rank's value, by a collective), and a first call slower than
    :data:`REPEAT_BELOW_S` on any rank is not repeated: every rank then issues
    the same calls (collectives under the same names), whatever its own clock
    read."""
    best = math.inf
    for i in range(repeats):
        t0 = time.perf_counter()
        run(i)
        best = min(best, time.perf_counter() - t0)
        if i == 0 and agree_max(best) > REPEAT_BELOW_S:
            break
    return best


def probe_numels_for(numels, link, workers, machine=LINK_ONLY, most=None):
    """The sizes a check times: ``numels``, each capped at what ``link`` moves
    in :data:`PROBE_BUDGET_S`; all of them as given where nothing is known
    (``link`` None or of infinite bandwidth) or the cap would leave fewer
    than two distinct sizes (then the two smallest).

    ``most``: the most elements a step sends (the planned tensors together).
    No probe is larger: a plan is priced only at sizes up to it, and where
    the link is fast a larger probe costs far more than a step (a 16M-element
    allreduce where 4 ranks share 2 cores, for a model of 215k: most of a
    0.4-0.7 s decision, ``auto_check_seconds`` in docs/results/tta_pinned.json).
    Two distinct sizes stay: the smallest and ``most`` where it is below the
    second.

    The cap never leaves the largest probe's bytes less time than the link's
    latency steps take: bytes hidden under the latency (and its noise on a
    loaded machine) show no slope, and the fit would read an infinite
    bandwidth.  A check on a high-latency link may therefore spend up to
    twice the latency steps, more than the budget.

    Where ranks share cores (``machine``), the latency per step is at least
    the wait for a core (:func:`hvd_compress.costmodel.machine.with_wait_floor`) and
    the largest probe moves bytes for :data:`SHARED_BYTES_TO_LATENCY` times the
    latency steps, larger than ``numels`` offer where needed (up to
    :data:`MAX_PROBE_NUMEL`): the waits scatter by about their own size, and
    under them a probe of a few latency steps' bytes read 1.6x the link at
    8 ranks on 2 cores, 1 Gbit/s (``bench scale``)."""
    sizes = tuple(sorted(set(numels)))
    if link is None or workers < 2 or not math.isfinite(link.bytes_per_s):
        return _at_most(sizes, most)
    shared = bool(machine.cpus)
    hops = 2.0 * (workers - 1)
    latency_steps_s = hops * with_wait_floor(link, machine, workers).latency_s
    byte_seconds = max(PROBE_BUDGET_S - latency_steps_s,
                       (SHARED_BYTES_TO_LATENCY if shared else 1.0) * latency_steps_s)
    cap = max(1, int(byte_seconds * link.bytes_per_s * workers / hops / 4))
    capped = tuple(sorted({min(n, cap) for n in sizes}))
    if shared and capped[-1] < min(cap, MAX_PROBE_NUMEL):
        capped = capped[:-1] + (max(capped[-1], min(cap, MAX_PROBE_NUMEL)),)
    return _at_most(capped if len(capped) >= 2 else sizes[:2], most)


def _at_most(sizes, most):
    """``sizes`` capped at ``most`` (None: as given), two distinct sizes kept."""
    if most is None:
        return sizes
    capped = tuple(sorted({min(n, int(most)) for n in sizes}))
    if len(capped) >= 2:
        return capped
    return (sizes[0], int(most)) if int(most) > sizes[0] else sizes[:2]

#: Auto switches the 2-rank swap (``HVDC_PAIR_SWAP_MIN_BYTES``) on for payloads
#: of at least this many bytes, as the README's measurements did
PAIR_SWAP_BYTES = 1 << 20
#: ... where the fitted link carries at most this many bytes a second.  Measured
#: on 2 emulated hosts (Top-K 10%, 16M parameters): at 100 Mbit/s (12.5 MB/s)
#: the swap took a step from 1.2-1.6 s to 0.9 s, at 1 Gbit/s (125 MB/s) from
#: 0.23-0.36 s to 0.69-0.94 s; the bound is their geometric mean
#: (docs/design/architecture.md, "Two ranks")
PAIR_SWAP_MAX_BYTES_PER_S = 40e6


def pair_swap_for(link, workers):
    """The 2-rank swap's threshold in bytes that the fitted ``link`` makes pay
    (:data:`PAIR_SWAP_BYTES` on a link of at most :data:`PAIR_SWAP_MAX_BYTES_PER_S`
    between exactly 2 ranks), else 0 (off)."""
    if workers != 2 or link is None or not link.bytes_per_s <= PAIR_SWAP_MAX_BYTES_PER_S:
        return 0
    return PAIR_SWAP_BYTES
