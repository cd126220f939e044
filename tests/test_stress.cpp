// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#include <cstdlib>

#include "helpers.hpp"
#include "stress.hpp"

namespace {

double env_or(const char* name, double fallback) {
  const char* v = std::getenv(name);
  return v != nullptr && *v != '\0' ? std::atof(v) : fallback;
}

}  // namespace

// TORCHDBG_STRESS_SEED and TORCHDBG_STRESS_SECONDS replay or lengthen a run; the seed is printed.
TEST_CASE("random concurrent training, attach/detach, hooks, health and reports: no crash, race or wrong norm",
          "[stress]") {
  torchdbg_test::StressOptions o;
  o.seed = static_cast<uint64_t>(env_or("TORCHDBG_STRESS_SEED", 20261201));
  o.seconds = env_or("TORCHDBG_STRESS_SECONDS", 2.0);
  o.jsonl_path = torchdbg_test::tmp_dir("stress") + "/run.jsonl";
  const auto rep = torchdbg_test::run_stress(o);
  INFO("seed " << o.seed);
  for (const auto& p : rep.problems) INFO(p);
  CHECK(rep.problems.empty());
  // The run did what it is for: every kind of event happened.
  CHECK(rep.steps_a > 5);
  CHECK(rep.steps_b > 5);
  CHECK(rep.session_swaps > 0);
  CHECK(rep.hook_changes > 0);
  CHECK(rep.health_swaps > 0);
  CHECK(rep.thrown_passes > 0);
}
