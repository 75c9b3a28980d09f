#!/usr/bin/env python
"""The one cost model (hvd_compress/cost_model.py) against every measured row.

    .venv/bin/python scripts/scale_model_check.py            # report -> docs/results/scale_model_check.{md,json}
    .venv/bin/python scripts/scale_model_check.py --fit      # also print the machine constants fitted to e2e.json
    .venv/bin/python scripts/scale_model_check.py --write-back   # also add predicted_* fields to scale_measured.json

Rows with a time (``bench scale``: docs/results/scale_measured.json, ``bench
e2e``: docs/results/e2e.json): measured = the step with Horovod minus the same
model's purely local step (``link_s`` / ``comm_s_measured``); predicted =
:func:`hvd_compress.tools.advise.predict_row` -- per tensor the transport's
latency and bytes at the row's measured TCP goodput (latency per ring step:
half the measured round trip where the row has one, else 50 us), the codec
(the row's own measured encode + decode wall time per step where it carries
it, else bench micro's costs times the CPU sharing of the run), the
collective's own CPU work and Horovod's cycle (``advise.CPU_GLOO``: three
global constants, fitted once by ``--fit`` to the unshaped-link rows of e2e.json,
with the cores the row's ranks shared), tensor fusion.  Error = (predicted -
measured) / measured.  Nothing is fitted per row.

Rows with bytes only (docs/results/two_phase.json): the wire bytes each rank
receives, predicted by the same model, against the interface counters.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from hvd_compress import cost_model  # noqa: E402
from hvd_compress.tools import advise  # noqa: E402

RESULTS = os.path.join(REPO, "docs", "results")


def _load(path):
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f)


def _measured(row):
    if row.get("link_s") is not None:
        return row["link_s"]
    return row.get("comm_s_measured")


def _overhead(micro, rows):
    from hvd_compress.tools.bench.micro import allocator_of
    alloc = {allocator_of(r) for r in rows} or {"default"}
    return advise.Overhead.from_file(micro, "torch", "cpu", alloc.pop() if len(alloc) == 1 else "default")


def check_time_rows(rows, source, overhead, machine=None):
    machine = machine or advise.CPU_GLOO
    out = []
    for r in rows:
        meas = _measured(r)
        if meas is None or r.get("framework", "torch") != "torch":
            continue
        step, known = advise.predict_row(r, overhead, machine)
        entry = {"source": source, "scheme": r["scheme"], "transport": r.get("transport"), "workers": r["workers"],
                 "link_mbit": r.get("link_mbit"), "link_measured_mbit": r.get("link_measured_mbit"),
                 "model_params": r.get("model_params"), "measured_s": meas,
                 "codec": "row" if r.get("encode_s_per_step") is not None else "bench micro",
                 "measured_wire_rx_bytes": r.get("wire_rx_bytes_per_step"),
                 "loadavg_1m": r.get("loadavg_1m_before")}
        if step is None:
            entry.update(predicted_s=None, error=None, why="the model cannot predict this row (no plan/scheme)")
        else:
            entry.update(predicted_s=step.seconds, predicted_link_s=step.link_s, predicted_codec_s=step.codec_s,
                         predicted_collective_s=step.collective_s, predicted_cycle_s=step.cycle_s,
                         predicted_wire_bytes=step.wire_bytes,
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


def summary(rows):
    errs = sorted(abs(r["error"]) for r in rows if r.get("error") is not None)
    if not errs:
        return {"rows": 0}
    return {"rows": len(errs), "median_abs_error": statistics.median(errs), "worst_abs_error": errs[-1]}


def _pct(x):
    return "-" if x is None else f"{100 * x:+.0f}%"


def _ms(x):
    return "-" if x is None else f"{1e3 * x:.1f}"


def report(time_rows, byte_rows, machine):
    lines = ["# The cost model against measured rows", "",
             "Generated by `.venv/bin/python scripts/scale_model_check.py` (the method is in the script's "
             "docstring). Machine constants: "
             f"fp32 sum {machine.reduce_s_per_byte * 1e9:.2f} ns/B, fp16 sum {machine.reduce_half_s_per_byte * 1e9:.2f}"
             f" ns/B, gather copies {machine.gather_s_per_byte * 1e9:.2f} ns/B received, cycle "
             f"{machine.cycle_s * 1e3:g} ms (advise.CPU_GLOO, fitted by `--fit` to e2e.json's unshaped rows).", ""]
    for source in sorted({r["source"] for r in time_rows}):
        rows = [r for r in time_rows if r["source"] == source]
        s = summary(rows)
        lines += [f"## {source}: step time minus compute", ""]
        if s["rows"]:
            lines.append(f"Median |error| {100 * s['median_abs_error']:.0f}%, worst {100 * s['worst_abs_error']:.0f}% "
                         f"over {s['rows']} scored rows (of {len(rows)}).")
        lines += ["", "| N | link (Mbit/s, measured) | scheme | transport | codec from | measured ms | predicted ms | "
                      "link ms | codec ms | collective CPU ms | cycle ms | error |",
                  "|---:|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in sorted(rows, key=lambda r: (r["workers"], r["link_mbit"] or 1e9, r["scheme"])):
            link = "unshaped" if r["link_mbit"] is None else f"{r['link_mbit']:g}"
            link += f" ({r['link_measured_mbit']:.0f})" if r.get("link_measured_mbit") else ""
            err = _pct(r["error"]) if r["error"] is not None else f"- ({r['why']})"
            lines.append(f"| {r['workers']} | {link} | {r['scheme']} | {r['transport']} | {r['codec']} | "
                         f"{_ms(r['measured_s'])} | {_ms(r['predicted_s'])} | {_ms(r.get('predicted_link_s'))} | "
                         f"{_ms(r.get('predicted_codec_s'))} | {_ms(r.get('predicted_collective_s'))} | "
                         f"{_ms(r.get('predicted_cycle_s'))} | {err} |")
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
    p.add_argument("--write-back", action="store_true",
                   help="add predicted_link_s (the model's link_s) and predicted_error to every row of the --scale file")
    a = p.parse_args(argv)
    e2e, scale = _load(a.e2e), _load(a.scale)
    overhead = _overhead(a.micro, e2e)
    if a.fit:
        print(json.dumps(fit_machine(e2e, overhead), indent=1))
    time_rows = check_time_rows(scale, "scale_measured.json", overhead) + check_time_rows(e2e, "e2e.json", overhead)
    byte_rows = check_byte_rows(_load(a.two_phase))
    text = report(time_rows, byte_rows, advise.CPU_GLOO)
    with open(a.out, "w") as f:
        f.write(text)
    stats = {src: summary([r for r in time_rows if r["source"] == src]) for src in ("scale_measured.json", "e2e.json")}
    stats["all time rows"] = summary(time_rows)
    with open(os.path.splitext(a.out)[0] + ".json", "w") as f:
        json.dump({"summary": stats, "time_rows": time_rows, "byte_rows": byte_rows}, f, indent=1)
    if a.write_back and scale:
        predicted = iter(check_time_rows(scale, "scale_measured.json", overhead))
        for r in scale:
            if _measured(r) is None or r.get("framework", "torch") != "torch":
                continue
            q = next(predicted)
            r["predicted_link_s"], r["predicted_error"] = q["predicted_s"], q["error"]
        from hvd_compress.tools.bench.report import write_json
        write_json(a.scale, scale)  # bench scale's own layout, so only the predicted_* lines change
    print(text)
    print(json.dumps(stats, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
