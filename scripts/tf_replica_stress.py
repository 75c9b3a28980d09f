"""Stress the cross-rank identity of TF replicas: one linear model per scheme, all
trained in one tf.function through the stock ``hvd.DistributedGradientTape``, and
after every step the weights of every replica are gathered and compared bit for bit.

    horovodrun -np 3 -H localhost:3 --gloo python scripts/tf_replica_stress.py [--steps 120] [--schemes A,B]

Prints, on rank 0, the first step at which each scheme's replicas differed (an
empty dict when none did) and exits 1 if any did.  docs/reliability.md quotes what
it measured with the fixed aggregate and with the old chain of adds put back.
"""
import argparse
import os
import sys

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
import horovod.tensorflow as hvd  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", "tests", "horovod"), os.path.join(HERE, "..", "tests")]
from compression_cases import TRAIN_IDS, TRAIN_LR, train_scheme  # noqa: E402

DEFAULT = "NoCompression,FP16,BF16,Int8,Int8-block64,QSGD16,TernGrad,SignSGD,Lossless"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--schemes", default=DEFAULT, help=f"comma-separated, from {','.join(TRAIN_IDS)}")
    a = ap.parse_args()
    ids = a.schemes.split(",")
    unknown = sorted(set(ids) - set(TRAIN_IDS))
    if unknown:
        ap.error(f"--schemes: unknown {unknown}; allowed: {','.join(TRAIN_IDS)}")
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    rng = np.random.default_rng(2024)
    x = rng.standard_normal((96 * size, 12)).astype(np.float32)
    w = rng.standard_normal((12, 1)).astype(np.float32)
    y = (np.tanh(x @ w) + 0.05 * rng.standard_normal((96 * size, 1))).astype(np.float32)

    def model(seed):
        tf.random.set_seed(seed)  # different per rank on purpose: the broadcast fixes it
        return tf.keras.Sequential([tf.keras.layers.Dense(1, input_shape=(12,))])

    models = {sid: model(100 + rank) for sid in ids}
    for m in models.values():
        hvd.broadcast_variables(m.variables, root_rank=0)
    lr = dict(TRAIN_LR, SignSGD=0.02)
    opts = {sid: tf.keras.optimizers.SGD(learning_rate=lr.get(sid, 0.1)) for sid in ids}
    comps = {sid: train_scheme(sid) for sid in ids}

    def train_step(xb, yb):
        for sid, m in models.items():
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(m(xb, training=True) - yb))
            tape = hvd.DistributedGradientTape(tape, compression=comps[sid])
            grads = tape.gradient(loss, m.trainable_variables)
            opts[sid].apply_gradients(zip(grads, m.trainable_variables))

    step_fn = tf.function(train_step, autograph=False)

    def differing(tag):
        flat = tf.stack([tf.concat([tf.reshape(v, [-1]) for v in models[s].trainable_variables], 0) for s in ids])
        everyone = hvd.allgather(flat[None], name=f"stress.{tag}").numpy()
        return [ids[i] for i in range(len(ids)) if any(not np.array_equal(everyone[r, i], everyone[0, i])
                                                       for r in range(size))]

    first = {sid: -1 for sid in differing("init")}
    for step in range(a.steps):
        lo = rank * 96 + (step % 3) * 32
        step_fn(tf.constant(x[lo:lo + 32]), tf.constant(y[lo:lo + 32]))
        for sid in differing(step):
            first.setdefault(sid, step)
    if rank == 0:
        print(f"first step at which replicas differed ({a.steps} steps, {size} ranks): {first}", flush=True)
    sys.exit(1 if first else 0)


if __name__ == "__main__":
    main()
