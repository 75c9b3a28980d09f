#!/usr/bin/env bash
# One-shot CUDA check of hvd_compress, for a machine with a CUDA GPU
# and python3 with torch -- no network, no Horovod build, nothing to install
# (TensorFlow and zstandard are used when present, skipped with a reason when not):
#   1. every scheme's encode/decode + error feedback on CUDA agrees with the CPU
#      (bit-exact for deterministic schemes, same distribution for stochastic ones)
#   2. host-sync check of every hot path (torch.cuda.set_sync_debug_mode)
#   3. bench micro on CUDA at 16M and 256M elements, in copies of a device-to-device
#      dst.copy_(src); the speed targets judged at 256M
# Writes micro_cuda.json (bench micro's format), gpu_check.json and gpu_check.log
# to --out (default docs/results).  Without CUDA, or with --cpu-fallback, the same
# checks run on the CPU at small sizes (default --out out/gpu_check) and the
# benchmark goes to micro_cpu_fallback.json instead.  Usage:
#   bash scripts/gpu_check.sh [--out DIR] [--cpu-fallback] [--quick] [--parts correctness,sync,micro] ...
# (all options: bash scripts/gpu_check.sh --help).  Exit status 0: every
# correctness check passed.
# Python: $HVD_COMPRESS_PYTHON, else the repository's .venv when present, else python3.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export TF_USE_LEGACY_KERAS=1 TF_CPP_MIN_LOG_LEVEL=3 PYTHONUNBUFFERED=1
PY="${HVD_COMPRESS_PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x "$REPO/.venv/bin/python" ]; then PY="$REPO/.venv/bin/python"; else PY="python3"; fi
fi
cd "$REPO"
echo "gpu_check: $PY -m hvd_compress.tools.bench.gpu_check $*"
exec "$PY" -m hvd_compress.tools.bench.gpu_check "$@"
