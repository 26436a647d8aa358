#!/usr/bin/env bash
# Set up ppo-kernels on a fresh machine and run something, in one command:
#   bash scripts/dev.sh demo     # the main job: PPO with fused ops, then eager ops, side by side
#   bash scripts/dev.sh test     # the test suite (pytest-xdist, a worker per core; pytest's flags
#                                # follow: a file, -k, -n 0 for one process, --file-order=...)
#   bash scripts/dev.sh bench    # the CPU op tables (rewrites bench/results/, on purpose; --only
#                                # NAME, --all, --list: bench/run.py)
#   bash scripts/dev.sh lint     # ruff check + ruff format --check + clang-format (CI runs it)
#   bash scripts/dev.sh docs     # the documentation site on http://127.0.0.1:8000 (--build: build
#                                # it into build/site with warnings as errors, as CI does)
#   bash scripts/dev.sh wheel    # a binary wheel of the package into wheels/
#   bash scripts/dev.sh install ARGS  # pip install's arguments into the venv $VENV, as dev.sh
#                                # installs (through uv; CI's wheel stage uses it)
#   bash scripts/dev.sh setup    # only create the venv and build
# The torch build follows the machine: with an NVIDIA GPU, torch 2.14.1 (CUDA 13.0) and the C++ +
# CUDA kernels; without one, the CPU-only torch 2.13.0 and the C++ kernels. PPO_KERNELS_FORCE_CUDA=1
# (or TORCH=2.14.1) takes the CUDA build on a machine without a GPU (CI does, to compile the CUDA
# kernels). Later calls reuse the venv and rebuild only what changed (ninja), so they take seconds.
# Environment: VENV (default .venv), TORCH, PYTHON (default python3), MAX_JOBS (default 2),
# PPO_KERNELS_FORCE_CUDA / PPO_KERNELS_SKIP_CUDA_BUILD, PPO_KERNELS_NO_PEERS, DOCS_VENV (default
# .venv-docs), TORCH_CUDA_ARCH_LIST (GPU targets, setup.py's default 8.0;9.0+PTX).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=$(realpath -m "${VENV:-.venv}")
PY=${PYTHON:-python3}
export MAX_JOBS=${MAX_JOBS:-2}
export PIP_DISABLE_PIP_VERSION_CHECK=1
TORCH_CUDA=2.14.1 TORCH_CPU=2.13.0

say() { echo "== $*"; }

has_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q GPU; }

if [ -z "${TORCH:-}" ]; then
  if has_gpu || [ "${PPO_KERNELS_FORCE_CUDA:-0}" = 1 ]; then
    TORCH=$TORCH_CUDA
  else
    TORCH=$TORCH_CPU
    case "${1:-test}" in docs|lint|install) ;; *)  # those that need no torch
      say "no NVIDIA GPU here: CPU-only torch $TORCH_CPU, C++ kernels only" \
          "(PPO_KERNELS_FORCE_CUDA=1 or TORCH=$TORCH_CUDA for the CUDA build)" ;;
    esac
  fi
fi
TORCH_PIP=("torch==$TORCH")
if [ "$TORCH" = "$TORCH_CPU" ] && "$PY" -c \
    "import socket; socket.getaddrinfo('download.pytorch.org', 443)" >/dev/null 2>&1; then
  # PyPI's Linux torch is the CUDA build; the CPU-only wheel (+cpu, ~190 MB) is on PyTorch's index
  TORCH_PIP+=(--extra-index-url https://download.pytorch.org/whl/cpu)
fi
NUMPY=numpy
# torch 2.11 brings triton 3.6, whose interpreter (TRITON_INTERPRET=1: the Triton tests on the CPU)
# turns one-element arrays into Python scalars, which numpy 2.4 refuses (every Triton test fails)
case "$TORCH" in 2.11.*) NUMPY="numpy<2.4" ;; esac
DEPS=(ninja "$NUMPY" pytest pytest-xdist pytest-benchmark expecttest hypothesis "transformers>=4.45"
      tqdm matplotlib)

# The peers for the drop-in tests, installed by peers() below (names also used by inst)
PEERS="verl==0.9.1 trl==1.16.0 openrlhf==0.11.2"

# Installs go through uv where it installs (once a venv, with pip): pip unzips and byte-compiles
# every file of torch, uv links them from its cache (CI creates five venvs; DEVELOPING.md "Build
# while developing" has the times). It installs from where pip would (`pip config list`,
# translated by scripts/uv_args.py into uv's arguments and, for certificates and timeouts, its
# environment). PPO_KERNELS_PIP=1 keeps pip; an install uv fails is tried again with pip, whose
# messages name the problem. uv byte-compiles what it installs, as pip does: left to the first
# import, where bytecode is not written (PYTHONDONTWRITEBYTECODE, as in CI's image) every process
# compiles torch's sources again, which doubles its import (the suite starts a hundred of them).
uv_for() {  # uv for the venv $1 (its path on stdout), or nothing where it cannot be had
  [ "${PPO_KERNELS_PIP:-0}" = 1 ] && return 0
  if [ ! -x "$1/bin/uv" ]; then
    "$1/bin/pip" install -q uv >/dev/null 2>&1 || return 0
  fi
  echo "$1/bin/uv"
}

inst() {  # inst VENV ARGS...: pip install ARGS, through uv or pip (minus pip_filter.py's noise)
  local venv=$1 uv conf
  shift
  uv=$(uv_for "$venv")
  if [ -n "$uv" ]; then
    local args=() vars=()
    conf=$("$venv/bin/pip" config list 2>/dev/null || true)
    mapfile -t args < <("$PY" scripts/uv_args.py <<< "$conf")
    mapfile -t vars < <("$PY" scripts/uv_args.py --env <<< "$conf")
    env UV_COMPILE_BYTECODE="${UV_COMPILE_BYTECODE:-1}" ${vars[@]+"${vars[@]}"} \
      "$uv" pip install --python "$venv/bin/python" "${args[@]}" "$@" \
      && return 0
    say "uv could not install that: pip tries (its messages follow)"
  fi
  # shellcheck disable=SC2086  # one argument per peer
  "$venv/bin/pip" install "$@" 2>&1 | "$PY" scripts/pip_filter.py $PEERS
}

build_filter() {  # ninja's [n/m] lines shortened to the source file; other output passes
  local line n src
  while IFS= read -r line; do
    case "$line" in
      "["[0-9]*/[0-9]*"] "*)
        n=${line%%]*}]
        if [[ $line == *" -c "* ]]; then
          src=${line##* -c }; src=${src%% *}; echo "$n compiling csrc/${src#*/csrc/}"
        else
          echo "$n linking"
        fi ;;
      "Emitting ninja"*|"Compiling objects"*|"Allowing ninja"*|*" -shared "*) ;;
      *) printf '%s\n' "$line" ;;
    esac
  done
}

deps_want() { echo "${TORCH_PIP[*]} ${DEPS[*]}"; }  # what the venv's .ppo_deps records

setup() {
  if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV"
    "$PY" -m venv "$VENV"
    inst "$VENV" -q --upgrade pip setuptools wheel
  fi
  # dependencies: only when the wanted set changed since the last call
  local want
  want=$(deps_want)
  if [ "$(cat "$VENV/.ppo_deps" 2>/dev/null)" != "$want" ]; then
    say "installing torch $TORCH and the test / trainer dependencies (with uv: under a minute;" \
        "with pip: minutes, more for the 2.5 GB CUDA build)"
    inst "$VENV" -q "${TORCH_PIP[@]}" "${DEPS[@]}"
    echo "$want" > "$VENV/.ppo_deps"
  fi
  # the package from this checkout (a .pth, no editable-install machinery), compiled in place
  # against the torch just installed; ninja rebuilds only the sources that changed
  "$VENV/bin/python" -c "import site; open(site.getsitepackages()[0] + '/ppo_kernels_dev.pth', 'w').write('$PWD\n')"
  say "compiling the extension (ninja: only sources changed since the last build)"
  local t0=$SECONDS
  "$VENV/bin/python" setup.py -q build_ext --inplace 2>&1 | build_filter
  say "compiled in $(( SECONDS - t0 ))s"
  local info
  info=$("$VENV/bin/python" -m ppo_kernels info)
  echo "$info"
  grep -q "^compiled extension: yes" <<< "$info" || { echo "the extension did not build" >&2; exit 1; }
}

# The peers for the drop-in tests (tests/integrations/) and the parity tests: the supported
# verl / TRL / OpenRLHF without their dependencies, plus the few light imports their modules need
# at import time; tests/support/peer_stubs.py stands in for what only a GPU cluster needs (ray,
# tensordict, deepspeed, vllm, ...). A peer that does not install (e.g. OpenRLHF ships one wheel
# per Python) makes its tests skip. The peers go in last: an install with dependencies makes pip
# list every unmet pin of an installed package that depends on what it installed (for verl: ~20
# lines), an install --no-deps checks nothing (inst folds such a list into one line should a
# later install still bring one).
peers() {
  local p
  inst "$VENV" -q omegaconf accelerate codetiming orjson \
    || echo "the peers' light imports did not install: integration tests will skip" >&2
  # TRL's GRPOTrainer end to end (tests/integrations/test_trl_e2e.py) needs its data stack
  # (datasets with pandas / pyarrow); the version TRL 1.16.0 was tested with here
  inst "$VENV" -q datasets==5.2.0 \
    || echo "datasets did not install: the GRPOTrainer end-to-end tests will skip" >&2
  # a local Ray for the worker-activation test (tests/integrations/test_ray.py), the version
  # OpenRLHF 0.11.2 pins; Liger's kernels for verl's use_fused_kernels "liger" backend
  inst "$VENV" -q ray==2.55.0 || echo "ray did not install: the Ray worker test will skip" >&2
  # Liger's kernels need triton (the CUDA build of torch brings it); without triton an installed
  # liger-kernel breaks verl's own import of its fused-kernel module, so it is left out
  if "$VENV/bin/python" -c "import triton" >/dev/null 2>&1; then
    inst "$VENV" -q --no-deps liger-kernel==0.8.5 \
      || echo "liger-kernel did not install: verl's liger backend runs its torch route" >&2
  elif "$VENV/bin/python" -c "import liger_kernel" >/dev/null 2>&1; then
    "$VENV/bin/pip" uninstall -q -y liger-kernel  # a venv reused from before
  fi
  for p in $PEERS; do
    inst "$VENV" -q --no-deps "$p" || echo "$p did not install: its integration tests will skip" >&2
  done
}

# Formatter and linter (pinned, so a new release does not fail CI on unchanged code): ruff for
# Python, clang-format for csrc/ (.clang-format). Needs no torch.
LINTERS=(ruff==0.17.6 clang-format==23.1.5)
lint() {
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  inst "$VENV" -q "${LINTERS[@]}"
  "$VENV/bin/ruff" check .
  "$VENV/bin/ruff" format --check .
  git ls-files 'csrc/*.cpp' 'csrc/*.h' 'csrc/*.cu' 'csrc/*.cuh' \
    | xargs "$VENV/bin/clang-format" --dry-run --Werror
  echo "lint: ok"
}

# The documentation site (mkdocs.yml, docs/): MkDocs Material + mkdocstrings, in a venv of its own
# (no torch: the reference is read from the source). Every package pinned, the dependencies too,
# so that a new release cannot change the build.
DOCS_PKGS=(mkdocs==1.6.1 mkdocs-material==9.8.1 mkdocstrings==1.0.8 mkdocstrings-python==2.0.11
           griffelib==2.4.1 mkdocs-autorefs==1.4.5 mkdocs-get-deps==0.2.2
           mkdocs-material-extensions==1.3.1 pymdown-extensions==13.1.2 Markdown==3.11.3
           Pygments==2.21.0 Jinja2==3.1.6 MarkupSafe==3.0.4 PyYAML==6.0.4 pyyaml_env_tag==1.1
           babel==2.19.0 backrefs==8.3.1 click==8.5.1 colorama==0.4.6 ghp-import==2.1.0
           mergedeep==1.3.4 packaging==26.4 paginate==0.5.7 pathspec==1.1.1 platformdirs==4.14.9
           python-dateutil==4.0.0 requests==2.34.2 certifi==2026.10.19.post1
           charset-normalizer==3.5.3 idna==3.21 urllib3==2.8.0 watchdog==7.1.1 tzdata==2026.6
           ruff==0.17.6)  # ruff: mkdocstrings formats the signatures with it
docs() {
  local venv
  venv=$(realpath -m "${DOCS_VENV:-.venv-docs}")
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  if [ "$(cat "$venv/.ppo_deps" 2>/dev/null)" != "${DOCS_PKGS[*]}" ]; then
    say "installing the documentation tools into $venv"
    inst "$venv" -q --no-deps "${DOCS_PKGS[@]}"
    echo "${DOCS_PKGS[*]}" > "$venv/.ppo_deps"
  fi
  export NO_MKDOCS_2_WARNING=1  # Material's notice about its successor, on every build
  if [ "${1:-}" = --build ]; then
    "$venv/bin/mkdocs" build --strict "${@:2}"
    echo "docs: built build/site/index.html"
  else
    "$venv/bin/mkdocs" serve "$@"
  fi
}

# A binary wheel of the package with the extension compiled against the venv's torch (the CPU
# kernels; with a CUDA torch the CUDA kernels too: sm_80, sm_90 and PTX by default), named after that torch
# (setup.py: version 0.1.0+torch<version>, requiring torch==<version>). Built from the in-place
# build's objects (ninja: nothing to recompile after `setup`); never the test-only SIMT emulator.
wheel() {
  mkdir -p wheels
  PPO_KERNELS_BUILD_SIMT=0 "$VENV/bin/pip" wheel -q --no-build-isolation --no-deps -w wheels . \
    2>&1 | build_filter
  local whl
  whl=$(ls -t wheels/ppo_kernels-*.whl | head -n 1)
  say "built $whl"
  "$VENV/bin/python" -m zipfile -l "$whl" | grep -E "ppo_kernels/_C[.]" \
    || { echo "$whl holds no compiled extension" >&2; exit 1; }
}

cmd=${1:-test}
case "$cmd" in
  setup|test|bench|demo|wheel) ;;
  lint) lint; exit 0 ;;
  install) inst "$VENV" "${@:2}"; exit 0 ;;  # pip install's arguments, into $VENV (an existing venv)
  docs) docs "${@:2}"; exit 0 ;;
  *) echo "usage: $0 {setup|test|bench|demo|lint|docs|wheel|install}" >&2; exit 2 ;;
esac
if [ "$cmd" = demo ]; then  # the first run's installs and compiling, before they start
  "$PY" -I ppo_kernels/trainer/first_run.py --venv "$VENV" --want "$(deps_want)" --jobs "$MAX_JOBS" \
    $([ "$TORCH" = "$TORCH_CUDA" ] && [ "${PPO_KERNELS_SKIP_CUDA_BUILD:-0}" != 1 ] && echo --cuda) \
    || true
fi
setup
case "$cmd" in
  test)
    # PPO_KERNELS_NO_PEERS=1: no peers (their drop-in tests skip; CI's second stage runs none)
    [ "${PPO_KERNELS_NO_PEERS:-0}" = 1 ] || peers
    # one pytest-xdist worker per core, a test file per worker at a time (a file's module
    # fixtures and child processes run once, on one worker), unless the caller picks the workers
    # (-n 0: one process). CI runs this command as the README writes it: its flags live here.
    xdist=(-n auto --dist loadfile)
    for a in "${@:2}"; do
      case "$a" in -n|-n*|--numprocesses|--numprocesses=*) xdist=() ;; esac
    done
    # Each worker keeps torch's threads (one per core, so the kernels' threaded paths run), and
    # their OpenMP threads wait on the cores the other workers use: they sleep instead of spinning
    # while they wait (DEVELOPING.md "Tests" has the measurement).
    [ ${#xdist[@]} = 0 ] || export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
    "$VENV/bin/python" -m pytest -q -ra ${xdist[@]+"${xdist[@]}"} "${@:2}" ;;
  bench) "$VENV/bin/python" bench/run.py "${@:2}" ;;
  wheel) wheel ;;
  demo)
    say "the main job: PPO on the embedded task with fused ops, then eager ops (writes runs/demo)"
    # no checkpoint (92 MB; docs/trainer.md "What is kept on disk"): `demo --checkpoint` keeps one
    "$VENV/bin/python" -m ppo_kernels train --algo ppo --compare --out runs/demo --no-checkpoint \
      "${@:2}" ;;
esac
