#!/usr/bin/env bash
# The tests: installs what is missing, builds everything and runs ctest.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
build="$("$root/scripts/configure.sh" | tail -n 1)"
cmake --build "$build" -j "$(nproc)"
cd "$build"
ctest --output-on-failure -j "$(nproc)" "$@"
