// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#include <random>
#include <torchdbg/hook_context.hpp>
#include <torchdbg/hook_manager.hpp>

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

namespace {

/// Per index along `dim`, values above 0: a torch reference.
std::vector<int64_t> units_reference(const torch::Tensor& t, int64_t dim) {
  const int64_t d = dim < 0 ? dim + t.dim() : dim;
  std::vector<int64_t> others;
  for (int64_t i = 0; i < t.dim(); ++i)
    if (i != d) others.push_back(i);
  const torch::Tensor above = t.to(torch::kDouble) > 0;
  const torch::Tensor c = (others.empty() ? above.to(torch::kLong) : above.sum(others)).to(torch::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

void check_same_stats(const torchdbg::TensorStats& a, const torchdbg::TensorStats& b) {
  CHECK(a.sign_counts == b.sign_counts);
  CHECK(a.numel == b.numel);
  CHECK(a.finite_count == b.finite_count);
  CHECK(a.nan_count == b.nan_count);
  CHECK(a.pos_inf_count == b.pos_inf_count);
  CHECK(a.neg_inf_count == b.neg_inf_count);
  CHECK(a.zero_count == b.zero_count);
  CHECK(a.negative_count == b.negative_count);
  CHECK(torchdbg_test::near(a.mean, b.mean, 0.0));
  CHECK(torchdbg_test::near(a.std, b.std, 0.0));
  CHECK(torchdbg_test::near(a.min, b.min, 0.0));
  CHECK(torchdbg_test::near(a.max, b.max, 0.0));
  CHECK(torchdbg_test::near(a.l2_norm, b.l2_norm, 0.0));
  CHECK(torchdbg_test::near(a.l1_norm, b.l1_norm, 0.0));
}

}  // namespace

TEST_CASE("property: per-unit counts above 0 are a torch reference's, and the statistics read with them compute_stats', bit for bit",
          "[context]") {
  torchdbg_test::SeededRng rng(77);
  std::mt19937_64 gen(77);
  const auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(gen); };
  const torchdbg_test::RestoreThreads restore;  // the intra-op threads a trial reads with
  for (int trial = 0; trial < 300; ++trial) {
    // Every third trial an output large enough to be read in one pass with its counts; every
    // ninth one split between 2 to 4 threads, each counting its part (chunk boundaries fall
    // inside a unit's run and inside a block).
    const int64_t rank = trial % 3 == 0 ? 4 : pick(1, 4);
    std::vector<int64_t> shape;
    for (int64_t i = 0; i < rank; ++i) shape.push_back(i + 2 >= rank ? pick(1, 40) : pick(1, 6));
    if (trial % 3 == 0) shape = {8, pick(32, 63), 32, 32};  // 2^18 to 2^19 values
    if (trial % 9 == 0) shape = {pick(2, 8), pick(32, 63), 64, pick(48, 64)};  // up to 2^21
    const int threads = trial % 9 == 0 ? static_cast<int>(pick(2, 4)) : 1;
    torch::set_num_threads(threads);
    torch::Tensor t = torch::randn(shape) * std::pow(10.0, static_cast<double>(pick(-3, 3)));
    if (pick(0, 2) == 0) t = torch::relu(t);  // a ReLU's output: the kernel's non-negative path
    auto flat = t.view(-1);
    for (int64_t k = pick(0, 3); k > 0; --k) {  // NaN, +-Inf and zeros anywhere
      const int64_t at = pick(0, t.numel() - 1);
      const int64_t what = pick(0, 3);
      flat[at] = what == 0 ? std::nan("") : what == 1 ? INFINITY : what == 2 ? -INFINITY : 0.0;
    }
    const int64_t layout = pick(0, 4);  // 0-2 contiguous, 3 transposed, 4 half
    if (layout == 3 && rank >= 2) t = t.transpose(0, rank - 1);
    if (layout == 4) t = t.to(torch::kHalf);
    const int64_t dim = pick(-rank, rank - 1);
    const bool with_signs = pick(0, 1) == 1;  // a later hook reads stats(): the fused read counts signs
    INFO("trial " << trial << " shape " << t.sizes() << " dim " << dim << " dtype " << t.scalar_type()
                  << " threads " << threads << (with_signs ? " with an inspector" : ""));
    torchdbg::HookManager hooks;
    std::vector<int64_t> got;
    torchdbg::TensorStats moments;
    hooks.register_callback(
        "units",
        [&](const torchdbg::HookContext& ctx) {
          got = ctx.units_above_zero(dim);
          CHECK(&ctx.units_above_zero(dim) == &ctx.units_above_zero(dim));  // computed once
          moments = ctx.moment_stats();
        },
        torchdbg::CallbackStats::Moments);
    hooks.register_hook(torchdbg::HookConfig().name("units").trigger(torchdbg::HookTrigger::every_forward())
                            .actions({torchdbg::HookAction::custom_callback("units")}));
    if (with_signs)
      hooks.register_hook(torchdbg::HookConfig().name("inspect").trigger(torchdbg::HookTrigger::every_forward())
                              .actions({torchdbg::HookAction::inspect_tensor()}));
    const auto results = hooks.execute_hooks("layer", t, true);
    for (const auto& r : results) CHECK_FALSE(r.second.is_error());
    CHECK(got == units_reference(t, dim));
    check_same_stats(moments, torchdbg::compute_stats(t, torchdbg::StatsOptions().sign_counts(with_signs)));
  }
}

TEST_CASE("per-unit counts: a missing dimension is named, other dimensions recount, statistics at hand are kept",
          "[context]") {
  torchdbg::Metadata md;
  const auto scalar = torch::tensor(1.0f);
  torchdbg::HookContext zero_d("fc", true, torchdbg::TrainingState{}, md, scalar);
  CHECK_THROWS_WITH(zero_d.units_above_zero(0),
                    Catch::Contains("0-d tensor has no unit dimension (dimension 0 asked)"));
  const torch::Tensor undefined;
  torchdbg::HookContext none("fc", true, torchdbg::TrainingState{}, md, undefined);
  CHECK_THROWS_WITH(none.units_above_zero(1), Catch::Contains("undefined tensor"));
  const auto meta = torch::empty({2, 3}, torch::TensorOptions().device(torch::kMeta));
  torchdbg::HookContext no_data("fc", true, torchdbg::TrainingState{}, md, meta);
  CHECK_THROWS_AS(no_data.units_above_zero(1), torchdbg::Error);
  const auto t = torch::relu(torch::randn({8, 32, 32, 32}));  // read with its counts in one pass
  torchdbg::HookContext ctx("conv", true, torchdbg::TrainingState{}, md, t);
  CHECK_THROWS_WITH(ctx.units_above_zero(4), Catch::Contains("unit dimension 4 out of range for a 4-d tensor"));
  const auto& channels = ctx.units_above_zero(1);
  CHECK(channels == units_reference(t, 1));
  const auto* first = &ctx.moment_stats();  // read with the counts
  check_same_stats(*first, torchdbg::compute_stats(t, torchdbg::StatsOptions().sign_counts(false)));
  CHECK(ctx.units_above_zero(-1) == units_reference(t, 3));  // another dimension: counted again
  CHECK(ctx.units_above_zero(0) == units_reference(t, 0));
  CHECK(channels == units_reference(t, 1));  // still the channels' counts
  CHECK(&ctx.units_above_zero(1) == &channels);
  CHECK(&ctx.moment_stats() == first);  // the statistics are not read again
  // The caller's statistics stand: the counts are read on their own.
  torchdbg::TensorStats given = torchdbg::compute_stats(t);
  given.mean = 42.0;
  torchdbg::HookContext with_given("conv", true, torchdbg::TrainingState{}, md, t, &given);
  CHECK(with_given.units_above_zero(1) == units_reference(t, 1));
  CHECK(&with_given.moment_stats() == &given);
}
