"""Horovod's pytorch_synthetic_benchmark.py, with hvd_compress.

Same flags and output lines as Horovod 0.28.1's
``examples/pytorch/pytorch_synthetic_benchmark.py`` (``Iter #N: X img/sec per
CPU``, ``Img/sec per CPU: X +-Y``, ``Total img/sec on N CPU(s): X +-Y``), so
results compare directly; added are ``--compression`` with the scheme options
and ``--no-error-feedback``, and one extra, indented line per iteration (``  iter #N: loss L | sent ...``)
with the loss and the gradient bytes sent vs dense.

torchvision is not a dependency, so the models are defined here:
``resnet20``/``resnet8`` (CIFAR-style ResNets, ``--image-size 32`` default),
``mlp`` (a wide MLP whose 14M parameters make communication dominate) and
``convnet``.  If torchvision is installed, any of its model names
(``--model resnet50 --image-size 224``) works as in Horovod's script.

    horovodrun -np 2 -H localhost:2 python examples/pytorch_synthetic_benchmark.py --model mlp --compression topk
    horovodrun -np 2 -H localhost:2 python examples/pytorch_synthetic_benchmark.py --fp16-allreduce
"""
import argparse
import os
import sys
import timeit

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.backends.cudnn as cudnn  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import torch.optim as optim  # noqa: E402

import horovod.torch as hvd  # noqa: E402

from _common import add_compression_args, make_compression  # noqa: E402
from hvd_compress.tools.metrics import TorchCompressionLogger  # noqa: E402

# Benchmark settings
parser = argparse.ArgumentParser(description='PyTorch Synthetic Benchmark',
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument('--model', type=str, default='resnet20',
                    help='model to benchmark: resnet20, resnet8, mlp, convnet (or a torchvision name)')
parser.add_argument('--batch-size', type=int, default=32,
                    help='input batch size')
parser.add_argument('--image-size', type=int, default=None,
                    help='input height/width (default: 32 for the built-in models, 224 for torchvision)')
parser.add_argument('--num-classes', type=int, default=1000)

parser.add_argument('--num-warmup-batches', type=int, default=10,
                    help='number of warm-up batches that don\'t count towards benchmark')
parser.add_argument('--num-batches-per-iter', type=int, default=10,
                    help='number of batches per benchmark iteration')
parser.add_argument('--num-iters', type=int, default=10,
                    help='number of benchmark iterations')

parser.add_argument('--no-cuda', action='store_true', default=False,
                    help='disables CUDA training')

parser.add_argument('--use-adasum', action='store_true', default=False,
                    help='use adasum algorithm to do reduction (Horovod\'s own compressions only)')
parser.add_argument('--threads', type=int, default=1, help='torch intra-op threads per rank')
add_compression_args(parser)  # --compression, scheme options, --no-error-feedback, --fp16-allreduce


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.short = None
        if stride != 1 or cin != cout:
            self.short = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.short is None else self.short(x)))


class CifarResNet(nn.Module):
    """He et al.'s CIFAR ResNet (6n+2 layers), global-pooled so any image size works."""

    def __init__(self, depth, num_classes):
        super().__init__()
        n = (depth - 2) // 6
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        layers, cin = [], 16
        for cout, stride in ((16, 1), (32, 2), (64, 2)):
            for i in range(n):
                layers.append(BasicBlock(cin, cout, stride if i == 0 else 1))
                cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


class ConvNet(nn.Module):
    def __init__(self, num_classes):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 32, 3, padding=1), nn.Conv2d(32, 64, 3, padding=1)
        self.fc1, self.fc2 = nn.Linear(64 * 16, 512), nn.Linear(512, num_classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.c1(x)), 2)
        x = F.adaptive_avg_pool2d(F.relu(self.c2(x)), 4)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def make_model(name, num_classes, image_size):
    if name.startswith('resnet') and name[6:].isdigit() and (int(name[6:]) - 2) % 6 == 0:
        return CifarResNet(int(name[6:]), num_classes)
    if name == 'mlp':
        d = 3 * image_size * image_size
        return nn.Sequential(nn.Flatten(), nn.Linear(d, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                             nn.Linear(2048, num_classes))
    if name == 'convnet':
        return ConvNet(num_classes)
    from torchvision import models  # optional
    return getattr(models, name)(num_classes=num_classes)


args = parser.parse_args()
args.cuda = not args.no_cuda and torch.cuda.is_available()
builtin = args.model in ('mlp', 'convnet') or (args.model.startswith('resnet') and args.model[6:].isdigit()
                                                and (int(args.model[6:]) - 2) % 6 == 0)
if args.image_size is None:
    args.image_size = 32 if builtin else 224
torch.set_num_threads(args.threads)

hvd.init()

if args.cuda:
    # Horovod: pin GPU to local rank.
    torch.cuda.set_device(hvd.local_rank())

cudnn.benchmark = True

# Set up standard model.
torch.manual_seed(0)
model = make_model(args.model, args.num_classes, args.image_size)

# By default, Adasum doesn't need scaling up learning rate.
lr_scaler = hvd.size() if not args.use_adasum else 1

if args.cuda:
    # Move model to GPU.
    model.cuda()
    # If using GPU Adasum allreduce, scale learning rate by local_size.
    if args.use_adasum and hvd.nccl_built():
        lr_scaler = hvd.local_size()

optimizer = optim.SGD(model.parameters(), lr=0.01 * lr_scaler)

# Horovod: (optional) compression algorithm -- here any hvd_compress scheme.
compression, describe = make_compression(args, hvd)

# Horovod: wrap optimizer with DistributedOptimizer.
optimizer = hvd.DistributedOptimizer(optimizer,
                                     named_parameters=model.named_parameters(),
                                     compression=compression,
                                     op=hvd.Adasum if args.use_adasum else hvd.Average)

# Horovod: broadcast parameters & optimizer state.
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

metrics = TorchCompressionLogger(compression, model=model, time_codec=True)

# Set up fixed fake data
data = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
target = torch.LongTensor(args.batch_size).random_() % args.num_classes
if args.cuda:
    data, target = data.cuda(), target.cuda()

last_loss = [float('nan')]


def benchmark_step():
    optimizer.zero_grad()
    output = model(data)
    loss = F.cross_entropy(output, target)
    loss.backward()
    optimizer.step()
    metrics.step()
    last_loss[0] = loss.item()


def log(s, nl=True):
    if hvd.rank() != 0:
        return
    print(s, end='\n' if nl else '', flush=True)


log('Model: %s' % args.model)
log('Batch size: %d' % args.batch_size)
device = 'GPU' if args.cuda else 'CPU'
log('Number of %ss: %d' % (device, hvd.size()))
log('Compression: %s (%d parameters)' % (describe, sum(p.numel() for p in model.parameters())))

# Warm-up
log('Running warmup...')
timeit.timeit(benchmark_step, number=args.num_warmup_batches)
metrics.end_epoch(0)

# Benchmark
log('Running benchmark...')
img_secs = []
sent = dense = 0
for x in range(args.num_iters):
    time = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / time
    log('Iter #%d: %.1f img/sec per %s' % (x, img_sec, device))
    m = metrics.end_epoch(x + 1)
    sent, dense = sent + m['bytes_sent'], dense + m['bytes_dense_fp32']
    log('  iter #%d: loss %.4f | %s' % (x, last_loss[0], metrics.format(m)))
    img_secs.append(img_sec)

# Results
img_sec_mean = np.mean(img_secs)
img_sec_conf = 1.96 * np.std(img_secs)
log('Img/sec per %s: %.1f +-%.1f' % (device, img_sec_mean, img_sec_conf))
log('Total img/sec on %d %s(s): %.1f +-%.1f' %
    (hvd.size(), device, hvd.size() * img_sec_mean, hvd.size() * img_sec_conf))
log('Gradients: %s' % metrics.format({'bytes_sent': sent, 'bytes_dense_fp32': dense}))
