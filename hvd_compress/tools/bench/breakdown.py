"""``hvd-compress bench breakdown``: where a training step's time goes, measured
on the emulated cluster (root).

    sudo .venv/bin/hvd-compress bench breakdown [--schemes "none,TopK(0.01)"] [--rates none,1000,100] \
        [--prefix ac] [--steps 10] [--out docs/results/step_breakdown.json]

For each link and scheme, one ``horovodrun`` launch of ``bench e2e``'s worker
(torch, the 16M-parameter MLP, 2 hosts, Gloo) with ``--breakdown``: every rank
clocks each timed step's parts (``StepBreakdown`` in
``hvd_compress/tools/bench/e2e_worker.py``: forward, backward, encode, the
waits on Horovod's allreduces and on the side allgathers, decode, the rest of
the optimizer's synchronize, the update), and rank 0 records Horovod's
timeline of the timed steps (``HOROVOD_TIMELINE=DYNAMIC``,
``hvd.start_timeline(..., mark_cycles=True)``), from which come, per step:
the negotiation time of every collective (enqueued until every rank is
ready), the collectives' own execution (Gloo's allgather/allreduce, the
fusion-buffer copies) and Horovod's cycles.  ``link_s`` is the bytes the
scheme should put on the wire per step at the measured TCP goodput: the part
of the collectives' execution that is the link, the rest of it their CPU.

Medians over the timed steps; parts are per rank (the table shows the mean
of the two ranks' medians).  The parts that overlap (a collective runs in
Horovod's background thread while the backward pass goes on) are shown as
measured: the timeline's spans are not a partition of the step, the clocks
are.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time

from ..units import parse_count
from .e2e import REPO, expected_wire, parse_rates
from .specs import split_specs

#: the clocked parts of a step, in the order they happen
PARTS = ("forward", "backward", "encode", "wait_allreduce", "wait_gather", "decode", "sync_rest", "update")


def parse_timeline(path):
    """Chrome-trace events of Horovod's timeline (rank 0's file; Horovod
    may leave the JSON array unclosed) -> totals in seconds:
    ``{"negotiate": {op: s}, "execute": {op: s}, "activity": {name: s},
    "cycles": n, "collectives": {op: n}}``."""
    text = open(path).read().strip()
    if not text:
        return None
    text = text.rstrip(",")
    if not text.endswith("]"):
        text += "]"
    try:
        events = json.loads(text)
    except json.JSONDecodeError:  # a torn last line: drop it
        events = json.loads(text[:text.rstrip("]").rstrip().rfind("\n")].rstrip().rstrip(",") + "]")
    stacks, out = {}, {"negotiate": {}, "execute": {}, "activity": {}, "cycles": 0, "collectives": {}}
    for ev in events:
        ph, pid = ev.get("ph"), ev.get("pid")
        if ev.get("name") == "CYCLE_START":
            out["cycles"] += 1
            continue
        if ph == "B":
            stacks.setdefault(pid, []).append((ev.get("name", ""), float(ev.get("ts", 0))))
        elif ph == "E" and stacks.get(pid):
            name, t0 = stacks[pid].pop()
            seconds = (float(ev.get("ts", 0)) - t0) * 1e-6
            depth = len(stacks[pid])
            if depth == 0 and name.startswith("NEGOTIATE_"):
                op = name[len("NEGOTIATE_"):]
                out["negotiate"][op] = out["negotiate"].get(op, 0.0) + seconds
            elif depth == 0:
                out["execute"][name] = out["execute"].get(name, 0.0) + seconds
                out["collectives"][name] = out["collectives"].get(name, 0) + 1
            else:
                out["activity"][name] = out["activity"].get(name, 0.0) + seconds
    return out


def summarize(row, timeline, goodput_mbit):
    """The per-step table row: the clocked parts (mean over ranks of each
    rank's median), the timeline's totals per step, and the link's share."""
    steps = row["steps"]
    per_rank = row["breakdown_per_rank"]
    parts = {p: statistics.mean(statistics.median(s[p] for s in r["steps"]) for r in per_rank) for p in PARTS}
    parts["step"] = statistics.mean(statistics.median(s["step"] for s in r["steps"]) for r in per_rank)
    wire = row.get("expected_wire_bytes_per_step") or 0.0
    link_s = wire / (goodput_mbit * 1e6 / 8) if goodput_mbit else None
    out = {"scheme": row["scheme"], "link_mbit": row["link_mbit"], "link_measured_mbit": goodput_mbit,
           "median_step_s": row["median_step_s"], "compute_s": row["compute_s"], "parts_s": parts,
           "expected_wire_bytes_per_step": wire, "link_s": link_s, "steps": steps}
    if timeline is not None:
        out["timeline_per_step"] = {
            "negotiate_s": {k: v / steps for k, v in timeline["negotiate"].items()},
            "execute_s": {k: v / steps for k, v in timeline["execute"].items()},
            "activity_s": {k: v / steps for k, v in timeline["activity"].items()},
            "collectives": {k: v / steps for k, v in timeline["collectives"].items()},
            "cycles": timeline["cycles"] / steps}
    return out


def markdown(rows):
    head = ("| link | scheme | step | forward + backward + update | encode | decode | wait: allreduces | "
            "wait: allgathers | sync rest | timeline: negotiation | timeline: execution | link time | cycles |")
    lines = [head, "|---|---|" + "---:|" * 11]
    for r in rows:
        p, tl = r["parts_s"], r.get("timeline_per_step", {})
        link = "unshaped" if r["link_mbit"] is None else f"{r['link_mbit']:g} Mbit/s"

        def ms(v):
            return "-" if v is None else f"{1e3 * v:.0f}"
        lines.append(f"| {link} | {r['scheme']} | {ms(p['step'])} | "
                     f"{ms(p['forward'] + p['backward'] + p['update'])} | {ms(p['encode'])} | {ms(p['decode'])} | "
                     f"{ms(p['wait_allreduce'])} | {ms(p['wait_gather'])} | {ms(p['sync_rest'])} | "
                     f"{ms(sum(tl.get('negotiate_s', {}).values()) if tl else None)} | "
                     f"{ms(sum(tl.get('execute_s', {}).values()) if tl else None)} | {ms(r['link_s'])} | "
                     f"{tl.get('cycles', 0):.0f} |")
    return "\n".join(lines)


def add_arguments(p):
    p.add_argument("--schemes", default="TopK(0.01)", help="comma-separated specs (default %(default)s)")
    p.add_argument("--rates", default="none,1000,100", help="link rates in Mbit/s, 'none' = unshaped "
                   "(default %(default)s)")
    p.add_argument("--prefix", default="hvdsb", help="cluster name prefix (default %(default)s)")
    p.add_argument("--params", default="16M", help="parameter count of the MLP (default %(default)s)")
    p.add_argument("--steps", type=int, default=10, help="timed steps (default %(default)s)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default=None, help="JSON of the rows (default: print only)")


def _launch(cluster, spec, rate, goodput, args, tmp, index):
    """One scheme at one link: the worker under horovodrun, its row summarized (None if it failed)."""
    out, timeline = os.path.join(tmp, f"r{index}.json"), os.path.join(tmp, f"t{index}.json")
    cmd = [sys.executable, "-m", "hvd_compress.tools.bench.e2e_worker", "--framework", "torch",
           "--model", "mlp", "--params", str(parse_count(args.params)), "--scheme", spec,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--max-seconds", "30",
           "--iface", cluster.iface, "--breakdown", "--step-timeline", timeline, "--out", out]
    env = {"TF_CPP_MIN_LOG_LEVEL": "3", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "HOROVOD_TIMELINE": "DYNAMIC"}
    load = os.getloadavg()[0]
    r = cluster.run(0, cluster.horovodrun_command(cmd, np=2, controller="gloo", slots=1), env=env, timeout=900,
                    cwd=str(REPO))
    if r.returncode != 0 or not os.path.exists(out):
        print(f"{spec} at {rate}: FAILED (exit {r.returncode})\n{(r.stdout or '')[-2000:]}"
              f"{(r.stderr or '')[-2000:]}", file=sys.stderr)
        return None
    with open(out) as f:
        row = json.load(f)
    row["link_mbit"] = rate
    row["expected_wire_bytes_per_step"] = expected_wire(row["transport"], row["payload_bytes_per_step"],
                                                        row["workers"])
    time.sleep(0.5)  # the timeline's writer thread flushes on stop
    s = summarize(row, parse_timeline(timeline) if os.path.exists(timeline) else None, goodput)
    s["loadavg_1m_before"], s["loadavg_1m_after"] = load, os.getloadavg()[0]
    return s


def main_args(args, command) -> int:
    """Every scheme at every link, in one cluster; the table printed and, with ``--out``, the JSON."""
    from ..testing.cluster import Cluster
    rows, result = [], {"command": command, "loadavg_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="hvdc_breakdown_") as tmp, Cluster(2, prefix=args.prefix) as c:
        os.chmod(tmp, 0o755)
        for rate in parse_rates(args.rates):
            c.set_rate(rate)
            goodput = c.measure_throughput_mbit(src=1, dst=0, seconds=2.0)
            for spec in split_specs(args.schemes):
                s = _launch(c, spec, rate, goodput, args, tmp, len(rows))
                if s is not None:
                    rows.append(s)
                    print(markdown([s]).splitlines()[-1], flush=True)
    result["rows"] = rows
    print(markdown(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")
    return 0
