"""``hvd-compress bench e2e``: training steps on the emulated cluster.

For each link rate (``tc tbf`` on every host's veth, both directions; or
unshaped) and each scheme, one ``horovodrun`` launch of
:mod:`hvd_compress.tools.bench.e2e_worker` across the cluster's hosts (one rank per
host by default).  Per run:

* ``median_step_s`` -- median over the timed steps of the slowest rank's step
  (zero_grad, forward, backward with Horovod's hooks, optimizer step);
* ``compute_s`` -- the same model's purely local step, timed on every rank at
  once before Horovod is involved; ``comm_s_measured = median_step_s -
  compute_s`` is what ``advise --validate`` compares its predictions with;
* ``payload_bytes_per_step`` -- bytes each rank hands to Horovod per step
  (``compressor.stats.totals()``; a counting wrapper for Horovod's own
  ``none``/``fp16``), mean over ranks;
* ``wire_bytes_per_step`` -- bytes each host's interface transmitted per timed
  step (veth counters read inside the host's namespace right after barriers
  around the timed steps), mean over hosts; ``wire_to_payload`` is their
  ratio and ``expected_wire_bytes_per_step`` what the transport should send
  (ring allreduce ``2(N-1)/N x payload``, allgather ``(N-1) x payload``).
  ``idle_wire_bytes_per_s`` is what the interface sends while no tensor is
  pending (Horovod's background coordination, measured for 1 s after the
  timed steps); ``control_bytes_per_step`` = that rate x the mean step time,
  and ``wire_minus_control_to_payload`` the ratio without it.
  ``wire_bytes_run_total`` is the whole launch (start-up, broadcasts and
  warm-up included) from the cluster's own counters, for cross-checking.
* ``speedup_vs_none`` / ``speedup_vs_hvd_fp16`` -- ratio of median step times
  at the same link rate.
* ``ceiling_step_s`` -- the byte-limited step: the median ``compute_s`` of
  this link's runs plus ``expected_wire_bytes_per_step`` at the measured TCP goodput
  (``link_measured_mbit``), as if encoding were free and nothing overlapped;
  ``ceiling_speedup`` is ``none``'s median step over it, and
  ``ceiling_fraction`` the share of it that ``speedup_vs_none`` reaches.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..units import parse_count, parse_rate
from .report import Progress, human_bytes, human_count, human_seconds, table, write_json
from .specs import parse_spec, split_specs

DEFAULT_SCHEMES = ("none", "hvd_fp16", "TopK(0.01)", "Int8", "EFSignSGD", "FP16", "DGC(0.01)")
DEFAULT_RATES = "none,1000,100"
FIELDS = ("scheme", "framework", "model_params", "workers", "link_mbit", "median_step_s", "speedup_vs_none",
          "speedup_vs_hvd_fp16", "payload_bytes_per_step", "wire_bytes_per_step")
REPO = Path(__file__).resolve().parents[3]  # the checkout: hvd_compress/tools/bench/e2e.py


def parse_rates(text):
    if isinstance(text, (list, tuple)):
        return [None if r is None else parse_rate(r) for r in text]
    return [parse_rate(t.strip()) for t in str(text).split(",") if t.strip()]


def expected_wire(transport, payload, n):
    if transport == "mixed":  # Auto: a transport per tensor; the plan, not the spec, says which
        return None
    if n <= 1 or payload is None:
        return 0.0
    if transport in ("allreduce", "powersgd"):
        return 2.0 * (n - 1) / n * payload
    return float(n - 1) * payload


def rate_label(r):
    return "unshaped" if r is None else f"{r:g} Mbit/s"


def run(framework="torch", model="mlp", params="16M", hosts=2, workers=None, rates=DEFAULT_RATES,
        schemes=DEFAULT_SCHEMES, steps=10, warmup=2, max_seconds=30.0, batch=32, threads=1,
        controller="gloo", out_json=None, out_png=None, prefix="hvdcb", measure_link=True,
        run_timeout=900, progress=True, stream=None, allocator="default"):
    """Bring up the cluster, run every (rate, scheme), tear it down; return the rows.
    ``allocator``: one of :data:`hvd_compress.tools.bench.micro.ALLOCATORS`, the glibc
    malloc settings every rank starts with."""
    from .micro import ALLOCATORS, check_allocator
    from ..testing.cluster import Cluster

    stream = stream or sys.stdout
    framework = "tensorflow" if framework in ("tf", "tensorflow") else framework
    schemes = split_specs(schemes) if isinstance(schemes, str) else list(schemes)
    for s in schemes:
        parse_spec(s)
    rates = parse_rates(rates)
    check_allocator("allocator", allocator)
    params = parse_count(params)
    workers = workers or hosts
    slots = -(-workers // hosts)
    prog = Progress(len(rates) * len(schemes), enabled=progress)
    rows, failures = [], []
    env = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_USE_LEGACY_KERAS": "1", "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": str(threads), **ALLOCATORS[allocator]}
    with tempfile.TemporaryDirectory(prefix="hvdc_e2e_") as tmp, Cluster(hosts, prefix=prefix) as c:
        prog.note(f"cluster '{prefix}': {', '.join(c.hosts)}; {workers} worker(s), {framework} {model} "
                  f"~{human_count(params)} params, schemes: {', '.join(schemes)}")
        for rate in rates:
            c.set_rate(rate)
            measured = None
            if measure_link:
                try:
                    measured = c.measure_throughput_mbit(src=1 if hosts > 1 else 0, dst=0, seconds=2.0)
                    prog.note(f"link {rate_label(rate)}: measured TCP goodput {measured:.0f} Mbit/s")
                except Exception as e:  # the benchmark can go on without it
                    prog.note(f"link {rate_label(rate)}: throughput measurement failed: {e}")
            for spec in schemes:
                out = os.path.join(tmp, f"r{len(rows) + len(failures)}.json")
                cmd = [sys.executable, "-m", "hvd_compress.tools.bench.e2e_worker", "--framework", framework,
                       "--model", model, "--params", str(params), "--batch", str(batch), "--scheme", spec,
                       "--steps", str(steps), "--warmup", str(warmup), "--max-seconds", str(max_seconds),
                       "--threads", str(threads), "--iface", c.iface, "--out", out]
                argv = c.horovodrun_command(cmd, np=workers, controller=controller, slots=slots)
                before = c.link_bytes()
                load_before = os.getloadavg()[0]
                t0 = time.monotonic()
                rc, err = run_launch(c, argv, env, run_timeout)
                after = c.link_bytes()
                label = f"{rate_label(rate):>13} {spec:<24}"
                if rc != 0 or not os.path.exists(out):
                    failures.append({"scheme": spec, "link_mbit": rate, "rc": rc,
                                     "log_tail": clean_log(err)[-4000:]})
                    prog.step(label, f"FAILED (exit {rc}); log tail:\n{clean_log(err)[-1500:]}")
                    continue
                with open(out) as f:
                    row = json.load(f)
                row["link_mbit"] = rate
                row["link_measured_mbit"] = measured
                row["controller"] = controller
                row["allocator"] = allocator
                row["launch_s"] = time.monotonic() - t0
                # load of the machine (other users' work competes for the same CPUs)
                row["loadavg_1m_before"], row["loadavg_1m_after"] = load_before, os.getloadavg()[0]
                row["cpus"] = os.cpu_count()
                row["wire_bytes_run_total"] = sum(after[h].tx - before[h].tx for h in c.hosts) / len(c.hosts)
                row["expected_wire_bytes_per_step"] = expected_wire(row["transport"], row["payload_bytes_per_step"],
                                                                    row["workers"])
                row["wire_to_payload"] = (row["wire_bytes_per_step"] / row["payload_bytes_per_step"]
                                          if row.get("wire_bytes_per_step") and row["payload_bytes_per_step"]
                                          else None)
                row["wire_to_expected"] = (row["wire_bytes_per_step"] / row["expected_wire_bytes_per_step"]
                                           if row.get("wire_bytes_per_step") and row["expected_wire_bytes_per_step"]
                                           else None)
                idle = row.get("idle_wire_bytes_per_s")
                row["control_bytes_per_step"] = idle * row["mean_step_s"] if idle is not None else None
                row["wire_minus_control_to_payload"] = (
                    (row["wire_bytes_per_step"] - row["control_bytes_per_step"]) / row["payload_bytes_per_step"]
                    if row["control_bytes_per_step"] is not None and row.get("wire_bytes_per_step")
                    and row["payload_bytes_per_step"] else None)
                row["comm_s_measured"] = (row["median_step_s"] - row["compute_s"]
                                          if row.get("compute_s") is not None else None)
                rows.append(row)
                base = [x for x in rows if x["scheme"] == "none" and x["link_mbit"] == rate]
                sp = f" ({base[0]['median_step_s'] / row['median_step_s']:.2f}x vs none)" if base else ""
                prog.step(label, f"step {human_seconds(row['median_step_s'])}{sp}, payload "
                                 f"{human_bytes(row['payload_bytes_per_step'])}, wire "
                                 f"{human_bytes(row['wire_bytes_per_step'])}/step")
    _add_speedups(rows)
    print(format_table(rows), file=stream)
    if failures:
        print("FAILED runs: " + ", ".join(f"{f['scheme']} @ {rate_label(f['link_mbit'])} (exit {f['rc']})"
                                          for f in failures), file=stream)
    if out_json:
        write_json(out_json, rows)
        print(f"wrote {out_json}", file=stream)
        if failures:
            write_json(os.path.splitext(out_json)[0] + "_failures.json", failures)
    if out_png and rows:
        paths = plot(rows, out_png)
        print("wrote " + ", ".join(paths), file=stream)
    return Rows(rows, failures)


class Rows(list):
    def __init__(self, rows, failures=()):
        super().__init__(rows)
        self.failures = list(failures)


def run_launch(cluster, argv, env, timeout):
    """One horovodrun launch from the cluster's first host, in the checkout:
    (its exit code, or "timeout"; its stdout and stderr together)."""
    try:
        r = cluster.run(0, argv, env=env, timeout=timeout, cwd=str(REPO))
        return r.returncode, (r.stdout or "") + (r.stderr or "")
    except subprocess.TimeoutExpired as e:
        return "timeout", str(e.stderr or "")


def clean_log(text):
    drop = ("I0000 ", "WARNING: All log messages", "oneDNN custom operations", "cudart_stub",
            "Could not find cuda drivers")
    return "\n".join(l for l in str(text).splitlines() if not any(d in l for d in drop))


def _add_speedups(rows):
    for r in rows:
        same = [x for x in rows if x["link_mbit"] == r["link_mbit"] and x["framework"] == r["framework"]
                and x["model_params"] == r["model_params"] and x["workers"] == r["workers"]]
        for name, key in (("none", "speedup_vs_none"), ("hvd_fp16", "speedup_vs_hvd_fp16")):
            b = [x for x in same if x["scheme"] == name]
            r[key] = b[0]["median_step_s"] / r["median_step_s"] if b else None
        _add_ceiling(r, same)


def _add_ceiling(r, same):
    """The byte-limited step: the model's compute (the median over this
    link's runs of the purely local step, which is the same work in each) plus
    the bytes the transport puts on the wire at the measured link goodput,
    with zero encode cost and no overlap; and the speedup over ``none`` that
    it would give, and the share of it reached."""
    import statistics
    rate = r.get("link_measured_mbit") or r.get("link_mbit")
    base = next((x for x in same if x["scheme"] == "none"), None)
    computes = [x["compute_s"] for x in same if x.get("compute_s") is not None]
    compute = statistics.median(computes) if computes else None
    if not rate or compute is None or r.get("expected_wire_bytes_per_step") is None:
        r["ceiling_step_s"] = r["ceiling_speedup"] = r["ceiling_fraction"] = None
        return
    r["ceiling_step_s"] = compute + r["expected_wire_bytes_per_step"] * 8.0 / (rate * 1e6)
    r["ceiling_speedup"] = base["median_step_s"] / r["ceiling_step_s"] if base else None
    r["ceiling_fraction"] = (r["speedup_vs_none"] / r["ceiling_speedup"]
                             if r["ceiling_speedup"] and r.get("speedup_vs_none") else None)


def format_table(rows):
    def f2(v):
        return "-" if v is None else f"{v:.2f}"

    cols = [("link", lambda r: rate_label(r["link_mbit"]), ">"),
            ("scheme", lambda r: r["scheme"], "<"),
            ("step (median)", lambda r: human_seconds(r["median_step_s"]), ">"),
            ("compute", lambda r: human_seconds(r.get("compute_s")), ">"),
            ("vs none", lambda r: f2(r.get("speedup_vs_none")), ">"),
            ("vs hvd fp16", lambda r: f2(r.get("speedup_vs_hvd_fp16")), ">"),
            ("ceiling", lambda r: f2(r.get("ceiling_speedup")), ">"),
            ("of ceiling", lambda r: "-" if r.get("ceiling_fraction") is None else f"{r['ceiling_fraction']:.0%}", ">"),
            ("payload/step", lambda r: human_bytes(r["payload_bytes_per_step"]), ">"),
            ("wire/step", lambda r: human_bytes(r.get("wire_bytes_per_step")), ">"),
            ("wire/payload", lambda r: f2(r.get("wire_to_payload")), ">"),
            ("idle ctl/s", lambda r: human_bytes(r.get("idle_wire_bytes_per_s")), ">"),
            ("(wire-ctl)/payload", lambda r: f2(r.get("wire_minus_control_to_payload")), ">"),
            ("steps", lambda r: r["steps"], ">")]
    head = ""
    if rows:
        r = rows[0]
        head = (f"bench e2e: {r['framework']} {r['model']} {human_count(r['model_params'])} params, "
                f"{r['workers']} workers on {r['hosts']} hosts, batch {r['batch']}, {r['threads']} thread(s)/rank")
    return table(rows, cols, title=head)


def plot(rows, path):
    """Two PNGs: ``path`` (step time vs link rate per scheme) and
    ``<path stem>_wire.png`` (payload and wire bytes per step per scheme)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    rates = list(dict.fromkeys(r["link_mbit"] for r in rows))
    rates.sort(key=lambda x: -(x if x is not None else float("inf")))  # unshaped, fast -> slow
    schemes = list(dict.fromkeys(r["scheme"] for r in rows))
    r0 = rows[0]
    desc = (f"{r0['framework']} {r0['model']} {human_count(r0['model_params'])} params, "
            f"{r0['workers']} workers / {r0['hosts']} hosts")

    fig, ax = plt.subplots(figsize=(8, 5))
    for s in schemes:
        ys = []
        for rate in rates:
            m = [r["median_step_s"] for r in rows if r["scheme"] == s and r["link_mbit"] == rate]
            ys.append(m[0] if m else np.nan)
        ax.plot(range(len(rates)), ys, marker="o", label=s)
    ax.set_xticks(range(len(rates)))
    ax.set_xticklabels([rate_label(r) for r in rates])
    ax.set_yscale("log")
    ax.set_xlabel("link rate (tc tbf on every host's veth)")
    ax.set_ylabel("median step time [s]")
    ax.set_title(f"bench e2e: step time vs link rate\n{desc}", fontsize=10)
    ax.grid(which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)

    wire_path = os.path.splitext(path)[0] + "_wire.png"
    fig, ax = plt.subplots(figsize=(10, 5))
    width = 0.8 / (len(rates) + 1)
    x = np.arange(len(schemes))
    pay = []
    for s in schemes:
        m = [r["payload_bytes_per_step"] for r in rows if r["scheme"] == s]
        pay.append(m[0] if m else np.nan)
    ax.bar(x - 0.4 + width / 2, pay, width, label="payload at the Horovod call", color="0.6", hatch="//")
    for j, rate in enumerate(rates):
        w = []
        for s in schemes:
            m = [r.get("wire_bytes_per_step") for r in rows if r["scheme"] == s and r["link_mbit"] == rate]
            w.append(m[0] if m and m[0] else np.nan)
        ax.bar(x - 0.4 + width * (j + 1.5), w, width, label=f"wire (veth tx), {rate_label(rate)}")
    ax.set_xticks(x)
    ax.set_xticklabels(schemes, rotation=20, ha="right")
    ax.set_yscale("log")
    ax.set_ylabel("bytes per step per rank/host")
    ax.set_title(f"bench e2e: bytes per step, counted at Horovod vs on the wire\n{desc}", fontsize=10)
    ax.grid(axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(wire_path, dpi=110)
    plt.close(fig)
    return [path, wire_path]
