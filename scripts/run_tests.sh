#!/usr/bin/env bash
# Runs the whole test suite: plain pytest for everything that starts its own
# processes (unit, property, cluster, docker-file and example tests), then each
# file under tests/horovod/ under real `horovodrun` -- with Gloo, and with MPI for the files in
# MPI_FILES, with 2 processes, and also with 3 for the files listed in NP3_FILES.  An entry
# "file.py:gloo" runs at 3 processes with that controller only.  The files of one framework
# that run in one configuration share a launch, except those that register a static process
# set (below, "Which launches run").  Only torch files run at 3:
# the compressor runs the same code above Horovod's core ops whatever the framework and
# controller, the TF files' 3-process launches took 241 s of CI's wall time, and
# tests/testing/test_two_phase_cluster.py runs the TF two-phase file at 4 ranks with MPI
# (docs/development.md, "CI wall time", has the measured times).
# Any failure, or a run that collects no test (pytest's exit code 5), fails.
# The venv is the one scripts/install.sh made for $PYTHON (scripts/venv_path.sh;
# .venv when PYTHON is unset).  A framework that this venv's Horovod was built
# without (HVD_COMPRESS_FRAMEWORKS) skips its tests/horovod files (named *_torch*.py,
# *_tf*.py), each reported as SKIPPED with the reason and counted as skipped.
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/venv_path.sh
. "$REPO/scripts/venv_path.sh"
VENV="$(hvdc_selected_venv "$REPO")" || exit 1
PY="$VENV/bin/python"
HVDRUN="$VENV/bin/horovodrun"
OUT="${HVDC_TEST_OUT:-$REPO/out/tests}"
export TF_USE_LEGACY_KERAS=1 TF_CPP_MIN_LOG_LEVEL=3 PYTHONUNBUFFERED=1 PYTHONHASHSEED=0
NP3_FILES="${NP3_FILES:-test_torch_compression.py:mpi test_process_set_torch.py test_two_phase_torch.py
  test_auto_torch.py:gloo}"
CONTROLLERS="${HVDC_CONTROLLERS:-gloo mpi}"
# The files that also run with MPI ("all": every file).  The others (Auto, drop-in patterns,
# momentum, training) test the compressor's state and math above Horovod's core ops, which run
# the same code whatever the controller; the files below cover every scheme, the two-phase
# transport, process sets and failures through MPI's own collectives (docs/development.md,
# "CI wall time").
MPI_FILES="${HVDC_MPI_FILES:-test_smoke_torch.py test_smoke_tf.py test_torch_compression.py
  test_two_phase_torch.py test_process_set_torch.py test_reliability_torch.py test_reliability_tf.py}"
mkdir -p "$OUT"
cd "$REPO"

passed=0; failed=0; skipped=0; failures=()
count() { # junit xml -> add to totals (unless $3 = check-only); missing file = failure
  # locals matter: the caller's loop variable is also called f
  local xml="$1" label="$2" mode="${3:-add}" t f e s
  if [ ! -s "$xml" ]; then failed=$((failed+1)); failures+=("$label (no report)"); return; fi
  read -r t f e s < <("$PY" - "$xml" <<'PYEOF'
import sys, xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
suites = [root] if root.tag == "testsuite" else list(root)
t = sum(int(s.get("tests", 0)) for s in suites); f = sum(int(s.get("failures", 0)) for s in suites)
e = sum(int(s.get("errors", 0)) for s in suites); sk = sum(int(s.get("skipped", 0)) for s in suites)
print(t, f, e, sk)
PYEOF
)
  if [ "$mode" = check-only ]; then
    if [ $((f + e)) -gt 0 ] || [ "$t" = 0 ]; then failed=$((failed+1)); failures+=("$label ($((f+e)) failed, $t tests)"); fi
    if [ $((f + e)) -gt 0 ]; then add_failure_lines "$xml"; fi
    return
  fi
  passed=$((passed + t - f - e - s)); failed=$((failed + f + e)); skipped=$((skipped + s))
  if [ "$t" = 0 ]; then failed=$((failed+1)); failures+=("$label (no tests collected)"); fi
  if [ $((f + e)) -gt 0 ]; then failures+=("$label ($((f+e)) failed)"); add_failure_lines "$xml"; fi
}

add_failure_lines() { # junit xml -> the first failing tests and the first line of each message, under the
  # summary's FAILED line: CI keeps only the tail of the log, which names the failing
  # launch but not why it failed
  local line
  while IFS= read -r line; do failures+=("    $line"); done < <("$PY" - "$1" <<'PYEOF'
import sys, xml.etree.ElementTree as ET
bad = [(c, r) for c in ET.parse(sys.argv[1]).getroot().iter("testcase")
       for r in list(c) if r.tag in ("failure", "error")]
for case, result in bad[:3]:
    message = (result.get("message") or result.text or "").strip().splitlines() or [""]
    where = case.get("classname", "").rsplit(".", 1)[-1]  # the test file: a launch can hold several
    print(f"{where + '::' if where else ''}{case.get('name')}: {message[0][:300]}")
if len(bad) > 3:
    print(f"... and {len(bad) - 3} more")
PYEOF
)
}

record_exit() { # label rc: a non-zero exit is a failure; 5 (no tests collected) also counts as a failed test
  if [ "$2" -ne 0 ]; then failures+=("$1 (exit $2)"); [ "$2" = 5 ] && failed=$((failed+1)); fi
}

run() { # label, command...
  local label="$1"; shift
  echo; echo "=== $label: $*"; local start=$SECONDS
  "$@"; local rc=$?
  echo "=== $label: exit $rc in $((SECONDS-start)) s"
  record_exit "$label" "$rc"
  return 0
}

# 1. tests that need no horovodrun around them
# HVDC_PLAIN_TESTS narrows this run (scripts/test_python_versions.sh: tests/unit), HVDC_HOROVOD_FILES
# the horovodrun launches (names under tests/horovod/); both default to everything
# shellcheck disable=SC2086  # HVDC_PLAIN_TESTS is a list of paths
run "pytest" "$PY" -m pytest -p no:cacheprovider -ra -q --junitxml="$OUT/plain.xml" ${HVDC_PLAIN_TESTS:-tests} --ignore=tests/horovod "$@"
count "$OUT/plain.xml" "pytest"

# 2. tests that run inside horovodrun, one launch per framework and configuration (below).
# A launch in which some rank died without writing its report (killed by a signal: an abort
# in the Gloo/MPI transport, the out-of-memory killer) and which did not hang is a crash.
# It runs once more only when its log shows a failure known to come from outside the
# project (OUTSIDE_CAUSES); then the rerun's result is what counts, and the summary prints
# the rerun with its cause and the first attempt's log.  Any other crash fails at once, and
# the summary prints the lines of its log that say why.
crashes=(); reruns=()
# OUTSIDE_PATTERNS[i] (an extended regular expression over the launch's log) shows the
# cause OUTSIDE_CAUSES[i]; docs/development.md, "Reruns", says why each is outside the project
OUTSIDE_PATTERNS=(
  "Horovod background loop uncaught exception.*(Timed out waiting [0-9]+ms for recv|Application timeout caused pair closure)"
)
OUTSIDE_CAUSES=(
  "a Gloo receive in Horovod's background loop timed out (HOROVOD_GLOO_TIMEOUT_SECONDS), and Horovod shut down (with a static process set, by aborting in ProcessSetTable::Finalize)"
)
outside_cause() { # log -> the cause of the first OUTSIDE_PATTERNS entry the log matches, or nothing
  local i
  for i in "${!OUTSIDE_PATTERNS[@]}"; do
    if grep -Eq -- "${OUTSIDE_PATTERNS[$i]}" "$1"; then echo "${OUTSIDE_CAUSES[$i]}"; return; fi
  done
}
rank_reports_missing() { # xml-prefix np -> true if some rank wrote no report
  local r; for r in $(seq 0 $(($2-1))); do [ -s "$1.rank$r.xml" ] || return 0; done; return 1
}
crash_lines() { # log -> the lines that say why a process died, and the top of the first Python stack
  awk '/Fatal Python error|terminate called|what\(\):|uncaught exception|Timed out|corrupted|double free|Assertion|Killed|status code [0-9]+/ && !seen[$0]++ && n++ < 12 { print }
       /Current thread|Thread 0x/ && !stack { stack = 5 }
       stack > 0 && stack-- { print }' "$1"
}
#: a launch still running after LAUNCH_BOUND_S is stopped as hung (a failure); a single test
#: still running after HANG_DUMP_S prints every rank's Python stacks to the log first (the
#: slowest test files take about 300 s on a loaded 2-core machine)
LAUNCH_BOUND_S="${HVDC_LAUNCH_BOUND_S:-900}"
HANG_DUMP_S="${HVDC_HANG_DUMP_S:-600}"
hang_lines() { # log -> the test that was running and the top frames of each thread faulthandler printed
  awk '/Timeout \(|Thread 0x|Current thread/ { frames = 6 } frames > 0 && frames-- && n++ < 60 { print }' "$1"
}
launch() { # label np controller xml-prefix test-file...
  local label="$1" np="$2" ctl="$3" xml="$4" log="$OUT/logs/$1.log" attempt rc cause line
  shift 4
  mkdir -p "$OUT/logs"
  rm -f "$log.attempt1"
  for attempt in 1 2; do
    rm -f "$xml".rank*.xml
    echo; echo "=== $label (attempt $attempt): $*"; local start=$SECONDS
    # --capture=sys: pytest captures Python's output only, so what Horovod, Gloo and the C++
    # runtime write to stderr reaches the log (with the default fd capture, a process that
    # aborts takes those lines with it)
    # faulthandler_timeout: a test still running after HANG_DUMP_S prints every thread's Python
    # stack to the log (and goes on), so a launch that `timeout` stops shows where each rank waited
    timeout "$LAUNCH_BOUND_S" "$HVDRUN" -np "$np" -H "localhost:$np" "--$ctl" \
      "$PY" -m pytest -p no:cacheprovider --capture=sys -o faulthandler_timeout="$HANG_DUMP_S" \
      -ra -q "$@" --junitxml="$xml.rank%RANK%.xml" \
      -o junit_suite_name="$label" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    echo "=== $label: exit $rc in $((SECONDS-start)) s"
    if [ $attempt = 2 ]; then
      reruns+=("    the rerun: exit $rc")
      break
    fi
    # exit 124: the launch hung until `timeout` stopped it; a hang is a failure, never rerun
    if [ $rc -eq 124 ]; then
      crashes+=("HUNG (stopped after $LAUNCH_BOUND_S s, not rerun): $label; $log says (the stacks faulthandler printed):")
      while IFS= read -r line; do crashes+=("    $line"); done < <(hang_lines "$log")
    fi
    if [ $rc -ne 0 ] && [ $rc -ne 124 ] && rank_reports_missing "$xml" "$np"; then
      cause="$(outside_cause "$log")"
      if [ -n "$cause" ]; then
        mv "$log" "$log.attempt1"
        reruns+=("RERUN: $label crashed (exit $rc, some rank wrote no report): $cause; log $log.attempt1")
        continue
      fi
      crashes+=("CRASHED (not rerun: no cause outside the project in its log): $label, exit $rc, some rank wrote no report; $log says:")
      while IFS= read -r line; do crashes+=("    $line"); done < <(crash_lines "$log")
    fi
    break
  done
  record_exit "$label" "$rc"
  return 0
}
# the frameworks this venv's Horovod was built with: its extension libraries, found without importing
# torch or TF (a framework that was built but does not import fails its tests; it is not skipped)
HOROVOD_BUILT="$("$PY" - <<'PYEOF' 2>/dev/null
import glob, importlib.util, os
spec = importlib.util.find_spec("horovod")
root = spec.submodule_search_locations[0] if spec else ""
print(" ".join(fw for fw in ("torch", "tensorflow") if root and glob.glob(os.path.join(root, fw, "mpi_lib*.so"))))
PYEOF
)"
built_with() { # torch / tensorflow -> true if this venv's Horovod has that framework
  case " $HOROVOD_BUILT " in *" $1 "*) return 0;; esac; return 1
}
skipped_files=()
shopt -s nullglob
HOROVOD_FILES=()
if [ -n "${HVDC_HOROVOD_FILES:-}" ]; then
  for f in $HVDC_HOROVOD_FILES; do
    [ -f "tests/horovod/$f" ] || { echo "HVDC_HOROVOD_FILES: no tests/horovod/$f" >&2; exit 2; }
    HOROVOD_FILES+=("tests/horovod/$f")
  done
else
  HOROVOD_FILES=(tests/horovod/test_*.py)
fi
# Which launches run: one per framework, controller and process count, holding every file of
# that framework that runs in that configuration (a launch costs 12-28 s before its first test:
# horovodrun, Python, torch or TF, hvd.init; 30 launches of one file each spent 525 s of 1136 s
# there).  A file that registers a static process set (`hvd.init(process_sets=...)`) runs in a
# launch of its own: Horovod registers static sets at its first hvd.init() only, and the later
# hvd.init() calls of the other files in a launch do nothing.  torch and TF never share a
# launch: each has its own Horovod extension library, and so its own Horovod.
own_launch() { # test file -> true if it registers a static process set
  grep -q "hvd.init(process_sets=" "$1"
}
declare -A GROUP_FILES=(); GROUP_ORDER=()
for test_file in "${HOROVOD_FILES[@]}"; do
  base="$(basename "$test_file")"
  case "$base" in
    *_torch.py|*_torch_*.py) framework=torch;;
    *_tf.py|*_tf_*.py) framework=tensorflow;;
    *) framework="";;
  esac
  if [ -n "$framework" ] && ! built_with "$framework"; then
    skipped_files+=("SKIPPED: $base: the Horovod in $VENV was built without $framework (HVD_COMPRESS_FRAMEWORKS)")
    skipped=$((skipped + 1))
    continue
  fi
  if own_launch "$test_file"; then group="${base%.py}"; else group="${framework:-other}"; fi
  for ctl in $CONTROLLERS; do
    if [ "$ctl" = mpi ] && [ "$MPI_FILES" != all ]; then
      case " $(echo $MPI_FILES) " in *" $base "*) ;; *) continue;; esac
    fi
    nps="2"; case " $(echo $NP3_FILES) " in *" $base "*|*" $base:$ctl "*) nps="2 3";; esac
    for np in $nps; do
      key="$group|$np|$ctl"
      [ -n "${GROUP_FILES[$key]:-}" ] || GROUP_ORDER+=("$key")
      GROUP_FILES[$key]="${GROUP_FILES[$key]:-}${GROUP_FILES[$key]:+ }$test_file"
    done
  done
done
for key in "${GROUP_ORDER[@]}"; do
  IFS='|' read -r name np ctl <<< "$key"
  read -r -a files <<< "${GROUP_FILES[$key]}"
  # a launch of one file is named after it; a shared one after its framework and its file count
  if [ ${#files[@]} = 1 ]; then name="$(basename "${files[0]}" .py)"; else name="${name}_files_${#files[@]}"; fi
  label="$name[np=$np,$ctl]"
  xml="$OUT/$name-np$np-$ctl"
  launch "$label" "$np" "$ctl" "$xml" "${files[@]}"
  # every rank writes a report; count rank 0's, and require all ranks to have passed
  for r in $(seq 0 $((np-1))); do
    if [ $r = 0 ]; then count "$xml.rank0.xml" "$label"; else count "$xml.rank$r.xml" "$label rank $r" check-only; fi
  done
done

if [ ${#reruns[@]} -gt 0 ]; then echo; printf '%s\n' "${reruns[@]}"; fi
if [ ${#crashes[@]} -gt 0 ]; then echo; printf '%s\n' "${crashes[@]}"; fi
if [ ${#skipped_files[@]} -gt 0 ]; then echo; printf '%s\n' "${skipped_files[@]}"; fi
echo
for entry in "${failures[@]}"; do # an indented entry says why the FAILED line above it failed
  case "$entry" in "    "*) printf '%s\n' "$entry";; *) printf 'FAILED: %s\n' "$entry";; esac
done
[ -n "${HVDC_CI_START:-}" ] && echo "wall time since CI start (set-up included): $(( $(date +%s) - HVDC_CI_START )) s"
echo "python: $("$PY" --version 2>&1) in $VENV"
echo "total: $passed passed, $failed failed, $skipped skipped"
[ $failed -eq 0 ] && [ ${#failures[@]} -eq 0 ] && [ $passed -gt 0 ]
