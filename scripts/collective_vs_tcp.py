#!/usr/bin/env python
"""How long the emulated link takes to swap a payload, by plain TCP and by
Horovod's collectives: what a bytes-only ceiling can expect of one step's
exchange, and what Horovod's Gloo collectives reach of it.

    .venv/bin/python scripts/collective_vs_tcp.py [--rate 100] [--sizes 0.8M,2M,7.45M,16M] \
        [--reps 6] [--gap 0.1] [--kinds KIND,...] [--trace FILE] [--local] [--prefix qx] \
        [--out docs/results/collective_vs_tcp.json]

Needs root (a 2-host emulated cluster, ``hvd_compress.tools.testing.cluster``,
its links shaped to ``--rate`` Mbit/s by ``tc tbf``).  For each size, ``--reps``
times with ``--gap`` seconds idle between (a training step leaves the link idle
while it computes), medians, of each of ``--kinds`` (default: the first five):

* ``tcp_two_connections``: both hosts send each other the size at once, one TCP
  connection each way (``TCP_NODELAY``), from a 1-byte handshake until this
  host has received all of it;
* ``tcp_one_connection``: the same over a single connection carrying both
  directions (as a Gloo pair does);
* ``horovod_allgather`` / ``horovod_allreduce``: ``horovodrun -np 2 --gloo``,
  one blocking ``hvd.allgather`` of the size (uint8) / ``hvd.allreduce`` of the
  size (fp32; a 2-rank ring moves the size each way), after a 1-element
  allreduce as a barrier, from the earlier rank's start to the later rank's
  end (both ranks read one clock: the hosts share the machine);
* ``horovod_allgather_in_4``: four ``allgather_async`` of a quarter each,
  launched together (Horovod fuses them into one response);
* ``horovod_allgather_4_in_turn``: four blocking ``hvd.allgather`` of a quarter
  each, one after the other (four responses);
* ``horovod_alltoall_swap``: one ``hvd.alltoall`` of twice the size (uint8,
  equal splits: the size to the peer, the size to itself);
* ``horovod_reducescatter_swap``: one ``hvd.reducescatter`` (``op=Sum``) of a
  ``[2, size/4]`` int32 tensor whose row of the peer is filled and whose own
  row is zeros: each rank receives the peer's row, the size each way (the way
  ``TorchAdapter.allgather_fixed`` swaps a large payload between 2 ranks).

While the Horovod kinds run, host 1's eth0 byte counters are sampled every
5 ms; each repetition's ``both_directions_share`` is the share of its samples
in which host 1 both sent and received at over a quarter of the link rate
(1: the two directions overlap throughout; 0: one after the other).
``--trace`` writes the samples and spans too.

``--local`` runs the Horovod kinds on this machine instead (``horovodrun -np 2
-H localhost:2``, loopback, no shaping, no root, no link samples): what each
collective costs on the hosts, with the link out of the way.

``at_link_rate_s`` is the size at the nominal rate (None with ``--local``).  The ratios to it say how
much of a step's exchange is the link and how much the way it is used.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
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

#: the Horovod side: argv = sizes (comma list of bytes), reps, gap, kinds (comma list)
HOROVOD = r'''
import json, statistics, sys, time
import torch, horovod.torch as hvd
hvd.init()
sizes, reps, gap, kinds = [int(s) for s in sys.argv[1].split(",")], int(sys.argv[2]), float(sys.argv[3]), \
    sys.argv[4].split(",")
assert hvd.size() == 2, "the swaps below are written for 2 ranks"
peer = 1 - hvd.rank()
spans = {}
for size in sizes:
    for kind in kinds:
        for r in range(reps):
            hvd.allreduce(torch.zeros(1), name="barrier")
            w0 = time.time()
            if kind == "horovod_allgather":
                hvd.allgather(torch.ones(size, dtype=torch.uint8), name=f"g.{size}")
            elif kind == "horovod_allreduce":
                hvd.allreduce(torch.ones(size // 4), name=f"r.{size}")
            elif kind == "horovod_allgather_in_4":
                hs = [hvd.allgather_async(torch.ones(size // 4, dtype=torch.uint8), name=f"g4.{size}.{i}")
                      for i in range(4)]
                for h in hs:
                    hvd.synchronize(h)
            elif kind == "horovod_allgather_4_in_turn":
                for i in range(4):
                    hvd.allgather(torch.ones(size // 4, dtype=torch.uint8), name=f"g4t.{size}.{i}")
            elif kind == "horovod_alltoall_swap":
                hvd.alltoall(torch.ones(2 * size, dtype=torch.uint8), name=f"a2a.{size}")
            elif kind == "horovod_reducescatter_swap":
                # int32 sum with zeros is exact: rank r receives half r, which only the peer filled
                x = torch.zeros(2, -(-size // 4), dtype=torch.int32)
                x[peer] = 1
                hvd.reducescatter(x, op=hvd.Sum, name=f"rs.{size}")
            else:
                raise SystemExit(f"unknown kind {kind}")
            spans.setdefault(f"{kind}.{size}", []).append((w0, time.time()))
            time.sleep(gap)
# both ranks run on one machine, one clock: a repetition lasts from the earlier rank's start
# to the later rank's end (a rank's send completes once its last bytes are in its socket)
every = hvd.allgather_object(spans, name="spans")
if hvd.rank() == 0:
    spans = {k: [(min(s[k][i][0] for s in every), max(s[k][i][1] for s in every)) for i in range(len(v))]
             for k, v in spans.items()}
    print("RESULT " + json.dumps({k: [w1 - w0 for w0, w1 in v] for k, v in spans.items()}))
    print("SPANS " + json.dumps(spans))
'''

#: samples host 1's eth0 byte counters every 5 ms until killed: one line "time rx tx" each
#: into the file argv[1]
LINK_SAMPLER = r'''
import sys, time
rx, tx = open("/sys/class/net/eth0/statistics/rx_bytes"), open("/sys/class/net/eth0/statistics/tx_bytes")
with open(sys.argv[1], "w") as out:
    while True:
        rx.seek(0); tx.seek(0)
        out.write(f"{time.time():.4f} {rx.read().strip()} {tx.read().strip()}\n"); out.flush()
        time.sleep(0.005)
'''

KINDS = ("tcp_two_connections", "tcp_one_connection", "horovod_allgather", "horovod_allreduce",
         "horovod_allgather_in_4", "horovod_allgather_4_in_turn", "horovod_alltoall_swap",
         "horovod_reducescatter_swap")
DEFAULT_KINDS = "tcp_two_connections,tcp_one_connection,horovod_allgather,horovod_allreduce,horovod_allgather_in_4"


def both_directions_share(samples, span, bytes_per_s):
    """The share of ``span``'s 5 ms samples in which host 1 both sent and
    received at over a quarter of the link rate."""
    w0, w1 = span
    inside = [s for s in samples if w0 <= s[0] <= w1]
    busy = [min(b[1] - a[1], b[2] - a[2]) / max(b[0] - a[0], 1e-6) > bytes_per_s / 4
            for a, b in zip(inside, inside[1:])]
    return sum(busy) / len(busy) if busy else None


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
    p.add_argument("--kinds", default=DEFAULT_KINDS, help=f"comma list of {', '.join(KINDS)} (default {DEFAULT_KINDS})")
    p.add_argument("--trace", help="also write host 1's link byte counters (5 ms samples) and each "
                   "repetition's span to this JSON file")
    p.add_argument("--local", action="store_true",
                   help="run the horovod_ kinds on this machine instead (horovodrun -np 2 -H localhost:2: "
                   "loopback, no shaping, no root): what the collectives cost on the hosts")
    p.add_argument("--prefix", default="qx")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "results", "collective_vs_tcp.json"))
    a = p.parse_args(argv)
    kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not kinds:
        p.error(f"--kinds: unknown {unknown}; allowed: {', '.join(KINDS)}")
    horovod_kinds = [k for k in kinds if k.startswith("horovod_")]
    if a.local and horovod_kinds != kinds:
        p.error("--local runs only the horovod_ kinds")
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    raw, spans, samples = {}, {}, []
    load_before = os.getloadavg()[0]
    if a.local:
        cmd = [os.path.join(os.path.dirname(sys.executable), "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo",
               sys.executable, "-c", HOROVOD, ",".join(map(str, sizes)), str(a.reps), str(a.gap), ",".join(kinds)]
        r = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                           timeout=1800, cwd=ROOT)
        raw, spans = horovod_results(r)
    else:
        raw, spans, samples = on_cluster(a, kinds, horovod_kinds, sizes)
    if a.trace:
        with open(a.trace, "w") as f:
            json.dump({"samples_time_rx_tx": samples, "spans": spans}, f)
    bytes_per_s = None if a.local else a.rate * 1e6 / 8
    rows = []
    for size in sizes:
        row = {"bytes": size, "at_link_rate_s": None if a.local else size / bytes_per_s}
        for kind in kinds:
            times = raw[f"{kind}.{size}"]
            row[kind + "_s"] = statistics.median(times)
            row[kind + "_all_s"] = times
            if samples and f"{kind}.{size}" in spans:
                shares = [both_directions_share(samples, span, bytes_per_s) for span in spans[f"{kind}.{size}"]]
                row[kind + "_both_directions_share"] = [None if x is None else round(x, 3) for x in shares]
        rows.append(row)
    result = {"command": "scripts/collective_vs_tcp.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "rate_mbit": None if a.local else a.rate, "reps": a.reps, "gap_s": a.gap,
              "loadavg_1m_before": load_before, "loadavg_1m_after": os.getloadavg()[0],
              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "rows": rows}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(("this machine, loopback" if a.local else f"{a.rate:g} Mbit/s") + f", median of {a.reps}, ms"
          + ("" if a.local else " (x the size at the link rate)")
          + ("; [median share of the time host 1 both sent and received]" if samples else ""))
    print(f"{'bytes':>10} {'link':>7} " + " ".join(f"{k:>30}" for k in kinds))
    for row in rows:
        cells = []
        for k in kinds:
            cell = f"{row[k + '_s'] * 1e3:.0f}"
            if row["at_link_rate_s"]:
                cell += f" ({row[k + '_s'] / row['at_link_rate_s']:.2f}x)"
            shares = [x for x in row.get(k + "_both_directions_share", []) if x is not None]
            if shares:
                cell += f" [{statistics.median(shares):.2f}]"
            cells.append(f"{cell:>30}")
        link = "-" if row["at_link_rate_s"] is None else f"{row['at_link_rate_s'] * 1e3:.0f}"
        print(f"{row['bytes']:>10} {link:>7} " + " ".join(cells))
    print(f"wrote {a.out}")


def horovod_results(r):
    """({kind.size: [seconds]}, {kind.size: [(start, end)]}) from the Horovod side's output."""
    lines = (r.stdout or "").splitlines()
    result = [x for x in lines if "RESULT " in x]
    if r.returncode != 0 or not result:
        raise SystemExit(f"horovodrun failed (exit {r.returncode}):\n{(r.stdout or '')[-2000:]}"
                         f"{(r.stderr or '')[-2000:]}")
    spans = json.loads([x for x in lines if "SPANS " in x][-1].split("SPANS ", 1)[1])
    return json.loads(result[-1].split("RESULT ", 1)[1]), spans


def on_cluster(a, kinds, horovod_kinds, sizes):
    """The kinds on a 2-host emulated cluster shaped to ``a.rate``: (raw times, spans, link samples)."""
    from hvd_compress.tools.testing.cluster import Cluster
    raw, spans, samples = {}, {}, []
    with Cluster(2, prefix=a.prefix) as c:
        c.set_rate(a.rate)
        for i, size in enumerate(sizes):
            if "tcp_two_connections" in kinds:
                raw[f"tcp_two_connections.{size}"] = tcp_swap(c, size, a.reps, a.gap, "two", 5300 + 2 * i)
            if "tcp_one_connection" in kinds:
                raw[f"tcp_one_connection.{size}"] = tcp_swap(c, size, a.reps, a.gap, "one", 5301 + 2 * i)
        if horovod_kinds:
            trace = tempfile.NamedTemporaryFile(prefix="collective_vs_tcp_", suffix=".txt", delete=False).name
            sampler = c.popen(0, [os.path.join(c.venv_bin, "python"), "-c", LINK_SAMPLER, trace],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                cmd = [os.path.join(c.venv_bin, "python"), "-c", HOROVOD, ",".join(map(str, sizes)), str(a.reps),
                       str(a.gap), ",".join(horovod_kinds)]
                r = c.run(0, c.horovodrun_command(cmd, np=2, controller="gloo"), env={"OMP_NUM_THREADS": "1"},
                          timeout=1800, cwd=ROOT)
            finally:
                sampler.terminate()
                sampler.wait(timeout=30)
                with open(trace) as f:
                    text = f.read()
                os.unlink(trace)
            samples = [tuple(float(v) for v in line.split()) for line in text.splitlines() if len(line.split()) == 3]
            times, spans = horovod_results(r)
            raw.update(times)
    return raw, spans, samples


if __name__ == "__main__":
    main()
