"""hvd_compress/costmodel/step_plan.py: the step's plan by the one cost model, with the
rounds a step's tensors share charged once, against the tensor-by-tensor
choice and a brute-force search."""
from __future__ import annotations

import itertools
import random

import pytest

from hvd_compress.auto import Link, default_candidates, plan
from hvd_compress.auto.planner import choose, tensor_options
from hvd_compress.costmodel.model import LINK_ONLY, shared_host, step_cost, tensor_cost
from hvd_compress.costmodel.step_plan import plan_step

#: eight 1024 x 1024 matrices: a model whose PowerSGD rounds Horovod fuses
MATRICES = {f"layer{i}.weight": (1 << 20, (1024, 1024)) for i in range(8)}
#: 100 Mbit/s, and ring steps of 3 ms (ranks waiting for a core)
SLOW_HIGH_LATENCY = Link(latency_s=3e-3, bytes_per_s=100e6 / 8)


def _codecs(tensors, candidates, per_element_s=2e-9):
    return {k: {c.label: (0.0 if c.label == "none" else per_element_s * numel) for c in candidates}
            for k, (numel, _) in tensors.items()}


def _step_seconds(labels, tensors, workers, link, candidates, codecs, machine=LINK_ONLY):
    costs = [tensor_options(*tensors[k], workers, link, candidates, codecs[k], machine)[labels[k]]
             for k in sorted(tensors)]
    return step_cost(costs, machine).seconds


def test_shared_rounds_make_powersgd_win_where_tensor_by_tensor_picks_topk():
    """Charged per tensor, PowerSGD's two extra rounds (2 x 2 (N-1) ring steps of
    3 ms at N = 4) look dearer than Top-K's bytes; once per step they are not."""
    cands = default_candidates(topk_ratios=(0.01,), fp16=False, int8=False, two_phase=False)
    codecs = _codecs(MATRICES, cands)
    one_by_one = {k: choose(*MATRICES[k], 4, SLOW_HIGH_LATENCY, cands, codecs[k]).label for k in MATRICES}
    assert set(one_by_one.values()) == {"TopK(0.01)"}
    step = {k: c.label for k, c in plan(MATRICES, 4, SLOW_HIGH_LATENCY, cands, codecs).items()}
    assert set(step.values()) == {"PowerSGD(4)"}
    assert (_step_seconds(step, MATRICES, 4, SLOW_HIGH_LATENCY, cands, codecs)
            < _step_seconds(one_by_one, MATRICES, 4, SLOW_HIGH_LATENCY, cands, codecs))


def test_without_latency_or_margin_the_step_plan_is_the_tensor_by_tensor_one():
    cands = default_candidates()
    link = Link(latency_s=0.0, bytes_per_s=1e9 / 8)
    tensors = dict(MATRICES, bias=(1024, (1024,)), embed=(1 << 22, (4096, 1024)))
    codecs = _codecs(tensors, cands)
    one_by_one = {k: choose(*tensors[k], 8, link, cands, codecs[k], min_gain=0.0).label for k in tensors}
    assert len(set(one_by_one.values())) > 1  # a mix: the step's margin (min_gain) is off here
    assert {k: c.label for k, c in plan(tensors, 8, link, cands, codecs, min_gain=0.0).items()} == one_by_one


@pytest.mark.parametrize("seed", range(12))
def test_the_search_finds_the_cheapest_step_of_all_plans(seed):
    """Against every assignment of 4 tensors to 4 transports: nothing cheaper
    (with min_gain 0) exists, and the plan never costs more than all ``none``."""
    rng = random.Random(seed)
    workers = rng.choice([2, 4, 8, 16])
    link = Link(latency_s=rng.choice([0.0, 5e-5, 3e-3]), bytes_per_s=rng.choice([12.5e6, 125e6, 1.25e9]))
    machine = rng.choice([LINK_ONLY, shared_host(workers, 2)])
    options = []
    for _ in range(4):
        numel = rng.choice([1 << 10, 1 << 16, 1 << 20, 1 << 22])
        opts = {}
        for label, transport, payload in (("none", "allreduce", 4.0 * numel),
                                          ("topk", "allgather", 0.08 * numel),
                                          ("topk/two_phase", "two_phase", 0.08 * numel),
                                          ("powersgd", "powersgd", 0.02 * numel)):
            codec = 0.0 if label == "none" else rng.uniform(0.5, 4.0) * 1e-9 * numel
            opts[label] = tensor_cost(transport, payload, workers, link, machine, codec_s=codec)
        options.append(opts)
    got = plan_step(options, machine, min_gain=0.0)
    got_s = step_cost([o[k] for o, k in zip(options, got)], machine).seconds
    brute = min(step_cost([o[k] for o, k in zip(options, labels)], machine).seconds
                for labels in itertools.product(*[list(o) for o in options]))
    assert got_s <= brute * (1 + 1e-9)
    assert got_s <= step_cost([o["none"] for o in options], machine).seconds


def test_min_gain_keeps_each_tensors_margin():
    link = Link(latency_s=0.0, bytes_per_s=125e6)
    none = tensor_cost("allreduce", 4e6, 4, link)
    close = tensor_cost("allgather", 0.1e6, 4, link,
                        codec_s=none.own_s * 0.95 - tensor_cost("allgather", 0.1e6, 4, link).own_s)
    assert close.own_s == pytest.approx(none.own_s * 0.95)
    assert plan_step([{"none": none, "topk": close}], min_gain=0.1) == ["none"]
    assert plan_step([{"none": none, "topk": close}], min_gain=0.01) == ["topk"]


def test_bad_input_names_the_parameter():
    cost = tensor_cost("allreduce", 4e3, 2, Link(0.0, 1e9))
    with pytest.raises(ValueError, match="min_gain"):
        plan_step([{"none": cost}], min_gain=1.0)
    with pytest.raises(ValueError, match="lacks the 'none' candidate"):
        plan_step([{"topk": cost}])


def test_a_tiny_tensor_stays_dense_beside_a_compressed_one():
    """The big tensor pays the allgather's rounds; an 8-element bias would join
    them for free but for the collectives it would enter (ENTRY_S each)."""
    cands = default_candidates(topk_ratios=(0.01,), powersgd_rank=None, fp16=False, int8=False)
    tensors = {"w": (1 << 20, (1024, 1024)), "b": (8, (8,))}
    choices = plan(tensors, 4, SLOW_HIGH_LATENCY, cands, _codecs(tensors, cands))
    assert choices["w"].label != "none" and choices["b"].label == "none"


def test_each_candidate_a_plan_adds_must_pay_min_gain_of_the_step():
    """A second transport that makes the step only a little faster is left
    out: its collectives and cycles are where the model errs most."""
    link = Link(latency_s=0.0, bytes_per_s=125e6)
    big_none = tensor_cost("allreduce", 40e6, 4, link)
    big_lowrank = tensor_cost("powersgd", 0.4e6, 4, link, codec_s=1e-3)
    small_none = tensor_cost("allreduce", 40e3, 4, link)
    # the small tensor on an allgather: its own cost well under none's, but the
    # step gains only a few percent of the PowerSGD plan's time
    small_gather = tensor_cost("allgather", 400, 4, link, codec_s=1e-4)
    options = [{"none": big_none, "powersgd": big_lowrank}, {"none": small_none, "topk": small_gather}]
    alone = step_cost([big_lowrank, small_none]).seconds
    mixed = step_cost([big_lowrank, small_gather]).seconds
    assert small_gather.own_s < 0.5 * small_none.own_s and 0.9 * alone < mixed < alone
    assert plan_step(options, min_gain=0.1) == ["powersgd", "none"]
    assert plan_step(options, min_gain=0.01) == ["powersgd", "topk"]
