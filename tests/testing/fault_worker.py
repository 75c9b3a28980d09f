"""Training worker of tests/testing/test_faults.py (torch, under horovodrun).

    python fault_worker.py --state-dir DIR [--max-seconds 300] [--compression topk|none]

A small MLP trained with ``hvd.DistributedOptimizer`` and an hvd_compress
compressor, one step every ~50 ms, for at most ``--max-seconds`` (so a fault
that goes unnoticed ends as a *successful* exit, which the test reports as a
failure, never as a hang).  Each rank writes ``DIR/rank<R>.json`` with its pid,
host name and step count after every step, so the test can see that training
is under way on every host and can find the process to kill.
"""
import argparse
import json
import os
import socket
import time

import torch

import horovod.torch as hvd

import hvd_compress


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--state-dir", required=True)
    ap.add_argument("--max-seconds", type=float, default=300.0)
    ap.add_argument("--compression", default="topk", choices=["topk", "none"])
    args = ap.parse_args()
    hvd.init()
    rank = hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    comp = hvd_compress.TopK(0.05) if args.compression == "topk" else hvd_compress.none()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters(), compression=comp)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(rank)
    path = os.path.join(args.state_dir, f"rank{rank}.json")
    start = time.monotonic()
    step = 0
    while time.monotonic() - start < args.max_seconds:
        x = torch.randn(32, 64, generator=gen)
        y = x[:, :1].clone()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        step += 1
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump({"rank": rank, "pid": os.getpid(), "host": socket.gethostname(), "step": step,
                       "time": time.time()}, f)
        os.replace(tmp, path)
        time.sleep(0.05)
    print(f"FAULT_WORKER rank {rank} finished {step} steps without a fault", flush=True)


if __name__ == "__main__":
    main()
