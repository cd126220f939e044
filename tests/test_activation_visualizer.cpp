// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#include <torchdbg/activation_visualizer.hpp>
#include <torchdbg/hook_manager.hpp>

#include "helpers.hpp"

using torchdbg::ActivationVisualizer;
using torchdbg::VisualizerOptions;

TEST_CASE("visualizer keeps per-layer statistics checked against a reference", "[visualizer]") {
  torchdbg_test::SeededRng rng(21);
  ActivationVisualizer vis;
  auto t = torch::relu(torch::randn({16, 32}));
  vis.record("fc1/relu", t, 5);
  const auto a = vis.latest("fc1/relu");
  REQUIRE(a);
  const auto r = torchdbg_test::reference(t);
  CHECK(a->step == 5);
  CHECK(a->numel == 512);
  CHECK_SCALED(a->mean, r.mean, r.scale(), 1e-6);
  CHECK_CLOSE(a->std, r.std, 1e-6);  // float32 data: the float path
  CHECK(a->min == 0.0);
  CHECK(a->max == r.max);
  CHECK_CLOSE(a->median, torchdbg_test::ref_quantile(r.sorted, 0.5), 1e-12);
  CHECK_CLOSE(a->q25, torchdbg_test::ref_quantile(r.sorted, 0.25), 1e-12);
  CHECK_CLOSE(a->q75, torchdbg_test::ref_quantile(r.sorted, 0.75), 1e-12);
  CHECK(a->zeros == r.zeros);
  CHECK(a->zeros > 150);  // ReLU zeroes about half
  CHECK(a->negatives == 0);
  CHECK(a->positives == r.pos);
  CHECK_CLOSE(a->sparsity, static_cast<double>(r.zeros) / 512.0, 1e-15);
  int64_t out3 = 0;
  for (double x : r.sorted) out3 += std::fabs(x - r.mean) > 3 * r.std;
  CHECK(a->outliers == out3);
}

TEST_CASE("visualizer history is bounded and the histogram covers every finite value", "[visualizer]") {
  ActivationVisualizer vis(VisualizerOptions().history_capacity(4).histogram_bins(8));
  for (int64_t s = 0; s < 9; ++s) vis.record("x", torch::randn({100}), s);
  const auto h = vis.history("x");
  REQUIRE(h.size() == 4);
  CHECK(h.front().step == 5);
  const auto hist = vis.histogram("x");
  REQUIRE(hist);
  CHECK(hist->counts.size() == 8);
  CHECK(hist->edges.size() == 9);
  int64_t total = 0;
  for (auto c : hist->counts) total += c;
  CHECK(total == 100);
  CHECK_FALSE(vis.histogram("nope"));
}

TEST_CASE("heatmaps average leading dims, lay 1-D data near-square and downsample", "[visualizer]") {
  SECTION("last two dims, mean over the rest") {
    auto t = torch::arange(24, torch::kDouble).reshape({2, 3, 4});
    const auto h = torchdbg::make_heatmap(t, 64);
    REQUIRE(h.rows == 3);
    REQUIRE(h.cols == 4);
    const auto ref = t.mean(0);
    for (int64_t r = 0; r < 3; ++r)
      for (int64_t c = 0; c < 4; ++c) CHECK(h.at(r, c) == ref[r][c].item<double>());
  }
  SECTION("1-D becomes near-square with NaN padding") {
    const auto h = torchdbg::make_heatmap(torch::arange(10, torch::kFloat), 64);
    CHECK(h.rows == 3);
    CHECK(h.cols == 4);
    CHECK(h.at(0, 0) == 0.0);
    CHECK(h.at(2, 1) == 9.0);
    CHECK(std::isnan(h.at(2, 2)));
  }
  SECTION("block means down to the maximum size") {
    auto t = torch::arange(64, torch::kDouble).reshape({8, 8});
    const auto h = torchdbg::make_heatmap(t, 4);
    REQUIRE(h.rows == 4);
    REQUIRE(h.cols == 4);
    const auto ref = torch::avg_pool2d(t.view({1, 1, 8, 8}), 2).view({4, 4});
    for (int64_t r = 0; r < 4; ++r)
      for (int64_t c = 0; c < 4; ++c) CHECK(h.at(r, c) == ref[r][c].item<double>());
  }
  CHECK_THROWS_AS(torchdbg::make_heatmap(torch::ones({2}), 0), torchdbg::Error);
}

TEST_CASE("visualizer draws an ASCII histogram and exports JSON and a table", "[visualizer]") {
  ActivationVisualizer vis(VisualizerOptions().histogram_bins(4));
  vis.record("conv1", torch::tensor({0.0, 0.1, 0.2, 0.3, 0.9, 1.0}), 2);
  const std::string plot = vis.ascii_histogram("conv1", 10);
  CHECK(plot.find("##########") != std::string::npos);  // the peak bin fills the width
  CHECK(std::count(plot.begin(), plot.end(), '\n') == 5);
  CHECK_THROWS_WITH(vis.ascii_histogram("nope"), Catch::Contains("nope"));
  const auto j = vis.to_json();
  CHECK(j["layers"]["conv1"]["latest"]["step"] == 2);
  CHECK(j["layers"]["conv1"]["histogram"]["counts"].size() == 4);
  CHECK(j["layers"]["conv1"]["heatmap"]["rows"] == 2);
  CHECK(nlohmann::json::parse(j.dump()) == j);
  const std::string table = vis.summary_table();
  CHECK(table.find("conv1") != std::string::npos);
  CHECK(table.find("sparsity") != std::string::npos);
  vis.clear();
  CHECK(vis.layers().empty());
}

TEST_CASE("visualizer needs statistics with a distribution and valid options", "[visualizer]") {
  ActivationVisualizer vis;
  CHECK_THROWS_AS(vis.record("x", 0, torchdbg::compute_stats(torch::ones({2})), torch::ones({2})), torchdbg::Error);
  CHECK_THROWS_AS(ActivationVisualizer(VisualizerOptions().histogram_bins(0)), torchdbg::Error);
  CHECK_THROWS_AS(vis.record("x", torch::ones({2}, torch::kComplexFloat)), torchdbg::Error);
  CHECK(vis.layers().empty());
}

TEST_CASE("empty activations of any shape are recorded with empty statistics, not an error", "[visualizer]") {
  torchdbg::HookManager hooks;
  hooks.create_tensor_inspection_hook({});
  for (const auto& shape : std::vector<std::vector<int64_t>>{{3, 0, 5}, {0, 4, 4}, {2, 3, 0}, {0}, {2, 0}}) {
    INFO("shape " << torch::IntArrayRef(shape));
    const auto r = hooks.execute_hooks("empty", torch::empty(shape), true);
    REQUIRE(r.size() == 1);
    CHECK(r[0].second.ok());
    const auto s = hooks.inspector.latest("empty");
    REQUIRE(s);
    CHECK(s->stats.numel == 0);
    CHECK(std::isnan(s->stats.mean));
    const auto h = torchdbg::make_heatmap(torch::empty(shape), 8);
    CHECK(h.values.size() == static_cast<std::size_t>(h.rows * h.cols));
  }
  // {0, 4, 4}: no rows to average over, so a 4 x 4 map of NaN.
  const auto h = torchdbg::make_heatmap(torch::empty({0, 4, 4}), 8);
  CHECK(h.rows == 4);
  CHECK(std::isnan(h.at(0, 0)));
}

namespace {

/// The heatmap computed naively from a contiguous double copy: mean over the leading
/// dimensions (NaN propagates), the 1-D layout, then NaN-ignoring block means.
torchdbg::Heatmap naive_heatmap(const torch::Tensor& t, int64_t max_size) {
  const torch::Tensor d = t.to(torch::kDouble).contiguous();
  int64_t rows = 1, cols = 1;
  std::vector<double> full;
  if (d.dim() >= 2) {
    rows = d.size(-2);
    cols = d.size(-1);
    const torch::Tensor m = d.reshape({-1, rows, cols}).mean(0).contiguous();
    full.assign(m.data_ptr<double>(), m.data_ptr<double>() + m.numel());
  } else {
    const int64_t n = d.numel();
    rows = static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(n))));
    cols = (n + rows - 1) / rows;
    std::swap(rows, cols);
    full.assign(static_cast<std::size_t>(rows * cols), std::nan(""));
    for (int64_t k = 0; k < n; ++k) full[static_cast<std::size_t>(k)] = d.reshape({-1})[k].item<double>();
  }
  torchdbg::Heatmap h;
  h.rows = std::min(rows, max_size);
  h.cols = std::min(cols, max_size);
  for (int64_t r = 0; r < h.rows; ++r)
    for (int64_t c = 0; c < h.cols; ++c) {
      double sum = 0;
      int64_t n = 0;
      for (int64_t i = r * rows / h.rows; i < (r + 1) * rows / h.rows; ++i)
        for (int64_t j = c * cols / h.cols; j < (c + 1) * cols / h.cols; ++j) {
          const double v = full[static_cast<std::size_t>(i * cols + j)];
          if (!std::isnan(v)) sum += v, ++n;
        }
      h.values.push_back(n > 0 ? sum / static_cast<double>(n) : std::nan(""));
    }
  return h;
}

}  // namespace

TEST_CASE("heatmaps of expanded views equal the naive heatmap of their values, read from storage", "[visualizer]") {
  torchdbg_test::SeededRng rng(17);
  auto base = torch::randn({3, 1, 5});
  base[0][0][2] = std::nan("");
  const std::vector<std::pair<std::string, torch::Tensor>> views = {
      {"rows expanded", base.expand({3, 70, 5})},
      {"columns expanded", torch::randn({4, 9, 1}).expand({4, 9, 130})},
      {"leading expanded", torch::randn({1, 6, 7}).expand({50, 6, 7})},
      {"all expanded", torch::randn({1, 1, 1}).expand({4, 66, 66})},
      {"1-D expanded", torch::randn({1}).expand({1000})},
      {"0-d", torch::randn({})},
      {"transposed expansion", base.expand({3, 70, 5}).transpose(1, 2)},
      {"overlapping windows", torch::randn({40}).unfold(0, 6, 2)},
      {"overlapping windows beyond a piece", torch::randn({1 << 12}).unfold(0, 512, 1)},
      {"overlapping leading windows", torch::randn({1 << 13}).unfold(0, 64, 1).unfold(0, 16, 4)},
  };
  for (const auto& [name, v] : views) {
    INFO(name << " " << v.sizes());
    for (int64_t size : {64, 7}) {
      const auto got = torchdbg::make_heatmap(v, size);
      const auto want = naive_heatmap(v, size);
      REQUIRE(got.rows == want.rows);
      REQUIRE(got.cols == want.cols);
      for (std::size_t i = 0; i < want.values.size(); ++i) CHECK_CLOSE(got.values[i], want.values[i], 1e-12);
    }
  }
  // 2^28 values from 16 KiB of storage: computed without copying them.
  const auto huge = torch::randn({1, 4096}).expand({int64_t{1} << 16, 4096});
  const auto h = torchdbg::make_heatmap(huge, 8);
  CHECK(h.rows == 8);
  CHECK(h.cols == 8);
}
