#!/usr/bin/env bash
# The demo: installs what is missing, builds examples/training_loop.cpp and runs it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/scripts/setup.sh"
build="$("$root/scripts/configure.sh" | tail -n 1)"
cmake --build "$build" --target training_loop -j "$(nproc)"
exec "$build/examples/training_loop" "$@"
