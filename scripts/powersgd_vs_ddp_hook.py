#!/usr/bin/env python
"""hvd_compress's PowerSGD under Horovod against PyTorch DDP's own
``powerSGD_hook``, same model, same rank, same processes (Gloo, localhost).

    .venv/bin/python scripts/powersgd_vs_ddp_hook.py [--np 2] [--rank 4] [--model mlp] [--params 16M] \
        [--batch 32] [--steps 12] [--threads 1] [--out docs/results/powersgd_vs_ddp_hook.json]

Each side runs in its own launch (DDP: processes started here with
``torch.multiprocessing``; Horovod: ``horovodrun --gloo``), one after the
other, and times per step (median over ``--steps`` after warm-up steps):

* ``compute_s``: forward + backward + SGD step of the same model with no
  communication at all (the model alone, in the same processes);
* ``dense_s``: a step with the framework's dense allreduce (DDP's default;
  Horovod's ``DistributedOptimizer`` without compression);
* ``powersgd_s``: a step with PowerSGD at ``--rank`` with error feedback and
  warm start (DDP: ``PowerSGDState(matrix_approximation_rank=rank,
  start_powerSGD_iter=2)`` and ``powerSGD_hook``, compression from the third
  step, every gradient in one bucket -- with two, the hook's chained Gloo
  allreduces run in a different order on each rank and Gloo aborts; Horovod:
  ``compression=hvd_compress.PowerSGD(rank)``);
* ``powersgd_overhead_s = powersgd_s - compute_s``: what PowerSGD adds to a
  step -- its encode and decode, and two small allreduces per bucket (DDP) or
  per matrix (Horovod), which on localhost cost little.

Each is a median of wall seconds, and (``*_cpu``) of the process's CPU
seconds over all its threads, which the load of other processes on a shared
machine inflates less than the wall time.

Horovod's side also reports ``compress_s`` and ``decompress_s``, the time in
the compressor's ``compress`` and ``decompress`` per step, summed over
tensors (``decompress`` includes waiting for the P and Q allreduces).

Tensors the compression would not shrink enough go dense on both sides:
the hook's ``min_compression_rate`` is set to 1, the criterion of
``PowerSGD.transport_for`` ((n + m) r < n m), so both compress the same
matrices.  One thread per process by default, as ``bench micro``.
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

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _parse_count(s):
    s = str(s).strip().upper()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9}.get(s[-1:], 1)
    return int(float(s[:-1] if mult > 1 else s) * mult)


def _model(args):
    sys.path.insert(0, ROOT)
    import torch
    from hvd_compress.tools.bench.models import torch_model
    torch.manual_seed(0)
    return torch_model(args.model, _parse_count(args.params))


def _timed_steps(step, steps, warmup, row=None, name=None):
    """Median wall seconds of a step; with ``row``, also the median CPU
    seconds of the whole process (every thread: DDP runs the hook's later
    rounds on Gloo's threads, Horovod its collectives on its own) as
    ``row[name + "_cpu"]``, which the load of other processes inflates less."""
    for _ in range(warmup):
        step()
    times, cpu = [], []
    for _ in range(steps):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    if row is not None:
        row[name + "_cpu"] = statistics.median(cpu)
    return statistics.median(times)


def _local_compute(args, row):
    """forward + backward + SGD step, no communication: the model alone."""
    import torch
    model, batch, loss_fn = _model(args)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = batch(args.batch, seed=1)

    def step():
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return _timed_steps(step, args.steps, args.warmup, row, "compute_s")


# ----------------------------------------------------------------------------- DDP
def _ddp_worker(rank, args, port, out_path):
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.set_num_threads(args.threads)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.np)
    row = {"side": "ddp"}
    row["compute_s"] = _local_compute(args, row)
    for mode in ("dense", "powersgd"):
        model, batch, loss_fn = _model(args)
        # one bucket: under Gloo the hook's chained allreduces of two buckets interleave in a
        # different order on each rank (a collective mismatch that aborts the process)
        ddp = DDP(model, bucket_cap_mb=1024)
        if mode == "powersgd":
            state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=args.rank,
                                       start_powerSGD_iter=2, min_compression_rate=1, use_error_feedback=True,
                                       warm_start=True, random_seed=0)
            ddp.register_comm_hook(state, psgd.powerSGD_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
        x, y = batch(args.batch, seed=1 + rank)

        def step():
            opt.zero_grad()
            loss_fn(ddp(x), y).backward()
            opt.step()
        dist.barrier()
        row[f"{mode}_s"] = _timed_steps(step, args.steps, max(args.warmup, 3), row, f"{mode}_s")
    dist.barrier()
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(row, f)
    dist.destroy_process_group()


def run_ddp(args):
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out_path = f.name
    mp.spawn(_ddp_worker, args=(args, port, out_path), nprocs=args.np, join=True)
    with open(out_path) as f:
        return json.load(f)


# ----------------------------------------------------------------------------- Horovod
def _hvd_worker(args):
    import horovod.torch as hvd
    import torch
    sys.path.insert(0, ROOT)
    import hvd_compress
    torch.set_num_threads(args.threads)
    hvd.init()
    row = {"side": "horovod"}
    row["compute_s"] = _local_compute(args, row)
    for mode in ("dense", "powersgd"):
        model, batch, loss_fn = _model(args)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        comp = hvd_compress.PowerSGD(args.rank) if mode == "powersgd" else hvd.Compression.none
        timing = {"compress": 0.0, "decompress": 0.0}
        if mode == "powersgd":
            for name in ("compress", "decompress"):
                inner = getattr(comp, name)

                def timed(*a, _inner=inner, _name=name):
                    t0 = time.perf_counter()
                    try:
                        return _inner(*a)
                    finally:
                        timing[_name] += time.perf_counter() - t0
                setattr(comp, name, timed)
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                       named_parameters=model.named_parameters(), compression=comp)
        x, y = batch(args.batch, seed=1 + hvd.rank())
        per_step = []

        def step():
            timing.update(compress=0.0, decompress=0.0)
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
            per_step.append(dict(timing))
        row[f"{mode}_s"] = _timed_steps(step, args.steps, max(args.warmup, 3), row, f"{mode}_s")
        if mode == "powersgd":
            timed_steps = per_step[-args.steps:]
            row["compress_s"] = statistics.median(t["compress"] for t in timed_steps)
            row["decompress_s"] = statistics.median(t["decompress"] for t in timed_steps)
    hvd.allreduce(torch.zeros(1), name="powersgd_vs_ddp_hook.done")
    if hvd.rank() == 0:
        print("HVDC_ROW " + json.dumps(row), flush=True)


def run_horovod(args):
    venv_bin = os.path.dirname(sys.executable)
    horovodrun = os.path.join(venv_bin, "horovodrun")
    cmd = [horovodrun, "-np", str(args.np), "-H", f"localhost:{args.np}", "--gloo", sys.executable, __file__,
           "--role", "horovod"] + _forward(args)
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    for line in proc.stdout.splitlines():
        if "HVDC_ROW " in line:
            return json.loads(line.split("HVDC_ROW ", 1)[1])
    raise RuntimeError(f"horovodrun exited {proc.returncode} without a result:\n{proc.stdout[-3000:]}\n"
                       f"{proc.stderr[-3000:]}")


def _forward(args):
    return ["--np", str(args.np), "--rank", str(args.rank), "--model", args.model, "--params", str(args.params),
            "--batch", str(args.batch), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--threads", str(args.threads)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--np", type=int, default=2)
    ap.add_argument("--rank", type=int, default=4, help="PowerSGD's rank on both sides")
    ap.add_argument("--model", default="mlp", help="mlp or transformer (hvd_compress.tools.bench.models)")
    ap.add_argument("--params", default="16M")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the rows and the settings as JSON")
    ap.add_argument("--role", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role == "horovod":
        _hvd_worker(args)
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    rows = [run_ddp(args), run_horovod(args)]
    for r in rows:
        r["powersgd_overhead_s"] = r["powersgd_s"] - r["compute_s"]
        r["powersgd_overhead_s_cpu"] = r["powersgd_s_cpu"] - r["compute_s_cpu"]
    ms = lambda v: f"{1e3 * v:8.1f}"  # noqa: E731
    print(f"PowerSGD({args.rank}), {args.model} {args.params}, batch {args.batch}, {args.np} processes, "
          f"Gloo on localhost, {args.threads} thread(s); median ms per step")
    print(f"{'side':<9}{'compute':>9}{'dense':>9}{'powersgd':>9}{'overhead':>9}{'compress':>9}{'decomp.':>9}")
    for r in rows:
        print(f"{r['side']:<9}{ms(r['compute_s'])}{ms(r['dense_s'])}{ms(r['powersgd_s'])}"
              f"{ms(r['powersgd_overhead_s'])}{ms(r['compress_s']) if 'compress_s' in r else '       -'}"
              f"{ms(r['decompress_s']) if 'decompress_s' in r else '       -'}")
    print("CPU seconds of the process per step (every thread):")
    for r in rows:
        print(f"{r['side']:<9}{ms(r['compute_s_cpu'])}{ms(r['dense_s_cpu'])}{ms(r['powersgd_s_cpu'])}"
              f"{ms(r['powersgd_overhead_s_cpu'])}")
    ddp, hv = rows
    print(f"PowerSGD's overhead per step, Horovod + hvd_compress / DDP hook: "
          f"{hv['powersgd_overhead_s'] / ddp['powersgd_overhead_s']:.2f} (wall), "
          f"{hv['powersgd_overhead_s_cpu'] / ddp['powersgd_overhead_s_cpu']:.2f} (CPU)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"settings": {k: v for k, v in vars(args).items() if k not in ("out", "role")},
                       "command": "scripts/powersgd_vs_ddp_hook.py " + " ".join(_forward(args)),
                       "loadavg_1m": os.getloadavg()[0], "rows": rows}, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
