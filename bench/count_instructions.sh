#!/usr/bin/env bash
# Instructions per training step, plain and monitored, counted by callgrind: figures that do
# not drift with the machine's load, unlike the bench's timings (docs/performance.md,
# "Counting instructions"). Each model and mode runs in its own process
# (`torchdbg_bench --train-only MODE`), counted inside the timed steps only.
#
#   bench/count_instructions.sh [MODELS] [MODES] [STEPS]
#   defaults: mlp,cnn,transformer,gru,one  idle,every10,full  20 (a multiple of 10: every10
#   counts its due steps at their share)
#
# TORCHDBG_BENCH names the bench binary (default build/bench/torchdbg_bench). Needs valgrind.
# Instructions ignore cache misses and memory bandwidth: a monitored step's time grows more
# than its instruction count (the statistics kernel's reads, code that runs at a lower IPC).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bench="${TORCHDBG_BENCH:-$root/build/bench/torchdbg_bench}"
models="${1:-mlp,cnn,transformer,gru,one}"
modes="${2:-idle,every10,full}"
steps="${3:-20}"
command -v valgrind >/dev/null || { echo "count_instructions.sh: needs valgrind (apt-get install valgrind)" >&2; exit 1; }
[[ -x "$bench" ]] || { echo "count_instructions.sh: no bench at $bench (./scripts/test.sh builds it)" >&2; exit 1; }
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
preload=()
if [[ "$(ldd "$bench")" == *libhwy.so* ]]; then
  # Debian's libhwy (a dependency of LibTorch's) reads the time stamp counter with rdtscp when
  # it loads, which valgrind cannot run (SIGILL): a stand-in for that one function.
  printf 'unsigned long long _ZN3hwy8platform15TimerResolutionEv(void) { return 10; }\n' > "$out/hwy.c"
  printf 'HWY_0 { global: _ZN3hwy8platform15TimerResolutionEv; };\n' > "$out/hwy.map"
  cc -shared -fPIC -Wl,--version-script="$out/hwy.map" "$out/hwy.c" -o "$out/hwy.so"
  preload=(env LD_PRELOAD="$out/hwy.so")
fi
count() {  # MODEL MODE: instructions inside the counted steps
  "${preload[@]}" valgrind --tool=callgrind --toggle-collect='*train_counted*' \
    --callgrind-out-file="$out/cg" "$bench" --models "$1" --train-only "$2" --steps "$steps" \
    > "$out/log" 2>&1 || { cat "$out/log" >&2; exit 1; }
  awk '/^(summary|totals):/ { print $2; exit }' "$out/cg"
}
echo "instructions per step (callgrind, $steps steps after 10 warm-up steps, one process per mode)"
for m in ${models//,/ }; do
  plain="$(count "$m" plain)"
  line="$(awk -v p="$plain" -v n="$steps" -v m="$m" 'BEGIN { printf "%s: plain %.3fM", m, p / n / 1e6 }')"
  for mode in ${modes//,/ }; do
    c="$(count "$m" "$mode")"
    line+="$(awk -v c="$c" -v p="$plain" -v n="$steps" -v mode="$mode" \
      'BEGIN { printf ", %s %+.0fK (%+.3f%%)", mode, (c - p) / n / 1e3, 100 * (c - p) / p }')"
  done
  echo "$line"
done
