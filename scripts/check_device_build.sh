#!/usr/bin/env bash
# Compile every C++ / CUDA source against the torch of the lent GPU's image (torch 2.11.0+cu130,
# whose extensions build as C++17), here, before a device call: on 2026-12-04 two device calls
# (about 8.5 of the session's 15 minutes) ended in compile errors this finds in ~5 minutes
# (autograd nodes held by shared_ptr before torch 2.13; std::bit_cast outside C++20). Paths
# with spaces are not supported.
# Syntax only for the .cpp files (both C++17 and C++20), sm_90 objects for the .cu files; nothing
# is linked or run. The first call downloads torch 2.11 and the CUDA headers (~2.7 GB) into $VENV.
#   bash scripts/check_device_build.sh   # VENV (default /tmp/torch211), TORCH (2.11.0), JOBS, NVCC
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=${TORCH:-2.11.0}
VENV=${VENV:-/tmp/torch211}
PY=${PYTHON:-python3}
NVCC=${NVCC:-/usr/local/cuda/bin/nvcc}
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [ ! -d "$VENV/lib" ]; then
  "$PY" -m venv "$VENV"
  # headers only: torch's own wheel (no import, so none of its runtime libraries) and the CUDA
  # headers its ATen/cuda headers include (cusparse.h, cublas_v2.h, ...)
  "$VENV/bin/pip" install -q --no-deps "torch==$TORCH"
  "$VENV/bin/pip" install -q "cuda-toolkit[cusparse,cublas,cudart,cusolver,curand,cufft]==13.0.2"
fi
SITE=$(echo "$VENV"/lib/python3*/site-packages)
TI=$SITE/torch/include
PYINC=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
INC=(-Icsrc "-I$TI" "-I$TI/torch/csrc/api/include" -I/usr/local/cuda/include
     "-I$SITE/nvidia/cu13/include" "-I$PYINC")
DEFS=(-DNDEBUG -DPPO_KERNELS_BUILD -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C)
JOBS=${JOBS:-$(nproc)}
[ -x "$NVCC" ] || { echo "nvcc not found at $NVCC: set NVCC"; exit 1; }

one() {  # one source in one dialect; prints its first errors and fails when it does not compile
  local std=$1 f=$2 out
  local extra=()
  [[ $f == csrc/testing/* ]] && extra=(-DPPO_SIMT)
  if [[ $f == *.cu ]]; then
    out=$("$NVCC" -c -o /dev/null "-std=$std" -O1 --expt-relaxed-constexpr "${DEFS[@]}" \
      -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ \
      -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ -Xcompiler -fPIC \
      -gencode arch=compute_90,code=sm_90 "${INC[@]}" "$f" 2>&1) && return 0
  else
    out=$(g++ -fsyntax-only -fPIC -fopenmp "-std=$std" "${DEFS[@]}" "${extra[@]}" "${INC[@]}" \
      "$f" 2>&1) && return 0
  fi
  echo "FAILED ($std): $f"
  grep -m5 "error" <<<"$out"
  return 1
}
export -f one
export NVCC
export DEFS_S="${DEFS[*]}" INC_S="${INC[*]}"

fail=0
{
  for f in csrc/cuda/*.cu; do echo "c++17 $f"; done  # the longest first
  for std in c++17 c++20; do
    for f in csrc/*.cpp csrc/cpu/*.cpp csrc/ops/*.cpp csrc/testing/*.cpp; do echo "$std $f"; done
  done
} | xargs -P "$JOBS" -L1 bash -c 'read -ra DEFS <<<"$DEFS_S"; read -ra INC <<<"$INC_S"; one "$@"' _ \
  || fail=1
[ "$fail" = 0 ] && echo "check_device_build: every source compiles against torch $TORCH"
exit "$fail"
