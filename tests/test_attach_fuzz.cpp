// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#include <cstdlib>

#include "attach_fuzz.hpp"
#include "helpers.hpp"

// TORCHDBG_FUZZ_MODELS and TORCHDBG_FUZZ_SEED run more models or other ones.
TEST_CASE("differential fuzzer: random models deliver what their forward returned, every gradient and norm",
          "[fuzz_attach]") {
  const char* n_env = std::getenv("TORCHDBG_FUZZ_MODELS");
  const char* s_env = std::getenv("TORCHDBG_FUZZ_SEED");
  const int models = n_env != nullptr ? std::atoi(n_env) : 200;
  const uint64_t first = s_env != nullptr ? std::strtoull(s_env, nullptr, 10) : 1;
  int failed = 0;
  int64_t checks = 0;
  for (uint64_t seed = first; seed < first + static_cast<uint64_t>(models); ++seed) {
    const auto spec = torchdbg_test::fuzz::random_spec(seed);
    const auto r = torchdbg_test::fuzz::run(spec);
    checks += r.checks;
    if (r.mismatches.empty()) continue;
    ++failed;
    std::string what;
    for (const auto& m : r.mismatches) what += "\n  " + m;
    FAIL_CHECK("model " << seed << ":\n" << torchdbg_test::fuzz::as_code(spec) << what);
  }
  INFO(models << " models, " << checks << " checks");
  CHECK(failed == 0);
  CHECK(checks > models);
}
