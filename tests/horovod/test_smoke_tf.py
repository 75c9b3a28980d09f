"""Smoke test of the Horovod stack for TensorFlow 2.

Runs under ``horovodrun -np 2`` (scripts/run_tests.sh launches it with Gloo and
with MPI; ``TF_USE_LEGACY_KERAS=1`` selects tf_keras): ``hvd.allreduce`` and
``hvd.allgather`` give the right numbers, eagerly and inside ``tf.function``,
and a 3-step ``hvd.DistributedGradientTape`` training loop inside
``tf.function`` with ``hvd.Compression.fp16`` keeps the replicas bitwise
identical.

Every rank runs every test in the same order and issues the same collectives
before it asserts anything, so one rank's failure cannot leave another waiting.
"""
import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

import horovod.tensorflow as hvd  # noqa: E402

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()


def test_world_and_keras_flavour():
    assert SIZE >= 2, "the smoke test must run under horovodrun with at least 2 processes"
    assert 0 <= RANK < SIZE
    ranks = hvd.allgather(tf.constant([RANK], tf.int64), name="smoke.ranks")
    assert ranks.numpy().tolist() == list(range(SIZE))
    # TF_USE_LEGACY_KERAS=1 must give tf_keras (Keras 2), which Horovod's keras API needs
    assert tf.keras.__name__.startswith("tf_keras"), tf.keras.__name__


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64, tf.int32, tf.int64])
def test_allreduce_sum_and_average_eager(dtype):
    base = np.arange(12, dtype=np.float64).reshape(3, 4)
    x = tf.cast(base * (RANK + 1), dtype)
    s = hvd.allreduce(x, op=hvd.Sum, name=f"smoke.sum.{dtype.name}")
    want_sum = base * (SIZE * (SIZE + 1) // 2)
    assert s.dtype == dtype and s.shape == x.shape
    np.testing.assert_array_equal(s.numpy().astype(np.float64), want_sum)
    if dtype.is_floating:
        a = hvd.allreduce(x, op=hvd.Average, name=f"smoke.avg.{dtype.name}")
        np.testing.assert_allclose(a.numpy(), want_sum / SIZE, rtol=1e-6)


def test_allreduce_and_allgather_in_tf_function():
    @tf.function
    def f(x):
        s = hvd.allreduce(x, op=hvd.Sum, name="smoke.fn.sum")
        h = hvd.allreduce(x, op=hvd.Sum, name="smoke.fn.fp16", compression=hvd.Compression.fp16)
        g = hvd.allgather(tf.fill([RANK + 1, 2], x[0]), name="smoke.fn.gather")
        return s, h, g

    s, h, g = f(tf.fill([5], float(RANK + 1)))
    want = SIZE * (SIZE + 1) / 2
    assert s.numpy().tolist() == [want] * 5
    assert h.dtype == tf.float32 and h.numpy().tolist() == [want] * 5
    want_g = np.concatenate([np.full((r + 1, 2), r + 1.0) for r in range(SIZE)])
    np.testing.assert_array_equal(g.numpy(), want_g)


def test_allgather_variable_first_dimension_and_int8():
    x = tf.fill([RANK + 1, 3], float(RANK))
    g = hvd.allgather(x, name="smoke.gather")
    b = hvd.allgather(tf.constant([RANK, -RANK], tf.int8), name="smoke.gather.int8")
    want = np.concatenate([np.full((r + 1, 3), float(r)) for r in range(SIZE)])
    np.testing.assert_array_equal(g.numpy(), want)
    assert b.dtype == tf.int8
    assert b.numpy().tolist() == [v for r in range(SIZE) for v in (r, -r)]


def test_broadcast():
    x = tf.fill([4], float(RANK + 10))
    y = hvd.broadcast(x, root_rank=SIZE - 1, name="smoke.bcast")
    assert y.numpy().tolist() == [SIZE - 1 + 10.0] * 4


def _flat(variables):
    return tf.concat([tf.reshape(v, [-1]) for v in variables], 0)


def test_distributed_gradient_tape_fp16_three_steps_replicas_identical():
    tf.random.set_seed(1234 + RANK)  # different initial weights and data on every rank
    model = tf.keras.Sequential([tf.keras.layers.Dense(16, activation="tanh", input_shape=(10,)),
                                 tf.keras.layers.Dense(1)])
    opt = tf.keras.optimizers.SGD(learning_rate=0.1, momentum=0.9)
    hvd.broadcast_variables(model.variables, root_rank=0)
    start = _flat(model.trainable_variables).numpy()
    rng = np.random.default_rng(99 + RANK)
    data = [(rng.standard_normal((32, 10)).astype(np.float32),) for _ in range(3)]

    @tf.function
    def train_step(x):
        y = tf.reduce_sum(x, axis=1, keepdims=True)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
        tape = hvd.DistributedGradientTape(tape, compression=hvd.Compression.fp16, op=hvd.Average)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    losses = [float(train_step(tf.constant(x))) for (x,) in data]
    w = _flat(model.trainable_variables)
    everyone = hvd.allgather(tf.reshape(w, [1, -1]), name="smoke.replicas").numpy()
    assert everyone.shape == (SIZE, w.shape[0])
    for r in range(SIZE):
        np.testing.assert_array_equal(everyone[r], everyone[0], err_msg=f"replica {r} differs from replica 0")
    assert not np.array_equal(w.numpy(), start), "the weights did not move"
    assert np.all(np.isfinite(losses))
    assert int(opt.iterations.numpy()) == 3
