"""The two-phase transport's Horovod tests at 3 and 4 ranks, one rank a host, on the
emulated cluster (hvd_compress/tools/testing/cluster.py): tests/horovod/test_two_phase_torch.py
under ``horovodrun --gloo`` and tests/horovod/test_two_phase_tf.py under ``--mpi``.

scripts/run_tests.sh runs those files at 2 ranks on localhost (the torch file at 3 too); this
adds 4 ranks (and 3 across hosts) with every rank in its own network namespace, and is where
the TF file's process-set test (a set of 3 of the 4 ranks) runs.  To keep the whole
module under a few minutes on a loaded 2-core machine the files run in their quick mode
(``HVDC_TWO_PHASE_QUICK=1``: Int8 and TopK(values=Int8) -- padding, per-tensor scales, Top-K
ties among quantized values -- and in torch QSGD's seeded draws, with default options,
plus the 'auto', byte-count and construction tests, and in TF the process-set test) and
one 4-host cluster serves both sizes (3 ranks run on its first 3 hosts).  Measured at a load average of 15-17 on 2
cores: about 6 minutes for the module (np=4 TF under MPI alone about 3).

Needs root (network namespaces): without root these FAIL when CI is set and are skipped
with a reason otherwise, like tests/testing/test_cluster.py.
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hvd_compress.tools.testing import cluster as cl
from hvd_compress.tools.testing.cluster import Cluster

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable
PREFIX = "hvdt2p"
# A loaded 2-core machine needs longer than Horovod's defaults to start 4 ranks.
SLOW_MACHINE_ARGS = ["--start-timeout", "180"]
ENV = {"HVDC_TWO_PHASE_QUICK": "1", "HOROVOD_GLOO_TIMEOUT_SECONDS": "180", "TF_CPP_MIN_LOG_LEVEL": "3",
       "TF_USE_LEGACY_KERAS": "1", "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1",
       # Open MPI busy-polls while it waits: with 4 ranks on 2 cores, yield instead
       "OMPI_MCA_mpi_yield_when_idle": "1"}
RUN_TIMEOUT = 300

RUNS = [  # (ranks, test file, controller, pytest -k selection or None)
    (4, "test_two_phase_torch.py", "gloo", None),
    (4, "test_two_phase_tf.py", "mpi", None),
    # 3 ranks (uneven chunks): the whole torch file at np=3 on localhost, Gloo and MPI, in
    # scripts/run_tests.sh; across hosts the 4-rank runs above
]


@pytest.fixture(scope="module", autouse=True)
def _need_root(need_root):
    """Every test here runs on the emulated cluster (tests/testing/conftest.py)."""


@pytest.fixture(scope="module")
def cluster4():
    cl.teardown(PREFIX)  # this prefix belongs to these tests: clear a crashed run's leftovers
    with Cluster(4, prefix=PREFIX) as c:
        yield c


_SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|xfailed|xpassed|errors?)")
_FINAL = re.compile(r"(?:\d+ [a-z]+(?:, )?)+ in [\d.]+s")  # pytest's closing line: "1 failed, 17 passed in 2.1s"


@pytest.mark.parametrize("np_,test_file,controller,select", RUNS,
                         ids=[f"np{n}-{f[15:-3]}-{c}" for n, f, c, _ in RUNS])
def test_two_phase_file_across_hosts(cluster4, np_, test_file, controller, select):
    pytest_argv = [PY, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rfE", "--color=no",
                   str(REPO / "tests" / "horovod" / test_file)] + (["-k", select] if select else [])
    cmd = cluster4.horovodrun_command(pytest_argv, np=np_, controller=controller, extra=SLOW_MACHINE_ARGS)
    try:
        r = cluster4.run(0, cmd, timeout=RUN_TIMEOUT, env=ENV, cwd=str(REPO))
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"horovodrun -np {np_} {test_file} timed out after {RUN_TIMEOUT} s:\n"
                    f"{((e.stdout or '') + (e.stderr or ''))[-4000:]}")
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"horovodrun -np {np_} --{controller} {test_file} failed ({r.returncode}):\n{out[-8000:]}"
    # every rank printed a pytest summary with passes and no failure; searched in the whole
    # output, since mpirun's tagged output can put two ranks' summaries on one line
    finals = [m for m in _FINAL.findall(out) if "passed" in m or "failed" in m]
    assert len(finals) >= np_, out[-4000:]
    for line in finals:
        counts = {kind: int(n) for n, kind in _SUMMARY.findall(line)}
        assert counts.get("failed", 0) == 0 and counts.get("error", 0) == 0 and counts.get("errors", 0) == 0, line
        assert counts.get("passed", 0) > 0, line
