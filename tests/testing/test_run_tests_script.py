"""scripts/run_tests.sh, the runner CI calls: what its summary says when a rank fails, and
which crashed launches it runs once more.

CI keeps only the tail of the log, so the summary at the end must say which test failed and
why.  The runner here drives a fake virtual environment: its ``python -m pytest`` writes a
passing junit report, its ``horovodrun`` writes one report per rank, and in one launch rank 1
fails one test with a known message (or dies without a report, printing a crash).
Everything else the runner does (counting the reports, rerunning, the exit code) is the real
script.
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
np=0; ctl=; file=; files=; xml=
while [ $# -gt 0 ]; do
  case "$1" in -np) np="$2"; shift;; --gloo|--mpi) ctl="$1";; *.py) file="$1"; files="$files ${{1##*/}}";;
    --junitxml=*) xml="${{1#--junitxml=}}";; esac
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
               HVDC_CONTROLLERS="mpi", NP3_FILES="no_such_file.py",
               HVDC_MPI_FILES="test_process_set_torch.py test_smoke_torch.py")
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
    # only the files in HVDC_MPI_FILES ran with MPI: two tests from the plain pytest, two per
    # launch's rank 0 (rank 1's failure is counted once)
    launched = [line for line in out.splitlines() if line.startswith("=== test_") and "(attempt 1)" in line]
    assert launched == ["=== test_process_set_torch[np=2,mpi] (attempt 1): tests/horovod/test_process_set_torch.py",
                        "=== test_smoke_torch[np=2,mpi] (attempt 1): tests/horovod/test_smoke_torch.py"], launched
    assert lines[-1] == "total: 6 passed, 1 failed, 0 skipped", summary


# Every launch passes, except two that crash on their first attempt: some rank writes no
# report and the launch exits 134.  test_two_phase_torch.py's log shows Horovod's Gloo
# timeout in its background loop (a cause outside the project: rerun once; the rerun
# passes); test_smoke_tf.py's shows a segfault and nothing known (no rerun: a failure).  The
# run holds these two files only, so each is a launch of its own (a torch and a TF launch).
# Each call is appended to $HVDC_TEST_OUT/calls.  Horovod's line reaches the log only if
# pytest leaves the C-level stderr alone (--capture=sys): under pytest's default fd capture,
# a process that aborts takes it with it, and so does this fake.
CRASH_LINE = {
    "test_two_phase_torch.py": "[1]<stderr>:[2026-01-01 00:00:00.000000: E horovod/common/operations.cc:697] [1]: "
                               "Horovod background loop uncaught exception: [gloo/transport/tcp/unbound_buffer.cc:81] "
                               "Timed out waiting 30000ms for recv operation to complete",
    "test_smoke_tf.py": "[1]<stderr>:Fatal Python error: Segmentation fault",
}
FAKE_CRASHING_HOROVODRUN = f"""#!/usr/bin/env bash
np=0; file=; xml=; capture=fd
while [ $# -gt 0 ]; do
  case "$1" in -np) np="$2"; shift;; *.py) file="$1";; --junitxml=*) xml="${{1#--junitxml=}}";;
    --capture=*) capture="${{1#--capture=}}";; esac
  shift
done
base="${{file##*/}}"
echo "$base" >> "$HVDC_TEST_OUT/calls"
attempt=$(grep -cx "$base" "$HVDC_TEST_OUT/calls")
crash=
case "$base" in
  test_two_phase_torch.py) [ "$attempt" = 1 ] && crash='{CRASH_LINE["test_two_phase_torch.py"]}';;
  test_smoke_tf.py) crash='{CRASH_LINE["test_smoke_tf.py"]}';;
esac
for r in $(seq 0 $((np-1))); do
  [ -n "$crash" ] && [ "$r" = 1 ] && continue
  echo '{PASSING}' > "${{xml//%RANK%/$r}}"
done
if [ -n "$crash" ]; then [ "$capture" = sys ] && echo "$crash"; echo "terminate called after throwing an instance of 'gloo::IoException'"; exit 134; fi
exit 0
"""


def test_a_crash_is_rerun_only_for_a_cause_outside_the_project(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    _executable(venv / "bin" / "python", FAKE_PYTHON)
    _executable(venv / "bin" / "horovodrun", FAKE_CRASHING_HOROVODRUN)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    env = dict(os.environ, HVD_COMPRESS_VENV=str(venv), HVDC_TEST_OUT=str(out_dir),
               HVDC_CONTROLLERS="gloo", NP3_FILES="no_such_file.py",
               HVDC_HOROVOD_FILES="test_two_phase_torch.py test_smoke_tf.py")
    proc = subprocess.run(["bash", str(REPO / "scripts" / "run_tests.sh")], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode != 0, out[-3000:]
    calls = (out_dir / "calls").read_text().split()
    assert calls.count("test_two_phase_torch.py") == 2 and calls.count("test_smoke_tf.py") == 1, calls
    assert all(calls.count(f) == 1 for f in set(calls) - {"test_two_phase_torch.py"}), calls
    summary = out[out.rindex("\nRERUN: "):].splitlines()[1:]
    log = out_dir / "logs" / "test_two_phase_torch[np=2,gloo].log"
    at = next(i for i, line in enumerate(summary) if line.startswith("RERUN: test_two_phase_torch[np=2,gloo]"))
    assert summary[at] == ("RERUN: test_two_phase_torch[np=2,gloo] crashed (exit 134, some rank wrote no report): "
                           "a Gloo receive in Horovod's background loop timed out (HOROVOD_GLOO_TIMEOUT_SECONDS), "
                           "and Horovod shut down (with a static process set, by aborting in "
                           "ProcessSetTable::Finalize); "
                           f"log {log}.attempt1"), summary
    assert summary[at + 1] == "    the rerun: exit 0", summary
    assert CRASH_LINE["test_two_phase_torch.py"] in Path(f"{log}.attempt1").read_text()
    assert "Timed out" not in log.read_text()  # the log of the rerun, which passed
    # the segfault: not rerun, reported with its log's lines, and a failure
    crashed = next(i for i, line in enumerate(summary) if line.startswith("CRASHED"))
    assert summary[crashed] == ("CRASHED (not rerun: no cause outside the project in its log): "
                                "test_smoke_tf[np=2,gloo], exit 134, some rank wrote no report; "
                                f"{out_dir}/logs/test_smoke_tf[np=2,gloo].log says:"), summary
    assert f"    {CRASH_LINE['test_smoke_tf.py']}" in summary
    assert "FAILED: test_smoke_tf[np=2,gloo] rank 1 (no report)" in summary
    assert "FAILED: test_smoke_tf[np=2,gloo] (exit 134)" in summary
    assert not any("two_phase" in line for line in summary if line.startswith("FAILED"))
    assert summary[-1] == "total: 6 passed, 1 failed, 0 skipped", summary  # 2 plain, 2 a launch


def test_files_of_a_framework_horovod_was_built_without_are_skipped_and_reported(tmp_path):
    """A TF-only Horovod (HVD_COMPRESS_FRAMEWORKS=tensorflow): the torch files are not
    launched; each is named on a SKIPPED line with the reason and counted as skipped."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    # the runner's one bare `python -` (stdin script, no arguments) asks which frameworks Horovod has
    tf_only = FAKE_PYTHON.replace("exec ", 'if [ "$1" = - ] && [ $# = 1 ]; then cat > /dev/null; echo tensorflow; '
                                           'exit 0; fi\nexec ', 1)
    _executable(venv / "bin" / "python", tf_only)
    launched = tmp_path / "launched"
    _executable(venv / "bin" / "horovodrun",
                FAKE_HOROVODRUN.replace("rc=0\n", f'rc=0\necho "$files" >> {launched}\n', 1))
    env = dict(os.environ, HVD_COMPRESS_VENV=str(venv), HVDC_TEST_OUT=str(tmp_path / "out"),
               HVDC_CONTROLLERS="gloo", NP3_FILES="no_such_file.py")
    proc = subprocess.run(["bash", str(REPO / "scripts" / "run_tests.sh")], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:]
    files = sorted(p.name for p in (REPO / "tests" / "horovod").glob("test_*.py"))
    torch_files = [f for f in files if "_torch" in f]
    tf_files = [f for f in files if "_tf" in f]
    assert torch_files and tf_files and sorted(torch_files + tf_files) == files
    assert sorted(launched.read_text().split()) == tf_files
    for f in torch_files:
        assert f"SKIPPED: {f}: the Horovod in {venv} was built without torch (HVD_COMPRESS_FRAMEWORKS)" in out
    n_launches = len(launched.read_text().splitlines())
    assert out.splitlines()[-1] == f"total: {2 + 2 * n_launches} passed, 0 failed, {len(torch_files)} skipped"


# Every launch passes, except test_smoke_tf.py's, which never ends: its ranks print what
# pytest's faulthandler prints for a test past its timeout, then wait.
HANG_DUMP = ("[0]<stderr>:Timeout (0:10:00)!\n"
             "[0]<stderr>:Thread 0x00007f0000000001 (most recent call first):\n"
             '[0]<stderr>:  File "/venv/lib/python3.11/site-packages/hvd_compress/auto/tf_auto.py", line 305 in decide_for\n'
             '[0]<stderr>:  File "tests/horovod/test_smoke_tf.py", line 12 in test_waits\n')
FAKE_HANGING_HOROVODRUN = f"""#!/usr/bin/env bash
np=0; file=; xml=; dump=
for a in "$@"; do case "$a" in faulthandler_timeout=*) dump="${{a#faulthandler_timeout=}}";; esac; done
while [ $# -gt 0 ]; do
  case "$1" in -np) np="$2"; shift;; *.py) file="$1";; --junitxml=*) xml="${{1#--junitxml=}}";; esac
  shift
done
if [ "${{file##*/}}" = test_smoke_tf.py ]; then
  echo "faulthandler_timeout=$dump"
  printf '%s' '{HANG_DUMP}'
  exec sleep 60
fi
for r in $(seq 0 $((np-1))); do echo '{PASSING}' > "${{xml//%RANK%/$r}}"; done
"""


def test_a_hung_launch_is_stopped_and_the_summary_shows_where_its_ranks_waited(tmp_path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    _executable(venv / "bin" / "python", FAKE_PYTHON)
    _executable(venv / "bin" / "horovodrun", FAKE_HANGING_HOROVODRUN)
    out_dir = tmp_path / "out"
    env = dict(os.environ, HVD_COMPRESS_VENV=str(venv), HVDC_TEST_OUT=str(out_dir), HVDC_CONTROLLERS="gloo",
               NP3_FILES="no_such_file.py", HVDC_LAUNCH_BOUND_S="2", HVDC_HANG_DUMP_S="1",
               HVDC_HOROVOD_FILES="test_smoke_tf.py test_smoke_torch.py")
    proc = subprocess.run(["bash", str(REPO / "scripts" / "run_tests.sh")], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode != 0, out[-3000:]
    assert "faulthandler_timeout=1" in out  # the ranks were asked to print their stacks
    summary = out[out.rindex("\nHUNG "):].splitlines()[1:]
    log = out_dir / "logs" / "test_smoke_tf[np=2,gloo].log"
    assert summary[0] == f"HUNG (stopped after 2 s, not rerun): test_smoke_tf[np=2,gloo]; {log} says " \
                         "(the stacks faulthandler printed):", summary
    for line in HANG_DUMP.splitlines():
        assert f"    {line}" in summary, summary
    assert "FAILED: test_smoke_tf[np=2,gloo] (exit 124)" in summary
    assert not any(line.startswith("RERUN") for line in summary)


def test_the_files_of_a_framework_share_a_launch_unless_they_register_a_process_set(tmp_path):
    """The default matrix (Gloo and MPI, 2 and 3 processes): one launch per framework,
    controller and process count, plus one for each file that registers a static process set
    (Horovod registers those at its first hvd.init() only); every file runs in every
    configuration it ran in when each file had launches of its own, exactly once."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    _executable(venv / "bin" / "python", FAKE_PYTHON)
    launched = tmp_path / "launched"
    _executable(venv / "bin" / "horovodrun",
                FAKE_HOROVODRUN.replace("rc=0\n", f'rc=0\necho "$np $ctl$files" >> {launched}\n', 1))
    env = dict(os.environ, HVD_COMPRESS_VENV=str(venv), HVDC_TEST_OUT=str(tmp_path / "out"))
    for name in ("NP3_FILES", "HVDC_MPI_FILES", "HVDC_CONTROLLERS", "HVDC_HOROVOD_FILES"):
        env.pop(name, None)
    proc = subprocess.run(["bash", str(REPO / "scripts" / "run_tests.sh")], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    # (the fake fails one test of test_process_set_torch.py at 2 MPI ranks, so the run fails)
    assert proc.stdout.splitlines()[-1] == "total: 26 passed, 1 failed, 0 skipped", proc.stdout[-3000:]
    launches = [line.split() for line in launched.read_text().splitlines()]
    own = {p.name for p in (REPO / "tests" / "horovod").glob("test_*.py")
           if "hvd.init(process_sets=" in p.read_text()}
    assert own == {"test_process_set_torch.py", "test_tf_compression.py", "test_two_phase_tf.py"}
    runs = [(np, ctl, f) for np, ctl, *files in launches for f in files]
    assert len(runs) == len(set(runs))  # no file twice in one configuration
    for np, ctl, *files in launches:
        assert len({"torch" if "_torch" in f else "tf" for f in files}) == 1, files  # one framework
        assert len(files) == 1 or not own & set(files), files  # a process-set file runs alone
    torch_gloo_2 = [files for np, ctl, *files in launches if (np, ctl) == ("2", "--gloo") and "_torch" in files[0]]
    every_torch = sorted(p.name for p in (REPO / "tests" / "horovod").glob("test_*.py") if "_torch" in p.name)
    assert sorted(f for files in torch_gloo_2 for f in files) == every_torch
    assert len(torch_gloo_2) == 2  # the shared launch, and the process-set file's own
    assert ("2", "--mpi", "test_smoke_tf.py") in runs and ("3", "--gloo", "test_auto_torch.py") in runs
    assert ("3", "--gloo", "test_torch_compression.py") not in runs  # NP3_FILES: MPI only
    assert len(launches) == 12, launches
