#!/usr/bin/env bash
# Build the extension -- C++ and CUDA kernels, sm_90 -- against the torch of the lent GPU's image
# (torch 2.11.0+cu130, whose extensions build as C++17), here, before a device call: device calls
# have ended in compile errors this finds, spending most of a session's device time
# (bench/results/gpu_2026-12-04_H200_build_failed.md: autograd nodes held by shared_ptr before torch
# 2.13; std::bit_cast outside C++20). It is setup.py's own build (its flags, torch's nvcc flags, the
# link), in a scratch copy of the working tree (uncommitted changes included), so it cannot drift
# from what gpu_check.py builds. Nothing is run. A build takes minutes on a small CPU; the first
# call installs torch 2.11 with its CUDA libraries and headers (~3 GB) into $VENV. CI's stage 4
# builds the .cpp files against 2.11 on every push; the .cu files are compiled against it only here.
#   bash scripts/check_device_build.sh   # VENV (default /tmp/torch211), TORCH (2.11.0), JOBS
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH=${TORCH:-2.11.0}
VENV=${VENV:-/tmp/torch211}
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  "$PY" -m venv "$VENV"
  # torch with its nvidia-* dependencies: their include dirs hold the CUDA headers torch's
  # ATen/cuda headers include (cusparse.h, cublas_v2.h, ...), which setup.py finds there
  "$VENV/bin/pip" install -q "torch==$TORCH" setuptools ninja
fi
got=$("$VENV/bin/python" -c "import torch; print(torch.__version__, torch.version.cuda)")
[[ $got == "$TORCH"* && $got != *None ]] || { echo "$VENV has torch $got, not a CUDA $TORCH"; exit 1; }

SCRATCH=$(mktemp -d /tmp/check_device_build.XXXXXX)
trap 'rm -rf "$SCRATCH"' EXIT
git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$SCRATCH" 2>/dev/null || true
rm -rf "$SCRATCH"/build "$SCRATCH"/ppo_kernels/_C* "$SCRATCH"/ppo_kernels/_simt*
log=$SCRATCH/build.log
echo "check_device_build: building against torch $got (sm_90) in $SCRATCH ..."
start=$(date +%s)
if ! (cd "$SCRATCH" && PPO_KERNELS_FORCE_CUDA=1 TORCH_CUDA_ARCH_LIST=9.0 \
      MAX_JOBS=${JOBS:-$(nproc)} "$VENV/bin/python" setup.py build_ext --inplace) >"$log" 2>&1; then
  echo "check_device_build: FAILED against torch $got; the first errors:"
  grep -E -m20 "error|Error" "$log" || tail -30 "$log"
  exit 1
fi
# PPO_KERNELS_FORCE_CUDA=1 fails the build rather than leave the CUDA kernels out; say so anyway
grep -q "building CPU + CUDA kernels" "$log" && ls "$SCRATCH"/ppo_kernels/_C*.so >/dev/null \
  || { echo "check_device_build: no CUDA build in $log"; exit 1; }
echo "check_device_build: C++ and CUDA kernels build against torch $got ($(( $(date +%s) - start )) s)"
