#!/usr/bin/env bash
# Set up ppo-kernels on a fresh machine and run something, in one command:
#   bash scripts/dev.sh test     # build, then the whole test suite
#   bash scripts/dev.sh demo     # build, then the main job: PPO demo (fused vs eager) + benchmarks
#   bash scripts/dev.sh bench    # build, then the CPU benchmark table
#   bash scripts/dev.sh setup    # only create the venv and build
# Environment: VENV (default .venv), TORCH (default 2.14.1, the CUDA 13.0 build; 2.13.0 is the
# CPU-only build), PYTHON (default python3), MAX_JOBS, PPO_KERNELS_FORCE_CUDA / _SKIP_CUDA_BUILD.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(realpath -m "${VENV:-.venv}")
TORCH=${TORCH:-2.14.1}
PY=${PYTHON:-python3}
export MAX_JOBS=${MAX_JOBS:-2}
export PIP_DISABLE_PIP_VERSION_CHECK=1

pip_() {  # pip without this machine's "Location ... is ignored" noise; failures still fail
  "$VENV/bin/pip" "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }
}

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
    pip_ install -q --upgrade pip setuptools wheel
  fi
  pip_ install -q "torch==$TORCH" ninja pytest pytest-benchmark numpy expecttest hypothesis \
    "transformers>=4.45" tqdm matplotlib
  # Compiled against the torch just installed: C++ kernels, plus CUDA kernels if torch is a CUDA
  # build and nvcc is found (no GPU needed).
  pip_ install -q --no-build-isolation -e .
  "$VENV/bin/python" -c "import ppo_kernels._C" || { echo "the extension did not build" >&2; exit 1; }
  "$VENV/bin/python" -m ppo_kernels info
}

# The peers for the drop-in tests (tests/test_integrations*.py) and the parity tests: the supported
# verl / TRL / OpenRLHF without their dependencies, plus the few light imports their modules need
# at import time; tests/_peer_stubs.py stands in for what only a GPU cluster needs (ray,
# tensordict, deepspeed, vllm, ...). A peer that does not install (e.g. OpenRLHF ships one wheel
# per Python) makes its tests skip.
PEERS="verl==0.9.1 trl==1.16.0 openrlhf==0.11.2"
peers() {
  local p
  for p in $PEERS; do
    pip_ install -q --no-deps "$p" || echo "$p did not install: its integration tests will skip" >&2
  done
  pip_ install -q omegaconf accelerate codetiming orjson \
    || echo "the peers' light imports did not install: integration tests will skip" >&2
}

cmd=${1:-test}
setup
case "$cmd" in
  setup) ;;
  test) peers; "$VENV/bin/python" -m pytest -q -ra "${@:2}" ;;
  bench) "$VENV/bin/python" bench/run.py "${@:2}" ;;
  demo)
    if [ -f ppo_kernels/trainer/cli.py ]; then
      "$VENV/bin/python" -m ppo_kernels train --algo ppo --compare --out runs/demo "${@:2}"
    fi
    "$VENV/bin/python" bench/run.py --ops token_logprobs ;;
  *) echo "usage: $0 {setup|test|bench|demo}" >&2; exit 2 ;;
esac
