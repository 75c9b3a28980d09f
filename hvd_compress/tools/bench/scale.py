"""``hvd-compress bench scale``: training steps at several cluster sizes.

One emulated cluster (:class:`hvd_compress.tools.testing.cluster.Cluster`) of
``max(workers)`` hosts; for each link rate (``tc tbf`` on every host's veth,
both directions) the TCP goodput and round-trip time between two hosts are
measured, then for each N one ``horovodrun -np N --gloo`` on the first N hosts
(one rank a host) runs :mod:`hvd_compress.tools.bench.e2e_worker` with every
scheme in blocks: per block a fresh model, compute-only steps on every rank at
once, warm-up, timed steps; ``--passes`` passes, every other one in reverse
order, the steps of a scheme's blocks pooled.  The rows are merged into the
output file: a row replaces the one with the same (scheme, workers,
link_mbit, model_params), the others stay.

Output: a JSON list of rows (``docs/results/scale_measured.json``).  Field
names are stable; a script that adds predictions writes fields named
``predicted_*`` and leaves the others alone.

Identification
    ``scheme`` (the spec, e.g. ``TopK(0.01, transport='two_phase')``),
    ``transport`` (``allreduce``: Horovod's dense ring allreduce carries the
    payload; ``allgather``; ``two_phase``; ``powersgd``: allreduces of P and Q;
    ``mixed``: Auto, a scheme and transport per tensor, see ``auto_plan``),
    ``workers`` (N, one rank a host), ``hosts``, ``framework``, ``model``,
    ``model_params``, ``layer_shapes`` (every gradient's shape, in
    ``model.parameters()`` order) and ``layer_numels``, ``batch``, ``threads``
    (per rank), ``controller``.
Link
    ``link_mbit`` (the tbf rate), ``link_measured_mbit`` (TCP goodput host 2 ->
    host 1 over 2 s), ``link_rtt_s`` (median round trip of a 1-byte TCP
    ping-pong between the same hosts).
Horovod
    ``horovod_cycle_time_ms``, ``horovod_fusion_threshold_bytes`` (what the
    ranks ran with: the environment's value, else Horovod 0.28.1's default of
    1 ms and 128 MiB), ``horovod_settings_from_env``.
Time, seconds (the slowest rank of each step; medians over the pooled steps)
    ``median_step_s`` (zero_grad, forward, backward with Horovod's hooks,
    optimizer step incl. Horovod's synchronize), ``step_s_all``;
    ``compute_s`` (the same model's purely local step, timed on every rank at
    once right before the scheme's distributed steps, so it carries the same
    CPU sharing), ``compute_s_all``; ``link_s`` = ``median_step_s -
    compute_s``: everything the distributed step adds (codec work, waiting
    on the link and on other ranks); ``backward_s``: zero_grad + forward +
    backward of the distributed step (the hooks' compress calls run inside).
    Per rank, summed over the timed steps and divided by their number:
    ``encode_s_per_step`` (CPU time inside ``compress``: error feedback,
    encode, launching collectives), ``decode_s_per_step`` (CPU time inside
    ``decompress``: two-phase's owner round, decode), ``encode_wait_s_per_step``
    and ``decode_wait_s_per_step`` (time blocked in ``horovod.torch.synchronize``
    inside those calls, i.e. waiting for hvd_compress's side collectives);
    mean over ranks, and ``*_max`` the slowest rank.  For Horovod's ``none`` and
    ``hvd_fp16`` Horovod waits for its allreduce itself, so their waits are 0.
    ``mean_step_s``: wall time of the timed steps / their number.
Bytes per step (timed steps only)
    ``payload_bytes_per_step``: what each rank hands to Horovod's collectives
    (two-phase: the N chunk payloads of the alltoall, its own included, plus
    the owned chunk's payload), mean over ranks; ``wire_bytes_per_step`` /
    ``wire_rx_bytes_per_step``: bytes each host's interface sent / received,
    mean over hosts; ``wire_per_host``: every host's tx and rx;
    ``expected_wire_bytes_per_step``: what the transport should send per host
    from the payload (allreduce and powersgd ``2(N-1)/N P``, allgather
    ``(N-1) P``, two_phase ``2(N-1)/(N+1) P``: a ``(N-1)/N`` share of the
    alltoall's ``N/(N+1) P`` plus ``N-1`` copies of the owned chunk's ``P/(N+1)``;
    Auto: None); ``wire_to_expected``; ``idle_wire_bytes_per_s``: Horovod's
    coordination traffic while nothing is pending (measured for
    ``--idle-seconds`` after each block; not subtracted).
Comparisons (same N, same link)
    ``speedup_vs_none``, ``speedup_vs_hvd_fp16``: ratios of median steps.
Run
    ``steps``, ``passes``, ``warmup`` (Auto: plus its calibration steps and the
    step that applies its first plan), ``launch_s``, ``loadavg_1m_before``/
    ``_after`` (the machine is shared: other work competes for its CPUs),
    ``runnable_before`` (other work runnable right before the launch: the mean
    of ``/proc/loadavg``'s running count over a second, less the sampler;
    unlike the 1-minute load average it does not carry the last launch),
    ``settle_s`` (how long the launch waited for that to fall to
    :data:`QUIET_RUNNABLE`),
    ``cpus``, ``measured_at`` (UTC), ``command`` (the command line that made
    the row), ``per_rank``, ``auto_plan`` (Auto only), ``pinned_cores`` (true
    where each rank ran bound to core ``rank mod cores``, the default; absent
    where ``--no-pin-cores`` left the ranks to the scheduler).
"""
from __future__ import annotations

import datetime
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

from ..recipes import is_auto_spec
from ..units import parse_count
from .e2e import clean_log, parse_rates, rate_label, run_launch
from .pinning import worker_arguments
from .report import Progress, human_bytes, human_count, human_seconds, table, write_json
from .specs import parse_spec, split_specs

DEFAULT_SCHEMES = ("none", "hvd_fp16", "TopK(0.01)", "TopK(0.01, transport='two_phase')",
                   "Int8(transport='two_phase')", "EFSignSGD", "PowerSGD(4)", "Auto()")
DEFAULT_WORKERS = "2,4,8"
DEFAULT_RATES = "100,1000"
DEFAULT_PARAMS = "4M"
#: the fields that identify a row: a new row replaces an old one with the same values
ROW_KEY = ("scheme", "workers", "link_mbit", "model_params", "framework", "model")


#: a launch waits (up to ``settle_max_s``) until at most this many other
#: tasks are runnable, so that one launch's ranks do not run into the next's
QUIET_RUNNABLE = 0.5


def runnable_now(seconds=1.0, interval=0.05):
    """Tasks runnable on this machine, besides the caller: the mean over
    ``seconds`` of ``/proc/loadavg``'s running count, less one (the sampler);
    None where it cannot be read."""
    samples = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            with open("/proc/loadavg") as f:
                samples.append(int(f.read().split()[3].split("/")[0]) - 1)
        except (OSError, ValueError, IndexError):
            return None
        time.sleep(interval)
    return max(0.0, statistics.mean(samples)) if samples else None


def settle(max_s=60.0, quiet=QUIET_RUNNABLE):
    """Wait until at most ``quiet`` other tasks are runnable, or ``max_s``:
    (runnable, seconds waited)."""
    t0 = time.monotonic()
    while True:
        now = runnable_now()
        if now is None or now <= quiet or time.monotonic() - t0 >= max_s:
            return now, time.monotonic() - t0


def parse_workers(text):
    if isinstance(text, (list, tuple)):
        values = [int(v) for v in text]
    else:
        try:
            values = [int(t) for t in str(text).split(",") if t.strip()]
        except ValueError:
            raise ValueError(f"workers must be a comma list of integers >= 2, got {text!r}") from None
    if not values or any(v < 2 for v in values):
        raise ValueError(f"workers must be a comma list of integers >= 2, got {text!r}")
    return values


def expected_wire(transport, payload, n):
    """Bytes per step each host should send for ``payload`` bytes at the Horovod call."""
    if transport in (None, "mixed", "auto") or payload is None:
        return None
    if n <= 1:
        return 0.0
    if transport in ("allreduce", "powersgd"):
        return 2.0 * (n - 1) / n * payload
    if transport == "two_phase":
        return 2.0 * (n - 1) / (n + 1) * payload
    return float(n - 1) * payload


def build_row(worker_row, *, link_mbit, link_measured_mbit, link_rtt_s, controller, command, launch_s=None,
              load_before=None, load_after=None, measured_at=None, runnable_before=None, settle_s=None,
              pinned_cores=False):
    """A ``scale_measured.json`` row from one scheme's worker row and what the
    driver knows of the link and the run."""
    row = dict(worker_row)
    row.update(link_mbit=link_mbit, link_measured_mbit=link_measured_mbit, link_rtt_s=link_rtt_s,
               controller=controller, command=command, launch_s=launch_s, loadavg_1m_before=load_before,
               loadavg_1m_after=load_after, cpus=os.cpu_count(), measured_at=measured_at,
               runnable_before=runnable_before, settle_s=settle_s)
    compute = row.get("compute_s")
    row["link_s"] = row["median_step_s"] - compute if compute is not None else None
    row["comm_s_measured"] = row["link_s"]  # the name ``advise --validate`` reads
    row["expected_wire_bytes_per_step"] = expected_wire(row.get("transport"), row.get("payload_bytes_per_step"),
                                                        row["workers"])
    if pinned_cores:
        row["pinned_cores"] = True
    wire, exp = row.get("wire_bytes_per_step"), row["expected_wire_bytes_per_step"]
    row["wire_to_expected"] = wire / exp if wire and exp else None
    return row


def row_key(row):
    return tuple(row.get(k) for k in ROW_KEY)


def merge_rows(old, new):
    """``old`` with every row of ``new`` replacing the one with its key (or added)."""
    keys = {row_key(r) for r in new}
    return [r for r in old if row_key(r) not in keys] + list(new)


def add_comparisons(rows):
    """``speedup_vs_none`` and ``speedup_vs_hvd_fp16`` within each (N, link, model)."""
    for r in rows:
        same = [x for x in rows if x["workers"] == r["workers"] and x["link_mbit"] == r["link_mbit"]
                and x["model_params"] == r["model_params"] and x["framework"] == r["framework"]]
        for name, key in (("none", "speedup_vs_none"), ("hvd_fp16", "speedup_vs_hvd_fp16")):
            base = [x for x in same if x["scheme"] == name]
            r[key] = base[0]["median_step_s"] / r["median_step_s"] if base else None
    return rows


def paired_ratio(best, auto):
    """``best``'s step over ``auto``'s pass by pass (``pass_median_step_s``:
    the blocks of one launch alternate schemes, so a pass's two blocks ran
    minutes apart at most and share the machine's load): (median, lowest,
    highest) over the passes, or None where either row lacks them."""
    b, a = best.get("pass_median_step_s"), auto.get("pass_median_step_s")
    if not b or not a or len(a) != len(b) or any(v is None or v <= 0 for v in a + b):
        return None
    ratios = sorted(x / y for x, y in zip(b, a))
    return statistics.median(ratios), ratios[0], ratios[-1]


def auto_vs_best(rows):
    """Per (N, link) and per Auto row: its median step against the best fixed
    scheme's (every row not Auto): ``[{workers, link_mbit, auto_scheme,
    auto_step_s, best_scheme, best_step_s, ratio, paired}]``, ratio = best /
    Auto over the pooled steps (1.0: Auto is as fast); ``paired``: the same
    ratio pass by pass (:func:`paired_ratio`: median, lowest, highest)."""
    out = []
    for n, link in sorted({(r["workers"], r["link_mbit"]) for r in rows}, key=lambda k: (k[0], k[1] or 0)):
        same = [r for r in rows if r["workers"] == n and r["link_mbit"] == link]
        fixed = [r for r in same if not is_auto_spec(r["scheme"])]
        if not fixed:
            continue
        best = min(fixed, key=lambda r: r["median_step_s"])
        for auto in (r for r in same if is_auto_spec(r["scheme"])):
            out.append({"workers": n, "link_mbit": link, "auto_scheme": auto["scheme"],
                        "auto_step_s": auto["median_step_s"], "best_scheme": best["scheme"],
                        "best_step_s": best["median_step_s"], "ratio": best["median_step_s"] / auto["median_step_s"],
                        "paired": paired_ratio(best, auto)})
    return out


def measure_rtt_s(cluster, src=1, dst=0, rounds=50, port=5202):
    """Median round trip of a 1-byte TCP ping-pong from host ``src`` to ``dst``."""
    from ..testing.cluster import ClusterError, _killpg
    echo = ("import socket\n"
            "s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
            f"s.bind(('0.0.0.0',{port}));s.listen(1);print('ready',flush=True)\n"
            "c,_=s.accept();c.setsockopt(socket.IPPROTO_TCP,socket.TCP_NODELAY,1)\n"
            "while True:\n"
            "  b=c.recv(1)\n"
            "  if not b: break\n"
            "  c.sendall(b)\n")
    ping = ("import socket,time,statistics\n"
            f"c=socket.create_connection(('{cluster.ips[dst]}',{port}),timeout=10)\n"
            "c.setsockopt(socket.IPPROTO_TCP,socket.TCP_NODELAY,1);t=[]\n"
            f"for i in range({int(rounds)}):\n"
            "  t0=time.perf_counter();c.sendall(b'x');c.recv(1);t.append(time.perf_counter()-t0)\n"
            "print(statistics.median(t[5:] or t))\n")
    rp = cluster.popen(dst, [sys.executable, "-c", echo], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        if rp.stdout.readline().strip() != "ready":
            raise ClusterError(f"rtt echo server failed: {rp.stderr.read()}")
        r = cluster.run(src, [sys.executable, "-c", ping], timeout=60, check=True)
        return float(r.stdout.strip().splitlines()[-1])
    finally:
        if rp.poll() is None:
            _killpg(rp)
        rp.communicate()


def run(workers=DEFAULT_WORKERS, rates=DEFAULT_RATES, schemes=DEFAULT_SCHEMES, model="mlp", params=DEFAULT_PARAMS,
        steps=4, warmup=2, passes=2, compute_steps=3, batch=32, threads=1, prefix="sb", out_json=None,
        out_png=None, merge=True, idle_seconds=0.5, run_timeout=1800, progress=True, stream=None, command=None,
        settle_max_s=60.0, pin_cores=True):
    """Bring up the cluster, run every (rate, N) with all schemes, tear it down;
    merge the rows into ``out_json``; return the new rows.  ``pin_cores``: rank ``r``
    bound to core ``r mod cores`` (:mod:`hvd_compress.tools.bench.pinning`; the rows
    say ``pinned_cores``)."""
    from ..testing.cluster import Cluster

    stream = stream or sys.stdout
    schemes = split_specs(schemes) if isinstance(schemes, str) else list(schemes)
    for s in schemes:
        parse_spec(s)
    workers = parse_workers(workers)
    rates = parse_rates(rates)
    params = parse_count(params)
    if command is None:  # the options after "scale" on this process's command line
        argv = sys.argv[1:]
        argv = argv[argv.index("scale") + 1:] if "scale" in argv else argv
        command = "hvd-compress bench scale " + shlex.join(argv)
    env = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_USE_LEGACY_KERAS": "1", "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": str(threads)}
    prog = Progress(len(rates) * len(workers), enabled=progress)
    rows, failures = [], []
    with tempfile.TemporaryDirectory(prefix="hvdc_scale_") as tmp, Cluster(max(workers), prefix=prefix) as c:
        prog.note(f"cluster '{prefix}': {len(c.hosts)} hosts; N = {', '.join(map(str, workers))}; {model} "
                  f"~{human_count(params)} params; schemes: {', '.join(schemes)}")
        for rate in rates:
            c.set_rate(rate)
            goodput = rtt = None
            try:
                goodput = c.measure_throughput_mbit(src=1, dst=0, seconds=2.0)
                rtt = measure_rtt_s(c)
                prog.note(f"link {rate_label(rate)}: TCP goodput {goodput:.0f} Mbit/s, rtt {rtt * 1e3:.2f} ms")
            except Exception as e:  # the benchmark can go on without them
                prog.note(f"link {rate_label(rate)}: link measurement failed: {e}")
            for n in workers:
                out = os.path.join(tmp, f"n{n}_r{rate}.json")
                cmd = [sys.executable, "-m", "hvd_compress.tools.bench.e2e_worker", "--framework", "torch",
                       "--model", model, "--params", str(params), "--batch", str(batch),
                       "--scheme", ",".join(schemes), "--passes", str(passes), "--steps", str(steps),
                       "--min-steps", str(steps), "--warmup", str(warmup), "--compute-steps", str(compute_steps),
                       "--threads", str(threads), "--idle-seconds", str(idle_seconds), "--iface", c.iface,
                       "--out", out] + worker_arguments(pin_cores)
                argv = c.horovodrun_command(cmd, np=n, controller="gloo", extra=["--start-timeout", "180"])
                runnable, waited = settle(settle_max_s)
                load_before, t0 = os.getloadavg()[0], time.monotonic()
                rc, log = run_launch(c, argv, env, run_timeout)
                label = f"{rate_label(rate):>13} N={n}"
                if rc != 0 or not os.path.exists(out):
                    failures.append({"workers": n, "link_mbit": rate, "rc": rc, "log_tail": clean_log(log)[-4000:]})
                    prog.step(label, f"FAILED (exit {rc}); log tail:\n{clean_log(log)[-1500:]}")
                    continue
                with open(out) as f:
                    got = json.load(f)
                got = got if isinstance(got, list) else [got]
                launch_s, now = time.monotonic() - t0, datetime.datetime.now(datetime.timezone.utc)
                new = [build_row(w, link_mbit=rate, link_measured_mbit=goodput, link_rtt_s=rtt, controller="gloo",
                                 command=command, launch_s=launch_s, load_before=load_before,
                                 load_after=os.getloadavg()[0], measured_at=now.strftime("%Y-%m-%dT%H:%M:%SZ"),
                                 runnable_before=runnable, settle_s=waited, pinned_cores=pin_cores)
                       for w in got]
                rows += new
                prog.step(label, "; ".join(f"{x['scheme']} {human_seconds(x['median_step_s'])}" for x in new))
    all_rows = rows
    if out_json:
        old = []
        if merge and os.path.exists(out_json):
            with open(out_json) as f:
                old = json.load(f)
        all_rows = add_comparisons(merge_rows(old, rows))
        write_json(out_json, all_rows)
        print(f"wrote {out_json} ({len(rows)} new rows, {len(all_rows)} in all)", file=stream)
        if failures:
            write_json(os.path.splitext(out_json)[0] + "_failures.json", failures)
    else:
        add_comparisons(rows)
    print(format_table(all_rows), file=stream)
    comparison = auto_vs_best(all_rows)
    if comparison:
        print("Auto vs the best fixed scheme (ratio = best step / Auto's step):", file=stream)
        for c_ in comparison:
            paired = c_["paired"]
            paired = f"; pass by pass {paired[0]:.2f} ({paired[1]:.2f}-{paired[2]:.2f})" if paired else ""
            print(f"  N={c_['workers']} {rate_label(c_['link_mbit'])}: {c_['auto_scheme']} "
                  f"{human_seconds(c_['auto_step_s'])}, best {c_['best_scheme']} {human_seconds(c_['best_step_s'])}, "
                  f"ratio {c_['ratio']:.2f}{paired}", file=stream)
    if failures:
        print("FAILED runs: " + ", ".join(f"N={f['workers']} @ {rate_label(f['link_mbit'])} (exit {f['rc']})"
                                          for f in failures), file=stream)
    if out_png and all_rows:
        print("wrote " + plot(all_rows, out_png), file=stream)
    return rows, failures


def format_table(rows):
    def f2(v):
        return "-" if v is None else f"{v:.2f}"

    rows = sorted(rows, key=lambda r: (r["link_mbit"] or 0, r["workers"]))
    cols = [("link", lambda r: rate_label(r["link_mbit"]), ">"),
            ("N", lambda r: r["workers"], ">"),
            ("scheme", lambda r: r["scheme"], "<"),
            ("step", lambda r: human_seconds(r["median_step_s"]), ">"),
            ("compute", lambda r: human_seconds(r.get("compute_s")), ">"),
            ("link_s", lambda r: human_seconds(r.get("link_s")), ">"),
            ("encode", lambda r: human_seconds(r.get("encode_s_per_step")), ">"),
            ("decode", lambda r: human_seconds(r.get("decode_s_per_step")), ">"),
            ("vs none", lambda r: f2(r.get("speedup_vs_none")), ">"),
            ("vs fp16", lambda r: f2(r.get("speedup_vs_hvd_fp16")), ">"),
            ("payload", lambda r: human_bytes(r["payload_bytes_per_step"]), ">"),
            ("wire tx", lambda r: human_bytes(r.get("wire_bytes_per_step")), ">"),
            ("wire rx", lambda r: human_bytes(r.get("wire_rx_bytes_per_step")), ">"),
            ("tx/expected", lambda r: f2(r.get("wire_to_expected")), ">"),
            ("steps", lambda r: r["steps"], ">")]
    head = ""
    if rows:
        r = rows[0]
        head = (f"bench scale: {r['framework']} {r['model']} {human_count(r['model_params'])} params, one rank a host, "
                f"batch {r['batch']}, {r['threads']} thread(s)/rank")
    return table(rows, cols, title=head)


def markdown(rows):
    """The rows as the markdown table of docs/results/benchmarks.md, and the
    Auto comparison under it (``hvd-compress bench scale --report``)."""
    def ms(v):
        return "-" if v is None else f"{v * 1e3:.0f}"

    def ratio(v):
        return "-" if v is None else f"{v:.2f}"

    def mb(v):
        return "-" if v is None else f"{v / 1e6:.3f}"

    head = ("| link | N | scheme | transport | step ms | compute ms | link_s ms | encode ms | decode ms | "
            "vs none | vs fp16 | payload MB | tx MB/host | rx MB/host | tx/expected | load |\n"
            "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in sorted(rows, key=lambda r: (r["link_mbit"] or 0, r["workers"])):
        load = r.get("loadavg_1m_before")
        lines.append(f"| {rate_label(r['link_mbit'])} | {r['workers']} | {r['scheme']} | {r['transport']} | "
                     f"{ms(r['median_step_s'])} | {ms(r.get('compute_s'))} | {ms(r.get('link_s'))} | "
                     f"{ms(r.get('encode_s_per_step'))} | {ms(r.get('decode_s_per_step'))} | "
                     f"{ratio(r.get('speedup_vs_none'))} | {ratio(r.get('speedup_vs_hvd_fp16'))} | "
                     f"{mb(r['payload_bytes_per_step'])} | {mb(r.get('wire_bytes_per_step'))} | "
                     f"{mb(r.get('wire_rx_bytes_per_step'))} | {ratio(r.get('wire_to_expected'))} | "
                     f"{'-' if load is None else f'{load:.0f}'} |")
    cmp_ = auto_vs_best(rows)
    if cmp_:
        lines += ["", "| link | N | Auto | its step ms | best fixed | its step ms | best / Auto | pass by pass |",
                  "|---|---:|---|---:|---|---:|---:|---|"]
        lines += [f"| {rate_label(c['link_mbit'])} | {c['workers']} | {c['auto_scheme']} | {ms(c['auto_step_s'])} | "
                  f"{c['best_scheme']} | {ms(c['best_step_s'])} | {c['ratio']:.2f} | "
                  + ("-" if not c["paired"] else f"{c['paired'][0]:.2f} ({c['paired'][1]:.2f}-{c['paired'][2]:.2f})")
                  + " |" for c in cmp_]
    return "\n".join(lines)


def plot(rows, path):
    """Median step (left) and wire bytes sent per host (right) against N, one
    line per scheme, one line style per link rate."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    schemes = list(dict.fromkeys(r["scheme"] for r in rows))
    rates = sorted({r["link_mbit"] for r in rows}, key=lambda x: x or 0)
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for i, s in enumerate(schemes):
        color = f"C{i % 10}"
        for j, rate in enumerate(rates):
            rs = sorted([r for r in rows if r["scheme"] == s and r["link_mbit"] == rate], key=lambda r: r["workers"])
            if not rs:
                continue
            lab = s if j == 0 else None
            axes[0].plot([r["workers"] for r in rs], [r["median_step_s"] for r in rs], styles[j % 4], marker="o",
                         color=color, label=lab)
            if j == 0:
                axes[1].plot([r["workers"] for r in rs], [r.get("wire_bytes_per_step") or float("nan") for r in rs],
                             "-", marker="o", color=color, label=lab)
    r0 = rows[0]
    desc = f"{r0['model']} {human_count(r0['model_params'])} params, torch, Gloo, one rank a host"
    axes[0].set_title("median step [s]; " + ", ".join(f"{styles[j % 4]} {rate_label(r)}" for j, r in enumerate(rates)),
                      fontsize=9)
    axes[1].set_title(f"bytes sent per host per step ({rate_label(rates[0])})", fontsize=9)
    for ax in axes:
        ax.set_xlabel("workers N")
        ax.set_yscale("log")
        ax.set_xticks(sorted({r["workers"] for r in rows}))
        ax.grid(which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"bench scale: {desc}", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
