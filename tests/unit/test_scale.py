"""``hvd-compress bench scale``'s row assembly and schema, without horovodrun:
the worker's pooling of blocks into a row (:func:`e2e_worker._row`), the
driver's link fields, expected wire bytes, merging and comparisons
(:mod:`hvd_compress.tools.bench.scale`), and the encode/decode clock."""
import argparse
import time

import pytest

from hvd_compress.tools.bench import e2e_worker as W
from hvd_compress.tools.bench import scale as S


def _args(**kw):
    base = dict(framework="torch", model="mlp", batch=32, threads=1, idle_seconds=0.5, change_link_at=0,
                iface="eth0", scheme="TopK(0.01)")
    base.update(kw)
    return argparse.Namespace(**base)


def _rank(rank, host, times, compute, tx, rx, encode):
    return {"rank": rank, "host": host, "steps": len(times), "times": times, "warmup_times": [9.0],
            "compute": compute, "wall": sum(times), "backward": [0.01] * len(times),
            "codec": {"encode_s": encode, "decode_s": 2 * encode, "encode_wait_s": 0.0, "decode_wait_s": 0.5},
            "rx": rx, "tx": tx, "idle_tx": 100, "idle_rx": 50, "payload_bytes_per_step": 1000.0,
            "loss_first": 2.0, "loss_last": 1.0}


def _worker_row():
    shapes = [[8, 4], [8], [2, 8], [2]]
    block1 = [_rank(0, "h1", [1.0, 3.0], [0.5, 0.5], 4000, 4400, 0.2),
              _rank(1, "h2", [2.0, 1.0], [0.7, 0.4], 6000, 6600, 0.4)]
    block2 = [_rank(0, "h1", [1.5, 1.5], [0.5, 0.6], 4000, 4400, 0.2),
              _rank(1, "h2", [1.0, 1.0], [0.4, 0.4], 6000, 6600, 0.4)]
    info = {"transport": "allgather", "warmup": 2, "layer_shapes": shapes}
    return W._row(_args(), "TopK(0.01)", [block1, block2], info)


def test_worker_row_pools_blocks_per_step_and_per_host():
    row = _worker_row()
    assert row["steps"] == 4 and row["passes"] == 2 and row["workers"] == 2 and row["hosts"] == 2
    # the slowest rank of each step, over both blocks: [2, 3, 1.5, 1.5]
    assert row["step_s_all"] == [2.0, 3.0, 1.5, 1.5]
    assert row["median_step_s"] == pytest.approx(1.75)
    assert row["compute_s_all"] == [0.7, 0.5, 0.5, 0.6] and row["compute_s"] == pytest.approx(0.55)
    assert row["layer_shapes"] == [[8, 4], [8], [2, 8], [2]]
    assert row["layer_numels"] == [32, 8, 16, 2] and row["model_params"] == 58
    # bytes: each host's two blocks summed, over 4 steps
    hosts = {h["host"]: h for h in row["wire_per_host"]}
    assert hosts["h1"]["tx_bytes_per_step"] == 2000 and hosts["h2"]["rx_bytes_per_step"] == 3300
    assert row["wire_bytes_per_step"] == 2500 and row["wire_rx_bytes_per_step"] == 2750
    assert row["idle_wire_bytes_per_s"] == pytest.approx(200 / 1.0)
    # codec seconds per step: rank 0 0.4/4, rank 1 0.8/4
    assert row["encode_s_per_step"] == pytest.approx(0.15) and row["encode_s_per_step_max"] == pytest.approx(0.2)
    assert row["decode_s_per_step"] == pytest.approx(0.3) and row["decode_wait_s_per_step"] == pytest.approx(0.25)
    assert row["horovod_cycle_time_ms"] > 0 and row["horovod_fusion_threshold_bytes"] > 0


def test_horovod_settings_read_the_environment_or_the_defaults():
    assert W.horovod_settings({}) == {"horovod_cycle_time_ms": 1.0,
                                      "horovod_fusion_threshold_bytes": 128 * 1024 * 1024,
                                      "horovod_settings_from_env": False}
    got = W.horovod_settings({"HOROVOD_CYCLE_TIME": "20", "HOROVOD_FUSION_THRESHOLD": "0"})
    assert got["horovod_cycle_time_ms"] == 20.0 and got["horovod_fusion_threshold_bytes"] == 0
    assert got["horovod_settings_from_env"]


def test_scale_row_has_the_link_fields_and_link_time():
    row = S.build_row(_worker_row(), link_mbit=100.0, link_measured_mbit=95.0, link_rtt_s=6e-5, controller="gloo",
                      command="hvd-compress bench scale --workers 2", launch_s=30.0, load_before=1.0,
                      load_after=2.0, measured_at="2026-01-01T00:00:00Z")
    for field in ("scheme", "transport", "workers", "link_mbit", "link_measured_mbit", "link_rtt_s", "layer_shapes",
                  "compute_s", "encode_s_per_step", "decode_s_per_step", "horovod_cycle_time_ms",
                  "horovod_fusion_threshold_bytes", "payload_bytes_per_step", "wire_bytes_per_step",
                  "wire_rx_bytes_per_step", "median_step_s", "command", "loadavg_1m_before"):
        assert row[field] is not None, field
    assert row["link_s"] == pytest.approx(1.75 - 0.55) and row["comm_s_measured"] == row["link_s"]
    # allgather at N=2: one payload out
    assert row["expected_wire_bytes_per_step"] == 1000.0 and row["wire_to_expected"] == 2.5
    assert "pinned_cores" not in row  # left to the scheduler
    pinned = S.build_row(_worker_row(), link_mbit=100.0, link_measured_mbit=95.0, link_rtt_s=6e-5,
                         controller="gloo", command="c", pinned_cores=True)
    assert pinned["pinned_cores"] is True


def test_the_scale_worker_takes_pin_cores_and_the_driver_no_pin_cores(capsys):
    """The driver launches ``e2e_worker --pin-cores`` unless ``--no-pin-cores``: both parse."""
    from hvd_compress.tools.cli import build_parser
    args = build_parser().parse_args(["bench", "scale", "--no-pin-cores"])
    assert args.no_pin_cores is True
    assert build_parser().parse_args(["bench", "scale"]).no_pin_cores is False
    with pytest.raises(SystemExit):  # past the parsing of --pin-cores, to the check of --warmup
        W.main(["--pin-cores", "--out", "x.json", "--warmup", "0"])
    assert "--warmup must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("transport,n,want", [("allreduce", 4, 1.5), ("powersgd", 8, 1.75), ("allgather", 8, 7.0),
                                              ("two_phase", 8, 14 / 9), ("two_phase", 2, 2 / 3),
                                              ("mixed", 4, None)])
def test_expected_wire_per_transport(transport, n, want):
    got = S.expected_wire(transport, 1.0, n)
    assert got == (None if want is None else pytest.approx(want))


def test_merge_replaces_rows_of_the_same_key_and_keeps_the_rest():
    a = {"scheme": "none", "workers": 2, "link_mbit": 100.0, "model_params": 5, "framework": "torch",
         "model": "mlp", "median_step_s": 1.0}
    b = dict(a, scheme="Auto()", median_step_s=0.5)
    a2 = dict(a, median_step_s=2.0)
    c = dict(a, workers=4)
    merged = S.merge_rows([a, b, c], [a2])
    assert sorted(r["median_step_s"] for r in merged) == [0.5, 1.0, 2.0] and a not in merged
    S.add_comparisons(merged)
    assert [r["speedup_vs_none"] for r in merged if r["scheme"] == "Auto()"] == [4.0]
    cmp_ = S.auto_vs_best(merged)
    assert cmp_ == [{"workers": 2, "link_mbit": 100.0, "auto_scheme": "Auto()", "auto_step_s": 0.5,
                     "best_scheme": "none", "best_step_s": 2.0, "ratio": 4.0, "paired": None}]


def test_paired_ratio_compares_pass_by_pass():
    """Each pass's blocks share the machine's load: the ratio is taken within a
    pass, then its median and range over the passes."""
    best = {"pass_median_step_s": [1.0, 2.0, 1.5]}
    auto = {"pass_median_step_s": [1.0, 2.5, 1.0]}
    assert S.paired_ratio(best, auto) == pytest.approx((1.0, 0.8, 1.5))
    assert S.paired_ratio(best, {"pass_median_step_s": [1.0]}) is None  # passes differ
    assert S.paired_ratio(best, {}) is None


def test_workers_must_be_integers_of_at_least_two():
    assert S.parse_workers("2,4,8") == [2, 4, 8]
    for bad in ("1,2", "two", ""):
        with pytest.raises(ValueError, match="workers"):
            S.parse_workers(bad)


def test_timed_compression_keeps_waiting_apart_from_work():
    clock = W.WaitClock()

    class Inner:
        def compress(self, t):
            t0 = time.perf_counter()
            time.sleep(0.01)  # stands for hvd.synchronize inside compress
            clock.total += time.perf_counter() - t0
            return t, None

        def decompress(self, t, ctx):
            return t

    timed = W.TimedCompression(Inner(), clock)
    timed.compress(1)
    timed.decompress(1, None)
    assert timed.encode_wait_s == pytest.approx(clock.total) and timed.encode_wait_s >= 0.01
    assert timed.encode_s >= 0 and timed.decode_wait_s == 0 and timed.compress_calls == 1


def test_markdown_lists_every_row_and_the_auto_comparison():
    row = S.build_row(_worker_row(), link_mbit=100.0, link_measured_mbit=95.0, link_rtt_s=6e-5, controller="gloo",
                      command="c")
    assert len(row["pass_median_step_s"]) == row["passes"] == 2  # one median per block
    auto = dict(row, scheme="Auto()", transport="mixed", median_step_s=2.0,
                pass_median_step_s=[2 * v for v in row["pass_median_step_s"]])
    text = S.markdown(S.add_comparisons([row, auto]))
    assert text.count("| 100 Mbit/s | 2 |") == 3  # two rows and the comparison
    assert "| 100 Mbit/s | 2 | Auto() | 2000 | TopK(0.01) | 1750 | 0.88 | 0.50 (0.50-0.50) |" in text


def test_runnable_tasks_are_read_now_and_a_launch_waits_for_quiet():
    """The instantaneous runnable count (not the 1-minute average, which carries
    the last launch): a busy process beside the sampler shows as a task."""
    import subprocess
    import sys
    idle = S.runnable_now(0.2)
    assert idle >= 0.0
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        busy = S.runnable_now(1.0)
        runnable, waited = S.settle(max_s=0.0, quiet=-1.0)  # never quiet: gives up at once
    finally:
        spin.kill()
        spin.wait()
    assert busy >= 0.5 and runnable >= 0.0 and waited < 5.0


def test_a_rows_machine_takes_the_tasks_runnable_before_its_launch():
    from hvd_compress.tools import advise
    row = {"workers": 8, "cpus": 2, "loadavg_1m_before": 14.9, "runnable_before": 0.2}
    assert advise.row_machine(row, advise.CPU_GLOO).background_load == pytest.approx(0.2)
    del row["runnable_before"]
    assert advise.row_machine(row, advise.CPU_GLOO).background_load == pytest.approx(14.9)
