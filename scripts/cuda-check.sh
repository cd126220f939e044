#!/bin/bash
# CUDA checks on a machine with an NVIDIA GPU and a python3 whose torch has CUDA: builds the
# tests and the bench against that LibTorch (torch.utils.cmake_prefix_path), then runs the
# [cuda] tests, `torchdbg_bench --device cuda` and the whole suite, one tag per process, each
# phase within the time left of a budget. Seven logs go to OUT_DIR (default ./cuda-check).
#
#   scripts/cuda-check.sh [OUT_DIR]
#
# Environment: TORCHDBG_DEPS_PREFIX, a prefix holding fmt, nlohmann_json, RE2 and Catch2 when
# the system has none (e.g. Debian's headers, libre2 and CMake files copied under one folder);
# TORCHDBG_CHECK_SECONDS (default 570), the budget of the whole run.
set -u
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT_DIR=$(mkdir -p "${1:-cuda-check}" && cd "${1:-cuda-check}" && pwd)
BUDGET=${TORCHDBG_CHECK_SECONDS:-570}
DEPS=${TORCHDBG_DEPS_PREFIX:-}
T0=$(date +%s)
FAILED=0  # set by a phase that fails; the script's exit status
say() { echo "[$(($(date +%s) - T0)) s] $*"; }
# A phase's time limit: at most $1 seconds, and never past the budget.
left() {
  local l=$((BUDGET - ($(date +%s) - T0)))
  [ "$l" -lt 1 ] && l=1
  [ "$l" -lt "$1" ] && echo "$l" || echo "$1"
}

main() {
  say "machine"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c 'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda, torch.cuda.is_available())'
  g++ --version | head -1
  lscpu | grep -m1 "Model name"
  local tp tl py b=/tmp/torchdbg-cuda-build
  tp=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
  tl=$(python3 -c 'import torch, os; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
  py=$(command -v python3)
  export LD_LIBRARY_PATH=${DEPS:+$DEPS/lib/x86_64-linux-gnu:$DEPS/lib:}$tl:${LD_LIBRARY_PATH:-}
  say "configure"
  timeout "$(left 120)" cmake -S "$ROOT" -B $b -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$tp${DEPS:+;$DEPS}" -DTORCHDBG_TEST_SANITIZE= -DTORCHDBG_TSAN_TESTS=OFF \
    -DTORCHDBG_HEADER_CHECK=OFF -DTORCHDBG_BUILD_EXAMPLES=OFF -DTORCHDBG_TEST_PYTHON="$py" \
    >"$OUT_DIR/configure.txt" 2>&1
  local rc=$?
  echo "configure rc $rc"
  [ $rc -eq 0 ] || FAILED=1
  say "build"
  timeout "$(left 400)" cmake --build $b -j "$(nproc)" --target torchdbg_tests torchdbg_bench -- -k 0 \
    >"$OUT_DIR/build.txt" 2>&1
  rc=$?
  [ $rc -eq 0 ] || FAILED=1
  echo "build rc $rc, $(grep -c 'warning:' "$OUT_DIR/build.txt") warnings"
  grep -m 20 -E "error:|FAILED:" "$OUT_DIR/build.txt"
  local exe=$b/tests/torchdbg_tests bench=$b/bench/torchdbg_bench
  export TORCHDBG_TEST_TMP=/tmp/torchdbg-cuda-tmp
  mkdir -p $TORCHDBG_TEST_TMP
  if [ -x $exe ]; then
    say "[cuda] tests"
    timeout "$(left 150)" stdbuf -oL $exe "[cuda]" --order decl -d yes >"$OUT_DIR/cuda_tests.txt" 2>&1
    rc=$?
    [ $rc -eq 0 ] || FAILED=1
    echo "[cuda] tests rc $rc"
    tail -4 "$OUT_DIR/cuda_tests.txt"
  fi
  if [ -x $bench ]; then
    say "bench"
    (cd /tmp && timeout "$(left 150)" stdbuf -oL $bench --device cuda --models mlp,cnn,transformer,gru \
      --rss-steps 0 --count-ops --json "$OUT_DIR/bench_cuda.json" >"$OUT_DIR/bench_cuda.txt" 2>&1
     echo "bench rc $?" >>"$OUT_DIR/bench_cuda.txt")
    cat "$OUT_DIR/bench_cuda.txt"
  fi
  if [ -x $exe ]; then
    say "whole suite, one tag per process"
    local tags pids=() limit t logs=/tmp/torchdbg-cuda-suite
    mkdir -p $logs
    tags=$($exe --list-tags | sed -n 's/.*\[\([a-z_]*\)\].*/\1/p' | grep -v '^cuda$' | sort -u)
    limit=$(left 240)
    for t in $tags; do
      (mkdir -p "$TORCHDBG_TEST_TMP/$t"
       TORCHDBG_TEST_TMP=$TORCHDBG_TEST_TMP/$t timeout "$limit" $exe "[$t]" --order decl >"$logs/$t.txt" 2>&1
       echo "rc $?" >>"$logs/$t.txt") &
      pids+=($!)
    done
    wait "${pids[@]}"
    # One file for the suite: each tag's result, then the start of each failing tag's log.
    for t in $tags; do echo "$t: $(tail -3 "$logs/$t.txt" | tr '\n' ' ')"; done >"$OUT_DIR/suite.txt"
    for t in $tags; do
      tail -1 "$logs/$t.txt" | grep -q '^rc 0$' || { echo "=== $t"; head -c 20000 "$logs/$t.txt"; FAILED=1; }
    done >>"$OUT_DIR/suite.txt"
    head -40 "$OUT_DIR/suite.txt"
  fi
  grep -q "^bench rc 0" "$OUT_DIR/bench_cuda.txt" 2>/dev/null || FAILED=1
  say "done"
  return $FAILED
}

main 2>&1 | tee "$OUT_DIR/log.txt"
exit "${PIPESTATUS[0]}"
