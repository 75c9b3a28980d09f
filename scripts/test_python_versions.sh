#!/usr/bin/env bash
# The tests on the Pythons other than CI's 3.11.  For each interpreter,
# scripts/install.sh sets up its own venv (.venv-py312, .venv-py313: Horovod
# 0.28.1 built for that Python, its wheel cached per Python), then one of
#   default:      tests/unit, and under horovodrun at np=2 over Gloo the files
#                 that exercise what the Python version can change -- reading
#                 parameter names and keys from Horovod's frames (Python 3.12
#                 inlines comprehensions, PEP 709): $VERSION_FILES below;
#   --horovod-only: those Horovod files, with tests/unit/test_horovod_internals.py
#                 as the plain part;
#   --full:       scripts/run_tests.sh's whole suite, Horovod files at np=2 over
#                 Gloo (HVDC_CONTROLLERS and NP3_FILES widen it);
#   --unit-only:  tests/unit only, installed with --no-horovod.
# Each Python's log goes to out/python_versions/py3NN-<mode>.log; the summary at the end
# has one line per Python (its totals and wall time, install included) and says
# FAILED for any Python whose install or tests failed.  docs/development.md
# quotes the last run.
#
# Usage: scripts/test_python_versions.sh [--full | --unit-only | --horovod-only] [--unit-only-for X.Y] [PYTHON ...]
#   default PYTHONs: python3.12 and python3.13 (pyenv's 3.12.1 / 3.13.0 where PATH has none)
#   --unit-only-for X.Y: that Python runs tests/unit only, the others as chosen
set -uo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$REPO/out/python_versions"
VERSION_FILES="${HVDC_VERSION_FILES:-test_smoke_torch.py test_smoke_tf.py test_drop_in_torch.py test_drop_in_tf.py test_training_tf.py}"
MODE=versions; UNIT_ONLY_FOR=""; PYTHONS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --full) MODE=full; shift;;
    --unit-only) MODE=unit; shift;;
    --horovod-only) MODE=horovod; shift;;
    --unit-only-for) [ $# -ge 2 ] || { echo "--unit-only-for needs a version, e.g. 3.13" >&2; exit 2; }
                     UNIT_ONLY_FOR+=" $2"; shift 2;;
    -h|--help) sed -n '2,22p' "${BASH_SOURCE[0]}"; exit 0;;
    -*) echo "unknown option '$1' (allowed: --full, --unit-only, --horovod-only, --unit-only-for X.Y, PYTHON paths)" >&2; exit 2;;
    *) PYTHONS+=("$1"); shift;;
  esac
done
if [ ${#PYTHONS[@]} = 0 ]; then
  for v in 3.12:3.12.1 3.13:3.13.0; do
    if command -v "python${v%%:*}" >/dev/null; then PYTHONS+=("$(command -v "python${v%%:*}")")
    elif [ -x "$HOME/.pyenv/versions/${v#*:}/bin/python" ]; then PYTHONS+=("$HOME/.pyenv/versions/${v#*:}/bin/python")
    else echo "no Python ${v%%:*} found (python${v%%:*} on PATH or ~/.pyenv/versions/${v#*:})" >&2; exit 2
    fi
  done
fi
# shellcheck source=scripts/venv_path.sh
. "$REPO/scripts/venv_path.sh"
export TF_USE_LEGACY_KERAS=1 TF_CPP_MIN_LOG_LEVEL=3 PYTHONUNBUFFERED=1 PYTHONHASHSEED=0
mkdir -p "$OUT"
summary=(); bad=0
for python in "${PYTHONS[@]}"; do
  minor="$(hvdc_python_minor "$python")" || { summary+=("FAILED: $python does not run"); bad=1; continue; }
  version="$("$python" -c 'import platform; print(platform.python_version())')"
  short="${version%.*}"
  mode=$MODE
  case " $UNIT_ONLY_FOR " in *" $short "*) mode=unit;; esac
  log="$OUT/py$minor-$mode.log"
  echo; echo "=== Python $version ($python): install, then the $mode run; log: $log"
  start=$SECONDS
  {
    install_start=$SECONDS
    if [ $mode = unit ]; then
      bash "$REPO/scripts/install.sh" --python "$python" --no-horovod
    else
      bash "$REPO/scripts/install.sh" --python "$python"
    fi
    install_rc=$?
    echo "=== install: exit $install_rc in $((SECONDS - install_start)) s"
    if [ $install_rc = 0 ]; then
      venv="$(hvdc_venv_path "$REPO" "$minor")"
      case $mode in
        unit) "$venv/bin/python" -m pytest -p no:cacheprovider -ra -q tests/unit;;
        versions|horovod)
          plain=tests/unit; [ $mode = horovod ] && plain=tests/unit/test_horovod_internals.py
          PYTHON="$python" HVDC_CONTROLLERS=gloo NP3_FILES="" HVDC_PLAIN_TESTS="$plain" \
            HVDC_HOROVOD_FILES="$VERSION_FILES" HVDC_TEST_OUT="$OUT/py$minor" bash "$REPO/scripts/run_tests.sh";;
        full) PYTHON="$python" HVDC_CONTROLLERS="${HVDC_CONTROLLERS:-gloo}" NP3_FILES="${NP3_FILES:-}" \
                HVDC_TEST_OUT="$OUT/py$minor" bash "$REPO/scripts/run_tests.sh";;
      esac
      echo "=== tests: exit $?"
    fi
  } > "$log" 2>&1 < /dev/null
  took=$((SECONDS - start))
  tests_rc="$(sed -n 's/^=== tests: exit //p' "$log" | tail -1)"
  if [ "$mode" = unit ]; then
    totals="$(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed).* in ' "$log" | tail -1 | tr -d '=')"
  else
    totals="$(grep '^total: ' "$log" | tail -1)"
  fi
  if [ -z "$tests_rc" ]; then
    summary+=("FAILED: Python $version: install failed after $took s (see $log)"); bad=1
  elif [ "$tests_rc" != 0 ]; then
    summary+=("FAILED: Python $version, $mode run: ${totals:-no totals} (exit $tests_rc, $took s; see $log)"); bad=1
  else
    summary+=("ok: Python $version, $mode run: ${totals# } ($took s with the install)")
  fi
  grep -E '^SKIPPED|^FAILED' "$log" | sed 's/^/    /' | head -20
done
echo; echo "=== summary (scripts/test_python_versions.sh)"
printf '%s\n' "${summary[@]}"
exit $bad
