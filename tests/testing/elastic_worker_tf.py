"""Worker of tests/testing/test_elastic_jobs.py (TensorFlow 2, under elastic horovodrun).

    python elastic_worker_tf.py HOSTS_FILE STAYING LEAVING

(as elastic_worker_torch.py)

One linear regression (Keras ``Dense``) in a ``hvd.elastic.TensorFlowKerasState``,
``op=hvd.Sum`` and plain SGD, compressed by one ``hvd_compress.TopK(0.01)``
registered with ``hvd_compress.elastic.register``.  Training is Keras ``fit``
with Horovod's elastic callbacks (``UpdateBatchStateCallback``,
``UpdateEpochStateCallback``, ``CommitStateCallback`` committing every batch)
under ``hvd.elastic.run``; steps alternate between the two TF paths, both
through that compressor (the same residuals): even steps are ``fit``'s batches
(Keras' compiled train function, the Horovod Keras ``DistributedOptimizer``),
odd steps a ``tf.function`` with ``hvd.DistributedGradientTape``, run from a
callback after each batch and built again after each reset.  The membership
schedule and the records are those of elastic_worker_torch.py up to its fault:
host LEAVING removed, then added back, then 12 steps at 3 workers.  No worker is
killed here: in this job one survivor of a SIGKILLed TF worker sees the dead peer
at once while the other waits out HOROVOD_GLOO_TIMEOUT_SECONDS (120 s, set long
enough for a joining TF worker's start-up) in a receive from the first, which
meanwhile waits in the new rendezvous for the same 120 s: the job then fails or
not by a race (1 of 3 runs on the emulated cluster exited 0; see
docs/guide/elastic.md).  The torch job kills a worker.
"""
import json
import os
import sys
import time

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import horovod.tensorflow as hvd  # noqa: E402
import horovod.tensorflow.keras as hvdk  # noqa: E402

import hvd_compress  # noqa: E402
import hvd_compress.elastic  # noqa: E402

HOSTS_FILE, STAYING, LEAVING = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
LR = 0.3
D_IN, D_OUT, BATCH = 64, 16, 32
STEPS_PER_PHASE = 12
MAX_STEPS = 400
HOST = os.environ.get("HOROVOD_HOSTNAME", "?")

hvd.init()
rng = np.random.default_rng(0)
TEACHER = rng.standard_normal((D_IN, D_OUT)).astype(np.float32)
EVAL_X = rng.standard_normal((256, D_IN)).astype(np.float32)
EVAL_Y = EVAL_X @ TEACHER


def batch_of(step, rank):
    g = np.random.default_rng(1_000_003 * step + rank)
    x = g.standard_normal((BATCH, D_IN)).astype(np.float32)
    return x, (x @ TEACHER + 0.01 * g.standard_normal((BATCH, D_OUT))).astype(np.float32)


#: per-rank sums of the gradients this rank computed (float64), outside the model: never broadcast
GRAD_SUMS = []


def add_raw_gradients(net, x, y):
    """This rank's uncompressed gradient of the step, added to GRAD_SUMS (the
    conservation check's reference), from a tape of its own."""
    with tf.GradientTape() as raw:
        loss = tf.reduce_mean(tf.square(net(x) - y))
    for s, g in zip(GRAD_SUMS, raw.gradient(loss, net.trainable_variables)):
        s.assign_add(tf.cast(g, tf.float64))


class Regression(tf.keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = tf.keras.layers.Dense(D_OUT, kernel_initializer=tf.keras.initializers.GlorotUniform(seed=1))

    def call(self, x):
        return self.dense(x)

    def train_step(self, data):
        x, y = data
        add_raw_gradients(self, x, y)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(self(x) - y))
        # Horovod's Keras DistributedOptimizer reduces in compute_gradients, which minimize calls
        self.optimizer.minimize(loss, self.trainable_variables, tape=tape)
        return {"loss": loss}


compression = hvd_compress.TopK(0.01)
model = Regression()
model.build((None, D_IN))
GRAD_SUMS.extend(tf.Variable(tf.zeros(v.shape, tf.float64), trainable=False) for v in model.trainable_variables)
keras_optimizer = hvdk.DistributedOptimizer(tf.keras.optimizers.SGD(LR), compression=compression, op=hvd.Sum)
model.compile(optimizer=keras_optimizer)
# the optimizer's variables (iterations, hyperparameters) exist before the first step, so that a
# joining worker's sync broadcasts the same variables as the survivors' (Horovod's examples run a step)
keras_optimizer.build(model.trainable_variables)
tape_optimizer = tf.keras.optimizers.SGD(LR)
INITIAL = [v.numpy().astype(np.float64) for v in model.trainable_variables]
INITIAL_LOSS = float(np.mean(np.square(model(EVAL_X).numpy() - EVAL_Y)))


def make_tape_step():
    @tf.function
    def tape_step(x, y):
        add_raw_gradients(model, x, y)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y))
        dtape = hvd.DistributedGradientTape(tape, compression=compression, op=hvd.Sum)
        grads = dtape.gradient(loss, model.trainable_variables)
        tape_optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return tape_step


steps = {"tape": make_tape_step()}


def folded_residuals():
    """This rank's residual of every variable (numpy); TopK travels by allgather: no stage-2 residual."""
    adapter = compression.adapters.get("tensorflow")
    out = []
    for v in model.trainable_variables:
        r = adapter.residuals.get(v.name) if adapter is not None else None
        out.append(np.zeros(v.shape.num_elements()) if r is None else r.numpy().astype(np.float64))
    return out


class State(hvd.elastic.TensorFlowKerasState):
    """Horovod's Keras state; each commit also records (by allgather, so that it rolls back
    with the state) every rank's process id, gradient sums and residuals."""

    def save(self):
        entry = {"grads": [g.numpy().reshape(-1) for g in GRAD_SUMS], "residuals": folded_residuals()}
        gathered = hvd.allgather_object((hvd_compress.elastic.PROCESS_ID, entry), name="test.records")
        self.records = {**self.records, **dict(gathered)}
        self.members = [pid for pid, _ in gathered]
        self._saved_grads = [g.numpy() for g in GRAD_SUMS]
        super().save()

    def restore(self):
        super().restore()
        for g, s in zip(GRAD_SUMS, self._saved_grads):
            g.assign(s)


state = State(model, optimizer=keras_optimizer, epoch=0, batch=0, step=0, phase=0, phase_step=0, records={},
              members=[], sizes=[], losses=[])
state._saved_grads = [g.numpy() for g in GRAD_SUMS]
hvd_compress.elastic.register(state, compression)


def on_reset():
    steps["tape"] = make_tape_step()  # traced again for the new world


state.register_reset_callbacks([on_reset])


def hosts_text(with_leaving):
    return "".join(f"{h}\n" for h in STAYING + ([f"{LEAVING}:1"] if with_leaving else []))


def write_hosts(text):
    tmp = HOSTS_FILE + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, HOSTS_FILE)


def advance_phase(state):
    size, since = hvd.size(), state.step - state.phase_step
    waits_for = {0: 3, 2: 2, 4: 3}
    if state.phase in waits_for and size == waits_for[state.phase]:
        state.phase, state.phase_step = state.phase + 1, state.step
    elif state.phase in (1, 3, 5) and since >= STEPS_PER_PHASE:
        state.phase, state.phase_step = state.phase + 1, state.step
        if state.phase == 2 and hvd.rank() == 0:
            write_hosts(hosts_text(with_leaving=False))
        if state.phase == 4 and hvd.rank() == 0:
            write_hosts(hosts_text(with_leaving=True))


def eval_loss():
    return float(np.mean(np.square(model(EVAL_X).numpy() - EVAL_Y)))


def done(state):
    return state.phase >= 6 or state.step >= MAX_STEPS


def finish_step(state):
    state.step += 1
    state.sizes = state.sizes + [hvd.size()]
    state.losses = state.losses + [eval_loss()]
    advance_phase(state)


class TapeStepAndRecords(tf.keras.callbacks.Callback):
    """After each of fit's batches (an even step): that step's records, then the odd step
    through the tape; before Horovod's CommitStateCallback commits both."""

    def on_train_batch_end(self, batch, logs=None):
        finish_step(state)
        if not done(state):
            x, y = (tf.constant(a) for a in batch_of(state.step, hvd.rank()))
            steps["tape"](x, y)
            finish_step(state)
        if done(state):
            self.model.stop_training = True
        time.sleep(0.05)


CALLBACKS = [TapeStepAndRecords(), hvdk.elastic.UpdateBatchStateCallback(state),
             hvdk.elastic.UpdateEpochStateCallback(state), hvdk.elastic.CommitStateCallback(state, batches_per_commit=1)]


@hvd.elastic.run
def train(state):
    while not done(state):
        # fit's batches are the even steps from state.step on (restored after a reset), in order
        first = state.step + state.step % 2
        data = [batch_of(s, hvd.rank()) for s in range(first, MAX_STEPS, 2)]
        model.fit(np.concatenate([x for x, _ in data]), np.concatenate([y for _, y in data]), batch_size=BATCH,
                  epochs=1, shuffle=False, verbose=0, callbacks=CALLBACKS)
    state.commit()


train(state)
final = tf.concat([tf.reshape(v, [-1]) for v in model.trainable_variables], 0)
gathered = hvd.allgather(tf.expand_dims(final, 0), name="test.final_weights").numpy()
if hvd.rank() == 0:
    identical = all(np.array_equal(gathered[0], gathered[r]) for r in range(hvd.size()))
    departed = [pid for pid in state.records if pid not in state.members]
    variables = model.trainable_variables
    applied = [(w0 - v.numpy().astype(np.float64)).reshape(-1) / LR for w0, v in zip(INITIAL, variables)]
    grads = [sum(rec["grads"][i] for rec in state.records.values()) for i in range(len(variables))]
    kept = [sum(state.records[pid]["residuals"][i] for pid in state.members) for i in range(len(variables))]
    lost = [sum((state.records[pid]["residuals"][i] for pid in departed), np.zeros(v.shape.num_elements()))
            for i, v in enumerate(variables)]
    result = {"initial_loss": INITIAL_LOSS, "size": hvd.size(), "steps": state.step, "sizes": state.sizes,
              "identical": identical, "losses": state.losses, "kinds": {"topk": {
                  "conservation_error": max(float(np.abs(a + k + lo - g).max())
                                            for a, k, lo, g in zip(applied, kept, lost, grads)),
                  "error_without_lost": max(float(np.abs(a + k - g).max()) for a, k, g in zip(applied, kept, grads)),
                  "grad_scale": max(float(np.abs(g).max()) for g in grads),
                  "lost_expected_norm": float(np.sqrt(sum(np.square(r).sum() for pid in departed
                                                          for r in state.records[pid]["residuals"]))),
                  "lost_reported": compression.stats.lost(), "departed": len(departed),
                  "final_loss": eval_loss()}}}
    print("ELASTIC_RESULT " + json.dumps(result), flush=True)
