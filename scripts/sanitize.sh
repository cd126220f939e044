#!/usr/bin/env bash
# The test suite under sanitizers at -O2 (./scripts/test.sh already runs it under
# ASan+UBSan and the concurrency tests under TSan, at -O0; optimised code can behave
# differently, and a sanitized -O2 build takes ~2x the compile time of the Release one):
#   build-asan/: every test under AddressSanitizer + UndefinedBehaviorSanitizer
#   build-tsan/: the concurrency tests under ThreadSanitizer (tests/tsan.supp: uninstrumented LibTorch)
# Usage: ./scripts/sanitize.sh [asan|tsan]... (default: both)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
kinds=("$@")
((${#kinds[@]})) || kinds=(asan tsan)
gen=()
if command -v ninja >/dev/null; then gen=(-G Ninja); fi
prefix=()
if [[ -n "${CMAKE_PREFIX_PATH:-}" ]]; then prefix=("-DCMAKE_PREFIX_PATH=$CMAKE_PREFIX_PATH"); fi
for kind in "${kinds[@]}"; do
  case "$kind" in
    asan) san="address;undefined" ;;
    tsan) san="thread" ;;
    *) echo "sanitize.sh: unknown kind '$kind' (asan or tsan)" >&2; exit 2 ;;
  esac
  build="$root/build-$kind"
  cmake -S "$root" -B "$build" "${gen[@]}" "${prefix[@]}" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
        "-DTORCHDBG_SANITIZE=$san" -DTORCHDBG_BUILD_BENCH=OFF -DTORCHDBG_BUILD_EXAMPLES=OFF >/dev/null
  cmake --build "$build" --target torchdbg_tests -j "$(nproc)"
  mkdir -p "$build/tests/tmp"
  export TORCHDBG_TEST_TMP="$build/tests/tmp"
  if [[ "$kind" == asan ]]; then
    UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 "$build/tests/torchdbg_tests"
  else
    TSAN_OPTIONS="suppressions=$root/tests/tsan.supp:halt_on_error=1" \
      "$build/tests/torchdbg_tests" "[manager],[attach],[hooked],[training],[health],[report],[inspector],[visualizer]"
  fi
done
