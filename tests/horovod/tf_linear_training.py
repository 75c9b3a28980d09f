"""Small TF models for the integration tests, and one linear model per scheme, all trained in one ``tf.function`` through the stock
``hvd.DistributedGradientTape``. Shared by test_tf_compression.py (replicas identical,
loss falls) and scripts/tf_replica_stress.py (replicas compared after every step); and the
Keras pieces that inject chosen gradients into ``model.fit`` (test_tf_compression.py,
test_training_tf.py)."""
import numpy as np
import tensorflow as tf
import horovod.tensorflow as hvd

from compression_cases import TRAIN_LR, train_scheme


def dataset(size):
    """96 rows a rank of a smooth regression target, the same on every rank."""
    rng = np.random.default_rng(2024)
    x = rng.standard_normal((96 * size, 12)).astype(np.float32)
    w = rng.standard_normal((12, 1)).astype(np.float32)
    y = (np.tanh(x @ w) + 0.05 * rng.standard_normal((96 * size, 1))).astype(np.float32)
    return x, y


def linear_model(seed, name=None):
    """A linear model (two tensors: tracing costs per tensor)."""
    tf.random.set_seed(seed)  # deliberately different initial weights per rank: the broadcast fixes them
    return tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(12,))], name=name)


def mlp(seed, prefix="", hidden=32):
    """A small MLP with named layers and initial weights drawn from ``seed`` by numpy (Keras's
    unseeded initializers do not repeat after tf.random.set_seed in one process)."""
    model = tf.keras.Sequential([tf.keras.layers.Dense(hidden, activation="tanh", input_shape=(12,),
                                                       name=prefix + "fc1"),
                                 tf.keras.layers.Dense(1, name=prefix + "out")])
    rng = np.random.default_rng(seed)
    model.set_weights([(rng.standard_normal(w.shape) * 0.3).astype(np.float32) for w in model.get_weights()])
    return model


def mse_tape_step(model, opt, comp, input_signature=None):
    """A traced step: mean squared error, gradients through the stock
    DistributedGradientTape with ``comp``, applied by ``opt``; returns the loss."""
    @tf.function(input_signature=input_signature)
    def step_fn(xb, yb):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
        tape = hvd.DistributedGradientTape(tape, compression=comp)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss
    return step_fn


def flat_weights(model):
    return tf.concat([tf.reshape(v, [-1]) for v in model.trainable_variables], 0)


class LinearTraining:
    """``ids``: scheme ids of compression_cases; ``name_of(sid)``: the model's name."""

    def __init__(self, ids, name_of=lambda sid: None):
        self.ids, self.rank, self.size = list(ids), hvd.rank(), hvd.size()
        self.x, self.y = dataset(self.size)
        self.models = {sid: linear_model(100 + self.rank, name_of(sid)) for sid in self.ids}
        for m in self.models.values():
            hvd.broadcast_variables(m.variables, root_rank=0)
        lr = dict(TRAIN_LR, SignSGD=0.02)  # a linear model here: the vote needs larger steps than in torch's MLP
        opts = {sid: tf.keras.optimizers.SGD(learning_rate=lr.get(sid, 0.1)) for sid in self.ids}
        comps = {sid: train_scheme(sid) for sid in self.ids}

        def train_step(xb, yb):
            for sid, model in self.models.items():
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean(tf.square(model(xb, training=True) - yb))
                tape = hvd.DistributedGradientTape(tape, compression=comps[sid])
                grads = tape.gradient(loss, model.trainable_variables)
                opts[sid].apply_gradients(zip(grads, model.trainable_variables))

        self._step_fn = tf.function(train_step, autograph=False)

    def step(self, step):
        """One step on this rank's shard: batches of 32 cycling through its 96 rows."""
        lo = self.rank * 96 + (step % 3) * 32
        self._step_fn(tf.constant(self.x[lo:lo + 32]), tf.constant(self.y[lo:lo + 32]))

    def losses(self):
        return {sid: float(tf.reduce_mean(tf.square(m(self.x) - self.y))) for sid, m in self.models.items()}

    def everyone(self, name):
        """Every replica's weights, (size, schemes, weights), by one allgather named ``name``."""
        flat = tf.stack([flat_weights(self.models[sid]) for sid in self.ids])[None]
        return hvd.allgather(flat, name=name).numpy()


# --- Keras model.fit with injected gradients ---------------------------------------------------------
class Inject(tf.keras.layers.Layer):
    """One weight per spec; the input row is the concatenation of the flat G's, and the
    output is sum(w * G): with a mean-of-output loss and batch size 1, grad w == G."""

    def __init__(self, specs, **kw):
        super().__init__(**kw)
        self.specs = specs

    def build(self, input_shape):
        self.ws = {s: self.add_weight(name=s, shape=shape, initializer="zeros") for s, shape in self.specs.items()}

    def call(self, x):
        out, off = 0.0, 0
        for s, shape in self.specs.items():
            n = int(np.prod(shape))
            g = tf.reshape(x[:, off:off + n], [-1, *shape])
            out = out + tf.reduce_sum(self.ws[s][None] * g, axis=list(range(1, len(shape) + 1)))
            off += n
        return out[:, None]


class CaptureSGD(tf.keras.optimizers.legacy.SGD):
    """SGD that also keeps the (aggregated) gradients it applies, for the test to read."""

    def apply_gradients(self, grads_and_vars, *args, **kwargs):
        grads_and_vars = list(grads_and_vars)
        if not hasattr(self, "captured"):
            with tf.init_scope():
                self.captured = {v.name: tf.Variable(tf.zeros_like(v), trainable=False) for _, v in grads_and_vars}
                self.applied = tf.Variable(0, dtype=tf.int64, trainable=False)
        for g, v in grads_and_vars:
            self.captured[v.name].assign(g)
        self.applied.assign_add(1)
        return super().apply_gradients(grads_and_vars, *args, **kwargs)
