"""``hvd-compress bench link-change``: Auto() when the link changes under it,
unshaped, then 100 Mbit/s mid-run (root).

    sudo .venv/bin/hvd-compress bench link-change [--recheck-every 10] [--steps 40] [--change-at 10] \
        [--out FILE.json]

On the emulated cluster (2 hosts, one rank each; root, like ``bench e2e``),
each scheme trains the 16M-parameter MLP for ``--steps`` timed steps; before
timed step ``--change-at`` every rank waits while this driver shapes both
hosts' links to ``--rate`` Mbit/s (``tc tbf``), then they go on.  Schemes:
``Auto(recheck_every=R)`` and ``TopK(0.01)`` (the best fixed scheme on a slow
link in ``bench e2e``), with ``none`` for reference.

Auto's targets, checked, printed and written to the JSON:

* Auto re-checks (and re-plans where the new link calls for it) within its
  re-check period after the change (first re-check step - change step < R;
  the JSON also says whether that check adopted a new plan);
* after that re-check, Auto's median step is within 1.2x of TopK(0.01)'s
  median step after the change.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import threading
import time

from .e2e import REPO


def _driver(cluster, link_file, rate, stop):
    """Reshape the link when a rank asks (``<link_file>.request``)."""
    while not stop.is_set():
        if os.path.exists(link_file + ".request"):
            cluster.set_rate(rate)
            open(link_file + ".done", "w").close()
            return
        time.sleep(0.05)


def run_one(cluster, spec, a, tmp):
    from .micro import ALLOCATORS
    link_file = os.path.join(tmp, f"link{abs(hash(spec))}")
    out = os.path.join(tmp, f"{abs(hash(spec))}.json")
    cluster.set_rate(None)
    cmd = [sys.executable, "-m", "hvd_compress.tools.bench.e2e_worker", "--scheme", spec, "--steps", str(a.steps),
           "--max-seconds", "0", "--warmup", "2", "--change-link-at", str(a.change_at), "--link-file", link_file,
           "--iface", cluster.iface, "--out", out]
    stop = threading.Event()
    t = threading.Thread(target=_driver, args=(cluster, link_file, a.rate, stop), daemon=True)
    t.start()
    env = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_USE_LEGACY_KERAS": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           **ALLOCATORS["default"]}
    try:
        r = cluster.run(0, cluster.horovodrun_command(cmd, np=2, controller="gloo", slots=1), env=env,
                        timeout=1800, cwd=str(REPO))
    finally:
        stop.set()
        t.join(timeout=5)
    if r.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"{spec} failed (exit {r.returncode}):\n{(r.stdout or '')[-2000:]}{(r.stderr or '')[-2000:]}")
    with open(out) as f:
        row = json.load(f)
    steps = row["step_s_all"]
    row["median_before_s"] = statistics.median(steps[:a.change_at]) if a.change_at else None
    row["median_after_s"] = statistics.median(steps[a.change_at:])
    if "auto_plan_steps" in row:
        plans = [s for s in row["auto_plan_steps"] if s >= a.change_at]
        checks = [s for s in row["auto_check_steps"] if s >= a.change_at]
        row["replan_step"] = plans[0] if plans else None  # a new plan adopted after the change
        row["recheck_step"] = checks[0] if checks else None  # the first re-check after it
        row["median_after_recheck_s"] = (statistics.median(steps[checks[0] + 1:])
                                         if checks and checks[0] + 1 < len(steps) else None)
    print(f"{spec:>28}: median step before {row['median_before_s']:.3f} s, after {row['median_after_s']:.3f} s"
          + (f", re-checked at step {row.get('recheck_step')}, new plan at step {row.get('replan_step')}"
             if "auto_plan_steps" in row else ""), flush=True)
    return row


def add_arguments(p):
    p.add_argument("--recheck-every", type=int, default=10, help="Auto's re-check period (default %(default)s)")
    p.add_argument("--steps", type=int, default=40, help="timed steps (default %(default)s)")
    p.add_argument("--change-at", type=int, default=10, help="the timed step before which the link changes "
                   "(default %(default)s)")
    p.add_argument("--rate", type=float, default=100.0, help="the link after the change, Mbit/s "
                   "(default %(default)s)")
    p.add_argument("--schemes", default=None, help="';'-separated specs (default: Auto(recheck_every=R), "
                   "TopK(0.01), none)")
    p.add_argument("--prefix", default="hvdcl", help="cluster name prefix (default %(default)s)")
    p.add_argument("--out", default=None, help="JSON of the rows and verdicts (default: print only)")


def verdicts(rows, auto, change_at, recheck_every):
    """Auto's two targets against TopK(0.01) in the same run ({} without both rows)."""
    by = {r["scheme"]: r for r in rows}
    if auto not in by or "TopK(0.01)" not in by:
        return {}
    ar, tk = by[auto], by["TopK(0.01)"]
    lag = None if ar.get("recheck_step") is None else ar["recheck_step"] - change_at
    ratio = (ar["median_after_recheck_s"] / tk["median_after_s"]) if ar.get("median_after_recheck_s") else None
    return {"rechecked_within_recheck_period": {"lag_steps": lag, "recheck_every": recheck_every,
                                                "new_plan_at": ar.get("replan_step"),
                                                "met": lag is not None and lag < recheck_every},
            "after_recheck_within_1.2x_of_topk": {"ratio": ratio, "met": ratio is not None and ratio <= 1.2}}


def main_args(a, command) -> int:
    """Every scheme through the link change; 0 when Auto met both targets."""
    from ..testing.cluster import Cluster
    auto = f"Auto(recheck_every={a.recheck_every})"
    schemes = a.schemes.split(";") if a.schemes else [auto, "TopK(0.01)", "none"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="hvdc_link_") as tmp, Cluster(2, prefix=a.prefix) as cluster:
        for spec in schemes:
            rows.append(run_one(cluster, spec, a, tmp))
    checks = verdicts(rows, auto, a.change_at, a.recheck_every)
    for k, v in checks.items():
        print(f"{k}: {v}")
    if a.out:
        doc = {"command": command, "change_at": a.change_at, "rate_mbit": a.rate, "steps": a.steps, "rows": rows,
               "verdicts": checks}
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {a.out}")
    return 0 if checks and all(v["met"] for v in checks.values()) else 1
