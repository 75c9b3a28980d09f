"""One rank of ``hvd-compress bench models`` (under ``horovodrun``): a
Horovod-style synthetic benchmark of one architecture under every requested
scheme in turn (:mod:`hvd_compress.tools.bench.architectures`; the same
batch every step, SGD with momentum, Horovod's ``DistributedOptimizer`` /
``DistributedGradientTape``).  Rank 0 writes a JSON list with one row a
scheme, rewritten after each scheme so that a crash keeps the rows before it.

Each scheme gets a fresh model built from the same seed (so every scheme
starts from the same weights, broadcast from rank 0), a fresh optimizer, a
fresh compressor and Horovod's optimizer / tape built anew; in TensorFlow
the previous scheme's model and ``tf.function`` are dropped and Keras's
session cleared first.  Every rank runs the schemes in the same order.  A
scheme that raises on any rank gets a row with its ``error`` and the next
scheme runs.

Each rank clocks every step; a step's time is the slowest rank's.
With ``--rounds R > 1`` every scheme is built and warmed up first and the
timed steps run in R rounds of ``--steps`` each, the schemes in turn,
every other round in reverse (``round_median_step_s``: each round's median),
so that a drifting load falls on every scheme alike.
``median_step_s`` is the median of the timed steps; ``startup_s`` is what
the steps before them took beyond as many steady steps (the first step's
tracing, Auto's calibration and decision), ``first_step_s`` the first step
alone (the launch's first scheme also pays the process's first-use costs,
such as TensorFlow's first kernels).  ``scheme_s`` is the scheme's own wall
seconds on rank 0 (building its model, its steps);
``loadavg_1m_before`` / ``_after`` the machine's load around it;
``initial_weights_sum`` the sum of the broadcast weights' absolute values,
the same for every scheme of a launch.  For ``Auto()``, ``auto_startup``
breaks the start-up down: this rank's seconds probing the link, timing the
codecs and deciding, the calibration steps, the steps (and their
seconds) before the plan in force at the end, and the last decision's trial
plans (``trials``); ``auto_state`` what its planner saw (to replay the
decision offline).  ``hvdc_env``: the ``HVDC_*`` environment variables the
ranks saw.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from dataclasses import dataclass, field

from .pinning import add_worker_argument, pin_if_asked


def _compression(spec, framework):
    from .specs import HOROVOD_SPECS, horovod_compression, parse_spec
    return horovod_compression(spec, framework) if spec in HOROVOD_SPECS else parse_spec(spec)


def _is_auto(comp):
    from hvd_compress import Auto
    return isinstance(comp, Auto)


def _untimed_steps(a, comp):
    """``--warmup``, plus Auto's calibration steps and the step that decides
    (TensorFlow: and the next, which traces the step with the plan's codecs;
    PyTorch: and the trial plans' steps, ``trial_plans x trial_steps``, a bound:
    fewer plans may qualify, and then the timed steps start under the final plan
    all the same)."""
    if not _is_auto(comp):
        return a.warmup
    if a.framework == "tensorflow":
        return a.warmup + comp.steps_before_plan + 2
    return a.warmup + comp.steps_before_plan + 1 + comp.most_trial_steps


def _clock(step, count):
    out = []
    for _ in range(count):
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


def run_torch(a):
    import torch
    import horovod.torch as hvd

    from .architectures import torch_model
    hvd.init()
    torch.set_num_threads(a.threads)

    def build(spec):
        torch.manual_seed(a.seed)
        model, make_batch, loss_fn = torch_model(a.model, a.size)
        x, y = make_batch(a.batch, seed=a.seed + hvd.rank())
        comp = _compression(spec, "torch")
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                       named_parameters=model.named_parameters(), compression=comp)
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        weights = float(sum(p.detach().abs().sum() for p in model.parameters()))

        def step():
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
        return comp, step, [list(p.shape) for p in model.parameters()], weights
    return _every_scheme(a, hvd, build, gc.collect)


def run_tf(a):
    from .architectures import tf_model
    from .e2e_worker import distributed_step, init_tf
    tf, hvd = init_tf(a.threads, a.seed)

    def build(spec):
        tf.keras.utils.set_random_seed(a.seed)
        model, make_batch, loss_obj = tf_model(a.model, a.size)
        x, y = make_batch(a.batch, seed=a.seed + hvd.rank())
        opt = tf.keras.optimizers.SGD(learning_rate=0.01, momentum=0.9)
        comp = _compression(spec, "tensorflow")
        train = distributed_step(tf, hvd, model, loss_obj, opt, comp)
        hvd.broadcast_variables(model.variables, root_rank=0)
        weights = float(sum(tf.reduce_sum(tf.abs(v)) for v in model.trainable_variables))
        return comp, lambda: float(train(x, y)), [v.shape.as_list() for v in model.trainable_variables], weights

    def release():
        """The schemes' models, optimizers and traced steps go (the next launch's
        scheme, or the next scheme where they run one after another)."""
        tf.keras.backend.clear_session()
        gc.collect()
    return _every_scheme(a, hvd, build, release)


@dataclass
class _Live:
    """A scheme of the launch: its compressor and step once built (or the
    error that stopped it), its clocks (untimed first), rank 0's seconds."""
    spec: str
    comp: object = None
    step: object = None
    facts: tuple = (None, None)
    times: list = field(default_factory=list)
    error: object = None
    seconds: float = 0.0
    load_before: float = 0.0


def _every_scheme(a, hvd, build, release):
    """Every ``--scheme`` on every rank, in order.  One round (``--rounds 1``):
    each scheme built, warmed up and timed before the next is built, then
    released.  More rounds: every scheme built and warmed up first, then the
    rounds of ``--steps`` timed steps each, the schemes in turn (every other
    round in reverse), so that the machine's drifting load falls on every
    scheme alike.  Rank 0 writes the rows so far after each scheme's row."""
    rows, live = [], []
    for spec in a.scheme:
        one = _Live(spec, load_before=os.getloadavg()[0])
        _run_part(one, lambda: _build_and_warm(a, build, one))
        live.append(one)
        if a.rounds == 1:
            _run_part(one, lambda: one.times.extend(_clock(one.step, a.steps)))
            _finish(a, hvd, one, rows)
            release()
    for r in range(a.rounds if a.rounds > 1 else 0):
        for one in (live if r % 2 == 0 else live[::-1]):
            if one.error is None:
                _run_part(one, lambda: one.times.extend(_clock(one.step, a.steps)))
    if a.rounds > 1:
        for one in live:
            _finish(a, hvd, one, rows)
        release()
    return 0


def _build_and_warm(a, build, one):
    one.comp, one.step, *facts = build(one.spec)
    one.facts = tuple(facts)
    one.times.extend(_clock(one.step, _untimed_steps(a, one.comp)))


def _run_part(one, fn):
    """Run a part of a scheme on this rank, adding its seconds; an error stops
    the scheme (recorded in its row), and the next scheme still runs."""
    if one.error is not None:
        return
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:  # recorded in the scheme's row
        one.error = f"{type(e).__name__}: {e}"
    one.seconds += time.monotonic() - t0


def _finish(a, hvd, one, rows):
    """The scheme's row gathered from every rank; rank 0 appends and writes it."""
    row = _scheme_row(a, hvd, one.spec, one.comp, None if one.error else one.times, one.facts, one.error)
    one.comp = one.step = None
    if hvd.rank() == 0:
        row.update(scheme_s=one.seconds, loadavg_1m_before=one.load_before, loadavg_1m_after=os.getloadavg()[0])
        rows.append(row)
        with open(a.out, "w") as f:
            json.dump(rows, f)


def _scheme_row(a, hvd, spec, comp, times, model_facts, error):
    """Every rank's clocks (or errors) gathered; the scheme's row."""
    everyone = hvd.allgather_object((times, error))
    errors = [f"rank {r}: {e}" for r, (_, e) in enumerate(everyone) if e]
    if errors:
        return {"model": a.model, "size": a.size, "framework": a.framework, "workers": hvd.size(),
                "scheme": spec, "error": "; ".join(errors)}
    slowest = [max(ts) for ts in zip(*(t for t, _ in everyone))]
    auto = _auto_startup(comp, slowest, a.framework) if _is_auto(comp) else None
    untimed = len(slowest) - a.steps * a.rounds
    timed = slowest[untimed:]
    median = statistics.median(timed)
    tensors, weights = model_facts
    return {"model": a.model, "size": a.size, "framework": a.framework, "workers": hvd.size(), "scheme": spec,
            "batch": a.batch, "threads": a.threads, "steps": a.steps, "rounds": a.rounds, "untimed_steps": untimed,
            "median_step_s": median, "round_median_step_s": [statistics.median(timed[i:i + a.steps])
                                                             for i in range(0, len(timed), a.steps)],
            "first_step_s": slowest[0],
            "startup_s": max(0.0, sum(slowest[:untimed]) - untimed * median), "step_s_all": slowest,
            "tensors": len(tensors), "params": sum(_numel(s) for s in tensors), "initial_weights_sum": weights,
            "hvdc_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("HVDC_")},
            "plan": _plan_counts(comp) if auto is not None else None, "auto_startup": auto,
            "auto_state": _auto_state(comp) if auto is not None else None}


def _numel(shape):
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _plan_counts(comp):
    """Auto's plan in force: ``{candidate label: tensors}``."""
    return _label_counts(comp.current_plan())


def _label_counts(labels):
    """``{key: candidate label}`` as ``{candidate label: tensors}``."""
    counts = {}
    for label in labels.values():
        counts[label] = counts.get(label, 0) + 1
    return counts


def _auto_startup(comp, slowest, framework):
    """What Auto's start cost: this rank's seconds in its probes (the early
    one, before the first step, also alone), codec timings (at the trace in
    TensorFlow, with their agreement over ranks there) and decision, its
    calibration steps, and the steps before the plan in force at the end with
    their seconds (PyTorch: the trial plans' steps included; TensorFlow, where that plan asked for a retrace: up to the
    step traced with the plan's codecs, which runs it)."""
    state = comp.plan_state
    seconds = dict(state.check_seconds or {})
    retraced = framework == "tensorflow" and len(state.history) - 1 in seconds.get("retraced_plans", ())
    final = state.history[-1][0] + retraced if state.history else len(slowest)
    ran = [t for t in state.trials_run() if t["start"] is not None]
    if ran:  # a pick that is the last trial's plan stays in force from that trial's start
        final = max(final, ran[-1]["start"] + comp.trial_steps)
    return {"probe_s": seconds.get("early_probe", 0.0) + seconds.get("probe", 0.0),
            "early_probe_s": seconds.get("early_probe"), "trace_agree_s": seconds.get("trace_agree"),
            "codec_s": seconds.get("codecs", 0.0) + seconds.get("trace_codecs", 0.0),
            "decide_s": seconds.get("decide"), "retrace_request_s": seconds.get("retrace_request"),
            "retraced": retraced,
            "calibration_steps": comp.calibration_steps,
            "steps_before_final_plan": final, "steps_before_final_plan_s": sum(slowest[:final]),
            "plans_adopted": len(state.history), "trial_plans_run": len(state.trials_run()),
            "link": _link_fields(state.link),
            # the first compress's probe: what Auto plans its trace and warmup from (TensorFlow
            # times no codec where it says no compressed candidate can pay)
            "early_link": _link_fields(state.early_link),
            "pair_swap_bytes": state.pair_swap_bytes, "backward_s": state.backward_s, "step_s": state.step_s,
            "codec_ns_per_element": _codec_ns_per_element(state), "trials": _trials(state)}


def _link_fields(link):
    return None if link is None else {"latency_s": link.latency_s, "bytes_per_s": link.bytes_per_s}


def _trials(state):
    """The last decision's trial plans as this rank saw them: each plan's
    tensors per candidate, the communication it ran from, its predicted
    step, this rank's timed step (``local_s``), the step averaged over ranks
    (``step_s``, what the pick compares) and whether it was kept (``picked``)."""
    return [{"plan": _label_counts(t["labels"]), "start": t["start"], "predicted_s": t["predicted_s"],
             "local_s": t["local_s"], "step_s": t["step_s"], "before": bool(t.get("before")),
             "picked": i == state.trial_pick} for i, t in enumerate(state.trials)]


def _auto_state(comp):
    """What rank 0's Auto planner saw at its last decision, compact enough to
    keep (``models_replay`` replays the decision with it): the tensors, the
    candidates, each tensor's codec seconds in the candidates' order (None:
    not usable), the fitted link, the backward span, the calibration step,
    the host, ``min_gain`` and the plan in force (``{key: label}``)."""
    from dataclasses import asdict
    state = comp.plan_state
    labels = [c.label for c in comp.candidates]
    return {"candidates": labels, "tensors": {k: [n, list(s)] for k, (n, s) in state.tensors.items()},
            "codec_s": {k: [row.get(label) for label in labels] for k, row in state.codec_s.items()},
            "link": None if state.link is None else [state.link.latency_s, state.link.bytes_per_s],
            "backward_s": state.backward_s, "step_s": state.step_s, "machine": asdict(state.machine),
            "min_gain": comp.min_gain, "plan": comp.current_plan()}


def _codec_ns_per_element(state):
    """Per candidate, the median over the tensors timed of its measured codec
    cost per element (ns).  A model's many small tensors, whose fixed cost
    dominates, set the median, so it overstates what a large tensor costs an
    element: a record of the run, not ``codec_costs`` to replay a plan with."""
    per = {}
    for key, row in state.codec_s.items():
        numel = state.tensors.get(key, (0,))[0]
        for label, seconds in row.items():
            if numel and label != "none":
                per.setdefault(label, []).append(1e9 * seconds / numel)
    return {label: statistics.median(v) for label, v in sorted(per.items())}


def main(argv=None):
    from .architectures import ARCHITECTURES, SIZES
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--framework", choices=["torch", "tensorflow"], default="torch")
    ap.add_argument("--model", choices=ARCHITECTURES, required=True)
    ap.add_argument("--size", choices=SIZES, default="full")
    ap.add_argument("--scheme", action="append", required=True, help="repeated: the schemes, run in turn")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5, help="timed steps a scheme a round")
    ap.add_argument("--rounds", type=int, default=1, help="rounds of timed steps, the schemes alternating")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    add_worker_argument(ap)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    pin_if_asked(a)
    return run_torch(a) if a.framework == "torch" else run_tf(a)


if __name__ == "__main__":
    raise SystemExit(main())
