"""hvd_compress.Auto under real horovodrun in TensorFlow 2 (scripts/run_tests.sh
runs it with Gloo at 2 processes): the stock ``hvd.DistributedGradientTape`` in a
``tf.function``, the legacy ``hvd.DistributedOptimizer`` around
``tf.compat.v1.train.GradientDescentOptimizer``, and
``horovod.tensorflow.keras.DistributedOptimizer`` under ``model.fit`` (tf_keras).

Every rank runs every test in the same order and issues the same
collectives before it asserts anything.  Where a test needs a given link, the
link probe (``hvd_compress.auto.tf_auto.probe_link``) is replaced by timings computed from the
cost model, identically on every rank, and the codec costs are fixed
(``Auto(codec_costs=auto_links.CODEC_COSTS)``), so no decision a test checks
depends on how fast this machine runs; the first test alone measures
everything for real and checks only that the ranks agree.  The agreement
collectives and the training collectives are the real ones.
"""
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import json  # noqa: E402
import tempfile  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import horovod.tensorflow as hvd  # noqa: E402
import horovod.tensorflow.keras as hvdk  # noqa: E402

import hvd_compress  # noqa: E402
from hvd_compress.auto import tf_auto as auto_tf  # noqa: E402
from hvd_compress.auto import Link  # noqa: E402
from hvd_compress.auto.planner import PlanMismatchError  # noqa: E402
from hvd_compress.cross_rank import stable_hash  # noqa: E402

import auto_links  # noqa: E402
from auto_links import CODEC_COSTS  # noqa: E402
from tf_linear_training import dataset, flat_weights, mlp, mse_tape_step  # noqa: E402

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
SPECS = {"w": (64, 512), "b": (8,)}  # the bias: latency-bound at any rate here
KEYS = {"w": "w:0", "b": "b:0"}
FAST = Link(latency_s=1e-6, bytes_per_s=1e12)
SLOW = Link(latency_s=1e-4, bytes_per_s=1e6)  # 8 Mbit/s: compressing the 128 KB weight pays


def grads_at(step):
    """This rank's gradient of each variable at a step (different per rank and step)."""
    rng = np.random.default_rng(1000 * step + RANK)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in SPECS.items()}


class Injected:
    """Variables starting at 0 and one traced step whose gradient is exactly
    grads_at(step) (loss sum(v * G)); Horovod sums (op=Sum), SGD with lr 1
    applies it, so each variable is minus the sum of what was applied.
    ``legacy``: Horovod's legacy DistributedOptimizer around the TF1 SGD
    instead of DistributedGradientTape."""

    def __init__(self, auto, specs=SPECS, legacy=False):
        self.names = list(specs)
        self.vars = [tf.Variable(tf.zeros(specs[n]), name=n) for n in self.names]
        opt = hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer(1.0), compression=auto,
                                       op=hvd.Sum) if legacy else None

        def loss_of(grads):
            return tf.add_n([tf.reduce_sum(v * g) for v, g in zip(self.vars, grads)])

        @tf.function
        def step_fn(grads):
            if legacy:
                opt.apply_gradients(opt.compute_gradients(lambda: loss_of(grads), var_list=self.vars))
                return
            with tf.GradientTape() as tape:
                loss = loss_of(grads)
            tape = hvd.DistributedGradientTape(tape, compression=auto, op=hvd.Sum)
            for v, g in zip(self.vars, tape.gradient(loss, self.vars)):
                v.assign_sub(g)
        self.step_fn = step_fn

    def step(self, step):
        g = grads_at(step)
        self.step_fn([tf.constant(g[n]) for n in self.names])


def links(sequence, monkeypatch):
    """Make the i-th link probe report the i-th link of ``sequence`` (the last one after)."""
    return auto_links.links(sequence, monkeypatch, auto_tf, SIZE)


def same_on_all_ranks(obj, name):
    h = stable_hash(json.dumps(obj, sort_keys=True, default=str))
    hashes = hvd.allgather(tf.constant([h], tf.int64), name=name).numpy().tolist()
    return all(x == hashes[0] for x in hashes)


def applied_schemes(auto):
    return {k: v["scheme"] for k, v in auto.stats.per_tensor().items()}


def expected_schemes(auto, plan):
    by_label = {c.label: c.scheme.name for c in auto.candidates}
    return {k: by_label[label] for k, label in plan.items()}


def test_plans_are_identical_on_all_ranks_and_applied():
    """Real measurements (link probes included): ranks measure different
    numbers, yet apply one plan, the one rank 0 chose from the averages."""
    auto = hvd_compress.Auto(calibration_steps=2, recheck_every=0, probe_numels=(256, 1 << 16))
    run = Injected(auto)
    for step in range(1, 5):
        run.step(step)
    plan = auto.current_plan()
    assert same_on_all_ranks(plan, "test.autotf.plan_same")
    weights = [float(tf.reduce_sum(v)) for v in run.vars]
    assert same_on_all_ranks(weights, "test.autotf.params_same")
    assert sorted(plan) == sorted(KEYS.values()) and len(auto.plan_state.history) == 1
    assert auto.plan_state.history[0][0] == 2  # decided after two dense communications
    assert applied_schemes(auto) == expected_schemes(auto, plan)
    assert auto.plan_state.step_s is not None and auto.plan_state.step_s > 0  # measured from the calibration steps
    assert all(auto.plan_state.codec_s[k] for k in plan)  # every tensor's candidates timed
    table = auto.describe()
    assert "w:0" in table and "64x512" in table and plan["w:0"] in table


def test_slow_link_compresses_the_weight_and_fast_link_does_not(monkeypatch):
    for link, compressed in ((SLOW, True), (FAST, False)):
        links([link], monkeypatch)
        auto = hvd_compress.Auto(codec_costs=CODEC_COSTS, calibration_steps=1, recheck_every=0)
        run = Injected(auto)
        for step in range(1, 4):  # decided at step 2; step 3 runs the plan's own trace
            run.step(step)
        plan = auto.current_plan()
        assert (plan["w:0"] != "none") == compressed, auto.describe()
        # the fixed costs, not timings: 1 ns an element (averaged over ranks: rounding only)
        codec_s = auto.plan_state.codec_s
        assert codec_s["w:0"]["Int8"] == pytest.approx(64 * 512 * 1e-9, rel=1e-9), codec_s
        # the 8-element bias stays dense or joins the collectives the weight pays for, never a
        # transport of its own: at 1 MB/s its 32 bytes cost about what a collective entry does
        # (cost_model.ENTRY_S), so the margin decides (2 ranks: it joins; 3: dense)
        assert plan["b:0"] in ("none", plan["w:0"]), auto.describe()
        assert applied_schemes(auto) == expected_schemes(auto, plan)


def test_the_predicted_plan_is_traced_and_adopted_without_a_retrace(monkeypatch):
    """A slow link from the first trace on: the early probe and the codec costs
    predict a lossy mode for the weight, the first trace holds it, and the
    first decision adopts a lossy plan in that trace, without tracing again."""
    links([SLOW], monkeypatch)
    auto_links.early_link(SLOW, monkeypatch, auto_tf, SIZE)
    auto = hvd_compress.Auto(codec_costs=CODEC_COSTS, calibration_steps=1, recheck_every=0)
    run = Injected(auto)
    run.step(1)
    tf_run = auto.adapter_for("tensorflow").run
    traces = tf_run.traces
    for step in range(2, 5):  # decided at step 2
        run.step(step)
    plan = auto.current_plan()
    assert plan["w:0"] != "none", auto.describe()
    assert tf_run.traces == traces and tf_run.retrace_asked is None
    assert "retrace_request" not in auto.plan_state.check_seconds and auto.plan_state.early_link is not None
    labels = [c.label for c in auto.candidates]
    assert labels.index(plan["w:0"]) + 1 in tf_run.traced["w:0"]
    assert applied_schemes(auto) == expected_schemes(auto, plan)
    assert same_on_all_ranks(plan, "test.autotf.predicted_plan")


def test_ranks_tracing_different_tensors_raise_on_every_rank(monkeypatch):
    """Rank 1 reports another class for the codec timing it agrees at the
    trace: every rank raises PlanMismatchError at the trace, none hangs."""
    auto = hvd_compress.Auto(calibration_steps=1, recheck_every=0, exclude=("FP16", "TopK(0.1)", "TopK(0.01)"))
    if RANK == 1:
        row = auto_tf.class_timing_row
        monkeypatch.setattr(auto_tf, "class_timing_row", lambda cls, numel, seconds: row(cls, numel + 1, seconds))
    run = Injected(auto, {"only": (8, 4)})
    with pytest.raises(Exception, match="ranks traced different tensors") as err:  # TF wraps it in a StagingError
        run.step_fn([tf.ones([8, 4])])
    assert PlanMismatchError.__name__ in str(err.value)
    assert same_on_all_ranks("after", "test.autotf.after_trace_mismatch")  # the ranks are still in step


def test_ranks_tracing_different_modes_raise_at_the_trace(monkeypatch):
    """Rank 1 predicts, and traces, Int8 where rank 0 traces none only (which
    hands Horovod the tensor itself, where a switch runs its own collectives):
    every rank raises PlanMismatchError at the trace, before the step runs."""
    links([FAST], monkeypatch)
    auto_links.early_link(FAST, monkeypatch, auto_tf, SIZE)
    if RANK == 1:
        monkeypatch.setattr(auto_tf, "predict_label", lambda *a: "Int8")
    auto = hvd_compress.Auto(codec_costs=CODEC_COSTS, calibration_steps=1, recheck_every=0)
    run = Injected(auto, {"only": (8, 4)})
    with pytest.raises(Exception, match="different plans") as err:
        run.step_fn([tf.ones([8, 4])])
    assert "PlanMismatchError" in repr(err.value) or "PlanMismatchError" in str(err.value)
    assert same_on_all_ranks("after", "test.autotf.after_modes_mismatch")


def test_a_forced_disagreement_raises_on_every_rank(monkeypatch):
    """Rank 1 reads the broadcast plan wrongly: every rank raises PlanMismatchError, none hangs."""
    links([FAST], monkeypatch)
    auto = hvd_compress.Auto(codec_costs=CODEC_COSTS, calibration_steps=1, recheck_every=0)
    auto_links.misread_plan_on(1, RANK, auto, monkeypatch)
    run = Injected(auto, {"only": (8, 4)})  # one tensor: nothing else in flight when the error comes
    run.step_fn([tf.ones([8, 4])])
    with pytest.raises(Exception, match="different plans") as err:
        run.step_fn([tf.ones([8, 4])])
    assert "PlanMismatchError" in repr(err.value) or "PlanMismatchError" in str(err.value)
    assert same_on_all_ranks("after", "test.autotf.after_mismatch")  # the ranks are still in step


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_error_feedback_survives_replans(monkeypatch, momentum):
    """fast -> slow -> fast: the weight's scheme changes to a lossy one and
    back, and at every step, summed over ranks,
    sum(what was applied) + residuals == sum(gradients).  With ``momentum=``
    the law holds for the velocities ``u <- m u + g``, carried across modes."""
    probes = links([FAST, SLOW, FAST], monkeypatch)
    # FP16 left out: Horovod sums its payloads in half precision, a rounding
    # after what was sent that no error feedback can see
    auto = hvd_compress.Auto(calibration_steps=2, recheck_every=3, replan_threshold=0.05, exclude=("FP16",),
                             codec_costs=CODEC_COSTS,
                             momentum=momentum)
    run = Injected(auto)
    worst = worst_conservation_error(auto, run, range(1, 12), momentum, "replans")
    assert len(probes) == 3  # decided at communication 3, re-checked at 6 and 9
    labels = [choices["w:0"].label for _, choices, _ in auto.plan_state.history]
    assert len(labels) == 3 and labels[0] == labels[2] == "none", labels
    assert labels[1] != "none", labels
    # back on none, the residual was sent out in full in one step and none keeps it at zero
    assert float(tf.reduce_max(tf.abs(auto.adapter_for("tensorflow").residuals["w:0"]))) == 0.0
    assert worst < 1e-3, f"conservation broken by {worst} under {labels}"
    assert same_on_all_ranks(auto.current_plan(), "test.autotf.replan_same")


def worst_conservation_error(auto, run, steps, momentum, tag, after_step=lambda step: None):
    """Run ``steps`` of a fresh ``Injected`` and return the largest deviation,
    over the steps and elements, of sum over ranks of (what was applied +
    residual held) from the sum of the velocities ``u <- m u + g``, relative
    to that sum's largest element where it exceeds 1; ``after_step(step)``
    runs after each step."""
    total = {n: np.zeros(s, np.float32) for n, s in SPECS.items()}
    velocity = {n: np.zeros(s, np.float32) for n, s in SPECS.items()}
    worst = 0.0
    for step in steps:
        run.step(step)
        residuals = auto.adapter_for("tensorflow").residuals
        for (name, g), v in zip(grads_at(step).items(), run.vars):
            velocity[name] = momentum * velocity[name] + g
            total[name] += velocity[name]
            mine = residuals.get(KEYS[name])  # a residual exists once the lossy modes are traced
            mine = np.zeros(v.shape, np.float32) if mine is None else mine.numpy().reshape(v.shape)
            held = hvd.allreduce(tf.constant(mine), op=hvd.Sum, name=f"test.autotf.{tag}.res.{name}.{step}")
            want = hvd.allreduce(tf.constant(total[name]), op=hvd.Sum, name=f"test.autotf.{tag}.grad.{name}.{step}")
            worst = max(worst, float(tf.reduce_max(tf.abs(-v + held - want))) / max(1.0, float(tf.reduce_max(tf.abs(want)))))
        after_step(step)
    return worst


@pytest.mark.parametrize("warmup_with, exclude", [("Int8", ("FP16",)), ("FP16", ())])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_a_quantized_warmup_runs_its_quantizer_in_the_first_trace_and_keeps_every_gradient(monkeypatch, momentum,
                                                                                            warmup_with, exclude):
    """A warmup on a link where dense clearly loses (the early probe at the
    first trace): the weight runs ``warmup_with``'s quantizer with error
    feedback through the warmup's 4 steps, the bias dense; the first decision
    adopts a lossy plan in the same trace; at every step, summed over ranks,
    sum(what was applied) + residuals == sum(velocities)."""
    links([SLOW], monkeypatch)
    auto_links.early_link(SLOW, monkeypatch, auto_tf, SIZE)
    auto = hvd_compress.Auto(calibration_steps=2, warmup_steps=4, warmup_with=warmup_with, recheck_every=0,
                             exclude=exclude, codec_costs=CODEC_COSTS, momentum=momentum)
    run = Injected(auto)
    in_warmup = {}

    def record(step):
        if step == 4:  # the warmup's last step: the first plan starts at the next communication
            in_warmup.update(applied_schemes(auto), planned=bool(auto.plan_state.history))
    worst = worst_conservation_error(auto, run, range(1, 9), momentum, "warmup", record)
    assert in_warmup == {"w:0": warmup_with, "b:0": "NoCompression", "planned": False}, in_warmup
    assert auto.plan_state.provisional == {"w:0": warmup_with, "b:0": "none"}
    tf_run = auto.adapter_for("tensorflow").run
    plan = auto.current_plan()
    assert plan["w:0"] != "none" and tf_run.retrace_asked is None, auto.describe()
    assert applied_schemes(auto) == expected_schemes(auto, plan)
    # FP16 travels by Horovod's half-precision allreduce, which rounds the sum
    # itself (2^-11 of it, a step), beyond any residual's reach
    tol = 2e-3 if warmup_with == "FP16" else 1e-3
    assert worst < tol, f"conservation broken by {worst} ({in_warmup}, then {plan})"
    assert same_on_all_ranks(plan, "test.autotf.warmup_plan")


@pytest.mark.parametrize("probe_name", ["probe_early", "probe_link"])
def test_a_probe_repeats_a_size_alike_on_every_rank_whatever_each_read(monkeypatch, probe_name):
    """As in PyTorch: rank 1's clock reads every allreduce of a probe (the
    early one or a decision's) as 1 s, rank 0's as what it took; both ranks
    time each size once."""
    names, prefix, seconds = auto_links.probe_with_clocks_apart(hvd, auto_tf, probe_name, monkeypatch)
    assert names == [f"{prefix}.{n}.{i}" for n in (1024, 4096) for i in ("0", "first")], names
    assert len(seconds) == 2 and (hvd.rank() != 1 or seconds == [1.0, 1.0]), seconds
    assert same_on_all_ranks(names, f"test.autotf.probe_names.{probe_name}")


def test_legacy_optimizer(monkeypatch):
    """hvd.DistributedOptimizer(tf.compat.v1.train.GradientDescentOptimizer): slow
    link then fast, the weight goes lossy and back, nothing is lost."""
    links([SLOW, FAST], monkeypatch)
    auto = hvd_compress.Auto(codec_costs=CODEC_COSTS, calibration_steps=1, recheck_every=2, exclude=("FP16",))
    run = Injected(auto, legacy=True)
    total = {n: np.zeros(s, np.float32) for n, s in SPECS.items()}
    for step in range(1, 6):
        run.step(step)
        for name, g in grads_at(step).items():
            total[name] += g
    labels = [choices["w:0"].label for _, choices, _ in auto.plan_state.history]
    residual = auto.adapter_for("tensorflow").residuals["w:0"].numpy().reshape(SPECS["w"])
    want = hvd.allreduce(tf.constant(total["w"]), op=hvd.Sum, name="test.autotf.legacy_grad").numpy()
    held = hvd.allreduce(tf.constant(residual), op=hvd.Sum, name="test.autotf.legacy_res").numpy()
    assert labels[0] != "none" and labels[-1] == "none", labels
    assert np.abs(-run.vars[0].numpy() + held - want).max() < 1e-3
    assert same_on_all_ranks(auto.current_plan(), "test.autotf.legacy_plan")


def trained_to_a_lossy_plan(monkeypatch, **kwargs):
    """An Auto trained on the slow link until its plan compresses the weight,
    and a tf.train.Checkpoint of it: (its kwargs, it, its run, the checkpoint's path)."""
    links([SLOW], monkeypatch)
    kwargs = dict(codec_costs=CODEC_COSTS, calibration_steps=1, exclude=("FP16",), **kwargs)
    auto = hvd_compress.Auto(**kwargs)
    run = Injected(auto)
    for step in range(1, 4):
        run.step(step)
    assert auto.current_plan()["w:0"] != "none", auto.describe()
    path = tf.train.Checkpoint(hvdc=auto.tf_checkpointable(), v=run.vars).save(
        os.path.join(tempfile.mkdtemp(prefix=f"autotf{RANK}_"), "ck"))
    return kwargs, auto, run, path


def test_resume_from_a_tf_checkpoint_keeps_the_plan(monkeypatch):
    """tf.train.Checkpoint(hvdc=auto.tf_checkpointable()) restored before the
    first trace: the plan, the modes and the residuals come back, and the
    resumed job does not re-calibrate (its link probe would say otherwise)."""
    kwargs, auto, run, path = trained_to_a_lossy_plan(monkeypatch, recheck_every=50)
    plan, history = auto.current_plan(), auto.plan_state.history
    assert plan["w:0"] != "none"
    residual = auto.adapter_for("tensorflow").residuals["w:0"].numpy()
    # state_dict() carries the plan and the modes too
    loaded = hvd_compress.Auto(**kwargs)
    loaded.load_state_dict(auto.state_dict())
    assert loaded.current_plan() == plan and json.loads(loaded.state_dict()["auto_plan"])["history"]

    probes = links([FAST], monkeypatch)
    resumed = hvd_compress.Auto(**kwargs)
    run2 = Injected(resumed)
    tf.train.Checkpoint(hvdc=resumed.tf_checkpointable(), v=run2.vars).restore(path).assert_existing_objects_matched()
    assert resumed.current_plan() == plan
    assert [(s, v) for s, _, v in resumed.plan_state.history] == [(s, v) for s, _, v in history]
    run2.step(4)
    restored = resumed.adapter_for("tensorflow")
    assert restored.state_module.steps["w:0"].numpy() == 4
    assert probes == [] and resumed.current_plan() == plan
    assert applied_schemes(resumed) == expected_schemes(resumed, plan)
    # the restored residual went into step 4's error feedback: it is no longer the saved one
    assert not np.array_equal(restored.residuals["w:0"].numpy(), residual)
    assert same_on_all_ranks(resumed.current_plan(), "test.autotf.resumed_same")


def op_types(graph):
    """Every op type in ``graph`` and in the functions of its library (the branches)."""
    graph_def = graph.as_graph_def()
    return [n.op for n in graph_def.node] + [n.op for f in graph_def.library.function for n in f.node_def]


def test_the_step_holds_one_host_callback_and_a_switch_only_where_a_lossy_mode_is_traced(monkeypatch):
    """What a trace builds: one host callback a step, shared by every tensor
    (not one a tensor); a tensor traced with ``none`` alone runs it without a
    ``tf.switch_case``.  Fast link: both tensors predicted none, no switch;
    slow link: the weight's predicted lossy mode behind one switch."""
    for name, link in (("fast", FAST), ("slow", SLOW)):
        links([link], monkeypatch)
        auto_links.early_link(link, monkeypatch, auto_tf, SIZE)
        auto = hvd_compress.Auto(codec_costs=CODEC_COSTS, calibration_steps=1, recheck_every=0)
        run = Injected(auto)
        g = grads_at(1)
        ops = op_types(run.step_fn.get_concrete_function([tf.constant(g[n]) for n in run.names]).graph)
        lossy = {k for k, held in auto.adapter_for("tensorflow").run.traced.items() if len(held) > 1}
        assert ops.count("EagerPyFunc") == 1, ops.count("EagerPyFunc")
        assert ops.count("Case") + ops.count("StatelessCase") == len(lossy), lossy
        assert ("w:0" in lossy) == (link is SLOW) and (link is SLOW or not lossy), lossy
        for step in range(1, 4):
            run.step(step)
        assert (auto.current_plan()["w:0"] != "none") == (link is SLOW), auto.describe()
        assert applied_schemes(auto) == expected_schemes(auto, auto.current_plan())
        assert same_on_all_ranks(auto.current_plan(), f"test.autotf.one_callback.{name}")


def test_a_plan_restored_after_the_trace_has_the_step_traced_again(monkeypatch):
    """A job traced on a fast link (none only), then a checkpoint with a
    lossy plan restored into it: the next step takes the plan up, runs none
    where its trace lacks the plan's mode (the residual waits) and asks for
    a retrace; the step after runs the plan."""
    kwargs, auto, run, path = trained_to_a_lossy_plan(monkeypatch, recheck_every=0)
    plan = auto.current_plan()
    residual = auto.adapter_for("tensorflow").residuals["w:0"].numpy()

    links([FAST], monkeypatch)
    auto_links.early_link(FAST, monkeypatch, auto_tf, SIZE)
    resumed = hvd_compress.Auto(**kwargs)
    run2 = Injected(resumed)
    run2.step(1)  # traced before the restore: none only
    tf_run = resumed.adapter_for("tensorflow").run
    assert tf_run.traced["w:0"] == (auto_tf.PLAIN,) and tf_run.retrace_asked is None
    tf.train.Checkpoint(hvdc=resumed.tf_checkpointable(), v=run2.vars).restore(path).assert_existing_objects_matched()
    run2.step(4)
    assert resumed.current_plan() == plan and tf_run.retrace_asked == 1
    assert "w:0" not in resumed.adapter_for("tensorflow").residuals  # none only: the restored residual waits
    run2.step(5)
    assert len(tf_run.traced["w:0"]) > 1 and resumed.current_plan() == plan
    # the restored residual (made at the retrace) went into step 5's error feedback
    assert not np.array_equal(resumed.adapter_for("tensorflow").residuals["w:0"].numpy(), residual)
    assert applied_schemes(resumed) == expected_schemes(resumed, plan)
    assert same_on_all_ranks(resumed.current_plan(), "test.autotf.late_restore_same")


def _shard():
    x, y = dataset(SIZE)
    return x[RANK * 96:(RANK + 1) * 96], y[RANK * 96:(RANK + 1) * 96], x, y


def test_tape_training_of_an_mlp(monkeypatch):
    """An MLP trained through DistributedGradientTape with Auto on a slow
    link: it compresses, re-checks, the loss falls and the replicas stay identical."""
    links([SLOW], monkeypatch)
    auto = hvd_compress.Auto(codec_costs=CODEC_COSTS, calibration_steps=2, recheck_every=4, min_gain=0.0)
    model = mlp(7 + RANK, prefix="tape_")
    hvd.broadcast_variables(model.variables, root_rank=0)
    opt = tf.keras.optimizers.SGD(learning_rate=0.05)
    step_fn = mse_tape_step(model, opt, auto)
    xs, ys, x, y = _shard()
    before = float(tf.reduce_mean(tf.square(model(x) - y)))
    for step in range(12):
        lo = (step % 3) * 32
        step_fn(tf.constant(xs[lo:lo + 32]), tf.constant(ys[lo:lo + 32]))
    after = float(tf.reduce_mean(tf.square(model(x) - y)))
    plan = auto.current_plan()
    everyone = hvd.allgather(flat_weights(model)[None], name="test.autotf.tape_weights").numpy()
    assert same_on_all_ranks(plan, "test.autotf.tape_plan")
    assert np.array_equal(everyone[0], everyone[-1])
    assert plan["tape_fc1/kernel:0"] != "none", auto.describe()
    assert len(auto.plan_state.history) >= 1 and after < 0.7 * before, (before, after)


def test_keras_fit_with_auto(monkeypatch):
    """model.fit with horovod.tensorflow.keras.DistributedOptimizer(compression=Auto)."""
    links([SLOW], monkeypatch)
    auto = hvd_compress.Auto(codec_costs=CODEC_COSTS, calibration_steps=2, recheck_every=5, min_gain=0.0)
    model = mlp(11 + RANK, prefix="fit_")
    opt = hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(learning_rate=0.05), compression=auto)
    model.compile(optimizer=opt, loss="mse")
    xs, ys, x, y = _shard()
    hist = model.fit(xs, ys, batch_size=16, epochs=4, shuffle=False, verbose=0,
                     callbacks=[hvdk.callbacks.BroadcastGlobalVariablesCallback(0)])
    plan = auto.current_plan()
    everyone = hvd.allgather(flat_weights(model)[None], name="test.autotf.fit_weights").numpy()
    assert same_on_all_ranks(plan, "test.autotf.fit_plan")
    assert np.array_equal(everyone[0], everyone[-1])
    assert plan["fit_fc1/kernel:0"] != "none", auto.describe()
    losses = hist.history["loss"]
    assert losses[-1] < 0.7 * losses[0], losses
    assert "Auto plan version" in auto.describe()
