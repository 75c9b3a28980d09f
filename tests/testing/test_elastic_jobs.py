"""Elastic Horovod with hvd_compress: real elastic jobs on the emulated cluster
(hvd_compress/tools/testing/cluster.py: 3 hosts ``el-h1`` .. ``el-h3``, each a
network namespace with its own address and sshd, one rank a host), launched from
``el-h1`` as ``horovodrun --gloo --min-np 2 --max-np 3 --host-discovery-script``,
in which a host is removed, added back, and a worker is killed with SIGKILL in
the middle of a step.

Three jobs: PyTorch (TopK(0.01), Int8 two-phase and Auto(), against Horovod's
uncompressed optimizer on the same schedule), TensorFlow (TopK(0.01) through
Keras ``fit`` with Horovod's elastic callbacks and a ``DistributedGradientTape``
step, alternating; only with ``HVDC_TEST_SLOW_ELASTIC=1``, skipped otherwise),
and a worker joining with another configuration, which must be an error on every
rank, not a hang.

The discovery script prints a file that the job's rank 0 rewrites at known steps
(``el-h3`` removed, added back; then the worker on ``el-h3`` kills itself and
Horovod blacklists that host); see tests/testing/elastic_worker_torch.py for the
schedule and what each rank records at each commit.

Asserts: the job exits 0 within ``JOB_BOUND_S``; every rank's final weights are
bitwise identical; with TopK(0.01) and Int8 (two-phase, which re-cuts its chunks
at 3, 2, 3 and 2 ranks) the conservation law holds across all changes,
``(w0 - w) / lr + survivors' residuals + departed ranks' residuals at their last
commit == sum of every gradient computed and committed`` (op=Sum, plain SGD), and
fails without the departed ranks' part; the lost mass that the library reports
equals the departed ranks' residual norm at their last commit; Auto calibrates
and plans again at each new number of workers; TopK(0.01)'s final loss is within
``TOPK_LOSS_TOLERANCE`` times the initial loss of the same schedule without
compression.

Needs root (network namespaces): without root these FAIL when CI is set and are
skipped with a reason otherwise, like tests/testing/test_cluster.py.
"""
import json
import os
import re
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hvd_compress.tools.testing import cluster as cl
from hvd_compress.tools.testing.cluster import Cluster

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
#: the cluster's name (its namespaces are el-br, el-h1 .. el-h3); it belongs to these tests
PREFIX = "el"
#: the hosts that stay, and the one that is removed, added back and killed
STAYING = ("el-h1:1", "el-h2:1")
LEAVING = "el-h3"
#: a job ends within this (a hang bound, not a speed check): measured 130-200 s (torch), 150-190 s (TF)
#: on the 2-core machine at a load average of 20; launches there ran up to 7x slower than unloaded,
#: so the bound leaves 3x over the loaded figure
JOB_BOUND_S = 600
#: TopK(0.01)'s final evaluation loss may exceed the uncompressed one by this fraction of the initial
#: loss: in the ~75 steps of the schedule none reaches ~1e-6 of it and TopK(0.01), which sends 10 of
#: 1040 elements a step, 0.09-0.12
TOPK_LOSS_TOLERANCE = 0.25
#: the same for Int8 (two-phase), which sends every element
INT8_LOSS_TOLERANCE = 0.001
#: TF: TopK(0.01)'s final loss at most this fraction of the initial loss (measured 2.8 of 60.8 in 143 steps)
TF_TOPK_FINAL_LOSS = 0.3
#: the TF fit-and-tape job runs only when this is "1": what it checks, other tests check in less time
#: (docs/development.md, "CI wall time")
SLOW_ELASTIC = os.environ.get("HVDC_TEST_SLOW_ELASTIC") == "1"


@pytest.fixture(scope="module", autouse=True)
def _need_root(need_root):
    """Every test here runs on the emulated cluster (tests/testing/conftest.py)."""


@pytest.fixture(scope="module")
def cluster():
    cl.teardown(PREFIX)  # clear a crashed run's leftovers
    with Cluster(3, prefix=PREFIX) as c:
        yield c


def staying_and_leaving(cluster):
    """(the hosts that stay, as ``host:1``; the host that leaves): ``STAYING`` and ``LEAVING`` on
    this module's cluster, the same roles on another's."""
    return tuple(f"{h}:1" for h in cluster.hosts[:2]), cluster.hosts[2]


def _hosts_text(cluster, with_leaving=True):
    staying, leaving = staying_and_leaving(cluster)
    return "".join(f"{h}\n" for h in staying + ((f"{leaving}:1",) if with_leaving else ()))


def _launch_elastic(cluster, tmp_path, worker, with_leaving, np, gloo_timeout_s, elastic_timeout_s, hang_message,
                    extra_args=()):
    """``horovodrun --min-np 2 --max-np 3`` of ``worker`` from the cluster's first host, with a
    discovery script that prints the file ``hosts`` (the staying hosts, and ``LEAVING`` if
    ``with_leaving``; the worker rewrites it); the worker's arguments: that file, the staying
    hosts, the leaving one, then ``extra_args``.  Returns (output, rc, seconds) and fails the
    test with ``hang_message`` if the job outlives ``JOB_BOUND_S``."""
    hosts = tmp_path / "hosts"
    hosts.write_text(_hosts_text(cluster, with_leaving))
    staying, leaving = staying_and_leaving(cluster)
    discover = tmp_path / "discover.sh"
    discover.write_text(f"#!/bin/sh\ncat {hosts}\n")
    discover.chmod(stat.S_IRWXU)
    env = {"TF_CPP_MIN_LOG_LEVEL": "3", "TF_USE_LEGACY_KERAS": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    if gloo_timeout_s is not None:  # None: Horovod's default
        env["HOROVOD_GLOO_TIMEOUT_SECONDS"] = str(gloo_timeout_s)
    cmd = [str(Path(cluster.venv_bin) / "horovodrun"), "-np", str(np), "--min-np", "2", "--max-np", "3",
           "--host-discovery-script", str(discover), "--elastic-timeout", str(elastic_timeout_s),
           "-p", str(cluster.ssh_port), "--ssh-identity-file", cluster.ssh_key,
           "--network-interface", cluster.iface, "--disable-cache", "--gloo",
           PY, str(worker), str(hosts), ",".join(staying), leaving, *extra_args]
    start = time.monotonic()
    p = cluster.popen(0, cmd, env=env, cwd=str(REPO), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                      stdin=subprocess.DEVNULL, text=True)
    try:
        out, _ = p.communicate(timeout=JOB_BOUND_S)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        pytest.fail(f"{hang_message} within {JOB_BOUND_S} s:\n{out[-6000:]}")
    return out, p.returncode, time.monotonic() - start


def _run_elastic_job(cluster, tmp_path, worker, gloo_timeout_s=30):
    out, rc, elapsed = _launch_elastic(cluster, tmp_path, worker, True, 3, gloo_timeout_s, 120,
                                       "elastic job did not end")
    assert rc == 0, out[-6000:]
    lines = [line for line in out.splitlines() if "ELASTIC_RESULT " in line]
    assert len(lines) == 1, out[-6000:]
    result = json.loads(lines[0].split("ELASTIC_RESULT ", 1)[1])
    print(f"elastic job: {elapsed:.0f} s, {result['steps']} steps, sizes {result['sizes']}, "
          f"{json.dumps(result['kinds'])}")
    return result, out


def test_torch_host_removed_added_and_worker_killed(cluster, tmp_path):
    result, out = _run_elastic_job(cluster, tmp_path, Path(__file__).with_name("elastic_worker_torch.py"))
    sizes = result["sizes"]
    # the schedule happened: 3 ranks, 2 (removed), 3 (added back), 2 (killed)
    changes = [s for i, s in enumerate(sizes) if i == 0 or s != sizes[i - 1]]
    assert changes == [3, 2, 3, 2], sizes
    assert result["size"] == 2
    assert f"{LEAVING}[0] has been removed from elastic job" in out  # the removal, as Horovod says it
    assert f"ELASTIC_KILL host={LEAVING}" in out  # the SIGKILL ...
    # ... as Horovod reports it: 137 (128 + SIGKILL), 255 through ssh
    assert re.search(r"Process \d+ exit with status code (137|255)\.", out), out[-6000:]
    assert result["identical"], "replicas differ after the membership changes"
    # Auto measured and planned again for each new number of workers: every stretch at one size
    # starts calibrating (no plan since the reset) and ends with a plan made at that size
    plans = result["auto_plans"]
    starts = [i for i in range(len(sizes)) if i == 0 or sizes[i] != sizes[i - 1]]
    for a, b in zip(starts, starts[1:] + [len(sizes)]):
        assert plans[a][0] == 0 and plans[b - 1][0] >= 1, (sizes[a], plans[a:b])
        assert plans[b - 1][1], (sizes[a], plans[b - 1])
    for kind in ("topk", "int8", "auto"):
        r = result["kinds"][kind]
        assert r["departed"] == 2
        # conservation among the survivors, with what the departed took away
        assert r["conservation_error"] <= 1e-5 * r["grad_scale"], (kind, r)
        lost = r["lost_reported"]
        assert lost["ranks"] == 2, (kind, lost)
        assert lost["norm"] == pytest.approx(r["lost_expected_norm"], rel=1e-5, abs=1e-9), (kind, r)
        if kind == "auto":
            continue  # its plans may keep tensors dense (no residual): nothing to lose then
        assert r["error_without_lost"] > 10 * r["conservation_error"], (kind, r)
        assert lost["tensors"] >= 2, (kind, lost)
    assert "hvd_compress.elastic: 1 rank(s) left holding" in out
    loss = {kind: r["final_loss"] for kind, r in result["kinds"].items()}
    initial = result["initial_loss"]
    assert loss["none"] < 0.01 * initial, loss  # the schedule trains
    assert loss["topk"] - loss["none"] <= TOPK_LOSS_TOLERANCE * initial, (loss, initial)
    assert loss["int8"] - loss["none"] <= INT8_LOSS_TOLERANCE * initial, (loss, initial)
    assert loss["auto"] - loss["none"] <= TOPK_LOSS_TOLERANCE * initial, (loss, initial)


@pytest.mark.skipif(not SLOW_ELASTIC, reason="HVDC_TEST_SLOW_ELASTIC=1 runs it (about 60 s): Keras fit with the "
                    "elastic callbacks and a traced tape step under elastic runs are covered by "
                    "tests/testing/test_elastic_examples.py's Keras MNIST-shaped and TF2 synthetic-shaped jobs, "
                    "one compressor through fit and a tape by tests/horovod/test_drop_in_tf.py")
def test_tf_keras_fit_and_tape_host_removed_and_added(cluster, tmp_path):
    # a joining TF worker takes longer than 30 s to start on a loaded machine: the survivors'
    # rendezvous waits up to HOROVOD_GLOO_TIMEOUT_SECONDS for it
    result, out = _run_elastic_job(cluster, tmp_path, Path(__file__).with_name("elastic_worker_tf.py"),
                                   gloo_timeout_s=120)
    sizes = result["sizes"]
    changes = [s for i, s in enumerate(sizes) if i == 0 or s != sizes[i - 1]]
    assert changes == [3, 2, 3], sizes
    assert f"{LEAVING}[0] has been removed from elastic job" in out
    assert result["identical"], "replicas differ after the membership changes"
    r = result["kinds"]["topk"]
    assert r["departed"] == 1
    assert r["conservation_error"] <= 1e-5 * r["grad_scale"], r
    assert r["error_without_lost"] > 10 * r["conservation_error"], r
    assert r["lost_reported"]["ranks"] == 1, r
    assert r["lost_reported"]["norm"] == pytest.approx(r["lost_expected_norm"], rel=1e-5), r
    assert r["final_loss"] <= TF_TOPK_FINAL_LOSS * result["initial_loss"], r


MISMATCH_WORKER = r'''
import os, sys, time
import torch
import horovod.torch as hvd
import hvd_compress
import hvd_compress.elastic
from hvd_compress.integration.fingerprint import ConfigMismatchError

hvd.init()
hosts_file, staying, leaving = sys.argv[1], sys.argv[2].split(","), sys.argv[3]
host = os.environ.get("HOROVOD_HOSTNAME")

compression = hvd_compress.TopK(0.02 if host == leaving else 0.01)  # the joining worker differs
model = torch.nn.Linear(64, 16)
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                               named_parameters=model.named_parameters(), compression=compression)
state = hvd.elastic.TorchState(model=model, optimizer=opt, step=0)
hvd_compress.elastic.register(state, compression)

@hvd.elastic.run
def train(state):
    while state.step < 300:
        opt.zero_grad()
        model(torch.randn(8, 64)).sum().backward()
        opt.step()
        state.step += 1
        if state.step == 5 and hvd.rank() == 0:
            with open(hosts_file + ".tmp", "w") as f:
                f.write("".join(f"{h}\n" for h in staying + [leaving + ":1"]))
            os.replace(hosts_file + ".tmp", hosts_file)
        time.sleep(0.05)
        state.commit()

try:
    train(state)
    print(f"MISMATCH_RESULT rank={hvd.rank()} host={host} trained", flush=True)
except ConfigMismatchError as e:
    print(f"MISMATCH_RESULT rank={hvd.rank()} host={host} refused: {e}", flush=True)
    sys.exit(3)
'''


def test_joining_worker_with_another_configuration_is_an_error_on_every_rank(cluster, tmp_path):
    """2 workers train; a third joins with TopK(0.02) instead of TopK(0.01): at the first exchange
    after the reset every rank, the joining one included, raises ConfigMismatchError naming the
    field, and the job ends (non-zero) instead of hanging."""
    worker = tmp_path / "mismatch_worker.py"
    worker.write_text(MISMATCH_WORKER)
    out, rc, elapsed = _launch_elastic(cluster, tmp_path, worker, False, 2, 60, 60,
                                       "the job did not refuse the joining worker")
    print(f"mismatch job: {elapsed:.0f} s")
    assert rc != 0, out[-6000:]
    refused = [line for line in out.splitlines() if "MISMATCH_RESULT" in line and " refused: " in line]
    assert len(refused) == 3, out[-6000:]
    assert any(f"host={LEAVING}" in line for line in refused), refused
    assert all("compression differs" in line and "0.02" in line for line in refused), refused
    assert "trained" not in out
