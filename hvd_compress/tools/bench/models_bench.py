"""``hvd-compress bench models``: Horovod-style synthetic benchmarks of real
architectures (:mod:`hvd_compress.tools.bench.architectures`) on the emulated
cluster, one rank a host, in both frameworks.

For each cluster size N (a cluster of N hosts), link (``tc tbf`` on every
host's veth, or unshaped) and scheme, one ``horovodrun`` launch of
:mod:`hvd_compress.tools.bench.models_worker`.  Each row: ``model``,
``framework``, ``workers``, ``link_mbit`` (None: unshaped), ``scheme``,
``median_step_s``, ``startup_s`` (what the steps before the timed ones took
beyond as many steady steps), ``plan`` (Auto's ``{candidate: tensors}``)
and, for ``Auto()``, ``auto_startup`` (probes, codec timings and decision in
seconds, calibration steps, the steps before the final plan in steps and
seconds); with the machine's load before and after the launch and
``vs_best_fixed`` (the fastest other scheme's step over this one's, same
model, framework, N and link).  Rows are merged into ``--out`` by (model,
size, framework, workers, link, scheme).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from .e2e import clean_log, parse_rates, rate_label, run_launch
from .report import Progress, human_seconds, table, write_json
from .specs import parse_spec, split_specs

DEFAULT_SCHEMES = "none,hvd_fp16,TopK(0.01),PowerSGD(4),Int8,EFSignSGD,Auto()"
KEY = ("model", "size", "framework", "workers", "link_mbit", "scheme")


def run(models="resnet50,mobilenetv2,bert,gpt2", frameworks="torch,tensorflow", workers="2,4",
        rates="none,1000,100", schemes=DEFAULT_SCHEMES, size="full", batch=4, steps=5, warmup=2, threads=1,
        prefix="hvdcm", out_json=None, merge=True, run_timeout=1800, progress=True, stream=None):
    """Every (N, link, framework, model, scheme); returns (rows, failures)."""
    from .architectures import check
    from ..testing.cluster import Cluster
    stream = stream or sys.stdout
    models = [m.strip() for m in models.split(",") if m.strip()] if isinstance(models, str) else list(models)
    frameworks = ["tensorflow" if f.strip() in ("tf", "tensorflow") else f.strip()
                  for f in (frameworks.split(",") if isinstance(frameworks, str) else frameworks) if f.strip()]
    schemes = split_specs(schemes) if isinstance(schemes, str) else list(schemes)
    sizes = [int(n) for n in str(workers).split(",") if n.strip()] if not isinstance(workers, list) else workers
    for m in models:
        check(m, size)
    for s in schemes:
        parse_spec(s)
    rates = parse_rates(rates)
    prog = Progress(len(sizes) * len(rates) * len(frameworks) * len(models) * len(schemes), enabled=progress)
    rows, failures = [], []
    env = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_USE_LEGACY_KERAS": "1", "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": str(threads)}
    for n in sizes:
        with tempfile.TemporaryDirectory(prefix="hvdc_models_") as tmp, Cluster(n, prefix=prefix) as c:
            for rate in rates:
                c.set_rate(rate)
                for framework in frameworks:
                    for model in models:
                        for spec in schemes:
                            cmd = [sys.executable, "-m", "hvd_compress.tools.bench.models_worker", "--framework",
                                   framework, "--model", model, "--size", size, "--scheme", spec, "--batch",
                                   str(batch), "--steps", str(steps), "--warmup", str(warmup), "--threads",
                                   str(threads), "--out", os.path.join(tmp, f"r{len(rows) + len(failures)}.json")]
                            got = _launch(c, cmd, n, env, run_timeout)
                            label = f"N={n} {rate_label(rate):>13} {framework} {model} {spec}"
                            if "rc" in got:
                                failures.append({**got, "model": model, "framework": framework, "workers": n,
                                                 "link_mbit": rate, "scheme": spec})
                                prog.step(label, f"FAILED (exit {got['rc']}): {got['log_tail'][-800:]}")
                                continue
                            got["link_mbit"] = rate
                            rows.append(got)
                            prog.step(label, f"step {human_seconds(got['median_step_s'])}, startup "
                                             f"{human_seconds(got['startup_s'])}")
    _add_best_fixed(rows)
    print(format_table(rows), file=stream)
    if failures:
        print("FAILED runs: " + ", ".join(f"N={f['workers']} {rate_label(f['link_mbit'])} {f['framework']} "
                                          f"{f['model']} {f['scheme']} (exit {f['rc']})" for f in failures),
              file=stream)
    if out_json:
        write_json(out_json, merged(out_json, rows) if merge else rows)
        print(f"wrote {out_json}", file=stream)
        if failures:
            write_json(os.path.splitext(out_json)[0] + "_failures.json", failures)
    return rows, failures


def _launch(cluster, cmd, n, env, timeout):
    """One horovodrun launch: the worker's row with the load around it, or {rc, log_tail}."""
    out = cmd[-1]
    argv = cluster.horovodrun_command(cmd, np=n, controller="gloo", slots=1)
    load_before, t0 = os.getloadavg()[0], time.monotonic()
    rc, log = run_launch(cluster, argv, env, timeout)
    if rc != 0 or not os.path.exists(out):
        return {"rc": rc, "log_tail": clean_log(log)[-4000:]}
    with open(out) as f:
        row = json.load(f)
    row.update(launch_s=time.monotonic() - t0, loadavg_1m_before=load_before, loadavg_1m_after=os.getloadavg()[0],
               cpus=os.cpu_count(), measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    return row


def _add_best_fixed(rows):
    """``vs_best_fixed``: the fastest other scheme's step over this row's, in the same run."""
    for r in rows:
        same = [x for x in rows if x is not r and all(x[k] == r[k] for k in KEY[:-1])]
        r["vs_best_fixed"] = min(x["median_step_s"] for x in same) / r["median_step_s"] if same else None


def merged(path, rows):
    """The rows of ``path`` (if any) with ``rows`` replacing those of the same key."""
    old = []
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    keys = {tuple(r.get(k) for k in KEY) for r in rows}
    return [r for r in old if tuple(r.get(k) for k in KEY) not in keys] + rows


def format_table(rows):
    def auto_part(r, key):
        a = r.get("auto_startup")
        return "-" if not a else (f"{a[key]:.2f}" if isinstance(a[key], float) else str(a[key]))
    cols = [("N", lambda r: r["workers"], ">"), ("link", lambda r: rate_label(r["link_mbit"]), ">"),
            ("framework", lambda r: r["framework"], "<"), ("model", lambda r: r["model"], "<"),
            ("scheme", lambda r: r["scheme"], "<"), ("step", lambda r: human_seconds(r["median_step_s"]), ">"),
            ("best other / this", lambda r: "-" if r.get("vs_best_fixed") is None else f"{r['vs_best_fixed']:.2f}",
             ">"),
            ("startup", lambda r: human_seconds(r["startup_s"]), ">"),
            ("first step", lambda r: human_seconds(r["first_step_s"]), ">"),
            ("Auto probe s", lambda r: auto_part(r, "probe_s"), ">"),
            ("Auto codec s", lambda r: auto_part(r, "codec_s"), ">"),
            ("Auto steps before plan", lambda r: auto_part(r, "steps_before_final_plan"), ">"),
            ("plan", lambda r: "-" if not r.get("plan") else ", ".join(f"{k} {v}" for k, v in r["plan"].items()),
             "<"),
            ("load", lambda r: f"{r['loadavg_1m_before']:.1f}", ">")]
    return table(rows, cols, title="bench models: Horovod-style synthetic benchmarks on the emulated cluster")
