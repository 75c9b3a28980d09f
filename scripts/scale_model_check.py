#!/usr/bin/env python
"""The one cost model (hvd_compress/costmodel/model.py) against every measured row.

    .venv/bin/python scripts/scale_model_check.py            # report -> docs/results/scale_model_check.{md,json}
    .venv/bin/python scripts/scale_model_check.py --fit      # also print the constants fitted (CPU_GLOO, CORE_WAIT_S)
    .venv/bin/python scripts/scale_model_check.py --write-back   # also add predicted_* fields (machine too) to scale_measured.json

Rows with a time (``bench scale``: docs/results/scale_measured.json, ``bench
e2e``: docs/results/e2e.json): measured = the step with Horovod minus the same
model's purely local step (bench scale: the median over the launch's compute-only
steps of every scheme, :func:`with_launch_compute`; bench e2e: ``comm_s_measured``); predicted =
:func:`hvd_compress.tools.advise.predict_row` -- per tensor the transport's
latency and bytes at the row's measured TCP goodput (latency per ring step:
half the measured round trip where the row has one, else 50 us), the codec
(the row's own measured encode + decode wall time per step where it carries
it, else bench micro's costs times the CPU sharing of the run), the
collective's own CPU work and Horovod's cycle (``advise.CPU_GLOO``: three
global constants, fitted once by ``--fit`` to the unshaped-link rows of e2e.json),
tensor fusion, and the row's machine (:func:`hvd_compress.tools.advise.row_machine`:
all ``workers`` ranks shared the row's ``cpus`` cores with ``runnable_before`` (else ``loadavg_1m_before``)
runnable tasks of other work): CPU work times ``max(1, ranks / cores)``, and
each ring step waiting ``CORE_WAIT_S x max(0, (ranks + load) / cores - 1)``
for the next rank's turn on a core (``cost_model.CORE_WAIT_S``: one global
constant, fitted once by ``--fit`` to every bench scale row; the report
also gives the error on the rows each fit held out).  Error = (predicted -
measured) / measured.  Nothing is fitted per row.  Each row also shows how far
its own passes disagree (``pass_spread``, slowest against fastest): the measurement's noise.

Rows with bytes only (docs/results/two_phase.json): the wire bytes each rank
receives, predicted by the same model, against the interface counters.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from hvd_compress.costmodel import model as cost_model  # noqa: E402
from hvd_compress.tools import advise  # noqa: E402

RESULTS = os.path.join(REPO, "docs", "results")


def _load(path):
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f)


def _measured(row):
    if row.get("link_s_launch") is not None:
        return row["link_s_launch"]
    if row.get("link_s") is not None:
        return row["link_s"]
    return row.get("comm_s_measured")


def with_launch_compute(rows):
    """Copies of bench scale rows whose measured time is the step less the
    compute-only step of the whole launch (``link_s_launch``): the median of
    every scheme's compute-only steps at that N and link, which run the same
    model on the same ranks.  One scheme's 9 compute-only steps alone are
    noisy on shared cores (at N = 4, 1 Gbit/s one scheme's median was 113 ms
    where the launch's was 62 ms, leaving 4 ms of a 117 ms step to the link)."""
    pooled = {}
    for r in rows:
        pooled.setdefault(_launch(r), []).extend(r.get("compute_s_all") or [])
    out = []
    for r in rows:
        steps = pooled.get(_launch(r))
        launch = statistics.median(steps) if steps and r.get("median_step_s") is not None else None
        out.append(dict(r, compute_s_launch=launch,
                        link_s_launch=None if launch is None else r["median_step_s"] - launch))
    return out


def _launch(row):
    return row.get("workers"), row.get("link_mbit"), row.get("model_params"), row.get("command")


def _overhead(micro, rows):
    from hvd_compress.tools.bench.micro import allocator_of
    alloc = {allocator_of(r) for r in rows} or {"default"}
    return advise.Overhead.from_file(micro, "torch", "cpu", alloc.pop() if len(alloc) == 1 else "default")


def pass_spread(row):
    """How far the row's own passes disagree: ``(slowest pass - fastest
    pass) / link_s`` (each pass: the median of its timed steps minus the median
    of its compute-only steps; bench scale keeps both in order in
    ``step_s_all`` and ``compute_s_all``).  None where the row has one pass."""
    steps, comp, passes = row.get("step_s_all"), row.get("compute_s_all"), row.get("passes") or 1
    meas = _measured(row)
    if passes < 2 or not steps or not comp or not meas or meas <= 0 or len(steps) % passes or len(comp) % passes:
        return None
    ns, nc = len(steps) // passes, len(comp) // passes
    per = [statistics.median(steps[i * ns:(i + 1) * ns]) - statistics.median(comp[i * nc:(i + 1) * nc])
           for i in range(passes)]
    return (max(per) - min(per)) / meas


def check_time_rows(rows, source, overhead, machine=None):
    machine = machine or advise.CPU_GLOO
    out = []
    for r in rows:
        meas = _measured(r)
        if meas is None or r.get("framework", "torch") != "torch":
            continue
        step, known = advise.predict_row(r, overhead, machine)
        ran_on = advise.row_machine(r, machine)
        entry = {"source": source, "scheme": r["scheme"], "transport": r.get("transport"), "workers": r["workers"],
                 "link_mbit": r.get("link_mbit"), "link_measured_mbit": r.get("link_measured_mbit"),
                 "model_params": r.get("model_params"), "measured_s": meas,
                 "codec": "row" if r.get("encode_s_per_step") is not None else "bench micro",
                 "measured_wire_rx_bytes": r.get("wire_rx_bytes_per_step"),
                 "loadavg_1m": r.get("loadavg_1m_before"), "background_load": advise.row_machine(
                     r, machine).background_load if r.get("cpus") else None,
                 # the machine the model was given for this row: cores, ranks sharing them, other work
                 "machine": {"cpus": ran_on.cpus, "ranks_per_host": ran_on.ranks_sharing(r["workers"]),
                             "background_load": ran_on.background_load, "core_wait_s": ran_on.core_wait_s,
                             "step_wait_s": ran_on.step_wait_s(r["workers"])},
                 "pass_spread": pass_spread(r)}
        if step is None:
            entry.update(predicted_s=None, error=None, why="the model cannot predict this row (no plan/scheme)")
        else:
            entry.update(predicted_s=step.seconds, predicted_link_s=step.link_s, predicted_codec_s=step.codec_s,
                         predicted_collective_s=step.collective_s, predicted_cycle_s=step.cycle_s,
                         predicted_wait_s=step.wait_s, predicted_wire_bytes=step.wire_bytes,
                         error=(step.seconds - meas) / meas if known and meas > 0 else None,
                         why=None if known else "no codec cost measured for this scheme")
        out.append(entry)
    return out


def check_byte_rows(rows):
    """two_phase.json: wire bytes per rank per step, predicted vs the interfaces."""
    out = []
    for r in rows:
        spec = r["scheme"] + ("/two_phase" if r["transport"] == "two_phase" else "")
        p = advise.predict(spec, r["params"], r["workers"], 1e9, machine=cost_model.LINK_ONLY, codec=(0.0, 0.0))
        meas = r["wire_rx_bytes_per_rank_per_step"]
        out.append({"scheme": r["scheme"], "transport": r["transport"], "workers": r["workers"],
                    "horovod_cycle_time_ms": r.get("horovod_cycle_time_ms"), "measured_wire_rx_bytes": meas,
                    "predicted_wire_bytes": p.wire_bytes, "error": (p.wire_bytes - meas) / meas})
    return out


def fit_machine(e2e_rows, overhead):
    """The three CPU constants of advise.CPU_GLOO, least squares through the
    origin over the unshaped-link e2e rows (the link is then fast enough for
    the collective's CPU work to show): residual = measured - link - codec -
    cycle, against the bytes each rank receives."""
    base = cost_model.Machine(cycle_s=cost_model.HOROVOD_CYCLE_S)
    groups = {"reduce": ([], []), "half": ([], []), "gather": ([], [])}
    for r in e2e_rows:
        if r.get("link_mbit") is not None or r.get("comm_s_measured") is None:
            continue
        step, known = advise.predict_row(r, overhead, base)
        if step is None or not known:
            continue
        resid = r["comm_s_measured"] - step.seconds
        tr = advise.transport_of(advise.row_spec(r))
        half = r["scheme"] in ("hvd_fp16", "FP16")
        group = "half" if half else ("reduce" if tr == "allreduce" else "gather" if tr != "powersgd" else None)
        if group:
            groups[group][0].append(step.wire_bytes)
            groups[group][1].append(resid)
    return {k: cost_model.fit_constant(xs, ys) for k, (xs, ys) in groups.items()}


def _log_error_sum(rows, overhead, machine):
    total = 0.0
    for r in rows:
        step, known = advise.predict_row(r, overhead, machine)
        meas = _measured(r)
        if step is None or not known or not meas or meas <= 0 or step.seconds <= 0:
            continue
        total += abs(math.log(step.seconds / meas))
    return total


def fit_core_wait(rows, overhead, machine=None):
    """``Machine.core_wait_s``, one global constant: the value (0 to 100 ms)
    that minimises the sum over ``rows`` of ``|log(predicted / measured)|``
    (every row weighs the same whatever its size; a relative error of +x and
    of -x/(1+x) count alike), the CPU constants held at ``machine``'s."""
    from dataclasses import replace
    machine = machine or advise.CPU_GLOO
    rows = [r for r in rows if _measured(r) is not None and r.get("framework", "torch") == "torch"]

    def cost(q):
        return _log_error_sum(rows, overhead, replace(machine, core_wait_s=q))
    grid = [0.0] + [1e-5 * 10 ** (i / 20) for i in range(81)]  # 10 us .. 100 ms, 20 a decade
    best = min(grid, key=cost)
    lo, hi = best / 10 ** 0.05, best * 10 ** 0.05  # refine within the grid's step (golden section)
    g = (math.sqrt(5) - 1) / 2
    for _ in range(30 if best > 0 else 0):
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        if cost(a) <= cost(b):
            hi = b
        else:
            lo = a
    return best if best == 0 else (lo + hi) / 2


def holdout(scale, e2e, overhead, machine=None):
    """The core wait fitted on one part of the rows, the error on the rest:
    {split: {"core_wait_s", "fitted_on": summary, "held_out": summary}}."""
    from dataclasses import replace
    machine = machine or advise.CPU_GLOO
    splits = {"fit on scale N <= 4, check on scale N = 8": ([r for r in scale if r["workers"] <= 4],
                                                           [r for r in scale if r["workers"] > 4]),
              "fit on scale N = 8, check on scale N <= 4": ([r for r in scale if r["workers"] > 4],
                                                           [r for r in scale if r["workers"] <= 4]),
              "fit on e2e.json and scale N = 2, check on scale N = 4, 8":
                  (e2e + [r for r in scale if r["workers"] <= 2], [r for r in scale if r["workers"] > 2])}
    out = {}
    for name, (fit_rows, rest) in splits.items():
        q = fit_core_wait(fit_rows, overhead, machine)
        m = replace(machine, core_wait_s=q)
        out[name] = {"core_wait_s": q,
                     "fitted_on": summary(check_time_rows(fit_rows, "fit", overhead, m)),
                     "held_out": summary(check_time_rows(rest, "held out", overhead, m))}
    return out


def summary(rows):
    errs = sorted(abs(r["error"]) for r in rows if r.get("error") is not None)
    if not errs:
        return {"rows": 0}
    return {"rows": len(errs), "median_abs_error": statistics.median(errs), "worst_abs_error": errs[-1]}


def _pct(x):
    return "-" if x is None else f"{100 * x:+.0f}%"


def _ms(x):
    return "-" if x is None else f"{1e3 * x:.1f}"


def _summary_line(s):
    if not s.get("rows"):
        return "no scored rows"
    return (f"median |error| {100 * s['median_abs_error']:.0f}%, worst {100 * s['worst_abs_error']:.0f}% "
            f"over {s['rows']} rows")


def report(time_rows, byte_rows, machine, held=None):
    lines = ["# The cost model against measured rows", "",
             "Generated by `.venv/bin/python scripts/scale_model_check.py` (the method is in the script's "
             "docstring). Machine constants: "
             f"fp32 sum {machine.reduce_s_per_byte * 1e9:.2f} ns/B, fp16 sum {machine.reduce_half_s_per_byte * 1e9:.2f}"
             f" ns/B, gather copies {machine.gather_s_per_byte * 1e9:.2f} ns/B received, cycle "
             f"{machine.cycle_s * 1e3:g} ms (advise.CPU_GLOO, fitted by `--fit` to e2e.json's unshaped rows); "
             f"a ring step's wait for a core {machine.core_wait_s * 1e3:.2f} ms per runnable task beyond one a core "
             f"(cost_model.CORE_WAIT_S, fitted by `--fit` to every bench scale row). Each row's machine: "
             f"its `cpus` cores shared by its `workers` ranks, with the tasks of other work runnable before its launch "
             f"(`runnable_before`, else the 1-minute load average `loadavg_1m_before`; the `load` column) "
             f"(the `wait` column: each ring step waits CORE_WAIT_S x max(0, (ranks + load) / cores - 1), shared "
             f"by fusion as the latency is; the CPU work of the collective and bench micro's codec costs take "
             f"max(1, ranks / cores) times as long). Measured: the step less the launch's compute-only step (the "
             f"median over every scheme's compute-only steps at that N and link).", ""]
    if held:
        lines += ["## Held out", "", "The core wait fitted on one part of the rows, the error on the rest "
                  "(the CPU constants are fitted to e2e.json's unshaped rows in every case):", "",
                  "| split | core wait fitted | on the rows it was fitted to | on the rows held out |",
                  "|---|---:|---|---|"]
        for name, h in held.items():
            lines.append(f"| {name} | {h['core_wait_s'] * 1e3:.2f} ms | {_summary_line(h['fitted_on'])} | "
                         f"{_summary_line(h['held_out'])} |")
        lines.append("")
    for source in sorted({r["source"] for r in time_rows}):
        rows = [r for r in time_rows if r["source"] == source]
        s = summary(rows)
        lines += [f"## {source}: step time minus compute", ""]
        if s["rows"]:
            lines.append(f"Median |error| {100 * s['median_abs_error']:.0f}%, worst {100 * s['worst_abs_error']:.0f}% "
                         f"over {s['rows']} scored rows (of {len(rows)}).")
            by_n = {n: summary([r for r in rows if r["workers"] == n]) for n in sorted({r["workers"] for r in rows})}
            if len(by_n) > 1:
                lines.append("By N: " + "; ".join(f"N = {n}: {_summary_line(v)}" for n, v in by_n.items()) + ".")
            spreads = [r for r in rows if r.get("pass_spread") is not None and r.get("error") is not None]
            if spreads:
                agree = [r for r in spreads if r["pass_spread"] <= 0.35]
                med = statistics.median(r["pass_spread"] for r in spreads)
                lines.append(f"The measurement itself: a row's slowest and fastest passes differ by a median {100 * med:.0f}% of "
                             f"its measured time, by more than 35% in {len(spreads) - len(agree)} of {len(spreads)} "
                             f"rows (`passes differ` column); over the {len(agree)} rows whose passes agree within "
                             f"35%: {_summary_line(summary(agree))}.")
        lines += ["", "| N | link (Mbit/s, measured) | scheme | transport | codec from | load | measured ms | "
                      "passes differ | predicted ms | link ms | codec ms | collective CPU ms | cycle ms | wait ms | "
                      "error |",
                  "|---:|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in sorted(rows, key=lambda r: (r["workers"], r["link_mbit"] or 1e9, r["scheme"])):
            link = "unshaped" if r["link_mbit"] is None else f"{r['link_mbit']:g}"
            link += f" ({r['link_measured_mbit']:.0f})" if r.get("link_measured_mbit") else ""
            err = _pct(r["error"]) if r["error"] is not None else f"- ({r['why']})"
            spread = "-" if r.get("pass_spread") is None else f"{100 * r['pass_spread']:.0f}%"
            load = r.get("background_load", r.get("loadavg_1m"))
            load = "-" if load is None else f"{load:.1f}"
            lines.append(f"| {r['workers']} | {link} | {r['scheme']} | {r['transport']} | {r['codec']} | {load} | "
                         f"{_ms(r['measured_s'])} | {spread} | {_ms(r['predicted_s'])} | "
                         f"{_ms(r.get('predicted_link_s'))} | "
                         f"{_ms(r.get('predicted_codec_s'))} | {_ms(r.get('predicted_collective_s'))} | "
                         f"{_ms(r.get('predicted_cycle_s'))} | {_ms(r.get('predicted_wait_s'))} | {err} |")
        lines.append("")
    if byte_rows:
        errs = sorted(abs(r["error"]) for r in byte_rows)
        lines += ["## two_phase.json: wire bytes each rank receives per step", "",
                  f"Median |error| {100 * statistics.median(errs):.0f}%, worst {100 * errs[-1]:.0f}% over "
                  f"{len(errs)} rows (the interfaces also carry TCP/IP headers and Horovod's coordination).", "",
                  "| N | scheme | transport | cycle ms | measured | predicted | error |", "|---:|---|---|---:|---:|---:|---:|"]
        for r in byte_rows:
            lines.append(f"| {r['workers']} | {r['scheme']} | {r['transport']} | {r['horovod_cycle_time_ms'] or 'default'} | "
                         f"{r['measured_wire_rx_bytes'] / 1e6:.3f} MB | {r['predicted_wire_bytes'] / 1e6:.3f} MB | "
                         f"{_pct(r['error'])} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scale", default=os.path.join(RESULTS, "scale_measured.json"))
    p.add_argument("--e2e", default=os.path.join(RESULTS, "e2e.json"))
    p.add_argument("--two-phase", default=os.path.join(RESULTS, "two_phase.json"))
    p.add_argument("--micro", default=os.path.join(RESULTS, "micro.json"))
    p.add_argument("--out", default=os.path.join(RESULTS, "scale_model_check.md"))
    p.add_argument("--fit", action="store_true", help="print the machine constants fitted to the e2e rows")
    p.add_argument("--also", action="append", default=None, metavar="JSON",
                   help="more bench scale rows to check, in their own section, nothing fitted to them (default: "
                        "docs/results/scale_measured_quiet.json where it exists)")
    p.add_argument("--ignore-load", action="store_true",
                   help="give every row a load average of 0 (what the load term is worth; use with --out elsewhere)")
    p.add_argument("--write-back", action="store_true",
                   help="add predicted_link_s (the model's link_s), predicted_error and predicted_machine (the "
                        "machine the model was given) to every row of the --scale file")
    a = p.parse_args(argv)
    e2e, scale = _load(a.e2e), with_launch_compute(_load(a.scale))
    if a.ignore_load:  # the model without the other work on the cores (a comparison, not the report)
        e2e, scale = ([dict(r, loadavg_1m_before=0.0, runnable_before=0.0) for r in rows] for rows in (e2e, scale))
    overhead = _overhead(a.micro, e2e)
    if a.fit:
        print(json.dumps(fit_machine(e2e, overhead), indent=1))
        print("core_wait_s fitted on every bench scale row:", fit_core_wait(scale, overhead))
    time_rows = check_time_rows(scale, "scale_measured.json", overhead) + check_time_rows(e2e, "e2e.json", overhead)
    if a.also is None:
        a.also = [p for p in (os.path.join(RESULTS, "scale_measured_quiet.json"),) if os.path.exists(p)]
    also = {os.path.basename(path): with_launch_compute(_load(path)) for path in a.also}
    if a.ignore_load:
        also = {k: [dict(r, loadavg_1m_before=0.0, runnable_before=0.0) for r in rows] for k, rows in also.items()}
    for name, rows in also.items():
        time_rows += check_time_rows(rows, name, overhead)
    byte_rows = check_byte_rows(_load(a.two_phase))
    held = holdout(scale, e2e, overhead) if scale else None
    text = report(time_rows, byte_rows, advise.CPU_GLOO, held)
    with open(a.out, "w") as f:
        f.write(text)
    stats = {src: summary([r for r in time_rows if r["source"] == src]) for src in ("scale_measured.json", "e2e.json")}
    for name in also:
        stats[name] = summary([r for r in time_rows if r["source"] == name])
    stats["all time rows"] = summary(time_rows)
    stats["scale_measured.json by N"] = {str(n): summary([r for r in time_rows if r["source"] == "scale_measured.json"
                                                         and r["workers"] == n])
                                         for n in sorted({r["workers"] for r in time_rows
                                                          if r["source"] == "scale_measured.json"})}
    stats["scale_measured.json, passes agree within 35%"] = summary(
        [r for r in time_rows if r["source"] == "scale_measured.json" and r.get("pass_spread") is not None
         and r["pass_spread"] <= 0.35])
    stats["held out"] = held
    with open(os.path.splitext(a.out)[0] + ".json", "w") as f:
        json.dump({"summary": stats, "time_rows": time_rows, "byte_rows": byte_rows}, f, indent=1)
    if a.write_back and scale and not a.ignore_load:
        predicted = iter(check_time_rows(scale, "scale_measured.json", overhead))
        scale = _load(a.scale)  # as bench scale wrote it
        for r in scale:
            if _measured(r) is None or r.get("framework", "torch") != "torch":
                continue
            q = next(predicted)
            r["predicted_link_s"], r["predicted_error"] = q["predicted_s"], q["error"]
            r["predicted_machine"] = q["machine"]  # the cores, ranks and load the prediction was given
        from hvd_compress.tools.bench.report import write_json
        write_json(a.scale, scale)  # bench scale's own layout, so only the predicted_* lines change
    print(text)
    print(json.dumps(stats, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
