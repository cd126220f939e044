#!/usr/bin/env bash
# Instructions per training step, plain and monitored, counted by callgrind: figures that do
# not drift with the machine's load, unlike the bench's timings (docs/performance.md,
# "Counting instructions"). Each model and mode runs in a process of its own
# (`torchdbg_bench --models M --train-only MODE`), and only the steps inside its
# train_counted() are counted; a mode's figure is its count minus the plain step's.
#
#   bench/count_instructions.sh [MODELS] [MODES] [STEPS] [WARMUP]
#   defaults: gru,one  idle,every10,full  20  10 (STEPS and WARMUP multiples of 10: every10
#   counts its due steps at their share). mlp, cnn and transformer take far longer under
#   callgrind (a GRU process about ten minutes on a 2-core VM).
#
# TORCHDBG_BENCH names the bench binary (default build/bench/torchdbg_bench, unstripped).
# Needs valgrind, and a C compiler where LibTorch loads libhwy (see below). Valgrind runs no
# AVX-512: under it LibTorch and the statistics kernel take their AVX2 paths.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bench="${TORCHDBG_BENCH:-$root/build/bench/torchdbg_bench}"
models="${1:-gru,one}"
modes="${2:-idle,every10,full}"
steps="${3:-20}"
warmup="${4:-10}"
fail() { echo "count_instructions.sh: $*" >&2; exit 1; }
[[ "$steps" =~ ^[1-9][0-9]*$ && "$warmup" =~ ^[0-9]+$ ]] || fail "STEPS must be > 0 and WARMUP >= 0, got '$steps' and '$warmup'"
command -v valgrind >/dev/null || fail "needs valgrind (apt-get install valgrind)"
[[ -x "$bench" ]] || fail "no bench at $bench (./scripts/test.sh builds it)"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
preload=()
if [[ "$(ldd "$bench")" == *libhwy.so* ]]; then
  # Debian's libhwy (a dependency of LibTorch's) reads the time stamp counter with rdtscp when
  # it loads, which valgrind cannot run (SIGILL): a stand-in for that one function.
  command -v cc >/dev/null || fail "needs a C compiler (cc) for a stand-in of libhwy's TimerResolution"
  printf 'unsigned long long _ZN3hwy8platform15TimerResolutionEv(void) { return 10; }\n' > "$out/hwy.c"
  printf 'HWY_0 { global: _ZN3hwy8platform15TimerResolutionEv; };\n' > "$out/hwy.map"
  cc -shared -fPIC -Wl,--version-script="$out/hwy.map" "$out/hwy.c" -o "$out/hwy.so"
  preload=(env "LD_PRELOAD=$out/hwy.so${LD_PRELOAD:+:$LD_PRELOAD}")
fi
count() {  # MODEL MODE: instructions inside the counted steps
  rm -f "$out/cg"
  ${preload[@]+"${preload[@]}"} valgrind --tool=callgrind --toggle-collect='*train_counted*' \
    --callgrind-out-file="$out/cg" "$bench" --models "$1" --train-only "$2" --steps "$steps" \
    --warmup "$warmup" > "$out/log" 2>&1 || { cat "$out/log" >&2; fail "$1 $2: the bench failed"; }
  local n
  n="$(awk '/^(summary|totals):/ { print $2; exit }' "$out/cg" 2>/dev/null || true)"
  [[ "$n" =~ ^[1-9][0-9]*$ ]] || fail "$1 $2: nothing counted (a stripped bench, or no train_counted in it?)"
  echo "$n"
}
echo "instructions per step (callgrind, $steps steps after $warmup warm-up steps, one process per mode)"
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
