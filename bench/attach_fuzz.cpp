// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
//
// The differential model fuzzer of the test suite (tests/attach_fuzz.hpp), over many models:
//   torchdbg_attach_fuzz [--models N] [--seed FIRST] [--steps S] [--verbose]
// Prints the models that mismatched (as code) and a count of mismatches by kind; exits 1 when
// any model mismatched.
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>

#include "../tests/attach_fuzz.hpp"

int main(int argc, char** argv) {
  int64_t models = 2000, steps = 3;
  uint64_t first = 1;
  bool verbose = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--models" && i + 1 < argc) {
      models = std::atoll(argv[++i]);
    } else if (a == "--seed" && i + 1 < argc) {
      first = std::strtoull(argv[++i], nullptr, 10);
    } else if (a == "--steps" && i + 1 < argc) {
      steps = std::atoll(argv[++i]);
    } else if (a == "--verbose") {
      verbose = true;
    } else {
      std::fprintf(stderr, "usage: torchdbg_attach_fuzz [--models N] [--seed FIRST] [--steps S] [--verbose]\n");
      return 2;
    }
  }
  int64_t failed = 0, checks = 0, deliveries = 0, gradients = 0;
  std::map<std::string, int64_t> kinds;  // a mismatch's text without names and numbers
  for (uint64_t seed = first; seed < first + static_cast<uint64_t>(models); ++seed) {
    const auto spec = torchdbg_test::fuzz::random_spec(seed);
    const auto r = torchdbg_test::fuzz::run(spec, static_cast<int>(steps));
    checks += r.checks;
    deliveries += r.deliveries;
    gradients += r.gradients;
    if (r.mismatches.empty()) continue;
    ++failed;
    for (const auto& m : r.mismatches) {
      std::string k;
      bool quoted = false;
      for (char c : m.substr(m.find(':') + 1)) {
        if (c == '\'') quoted = !quoted;
        if (!quoted && !std::isdigit(static_cast<unsigned char>(c)) && c != '.') k += c;
      }
      ++kinds[k];
    }
    if (verbose || failed <= 5) {
      std::printf("model %llu mismatched:\n  %s\n", static_cast<unsigned long long>(seed),
                  torchdbg_test::fuzz::as_code(spec).c_str());
      for (const auto& m : r.mismatches) std::printf("    %s\n", m.c_str());
    }
  }
  std::printf("torchdbg attach fuzz: %lld models, %lld passed, %lld mismatched; %lld deliveries, %lld gradients, %lld checks\n",
              static_cast<long long>(models), static_cast<long long>(models - failed), static_cast<long long>(failed),
              static_cast<long long>(deliveries), static_cast<long long>(gradients), static_cast<long long>(checks));
  for (const auto& [k, n] : kinds) std::printf("  %6lld x %s\n", static_cast<long long>(n), k.c_str());
  return failed == 0 ? 0 : 1;
}
