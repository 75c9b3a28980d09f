"""``hvd-compress bench models``: Horovod-style synthetic benchmarks of real
architectures (:mod:`hvd_compress.tools.bench.architectures`) on the emulated
cluster, one rank a host, in both frameworks.

For each cluster size N (a cluster of N hosts), link (``tc tbf`` on every
host's veth, or unshaped), framework and model, one ``horovodrun`` launch of
:mod:`hvd_compress.tools.bench.models_worker` runs every scheme in turn in
the same processes (a fresh model from the same seed, optimizer and
compressor each; its own warmup, calibration and timed steps), so the
launch's start-up (ssh, imports, Horovod's start) is paid once for all of
them.  With ``rounds > 1`` every scheme is built and warmed up first and
the timed steps run in rounds, the schemes alternating
(:mod:`~hvd_compress.tools.bench.models_worker`), so that the ranking of
schemes a few percent apart survives the machine's drifting load.  The
launch may run ``run_timeout`` seconds a scheme a round.  Each row:
``model``, ``framework``, ``workers``, ``link_mbit`` (None: unshaped),
``scheme``, ``median_step_s``, ``first_step_s``, ``startup_s`` (what the
steps before the timed ones took beyond as many steady steps), ``plan``
(Auto's ``{candidate: tensors}``) and, for ``Auto()``, ``auto_startup``
(probes, codec timings and decision in seconds, calibration steps, the
steps before the final plan in steps and seconds, ``link`` and ``early_link``:
the link the decision fitted and the one the first ``compress`` probed, and ``trials``: the last
decision's trial plans with their predicted and measured steps and the one
kept); ``hvdc_env`` (the ``HVDC_*`` variables the ranks saw: ``extra_env``,
``--env``); ``launch_s`` (the whole
shared launch's seconds), ``scheme_s`` (this scheme's own seconds inside
it), the machine's load before and after the scheme, and ``vs_best_fixed``
(the fastest other scheme's step over this one's, same model, framework, N
and link; for ``Auto``, ``vs_best_candidate``: the same against the
fixed schemes it may choose); ``pinned_cores`` where each rank ran bound to a core
(:mod:`hvd_compress.tools.bench.pinning`, the default).  A scheme that fails gets a failure row (``error``, or the
launch's ``rc`` and ``log_tail`` when the launch ended before its row) and
the others keep theirs.  Rows are merged into ``--out`` by (model, size,
framework, workers, link, scheme).
"""
from __future__ import annotations

import json
import os
import re
import sys
import tempfile
import time

from ..recipes import is_auto_spec
from .e2e import clean_log, parse_rates, rate_label, run_launch
from .pinning import worker_arguments
from .report import Progress, human_seconds, table, write_json
from .specs import parse_spec, split_specs

DEFAULT_SCHEMES = "none,hvd_fp16,TopK(0.01),PowerSGD(4),Int8,EFSignSGD,Auto(),Auto(include_sign=True)"
KEY = ("model", "size", "framework", "workers", "link_mbit", "scheme")


def run(models="resnet50,mobilenetv2,bert,gpt2", frameworks="torch,tensorflow", workers="2,4",
        rates="none,1000,100", schemes=DEFAULT_SCHEMES, size="full", batch=4, steps=5, rounds=1, warmup=2, threads=1,
        prefix="hvdcm", out_json=None, merge=True, run_timeout=1800, progress=True, stream=None, pin_cores=True,
        extra_env=None):
    """Every (N, link, framework, model), one launch each running every scheme; returns (rows, failures).
    ``pin_cores``: rank ``r`` bound to core ``r mod cores`` (:mod:`hvd_compress.tools.bench.pinning`; the rows
    say ``pinned_cores``).  ``extra_env``: ``{name: value}`` set for every rank (each row's ``hvdc_env``
    records the ``HVDC_*`` variables its ranks saw)."""
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
           "OMP_NUM_THREADS": str(threads), **(extra_env or {})}
    for n in sizes:
        with tempfile.TemporaryDirectory(prefix="hvdc_models_") as tmp, Cluster(n, prefix=prefix) as c:
            for rate in rates:
                c.set_rate(rate)
                for framework in frameworks:
                    for model in models:
                        cmd = _worker_command(framework, model, schemes, size, batch, (steps, rounds), warmup, threads,
                                              os.path.join(tmp, f"{rate}_{framework}_{model}.json"), pin_cores)
                        got, failed = _launch(c, cmd, n, env, run_timeout * len(schemes) * rounds, schemes)
                        for r in got + failed:
                            r["link_mbit"] = rate
                            if pin_cores:
                                r["pinned_cores"] = True
                            _report(prog, r, f"N={n} {rate_label(rate):>13} {framework} {model} {r['scheme']}")
                        rows += got
                        failures += [{**f, "model": model, "framework": framework, "workers": n} for f in failed]
    _add_best_fixed(rows)
    print(format_table(rows), file=stream)
    if failures:
        print("FAILED runs: " + ", ".join(f"N={f['workers']} {rate_label(f['link_mbit'])} {f['framework']} "
                                          f"{f['model']} {f['scheme']} ({_why(f)})" for f in failures),
              file=stream)
    if out_json:
        states = split_auto_states(rows)
        write_json(out_json, merged(out_json, rows) if merge else rows)
        write_auto_states(auto_state_path(out_json), states, merge)
        print(f"wrote {out_json}", file=stream)
        if failures:
            write_json(os.path.splitext(out_json)[0] + "_failures.json", failures)
    return rows, failures


def parse_env(items):
    """``["NAME=VALUE", ...]`` (``--env``) as ``{name: value}``; a clear error otherwise."""
    env = {}
    for item in items or ():
        name, sep, value = str(item).partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ValueError(f"--env takes NAME=VALUE, a variable name then '=' and its value; got {item!r}")
        env[name] = value
    return env


def _worker_command(framework, model, schemes, size, batch, steps_rounds, warmup, threads, out, pin_cores=False):
    """The models_worker command line: one launch, every scheme in turn
    (``steps_rounds``: timed steps a round, rounds)."""
    steps, rounds = steps_rounds
    cmd = [sys.executable, "-m", "hvd_compress.tools.bench.models_worker", "--framework", framework, "--model",
           model, "--size", size, "--batch", str(batch), "--steps", str(steps), "--rounds", str(rounds),
           "--warmup", str(warmup),
           "--threads", str(threads)] + worker_arguments(pin_cores)
    return cmd + [arg for spec in schemes for arg in ("--scheme", spec)] + ["--out", out]


def _launch(cluster, cmd, n, env, timeout, schemes):
    """One horovodrun launch running every scheme: (the schemes' rows with the
    launch's seconds, failure rows: the scheme's error, or the launch's exit
    code and log when it ended before the scheme's row)."""
    out = cmd[-1]
    argv = cluster.horovodrun_command(cmd, np=n, controller="gloo", slots=1)
    t0 = time.monotonic()
    rc, log = run_launch(cluster, argv, env, timeout)
    launch_s = time.monotonic() - t0
    written = []
    if os.path.exists(out):
        with open(out) as f:
            written = json.load(f)
    got, failed = [], []
    for i, spec in enumerate(schemes):
        row = written[i] if i < len(written) else {"scheme": spec, "rc": rc if rc != 0 else "no row",
                                                   "log_tail": clean_log(log)[-4000:]}
        row.update(launch_s=launch_s, cpus=os.cpu_count(),
                   measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        (failed if "error" in row or "rc" in row else got).append(row)
    return got, failed


def _report(prog, row, label):
    if "median_step_s" in row:
        prog.step(label, f"step {human_seconds(row['median_step_s'])}, startup {human_seconds(row['startup_s'])}, "
                         f"scheme {human_seconds(row['scheme_s'])} of a {human_seconds(row['launch_s'])} launch")
    else:
        prog.step(label, f"FAILED ({_why(row)}): {(row.get('error') or row.get('log_tail', ''))[-800:]}")


def _why(failure):
    return f"exit {failure['rc']}" if "rc" in failure else "error"


def _add_best_fixed(rows):
    """``vs_best_fixed``: the fastest other scheme's step over this row's, in
    the same run; for an ``Auto`` row also ``vs_best_candidate``: the fastest
    fixed scheme among those it may choose (:func:`auto_may_choose`)."""
    for r in rows:
        same = [x for x in rows if x is not r and all(x[k] == r[k] for k in KEY[:-1])]
        r["vs_best_fixed"] = min(x["median_step_s"] for x in same) / r["median_step_s"] if same else None
        if is_auto_spec(r["scheme"]):
            mine = [x for x in same if auto_may_choose(r["scheme"], x["scheme"])]
            r["vs_best_candidate"] = min(x["median_step_s"] for x in mine) / r["median_step_s"] if mine else None


def auto_may_choose(auto_spec, fixed_spec):
    """Whether the ``Auto`` of ``auto_spec`` has a candidate of the scheme
    class of ``fixed_spec`` (Horovod's ``none`` and ``hvd_fp16``: its
    ``none`` and FP16); False for another Auto."""
    fixed = {"none": "NoCompression", "hvd_fp16": "FP16"}.get(fixed_spec)
    if fixed is None:
        comp = parse_spec(fixed_spec)
        if hasattr(comp, "candidates"):
            return False
        fixed = type(comp.scheme).__name__
    return fixed in {type(c.scheme).__name__ for c in parse_spec(auto_spec).candidates}


def row_key(row):
    """A row's key (:data:`KEY`) as one string: ``model|size|framework|workers|link_mbit|scheme``."""
    return "|".join(str(row.get(k)) for k in KEY)


def auto_state_path(out_json):
    """Where the Auto rows' planner inputs go: beside ``out_json``, ``<stem>_auto_state.json``."""
    return os.path.splitext(out_json)[0] + "_auto_state.json"


def split_auto_states(rows):
    """``{row key: auto_state}`` taken out of the rows (tens of kB each: kept
    apart so that the rows stay readable), each number to 4 significant digits."""
    return {row_key(r): _rounded(r.pop("auto_state")) for r in rows if r.get("auto_state")}


def _rounded(x):
    if isinstance(x, float):
        return float(f"{x:.4g}")
    if isinstance(x, dict):
        return {k: _rounded(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_rounded(v) for v in x]
    return x


def write_auto_states(path, states, merge=True):
    """Write ``states`` (merged into ``path``'s where ``merge``), one compact line a row."""
    old = {}
    if merge and os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
    out = {**old, **states}
    if not out:
        return
    with open(path, "w") as f:
        f.write("{\n" + ",\n".join(f"{json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}"
                                   for k, v in out.items()) + "\n}\n")


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
            ("best candidate / Auto", lambda r: "-" if r.get("vs_best_candidate") is None
             else f"{r['vs_best_candidate']:.2f}", ">"),
            ("startup", lambda r: human_seconds(r["startup_s"]), ">"),
            ("first step", lambda r: human_seconds(r["first_step_s"]), ">"),
            ("Auto probe s", lambda r: auto_part(r, "probe_s"), ">"),
            ("Auto codec s", lambda r: auto_part(r, "codec_s"), ">"),
            ("Auto steps before plan", lambda r: auto_part(r, "steps_before_final_plan"), ">"),
            ("plan", lambda r: "-" if not r.get("plan") else ", ".join(f"{k} {v}" for k, v in r["plan"].items()),
             "<"),
            ("load", lambda r: f"{r['loadavg_1m_before']:.1f}", ">")]
    return table(rows, cols, title="bench models: Horovod-style synthetic benchmarks on the emulated cluster")
