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

TEST_CASE("moment statistics skip the sign counts until a reader of stats() needs them", "[context]") {
  torchdbg::Metadata md;
  auto t = torch::relu(torch::randn({4096}));  // float32: the kernel's moments-only path
  const auto ref = torchdbg::compute_stats(t);
  REQUIRE(ref.zero_count > 0);
  {
    torchdbg::HookContext ctx("fc1", false, torchdbg::TrainingState{}, md, t);
    const auto& m = ctx.moment_stats();
    CHECK_FALSE(m.sign_counts);
    CHECK(m.l2_norm == ref.l2_norm);
    CHECK(&ctx.moment_stats() == &m);  // computed once
    const auto& s = ctx.stats();  // completes them: a second pass
    CHECK(s.sign_counts);
    CHECK(s.zero_count == ref.zero_count);
    CHECK(&ctx.moment_stats() == &s);  // later moment readers get the full ones
  }
  {
    torchdbg::HookContext ctx("fc1", false, torchdbg::TrainingState{}, md, t);
    CHECK(ctx.stats().zero_count == ref.zero_count);
    CHECK(ctx.moment_stats().sign_counts);  // already at hand: returned as they are
  }
  {  // the caller's moments-only statistics serve moment readers in place, not stats()
    const auto given = torchdbg::compute_stats(t, torchdbg::StatsOptions().sign_counts(false));
    torchdbg::HookContext ctx("fc1", false, torchdbg::TrainingState{}, md, t, &given);
    CHECK(&ctx.moment_stats() == &given);
    const auto& s = ctx.stats();
    CHECK(&s != &given);
    CHECK(s.zero_count == ref.zero_count);
    const auto& d = ctx.stats_with_distribution(8);
    CHECK(d.sign_counts);
    CHECK(d.zero_count == ref.zero_count);
    REQUIRE(d.distribution);
  }
  {  // a moments-only precomputed summary, then a distribution: the counts are computed too
    const auto given = torchdbg::compute_stats(t, torchdbg::StatsOptions().sign_counts(false));
    torchdbg::HookContext ctx("fc1", false, torchdbg::TrainingState{}, md, t, &given);
    const auto& d = ctx.stats_with_distribution(8);
    CHECK(d.zero_count == ref.zero_count);
    CHECK(d.sparsity == ref.sparsity);
  }
}
