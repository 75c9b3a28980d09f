"""Training-grade features through the stock, unpatched ``horovod.torch.DistributedOptimizer``:
per-layer policies, warmup schedules, DGC's corrections, gradient accumulation and
checkpoints.

Runs under ``horovodrun -np 2`` with Gloo (scripts/run_tests.sh).  Gradients
are injected as in test_torch_compression.py: every rank backpropagates ``sum(p * G_rank)``
so ``p.grad == G_rank`` exactly, and since every rank can compute every rank's ``G`` each
rank checks the aggregate against a numpy reference (``tests/reference.py`` for the schemes;
the phase table, DGC's momentum/clipping/masking and accumulation written out here).

Horovod's semantics this relies on (horovod/torch/optimizer.py, 0.28.1):

* ``named_parameters=`` gives the names; without it Horovod names parameters
  ``allreduce.noname.<group>.<index>`` and those are the compressor's keys;
* ``backward_passes_per_step=k``: each hook fires k times, ``p.grad`` *accumulates* (a sum,
  not a mean) and ``compress`` runs once, on the k-th pass; ``op=Average`` divides by the
  number of ranks only.

Every rank runs the same tests in the same order and issues all collectives of a test before
asserting anything.
"""
import io
import json
import re

import numpy as np
import pytest
import torch

import horovod.torch as hvd

from compression_cases import G, local_grads, ref
from training_cases import (SCHED_SPECS, assert_close, dgc_warmup_schedule, explicit_schedule, phase_table,
                            schedule_reference)
from compression_cases import simulate as ref_simulate

import hvd_compress as hc
from hvd_compress import Policy, Rule, Schedule
from hvd_compress.cross_rank import stable_hash
from hvd_compress.backend import TorchBackend
from torch_params import Params

hvd.init()
RANK, SIZE = hvd.rank(), hvd.size()
f32 = np.float32


# --- driving the stock optimizer with injected gradients ----------------------------------------------


def run_injected(comp, specs, steps, bpps=1, named=True, on_step=None, **opt_kw):
    """``steps`` communications of the stock DistributedOptimizer (``bpps`` backward passes
    each) with injected gradients; returns ``[{spec: aggregated grad}]``.  ``on_step(step)``
    runs after each synchronize (e.g. to read the stats)."""
    model = Params(specs)
    named_params = list(model.named_parameters())
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=named_params if named else None,
                                   compression=comp, backward_passes_per_step=bpps, **opt_kw)
    out = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        for micro in range(bpps):
            loss = sum((p * torch.from_numpy(G(n, RANK, step, tuple(p.shape), micro))).sum() for n, p in named_params)
            loss.backward()
        opt.synchronize()
        out.append({n: p.grad.detach().clone().numpy() for n, p in named_params})
        if on_step is not None:
            on_step(step)
    return out


def everyone(values, name):
    """allgather of a list of int64 numbers -> [per-rank lists]."""
    t = torch.tensor([list(values)], dtype=torch.int64)
    return hvd.allgather(t, name=name).tolist()


def torch_uniform_fn(comp, key):
    """The adapter's private draws: ``torch.rand`` from a generator seeded with
    ``TorchBackend.seed_for(stable_hash(seed, key, set_rank), step)``, step counting from 1."""
    def fn(step0, rank, n):
        seed = TorchBackend.seed_for(None, stable_hash(comp.seed, key, rank), step0 + 1)
        gen = torch.Generator().manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
        return torch.rand(n, generator=gen, dtype=torch.float32).numpy()
    return fn


# --- 1. per-layer policy: names reach the policy ------------------------------------------------------------
POLICY_SPECS = {
    "embed.weight": (50, 16),      # 800
    "fc1.weight": (64, 32),        # 2048
    "fc1.bias": (64,),
    "norm.weight": (64,),
    "attn.qkv.weight": (24, 16),   # 384
    "vec": (200,),
    "mid.weight": (20, 20),        # 400
    "tiny": (5,),
}


def make_policy():
    return Policy([
        Rule(hc.none(), name=["*bias", "*norm*"]),           # 0: glob
        Rule(hc.FP16(), name="re:^embed\\."),                # 1: regex
        Rule(hc.Int8(), name="re:attn", min_ndim=2),         # 2: regex + rank
        Rule(hc.TopK(0.05), min_numel=1000, min_ndim=2),     # 3: size + rank
        Rule(hc.BF16(), max_ndim=1, min_numel=100),          # 4: rank + size
        Rule(hc.none(), max_numel=16),                       # 5: size
    ], default=hc.EFSignSGD())


#: (rule index or None, scheme) each parameter gets with its name ...
BY_NAME = {
    "embed.weight": (1, "FP16"), "fc1.weight": (3, "TopK"), "fc1.bias": (0, "NoCompression"),
    "norm.weight": (0, "NoCompression"), "attn.qkv.weight": (2, "Int8"), "vec": (4, "BF16"),
    "mid.weight": (None, "EFSignSGD"), "tiny": (5, "NoCompression"),
}
#: ... and without it (Horovod's allreduce.noname.0.<i>): only size/rank conditions can match
WITHOUT_NAME = {
    "embed.weight": (None, "EFSignSGD"), "fc1.weight": (3, "TopK"), "fc1.bias": (None, "EFSignSGD"),
    "norm.weight": (None, "EFSignSGD"), "attn.qkv.weight": (None, "EFSignSGD"), "vec": (4, "BF16"),
    "mid.weight": (None, "EFSignSGD"), "tiny": (5, "NoCompression"),
}


def _compression_of(pol, rule):
    return pol.default if rule is None else pol.rules[rule].compression


def check_policy_run(pol, got, keys, expected, steps):
    stats = pol.stats.per_tensor()
    assert set(stats) == set(keys.values()), sorted(stats)
    for spec, shape in POLICY_SPECS.items():
        rule, scheme = expected[spec]
        row = stats[keys[spec]]
        assert row["scheme"] == scheme, (spec, keys[spec], row)
        assert row["calls"] == steps
        comp = _compression_of(pol, rule)
        sim, _ = ref_simulate(comp, spec, shape, list(range(SIZE)), steps=steps)
        for step in range(steps):
            assert_close(scheme, got[step][spec], sim.aggregated[step], f"{spec} ({scheme}) step {step}")
        assert row["payload_bytes"] == sim.nbytes[-1][RANK], (spec, row)


def test_policy_gets_torch_parameter_names():
    """named_parameters=: the keys are the module's parameter names; glob, regex, size and
    rank rules pick each tensor's scheme; the aggregate is that scheme's reference."""
    pol = make_policy()
    got = run_injected(pol, POLICY_SPECS, steps=2)
    check_policy_run(pol, got, {s: s for s in POLICY_SPECS}, BY_NAME, steps=2)


def test_policy_without_named_parameters_falls_back_to_horovod_names():
    """No named_parameters=: Horovod names the parameters 'allreduce.noname.<group>.<index>'
    and the policy sees those -- name rules match nothing, size/rank rules still decide."""
    pol = make_policy()
    got = run_injected(pol, POLICY_SPECS, steps=2, named=False)
    order = [n for n, _ in Params(POLICY_SPECS).named_parameters()]  # the optimizer's parameter order
    keys = {spec: f"allreduce.noname.0.{order.index(spec)}" for spec in POLICY_SPECS}
    check_policy_run(pol, got, keys, WITHOUT_NAME, steps=2)


def test_policy_direct_call_keys_by_shape():
    """hvd.allreduce(t, compression=policy) outside an optimizer: key 'anon:<shape>#0'; a
    name rule cannot match it ('fc1.bias'-like 64-vector gets the default), size rules do."""
    pol = make_policy()
    outs = {}
    for shape in [(64, 32), (64,), (8,)]:
        x = torch.from_numpy(G("direct", RANK, 0, shape))
        outs[shape] = hvd.allreduce(x, op=hvd.Average, compression=pol, name=f"policy.direct.{len(shape)}.{shape[0]}")
    stats = pol.stats.per_tensor()
    assert {k: v["scheme"] for k, v in stats.items()} == {
        "anon:64x32#0": "TopK", "anon:64#0": "EFSignSGD", "anon:8#0": "NoCompression"}, stats
    for shape, comp, sid in [((64, 32), pol.rules[3].compression, "TopK"), ((64,), pol.default, "EFSignSGD"),
                             ((8,), pol.rules[5].compression, "NoCompression")]:
        sim, _ = ref_simulate(comp, "direct", shape, list(range(SIZE)), steps=1)
        assert_close(sid, outs[shape].numpy(), sim.aggregated[0], f"direct call {shape}")


def test_direct_calls_of_one_tensor_share_error_feedback():
    comp = hc.TopK(0.05)
    shape = (40, 25)
    got = []
    for step in range(3):
        x = torch.from_numpy(G("direct.ef", RANK, step, shape))
        got.append(hvd.allreduce(x, op=hvd.Average, compression=comp, name=f"direct.ef.{step}").numpy())
    keys = sorted(comp.stats.per_tensor())
    sim, _ = ref_simulate(comp, "direct.ef", shape, list(range(SIZE)), steps=3)
    assert keys == ["anon:40x25#0"], keys
    for step in range(3):
        assert_close("TopK", got[step], sim.aggregated[step], f"direct call step {step}")


def test_describe_lists_every_parameter_with_rule_and_bytes():
    """describe(model.named_parameters()): one row per parameter with its rule and the bytes
    it will hand to Horovod per step -- equal to what the stats counted in a real step."""
    pol = make_policy()
    model = Params(POLICY_SPECS)
    text = pol.describe(model.named_parameters())
    run_injected(pol, POLICY_SPECS, steps=1)
    stats = pol.stats.per_tensor()
    lines = text.splitlines()
    rows = {cells[0]: cells for cells in (re.split(r"\s{2,}", line.strip()) for line in lines[1:-1])}
    assert list(rows) == [n for n, _ in model.named_parameters()], text
    for spec, (rule, _) in BY_NAME.items():
        name, shape, numel, label, nbytes, comp = rows[spec]
        assert label == ("default" if rule is None else f"rule {rule}"), rows[spec]
        assert int(numel) == int(np.prod(POLICY_SPECS[spec]))
        assert int(nbytes) == stats[spec]["payload_bytes"], (spec, rows[spec], stats[spec])
    total = sum(r["payload_bytes"] for r in stats.values())
    assert f"compressed {total} bytes" in lines[-1], lines[-1]


# --- 2. warmup / schedules -------------------------------------------------------------------------------
@pytest.mark.parametrize("which, bpps", [("explicit", 1), ("explicit", 2), ("dgc_warmup", 1), ("dgc_warmup", 2)])
def test_schedule_switches_at_the_communication_step(which, bpps):
    """Schedule([(0, none()), (3, TopK(0.25)), (6, TopK(0.01))]) and Schedule.dgc_warmup: the
    scheme and payload bytes of every communication follow the phase table; with
    backward_passes_per_step=2 the step counts communications, not backward passes; the
    counters agree across ranks; the aggregates (error feedback carried across phases)
    equal the reference of the accumulated gradients."""
    sched = explicit_schedule() if which == "explicit" else dgc_warmup_schedule()
    steps = 8
    seen = []

    def record(step):
        st = sched.stats.per_tensor()
        seen.append({k: (v["scheme"], v["payload_bytes"]) for k, v in st.items()})

    got = run_injected(sched, SCHED_SPECS, steps=steps, bpps=bpps, on_step=record)
    ad = sched.adapters["torch"]
    counters = everyone([ad.steps[k] for k in sorted(SCHED_SPECS)], name=f"sched.steps.{which}.{bpps}")
    table = phase_table(sched)
    for spec, shape in SCHED_SPECS.items():
        per_rank = [local_grads(spec, shape, r, steps, bpps) for r in range(SIZE)]
        grads = [[per_rank[r][s] for r in range(SIZE)] for s in range(steps)]
        agg, nbytes, residual = schedule_reference(table, grads)
        assert [s[spec] for s in seen] == nbytes, f"{spec}: per-step (scheme, bytes) {[s[spec] for s in seen]}"
        for step in range(steps):
            assert_close(nbytes[step][0], got[step][spec], agg[step], f"{spec} {which} bpps={bpps} step {step}")
        np.testing.assert_allclose(ad.residuals[spec].numpy(), residual[RANK], rtol=1e-6, atol=1e-6,
                                   err_msg=f"{spec}: residual carried across phases")
    assert counters == [[steps] * len(SCHED_SPECS)] * SIZE, counters


def test_schedule_counts_communications_of_unused_parameters_too():
    """The step is each tensor's own count of communications.  A parameter unused in some
    steps is still communicated by Horovod (a zero gradient, from synchronize()), so its
    counter -- and its phase -- stay aligned with the others and across ranks."""
    sched = explicit_schedule()
    model = Params({"early": (20, 20), "late": (20, 20)})
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.0),
                                   named_parameters=model.named_parameters(), compression=sched)
    schemes = []
    for step in range(6):
        opt.zero_grad()
        loss = (model.early * torch.from_numpy(G("early", RANK, step, (20, 20)))).sum()
        if step >= 4:
            loss = loss + (model.late * torch.from_numpy(G("late", RANK, step, (20, 20)))).sum()
        loss.backward()
        opt.synchronize()
        schemes.append({k: v["scheme"] for k, v in sched.stats.per_tensor().items()})
    # Horovod still communicates 'late' every step (a zero gradient when it was not used)
    assert sched.adapters["torch"].steps == {"early": 6, "late": 6}
    assert schemes[-1] == {"early": "TopK", "late": "TopK"}


def test_schedule_into_dgc_starts_and_carries_the_velocity():
    """Schedule([(0, none()), (2, DGC(0.25, m=0.9)), (4, DGC(0.05, m=0.9))]), 6 communications:
    the dense phase keeps no state; the first DGC phase starts from u = v = 0 and the second
    continues from the first's u and v (per-tensor state, carried across phases); each
    phase's sampling draws use the tensor's step.  Aggregates and final u, v == reference."""
    sched = Schedule([(0, hc.none()), (2, hc.DGC(0.25, momentum=0.9)), (4, hc.DGC(0.05, momentum=0.9))])
    steps = 6
    got = run_injected(sched, SCHED_SPECS, steps=steps)
    ad = sched.adapters["torch"]
    for spec, shape in SCHED_SPECS.items():
        draws = torch_uniform_fn(sched, spec)
        per_rank = [local_grads(spec, shape, r, steps) for r in range(SIZE)]
        n = int(np.prod(shape))
        u = [np.zeros(n, f32) for _ in range(SIZE)]
        v = [np.zeros(n, f32) for _ in range(SIZE)]
        for c in range(steps):
            _, comp = [p for p in sched.phases if p[0] <= c][-1]
            sents = []
            for r in range(SIZE):
                g = per_rank[r][c]
                if comp.scheme.name == "NoCompression":
                    sents.append(g)
                    continue
                u[r] = (u[r] * f32(0.9) + g).astype(f32)
                v[r] = (v[r] + u[r]).astype(f32)
                sent = ref.sent("DGC", comp.scheme.config(), v[r], uniform=lambda k, c=c, r=r: draws(c, r, k))
                v[r] = np.where(sent != 0, f32(0), (v[r] - sent).astype(f32)).astype(f32)
                u[r] = np.where(sent != 0, f32(0), u[r]).astype(f32)
                sents.append(sent)
            want = ref.op_scale(comp.scheme.name, ref.aggregate(comp.scheme.name, sents), SIZE)
            np.testing.assert_allclose(got[c][spec].reshape(-1), want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()),
                                       err_msg=f"{spec} communication {c} ({comp.scheme.name})")
        np.testing.assert_allclose(ad.memories["momentum"][spec].numpy(), u[RANK], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(ad.residuals[spec].numpy(), v[RANK], rtol=1e-5, atol=1e-5)


def _mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))


def _dataset():
    rng = np.random.default_rng(2024)
    x = rng.standard_normal((96 * SIZE, 12)).astype(f32)
    w = rng.standard_normal((12, 1)).astype(f32)
    y = (np.tanh(x @ w) + 0.05 * rng.standard_normal((96 * SIZE, 1))).astype(f32)
    return torch.from_numpy(x), torch.from_numpy(y)


X, Y = _dataset()


def _batch(step, micro=0, bpps=1):
    i = (step * bpps + micro) % 6
    lo = RANK * 96 + i * 16
    return X[lo:lo + 16], Y[lo:lo + 16]


def _full_loss(model):
    with torch.no_grad():
        return torch.nn.functional.mse_loss(model(X), Y).item()


def _replicas(model, what):
    w = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return hvd.allgather(w.reshape(1, -1), name=f"training.replicas.{what}")


def train(model, opt, steps, bpps=1, first=0):
    for step in range(first, first + steps):
        opt.zero_grad()
        for micro in range(bpps):
            xb, yb = _batch(step, micro, bpps)
            torch.nn.functional.mse_loss(model(xb), yb).backward()
        opt.step()


def test_policy_with_dgc_schedule_trains_and_replicas_stay_identical():
    """A realistic policy: biases dense, matrices on a warmup schedule into DGC with momentum
    correction (plain SGD, no optimizer momentum), backward_passes_per_step=2."""
    model = _mlp(10 + RANK)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    pol = Policy([Rule(hc.none(), name="*bias"),
                  Rule(Schedule([(0, hc.none()), (2, hc.DGC(0.25, momentum=0.9)), (5, hc.DGC(0.05, momentum=0.9))]),
                       min_ndim=2)])
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                   named_parameters=model.named_parameters(),
                                   compression=pol, backward_passes_per_step=2)
    before = _full_loss(model)
    train(model, opt, steps=15, bpps=2)
    after = _full_loss(model)
    reps = _replicas(model, "policy_dgc_schedule")
    stats = pol.stats.per_tensor()
    assert {k: v["scheme"] for k, v in stats.items()} == {"0.weight": "DGC", "0.bias": "NoCompression",
                                                          "2.weight": "DGC", "2.bias": "NoCompression"}
    assert all(v["calls"] == 15 for v in stats.values()), stats
    assert pol.adapters["torch"].steps == {k: 15 for k in stats}
    assert set(pol.adapters["torch"].memories["momentum"]) == {"0.weight", "2.weight"}
    for r in range(SIZE):
        assert torch.equal(reps[r], reps[0]), f"replica {r} differs"
    assert after < 0.8 * before, f"loss {before:.4f} -> {after:.4f}"


# --- 3. DGC corrections ------------------------------------------------------------------------------------
DGC_SPECS = {"big.weight": (40, 25), "vec": (100,)}


def dgc_reference(comp, spec, shape, steps, bpps=1):
    """Per rank: clip, u = m u + g, v = v + u, DGC's sampled selection of v (the adapter's
    draws), v and u masked where sent; aggregate: sum of the sent over ranks / size."""
    mom, clip = comp.memory.momentum, comp.memory.clip_norm
    cfg = comp.scheme.config()
    draws = torch_uniform_fn(comp, spec)
    per_rank = [local_grads(spec, shape, r, steps, bpps) for r in range(SIZE)]
    n = int(np.prod(shape))
    u = [np.zeros(n, f32) for _ in range(SIZE)]
    v = [np.zeros(n, f32) for _ in range(SIZE)]
    agg = []
    for step in range(steps):
        sents = []
        for r in range(SIZE):
            g = per_rank[r][step]
            if clip is not None:
                norm = np.linalg.norm(g.astype(np.float64))
                if norm > clip:
                    g = (g * f32(clip / norm)).astype(f32)
            u[r] = (u[r] * f32(mom) + g).astype(f32)
            v[r] = (v[r] + u[r]).astype(f32)
            s = ref.sent("DGC", cfg, v[r], uniform=lambda k, s=step, r=r: draws(s, r, k))
            mask = s != 0
            v[r] = np.where(mask, f32(0), (v[r] - s).astype(f32)).astype(f32)
            u[r] = np.where(mask, f32(0), u[r]).astype(f32)
            sents.append(s)
        agg.append(ref.op_scale("DGC", ref.aggregate("DGC", sents), SIZE))
    return agg, u[RANK], v[RANK]


@pytest.mark.parametrize("bpps", [1, 2])
def test_dgc_corrections_aggregate_matches_reference(bpps):
    """DGC(0.05, momentum=0.9, clip_norm=40): 4 communications; the aggregate every rank
    gets, and this rank's velocity u and accumulation v, equal the reference.  ||g|| is
    ~32 on rank 0 and ~47 on rank 1 for the 1000-element tensor (clipped on rank 1 only);
    with backward_passes_per_step=2 the corrections run once per communication, on the
    accumulated gradient."""
    comp = hc.DGC(0.05, momentum=0.9, clip_norm=40.0 if bpps == 1 else 56.0)  # sums of 2: ||g|| x sqrt(2)
    steps = 4
    got = run_injected(comp, DGC_SPECS, steps=steps, bpps=bpps)
    ad = comp.adapters["torch"]
    for spec, shape in DGC_SPECS.items():
        agg, u, v = dgc_reference(comp, spec, shape, steps, bpps)
        for step in range(steps):
            np.testing.assert_allclose(got[step][spec].reshape(-1), agg[step], rtol=1e-5,
                                       atol=1e-5 * float(np.abs(agg[step]).max()),
                                       err_msg=f"{spec} bpps={bpps} step {step}")
        np.testing.assert_allclose(ad.memories["momentum"][spec].numpy(), u, rtol=1e-5, atol=1e-5,
                                   err_msg=f"velocity of {spec}")
        np.testing.assert_allclose(ad.residuals[spec].numpy(), v, rtol=1e-5, atol=1e-5,
                                   err_msg=f"accumulation of {spec}")
    assert ad.steps == {s: steps for s in DGC_SPECS}
    assert {k: r["calls"] for k, r in comp.stats.per_tensor().items()} == {s: steps for s in DGC_SPECS}


def test_dgc_with_plain_sgd_trains_and_replicas_identical():
    """DGC's momentum correction replaces the optimizer's momentum: torch SGD(momentum=0)."""
    model = _mlp(30 + RANK)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    comp = hc.DGC(0.1, momentum=0.9, clip_norm=1.0)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.0),
                                   named_parameters=model.named_parameters(), compression=comp)
    before = _full_loss(model)
    train(model, opt, steps=25)
    after = _full_loss(model)
    reps = _replicas(model, "dgc_plain_sgd")
    for r in range(SIZE):
        assert torch.equal(reps[r], reps[0]), f"replica {r} differs"
    assert after < 0.7 * before, f"loss {before:.4f} -> {after:.4f}"
    mom = comp.adapters["torch"].memories["momentum"]
    assert set(mom) == {n for n, _ in model.named_parameters()}
    assert any(float(m.abs().sum()) > 0 for m in mom.values())


# --- 4. gradient accumulation ---------------------------------------------------------------------------------
@pytest.mark.parametrize("op", ["average", "sum"])
def test_accumulation_compresses_once_per_communication(op):
    """backward_passes_per_step=2, TopK: Horovod sums the two micro-batch gradients in p.grad;
    compress runs once per communication (stats calls, step counters); error feedback is
    applied once, to the sum (residual == reference of the accumulated gradient)."""
    comp = hc.TopK(0.05)
    steps = 3
    got = run_injected(comp, SCHED_SPECS, steps=steps, bpps=2, op=hvd.Sum if op == "sum" else hvd.Average)
    ad = comp.adapters["torch"]
    for spec, shape in SCHED_SPECS.items():
        sim, _ = ref_simulate(comp, spec, shape, list(range(SIZE)), steps=steps, bpps=2, op=op)
        for step in range(steps):
            assert_close("TopK", got[step][spec], sim.aggregated[step], f"{spec} op={op} step {step}")
        np.testing.assert_allclose(ad.residuals[spec].numpy(), sim.residuals[RANK], rtol=1e-6, atol=1e-5,
                                   err_msg=f"{spec}: residual of the accumulated gradient")
    assert {k: r["calls"] for k, r in comp.stats.per_tensor().items()} == {s: steps for s in SCHED_SPECS}
    assert ad.steps == {s: steps for s in SCHED_SPECS}


# --- 5. checkpoints ----------------------------------------------------------------------------------------
def _policy_schedule():
    return Policy([Rule(hc.none(), name="*bias"),
                   Rule(Schedule([(0, hc.none()), (3, hc.TopK(0.1))]), min_ndim=2)])


CKPT = {  # id -> (compression factory, optimizer momentum)
    "TopK": (lambda: hc.TopK(0.1), 0.9),
    "PowerSGD": (lambda: hc.PowerSGD(rank=2), 0.9),
    "DGC": (lambda: hc.DGC(0.1, momentum=0.9, clip_norm=2.0), 0.0),
    "Policy-Schedule": (_policy_schedule, 0.9),
}
N_BEFORE, M_AFTER = 3, 3


def _build(cid, seed):
    make, momentum = CKPT[cid]
    model = _mlp(seed)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    comp = make()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=momentum),
                                   named_parameters=model.named_parameters(), compression=comp)
    return model, opt, comp


def _weights(model):
    return [p.detach().clone() for p in model.parameters()]


def _plain(obj, path="state"):
    """Only dicts, strings and tensors: nothing that needs pickle."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            assert isinstance(k, str), f"{path}: key {k!r}"
            _plain(v, f"{path}/{k}")
    else:
        assert isinstance(obj, (str, torch.Tensor)), f"{path}: {type(obj).__name__}"


@pytest.mark.parametrize("cid", list(CKPT))
def test_checkpoint_resume_is_bit_identical(cid):
    """Train N steps, save model + optimizer + compressor.state_dict() with torch.save, build
    a fresh model/optimizer/compressor (other initial weights), load with
    torch.load(weights_only=True) (no pickled objects accepted), train M more: the weights
    equal an uninterrupted N+M run bit for bit.  Without the compressor's state they do not
    (residuals, DGC velocities, PowerSGD's Q and the step counters matter)."""
    model, opt, comp = _build(cid, seed=1)
    train(model, opt, N_BEFORE + M_AFTER)
    straight = _weights(model)

    model, opt, comp = _build(cid, seed=1)
    train(model, opt, N_BEFORE)
    state = comp.state_dict()
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "hvd_compress": state}, buf)

    model, opt, comp = _build(cid, seed=2)
    blob = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    model.load_state_dict(blob["model"])
    opt.load_state_dict(blob["optimizer"])
    comp.load_state_dict(blob["hvd_compress"])
    train(model, opt, M_AFTER, first=N_BEFORE)
    resumed = _weights(model)

    model, opt, comp2 = _build(cid, seed=2)  # control: the compressor's state left out
    model.load_state_dict(blob["model"])
    opt.load_state_dict(blob["optimizer"])
    train(model, opt, M_AFTER, first=N_BEFORE)
    forgetful = _weights(model)

    _plain(state)
    json.loads(state["config"])
    keys = set(state["torch"])
    assert any(k.startswith("step/") for k in keys), keys
    if cid in ("TopK", "DGC", "PowerSGD"):
        assert {k for k in keys if k.startswith("residual/")} == {"residual/0.weight", "residual/0.bias",
                                                                   "residual/2.weight", "residual/2.bias"}, keys
    if cid == "DGC":
        assert {k for k in keys if k.startswith("memory/momentum/")} == {
            "memory/momentum/0.weight", "memory/momentum/0.bias", "memory/momentum/2.weight",
            "memory/momentum/2.bias"}, keys
    if cid == "PowerSGD":
        assert "scheme/0.weight/Q" in keys and state["torch"]["scheme/0.weight/Q"].shape == (12, 2), keys
    for a, b in zip(resumed, straight):
        assert torch.equal(a, b), f"{cid}: resumed weights differ from the uninterrupted run"
    assert any(not torch.equal(a, b) for a, b in zip(forgetful, straight)), \
        f"{cid}: the run without the compressor state is identical -- the test would not catch a lost state"


@pytest.mark.parametrize("saved, loading", [
    (lambda: hc.TopK(0.1), lambda: hc.TopK(0.05)),
    (lambda: hc.TopK(0.1), lambda: hc.TopK(0.1, error_feedback=False)),
    (lambda: hc.DGC(0.1, momentum=0.9), lambda: hc.DGC(0.1, momentum=0.8)),
    (_policy_schedule, lambda: Policy([Rule(hc.none(), name="*bias"),
                                       Rule(Schedule([(0, hc.none()), (4, hc.TopK(0.1))]), min_ndim=2)])),
])
def test_load_state_dict_of_another_configuration_is_refused(saved, loading):
    comp = saved()
    run_injected(comp, {"w": (10, 10)}, steps=1)
    state = comp.state_dict()
    other = loading()
    with pytest.raises(ValueError, match="different configuration"):
        other.load_state_dict(state)
    assert other.adapters == {} or all(not ad.steps for ad in other.adapters.values())
    saved().load_state_dict(state)  # the same configuration loads


def test_state_dict_of_another_rank_is_refused():
    comp = hc.TopK(0.1)
    run_injected(comp, {"w": (10, 10)}, steps=1)
    states = hvd.allgather_object(comp.state_dict(), name="training.states_of_all_ranks")
    fresh = hc.TopK(0.1)
    with pytest.raises(ValueError, match="saved by rank"):
        fresh.load_state_dict(states[(RANK + 1) % SIZE])
    fresh.load_state_dict(states[RANK])  # its own loads
    hc.TopK(0.1).load_state_dict(states[(RANK + 1) % SIZE], allow_other_rank=True)  # the escape hatch
