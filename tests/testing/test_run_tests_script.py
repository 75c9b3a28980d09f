"""scripts/run_tests.sh, the runner CI calls: what its summary says when a rank fails.

CI keeps only the tail of the log, so the summary at the end must say which test failed and
why.  The runner here drives a fake virtual environment: its ``python -m pytest`` writes a
passing junit report, its ``horovodrun`` writes one report per rank, and rank 1 of one launch
fails one test with a known message.  Everything else the runner does (counting the
reports, the exit code) is the real script.
"""
import os
import stat
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

PASSING = '<testsuite tests="2" failures="0" errors="0" skipped="0">' \
          '<testcase name="a"/><testcase name="b"/></testsuite>'
FAILING = ('<testsuite tests="2" failures="1" errors="0" skipped="0"><testcase name="a"/>'
           '<testcase name="test_late_set"><failure message="ValueError: Allreduce: Process set '
           'provided does not exist, or has not been registered.&#10;second line">trace</failure>'
           '</testcase></testsuite>')

FAKE_PYTHON = f"""#!/usr/bin/env bash
# `python -m pytest ... --junitxml=PATH`: write a passing report; anything else: the real python
if [ "$1" = -m ] && [ "$2" = pytest ]; then
  for a in "$@"; do case "$a" in --junitxml=*) echo '{PASSING}' > "${{a#--junitxml=}}";; esac; done
  exit 0
fi
exec {sys.executable} "$@"
"""

# Reports for ranks 0..np-1 at the path given with --junitxml=...%RANK%...; rank 1 of the
# np=2 MPI launch of test_process_set_torch.py fails, and that launch exits 1.
FAKE_HOROVODRUN = f"""#!/usr/bin/env bash
np=0; ctl=; file=; xml=
while [ $# -gt 0 ]; do
  case "$1" in -np) np="$2"; shift;; --gloo|--mpi) ctl="$1";; *.py) file="$1";; --junitxml=*) xml="${{1#--junitxml=}}";; esac
  shift
done
rc=0
for r in $(seq 0 $((np-1))); do
  report='{PASSING}'
  if [ "$r" = 1 ] && [ "$ctl" = --mpi ] && [ "$np" = 2 ] && [ "${{file##*/}}" = test_process_set_torch.py ]; then
    report='{FAILING}'; rc=1
  fi
  echo "$report" > "${{xml//%RANK%/$r}}"
done
exit $rc
"""


def _executable(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_the_summary_names_a_failing_ranks_tests_and_their_messages(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    _executable(venv / "bin" / "python", FAKE_PYTHON)
    _executable(venv / "bin" / "horovodrun", FAKE_HOROVODRUN)
    env = dict(os.environ, HVD_COMPRESS_VENV=str(venv), HVDC_TEST_OUT=str(tmp_path / "out"),
               HVDC_CONTROLLERS="mpi", NP3_FILES="no_such_file.py")
    proc = subprocess.run(["bash", str(REPO / "scripts" / "run_tests.sh")], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode != 0, out[-3000:]
    summary = out[out.index("FAILED: "):]
    lines = summary.splitlines()
    at = lines.index("FAILED: test_process_set_torch[np=2,mpi] rank 1 (1 failed, 2 tests)")
    assert lines[at + 1] == ("    test_late_set: ValueError: Allreduce: Process set provided "
                             "does not exist, or has not been registered."), summary
    assert "FAILED: test_process_set_torch[np=2,mpi] (exit 1)" in lines
    assert "second line" not in summary
    # every other launch passed: two tests from the plain pytest, two per launch's rank 0
    n_files = len(list((REPO / "tests" / "horovod").glob("test_*.py")))
    assert lines[-1] == f"total: {2 + 2 * n_files} passed, 1 failed, 0 skipped", summary
