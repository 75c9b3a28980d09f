"""Binding a benchmark's rank to a core (hvd_compress/tools/bench/pinning.py)."""
import os
import subprocess
import sys

import pytest

from hvd_compress.tools.bench import pinning


def test_the_rank_comes_from_the_launcher_and_its_absence_is_an_error():
    assert pinning.rank_from_env({"HOROVOD_RANK": "3"}) == 3
    assert pinning.rank_from_env({"OMPI_COMM_WORLD_RANK": "2"}) == 2
    assert pinning.rank_from_env({"PMI_RANK": "1", "HOROVOD_RANK": ""}) == 1
    with pytest.raises(ValueError, match="pin_cores: no rank in the environment.*HOROVOD_RANK"):
        pinning.rank_from_env({})


def test_ranks_take_the_cores_in_turn():
    assert [pinning.core_for(r, {6, 2}) for r in range(5)] == [2, 6, 2, 6, 2]
    with pytest.raises(ValueError, match="no core"):
        pinning.core_for(0, set())


def test_a_pinned_process_and_its_threads_run_on_its_core_only():
    cores = sorted(os.sched_getaffinity(0))
    code = ("import threading, os, json\n"
            "early = threading.Thread(target=lambda: ev.wait()); ev = threading.Event(); early.start()\n"
            "from hvd_compress.tools.bench.pinning import pin_rank_to_core\n"
            "core = pin_rank_to_core()\n"
            "later = []\n"
            "t = threading.Thread(target=lambda: later.append(sorted(os.sched_getaffinity(0)))); t.start(); t.join()\n"
            "tids = [int(x) for x in os.listdir('/proc/self/task')]\n"
            "print(json.dumps([core, later[0], sorted({c for tid in tids for c in os.sched_getaffinity(tid)})]))\n"
            "ev.set()\n")
    env = {**os.environ, "HOROVOD_RANK": str(len(cores) + 1)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    core, later, every_thread = __import__("json").loads(out)
    assert core == cores[(len(cores) + 1) % len(cores)]
    assert later == [core] and every_thread == [core]


def test_a_worker_binds_only_when_its_flag_asks():
    import argparse
    p = argparse.ArgumentParser()
    pinning.add_worker_argument(p)
    before = os.sched_getaffinity(0)
    pinning.pin_if_asked(p.parse_args([]))  # no flag: nothing changes (no rank is needed either)
    assert os.sched_getaffinity(0) == before and p.parse_args(["--pin-cores"]).pin_cores
    d = argparse.ArgumentParser()
    pinning.add_driver_argument(d)
    assert not d.parse_args([]).no_pin_cores and d.parse_args(["--no-pin-cores"]).no_pin_cores
