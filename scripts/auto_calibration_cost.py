#!/usr/bin/env python
"""What Auto's calibration costs, without the emulated cluster.

    .venv/bin/python scripts/auto_calibration_cost.py [--params 16M] [--e2e docs/results/e2e.json] \
        [--out docs/results/auto_calibration_cost.json]
    .venv/bin/python scripts/auto_calibration_cost.py --measured docs/results/e2e_auto_calibration.json

The second form prints what the cluster measured (:func:`measured_overhead`).

Two parts, for the torch MLP of ``bench e2e`` (its weight shapes):

1. **Decision step, measured here**: the CPU time of timing every candidate
   on every distinct tensor shape (``hvd_compress.auto.calibration.measure_codecs``,
   what the decision step runs besides the link probe), one thread, twice in
   the same process: PowerSGD timed through its preallocated torch rounds (as
   the transport runs it) and through the scheme's eager chain.
2. **Calibration steps, from the cost model**: for each link of the e2e
   results (the measured rate of its ``none`` row), the candidate each tensor
   is calibrated with (``provisional_choice``) and the predicted communication
   + codec seconds per step of that calibration against a dense one, with the
   measured ``none`` step of that link beside it.  The early probe's
   predicted time is included.  This is the cost model's prediction, not a
   measurement on the cluster (``bench e2e --schemes "none,Auto()"`` is).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def _count(s):
    s = str(s).strip().upper()
    mult = {"K": 10**3, "M": 10**6}.get(s[-1:], 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


def mlp_tensors(params):
    from hvd_compress.tools.bench.models import mlp_width
    d_in, classes = 1024, 10
    h = mlp_width(params, d_in, classes)
    dims = [d_in, h, h, classes]
    out = {}
    for i in range(3):
        out[f"{i}.weight"] = (dims[i] * dims[i + 1], (dims[i + 1], dims[i]))
        out[f"{i}.bias"] = (dims[i + 1], (dims[i + 1],))
    return out


def decision_step_seconds(tensors, eager_powersgd):
    import hvd_compress.codecs.torch_lowrank as tl
    from hvd_compress.auto import calibration
    from hvd_compress.auto.planner import applies, default_candidates
    real = tl.codec_for
    if eager_powersgd:
        tl.codec_for = lambda *a: None
    try:
        keys = sorted(tensors)
        t0 = time.process_time()
        rows = calibration.measure_codecs(tensors, keys, default_candidates(), 2, applies)
        return time.process_time() - t0, dict(zip(keys, rows))
    finally:
        tl.codec_for = real


def measured_overhead(rows, steps=1000):
    """Auto's calibration overhead per link, from ``bench e2e --schemes
    "none,Auto()"`` rows: its warm-up steps (``warmup_step_s_all``) start with
    the calibration steps (index 0 to ``calibration_steps - 1``, the first
    one also probing the link) and the decision step, then the plan runs
    (``median_step_s``).  Overhead = those steps minus as many steps of the
    plan; share = overhead / ``steps`` steps of the plan."""
    from hvd_compress import Auto
    n = Auto().calibration_steps
    out = []
    for r in rows:
        if r.get("scheme") != "Auto()":
            continue
        warm = r["warmup_step_s_all"]
        plan_s = r["median_step_s"]
        none = [x for x in rows if x.get("scheme") == "none" and x.get("link_mbit") == r.get("link_mbit")]
        overhead = sum(warm[:n + 1]) - (n + 1) * plan_s
        out.append({"link_mbit": r.get("link_mbit"), "link_measured_mbit": r.get("link_measured_mbit"),
                    "calibration_steps_s": warm[:n], "decision_step_s": warm[n], "plan_step_s": plan_s,
                    "none_step_s": none[0]["median_step_s"] if none else None,
                    "speedup_vs_none": r.get("speedup_vs_none"), "overhead_s": overhead,
                    "share_of_run": overhead / (steps * plan_s), "run_steps": steps,
                    "loadavg_1m": [r.get("loadavg_1m_before"), r.get("loadavg_1m_after")]})
    return out


def print_measured(rows):
    print(f"{'link':>10} {'calibration steps':>18} {'decision step':>14} {'plan step':>10} {'overhead':>9} "
          f"{'share of 1000 steps':>20} {'vs none':>8}")
    for m in rows:
        name = "unshaped" if m["link_mbit"] is None else f"{m['link_mbit']:g} Mbit/s"
        print(f"{name:>10} {sum(m['calibration_steps_s']):>17.2f}s {m['decision_step_s']:>13.2f}s "
              f"{1e3 * m['plan_step_s']:>8.0f}ms {m['overhead_s']:>8.2f}s {100 * m['share_of_run']:>19.1f}% "
              f"{m['speedup_vs_none'] or 0:>7.2f}x")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", default="16M")
    ap.add_argument("--e2e", default=os.path.join(ROOT, "docs/results/e2e.json"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--measured", default=None,
                    help="only print the measured overhead of the Auto() rows of this bench e2e JSON "
                         "(docs/results/e2e_auto_calibration.json)")
    args = ap.parse_args(argv)
    if args.measured:
        print_measured(measured_overhead(json.load(open(args.measured))))
        return 0
    import torch
    torch.set_num_threads(1)
    from hvd_compress.auto.probe import EARLY_PROBE_NUMELS
    from hvd_compress.auto.provisional import PROVISIONAL_CODEC_S_PER_ELEMENT, provisional_choice
    from hvd_compress.auto.planner import Link, comm_time, default_candidates, predict_comm
    tensors = mlp_tensors(_count(args.params))
    result = {"params": args.params, "tensors": tensors}

    new_s, new_rows = decision_step_seconds(tensors, eager_powersgd=False)
    eager_s, eager_rows = decision_step_seconds(tensors, eager_powersgd=True)
    labels = [c.label for c in default_candidates()]
    result["decision_step"] = {"powersgd_codec_s": new_s, "powersgd_eager_s": eager_s, "candidates": labels,
                               "codec_s_codec": new_rows, "codec_s_eager": eager_rows}
    print(f"decision step's codec timings, {args.params} MLP ({len(tensors)} tensors), one thread, CPU time: "
          f"{new_s:.2f} s with PowerSGD's torch rounds, {eager_s:.2f} s with its eager chain")
    j = labels.index(next(label for label in labels if label.startswith("PowerSGD")))
    for key in sorted(tensors):
        if new_rows[key][j] > 0:
            print(f"  {key} {tensors[key][1]}: PowerSGD encode + decode {1e3 * new_rows[key][j]:.1f} ms "
                  f"(torch rounds) vs {1e3 * eager_rows[key][j]:.1f} ms (eager chain), minimum of the timed rounds")

    rows = json.load(open(args.e2e))
    workers, cands = 2, default_candidates()
    by_label = {c.label: c for c in cands}
    result["links"] = []
    print(f"{'link':>10} {'none step':>10} {'dense comm':>11} {'calibrated':>11} {'probe':>8}  choices")
    for r in rows:
        if r.get("scheme") != "none" or r.get("framework") != "torch" or r.get("model") != "mlp":
            continue
        mbit = r.get("link_mbit") or r.get("link_measured_mbit")
        link = Link(latency_s=50e-6, bytes_per_s=mbit * 1e6 / 8)
        dense = cal = 0.0
        choices = {}
        for key, (numel, shape) in sorted(tensors.items()):
            label = provisional_choice(numel, shape, workers, link, cands)
            choices[key] = label
            dense += predict_comm(cands[0].scheme, numel, shape, workers, link)[1]
            cost = 0.0 if label == "none" else PROVISIONAL_CODEC_S_PER_ELEMENT * numel
            cal += predict_comm(by_label[label].scheme, numel, shape, workers, link)[1] + cost
        probe = sum(3 * comm_time("allreduce", 4 * n, workers, link.bytes_per_s, link.latency_s)[1]
                    for n in EARLY_PROBE_NUMELS)
        name = f"{mbit:.0f} Mbit/s" + ("" if r.get("link_mbit") else " (unshaped)")
        compressed = sorted({v for v in choices.values() if v != "none"})
        print(f"{name:>10} {r['median_step_s']:>9.2f}s {dense:>10.3f}s {cal:>10.3f}s {1e3 * probe:>6.1f}ms  "
              f"{', '.join(compressed) or 'all dense'}")
        result["links"].append({"link_mbit": mbit, "shaped": bool(r.get("link_mbit")),
                                "none_step_s_measured": r["median_step_s"], "dense_comm_s_predicted": dense,
                                "calibration_comm_codec_s_predicted": cal, "early_probe_s_predicted": probe,
                                "choices": choices})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
