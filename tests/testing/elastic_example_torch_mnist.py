"""Worker of tests/testing/test_elastic_examples.py, shaped like Horovod's
``examples/elastic/pytorch/pytorch_mnist_elastic.py``:

    python elastic_example_torch_mnist.py HOSTS_FILE STAYING LEAVING {kill,nokill,kill_only}

* a ``DataLoader`` over an ``hvd.elastic.ElasticSampler``, ``for state.epoch``
  and ``for state.batch`` loops under ``@hvd.elastic.run``, a commit every batch;
* the module-level ``compression`` handed to ``hvd.DistributedOptimizer``,
  which is built after the training function is defined, and
  ``hvd_compress.elastic.register(state, compression)`` after the state;
* a named ``hvd.allreduce`` of the test metric at the end.

A tiny classifier (8x8 "images", 10 classes) per scheme, trained on the same
batches: TopK(0.01), PowerSGD(4), Int8 two-phase and Auto() without its FP16
candidate (FP16, like Horovod's fp16, carries no error feedback: its rounding
is not conserved, so the ledger's law would hold only on runs whose plans never
chose it); ``op=hvd.Sum``, plain SGD.  Membership schedule and ledger:
tests/testing/elastic_ledger.py.
Rank 0 prints ``ELASTIC_RESULT``.
"""
import os
import signal
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

import horovod.torch as hvd
import hvd_compress
from elastic_ledger import MembershipSchedule, conservation, folded, print_result, recording_state

HOSTS_FILE, STAYING, LEAVING = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
SCHEDULE = MembershipSchedule(HOSTS_FILE, STAYING, LEAVING, steps=6, mode=sys.argv[4])
HOST = os.environ.get("HOROVOD_HOSTNAME", "?")
LR, BATCH, EPOCHS = 0.05, 16, 1000

hvd.init()
torch.manual_seed(0)
generator = torch.Generator().manual_seed(1)
images = torch.randn(4096, 1, 8, 8, generator=generator)
labels = (images.flatten(1) @ torch.randn(64, 10, generator=generator)).argmax(1)
train_dataset = torch.utils.data.TensorDataset(images, labels)
train_sampler = hvd.elastic.ElasticSampler(train_dataset, shuffle=False)
train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=BATCH, sampler=train_sampler)

compression = hvd_compress.TopK(0.01)
COMPRESSIONS = {"topk": compression, "powersgd": hvd_compress.PowerSGD(4),
                "int8": hvd_compress.Int8(transport="two_phase"),
                "auto": hvd_compress.Auto(calibration_steps=3, exclude=("FP16",))}
KINDS = tuple(COMPRESSIONS)
models = torch.nn.ModuleDict({k: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 10)) for k in KINDS})
INITIAL = {k: [p.detach().clone().numpy() for p in models[k].parameters()] for k in KINDS}
#: per kind, this rank's float64 sum of the gradients it computed (never broadcast)
GRAD_SUMS = {k: [torch.zeros(p.shape, dtype=torch.float64) for p in models[k].parameters()] for k in KINDS}


@hvd.elastic.run
def train(state):
    for state.epoch in range(state.epoch, EPOCHS):
        for state.batch, (data, target) in enumerate(train_loader):
            if SCHEDULE.done(state):
                return
            if SCHEDULE.killing_now(state, HOST):
                print(f"ELASTIC_KILL host={HOST} step={state.step}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)  # the others wait for this rank in the step's exchanges
            for kind in KINDS:
                optimizers[kind].zero_grad()
                loss = F.cross_entropy(models[kind](data), target)
                params = list(models[kind].parameters())
                for total, g in zip(GRAD_SUMS[kind], torch.autograd.grad(loss, params, retain_graph=True)):
                    total += g.double()
                loss.backward()
                optimizers[kind].step()
            train_sampler.record_batch(state.batch, BATCH)
            state.step += 1
            state.sizes = state.sizes + [hvd.size()]
            SCHEDULE.advance(state, hvd.size(), hvd.rank())
            time.sleep(0.05)
            state.commit()
        state.batch = 0
        train_sampler.set_epoch(state.epoch + 1)


def test_loss(kind):
    with torch.no_grad():
        loss = F.cross_entropy(models[kind](images[:512]), labels[:512])
    return hvd.allreduce(loss, name=f"avg_loss.{kind}").item()


optimizers = {k: hvd.DistributedOptimizer(torch.optim.SGD(models[k].parameters(), lr=LR),
                                          named_parameters=models[k].named_parameters(),
                                          compression=COMPRESSIONS[k], op=hvd.Sum) for k in KINDS}


def residuals(kind):
    """This rank's residual of each parameter of ``kind``, two-phase chunk folded in (numpy)."""
    adapter = COMPRESSIONS[kind].adapters.get("torch")
    out = []
    for name, p in models[kind].named_parameters():
        param = adapter.roles.store.params.get(name) if adapter is not None else None
        r = getattr(param, "residual", None)
        owned = getattr(param, "owned_chunk_residual", None)
        flat = np.zeros(p.numel()) if r is None else r.detach().double().numpy()
        out.append(folded(flat, None if owned is None else owned.detach().double().numpy(), hvd.rank(), hvd.size()))
    return out


def all_grad_sums():
    """Every kind's gradient sums, in one list (what a commit snapshots and a restore puts back)."""
    return [g for k in KINDS for g in GRAD_SUMS[k]]


def records_of_this_rank():
    return {k: {"grads": [g.numpy().reshape(-1).copy() for g in GRAD_SUMS[k]], "residuals": residuals(k)}
            for k in KINDS}


RecordingState = recording_state(hvd.elastic.TorchState, hvd.allgather_object, hvd_compress.elastic.PROCESS_ID,
                                 records_of_this_rank, lambda: [g.clone() for g in all_grad_sums()],
                                 lambda saved: [g.copy_(value) for g, value in zip(all_grad_sums(), saved)])
state = RecordingState(models, optimizers["topk"], sampler=train_sampler, epoch=0, batch=0, step=0, phase=0,
                       phase_step=0, sizes=[], records={}, members=[],
                       **{f"optimizer_{k}": optimizers[k] for k in KINDS if k != "topk"})
state.saved_grads = [g.clone() for g in all_grad_sums()]
hvd_compress.elastic.register(state, compression)
for kind in KINDS[1:]:
    hvd_compress.elastic.register(state, COMPRESSIONS[kind])
train(state)

losses = {k: test_loss(k) for k in KINDS}
weights = torch.cat([p.detach().reshape(-1) for k in KINDS for p in models[k].parameters()])
gathered = hvd.allgather(weights.unsqueeze(0), name="test.final_weights")
if hvd.rank() == 0:
    result = {"size": hvd.size(), "steps": state.step, "sizes": state.sizes, "test_loss": losses,
              "identical": all(torch.equal(gathered[0], row) for row in gathered), "kinds": {}}
    for k in KINDS:
        final = [p.detach().numpy() for p in models[k].parameters()]
        entry = conservation(INITIAL[k], final, LR, state.records, state.members, k)
        entry["lost_reported"] = COMPRESSIONS[k].stats.lost()
        result["kinds"][k] = entry
    print_result(result)
