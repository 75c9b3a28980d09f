#!/usr/bin/env bash
# The Horovod test files under horovodrun (as scripts/run_tests.sh launches them) while
# LOAD busy processes (`yes > /dev/null`) compete for the CPUs: a check that no test
# depends on the machine being idle.  Prints one line per launch and a total; exits
# non-zero if any launch failed.  The load processes end with the script.
#
#   bash scripts/stress_horovod_tests.sh                      # the defaults below
#   LOAD=2 REPS=3 NPS="2 3" FILES="test_auto_torch.py test_two_phase_torch.py" \
#     EXTRA="3:test_process_set_torch.py 2:test_auto_tf.py 3:test_auto_tf.py 3:test_two_phase_tf.py" \
#     bash scripts/stress_horovod_tests.sh
#
# FILES run REPS times at each NPS; EXTRA lists "np:file" launches run once after them.
# CTL is the controller (gloo or mpi).  Logs go to $HVDC_TEST_OUT/stress (out/tests/stress).
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HVD_COMPRESS_VENV:-$REPO/.venv}"
OUT="${HVDC_TEST_OUT:-$REPO/out/tests}/stress"
LOAD="${LOAD:-2}"
REPS="${REPS:-3}"
NPS="${NPS:-2 3}"
CTL="${CTL:-gloo}"
FILES="${FILES:-test_auto_torch.py test_two_phase_torch.py}"
EXTRA="${EXTRA:-3:test_process_set_torch.py 2:test_auto_tf.py 3:test_auto_tf.py 3:test_two_phase_tf.py}"
export TF_USE_LEGACY_KERAS=1 TF_CPP_MIN_LOG_LEVEL=3 PYTHONUNBUFFERED=1 PYTHONHASHSEED=0
mkdir -p "$OUT"
cd "$REPO" || exit 1

loaders=()
stop_load() { [ ${#loaders[@]} -gt 0 ] && kill "${loaders[@]}" 2>/dev/null; loaders=(); }
trap stop_load EXIT INT TERM
for _ in $(seq 1 "$LOAD"); do yes > /dev/null & loaders+=($!); done

launches=0; failed=0
launch() { # label np file
  local label="$1" np="$2" file="$3" log="$OUT/$1.log" start=$SECONDS rc
  timeout 900 "$VENV/bin/horovodrun" -np "$np" -H "localhost:$np" "--$CTL" \
    "$VENV/bin/python" -m pytest -p no:cacheprovider --capture=sys -ra -q "tests/horovod/$file" > "$log" 2>&1
  rc=$?
  launches=$((launches + 1)); [ $rc -ne 0 ] && failed=$((failed + 1))
  echo "$label: exit $rc in $((SECONDS - start)) s; $(grep -Eho '[0-9]+ passed[^[]*' "$log" | head -1);" \
       "load average $(cut -d' ' -f1 /proc/loadavg)"
}
for rep in $(seq 1 "$REPS"); do
  for np in $NPS; do
    for file in $FILES; do launch "${file%.py}[np=$np,$CTL] rep $rep" "$np" "$file"; done
  done
done
for entry in $EXTRA; do launch "${entry#*:}[np=${entry%%:*},$CTL]" "${entry%%:*}" "${entry#*:}"; done
stop_load
echo "stress: $launches launches beside $LOAD busy processes, $failed failed"
[ $failed -eq 0 ]
