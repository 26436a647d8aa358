#!/usr/bin/env bash
# The C++ kernels and the SIMT emulator under AddressSanitizer + UndefinedBehaviorSanitizer, in one
# command (CI's sanitizer stage runs the same):
#   bash scripts/sanitize.sh                      # build, then the default subset (TESTS below)
#   bash scripts/sanitize.sh tests/ops/test_gae.py -k carry   # build, then these pytest arguments
# The build (PPO_KERNELS_SANITIZE=1 PPO_KERNELS_BUILD_SIMT=1: -fsanitize=address,undefined, -O0, no
# CUDA) keeps its objects in build/sanitize/ and swaps the in-place ppo_kernels/_C*.so and
# _simt*.so for the sanitized ones while the tests run; the previous files are put back on exit.
# Python and torch are not instrumented: libasan is preloaded into the interpreter (the sanitized
# .so files cannot load otherwise). A finding aborts the process that hit it (a pytest-xdist
# worker: its test fails as a crash); ASan's report goes to build/sanitize/logs/, UBSan's to stderr
# (kept in build/sanitize/logs/pytest.out). The script prints every report and fails.
# Environment: PYTHON (an interpreter with torch; default $VENV/bin/python, VENV default .venv),
# MAX_JOBS (compile jobs, default 2), SANITIZE_WORKERS (pytest-xdist workers, default 2).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-${VENV:-.venv}/bin/python}
export MAX_JOBS=${MAX_JOBS:-2}
OUT=build/sanitize
SAVED=$OUT/saved
LOGS=$OUT/logs

# What the stage runs by default (CI's sanitizer stage), chosen by what reaches our C++ code: every
# op's CPU kernels against float64 (the ops' test files), the property tests (random shapes,
# strides, masks, extreme values), the argument checks of every registered op and raw kernel (bad
# inputs), the documented edge rows, index offsets past 2^31 and 2^24 (sizes), the simt tests
# (every emulated CUDA kernel) and the reports this stage must give (sanitizer findings). Not the
# peers, the trainer or the distributed forms (the same kernels through longer paths), nor the
# batch-invariance tests (they assert properties of MKL's matmuls that do not hold under ASan).
# SANITIZE_SUBSET (CI picks it by the time the earlier stages left): "full" (the default, above),
# "core" (the emulated CUDA kernels and every CPU kernel's own file with the bad inputs: each C++
# kernel still runs under the sanitizers, on fewer shapes) or "min" (the C++ extension alone, no
# SIMT emulator build, and the files of the kernels with the most index arithmetic).
subset=${SANITIZE_SUBSET:-full}
case "$subset" in full|core|min) ;; *) echo "SANITIZE_SUBSET: full, core or min, got $subset" >&2; exit 2 ;; esac
MIN=(tests/ops/test_token_logprobs.py tests/ops/test_sampler.py tests/ops/test_full_kl.py
     tests/ops/test_kl.py tests/ops/test_gae.py tests/ops/test_distill_kernels.py
     tests/ops/test_bad_inputs.py)
TESTS=("${MIN[@]}")
if [ "$subset" != min ]; then
  TESTS+=(tests/simt tests/ops/test_linear_logprobs.py tests/ops/test_linear_policy_loss.py
          tests/ops/test_masked_stats.py tests/ops/test_group_advantages.py tests/ops/test_losses.py)
fi
if [ "$subset" = full ]; then
  TESTS+=(tests/ops/test_policy_losses.py tests/ops/test_devices.py tests/ops/test_edge_cases.py
          tests/ops/test_sizes.py tests/properties)
fi
simt=1; [ "$subset" != min ] || simt=0
# Deselected (pytest -k): cases that run none of our C++, and cases that cost minutes under ASan for
# paths the rest covers (without them these files take a third of the time).
SKIP=(
  triton   # the Triton interpreter (numpy)
  eager    # the eager backend (torch's own ops)
  compile  # torch.compile: Dynamo, Inductor and its C++ compiler
  n_16384  # sizes' N=16384 x V=152064 heads: minutes of torch matmuls around the same loops
  more_than_2_pow_31  # 2^31 bf16 elements through one kernel: sizes' rows past 2^31 check the offsets
  fallback_without_the_extension  # no extension loaded
  environment_variable  # fresh interpreters importing torch, to read an environment variable
  peak_memory  # allocation peaks of large shapes (the normal stages check them)
)
k=$(printf ' and not %s' "${SKIP[@]}")
SELECT=(-k "${k# and }")

say() { echo "== sanitize: $*"; }

# ---- build ----------------------------------------------------------------------------------
mkdir -p "$SAVED" "$LOGS"
restore() {
  rm -f ppo_kernels/_C*.so ppo_kernels/_simt*.so
  if compgen -G "$SAVED/*" >/dev/null; then mv -f "$SAVED"/* ppo_kernels/; fi
}
rm -f "$SAVED"/*
for f in ppo_kernels/_C*.so ppo_kernels/_simt*.so ppo_kernels/_C.torch_version; do
  [ -e "$f" ] && mv "$f" "$SAVED/"
done
trap restore EXIT
say "building with -fsanitize=address,undefined into $OUT (ninja: only what changed)"
# ccache (torch wraps the compiler in it when it is installed) keyed on paths relative to the
# checkout: an unchanged source compiles from the cache in any clone (CI's are fresh ones)
export CCACHE_BASEDIR=${CCACHE_BASEDIR:-$ROOT} CCACHE_NOHASHDIR=${CCACHE_NOHASHDIR:-1}
t0=$(date +%s)
PPO_KERNELS_SANITIZE=1 PPO_KERNELS_BUILD_SIMT=$simt "$PY" setup.py -q build_ext --inplace \
  -b "$OUT/lib" -t "$OUT/temp" 2>&1 | grep -v "^\[[0-9]*/[0-9]*\] \|^Emitting ninja\|^Compiling obj\|^Allowing ninja\| -shared " || true
[ -e "$(ls ppo_kernels/_C*.so 2>/dev/null | head -1)" ] \
  && { [ "$simt" = 0 ] || compgen -G "ppo_kernels/_simt*.so" >/dev/null; } \
  || { echo "the sanitized build failed" >&2; exit 1; }
say "build took $(( $(date +%s) - t0 ))s"

# ---- run ------------------------------------------------------------------------------------
lib() {  # a runtime library of this gcc, by its full path
  local p; p=$(gcc -print-file-name="$1")
  [ -e "$p" ] || { echo "gcc's $1 not found (gcc -print-file-name=$1)" >&2; exit 1; }
  echo "$p"
}
# libasan first (the instrumented .so files need its runtime loaded before anything else);
# libstdc++ beside it: ASan resolves the real __cxa_throw when it starts, and a Python
# interpreter has not loaded libstdc++ by then (the first C++ exception would stop the run).
preload="$(lib libasan.so) $(lib libstdc++.so.6)"
rm -rf "$LOGS"; mkdir -p "$LOGS"
# detect_leaks=0: the interpreter and torch keep memory to exit. allow_user_segv_handler: the SIMT
# emulator turns a kernel's fault on its guard pages into an exception. detect_stack_use_after_return=0:
# ASan's fake stacks do not follow the emulator's fibers (ucontext). log_path: ASan's reports (from
# test subprocesses too) as files; UBSan, loaded beside ASan, writes to stderr only.
export ASAN_OPTIONS="detect_leaks=0:allow_user_segv_handler=1:detect_stack_use_after_return=0:log_path=$ROOT/$LOGS/asan"
# torch's profiler (the peak-memory tests) logs each start and stop to stderr, which reaches the
# terminal with --capture=sys below
export KINETO_LOG_LEVEL=${KINETO_LOG_LEVEL:-99}
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
args=("$@")
[ ${#args[@]} -gt 0 ] || args=("${TESTS[@]}" "${SELECT[@]}")
workers=${SANITIZE_WORKERS:-2}
say "pytest under ASan + UBSan (${workers} workers): ${args[*]}"
t0=$(date +%s)
# --capture=sys: a report written to stderr by the C++ runtime (then the process aborts) is not
# swallowed by pytest's capture of the test's output
set +e
LD_PRELOAD="$preload${LD_PRELOAD:+ $LD_PRELOAD}" "$PY" -m pytest -q -ra -p no:cacheprovider \
  --capture=sys -n "$workers" --dist loadfile "${args[@]}" 2>&1 | tee "$LOGS/pytest.out"
status=${PIPESTATUS[0]}
set -e
say "tests took $(( $(date +%s) - t0 ))s"
# A finding: ASan's ERROR / CHECK failed, UBSan's "runtime error:" (ASan's one warning, that it
# does not fully support swapcontext, is not: the emulator tells it its fiber switches).
pattern="ERROR: AddressSanitizer|AddressSanitizer: CHECK failed|runtime error: |ERROR: LeakSanitizer"
if grep -lE "$pattern" "$LOGS"/* >/dev/null 2>&1; then
  for f in $(grep -lE "$pattern" "$LOGS"/*); do
    [ "$f" = "$LOGS/pytest.out" ] && { grep -E -A40 "$pattern" "$f"; continue; }
    echo "---- $f"; cat "$f"
  done
  echo "sanitizer findings: the reports above (kept in $LOGS)" >&2
  exit 1
fi
exit "$status"
