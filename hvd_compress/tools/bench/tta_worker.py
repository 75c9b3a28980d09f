"""One rank of ``hvd-compress bench tta``; launched by horovodrun::

    horovodrun -np 4 -H h1:1,h2:1,h3:1,h4:1 ... python -m hvd_compress.tools.bench.tta_worker \\
        --framework torch --model cnn --schemes 'none,TopK(0.01)' --seeds 1,2 --steps 320 \\
        --eval-every 16 --out result.json

For each seed and each scheme, a fresh model trains ``--steps`` SGD steps (momentum 0.9, cosine
decay over those steps, each scheme under its recipe: :func:`build_compression`), and every
``--eval-every`` steps (and after the last) every rank evaluates its shard of the held-out data
(:mod:`hvd_compress.tools.bench.tta_data`); a point of the curve is ``(step, seconds, wire
bytes, accuracy)``: the training steps' wall-clock on rank 0 so far (the evaluations
excluded), the bytes this host's interface sent so far, and the held-out accuracy in percent.

``--time-steps N``: no curve; after ``--time-warmup`` steps, the slowest rank's median over
``N`` steps of the scheme past its dense warmup and ratio ramp (what a step costs on this
link), for :mod:`hvd_compress.tools.bench.tta` to combine with the steps to the target.

TensorFlow: each launch first runs two untimed dense steps of a throwaway model, so that no run
pays the process's first trace (seconds, whatever the scheme) alone.  An ``Auto()`` record adds
where its start-up went (``auto_check_seconds``), the step each plan took force from
(``auto_plan_starts``) and what each planned tensor was sent as before the first plan
(``auto_warmup``: ``none``, or the quantizer of a quantized warmup) and the first decision's
trial plans (``auto_trials``).

Rank 0 writes a JSON list (one object per (seed, scheme), after each) to ``--out``.
"""
from __future__ import annotations

import argparse
import collections
import json
import math
import os
import statistics
import sys
import time

from ..recipes import (DENSE_BELOW_WITH_EMBEDDINGS, MODEL_LR_PER_RANK, WARMUP_EPOCHS, is_auto_spec, per_model,
                       recipe_of_spec)
from .e2e_worker import read_iface
from .pinning import add_worker_argument, pin_if_asked
from .specs import HOROVOD_SPECS, horovod_compression, keyword_args, split_specs
from .tta_data import BATCH, load, lm_batch

#: the momentum of every run (in the optimizer, or in the compressor where the recipe says so)
MOMENTUM = 0.9


def build_compression(spec, model, steps_per_epoch, framework, seed=0, timing=False):
    """(compression object, momentum placement, per-rank learning rate) of ``spec`` under its
    recipe (:mod:`hvd_compress.tools.recipes`).  ``timing``: without the dense warmup and the
    ratio ramp, so that every step is the compressed one."""
    import hvd_compress
    lr = MODEL_LR_PER_RANK[model]
    if spec in HOROVOD_SPECS:
        return horovod_compression(spec, framework), "optimizer", lr
    if is_auto_spec(spec):
        # Auto's own advice (its docstring, docs/guide/schemes.md "Momentum placement"): momentum in
        # the compressor, the optimizer's at 0. Auto may pick a sign scheme or Top-K, whose residual
        # an optimizer's momentum amplifies; the recipes of those schemes place it the same way.
        # The dense warmup and dense small tensors are the lossy recipes' (the calibration runs
        # inside the warmup); on a slow link Auto picks their schemes.
        warmup = 0 if timing else WARMUP_EPOCHS[model] * steps_per_epoch
        # the spec's own arguments (Auto(include_sign=True)) join these, and win over them
        recipe_args = {"seed": seed, "momentum": MOMENTUM, "warmup_steps": warmup,
                       "dense_below": per_model(DENSE_BELOW_WITH_EMBEDDINGS, model)}
        auto = hvd_compress.Auto(**{**recipe_args, **keyword_args(spec)})
        return auto, "compressor", lr
    r = recipe_of_spec(spec)
    kwargs = {k: v for k, v in r.params.items() if k != "ramp" and v is not None}
    if r.placement == "compressor":
        kwargs["momentum"] = MOMENTUM
    factory = getattr(hvd_compress, r.label.split("(")[0])
    comp = factory(error_feedback=r.error_feedback, **kwargs)
    warmup = 0 if timing or not r.warmup else WARMUP_EPOCHS[model] * steps_per_epoch
    ramp = 0 if timing else per_model(r.params.get("ramp", 0), model) * steps_per_epoch
    dense_below = per_model(r.dense_below, model)
    if dense_below or warmup or ramp:
        comp = hvd_compress.recipe(comp, dense_below=dense_below, warmup_steps=warmup, ramp_steps=ramp)
    return comp, r.placement, r.lr or lr


def cosine_lr(peak, step, total):
    return peak * 0.5 * (1.0 + math.cos(math.pi * step / total))


class Batches:
    """This rank's training batches by step: the MNIST shard in a fresh permutation each
    epoch (seeded by seed, epoch and rank, as the examples do), or the LM's windows."""

    def __init__(self, model, data, rank, size, seed, steps_per_epoch):
        import numpy as np
        self.np, self.model, self.rank, self.seed = np, model, rank, seed
        self.batch = BATCH[model]
        xtr, ytr = data[0], data[1]
        self.x, self.y = (xtr, None) if model == "charlm" else (xtr[rank::size], ytr[rank::size])
        self.steps_per_epoch = steps_per_epoch
        self.perm_epoch, self.perm = -1, None

    def __call__(self, step):
        if self.model == "charlm":
            return lm_batch(self.x, self.batch, step, self.seed, self.rank)
        epoch, b = divmod(step, self.steps_per_epoch)
        if epoch != self.perm_epoch:
            self.perm = self.np.random.RandomState(self.seed * 1000 + epoch * 10 + self.rank).permutation(len(self.x))
            self.perm_epoch = epoch
        idx = self.perm[b * self.batch:(b + 1) * self.batch]
        return self.x[idx], self.y[idx]


def steps_per_epoch(model, data, size):
    """Optimizer steps in one pass over the training split at ``size`` ranks (the LM: 50)."""
    if model == "charlm":
        return 50
    return math.ceil(len(data[0]) / size / BATCH[model])


class Curve:
    """The evaluation points of one run, and the clock and byte counter they read."""

    def __init__(self, iface):
        self.iface, self.points, self.seconds, self.times = iface, [], 0.0, []
        counters = read_iface(iface)
        self.tx0 = None if counters is None else counters[1]

    def step_done(self, seconds):
        self.seconds += seconds
        self.times.append(seconds)

    def add(self, step, accuracy, loss):
        counters = read_iface(self.iface)
        wire = None if counters is None or self.tx0 is None else counters[1] - self.tx0
        self.points.append({"step": step, "time_s": round(self.seconds, 4), "wire_bytes": wire,
                            "accuracy": round(accuracy, 3), "train_loss": round(loss, 5) if math.isfinite(loss)
                            else None})


def _slowest_median(per_rank):
    """The median over steps of the slowest rank's time (``per_rank``: every rank's step times)."""
    return statistics.median(max(ts) for ts in zip(*per_rank)) if per_rank and per_rank[0] else None


def _record(a, spec, seed, curve, placement, size, steps, comp, extra=None):
    times = curve.times[a.time_warmup:] if a.time_steps else curve.times
    rec = {"scheme": spec, "seed": seed, "workers": size, "steps": steps, "momentum_placement": placement,
           "curve": curve.points, "train_s": curve.seconds, "step_times_s": [round(t, 5) for t in times],
           "median_step_s": statistics.median(times) if times else None}
    if hasattr(comp, "current_plan"):  # Auto: the plan in force at the end, and where it came from
        rec["auto_plan"] = comp.current_plan()
        config = comp.config()
        rec["auto_config"] = {k: config[k] for k in ("warmup_steps", "warmup_with", "dense_below",
                                                     "calibration_steps")}
        # where its start-up went: each check's seconds and the step each plan took force from
        state = comp.plan_state
        rec["auto_check_seconds"] = dict(state.check_seconds or {})
        rec["auto_plan_starts"] = [start for start, _, _ in state.history]
        rec["auto_warmup"] = dict(state.provisional)
        # the first decision's trial plans (PyTorch): each one's {scheme: tensors}, predicted and measured
        # step; a re-check's trials (its new plan against the plan in force) in auto_recheck_trials
        rounds = state.earlier_trials + ([{"trials": state.trials, "trial_pick": state.trial_pick}]
                                         if state.trials else [])
        listed = [[{"plan": dict(collections.Counter(t["labels"].values())), "predicted_s": t["predicted_s"],
                    "step_s": t["step_s"], "adopted": i == r["trial_pick"], "timed_before": bool(t.get("before"))}
                   for i, t in enumerate(r["trials"])] for r in rounds]
        rec["auto_trials"] = listed[0] if listed else []
        rec["auto_recheck_trials"] = listed[1:]
    rec.update(extra or {})
    return rec


def _run_all(a, hvd, train_one):
    """Every (seed, scheme) in turn; rank 0 writes the list after each."""
    out = []
    for seed in [int(s) for s in a.seeds.split(",")]:
        for spec in split_specs(a.schemes):
            t0 = time.monotonic()
            rec = train_one(spec, seed)
            if hvd.rank() == 0:
                out.append(rec)
                last = rec["curve"][-1] if rec["curve"] else {}
                print(f"[tta {a.framework} {a.model} np={hvd.size()}] {spec} seed {seed}: "
                      f"{last.get('accuracy', '-')}% after {rec['steps']} steps, train {rec['train_s']:.1f} s, "
                      f"median step {rec['median_step_s'] or 0:.4f} s ({time.monotonic() - t0:.0f} s)", flush=True)
                with open(a.out + ".tmp", "w") as f:
                    json.dump(out, f)
                os.replace(a.out + ".tmp", a.out)
    return 0


# ----------------------------------------------------------------------------- torch
def run_torch(a):
    import torch
    import horovod.torch as hvd

    from .tta_data import torch_model
    hvd.init()
    torch.set_num_threads(a.threads)
    data = load(a.model)
    size, rank = hvd.size(), hvd.rank()
    spe = steps_per_epoch(a.model, data, size)
    spe = int(hvd.allreduce(torch.tensor(spe), op=hvd.Min, name="tta.steps_per_epoch"))
    xv, yv = torch.from_numpy(data[2][rank::size]), torch.from_numpy(data[3][rank::size])

    def loss_of(out, y):
        return torch.nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    def evaluate(model):
        model.eval()
        with torch.no_grad():
            correct = (model(xv).argmax(-1) == yv).sum().float()
        model.train()
        tot = hvd.allreduce(torch.stack([correct, torch.tensor(float(yv.numel()))]), op=hvd.Sum, name="tta.eval")
        return 100.0 * float(tot[0] / tot[1])

    def compute_s():
        """The slowest rank's median of a few purely local steps, every rank at once."""
        model = torch_model(a.model)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        x, y = (torch.from_numpy(v) for v in Batches(a.model, data, rank, size, 0, spe)(0))
        hvd.allreduce(torch.zeros(1), name="tta.compute_barrier")
        times = []
        for _ in range(a.compute_steps + 1):
            t0 = time.perf_counter()
            opt.zero_grad()
            loss_of(model(x), y).backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        return _slowest_median(hvd.allgather_object(times[1:]))

    local = compute_s() if a.compute_steps else None

    def train_one(spec, seed):
        torch.manual_seed(seed)
        model = torch_model(a.model)
        comp, placement, lr = build_compression(spec, a.model, spe, "torch", seed, timing=bool(a.time_steps))
        opt = torch.optim.SGD(model.parameters(), lr=lr * size, momentum=MOMENTUM if placement == "optimizer" else 0.0)
        dopt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(), compression=comp)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        batches = Batches(a.model, data, rank, size, seed, spe)
        steps = a.time_warmup + a.time_steps if a.time_steps else a.steps
        hvd.allreduce(torch.zeros(1), name="tta.barrier")
        curve, loss = Curve(a.iface), float("nan")
        for step in range(steps):
            for g in dopt.param_groups:
                g["lr"] = cosine_lr(lr * size, step, a.steps)
            x, y = (torch.from_numpy(v) for v in batches(step))
            t0 = time.perf_counter()
            dopt.zero_grad()
            out = loss_of(model(x), y)
            out.backward()
            dopt.step()
            curve.step_done(time.perf_counter() - t0)
            loss = out.item()
            if not a.time_steps and ((step + 1) % a.eval_every == 0 or step + 1 == steps):
                curve.add(step + 1, evaluate(model), loss)
        nparams = sum(p.numel() for p in model.parameters())
        slowest = hvd.allgather_object(curve.times[a.time_warmup:] if a.time_steps else [])
        rec = _record(a, spec, seed, curve, placement, size, steps, comp,
                      {"params": nparams, "steps_per_epoch": spe, "compute_s": local,
                       "layer_numels": [p.numel() for p in model.parameters()]})
        if a.time_steps:
            rec["median_step_s"] = _slowest_median(slowest)
        del dopt
        return rec

    return _run_all(a, hvd, train_one)


# ----------------------------------------------------------------------------- TensorFlow
def run_tf(a):
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")  # tf_keras: Horovod needs Variable.ref(), Keras 3 lacks it
    import tensorflow as tf
    tf.config.threading.set_intra_op_parallelism_threads(a.threads)
    tf.config.threading.set_inter_op_parallelism_threads(a.threads)
    import horovod.tensorflow as hvd

    from .tta_data import tf_model
    hvd.init()
    data = load(a.model)
    size, rank = hvd.size(), hvd.rank()
    spe = steps_per_epoch(a.model, data, size)
    spe = int(hvd.allreduce(tf.constant(spe), op=hvd.Min, name="tta.steps_per_epoch"))
    xv, yv = tf.constant(data[2][rank::size]), tf.constant(data[3][rank::size])

    def compute_s():
        """The slowest rank's median of a few purely local steps, every rank at once."""
        model = tf_model(a.model, 0)
        opt = tf.keras.optimizers.SGD(learning_rate=0.0)
        loss_obj = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        @tf.function
        def local_step(x, y):
            with tf.GradientTape() as tape:
                loss = loss_obj(y, model(x, training=True))
            opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))
            return loss
        x, y = (tf.constant(v) for v in Batches(a.model, data, rank, size, 0, spe)(0))
        hvd.allreduce(tf.zeros([1]), name="tta.compute_barrier")
        times = []
        for _ in range(a.compute_steps + 1):
            t0 = time.perf_counter()
            float(local_step(x, y))
            times.append(time.perf_counter() - t0)
        return _slowest_median(hvd.allgather_object(times[1:]))

    local = compute_s() if a.compute_steps else None

    def warm_process():
        """Two untimed dense steps and an evaluation of a throwaway model: TensorFlow's first trace in a
        process costs seconds more than later ones (its own start-up, the same whatever the scheme), and
        the first run of each launch would pay it alone (Auto's launches hold nothing else)."""
        model = tf_model(a.model, 0)
        opt = tf.keras.optimizers.SGD(learning_rate=0.0)
        step_fn = _tf_step(tf, hvd, model, opt, tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                           hvd.Compression.none)
        x, y = (tf.constant(v) for v in Batches(a.model, data, rank, size, 0, spe)(0))
        for _ in range(2):
            float(step_fn(x, y))
        float(tf.reduce_sum(model(xv, training=False)))

    warm_process()

    def train_one(spec, seed):
        tf.random.set_seed(seed)
        model = tf_model(a.model, seed)
        comp, placement, lr = build_compression(spec, a.model, spe, "tensorflow", seed, timing=bool(a.time_steps))
        rate = tf.Variable(lr * size, trainable=False, dtype=tf.float32)
        opt = tf.keras.optimizers.SGD(learning_rate=lambda: rate,  # read each step: the cosine schedule below
                                      momentum=MOMENTUM if placement == "optimizer" else 0.0)
        loss_obj = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        step_fn = _tf_step(tf, hvd, model, opt, loss_obj, comp)
        model(tf.constant(Batches(a.model, data, rank, size, seed, spe)(0)[0]))  # builds the weights
        hvd.broadcast_variables(model.variables, root_rank=0)  # the optimizer's slots start at zero everywhere
        batches = Batches(a.model, data, rank, size, seed, spe)
        steps = a.time_warmup + a.time_steps if a.time_steps else a.steps
        hvd.allreduce(tf.zeros([1]), name="tta.barrier")
        curve, loss = Curve(a.iface), float("nan")
        for step in range(steps):
            rate.assign(cosine_lr(lr * size, step, a.steps))
            x, y = batches(step)
            x, y = tf.constant(x), tf.constant(y)
            t0 = time.perf_counter()
            loss = float(step_fn(x, y))
            curve.step_done(time.perf_counter() - t0)
            if not a.time_steps and ((step + 1) % a.eval_every == 0 or step + 1 == steps):
                correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(model(xv, training=False), -1), yv), tf.float32))
                tot = hvd.allreduce(tf.stack([correct, float(int(tf.size(yv)))]), op=hvd.Sum, name="tta.eval")
                curve.add(step + 1, 100.0 * float(tot[0] / tot[1]), loss)
        nparams = sum(int(v.shape.num_elements()) for v in model.trainable_variables)
        slowest = hvd.allgather_object(curve.times[a.time_warmup:] if a.time_steps else [])
        rec = _record(a, spec, seed, curve, placement, size, steps, comp,
                      {"params": nparams, "steps_per_epoch": spe, "compute_s": local,
                       "layer_numels": [int(v.shape.num_elements()) for v in model.trainable_variables]})
        if a.time_steps:
            rec["median_step_s"] = _slowest_median(slowest)
        return rec

    return _run_all(a, hvd, train_one)


def _tf_step(tf, hvd, model, opt, loss_obj, comp):
    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_obj(y, model(x, training=True))
        tape = hvd.DistributedGradientTape(tape, compression=comp)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return step


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m hvd_compress.tools.bench.tta_worker")
    p.add_argument("--framework", default="torch", choices=["torch", "tensorflow"])
    p.add_argument("--model", default="cnn", choices=["cnn", "transformer", "charlm"])
    p.add_argument("--schemes", default="none", help="comma list of scheme specs")
    p.add_argument("--seeds", default="1")
    p.add_argument("--steps", type=int, required=True, help="training steps (the cosine schedule's length)")
    p.add_argument("--eval-every", type=int, default=16)
    p.add_argument("--time-steps", type=int, default=0, help="time this many steps instead of a curve")
    p.add_argument("--time-warmup", type=int, default=3)
    p.add_argument("--compute-steps", type=int, default=0, help="first time this many purely local steps")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--iface", default="eth0")
    add_worker_argument(p)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    if a.steps < 1 or a.eval_every < 1:
        p.error("--steps and --eval-every must be >= 1")
    if a.time_steps and a.time_warmup < 1:
        p.error("--time-warmup must be >= 1 (the first step also builds Horovod's caches)")
    pin_if_asked(a)
    return run_torch(a) if a.framework == "torch" else run_tf(a)


if __name__ == "__main__":
    sys.exit(main())
