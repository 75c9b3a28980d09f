"""Worker of tests/testing/test_elastic_jobs.py (torch, under elastic horovodrun).

    python elastic_worker_torch.py HOSTS_FILE STAYING LEAVING

(``STAYING``: the hosts that stay, ``host:slots`` joined by commas; ``LEAVING``:
the host, one slot, that is removed, added back and whose worker is killed.)

Four linear regressions trained side by side in one elastic state, on the same
data, with ``op=hvd.Sum`` and plain SGD: ``none`` (Horovod's own), ``topk``
(``hvd_compress.TopK(0.01)``), ``int8`` (``hvd_compress.Int8(transport=
"two_phase")``) and ``auto`` (``hvd_compress.Auto(calibration_steps=3,
exclude=("FP16",))``, which calibrates and plans again after every membership
change; FP16 is left out because, like Horovod's fp16, it carries no error
feedback, so its rounding is not conserved and the law below would hold only
on the runs whose plans never chose it), each registered
with ``hvd_compress.elastic.register``.
Membership changes, driven from inside the job so they land at known phases
(the host file is what the discovery script prints):

1. 3 workers (the ``STAYING`` hosts and ``LEAVING``); rank 0 removes host
   ``LEAVING`` from the host file;
2. 2 workers; rank 0 adds it back;
3. 3 workers; the worker on ``LEAVING`` kills itself with SIGKILL in the
   middle of a step (after its backward, before its optimizer step): a fault,
   so the others restore the last commit; Horovod blacklists that host;
4. 2 workers to the end.

Every commit, each rank records (by allgather, inside ``save``, so it rolls
back with the state) its process id, the sum of the gradients it computed since
it joined (float64), and its error-feedback residual with the two-phase stage-2
residual folded in here (numpy, independent of the library's fold).  At the end
rank 0 prints one line ``ELASTIC_RESULT {json}`` with what the test asserts.
"""
import json
import os
import signal
import sys
import time

import numpy as np
import torch

import horovod.torch as hvd

import hvd_compress
import hvd_compress.elastic

HOSTS_FILE, STAYING, LEAVING = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
LR = 0.3
D_IN, D_OUT, BATCH = 64, 16, 32
STEPS_PER_PHASE = 15
MAX_STEPS = 400
KINDS = ("none", "topk", "int8", "auto")
HOST = os.environ.get("HOROVOD_HOSTNAME", "?")

hvd.init()
torch.manual_seed(0)
TEACHER = torch.randn(D_IN, D_OUT)
EVAL_X = torch.randn(256, D_IN)
EVAL_Y = EVAL_X @ TEACHER


def batch(step, rank):
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    x = torch.randn(BATCH, D_IN, generator=g)
    return x, x @ TEACHER + 0.01 * torch.randn(BATCH, D_OUT, generator=g)


compressions = {"topk": hvd_compress.TopK(0.01), "int8": hvd_compress.Int8(transport="two_phase"),
                "auto": hvd_compress.Auto(calibration_steps=3, exclude=("FP16",))}
models, optimizers = {}, {}
for kind in KINDS:
    torch.manual_seed(1)
    models[kind] = torch.nn.Linear(D_IN, D_OUT)
    optimizers[kind] = hvd.DistributedOptimizer(
        torch.optim.SGD(models[kind].parameters(), lr=LR),
        named_parameters=[(f"{kind}.{n}", p) for n, p in models[kind].named_parameters()],
        compression=compressions.get(kind, hvd.Compression.none), op=hvd.Sum)
INITIAL = {k: [p.detach().clone() for p in m.parameters()] for k, m in models.items()}
with torch.no_grad():
    INITIAL_LOSS = float(torch.nn.functional.mse_loss(models["none"](EVAL_X), EVAL_Y))
grad_sums = {k: [torch.zeros_like(p, dtype=torch.float64) for p in models[k].parameters()] for k in compressions}


def folded_residuals(kind):
    """This rank's residual of every parameter, stage-2 residual added at the
    place of the chunk it owns (ceil(n / size) elements per chunk), as numpy."""
    params = compressions[kind].adapters["torch"].roles.store.params if "torch" in compressions[kind].adapters else {}
    out = []
    for name, p in models[kind].named_parameters():
        r = np.zeros(p.numel())
        state = params.get(f"{kind}.{name}")
        if state is not None and state.residual is not None:
            r += state.residual.numpy()
        if state is not None and state.owned_chunk_residual is not None:
            n, size, rank = p.numel(), hvd.size(), hvd.rank()
            chunk = -(-n // size)
            lo, hi = min(rank * chunk, n), min((rank + 1) * chunk, n)
            r[lo:hi] += state.owned_chunk_residual.numpy()[:hi - lo]
        out.append(r)
    return out


class State(hvd.elastic.TorchState):
    def save(self):
        entry = {k: {"grads": [g.numpy().reshape(-1) for g in grad_sums[k]], "residuals": folded_residuals(k)}
                 for k in compressions}
        gathered = hvd.allgather_object((hvd_compress.elastic.PROCESS_ID, entry), name="test.records")
        self.records = {**self.records, **dict(gathered)}
        self.members = [pid for pid, _ in gathered]
        self._saved_grads = {k: [g.clone() for g in v] for k, v in grad_sums.items()}
        super().save()

    def restore(self):
        super().restore()
        for k, saved in self._saved_grads.items():
            for g, s in zip(grad_sums[k], saved):
                g.copy_(s)


state = State(model=models["none"], optimizer=optimizers["none"], topk_model=models["topk"],
              topk_optimizer=optimizers["topk"], int8_model=models["int8"], int8_optimizer=optimizers["int8"],
              auto_model=models["auto"], auto_optimizer=optimizers["auto"],
              step=0, phase=0, phase_step=0, records={}, members=[], sizes=[], losses=[], auto_plans=[])
state._saved_grads = {k: [g.clone() for g in v] for k, v in grad_sums.items()}
for comp in compressions.values():
    hvd_compress.elastic.register(state, comp)


def hosts_text(with_leaving):
    return "".join(f"{h}\n" for h in STAYING + ([f"{LEAVING}:1"] if with_leaving else []))


def write_hosts(text):
    tmp = HOSTS_FILE + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, HOSTS_FILE)


def eval_loss(kind):
    with torch.no_grad():
        return float(torch.nn.functional.mse_loss(models[kind](EVAL_X), EVAL_Y))


def advance_phase(state):
    """The schedule of membership changes; the same decision on every rank.
    Even phases wait for a size, odd ones run STEPS_PER_PHASE steps at it."""
    size, since = hvd.size(), state.step - state.phase_step
    waits_for = {0: 3, 2: 2, 4: 3, 6: 2}
    if state.phase in waits_for and size == waits_for[state.phase]:
        state.phase, state.phase_step = state.phase + 1, state.step
    elif state.phase in (1, 3, 5, 7) and since >= STEPS_PER_PHASE:
        state.phase, state.phase_step = state.phase + 1, state.step
        if state.phase == 2 and hvd.rank() == 0:
            write_hosts(hosts_text(with_leaving=False))
        if state.phase == 4 and hvd.rank() == 0:
            write_hosts(hosts_text(with_leaving=True))
        # phase 6: the worker on LEAVING dies in the next step; Horovod then blacklists that host


@hvd.elastic.run
def train(state):
    while state.phase < 8 and state.step < MAX_STEPS:
        x, y = batch(state.step, hvd.rank())
        for kind in KINDS:
            optimizers[kind].zero_grad()
            loss = torch.nn.functional.mse_loss(models[kind](x), y)
            if kind in grad_sums:
                for s, g in zip(grad_sums[kind], torch.autograd.grad(loss, list(models[kind].parameters()),
                                                                   retain_graph=True)):
                    s += g.double()
            loss.backward()
        if state.phase == 6 and HOST == LEAVING:
            print(f"ELASTIC_KILL host={HOST} step={state.step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)  # mid-step: the others are waiting in the exchange
        for kind in KINDS:
            optimizers[kind].step()
        state.step += 1
        state.sizes = state.sizes + [hvd.size()]
        # Auto after this step: the number of plans made since the last reset (0: calibrating) and the plan
        state.auto_plans = state.auto_plans + [[len(compressions["auto"].plan_state.history),
                                                compressions["auto"].current_plan()]]
        state.losses = state.losses + [{k: eval_loss(k) for k in KINDS}]
        advance_phase(state)
        time.sleep(0.05)
        state.commit()
    state.commit()  # the final records (inside: a late host update restarts the loop, which is done)


train(state)
weights = torch.cat([p.detach().reshape(-1) for k in KINDS for p in models[k].parameters()])
gathered = hvd.allgather(weights.unsqueeze(0), name="test.final_weights")
if hvd.rank() == 0:
    identical = all(torch.equal(gathered[0], gathered[r]) for r in range(hvd.size()))
    result = {"initial_loss": INITIAL_LOSS, "size": hvd.size(), "steps": state.step, "sizes": state.sizes, "identical": identical,
              "losses": state.losses, "auto_plans": state.auto_plans, "kinds": {}}
    departed = [pid for pid in state.records if pid not in state.members]
    for kind in compressions:
        params = list(models[kind].parameters())
        applied = [((w0.double() - p.detach().double()) / LR).numpy().reshape(-1)
                   for w0, p in zip(INITIAL[kind], params)]
        grads = [sum(rec[kind]["grads"][i] for rec in state.records.values()) for i in range(len(params))]
        kept = [sum(state.records[pid][kind]["residuals"][i] for pid in state.members) for i in range(len(params))]
        lost = [sum((state.records[pid][kind]["residuals"][i] for pid in departed), np.zeros(p.numel()))
                for i, p in enumerate(params)]
        scale = max(float(np.abs(g).max()) for g in grads)
        error = max(float(np.abs(a + k + lo - g).max()) for a, k, lo, g in zip(applied, kept, lost, grads))
        error_without_lost = max(float(np.abs(a + k - g).max()) for a, k, g in zip(applied, kept, grads))
        # every departed rank's residuals together, as one vector (what stats.lost()["norm"] measures)
        lost_norm = float(np.sqrt(sum(np.square(r).sum() for pid in departed for r in state.records[pid][kind]["residuals"])))
        result["kinds"][kind] = {"conservation_error": error, "error_without_lost": error_without_lost,
                                 "grad_scale": scale, "lost_expected_norm": lost_norm,
                                 "lost_reported": compressions[kind].stats.lost(),
                                 "departed": len(departed), "final_loss": eval_loss(kind)}
    result["kinds"]["none"] = {"final_loss": eval_loss("none")}
    print("ELASTIC_RESULT " + json.dumps(result), flush=True)
