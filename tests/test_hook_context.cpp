// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#include <torchdbg/hook_context.hpp>

#include "helpers.hpp"

TEST_CASE("context computes statistics once and adds the distribution on demand", "[context]") {
  torchdbg::Metadata md{{"parameter", "weight"}};
  auto t = torch::tensor({1.0, 2.0, 3.0, 4.0});
  torchdbg::TrainingState st;
  st.step = 3;
  st.loss = 0.5;
  torchdbg::HookContext ctx("fc1", false, st, md, t);
  CHECK(ctx.layer_name() == "fc1");
  CHECK_FALSE(ctx.is_forward());
  CHECK(ctx.step() == 3);
  CHECK(ctx.loss() == 0.5);
  CHECK_FALSE(ctx.gradient_norm());
  CHECK(ctx.metadata_value("parameter") == std::optional<std::string_view>("weight"));
  CHECK_FALSE(ctx.metadata_value("bias"));
  const auto* first = &ctx.stats();
  CHECK(first->mean == 2.5);
  CHECK_FALSE(first->distribution);
  const auto& full = ctx.stats_with_distribution(4);
  CHECK(&full == first);  // the same object, extended
  REQUIRE(full.distribution);
  CHECK(full.distribution->bin_counts.size() == 4);
  CHECK(full.median == 2.5);
}

TEST_CASE("precomputed statistics are read in place and never extended in place", "[context]") {
  torchdbg::Metadata md;
  auto t = torch::tensor({1.0, 2.0, 3.0, 4.0});
  torchdbg::TensorStats given = torchdbg::compute_stats(t);
  given.mean = 42.0;  // marks the caller's object: the context must not recompute
  torchdbg::HookContext ctx("fc1", true, torchdbg::TrainingState{}, md, t, &given);
  CHECK(&ctx.stats() == &given);
  CHECK(ctx.stats().mean == 42.0);
  const auto& full = ctx.stats_with_distribution(4);
  REQUIRE(full.distribution);
  CHECK(full.mean == 42.0);  // a copy of the caller's statistics, extended
  CHECK(&full != &given);
  CHECK_FALSE(given.distribution);
  CHECK(&ctx.stats() == &full);  // later readers see the extended copy
}
