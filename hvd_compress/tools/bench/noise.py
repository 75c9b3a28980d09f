"""``hvd-compress bench noise``: what this machine's timings can tell apart.

A benchmark target such as "``Auto()`` within 5% of ``none``" or "at least 0.95x the best
fixed scheme" can only be judged where one configuration, timed twice, gives the same time
within that margin.  This study runs nothing; it reads the benchmarks' own rows and reports
two spreads of configurations that are the same:

* **Across runs** (``bench tta``): ``none`` (plain Horovod) on one model, framework, rank
  count, link and seed, trained in separate runs (each results file's rows, a run being one
  ``command``; rows copied between files count once).  Each run's seconds a step is its
  curve's last training time over its steps (evaluations excluded), so runs of different
  budgets compare.  The spread is the slowest run's over the fastest's.
* **Within a run** (``bench models``): an ``Auto()`` row whose plan sent every tensor dense
  against that run's ``none`` row, timed in alternating rounds in the same run.  Auto's dense
  path still passes each tensor through its adapter (a few tens of microseconds a tensor,
  docs/results/benchmarks.md), so the ratio ``none / Auto`` is the same plan timed twice,
  less that.

Where the spread of a configuration against itself exceeds a target's margin, one run cannot
say whether that target is met: it needs repeated runs, or a machine on which ranks do not
share cores.
"""
from __future__ import annotations

import glob
import json
import os
from collections import defaultdict

NONE = "none"


def seconds_a_step(row):
    """A tta row's training seconds over its steps (its curve's last point), or None."""
    curve = row.get("curve") or []
    if not curve or not curve[-1].get("step"):
        return None
    return curve[-1]["time_s"] / curve[-1]["step"]


def tta_none_runs(paths):
    """``{(model, framework, workers, link, pinned, seed): {command: seconds a step}}`` of the
    measured ``none`` rows of the tta JSONs ``paths`` (``pinned``: the ranks ran bound to a core
    each); a row copied into another file (the same command) counts once."""
    runs = defaultdict(dict)
    for path in paths:
        with open(path) as f:
            rows = json.load(f)
        if not isinstance(rows, list):
            continue
        for r in rows:
            if r.get("scheme") != NONE or not r.get("measured"):
                continue
            s = seconds_a_step(r)
            if s is None:
                continue
            key = (r["model"], r["framework"], r["workers"], r["link"], bool(r.get("pinned_cores")), r["seed"])
            runs[key].setdefault(r.get("command") or path, s)
    return dict(runs)


def across_runs(runs):
    """Per (model, framework, workers, link, pinned): the number of runs, the seeds with two or
    more, the fastest and slowest seconds a step of one seed, and the largest slowest / fastest
    of a seed.  Cells where no seed ran twice are left out."""
    cells = defaultdict(list)
    for (model, framework, workers, link, pinned, seed), by_run in runs.items():
        if len(by_run) >= 2:
            cells[(model, framework, workers, link, pinned)].append((seed, sorted(by_run.values())))
    out = []
    for key in sorted(cells):
        seeds = sorted(cells[key])
        spreads = [times[-1] / times[0] for _, times in seeds]
        out.append({"model": key[0], "framework": key[1], "workers": key[2], "link": key[3], "pinned": key[4],
                    "runs": max(len(times) for _, times in seeds), "seeds": [s for s, _ in seeds],
                    "fastest_s": min(times[0] for _, times in seeds),
                    "slowest_s": max(times[-1] for _, times in seeds),
                    "largest_spread": max(spreads), "smallest_spread": min(spreads)})
    return out


def dense_plan(plan):
    """Whether a bench models ``plan`` (``{label: tensors}``) sent every tensor dense."""
    return bool(plan) and set(plan) == {NONE}


def within_runs(model_rows):
    """The bench models cells whose ``Auto()`` row planned every tensor dense: that run's
    ``none`` median step over Auto's (1.0: the same time; below 1: Auto slower)."""
    cells = defaultdict(dict)
    for r in model_rows:
        cells[(r["model"], r["framework"], r["workers"], r.get("link_mbit"))][r["scheme"]] = r
    out = []
    for key in sorted(cells, key=str):
        auto, none = cells[key].get("Auto()"), cells[key].get(NONE)
        if auto is None or none is None or not dense_plan(auto.get("plan")):
            continue
        if not auto.get("median_step_s") or not none.get("median_step_s"):
            continue
        out.append({"model": key[0], "framework": key[1], "workers": key[2], "link_mbit": key[3],
                    "none_s": none["median_step_s"], "auto_s": auto["median_step_s"],
                    "ratio": none["median_step_s"] / auto["median_step_s"]})
    return out


def tta_paths(results_dir):
    """The tta result JSONs of ``results_dir`` (not their ``.meta.json``)."""
    return sorted(p for p in glob.glob(os.path.join(results_dir, "tta*.json")) if not p.endswith(".meta.json"))


def markdown(across, within):
    """The two tables of docs/results/benchmarks.md ('What this machine can tell apart')."""
    lines = ["**`none` against itself, across runs** (`bench tta`; seconds a training step, one seed "
             "in separate runs):", "",
             "| model | framework | ranks | link | ranks bound to cores | runs of a seed | seeds | fastest | slowest | "
             "spread of a seed (smallest-largest) |",
             "|---|---|---:|---|---|---:|---|---:|---:|---:|"]
    for c in across:
        lines.append(f"| {c['model']} | {c['framework']} | {c['workers']} | {c['link']} | "
                     f"{'yes' if c['pinned'] else 'no'} | {c['runs']} | "
                     f"{','.join(map(str, c['seeds']))} | {c['fastest_s'] * 1000:.0f} ms | "
                     f"{c['slowest_s'] * 1000:.0f} ms | {c['smallest_spread']:.2f}-{c['largest_spread']:.2f}x |")
    lines += ["", "**The same plan twice, within a run** (`bench models`; `Auto()` planned every tensor dense; "
              "median step):", "",
              "| model | framework | ranks | link | `none` | `Auto()` (dense plan) | `none` / `Auto()` |",
              "|---|---|---:|---|---:|---:|---:|"]
    for c in within:
        link = "unshaped" if c["link_mbit"] is None else f"{c['link_mbit']:g} Mbit/s"
        lines.append(f"| {c['model']} | {c['framework']} | {c['workers']} | {link} | {c['none_s']:.3f} s | "
                     f"{c['auto_s']:.3f} s | {c['ratio']:.2f} |")
    return "\n".join(lines)


def main_args(args, command) -> int:
    """``hvd-compress bench noise``: print the two tables from the results in ``--results``."""
    paths = tta_paths(args.results)
    with open(os.path.join(args.results, "models.json")) as f:
        model_rows = json.load(f)
    print(markdown(across_runs(tta_none_runs(paths)), within_runs(model_rows)))
    return 0


def add_arguments(p, results_dir):
    p.add_argument("--results", default=results_dir, help="the results folder read (default %(default)s)")
