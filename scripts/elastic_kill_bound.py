"""How long a SIGKILLed TensorFlow worker costs its survivors, by Gloo timeout.

    .venv/bin/python scripts/elastic_kill_bound.py [--gloo-timeout 30 60 ...] [--runs 1] [--stall-reset]

Root: on the emulated cluster (hvd_compress/tools/testing/cluster.py, 3 hosts
``kb-h1`` .. ``kb-h3``), each run launches tests/testing/elastic_example_tf2_synthetic.py
in its ``kill_only`` mode under ``horovodrun --gloo --min-np 2 --max-np 3
--host-discovery-script`` with ``HOROVOD_GLOO_TIMEOUT_SECONDS`` set (``default``: unset,
Horovod's 30 s): 3 workers train 6 steps (TopK(0.01), PowerSGD(4), Int8 two-phase in a
module-level ``@tf.function``), then the worker on ``kb-h3`` kills itself before a step
while the others wait for it in that step's exchanges.  Prints one JSON line per run:
the exit code, the seconds from the kill to each survivor's reset callback (none: the
survivors never reset), the seconds from the kill to the end of the job, and the last
error lines.  ``--stall-reset``: one survivor's reset never finishes (the worker's
``stall_reset`` mode), to measure when hvd_compress's reset bound
(``HVDC_ELASTIC_RESET_TIMEOUT_S``, hvd_compress/integration/elastic_watchdog.py) ends the job.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests" / "testing")]

from hvd_compress.tools.testing import cluster as cl  # noqa: E402
from hvd_compress.tools.testing.cluster import Cluster  # noqa: E402
from test_elastic_examples import _kill_to_resets  # noqa: E402
from test_elastic_jobs import JOB_BOUND_S, _launch_elastic  # noqa: E402

WORKER = REPO / "tests" / "testing" / "elastic_example_tf2_synthetic.py"


def one_run(cluster, timeout, stall_reset=False):
    with tempfile.TemporaryDirectory() as tmp:
        try:
            out, rc, seconds = _launch_elastic(cluster, Path(tmp), WORKER, True, 3, timeout, 120, "the job did not end",
                                               extra_args=["kill_only"] + (["stall_reset"] if stall_reset else []))
        except pytest.fail.Exception as hung:  # killed at the launcher's bound: its output is in the message
            out, rc, seconds = str(hung), "hung", JOB_BOUND_S
    killed = re.search(r"ELASTIC_KILL .* t=([\d.]+)", out)
    errors = [line for line in out.splitlines()
              if re.search(r"Error|what\(\)|Timed out|timeout|did not finish within", line)]
    return {"gloo_timeout_s": timeout, "stall_reset": stall_reset, "rc": rc, "job_s": round(seconds),
            "kill_to_reset_s": _kill_to_resets(out) if killed else None,
            "kill_to_end_s": round(time.time() - float(killed.group(1)), 1) if killed else None,
            "sizes": json.loads(out.split("ELASTIC_RESULT ", 1)[1].splitlines()[0])["sizes"]
            if "ELASTIC_RESULT " in out else None, "errors": errors[-4:]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gloo-timeout", nargs="+", default=["default", "60"],
                        help="HOROVOD_GLOO_TIMEOUT_SECONDS values to run with ('default': unset)")
    parser.add_argument("--runs", type=int, default=1, help="runs per value")
    parser.add_argument("--stall-reset", action="store_true",
                        help="one survivor's reset never finishes: measure hvd_compress's reset bound")
    args = parser.parse_args()
    cl.teardown("kb")
    with Cluster(3, prefix="kb") as cluster:
        for value in args.gloo_timeout:
            for _ in range(args.runs):
                print(json.dumps(one_run(cluster, None if value == "default" else int(value), args.stall_reset)),
                      flush=True)


if __name__ == "__main__":
    main()
