#!/usr/bin/env python
"""How long the emulated link takes to swap a payload, by plain TCP and by
Horovod's collectives: what a bytes-only ceiling can expect of one step's
exchange, and what Horovod's Gloo collectives reach of it.

    .venv/bin/python scripts/collective_vs_tcp.py [--rate 100] [--sizes 0.8M,2M,7.45M,16M] \
        [--reps 6] [--gap 0.1] [--prefix qx] [--out docs/results/collective_vs_tcp.json]

Needs root (a 2-host emulated cluster, ``hvd_compress.tools.testing.cluster``,
its links shaped to ``--rate`` Mbit/s by ``tc tbf``).  For each size, ``--reps``
times with ``--gap`` seconds idle between (a training step leaves the link idle
while it computes), medians:

* ``tcp_two_connections``: both hosts send each other the size at once, one TCP
  connection each way (``TCP_NODELAY``), from a 1-byte handshake until this
  host has received all of it;
* ``tcp_one_connection``: the same over a single connection carrying both
  directions (as a Gloo pair does);
* ``horovod_allgather`` / ``horovod_allreduce``: ``horovodrun -np 2 --gloo``,
  one blocking ``hvd.allgather`` of the size (uint8) / ``hvd.allreduce`` of the
  size (fp32; a 2-rank ring moves the size each way), after a 1-element
  allreduce as a barrier;
* ``horovod_allgather_in_4``: four ``allgather_async`` of a quarter each,
  launched together (Horovod fuses them into one response).

``at_link_rate_s`` is the size at the nominal rate.  The ratios to it say how
much of a step's exchange is the link and how much the way it is used.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

#: one host of a TCP swap: argv = role (0/1), peer ip, port, bytes, reps, gap, mode (two/one)
TCP_SWAP = r'''
import json, socket, statistics, sys, threading, time
me, peer, port, size, reps, gap, mode = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), \
    int(sys.argv[5]), float(sys.argv[6]), sys.argv[7]
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("0.0.0.0", port)); srv.listen(1)
if mode == "two" or me == 0:
    for _ in range(400):
        try:
            out = socket.create_connection((peer, port), timeout=10); break
        except OSError:
            time.sleep(0.05)
if mode == "two" or me == 1:
    inc, _ = srv.accept()
if mode == "one":
    out = inc = out if me == 0 else inc
for s in {out, inc}:
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
buf, rbuf = bytearray(size), bytearray(1 << 20)

def recv(n):
    got = 0
    while got < n:
        got += inc.recv_into(rbuf, min(len(rbuf), n - got))

times = []
for _ in range(reps):
    out.sendall(b"h"); recv(1)
    t0 = time.perf_counter()
    th = threading.Thread(target=recv, args=(size,)); th.start()
    out.sendall(buf); th.join()
    times.append(time.perf_counter() - t0)
    time.sleep(gap)
print(json.dumps(times))
'''

#: the Horovod side: argv = sizes (comma list of bytes), reps, gap
HOROVOD = r'''
import json, statistics, sys, time
import torch, horovod.torch as hvd
hvd.init()
sizes, reps, gap = [int(s) for s in sys.argv[1].split(",")], int(sys.argv[2]), float(sys.argv[3])
out = {}
for size in sizes:
    for kind in ("horovod_allgather", "horovod_allreduce", "horovod_allgather_in_4"):
        times = []
        for r in range(reps):
            hvd.allreduce(torch.zeros(1), name="barrier")
            t0 = time.perf_counter()
            if kind == "horovod_allgather":
                hvd.allgather(torch.ones(size, dtype=torch.uint8), name=f"g.{size}")
            elif kind == "horovod_allreduce":
                hvd.allreduce(torch.ones(size // 4), name=f"r.{size}")
            else:
                hs = [hvd.allgather_async(torch.ones(size // 4, dtype=torch.uint8), name=f"g4.{size}.{i}")
                      for i in range(4)]
                for h in hs:
                    hvd.synchronize(h)
            times.append(time.perf_counter() - t0)
            time.sleep(gap)
        out[f"{kind}.{size}"] = times
if hvd.rank() == 0:
    print("RESULT " + json.dumps(out))
'''


def parse_size(text):
    text = text.strip().upper()
    mult = {"K": 10 ** 3, "M": 10 ** 6}.get(text[-1:], 1)
    return int(float(text[:-1] if mult > 1 else text) * mult)


def tcp_swap(cluster, size, reps, gap, mode, port):
    py = os.path.join(cluster.venv_bin, "python")
    args = lambda me, peer: [py, "-c", TCP_SWAP, str(me), peer, str(port), str(size), str(reps), str(gap), mode]
    other = cluster.popen(1, args(1, cluster.ips[0]), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        mine = cluster.run(0, args(0, cluster.ips[1]), timeout=600, check=True)
    finally:
        other.communicate(timeout=60)
    return json.loads(mine.stdout.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", type=float, default=100.0, help="Mbit/s (default 100)")
    p.add_argument("--sizes", default="0.8M,2M,7.45M,16M", help="bytes per rank (default 0.8M,2M,7.45M,16M)")
    p.add_argument("--reps", type=int, default=6)
    p.add_argument("--gap", type=float, default=0.1, help="idle seconds between repetitions (default 0.1)")
    p.add_argument("--prefix", default="qx")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "collective_vs_tcp.json"))
    a = p.parse_args(argv)
    from hvd_compress.tools.testing.cluster import Cluster
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    raw = {}
    load_before = os.getloadavg()[0]
    with Cluster(2, prefix=a.prefix) as c:
        c.set_rate(a.rate)
        for i, size in enumerate(sizes):
            raw[f"tcp_two_connections.{size}"] = tcp_swap(c, size, a.reps, a.gap, "two", 5300 + 2 * i)
            raw[f"tcp_one_connection.{size}"] = tcp_swap(c, size, a.reps, a.gap, "one", 5301 + 2 * i)
        cmd = [os.path.join(c.venv_bin, "python"), "-c", HOROVOD, ",".join(map(str, sizes)), str(a.reps), str(a.gap)]
        r = c.run(0, c.horovodrun_command(cmd, np=2, controller="gloo"), env={"OMP_NUM_THREADS": "1"},
                  timeout=1800, cwd=ROOT)
        line = [x for x in (r.stdout or "").splitlines() if "RESULT " in x]
        if r.returncode != 0 or not line:
            raise SystemExit(f"horovodrun failed (exit {r.returncode}):\n{(r.stdout or '')[-2000:]}{(r.stderr or '')[-2000:]}")
        raw.update(json.loads(line[-1].split("RESULT ", 1)[1]))
    rows = []
    for size in sizes:
        link_s = size * 8 / (a.rate * 1e6)
        row = {"bytes": size, "at_link_rate_s": link_s}
        for kind in ("tcp_two_connections", "tcp_one_connection", "horovod_allgather", "horovod_allreduce",
                     "horovod_allgather_in_4"):
            times = raw[f"{kind}.{size}"]
            row[kind + "_s"] = statistics.median(times)
            row[kind + "_all_s"] = times
        rows.append(row)
    result = {"command": "scripts/collective_vs_tcp.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "rate_mbit": a.rate, "reps": a.reps, "gap_s": a.gap, "loadavg_1m_before": load_before,
              "loadavg_1m_after": os.getloadavg()[0], "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(f"{a.rate:g} Mbit/s, median of {a.reps}, ms (x the size at the link rate)")
    kinds = ("tcp_two_connections", "tcp_one_connection", "horovod_allgather", "horovod_allreduce",
             "horovod_allgather_in_4")
    print(f"{'bytes':>10} {'link':>7} " + " ".join(f"{k:>24}" for k in kinds))
    for row in rows:
        cells = " ".join(f"{row[k + '_s'] * 1e3:>14.0f} ({row[k + '_s'] / row['at_link_rate_s']:.2f}x)" for k in kinds)
        print(f"{row['bytes']:>10} {row['at_link_rate_s'] * 1e3:>7.0f} {cells}")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
