"""hvd_compress under Horovod's Ray executor (``horovod.ray.RayExecutor``): a
PyTorch model trained by Ray workers, its gradients compressed by one line.

    pip install ray          # not a dependency of hvd_compress
    python examples/ray_pytorch.py --workers 2 --compression topk --ratio 0.25

Each Ray worker runs ``train`` (Horovod over Gloo between the Ray actors); the
script prints each worker's rank and whether its final weights equal rank 0's.
"""
from __future__ import annotations

import argparse


def train(ratio, steps):
    import torch

    import horovod.torch as hvd
    import hvd_compress

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    compression = hvd_compress.TopK(ratio)  # the one line hvd_compress adds
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                         named_parameters=model.named_parameters(), compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(8, 16) + hvd.rank()).pow(2).mean().backward()
        optimizer.step()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = hvd.allgather(weights.unsqueeze(0), name="ray_example.weights")
    return {"rank": hvd.rank(), "size": hvd.size(), "same_as_rank0": bool(torch.equal(gathered[0], weights))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--compression", choices=["topk"], default="topk")
    parser.add_argument("--ratio", type=float, default=0.25)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    import ray
    from horovod.ray import RayExecutor

    ray.init(num_cpus=args.workers, include_dashboard=False)
    executor = RayExecutor(RayExecutor.create_settings(timeout_s=180), num_workers=args.workers,
                           cpus_per_worker=1, use_gpu=False)
    executor.start()
    for result in executor.run(train, args=[args.ratio, args.steps]):
        print(result)
    executor.shutdown()


if __name__ == "__main__":
    main()
