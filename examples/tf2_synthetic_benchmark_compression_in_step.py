"""Horovod's tensorflow2_synthetic_benchmark.py pattern, unchanged but for one line.

Horovod 0.28.1's ``examples/tensorflow2/tensorflow2_synthetic_benchmark.py``
builds the compression *inside* the traced step::

    @tf.function
    def benchmark_step(first_batch):
        compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
        ...

Here that line builds an hvd_compress compressor instead (``--compression``
and the scheme options as in the other examples).  ``benchmark_step`` is
traced twice (``first_batch=True``, then ``False``), so two compressors are
built; the second continues the first one's error feedback (see
``hvd_compress.adapters.tf_traces.owner_across_traces``).  Output lines are
Horovod's (``Iter #N: X img/sec per CPU``, ``Img/sec per CPU``, ``Total
img/sec``), plus one ``Gradients:`` line with the bytes the last step sent.

    horovodrun -np 2 -H localhost:2 python examples/tf2_synthetic_benchmark_compression_in_step.py \\
        --compression topk --ratio 0.01
"""
import argparse
import os
import sys
import timeit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import add_compression_args, make_compression, quiet_tf  # noqa: E402

quiet_tf()

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import horovod.tensorflow as hvd  # noqa: E402

parser = argparse.ArgumentParser(description='TensorFlow Synthetic Benchmark, compression built in the step',
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument('--batch-size', type=int, default=16, help='input batch size')
parser.add_argument('--image-size', type=int, default=32)
parser.add_argument('--num-classes', type=int, default=10)
parser.add_argument('--num-warmup-batches', type=int, default=2)
parser.add_argument('--num-batches-per-iter', type=int, default=5)
parser.add_argument('--num-iters', type=int, default=3)
add_compression_args(parser)  # --compression, scheme options, --no-error-feedback, --fp16-allreduce
args = parser.parse_args()

hvd.init()
os.environ["CUDA_VISIBLE_DEVICES"] = "-1"
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

tf.random.set_seed(0)
shape = (args.image_size, args.image_size, 3)
model = tf.keras.Sequential([tf.keras.layers.InputLayer(input_shape=shape),
                             tf.keras.layers.Conv2D(16, 3, padding='same', activation='relu'),
                             tf.keras.layers.GlobalAveragePooling2D(),
                             tf.keras.layers.Dense(256, activation='relu'),
                             tf.keras.layers.Dense(args.num_classes, activation='softmax')])
opt = tf.optimizers.SGD(0.01)

data = tf.random.uniform([args.batch_size, args.image_size, args.image_size, 3])
target = tf.random.uniform([args.batch_size, 1], minval=0, maxval=args.num_classes - 1, dtype=tf.int64)
built = []  # the compressors each trace built, to report their bytes


@tf.function
def benchmark_step(first_batch):
    # Horovod: (optional) compression algorithm -- built here, as in Horovod's script.
    compression, _ = make_compression(args, hvd)
    built.append(compression)

    with tf.GradientTape() as tape:
        probs = model(data, training=True)
        loss = tf.reduce_mean(tf.losses.sparse_categorical_crossentropy(target, probs))

    # Horovod: add Horovod Distributed GradientTape.
    tape = hvd.DistributedGradientTape(tape, compression=compression)

    gradients = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(gradients, model.trainable_variables))

    # Horovod: broadcast initial variable states from rank 0 to all other processes.
    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables(), root_rank=0)
    return loss


def log(s):
    if hvd.rank() == 0:
        print(s, flush=True)


log('Model: convnet')
log('Batch size: %d' % args.batch_size)
log('Number of CPUs: %d' % hvd.size())
log('Compression: %s, built inside the traced step' % make_compression(args, hvd)[1])

log('Running warmup...')
benchmark_step(first_batch=True)
timeit.timeit(lambda: benchmark_step(first_batch=False), number=args.num_warmup_batches)

log('Running benchmark...')
img_secs = []
for x in range(args.num_iters):
    time = timeit.timeit(lambda: benchmark_step(first_batch=False), number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / time
    log('Iter #%d: %.1f img/sec per CPU' % (x, img_sec))
    img_secs.append(img_sec)

img_sec_mean, img_sec_conf = np.mean(img_secs), 1.96 * np.std(img_secs)
log('Img/sec per CPU: %.1f +-%.1f' % (img_sec_mean, img_sec_conf))
log('Total img/sec on %d CPU(s): %.1f +-%.1f' % (hvd.size(), hvd.size() * img_sec_mean, hvd.size() * img_sec_conf))
log('Traces: %d, compressors built: %d' % (benchmark_step.experimental_get_tracing_count(), len(built)))
stats = getattr(built[-1], 'stats', None)
if stats is not None:  # an hvd_compress compressor: the bytes its last step sent
    t = stats.totals()
    log('Gradients: sent %d B vs dense %d B (%.1fx smaller) over %d tensors'
        % (t['payload_bytes'], t['dense_fp32_bytes'], t['ratio'], t['tensors']))
