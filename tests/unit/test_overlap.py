"""The overlap-aware step (:mod:`hvd_compress.tools.overlap`): hand-computed timelines, and
the step between the cost model's two bounds."""
import pytest

from hvd_compress.tools.overlap import Exchange, exchanges_for, simulate

GB = 1e9


def test_dense_allreduce_hides_behind_the_backward_pass_one_tensor_at_a_time():
    # forward 1 s, backward 2 s (1 s a tensor); each allreduce 5 s on the link (2 ranks: one
    # payload each way); no cycle, no fusion: the last tensor is ready at 2, the first at 3
    ex = [Exchange("allreduce", 5 * GB), Exchange("allreduce", 5 * GB)]
    t = simulate(ex, 3.0, 2, GB, 0.0, weights=[1, 1], cycle_s=0.0, fusion_bytes=1)
    assert t.backward_end_s == pytest.approx(3.0)
    assert t.step_s == pytest.approx(2.0 + 5.0 + 5.0)  # the link starts at 2 and stays busy
    assert 3.0 + 10.0 > t.step_s > max(3.0, 10.0)      # strictly between the two bounds


def test_fusion_pays_the_latency_once_and_a_cycle_delays_the_start():
    ex = [Exchange("allreduce", 0.0)] * 3
    t = simulate(ex, 0.0, 2, GB, 0.01, weights=[1, 1, 1], cycle_s=0.5)
    # all three ready at 0, sent together at the first cycle tick (0): 2(N-1) = 2 latency steps once
    assert t.step_s == pytest.approx(0.02)
    late = simulate([Exchange("allreduce", 0.0)], 0.3, 2, GB, 0.01, cycle_s=0.5)
    assert late.step_s == pytest.approx(0.5 + 0.02)  # ready at 0.3, the thread wakes at 0.5


def test_encode_delays_the_backward_pass_and_decode_follows_the_link():
    ex = [Exchange("allgather", 1 * GB, encode_s=0.5, decode_s=0.25)]
    t = simulate(ex, 3.0, 2, GB, 0.0, cycle_s=0.0)
    assert t.backward_end_s == pytest.approx(3.5)
    assert t.step_s == pytest.approx(3.5 + 1.0 + 0.25)


def test_a_second_round_waits_for_the_backward_pass_and_a_cycle():
    # PowerSGD: half the bytes in P (during backward), half in Q after the backward pass
    # (the backward pass reaches the last tensor first)
    ex = [Exchange("allreduce", 0.0), Exchange("powersgd", 2 * GB)]
    t = simulate(ex, 3.0, 2, GB, 0.0, weights=[1, 1], cycle_s=0.1)
    # P ready at 2 (tick 2.0) -> 3.0; Q issued at max(3.0 + one cycle, backward end 3.0) = 3.1 -> 4.1
    assert t.step_s == pytest.approx(4.1)
    early = simulate(ex, 3.0, 2, 4 * GB, 0.0, weights=[1, 1], cycle_s=0.1)
    # P back at 2.5, but Q waits for the backward pass's end (3.0): 3.0 -> 3.25
    assert early.step_s == pytest.approx(3.25)


def test_the_step_lies_between_the_bounds_for_real_tensors():
    """At least the backward pass (encodes included) and the link's work; at most the backward
    pass, then all of the link's work, the decodes and a cycle per round."""
    from hvd_compress.tools.projection import MODELS, gpu_codec
    layers = MODELS["resnet50"].layers()
    numels = [layer[1] for layer in layers]
    for spec in ("none", "TopK(0.01)", "PowerSGD(4)"):
        ex = exchanges_for([spec] * len(numels), numels, 8, [layer[2] for layer in layers], gpu_codec)
        t = simulate(ex, 0.104, 8, 1.25e9, 10e-6, cycle_s=1e-3)
        assert t.backward_end_s == pytest.approx(0.104 + sum(e.encode_s for e in ex))
        assert max(t.backward_end_s, t.link_busy_s) <= t.step_s + 1e-9
        assert t.step_s <= t.backward_end_s + t.link_busy_s + sum(e.decode_s for e in ex) + 2e-3 + 1e-9
    dense = exchanges_for(["none"] * len(numels), numels, 8, None, None)
    assert all(e.encode_s == e.decode_s == 0 for e in dense)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="bytes_per_s"):
        simulate([Exchange("allreduce", 1.0)], 1.0, 2, 0.0, 0.0)
    with pytest.raises(ValueError, match="weights"):
        simulate([Exchange("allreduce", 1.0)], 1.0, 2, 1.0, 0.0, weights=[1, 2])
