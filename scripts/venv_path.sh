# Sourced by scripts/install.sh, run_tests.sh, demo.sh, build_docs.sh and test_python_versions.sh:
# which virtual environment belongs to which Python, so each Python keeps its own.
#   hvdc_venv_path REPO MINOR  -> $HVD_COMPRESS_VENV if set, else REPO/.venv for Python 3.11
#                                 (MINOR 311) and REPO/.venv-py3NN for the others
#   hvdc_python_minor PYTHON   -> 311, 312, ... for that interpreter
#   hvdc_selected_venv REPO    -> the venv for $PYTHON when it is set (the one install.sh made
#                                 for it), else $HVD_COMPRESS_VENV, else REPO/.venv
hvdc_venv_path() {
  if [ -n "${HVD_COMPRESS_VENV:-}" ]; then
    printf '%s\n' "$HVD_COMPRESS_VENV"
  elif [ "$2" = 311 ]; then
    printf '%s\n' "$1/.venv"
  else
    printf '%s\n' "$1/.venv-py$2"
  fi
}
hvdc_python_minor() {
  "$1" -c 'import sys; print(sys.version_info[0] * 100 + sys.version_info[1])'
}
hvdc_selected_venv() {
  if [ -n "${PYTHON:-}" ]; then
    local minor
    minor="$(hvdc_python_minor "$PYTHON")" || { echo "cannot run PYTHON=$PYTHON" >&2; return 1; }
    hvdc_venv_path "$1" "$minor"
  else
    printf '%s\n' "${HVD_COMPRESS_VENV:-$1/.venv}"
  fi
}
