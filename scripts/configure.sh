#!/usr/bin/env bash
# Configures the build directory (build/, or $TORCHDBG_BUILD_DIR) once; used by demo.sh and
# test.sh. Passes CMAKE_PREFIX_PATH through for LibTorch zip users.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${TORCHDBG_BUILD_DIR:-$root/build}"
args=(-S "$root" -B "$build" -DCMAKE_BUILD_TYPE="${CMAKE_BUILD_TYPE:-Release}")
if command -v ninja >/dev/null; then args+=(-G Ninja); fi
if [[ -n "${CMAKE_PREFIX_PATH:-}" ]]; then args+=("-DCMAKE_PREFIX_PATH=$CMAKE_PREFIX_PATH"); fi
if [[ -n "${TORCHDBG_HEADER_CHECK:-}" ]]; then args+=("-DTORCHDBG_HEADER_CHECK=$TORCHDBG_HEADER_CHECK"); fi
if [[ -n "${TORCHDBG_TSAN_TESTS:-}" ]]; then args+=("-DTORCHDBG_TSAN_TESTS=$TORCHDBG_TSAN_TESTS"); fi
if [[ -n "${TORCHDBG_SCALAR_TESTS:-}" ]]; then args+=("-DTORCHDBG_SCALAR_TESTS=$TORCHDBG_SCALAR_TESTS"); fi
if [[ -n "${TORCHDBG_FUZZ_TESTS:-}" ]]; then args+=("-DTORCHDBG_FUZZ_TESTS=$TORCHDBG_FUZZ_TESTS"); fi
if [[ -f "$build/CMakeCache.txt" ]]; then
  cmake -S "$root" -B "$build" >/dev/null
else
  cmake "${args[@]}" "$@"
fi
echo "$build"
