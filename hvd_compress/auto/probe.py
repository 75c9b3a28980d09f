"""The link probes of :class:`hvd_compress.Auto`: which allreduce sizes it
times, before the first step and at each decision, to fit the link
(:func:`hvd_compress.auto.planner.fit_link`)."""
from __future__ import annotations

import math

#: the allreduces timed at the first ``compress`` to choose how to calibrate:
#: 4 KB and 1 MB, so that the larger one's time is mostly bandwidth on a slow
#: link (84 ms at 100 Mbit/s, above the milliseconds a loaded machine adds to
#: any collective) and costs little on a fast one
EARLY_PROBE_NUMELS = (1 << 10, 1 << 18)
#: the allreduce sizes a decision times, before :func:`probe_numels_for` caps them
DEFAULT_PROBE_NUMELS = (1 << 10, 1 << 16, 1 << 20)
#: a check's probe sizes are capped at what the link known so far (the early
#: probe's fit, or the last decision's) moves in this many seconds per
#: allreduce: on a slow link the largest default size alone would cost seconds
PROBE_BUDGET_S = 0.1


def probe_numels_for(numels, link, workers):
    """The sizes a check times: ``numels``, each capped at what ``link`` moves
    in :data:`PROBE_BUDGET_S`; all of them as given where nothing is known
    (``link`` None or of infinite bandwidth) or the cap would leave fewer
    than two distinct sizes (then the two smallest).

    The cap never leaves the largest probe's bytes less time than the link's
    latency steps take: bytes hidden under the latency (and its noise on a
    loaded machine) show no slope, and the fit would read an infinite
    bandwidth.  A check on a high-latency link may therefore spend up to
    twice the latency steps, more than the budget."""
    sizes = tuple(sorted(set(numels)))
    if link is None or workers < 2 or not math.isfinite(link.bytes_per_s):
        return sizes
    hops = 2.0 * (workers - 1)
    latency_steps_s = hops * link.latency_s
    byte_seconds = max(PROBE_BUDGET_S - latency_steps_s, latency_steps_s)
    cap = byte_seconds * link.bytes_per_s * workers / hops / 4
    capped = tuple(sorted({min(n, max(1, int(cap))) for n in sizes}))
    return capped if len(capped) >= 2 else sizes[:2]
