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

from .pinning import add_worker_argument, pin_if_asked


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


class WaitClock:
    """Seconds spent in ``horovod.torch.synchronize`` -- where hvd_compress's
    adapter waits on its side collectives (allgather, alltoall) -- accumulated
    in :attr:`total`.  :meth:`install` replaces the module attribute the
    adapter calls; Horovod's own optimizer and ``hvd.allreduce`` bind
    ``mpi_ops.synchronize`` directly and are not counted."""

    def __init__(self):
        self.total = 0.0

    def install(self):
        import horovod.torch as hvd
        inner = hvd.synchronize
        if getattr(inner, "hvdc_wait_clock", None) is not None:
            return inner.hvdc_wait_clock
        clock = self

        def synchronize(handle):
            t0 = time.perf_counter()
            try:
                return inner(handle)
            finally:
                clock.total += time.perf_counter() - t0
        synchronize.hvdc_wait_clock = clock
        hvd.synchronize = synchronize
        return clock


class TimedCompression:
    """Wraps a compression object (hvd_compress's or Horovod's) and times its
    ``compress`` (encode, error feedback, launching side collectives) and
    ``decompress`` (waiting on side collectives, the owners' second round,
    decode) on this rank.  Time spent blocked in :class:`WaitClock` inside
    each call is kept apart: ``encode_s``/``decode_s`` are CPU work,
    ``encode_wait_s``/``decode_wait_s`` waiting for other ranks and the link."""

    def __init__(self, inner, clock=None):
        self.inner = inner
        self.clock = clock
        self.reset()

    def reset(self):
        self.encode_s = self.decode_s = self.encode_wait_s = self.decode_wait_s = 0.0
        self.compress_calls = self.decompress_calls = 0

    def _waited(self):
        return self.clock.total if self.clock is not None else 0.0

    def compress(self, tensor):
        t0, w0 = time.perf_counter(), self._waited()
        try:
            return self.inner.compress(tensor)
        finally:
            dw = self._waited() - w0
            self.encode_s += time.perf_counter() - t0 - dw
            self.encode_wait_s += dw
            self.compress_calls += 1

    def decompress(self, tensor, ctx):
        t0, w0 = time.perf_counter(), self._waited()
        try:
            return self.inner.decompress(tensor, ctx)
        finally:
            dw = self._waited() - w0
            self.decode_s += time.perf_counter() - t0 - dw
            self.decode_wait_s += dw
            self.decompress_calls += 1


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
    if getattr(comp, "transport", "allgather") != "allgather":  # two_phase, auto: the compressor's choice
        return comp.transport
    return comp.scheme.transport


def _wait_for_link_change(a, hvd, barrier):
    """Rank 0 asks the driver (``hvd-compress bench link-change``) to reshape the
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
    its first plan (PyTorch: and the trial plans' steps, ``trial_plans x
    trial_steps``, a bound where fewer run): the timed steps see the final plan,
    not the calibration."""
    if not _is_auto(comp):
        return a.warmup
    trials = comp.most_trial_steps if a.framework == "torch" else 0
    return a.warmup + comp.steps_before_plan + 1 + trials


# ----------------------------------------------------------------------------- torch
def run_torch(a):
    """One block per scheme of ``--scheme`` (a comma list), ``--passes`` times
    (the second pass in reverse order, so that drift of the machine's load
    falls on every scheme alike); each block builds a fresh model and
    optimizer.  One scheme and one pass: the single row ``bench e2e`` reads;
    otherwise a list of rows, one per scheme, the passes' steps pooled."""
    import torch
    import horovod.torch as hvd

    from .specs import split_specs

    hvd.init()
    torch.set_num_threads(a.threads)
    clock = WaitClock().install()
    specs = split_specs(a.scheme)
    blocks = {spec: [] for spec in specs}
    for p in range(a.passes):
        for spec in (specs if p % 2 == 0 else specs[::-1]):
            blocks[spec].append(_torch_block(a, hvd, spec, clock))
    if hvd.rank() != 0:
        return 0
    rows = [_row(a, spec, [b for b, _ in blocks[spec]], blocks[spec][-1][1]) for spec in specs]
    _write(a.out, rows[0] if len(specs) == 1 and a.passes == 1 else rows)
    return 0


def _torch_block(a, hvd, spec, clock):
    """Compute-only steps, then the distributed steps of one scheme on a fresh
    model: (every rank's measurements, what rank 0 knows of the compressor)."""
    import torch

    from .models import torch_model

    torch.manual_seed(a.seed)
    model, make_batch, loss_fn = torch_model(a.model, a.params)
    x, y = make_batch(a.batch, seed=a.seed + hvd.rank())
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    layer_shapes = [list(p.shape) for p in model.parameters()]

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
    comp = _make_compression(spec, "torch")
    timed = TimedCompression(comp, clock)
    dopt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=timed)
    backward_s = []

    def dist_step():
        t0 = time.perf_counter()
        dopt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        backward_s.append(time.perf_counter() - t0)
        dopt.step()
        return loss.detach().item()

    if a.breakdown:
        dist_step = _breakdown_step(a, hvd, dopt, comp, model, loss_fn, x, y)
    everyone = _measure(a, hvd, barrier, dist_step, comp, compute,
                        lambda obj: hvd.broadcast_object(obj, root_rank=0),
                        lambda obj: hvd.allgather_object(obj), timed=timed, backward_s=backward_s)
    info = _compressor_info(a, comp, spec, layer_shapes, hvd.size())
    del dopt
    return everyone, info


class StepBreakdown:
    """Where a PyTorch step's time goes, from clocks around the calls that
    make it up (``--breakdown``): ``forward`` (zero_grad and the forward
    pass), ``backward`` (the backward pass less the ``compress`` calls its
    hooks make), ``encode`` (``compress``: error feedback, encode, launching
    the side collectives), ``wait_allreduce`` (Horovod's ``synchronize`` of
    the allreduces the optimizer launched: the dense gradients, or a
    compressor's placeholders), ``wait_gather`` (``synchronize`` of the side
    collectives, inside ``decompress``), ``decode`` (``decompress`` less
    that waiting), ``sync_rest`` (the rest of the optimizer's synchronize)
    and ``update`` (the optimizer step).  One dict per step, seconds."""

    def __init__(self):
        self.now = {}
        self.steps = []

    def add(self, part, seconds):
        self.now[part] = self.now.get(part, 0.0) + seconds

    def timed(self, part, fn):
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(part, time.perf_counter() - t0)
        return wrapper


def _breakdown_step(a, hvd, dopt, comp, model, loss_fn, x, y):
    """The distributed step with :class:`StepBreakdown`'s clocks (rank-local
    wrappers of ``compress``, ``decompress``, the optimizer's
    ``synchronize`` calls and the collectives' wait); the breakdowns of the
    timed steps go to the result as ``breakdown_steps``."""
    import horovod.torch.optimizer as hvd_optimizer

    from ...adapters.torch_collectives import TorchCollectives
    clock = a.breakdown_clock = StepBreakdown()
    comp.compress = clock.timed("encode", comp.compress)
    comp.decompress = clock.timed("decompress", comp.decompress)
    hvd_optimizer.synchronize = clock.timed("wait_allreduce", hvd_optimizer.synchronize)
    TorchCollectives.wait = clock.timed("wait_gather", TorchCollectives.wait)

    def step():
        clock.now = {}
        t0 = time.perf_counter()
        dopt.zero_grad()
        loss = loss_fn(model(x), y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        dopt.synchronize()
        t3 = time.perf_counter()
        with dopt.skip_synchronize():
            dopt.step()
        value = loss.detach().item()
        t4 = time.perf_counter()
        got = clock.now
        encode, decompress = got.get("encode", 0.0), got.get("decompress", 0.0)
        wait_allreduce, wait_gather = got.get("wait_allreduce", 0.0), got.get("wait_gather", 0.0)
        clock.steps.append({"step": t4 - t0, "forward": t1 - t0, "backward": t2 - t1 - encode, "encode": encode,
                            "wait_allreduce": wait_allreduce, "wait_gather": wait_gather,
                            "decode": decompress - wait_gather,
                            "sync_rest": t3 - t2 - wait_allreduce - decompress, "update": t4 - t3})
        return value
    return step


# ----------------------------------------------------------------------------- TensorFlow
def init_tf(threads, seed):
    """TensorFlow with ``threads`` threads, Horovod started, the seed set: (tf, hvd)."""
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads)
    import horovod.tensorflow as hvd
    hvd.init()
    tf.random.set_seed(seed)
    return tf, hvd


def distributed_step(tf, hvd, model, loss_obj, opt, comp):
    """A traced training step ``(x, y) -> loss`` through Horovod's
    ``DistributedGradientTape`` with ``comp``."""
    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_obj(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=comp, sparse_as_dense=True)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return step


def run_tf(a):
    from .models import tf_model

    tf, hvd = init_tf(a.threads, a.seed)
    model, make_batch, loss_obj = tf_model(a.model, a.params)
    x, y = make_batch(a.batch, seed=a.seed + hvd.rank())
    opt = tf.keras.optimizers.SGD(learning_rate=a.lr, momentum=0.9)
    comp = _make_compression(a.scheme, "tensorflow")
    layer_shapes = [v.shape.as_list() for v in model.trainable_variables]

    @tf.function
    def local_step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_obj(y, model(x, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    dist_step_fn = distributed_step(tf, hvd, model, loss_obj, opt, comp)

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

    return _timed_loop(a, hvd, barrier, dist_step, comp, compute, layer_shapes,
                       lambda obj: hvd.broadcast_object(obj, root_rank=0),
                       lambda obj: hvd.allgather_object(obj))


# ----------------------------------------------------------------------------- shared
def _timed_loop(a, hvd, barrier, dist_step, comp, compute, layer_shapes, bcast, gather):
    everyone = _measure(a, hvd, barrier, dist_step, comp, compute, bcast, gather)
    if hvd.rank() != 0:
        return 0
    _write(a.out, _row(a, a.scheme, [everyone], _compressor_info(a, comp, a.scheme, layer_shapes, hvd.size())))
    return 0


def _write(path, obj):
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def _measure(a, hvd, barrier, dist_step, comp, compute, bcast, gather, timed=None, backward_s=None):
    """Warm-up, the timed steps between barriers with the interface's byte
    counters read around them, the idle traffic after; every rank's record
    (a list, on every rank)."""
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
    if timed is not None:
        timed.reset()
    if backward_s is not None:
        del backward_s[:]
    barrier()
    clock = getattr(a, "breakdown_clock", None)
    if clock is not None:
        clock.steps = []  # the timed steps only
        if a.step_timeline:  # every rank calls it (HOROVOD_TIMELINE=DYNAMIC); rank 0 writes the file
            hvd.start_timeline(a.step_timeline, mark_cycles=True)
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
    if clock is not None and a.step_timeline:
        hvd.stop_timeline()
    codec = None if timed is None else {k: getattr(timed, k) for k in
                                        ("encode_s", "decode_s", "encode_wait_s", "decode_wait_s")}
    # Horovod's background loop keeps coordinating while no tensor is pending:
    # measure that idle control traffic too, to explain wire > payload
    time.sleep(a.idle_seconds)
    c2 = read_iface(a.iface)
    barrier()
    me = {"rank": hvd.rank(), "host": socket.gethostname(), "steps": steps, "times": times, "warmup_times": warm,
          "compute": compute, "wall": wall, "backward": list(backward_s or []), "codec": codec,
          "rx": None if c0 is None else c1[0] - c0[0], "tx": None if c0 is None else c1[1] - c0[1],
          "idle_tx": None if c0 is None else c2[1] - c1[1], "idle_rx": None if c0 is None else c2[0] - c1[0],
          "payload_bytes_per_step": _payload_per_step(comp, steps), "loss_first": losses[0],
          "loss_last": losses[-1], "breakdown_steps": clock.steps if clock is not None else None,
          "auto_check_seconds": comp.plan_state.check_seconds if _is_auto(comp) else None}
    return gather(me)


def _compressor_info(a, comp, spec, layer_shapes, size):
    """What the row says about the compressor (rank 0's view, after its timed steps)."""
    info = {"transport": _transport(comp), "warmup": _warmup_steps(a, comp), "layer_shapes": layer_shapes}
    if _is_auto(comp):
        info["auto_plan"] = comp.describe()  # the table of what Auto chose per tensor
        info["auto_history_starts"] = [start for start, *_ in comp.plan_state.history]
        info["auto_calibration_steps"] = comp.steps_before_plan
        info["auto_recheck_every"] = comp.recheck_every
        # the communications the trial plans ran (PyTorch): the re-checks count from their end
        info["auto_trial_calls"] = len(comp.plan_state.trials_run()) * comp.trial_steps
        # the early probe's link (None: not probed) and what each tensor was calibrated with
        early = comp.plan_state.early_link
        info["auto_early_link"] = None if early is None else {"latency_s": early.latency_s,
                                                               "bytes_per_s": early.bytes_per_s}
        info["auto_calibrated_with"] = dict(comp.plan_state.provisional)
        # what the plan was made from (link, host, every candidate's codec seconds): the
        # planner can be run again on it, deterministically
        info["auto_plan_inputs"] = {**comp.plan_state.to_json(), "machine": repr(comp.plan_state.machine)}
    return info


def horovod_settings(environ=None):
    """Horovod's cycle time (ms) and fusion threshold (bytes) as this rank runs
    them: the environment's values, else Horovod 0.28.1's defaults (1 ms,
    128 MiB)."""
    environ = os.environ if environ is None else environ
    cycle = environ.get("HOROVOD_CYCLE_TIME")
    fusion = environ.get("HOROVOD_FUSION_THRESHOLD")
    return {"horovod_cycle_time_ms": float(cycle) if cycle else 1.0,
            "horovod_fusion_threshold_bytes": int(fusion) if fusion else 128 * 1024 * 1024,
            "horovod_settings_from_env": bool(cycle or fusion)}


def _row(a, spec, blocks, info):
    """One row from one or more blocks of the same scheme (each a list of every
    rank's record): the steps pooled, bytes per step over all timed steps."""
    first = blocks[0]
    per_step, compute_steps, warm, backward, per_pass = [], [], [], [], []
    for everyone in blocks:
        n = everyone[0]["steps"]
        block = [max(r["times"][i] for r in everyone) for i in range(n)]
        per_step += block
        per_pass.append(statistics.median(block) if block else None)
        compute_steps += [max(r["compute"][i] for r in everyone) for i in range(len(everyone[0]["compute"]))]
        warm += [max(r["warmup_times"][i] for r in everyone) for i in range(len(everyone[0]["warmup_times"]))]
        if all(len(r["backward"]) == n for r in everyone) and n:
            backward += [max(r["backward"][i] for r in everyone) for i in range(n)]
    steps = len(per_step)
    wall = sum(everyone[0]["wall"] for everyone in blocks)
    ranks = sorted({r["rank"] for r in first})
    hosts = {}
    for r in first:  # one set of counters per host (ranks on one host share its interface)
        hosts.setdefault(r["host"], r["rank"])

    def total(rank, key):
        vals = [r[key] for everyone in blocks for r in everyone if r["rank"] == rank]
        return None if any(v is None for v in vals) else sum(vals)

    per_host = []
    for host, rank in hosts.items():
        tx, rx = total(rank, "tx"), total(rank, "rx")
        per_host.append({"host": host, "tx_bytes_per_step": None if tx is None else tx / steps,
                         "rx_bytes_per_step": None if rx is None else rx / steps})
    tx = [h["tx_bytes_per_step"] for h in per_host if h["tx_bytes_per_step"] is not None]
    rx = [h["rx_bytes_per_step"] for h in per_host if h["rx_bytes_per_step"] is not None]
    idle_tx = [total(rank, "idle_tx") for rank in hosts.values()]
    idle_rx = [total(rank, "idle_rx") for rank in hosts.values()]
    idle_s = a.idle_seconds * len(blocks)
    per_rank = []
    for rank in ranks:
        mine = [r for everyone in blocks for r in everyone if r["rank"] == rank]
        entry = {"rank": rank, "host": mine[0]["host"], "tx": total(rank, "tx"), "rx": total(rank, "rx"),
                 "payload_bytes_per_step": mine[-1]["payload_bytes_per_step"]}
        if all(r["codec"] is not None for r in mine):
            for k in ("encode_s", "decode_s", "encode_wait_s", "decode_wait_s"):
                entry[k + "_per_step"] = sum(r["codec"][k] for r in mine) / steps
        per_rank.append(entry)
    me = [r for r in first if r["rank"] == 0][0]
    from .micro import malloc_env
    result = {
        "scheme": spec, "framework": a.framework, "model": a.model,
        "model_params": int(sum(_numel(s) for s in info["layer_shapes"])),
        "layer_numels": [_numel(s) for s in info["layer_shapes"]], "layer_shapes": info["layer_shapes"],
        "workers": len(ranks), "hosts": len(hosts), "batch": a.batch, "threads": a.threads,
        "steps": steps, "passes": len(blocks), "warmup": info["warmup"], "transport": info["transport"],
        "median_step_s": statistics.median(per_step), "mean_step_s": wall / steps,
        "step_s_all": per_step, "pass_median_step_s": per_pass, "compute_s": statistics.median(compute_steps) if compute_steps else None,
        "compute_s_all": compute_steps,
        "backward_s": statistics.median(backward) if backward else None,
        # the slowest rank's warm-up steps (Auto: its calibration and first decision are among them)
        "warmup_step_s_all": warm,
        "payload_bytes_per_step": statistics.mean(r["payload_bytes_per_step"] for r in per_rank),
        "wire_bytes_per_step": statistics.mean(tx) if tx else None,
        "wire_rx_bytes_per_step": statistics.mean(rx) if rx else None,
        "wire_per_host": per_host,
        "idle_wire_bytes_per_s": (statistics.mean(idle_tx) / idle_s) if idle_tx and None not in idle_tx
        and idle_s else None,
        "idle_wire_rx_bytes_per_s": (statistics.mean(idle_rx) / idle_s) if idle_rx and None not in idle_rx
        and idle_s else None,
        "wire_iface": a.iface, "loss_first": me["loss_first"], "loss_last": me["loss_last"],
        "per_rank": per_rank,
        "malloc_env": malloc_env(),  # what reached this rank through horovodrun
        **horovod_settings(),
    }
    if per_rank and all("encode_s_per_step" in r for r in per_rank):
        for k in ("encode_s", "decode_s", "encode_wait_s", "decode_wait_s"):
            vals = [r[k + "_per_step"] for r in per_rank]
            result[k + "_per_step"] = statistics.mean(vals)
            result[k + "_per_step_max"] = max(vals)
    if all(r.get("breakdown_steps") is not None for everyone in blocks for r in everyone):
        # every rank's breakdown of every timed step (the blocks' steps pooled)
        result["breakdown_per_rank"] = [{"rank": rank, "steps": [s for everyone in blocks for r in everyone
                                                                  if r["rank"] == rank
                                                                  for s in r["breakdown_steps"]]}
                                        for rank in ranks]
    if "auto_plan" in info:
        warmup = info["warmup"]
        result["auto_plan"] = info["auto_plan"]
        result["auto_early_link"] = info["auto_early_link"]
        result["auto_calibrated_with"] = info["auto_calibrated_with"]
        result["auto_plan_inputs"] = info["auto_plan_inputs"]
        result["auto_check_seconds"] = [r["auto_check_seconds"] for r in blocks[-1]]
        # the timed step at which each plan took effect: a plan's start counts the communications
        # before it (warm-up included), so start s is the (s + 1)-th call, timed step s - warmup
        result["auto_plan_steps"] = [start - warmup for start in info["auto_history_starts"]]
        # the timed steps at which Auto re-checked the link (its schedule: after the calibration and
        # the trial plans, then every recheck_every communications; the c-th call is timed step c - warmup - 1), whether
        # or not the check adopted a new plan
        first_check = info["auto_calibration_steps"] + 1 + info.get("auto_trial_calls", 0)
        n = blocks[-1][0]["steps"]
        every = info["auto_recheck_every"] or (n + warmup + 1)
        result["auto_check_steps"] = [c - warmup - 1 for c in range(first_check, warmup + n + 1, every)
                                      if c - warmup - 1 >= 0]
    result["change_link_at"] = a.change_link_at or None
    return result


def _numel(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n


def main(argv=None):
    from ..units import parse_count
    p = argparse.ArgumentParser(prog="python -m hvd_compress.tools.bench.e2e_worker")
    p.add_argument("--framework", default="torch", choices=["torch", "tensorflow", "tf"])
    p.add_argument("--model", default="mlp", choices=["mlp", "transformer"])
    p.add_argument("--params", default="16M", type=parse_count)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--scheme", default="none",
                   help="a scheme spec; torch: a comma list runs one block per scheme (a list of rows)")
    p.add_argument("--passes", type=int, default=1,
                   help="torch: run the schemes this many times, every other pass in reverse order")
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
    p.add_argument("--breakdown", action="store_true",
                   help="torch: time the parts of each step (StepBreakdown) and report them per rank")
    p.add_argument("--step-timeline", default=None,
                   help="with --breakdown: rank 0 records Horovod's timeline of the timed steps to this file")
    p.add_argument("--out", required=True)
    add_worker_argument(p)
    a = p.parse_args(argv)
    if a.breakdown and a.framework != "torch":
        p.error("--breakdown is implemented for --framework torch")
    if a.change_link_at and not a.link_file:
        p.error("--change-link-at needs --link-file")
    if a.framework == "tf":
        a.framework = "tensorflow"
    if a.warmup < 1:
        p.error("--warmup must be >= 1 (the first step also builds Horovod's caches)")
    pin_if_asked(a)
    return run_torch(a) if a.framework == "torch" else run_tf(a)


if __name__ == "__main__":
    sys.exit(main())
