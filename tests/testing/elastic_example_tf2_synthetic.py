"""Worker of tests/testing/test_elastic_examples.py, shaped like Horovod's
``examples/elastic/tensorflow2/tensorflow2_synthetic_benchmark_elastic.py``:

    python elastic_example_tf2_synthetic.py HOSTS_FILE STAYING LEAVING {kill,nokill,kill_only} [stall_reset]

* one module-level ``@tf.function`` step without arguments, reading its batch
  from variables, that builds its compressions inside the trace and reduces
  through ``hvd.DistributedGradientTape``;
* that step runs once before the elastic state exists (to make the
  optimizer's variables), and again in a reset callback, as Horovod's Keras
  example does, so that a joining worker's first step meets the survivors';
* ``hvd.elastic.run`` is decorated before the state and ``register``;
* ``hvd_compress.elastic.register(state)`` adopts the compressors the first
  step used.

Three tiny regressions in one Keras model, one tape each: TopK(0.01),
PowerSGD(4), Int8 two-phase; ``op=hvd.Sum``, plain SGD.  Membership schedule
and ledger: tests/testing/elastic_ledger.py.  Rank 0 prints ``ELASTIC_RESULT``.

``stall_reset`` (scripts/elastic_kill_bound.py): the worker on the first
staying host never finishes its reset after a failure (Horovod's ``init``
sleeps), to show that hvd_compress's reset bound ends the job with its error.
"""
import os
import signal
import sys
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import horovod.tensorflow as hvd  # noqa: E402
import hvd_compress  # noqa: E402
from elastic_ledger import (MembershipSchedule, conservation, print_result, recording_state,  # noqa: E402
                            tf_folded_residuals)

HOSTS_FILE, STAYING, LEAVING = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
SCHEDULE = MembershipSchedule(HOSTS_FILE, STAYING, LEAVING, steps=6, mode=sys.argv[4])
HOST = os.environ.get("HOROVOD_HOSTNAME", "?")
KINDS = ("topk", "powersgd", "int8")
LR, D_IN, D_OUT, BATCH = 0.05, 64, 16, 32

hvd.init()
if sys.argv[5:] == ["stall_reset"] and HOST == STAYING[0].split(":")[0]:
    import horovod.tensorflow.elastic as hvd_tf_elastic
    hvd_tf_elastic.init = lambda: time.sleep(10 ** 6)  # Horovod's reset calls shutdown(), then this
TEACHER = np.random.default_rng(0).standard_normal((D_IN, D_OUT)).astype(np.float32)


#: the first compressor of each kind built (by the first trace): the one that keeps the state,
#: which later traces' compressors hand their calls to
FIRST_BUILT = {}


def compression_for(kind):
    """Built inside the traced step, as Horovod's example builds its own."""
    if kind == "topk":
        compression = hvd_compress.TopK(0.01)
    elif kind == "powersgd":
        compression = hvd_compress.PowerSGD(4)
    else:
        compression = hvd_compress.Int8(transport="two_phase")
    FIRST_BUILT.setdefault(kind, compression)
    return compression


class ThreeRegressions(tf.keras.Model):
    def __init__(self):
        super().__init__()
        for i, kind in enumerate(KINDS):
            init = tf.keras.initializers.GlorotUniform(seed=i + 1)
            setattr(self, kind, tf.keras.layers.Dense(D_OUT, kernel_initializer=init))

    def call(self, x):
        return [getattr(self, kind)(x) for kind in KINDS]


model = ThreeRegressions()
model(tf.zeros([1, D_IN]))
opt = tf.keras.optimizers.SGD(LR)
X = tf.Variable(tf.zeros([BATCH, D_IN]), trainable=False)
Y = tf.Variable(tf.zeros([BATCH, D_OUT]), trainable=False)
#: per kind, this rank's float64 sum of the gradients it computed (never broadcast)
GRAD_SUMS = {k: [tf.Variable(tf.zeros(v.shape, tf.float64), trainable=False)
                 for v in getattr(model, k).trainable_variables] for k in KINDS}
INITIAL = {k: [v.numpy() for v in getattr(model, k).trainable_variables] for k in KINDS}


@tf.function
def train_one_batch():
    updates = []
    for kind in KINDS:
        compression = compression_for(kind)
        variables = getattr(model, kind).trainable_variables
        with tf.GradientTape(persistent=True) as tape:
            loss = tf.reduce_mean(tf.square(getattr(model, kind)(X) - Y))
        for total, g in zip(GRAD_SUMS[kind], tape.gradient(loss, variables)):
            total.assign_add(tf.cast(g, tf.float64))
        tape = hvd.DistributedGradientTape(tape, compression=compression, op=hvd.Sum)
        updates += zip(tape.gradient(loss, variables), variables)
    opt.apply_gradients(updates)  # one optimizer over every variable, in one call


def load_batch(seed):
    g = np.random.default_rng(seed)
    x = g.standard_normal((BATCH, D_IN)).astype(np.float32)
    X.assign(x)
    Y.assign(x @ TEACHER + 0.01 * g.standard_normal((BATCH, D_OUT)).astype(np.float32))


def step_outside_the_loop():
    """The step before the state (and in the reset callback): data of its own."""
    load_batch(7_000_003 + hvd.rank())
    train_one_batch()


def after_reset():
    """The survivors' reset callback: when (to time a killed worker's cost), then the step."""
    print(f"ELASTIC_RESET host={HOST} size={hvd.size()} t={time.time():.3f}", flush=True)
    step_outside_the_loop()


step_outside_the_loop()  # as Horovod's example: the optimizer's variables exist before the state


@hvd.elastic.run
def train(state):
    while not SCHEDULE.done(state):
        if SCHEDULE.killing_now(state, HOST):
            print(f"ELASTIC_KILL host={HOST} step={state.step} t={time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # the others wait for this rank in the step's exchanges
        load_batch(1_000_003 * state.step + hvd.rank())
        train_one_batch()
        state.step += 1
        state.sizes = state.sizes + [hvd.size()]
        SCHEDULE.advance(state, hvd.size(), hvd.rank())
        time.sleep(0.05)
        state.commit()


def grad_sums_now():
    return {k: [g.numpy() for g in GRAD_SUMS[k]] for k in KINDS}


def put_back(saved):
    for k in KINDS:
        for g, value in zip(GRAD_SUMS[k], saved[k]):
            g.assign(value)


def records_of_this_rank():
    return {k: {"grads": [g.numpy().reshape(-1) for g in GRAD_SUMS[k]], "residuals": residuals(k)} for k in KINDS}


def residuals(kind):
    """This rank's residual of each variable of ``kind``, two-phase chunk folded in (numpy)."""
    return tf_folded_residuals(COMPRESSIONS[kind].adapters["tensorflow"], getattr(model, kind).trainable_variables,
                               hvd.rank(), hvd.size())


RecordingState = recording_state(hvd.elastic.TensorFlowKerasState, hvd.allgather_object,
                                 hvd_compress.elastic.PROCESS_ID, records_of_this_rank, grad_sums_now, put_back)
state = RecordingState(model, opt, step=0, phase=0, phase_step=0, sizes=[], records={}, members=[])
state.saved_grads = grad_sums_now()
state.register_reset_callbacks([after_reset])
hvd_compress.elastic.register(state)
COMPRESSIONS = FIRST_BUILT
train(state)

final = {k: [v.numpy() for v in getattr(model, k).trainable_variables] for k in KINDS}
flat = tf.constant(np.concatenate([w.reshape(-1) for k in KINDS for w in final[k]])[None])
gathered = hvd.allgather(flat, name="test.final_weights").numpy()
if hvd.rank() == 0:
    result = {"size": hvd.size(), "steps": state.step, "sizes": state.sizes,
              "identical": all(np.array_equal(gathered[0], row) for row in gathered), "kinds": {}}
    for k in KINDS:
        entry = conservation(INITIAL[k], final[k], LR, state.records, state.members, k)
        entry["lost_reported"] = COMPRESSIONS[k].stats.lost()
        result["kinds"][k] = entry
    print_result(result)
