#!/usr/bin/env bash
# Compile time of a training-loop file with and without torchdbg (docs/performance.md,
# "Compile time"): torch/torch.h and a 10-line loop; the same with the README's quick start
# (the `quickstart` snippet of examples/tour.cpp),
# header-only (torchdbg.hpp) and in the fast-build mode (torchdbg.hpp, lite.hpp); and the
# compiled library itself, once. Rounds run the variants back to back in a rotating order and
# each variant is also given relative to the plain file of its own round, which cancels the
# drift of a shared machine.
#   bench/compile_time.sh [ROUNDS]   (default 3)
# CXX (default g++), CXXFLAGS (default -O2) and TORCH_INCLUDE (default /usr/include, the
# directory that holds torch/ and ATen/) change the compiler, the flags and LibTorch.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
rounds="${1:-3}"
cxx="${CXX:-g++}"
inc="${TORCH_INCLUDE:-/usr/include}"
read -r -a extra <<< "${CXXFLAGS:--O2}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

loop='  torch::manual_seed(0);
  auto model = torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 4));
  torch::optim::SGD opt(model->parameters(), 0.1);'
cat > "$work/plain.cpp" <<EOF
#include <torch/torch.h>
#include <iostream>
int main() {
$loop
  for (int64_t step = 0; step < 100; ++step) {
    opt.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(model->forward(torch::randn({32, 8})),
                                                     torch::randint(0, 4, {32}));
    loss.backward();
    opt.step();
  }
  std::cout << "done\n";
}
EOF
# The README's quick start, as examples/tour.cpp holds it (its `quickstart` snippet).
snippet="$(sed -n '/\[snippet quickstart\]/,/\[\/snippet\]/p' "$root/examples/tour.cpp" | sed '1d;$d')"
if [[ -z "$snippet" ]]; then
  echo "compile_time.sh: no quickstart snippet in examples/tour.cpp" >&2
  exit 1
fi
quick="int main() {
$loop
$snippet
}"
printf '#include <torch/torch.h>\n#include <torchdbg/torchdbg.hpp>\n#include <iostream>\n%s\n' "$quick" > "$work/full.cpp"
printf '#include <torch/torch.h>\n#include <torchdbg/lite.hpp>\n#include <iostream>\n%s\n' "$quick" > "$work/lite.cpp"

flags=(-std=c++17 "${extra[@]}" -I"$root/include" -isystem "$inc/torch/csrc/api/include")
[[ "$inc" != /usr/include ]] && flags+=(-isystem "$inc")  # never the system directory itself
# name|source|extra flag
variants=("plain|plain.cpp|" "header-only torchdbg.hpp|full.cpp|" "compiled torchdbg.hpp|full.cpp|-DTORCHDBG_COMPILED_LIB"
          "compiled lite.hpp|lite.cpp|-DTORCHDBG_COMPILED_LIB")

echo "machine: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //'), $(nproc) threads; $("$cxx" --version | head -n 1)"
echo "flags: ${flags[*]}"
results="$work/results.txt"
measure() {  # round name source [flag]: appends "round|name|user-seconds max-KB"
  local extra_flag=()
  [[ -n "$4" ]] && extra_flag=("$4")
  if ! /usr/bin/time -o "$work/time" -f '%U %M' "$cxx" "${flags[@]}" "${extra_flag[@]}" -c "$work/$3" \
      -o "$work/out.o" 2> "$work/err"; then
    echo "compile of $2 failed:" >&2
    cat "$work/err" >&2
    exit 1
  fi
  echo "$1|$2|$(tail -n 1 "$work/time")" >> "$results"
}
/usr/bin/time -o "$work/time" -f '%U %M' "$cxx" "${flags[@]}" -c "$root/src/torchdbg.cpp" -o "$work/lib.o"
echo "compiled library (src/torchdbg.cpp, once): $(awk '{printf "%.1f s, %.2f GB", $1, $2 / 1048576}' "$work/time")"
for ((r = 0; r < rounds; ++r)); do
  for ((k = 0; k < ${#variants[@]}; ++k)); do
    IFS='|' read -r name src flag <<< "${variants[$(((k + r) % ${#variants[@]}))]}"
    measure "$r" "$name" "$src" "$flag"
  done
done
/usr/bin/python3 - "$results" <<'EOF'
import statistics, sys
rows = [l.rstrip("\n").split("|") for l in open(sys.argv[1])]
by = {}
for r, name, tm in rows:
    t, m = tm.split()
    by.setdefault(name, {})[r] = (float(t), int(m))
plain = by["plain"]
print(f"{'file':28} {'median':>9} {'x plain':>8} {'x plain, same round':>20} {'memory':>8}")
for name, runs in by.items():
    med = statistics.median(t for t, _ in runs.values())
    pair = statistics.median(t / plain[r][0] for r, (t, _) in runs.items())
    mem = max(m for _, m in runs.values()) / 1048576
    print(f"{name:28} {med:8.1f}s {med / statistics.median(t for t, _ in plain.values()):7.2f}x "
          f"{pair:19.2f}x {mem:7.2f}G")
EOF
