"""Multi-host Horovod smoke check, run under horovodrun (used by the cluster tests and by
docker/compose.yaml's default command)::

    horovodrun -np 2 -H node1:1,node2:1 ... python hvd_compress/tools/testing/smoke.py \
        --framework torch --expect-size 2 --distinct-hosts

Every rank: hvd.init(); an allreduce (sum and average) of a tensor whose value depends
on the rank, checked exactly; an allgather of (hostname, network-namespace id, rank).
Rank 0 prints one line ``HVDC_SMOKE {json}`` and every rank exits non-zero on a wrong
result.  It is a script (run by path), so it does not import the hvd_compress package.
"""
import argparse
import json
import os
import socket
import sys


def _netns_id() -> str:
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:
        return "?"


def _run_torch(numel: int):
    import torch
    import horovod.torch as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x = torch.full((numel,), float(rank + 1))
    s = hvd.allreduce(x, op=hvd.Sum, name="hvdc_smoke_sum")
    a = hvd.allreduce(x, op=hvd.Average, name="hvdc_smoke_avg")
    want_sum = size * (size + 1) / 2
    ok = bool(torch.all(s == want_sum)) and bool(torch.allclose(a, torch.tensor(want_sum / size)))
    me = {"rank": rank, "host": socket.gethostname(), "netns": _netns_id(),
          "local_rank": hvd.local_rank(), "ok": ok}
    everyone = hvd.allgather_object(me)
    return hvd, rank, size, everyone, float(s[0]), want_sum


def _run_tf(numel: int):
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf
    import horovod.tensorflow as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    x = tf.fill([numel], float(rank + 1))
    s = hvd.allreduce(x, op=hvd.Sum, name="hvdc_smoke_sum")
    a = hvd.allreduce(x, op=hvd.Average, name="hvdc_smoke_avg")
    want_sum = size * (size + 1) / 2
    ok = bool(tf.reduce_all(s == want_sum)) and bool(
        tf.reduce_all(tf.abs(a - want_sum / size) < 1e-6))
    me = {"rank": rank, "host": socket.gethostname(), "netns": _netns_id(),
          "local_rank": hvd.local_rank(), "ok": ok}
    everyone = hvd.allgather_object(me, name="hvdc_smoke_who")
    return hvd, rank, size, everyone, float(s[0]), want_sum


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--framework", choices=("torch", "tf"), default="torch")
    ap.add_argument("--numel", type=int, default=1 << 18, help="elements allreduced (fp32)")
    ap.add_argument("--expect-size", type=int, default=None)
    ap.add_argument("--result-file", default=None,
                    help="rank 0 also writes its JSON result here (stdout lines can be split "
                         "or interleaved by mpirun's output forwarding)")
    ap.add_argument("--distinct-hosts", action="store_true",
                    help="require every rank to run on its own host and network namespace")
    args = ap.parse_args(argv)

    run = _run_torch if args.framework == "torch" else _run_tf
    hvd, rank, size, everyone, got, want = run(args.numel)
    problems = []
    if args.expect_size is not None and size != args.expect_size:
        problems.append(f"hvd.size()={size}, expected {args.expect_size}")
    bad = [e["rank"] for e in everyone if not e["ok"]]
    if bad:
        problems.append(f"wrong allreduce result on ranks {bad} (rank {rank} got {got}, want {want})")
    if args.distinct_hosts:
        hosts = {e["host"] for e in everyone}
        nets = {e["netns"] for e in everyone}
        if len(hosts) != size or len(nets) != size:
            problems.append(f"ranks share hosts/namespaces: {everyone}")
    if rank == 0:
        result = json.dumps({"framework": args.framework, "size": size, "sum": got,
                             "ranks": everyone, "problems": problems})
        print("HVDC_SMOKE " + result, flush=True)
        if args.result_file:
            with open(args.result_file + ".tmp", "w") as f:
                f.write(result)
            os.replace(args.result_file + ".tmp", args.result_file)
    hvd.shutdown()
    if problems:
        print(f"rank {rank}: SMOKE FAILED: " + "; ".join(problems), file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
