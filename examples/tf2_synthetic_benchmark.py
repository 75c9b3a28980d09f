"""Horovod's tensorflow2_synthetic_benchmark.py, with hvd_compress.

Same flags and output lines as Horovod 0.28.1's
``examples/tensorflow2/tensorflow2_synthetic_benchmark.py`` (``Iter #N: X
img/sec per CPU``, ``Img/sec per CPU: X +-Y``, ``Total img/sec on N CPU(s):
X +-Y``); added are ``--compression`` with the scheme options,
``--no-error-feedback`` and an indented line per iteration with the loss and
the gradient bytes sent vs dense.  ``hvd.DistributedGradientTape`` runs
inside a ``tf.function`` as in Horovod's script.

The default model is small enough for a CPU (``mlp``: a wide MLP whose 14M
parameters make communication dominate, on 32x32 images); ``convnet`` is a
small CNN; any ``tf.keras.applications`` name (``--model ResNet50
--image-size 224``, random weights, nothing downloaded) works as in Horovod's.

Keras: ``TF_USE_LEGACY_KERAS=1`` is set before TensorFlow is imported, so
``tf.keras`` is ``tf_keras`` (Keras 2), which Horovod 0.28.1 supports (see
``tf2_keras_mnist.py``).

    horovodrun -np 2 -H localhost:2 python examples/tf2_synthetic_benchmark.py --compression topk --ratio 0.01
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

from hvd_compress.tools.metrics import CompressionMeter  # noqa: E402

# Benchmark settings
parser = argparse.ArgumentParser(description='TensorFlow Synthetic Benchmark',
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument('--model', type=str, default='mlp',
                    help='model to benchmark: mlp, convnet, or a tf.keras.applications name such as ResNet50')
parser.add_argument('--batch-size', type=int, default=32,
                    help='input batch size')
parser.add_argument('--image-size', type=int, default=None,
                    help='input height/width (default: 32 for mlp/convnet, 224 for keras applications)')
parser.add_argument('--num-classes', type=int, default=1000)

parser.add_argument('--num-warmup-batches', type=int, default=10,
                    help='number of warm-up batches that don\'t count towards benchmark')
parser.add_argument('--num-batches-per-iter', type=int, default=10,
                    help='number of batches per benchmark iteration')
parser.add_argument('--num-iters', type=int, default=10,
                    help='number of benchmark iterations')

parser.add_argument('--no-cuda', action='store_true', default=False,
                    help='disables CUDA training')
add_compression_args(parser)  # --compression, scheme options, --no-error-feedback, --fp16-allreduce

args = parser.parse_args()
args.cuda = not args.no_cuda
if args.image_size is None:
    args.image_size = 32 if args.model in ('mlp', 'convnet') else 224

# Horovod: initialize Horovod.
hvd.init()

# Horovod: pin GPU to be used to process local rank (one GPU per process)
if args.cuda:
    gpus = tf.config.experimental.list_physical_devices('GPU')
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
    if gpus:
        tf.config.experimental.set_visible_devices(gpus[hvd.local_rank()], 'GPU')
    else:
        args.cuda = False
else:
    os.environ["CUDA_VISIBLE_DEVICES"] = "-1"
if not args.cuda:
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)


def make_model(name):
    shape = (args.image_size, args.image_size, 3)
    tf.random.set_seed(0)
    if name == 'mlp':
        return tf.keras.Sequential([tf.keras.layers.InputLayer(input_shape=shape), tf.keras.layers.Flatten(),
                                    tf.keras.layers.Dense(2048, activation='relu'),
                                    tf.keras.layers.Dense(2048, activation='relu'),
                                    tf.keras.layers.Dense(args.num_classes, activation='softmax')])
    if name == 'convnet':
        return tf.keras.Sequential([tf.keras.layers.InputLayer(input_shape=shape),
                                    tf.keras.layers.Conv2D(32, 3, padding='same', activation='relu'),
                                    tf.keras.layers.MaxPool2D(),
                                    tf.keras.layers.Conv2D(64, 3, padding='same', activation='relu'),
                                    tf.keras.layers.GlobalAveragePooling2D(),
                                    tf.keras.layers.Dense(512, activation='relu'),
                                    tf.keras.layers.Dense(args.num_classes, activation='softmax')])
    return getattr(tf.keras.applications, name)(weights=None, input_shape=shape, classes=args.num_classes)


# Set up standard model.
model = make_model(args.model)
opt = tf.optimizers.SGD(0.01)

# Horovod: (optional) compression algorithm -- here any hvd_compress scheme.
compression, describe = make_compression(args, hvd)
meter = CompressionMeter(compression, 4 * sum(int(np.prod(v.shape)) for v in model.trainable_variables))

data = tf.random.uniform([args.batch_size, args.image_size, args.image_size, 3])
target = tf.random.uniform([args.batch_size, 1], minval=0, maxval=args.num_classes - 1, dtype=tf.int64)
last_loss = [tf.constant(float('nan'))]


@tf.function
def benchmark_step(first_batch):
    # Horovod: use DistributedGradientTape
    with tf.GradientTape() as tape:
        probs = model(data, training=True)
        loss = tf.reduce_mean(tf.losses.sparse_categorical_crossentropy(target, probs))

    # Horovod: add Horovod Distributed GradientTape.
    tape = hvd.DistributedGradientTape(tape, compression=compression)

    gradients = tape.gradient(loss, model.trainable_variables)
    opt.apply_gradients(zip(gradients, model.trainable_variables))

    # Horovod: broadcast initial variable states from rank 0 to all other processes.
    # This is necessary to ensure consistent initialization of all workers when
    # training is started with random weights or restored from a checkpoint.
    #
    # Note: broadcast should be done after the first gradient step to ensure optimizer
    # initialization.
    if first_batch:
        hvd.broadcast_variables(model.variables, root_rank=0)
        hvd.broadcast_variables(opt.variables(), root_rank=0)
    return loss


def step(first_batch=False):
    last_loss[0] = benchmark_step(first_batch=first_batch)
    meter.step(with_residual=False)


def log(s, nl=True):
    if hvd.rank() != 0:
        return
    print(s, end='\n' if nl else '', flush=True)


log('Model: %s' % args.model)
log('Batch size: %d' % args.batch_size)
device = 'GPU' if args.cuda else 'CPU'
log('Number of %ss: %d' % (device, hvd.size()))
log('Compression: %s (%d parameters)' % (describe, sum(int(np.prod(v.shape)) for v in model.trainable_variables)))


with tf.device(device):
    # Warm-up
    log('Running warmup...')
    step(first_batch=True)
    timeit.timeit(lambda: step(first_batch=False),
                  number=args.num_warmup_batches)
    meter.reset_epoch()

    # Benchmark
    log('Running benchmark...')
    img_secs = []
    sent = dense = 0
    for x in range(args.num_iters):
        time = timeit.timeit(lambda: step(first_batch=False),
                             number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / time
        log('Iter #%d: %.1f img/sec per %s' % (x, img_sec, device))
        m = meter.epoch_summary()
        meter.reset_epoch()
        sent, dense = sent + m['bytes_sent'], dense + m['bytes_dense_fp32']
        log('  iter #%d: loss %.4f | %s' % (x, float(last_loss[0]), meter.format(m)))
        img_secs.append(img_sec)

    # Results
    img_sec_mean = np.mean(img_secs)
    img_sec_conf = 1.96 * np.std(img_secs)
    log('Img/sec per %s: %.1f +-%.1f' % (device, img_sec_mean, img_sec_conf))
    log('Total img/sec on %d %s(s): %.1f +-%.1f' %
        (hvd.size(), device, hvd.size() * img_sec_mean, hvd.size() * img_sec_conf))
    log('Gradients: %s' % meter.format({'bytes_sent': sent, 'bytes_dense_fp32': dense}))
