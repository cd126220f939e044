#!/usr/bin/env bash
# Compiles every torchdbg translation unit (tests, bench, examples) with -fsyntax-only against
# another LibTorch's headers, without its libraries: a quick check that the code still builds
# against, say, a LibTorch 2.x zip when only its include/ folder is at hand.
#   ./scripts/check_libtorch_headers.sh /path/to/libtorch        # the folder holding include/
# Each TU is compiled as a Debug build compiles it (attach.hpp differs without NDEBUG), and the
# umbrella header once more with NDEBUG. A full build with CMAKE_PREFIX_PATH=/path/to/libtorch
# is the real check; this one needs no shared libraries.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
lt="${1:?usage: $0 /path/to/libtorch}"
inc="$(cd "$lt/include" && pwd)"
[[ -f "$inc/torch/csrc/api/include/torch/torch.h" ]] || { echo "no LibTorch headers under $inc" >&2; exit 2; }
export TORCHDBG_CXX="${CXX:-g++}" TORCHDBG_INC="$inc" TORCHDBG_ROOT="$root"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
echo '#include <torchdbg/torchdbg.hpp>' >"$work/umbrella.cpp"

check_one() {  # <file> <-DNDEBUG|-UNDEBUG> <log dir>
  local out
  out="$3/$(basename "$1")$2.log"
  if "$TORCHDBG_CXX" -std=c++17 -fsyntax-only -Wall -Wextra -Werror "$2" \
       -DUSE_C10D_GLOO -DUSE_DISTRIBUTED '-DTORCHDBG_TEST_PYTHON="python3"' \
       -I"$TORCHDBG_ROOT/include" -I"$TORCHDBG_ROOT/tests" \
       -isystem "$TORCHDBG_INC" -isystem "$TORCHDBG_INC/torch/csrc/api/include" \
       "$1" >"$out" 2>&1; then
    echo "ok   $1 ($2)"
  else
    echo "FAIL $1 ($2)"; head -20 "$out"; touch "$3/failed"
  fi
}
export -f check_one

cd "$root"
{ printf '%s -UNDEBUG\n' tests/*.cpp bench/*.cpp examples/*.cpp; echo "$work/umbrella.cpp -DNDEBUG"; } |
  xargs -P "$(nproc)" -L1 bash -c 'check_one "$0" "$1" "'"$work"'"'
version=$(grep -rhE '#define TORCH_VERSION_(MAJOR|MINOR) ' "$inc/torch" | awk '{print $3}' | paste -sd.)
if [[ -e "$work/failed" ]]; then
  echo "LibTorch ${version:-?} headers: failures"; exit 1
fi
echo "LibTorch ${version:-?} headers: every TU compiled"
