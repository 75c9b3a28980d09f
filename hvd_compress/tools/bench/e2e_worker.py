"""One rank of ``bench e2e``; launched by horovodrun::

    horovodrun -np 2 -H h1:1,h2:1 ... python -m hvd_compress.tools.bench.e2e_worker \\
        --framework torch --model mlp --params 16M --scheme 'TopK(0.01)' --out result.json

Each rank:

1. builds the model and a fixed synthetic batch, sets its thread count;
2. times ``--compute-steps`` purely local steps (forward, backward, optimizer
   step; no Horovod) while the other ranks do the same -- ``compute_s``;
3. broadcasts the weights, wraps the optimizer with the stock
   ``hvd.DistributedOptimizer`` (torch) or ``hvd.DistributedGradientTape``
   (TF) and the chosen compression, runs ``--warmup`` steps, then the timed
   steps (fewer than ``--steps`` if ``--max-seconds`` would be exceeded; rank
   0 decides and broadcasts);
4. reads its host interface's byte counters (``/proc/net/dev`` in its network
   namespace: the veth end the cluster shapes) right after a barrier before
   the first timed step and after a barrier following the last one.

Rank 0 writes one JSON object to ``--out`` (see :func:`main`).  Bytes "at the
Horovod call" are what the compression object handed to Horovod: for
hvd_compress, ``compressor.stats.totals()['payload_bytes']`` of the last
step; for Horovod's ``none``/``fp16`` a counting wrapper around them.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time


def read_iface(iface):
    """(rx_bytes, tx_bytes) of ``iface`` in this process's network namespace."""
    with open("/proc/net/dev") as f:
        for line in f:
            name, sep, rest = line.partition(":")
            if sep and name.strip() == iface:
                v = rest.split()
                return int(v[0]), int(v[8])
    return None


class CountingCompression:
    """Wraps Horovod's own compression objects to count the bytes they hand
    to the allreduce.  Torch: a running total (reset with :meth:`reset`), one
    call per gradient per step.  TF: ``compress`` runs once per trace, so the
    bytes are recorded per graph tensor name and summed."""

    def __init__(self, inner):
        self.inner = inner
        self.total = 0
        self.calls = 0
        self.per_tensor = {}

    def compress(self, tensor):
        out, ctx = self.inner.compress(tensor)
        if hasattr(out, "element_size"):  # torch
            self.total += out.numel() * out.element_size()
            self.calls += 1
        else:
            self.per_tensor[out.name if hasattr(out, "name") else id(out)] = \
                out.shape.num_elements() * out.dtype.size
        return out, ctx

    def decompress(self, tensor, ctx):
        return self.inner.decompress(tensor, ctx)

    def reset(self):
        self.total = 0
        self.calls = 0

    def bytes_per_step(self, steps):
        if self.per_tensor:
            return sum(self.per_tensor.values())
        return self.total / max(steps, 1)


def _make_compression(spec, framework):
    from .specs import HOROVOD_SPECS, horovod_compression, parse_spec
    if spec in HOROVOD_SPECS:
        return CountingCompression(horovod_compression(spec, framework))
    return parse_spec(spec)


def _payload_per_step(comp, steps):
    if isinstance(comp, CountingCompression):
        return comp.bytes_per_step(steps)
    return comp.stats.totals()["payload_bytes"]


def _transport(comp):
    if isinstance(comp, CountingCompression):
        return "allreduce"
    if _is_auto(comp):
        return "mixed"  # a scheme per tensor, chosen online
    return comp.scheme.transport


def _wait_for_link_change(a, hvd, barrier):
    """Rank 0 asks the driver (``scripts/auto_link_change.py``) to reshape the
    link by creating ``<link-file>.request``; every rank waits for
    ``<link-file>.done`` (the hosts share the filesystem), then all go on together."""
    barrier()
    if hvd.rank() == 0:
        open(a.link_file + ".request", "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(a.link_file + ".done"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no link change within 120 s ({a.link_file}.done missing)")
        time.sleep(0.05)
    barrier()


def _is_auto(comp):
    from hvd_compress import Auto
    return isinstance(comp, Auto)


def _warmup_steps(a, comp):
    """``--warmup``, plus Auto's calibration steps and the step that applies
    its first plan: the timed steps see the plan, not the calibration."""
    return a.warmup + (comp.calibration_steps + 1 if _is_auto(comp) else 0)


# ----------------------------------------------------------------------------- torch
def run_torch(a):
    import torch
    import horovod.torch as hvd

    from .models import torch_model

    hvd.init()
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    model, make_batch, loss_fn = torch_model(a.model, a.params)
    x, y = make_batch(a.batch, seed=a.seed + hvd.rank())
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    layer_numels = [p.numel() for p in model.parameters()]

    def barrier():
        hvd.allreduce(torch.zeros(1), name="hvdc.bench.barrier", op=hvd.Sum)

    def local_step():
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach().item()

    # 2. compute only: every rank at once, as in training
    barrier()
    local_step()
    compute = []
    for _ in range(a.compute_steps):
        t0 = time.perf_counter()
        local_step()
        compute.append(time.perf_counter() - t0)

    # 3. distributed
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    comp = _make_compression(a.scheme, "torch")
    dopt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=comp)

    def dist_step():
        dopt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        dopt.step()
        return loss.detach().item()

    return _timed_loop(a, hvd, barrier, dist_step, comp, compute, layer_numels,
                       lambda obj: hvd.broadcast_object(obj, root_rank=0),
                       lambda obj: hvd.allgather_object(obj))


# ----------------------------------------------------------------------------- TensorFlow
def run_tf(a):
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(a.threads)
    tf.config.threading.set_inter_op_parallelism_threads(a.threads)
    import horovod.tensorflow as hvd

    from .models import tf_model

    hvd.init()
    tf.random.set_seed(a.seed)
    model, make_batch, loss_obj = tf_model(a.model, a.params)
    x, y = make_batch(a.batch, seed=a.seed + hvd.rank())
    opt = tf.keras.optimizers.SGD(learning_rate=a.lr, momentum=0.9)
    comp = _make_compression(a.scheme, "tensorflow")
    layer_numels = [int(v.shape.num_elements()) for v in model.trainable_variables]

    @tf.function
    def local_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_obj(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    @tf.function
    def dist_step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = loss_obj(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=comp, sparse_as_dense=True)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    def barrier():
        hvd.allreduce(tf.zeros([1]), name="hvdc.bench.barrier", op=hvd.Sum)

    barrier()
    float(local_step(x, y))
    compute = []
    for _ in range(a.compute_steps):
        t0 = time.perf_counter()
        float(local_step(x, y))
        compute.append(time.perf_counter() - t0)
    hvd.broadcast_variables(model.variables, root_rank=0)
    hvd.broadcast_variables(opt.variables(), root_rank=0)

    def dist_step():
        return float(dist_step_fn(x, y))

    return _timed_loop(a, hvd, barrier, dist_step, comp, compute, layer_numels,
                       lambda obj: hvd.broadcast_object(obj, root_rank=0),
                       lambda obj: hvd.allgather_object(obj))


# ----------------------------------------------------------------------------- shared
def _timed_loop(a, hvd, barrier, dist_step, comp, compute, layer_numels, bcast, gather):
    losses, warm = [], []
    for _ in range(_warmup_steps(a, comp)):
        t0 = time.perf_counter()
        losses.append(dist_step())
        warm.append(time.perf_counter() - t0)
    steps = a.steps
    if a.max_seconds and warm:
        steps = max(a.min_steps, min(a.steps, int(a.max_seconds / max(warm[-1], 1e-6))))
    steps = bcast(steps)
    if isinstance(comp, CountingCompression):
        comp.reset()
    barrier()
    c0 = read_iface(a.iface)
    times = []
    t_start = time.perf_counter()
    for i in range(steps):
        if a.change_link_at and i == a.change_link_at:
            _wait_for_link_change(a, hvd, barrier)
        t0 = time.perf_counter()
        losses.append(dist_step())
        times.append(time.perf_counter() - t0)
    barrier()
    wall = time.perf_counter() - t_start
    c1 = read_iface(a.iface)
    # Horovod's background loop keeps coordinating while no tensor is pending:
    # measure that idle control traffic too, to explain wire > payload
    time.sleep(a.idle_seconds)
    c2 = read_iface(a.iface)
    barrier()
    me = {"rank": hvd.rank(), "host": socket.gethostname(), "times": times, "warmup_times": warm,
          "compute": compute, "wall": wall,
          "rx": None if c0 is None else c1[0] - c0[0], "tx": None if c0 is None else c1[1] - c0[1],
          "idle_tx": None if c0 is None else c2[1] - c1[1],
          "payload_bytes_per_step": _payload_per_step(comp, steps), "loss_first": losses[0],
          "loss_last": losses[-1]}
    everyone = gather(me)
    if hvd.rank() != 0:
        return 0
    per_step = [max(r["times"][i] for r in everyone) for i in range(steps)]
    compute_s = statistics.median([max(r["compute"][i] for r in everyone) for i in range(len(compute))]) \
        if compute else None
    hosts = {}
    for r in everyone:  # one set of counters per host (ranks on one host share its interface)
        hosts.setdefault(r["host"], r)
    tx = [r["tx"] for r in hosts.values() if r["tx"] is not None]
    idle = [r["idle_tx"] for r in hosts.values() if r["idle_tx"] is not None]
    rx = [r["rx"] for r in hosts.values() if r["rx"] is not None]
    from .micro import malloc_env
    result = {
        "scheme": a.scheme, "framework": a.framework, "model": a.model,
        "model_params": int(sum(layer_numels)), "layer_numels": layer_numels,
        "workers": hvd.size(), "hosts": len(hosts), "batch": a.batch, "threads": a.threads,
        "steps": steps, "warmup": _warmup_steps(a, comp), "transport": _transport(comp),
        "median_step_s": statistics.median(per_step), "mean_step_s": wall / steps,
        "step_s_all": per_step, "compute_s": compute_s,
        # the slowest rank's warm-up steps (Auto: its calibration and first decision are among them)
        "warmup_step_s_all": [max(r["warmup_times"][i] for r in everyone) for i in range(len(me["warmup_times"]))],
        "payload_bytes_per_step": statistics.mean(r["payload_bytes_per_step"] for r in everyone),
        "wire_bytes_per_step": (statistics.mean(tx) / steps) if tx else None,
        "wire_rx_bytes_per_step": (statistics.mean(rx) / steps) if rx else None,
        "idle_wire_bytes_per_s": (statistics.mean(idle) / a.idle_seconds) if idle and a.idle_seconds else None,
        "wire_iface": a.iface, "loss_first": me["loss_first"], "loss_last": me["loss_last"],
        "per_rank": [{k: r[k] for k in ("rank", "host", "tx", "rx", "payload_bytes_per_step")}
                     for r in everyone],
        "malloc_env": malloc_env(),  # what reached this rank through horovodrun
    }
    if _is_auto(comp):
        result["auto_plan"] = comp.describe()  # the table of what Auto chose per tensor
        # the timed step at which each plan took effect: a plan's start counts the communications
        # before it (warm-up included), so start s is the (s + 1)-th call, timed step s - warmup
        result["auto_plan_steps"] = [start - result["warmup"] for start, *_ in comp.history]
        # the timed steps at which Auto re-checked the link (its schedule: after the calibration, then
        # every recheck_every communications; the c-th call is timed step c - warmup - 1), whether
        # or not the check adopted a new plan
        first = comp.calibration_steps + 1
        every = comp.recheck_every or (steps + result["warmup"] + 1)
        result["auto_check_steps"] = [c - result["warmup"] - 1 for c in range(first, result["warmup"] + steps + 1, every)
                                      if c - result["warmup"] - 1 >= 0]
    result["change_link_at"] = a.change_link_at or None
    with open(a.out + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(a.out + ".tmp", a.out)
    return 0


def main(argv=None):
    from ..units import parse_count
    p = argparse.ArgumentParser(prog="python -m hvd_compress.tools.bench.e2e_worker")
    p.add_argument("--framework", default="torch", choices=["torch", "tensorflow", "tf"])
    p.add_argument("--model", default="mlp", choices=["mlp", "transformer"])
    p.add_argument("--params", default="16M", type=parse_count)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--scheme", default="none")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--min-steps", type=int, default=3)
    p.add_argument("--max-seconds", type=float, default=0.0,
                   help="cap the timed steps to about this many seconds (0: no cap)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--compute-steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--iface", default="eth0")
    p.add_argument("--idle-seconds", type=float, default=1.0,
                   help="after the timed steps, measure the interface's idle traffic this long")
    p.add_argument("--change-link-at", type=int, default=0,
                   help="before this timed step, have the driver reshape the link (0: never)")
    p.add_argument("--link-file", default=None, help="the request/done file pair's prefix for --change-link-at")
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.change_link_at and not a.link_file:
        p.error("--change-link-at needs --link-file")
    if a.framework == "tf":
        a.framework = "tensorflow"
    if a.warmup < 1:
        p.error("--warmup must be >= 1 (the first step also builds Horovod's caches)")
    return run_torch(a) if a.framework == "torch" else run_tf(a)


if __name__ == "__main__":
    sys.exit(main())
