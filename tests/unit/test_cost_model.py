"""The one cost model (hvd_compress/costmodel/model.py) against hand-computed
cases, and the two users that must go through it: Auto's planner and
``hvd-compress advise``."""
from __future__ import annotations

import math

import pytest

from hvd_compress.costmodel import model as cm
from hvd_compress.costmodel.model import Link, Machine
from hvd_compress.tools.projection import gpu_codec_seconds

MB = 1e6
#: the hand-computed cases leave out the cost per collective entry (tested on its own)
NO_ENTRY = Machine(entry_s=0.0)


@pytest.mark.parametrize("transport, wire", [("allreduce", 1500.0), ("allgather", 3000.0), ("two_phase", 1500.0),
                                             ("powersgd", 1500.0)])
def test_wire_bytes_per_transport_at_four_workers(transport, wire):
    # 2 (N-1)/N = 1.5 and N-1 = 3 at N = 4, of a 1000-byte payload
    assert cm.wire_bytes(transport, 1000, 4) == wire
    assert cm.wire_bytes(transport, 1000, 1) == 0.0


@pytest.mark.parametrize("transport, extra, steps", [("allreduce", 0, 6), ("allgather", 0, 9), ("allgather", 2, 15),
                                                     ("two_phase", 0, 12), ("powersgd", 0, 18)])
def test_latency_steps_at_four_workers(transport, extra, steps):
    # allgather: 3 + the placeholder's 6 (+ 3 per length allgather); two-phase: alltoall 3 + allgather 3 +
    # placeholder 6; PowerSGD: two allreduces (6 each) + placeholder
    assert cm.latency_steps(transport, 4, extra) == steps


def test_comm_time_is_latency_steps_plus_bytes_over_bandwidth():
    wire, seconds = cm.comm_time("allreduce", 1 * MB, 4, 1 * MB, 1e-3)
    assert wire == 1.5 * MB and seconds == pytest.approx(1.5 + 6e-3)
    wire, seconds = cm.comm_time("allgather", 1 * MB, 4, 1 * MB, 1e-3)
    assert wire == 3 * MB and seconds == pytest.approx(3.0 + 9e-3)
    assert cm.comm_time("allgather", 1 * MB, 1, 1 * MB, 1e-3) == (0.0, 0.0)


def test_codec_seconds_count_the_decodes_each_transport_runs():
    # encode 1 s, decode 0.5 s, N = 4
    assert cm.codec_seconds("allreduce", 1.0, 0.5, 4) == 1.5
    assert cm.codec_seconds("powersgd", 1.0, 0.5, 4) == 1.5
    assert cm.codec_seconds("allgather", 1.0, 0.5, 4) == 1.0 + 4 * 0.5
    assert cm.codec_seconds("two_phase", 1.0, 0.5, 4) == pytest.approx(1.25 + 1.0)


def test_the_collectives_own_cpu_cost_per_byte_received():
    m = Machine(reduce_s_per_byte=1e-9, reduce_half_s_per_byte=4e-9, gather_s_per_byte=2e-9)
    assert cm.collective_cpu_seconds("allreduce", 1 * MB, 4, m) == pytest.approx(1.5e-3)
    assert cm.collective_cpu_seconds("allreduce", 1 * MB, 4, m, half=True) == pytest.approx(6e-3)
    assert cm.collective_cpu_seconds("allgather", 1 * MB, 4, m) == pytest.approx(6e-3)
    assert cm.collective_cpu_seconds("two_phase", 1 * MB, 4, m) == pytest.approx(3e-3)
    assert cm.collective_cpu_seconds("allgather", 1 * MB, 4, cm.LINK_ONLY) == 0.0


def test_tensor_cost_adds_link_codec_collective_and_the_extra_round():
    m = Machine(gather_s_per_byte=1e-9, cycle_s=2e-3, entry_s=0.0)
    link = Link(1e-4, 10 * MB)
    c = cm.tensor_cost("two_phase", 1 * MB, 4, link, m, encode_s=0.01, decode_s=0.02)
    assert c.wire_bytes == 1.5 * MB
    assert c.link_s == pytest.approx(12 * 1e-4 + 0.15)
    assert c.codec_s == pytest.approx(0.01 * 1.25 + 2 * 0.02)
    assert c.collective_s == pytest.approx(1.5e-3)
    assert c.rounds_s == 2e-3  # its second round waits one more cycle
    assert c.total_s == pytest.approx(c.link_s + c.codec_s + c.collective_s + 2e-3)
    assert cm.tensor_cost("allgather", 1 * MB, 4, link, m).rounds_s == 0.0
    # a measured codec total replaces encode/decode
    assert cm.tensor_cost("allgather", 1 * MB, 4, link, m, encode_s=9.0, codec_s=0.25).codec_s == 0.25


def test_step_cost_fuses_the_allreduce_latency_and_waits_one_cycle():
    link = Link(1e-3, 1 * MB)
    costs = [cm.tensor_cost("allreduce", 100, 2, link, NO_ENTRY) for _ in range(3)]
    # each: 2 (N-1) = 2 latency steps (2 ms) + 100 B at 1 MB/s
    assert costs[0].total_s == pytest.approx(2e-3 + 100 / MB)
    fused = cm.step_cost(costs, Machine(cycle_s=1e-3))
    assert fused.fusion_saved_s == pytest.approx(2 * 2e-3)  # one buffer: the latency once, not three times
    assert fused.seconds == pytest.approx(2e-3 + 300 / MB + 1e-3)
    two_buffers = cm.step_cost(costs, Machine(fusion_bytes=150))
    assert two_buffers.fusion_saved_s == pytest.approx(2e-3)
    unfused = cm.step_cost(costs, Machine(fusion_bytes=0))
    assert unfused.seconds == pytest.approx(3 * (2e-3 + 100 / MB))
    assert cm.step_cost([], Machine()).seconds == 0.0


def test_step_cost_shares_the_allgather_two_phase_and_powersgd_latency_across_tensors():
    link = Link(1e-3, 1 * MB)
    # N = 4: an allgather's own 3 latency steps and its placeholder's 6; two-phase 3 + 3 and 6
    gathers = [cm.tensor_cost("allgather", 100, 4, link) for _ in range(3)]
    assert gathers[0].shared_latency_s == pytest.approx(3e-3)
    step = cm.step_cost(gathers, Machine())
    assert step.fusion_saved_s == pytest.approx(2 * 3e-3 + 2 * 6e-3)  # each shared once, not three times
    phases = [cm.tensor_cost("two_phase", 100, 4, link) for _ in range(2)]
    assert phases[0].shared_latency_s == pytest.approx(6e-3)
    assert cm.step_cost(phases, Machine()).fusion_saved_s == pytest.approx(6e-3 + 6e-3)
    # PowerSGD: its P and Q rounds (2 x 6 latency steps) once per step
    lowrank = [cm.tensor_cost("powersgd", 100, 4, link) for _ in range(3)]
    assert lowrank[0].shared_latency_s == pytest.approx(12e-3)
    assert cm.step_cost(lowrank, Machine()).fusion_saved_s == pytest.approx(2 * 12e-3 + 2 * 6e-3)
    # per tensor the allgather latency stays: a tensor alone on its transport pays it
    assert gathers[0].marginal_s == pytest.approx(gathers[0].total_s - 6e-3)
    # its own cost leaves out everything a step pays once
    assert gathers[0].own_s == pytest.approx(gathers[0].total_s - 9e-3)


def test_ranks_sharing_cores_stretch_cpu_work_and_wait_per_ring_step():
    # no cores named: every rank has its own, no sharing, no wait (the projection, advise's CLI, Auto's default)
    assert Machine(core_wait_s=1.0).cpu_share(8) == 1.0 and Machine(core_wait_s=1.0).step_wait_s(8) == 0.0
    m = Machine(cpus=2, core_wait_s=1e-3)
    assert m.cpu_share(8) == 4.0 and m.cpu_share(2) == 1.0
    # 8 ranks + 4 tasks of other work on 2 cores: 5 runnable tasks beyond one a core
    assert Machine(cpus=2, background_load=4.0, core_wait_s=1e-3).step_wait_s(8) == pytest.approx(5e-3)
    assert m.step_wait_s(2) == 0.0 and m.step_wait_s(1) == 0.0  # a core each: no wait
    # ranks_per_host: 2 of the 16 workers on each 1-core host
    h = Machine(cpus=1, ranks_per_host=2, core_wait_s=1e-3)
    assert h.cpu_share(16) == 2.0 and h.step_wait_s(16) == pytest.approx(1e-3)


def test_shared_host_is_no_sharing_unless_the_ranks_outnumber_the_cores():
    assert cm.shared_host(2, 2) is cm.LINK_ONLY and cm.shared_host(1, 64) is cm.LINK_ONLY
    assert cm.shared_host(None, 2) is cm.LINK_ONLY and cm.shared_host(4, None) is cm.LINK_ONLY
    m = cm.shared_host(8, 2)
    assert (m.cpus, m.ranks_per_host, m.core_wait_s) == (2, 8, cm.CORE_WAIT_S)
    assert m.step_wait_s(8) == pytest.approx(3 * cm.CORE_WAIT_S)
    assert cm.shared_host(3, 2, base=cm.GPU_NCCL).cycle_s == cm.GPU_NCCL.cycle_s


def test_machine_of_counts_the_ranks_that_share_a_kernel():
    from hvd_compress.costmodel import machine
    """Ranks on one machine share its kernel whatever host names Horovod sees
    (containers, network namespaces): the most crowded kernel sets the
    sharing, never fewer ranks than ``local_size``."""
    a, b = 11, 22
    four_on_one = machine.machine_of([a, a, a, a], 1, 2)  # 4 emulated hosts, local_size 1 each, 2 cores
    assert (four_on_one.cpus, four_on_one.ranks_per_host) == (2, 4)
    assert four_on_one.core_wait_s == 0.0  # Auto's link fit, timed on the shared cores, holds the waits
    assert machine.machine_of([a, b, a, b], 1, 2) is cm.LINK_ONLY  # 2 ranks a machine, 2 cores each
    assert machine.machine_of([a, a, a, b], 1, 2).ranks_per_host == 3  # the busiest machine
    assert machine.machine_of([a, b], 3, 2).ranks_per_host == 3  # Horovod's count where it is larger
    assert machine.machine_of([], 1, None) is cm.LINK_ONLY
    # gathered from every rank: the same machine on every rank, the fewest cores and the largest local_size
    rows = [[a, 2, 1], [a, 4, 1], [a, 4, 1], [a, 4, 1], [b, 2, 3]]
    assert machine.agreed_machine(rows) == machine.machine_of([a, a, a, a, b], 3, 2)
    assert machine.agreed_machine(rows).ranks_per_host == 4 and machine.agreed_machine(rows).cpus == 2
    assert machine.this_rank(5)[1:] == [machine.usable_cpus(), 5]


def test_kernel_id_is_stable_in_a_process_and_an_integer():
    from hvd_compress.costmodel import machine
    assert machine.kernel_id() == machine.kernel_id() and 0 <= machine.kernel_id() < 2 ** 63
    assert machine.usable_cpus() >= 1


def test_each_ring_step_waits_for_a_core_and_fusion_shares_the_wait():
    link = Link(0.0, 1 * MB)
    m = Machine(cpus=1, core_wait_s=1e-3, entry_s=0.0)  # 4 ranks on 1 core: 3 ms a ring step
    assert cm.phases("allgather", 1) == ("allreduce:float32", "allgather", "allgather:lengths")
    assert cm.phases("allreduce", half=True) == ("allreduce:float16",)
    topk = [cm.tensor_cost("allgather", 100, 4, link, m, extra_allgathers=1) for _ in range(3)]
    none = cm.tensor_cost("allreduce", 100, 4, link, m)
    # per tensor: every latency step (allgather 3 + lengths 3 + placeholder 6; allreduce 6)
    assert topk[0].wait_s == pytest.approx(12 * 3e-3) and none.wait_s == pytest.approx(6 * 3e-3)
    assert topk[0].link_s == pytest.approx(topk[0].wire_bytes / MB + 12 * 3e-3)
    step = cm.step_cost(topk + [none], m)
    # fused: one allreduce ring for the placeholders and one for the dense tensor (6 + 6 steps),
    # and one gather of each kind (3 + 3 steps)
    assert step.wait_s == pytest.approx(18 * 3e-3)
    assert step.seconds == pytest.approx(step.link_s + step.wait_s)
    assert cm.step_cost(topk, m).wait_s == pytest.approx(12 * 3e-3)
    assert cm.step_cost([none], m).wait_s == pytest.approx(6 * 3e-3)
    alone = [cm.tensor_cost("allgather", 100, 4, link, Machine(), extra_allgathers=1) for _ in range(3)]
    assert cm.step_cost(alone, Machine()).wait_s == 0.0 and alone[0].wait_s == 0.0


def test_gpu_codec_is_passes_times_bytes_over_memory_bandwidth():
    # 1e9 elements, 2 passes of 4 bytes, 2 TB/s: 4 ms, + 3 launches of 5 us
    assert gpu_codec_seconds(1e9, 2, memory_bytes_per_s=2e12, launches=3) == pytest.approx(4e-3 + 15e-6)


def test_fit_constant_is_a_slope_through_the_origin():
    assert cm.fit_constant([1, 2, 3], [2, 4, 6]) == pytest.approx(2.0)
    assert cm.fit_constant([], []) is None
    assert cm.fit_constant([1, 2], [-1, -2]) == 0.0  # never a negative cost


def test_bad_input_names_the_parameter():
    with pytest.raises(ValueError, match="transport must be one of"):
        cm.wire_bytes("ring", 10, 2)
    with pytest.raises(ValueError, match="workers must be an integer >= 1"):
        cm.wire_bytes("allreduce", 10, 0)
    with pytest.raises(ValueError, match="payload must be a number of bytes"):
        cm.wire_bytes("allreduce", None, 2)


# ----------------------------------------------------------------------------- the users
def test_the_planner_predicts_through_the_model():
    from hvd_compress.auto.planner import predict_comm
    from hvd_compress.schemes import TopK
    link = Link(50e-6, 100 * MB / 8)
    topk = TopK(0.01)
    numel, shape, n = 1 << 22, (2048, 2048), 8
    payload, seconds = predict_comm(topk, numel, shape, n, link, "two_phase")
    chunk = topk.payload_nbytes(-(-numel // n))
    assert payload == 4 + n * chunk
    # what the tensor adds to a fused step: the allreduce part's latency is shared
    assert seconds == pytest.approx(cm.tensor_cost("two_phase", payload, n, link).total_s - 2 * (n - 1) * 50e-6)
    payload, seconds = predict_comm(topk, numel, shape, n, link)
    assert payload == topk.payload_nbytes(numel) + 4
    assert seconds == pytest.approx(cm.tensor_cost("allgather", payload, n, link).marginal_s)


def test_the_planner_chooses_the_transport_by_the_number_of_workers():
    """A 4M-element tensor at 100 Mbit/s with TopK(0.01) at 1 ns an element:
    allgather moves (N-1) payloads, two-phase about 2 in one more round.  At
    N = 2 both move one payload and allgather has fewer rounds; at N = 8
    allgather moves 7 payloads (about 2.4 MB, 0.19 s), two-phase 1.75 (0.05 s)."""
    from hvd_compress.auto.planner import choose, default_candidates
    link = Link(50e-6, 100 * MB / 8)
    numel, shape = 1 << 22, (2048, 2048)
    cands = [c for c in default_candidates(topk_ratios=(0.01,), powersgd_rank=None, fp16=False, int8=False)]
    assert [c.label for c in cands] == ["none", "TopK(0.01)", "TopK(0.01)/two_phase"]
    codec = {c.label: 1e-9 * numel for c in cands[1:]}
    assert choose(numel, shape, 2, link, cands, codec).label == "TopK(0.01)"
    assert choose(numel, shape, 8, link, cands, codec).label == "TopK(0.01)/two_phase"


def test_on_a_host_whose_ranks_share_cores_every_ring_step_waits():
    """TopK(0.01) saves most of a 128 KB tensor's 0.17 s at 1 MB/s on N = 3;
    where two ranks share a core and each ring step waits 0.2 s for the next
    rank's turn, the allgather's and two-phase's extra ring steps cost more
    than it saves."""
    from hvd_compress.auto.planner import choose, default_candidates, predict_cost
    link = Link(1e-4, 1 * MB)
    numel, shape = 64 * 512, (64, 512)
    cands = [c for c in default_candidates(topk_ratios=(0.01,), powersgd_rank=None, fp16=False, int8=False)]
    codec = {c.label: 1e-9 * numel for c in cands[1:]}
    shared = cm.shared_host(2, 1, NO_ENTRY, core_wait_s=0.2)  # one task beyond one a core: 0.2 s a step
    assert choose(numel, shape, 3, link, cands, codec, machine=NO_ENTRY).label != "none"
    assert choose(numel, shape, 3, link, cands, codec, machine=shared).label == "none"
    for cand in cands:
        alone = predict_cost(cand.scheme, numel, shape, 3, link, cand.transport, machine=NO_ENTRY)
        sharing = predict_cost(cand.scheme, numel, shape, 3, link, cand.transport, machine=shared)
        steps = round((alone.link_s - alone.wire_bytes / link.bytes_per_s) / link.latency_s)
        assert steps >= 4 and sharing.wait_s == pytest.approx(steps * 0.2), cand.label
        assert sharing.link_s - alone.link_s == pytest.approx(steps * 0.2), cand.label


def test_advise_gives_a_measured_row_the_machine_it_ran_on():
    from hvd_compress.tools import advise
    row = {"workers": 8, "cpus": 2, "loadavg_1m_before": 4.0}
    m = advise.row_machine(row, advise.CPU_GLOO)
    assert (m.cpus, m.ranks_per_host, m.background_load) == (2, 8, 4.0)
    assert m.step_wait_s(8) == pytest.approx(5 * cm.CORE_WAIT_S)
    assert advise.row_machine(row, cm.LINK_ONLY) is cm.LINK_ONLY
    assert advise.row_machine({"workers": 8}, advise.CPU_GLOO) is advise.CPU_GLOO
    assert advise.CPU_GLOO.step_wait_s(8) == 0.0  # the CLI: no sharing unless a row or the caller says so


def test_advise_predicts_through_the_model():
    from hvd_compress.tools import advise
    m = Machine(reduce_s_per_byte=2e-9, cycle_s=1e-3)
    p = advise.predict("none", 1_000_000, 4, 1e9, 1e-4, machine=m)
    c = cm.tensor_cost("allreduce", 4e6, 4, Link(1e-4, 1e9), m)
    assert p.comm_s == pytest.approx(c.link_s + c.collective_s) and p.total_s == pytest.approx(p.comm_s)
    two = advise.predict("TopK(0.01)/two_phase", 1_000_000, 4, 1e9, 1e-4, machine=m, codec=(1e-3, 1e-4))
    assert two.transport == "two_phase" and two.cost.rounds_s == 1e-3
    assert two.overhead_s == pytest.approx(cm.codec_seconds("two_phase", 1e-3, 1e-4, 4))
    with pytest.raises(ValueError, match="two-phase transport needs a fixed-size allgather scheme"):
        advise.predict("hvd_fp16/two_phase", 1000, 4, 1e9)


def test_advise_gpu_model_projection_ranks_allgather_int8_behind_none_and_compresses_on_a_slow_link():
    from hvd_compress.tools import advise
    from hvd_compress.tools.projection import GPU_SCHEMES, MODELS, gpu_codec
    layers = MODELS["resnet50"].layers()
    assert sum(layer[1] for layer in layers) == 25_557_032  # torchvision's resnet50
    fast = advise.advise(layers, 8, 100e9 / 8, 5e-6, None, GPU_SCHEMES, 0.1, cm.GPU_NCCL, codec_of=gpu_codec)
    # an Int8 allgather at 8 workers receives 7 x 1 byte an element, a ring allreduce 1.75 x 4: no gain, plus codec
    assert fast.totals["Int8"]["total_s"] > fast.totals["none"]["total_s"]
    assert fast.totals["Int8"]["wire_bytes"] == pytest.approx(fast.totals["none"]["wire_bytes"], rel=0.01)
    slow = advise.advise(layers, 64, 1e9 / 8, 5e-6, None, GPU_SCHEMES, 0.1, cm.GPU_NCCL, codec_of=gpu_codec)
    assert slow.plan_total_s < 0.5 * slow.none_total_s
    assert math.isfinite(slow.totals["TopK(0.01)/two_phase"]["total_s"])


def test_advise_predicts_an_auto_row_from_the_plan_it_printed():
    """A bench row of Auto carries ``Auto.describe()``'s table: the model reads
    each tensor's shape and chosen candidate (transport included) from it."""
    from hvd_compress.auto.planner import Choice, format_plan
    from hvd_compress.tools import advise
    tensors = {"fc.weight": (1 << 20, (1024, 1024)), "fc.bias": (1024, (1024,)), "emb": (1 << 18, (512, 512))}
    choices = {"fc.weight": Choice("TopK(0.01)/two_phase", 0.01, 0.1, 1000.0),
               "fc.bias": Choice("none", 1e-4, 1e-4, 4096.0), "emb": Choice("Int8", 0.01, 0.02, 262148.0)}
    text = "Auto plan version 0, in force from communication 6\n" + format_plan(choices, tensors, Link(1e-4, 1e7))
    assert sorted(advise.auto_plan_tensors(text)) == sorted(
        [(1 << 20, (1024, 1024), "TopK(0.01)/two_phase"), (1024, (1024,), "none"), (1 << 18, (512, 512), "Int8")])
    row = {"scheme": "Auto()", "transport": "mixed", "workers": 4, "link_mbit": 100.0, "model_params": 1 << 21,
           "auto_plan": text, "encode_s_per_step": 0.01, "decode_s_per_step": 0.02}
    step, known = advise.predict_row(row, None, cm.LINK_ONLY)
    parts = [advise.predict(s, n, 4, 100e6 / 8, 50e-6, codec=(0.0, 0.0), shape=sh).cost
             for n, sh, s in advise.auto_plan_tensors(text)]
    assert known and step.seconds == pytest.approx(cm.step_cost(parts).seconds + 0.03)
    assert advise.auto_plan_tensors("Auto: calibrating (3 steps before the first plan)") is None


def test_each_collective_a_tensor_enters_costs_an_entry():
    """ENTRY_S per collective a tensor enters (its phases), as CPU work: a
    dense tensor one, allgather Top-K with its lengths three, two-phase and
    PowerSGD three (the placeholder and two rounds)."""
    link = Link(0.0, 1 * MB)
    m = Machine(entry_s=1e-3)
    for transport, extra, entries in (("allreduce", 0, 1), ("allgather", 0, 2), ("allgather", 1, 3),
                                      ("two_phase", 0, 3), ("powersgd", 0, 3)):
        with_entries = cm.tensor_cost(transport, 100, 4, link, m, extra_allgathers=extra)
        without = cm.tensor_cost(transport, 100, 4, link, NO_ENTRY, extra_allgathers=extra)
        assert with_entries.collective_s - without.collective_s == pytest.approx(entries * 1e-3), transport
    # ranks sharing cores: CPU work, so it takes max(1, R/C) times as long
    shared = cm.shared_host(4, 2, m)
    assert cm.tensor_cost("allreduce", 100, 4, link, shared).collective_s == pytest.approx(2e-3)
    assert cm.tensor_cost("allreduce", 100, 1, link, m).collective_s == 0.0  # one rank: no collective
    assert Machine().entry_s == cm.ENTRY_S > 0


def test_a_link_fitted_on_shared_cores_keeps_at_least_the_wait_for_a_core():
    from hvd_compress.costmodel import machine
    shared = cm.shared_host(4, 2, core_wait_s=0.0)  # Auto's host: the fit holds the wait
    fitted = Link(0.0, 1 * MB)  # the probes' scatter gave an intercept of 0
    floored = machine.with_wait_floor(fitted, shared, 4)
    assert floored.latency_s == pytest.approx(cm.CORE_WAIT_S) and floored.bytes_per_s == fitted.bytes_per_s
    assert machine.with_wait_floor(Link(1.0, MB), shared, 4).latency_s == 1.0  # a larger fit stands
    assert machine.with_wait_floor(fitted, cm.LINK_ONLY, 4) is fitted  # a core a rank: no floor


def test_the_backward_pass_hides_link_time_and_never_cpu_work():
    """``step_cost(..., backward_s)``: up to that much of the link's time (latency,
    waits, bytes) is hidden; the codecs' and the collectives' CPU work never are."""
    machine = cm.shared_host(2, 2)
    dense = cm.tensor_cost("allreduce", 4e7, 2, Link(1e-3, 1.1e8), machine)
    bare = cm.step_cost([dense], machine)
    link = bare.seconds - bare.codec_s - bare.collective_s - bare.cycle_s
    part = cm.step_cost([dense], machine, backward_s=link / 2)
    assert part.hidden_s == pytest.approx(link / 2) and part.seconds == pytest.approx(bare.seconds - link / 2)
    whole = cm.step_cost([dense], machine, backward_s=10 * link)
    assert whole.hidden_s == pytest.approx(link)
    assert whole.seconds == pytest.approx(bare.codec_s + bare.collective_s + bare.cycle_s)
    assert cm.step_cost([dense], machine, backward_s=0.0).seconds == bare.seconds
