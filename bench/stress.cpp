// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
//
// The concurrency stress run of the test suite (tests/stress.hpp), longer and over many seeds:
//   torchdbg_stress [--seconds S] [--seeds N] [--seed FIRST]
// Prints one line per run and a total; exits 1 when any run found a problem.
#include <cstdlib>
#include <cstring>
#include <string>

#include "../tests/stress.hpp"

int main(int argc, char** argv) {
  double seconds = 20;
  uint64_t seeds = 3, first = 1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--seconds") {
      seconds = std::atof(argv[i + 1]);
    } else if (a == "--seeds") {
      seeds = std::strtoull(argv[i + 1], nullptr, 10);
    } else if (a == "--seed") {
      first = std::strtoull(argv[i + 1], nullptr, 10);
    } else {
      std::fprintf(stderr, "usage: torchdbg_stress [--seconds S] [--seeds N] [--seed FIRST]\n");
      return 2;
    }
  }
  uint64_t bad = 0, steps = 0, thrown = 0, swaps = 0;
  for (uint64_t s = first; s < first + seeds; ++s) {
    torchdbg_test::StressOptions o;
    o.seed = s;
    o.seconds = seconds;
    const auto r = torchdbg_test::run_stress(o);
    bad += r.problems.empty() ? 0 : 1;
    steps += r.steps_a + r.steps_b;
    thrown += r.thrown_passes;
    swaps += r.session_swaps;
  }
  std::printf("torchdbg stress: %llu runs, %llu steps, %llu passes threw, %llu session swaps, %llu runs with problems\n",
              static_cast<unsigned long long>(seeds), static_cast<unsigned long long>(steps),
              static_cast<unsigned long long>(thrown), static_cast<unsigned long long>(swaps),
              static_cast<unsigned long long>(bad));
  return bad == 0 ? 0 : 1;
}
