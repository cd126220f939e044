// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#include <torchdbg/tensor_inspector.hpp>

#include <limits>
#include <thread>

#include "helpers.hpp"

using torchdbg::InspectorOptions;
using torchdbg::TensorAlertKind;
using torchdbg::TensorInspector;

namespace {
bool has_alert(const std::vector<torchdbg::TensorAlert>& alerts, TensorAlertKind k) {
  for (const auto& a : alerts)
    if (a.kind == k) return true;
  return false;
}
}  // namespace

TEST_CASE("inspector records real statistics and counts NaN and Inf separately", "[inspector]") {
  torchdbg_test::SeededRng rng(11);
  TensorInspector insp;
  auto t = torch::randn({20, 10});
  t[0][0] = std::numeric_limits<float>::quiet_NaN();
  t[1][1] = std::numeric_limits<float>::infinity();
  const auto rec = insp.inspect("fc1", t, 7);
  const auto ref = torchdbg_test::reference(t);
  CHECK(rec.step == 7);
  CHECK(rec.stats.nan_count == 1);
  CHECK(rec.stats.inf_count == 1);
  CHECK_SCALED(rec.stats.mean, ref.mean, ref.scale(), 1e-6);
  CHECK_CLOSE(rec.stats.median, torchdbg_test::ref_quantile(ref.sorted, 0.5), 1e-12);
  REQUIRE(rec.stats.distribution);  // sample_rate 1.0 by default
  CHECK(has_alert(rec.alerts, TensorAlertKind::NaN));
  CHECK(has_alert(rec.alerts, TensorAlertKind::Inf));
  CHECK_FALSE(has_alert(rec.alerts, TensorAlertKind::ExtremeMagnitude));
  REQUIRE(insp.latest("fc1"));
  CHECK(insp.latest("fc1")->stats.numel == 200);
  CHECK_FALSE(insp.latest("fc2"));
  CHECK(insp.summary().alerts == 2);
}

TEST_CASE("inspector thresholds raise extreme, vanishing and exploding alerts", "[inspector]") {
  TensorInspector insp(InspectorOptions().extreme_magnitude(100.0).vanishing_gradient_norm(1e-4).exploding_gradient_norm(10.0));
  CHECK(has_alert(insp.inspect("a", torch::tensor({1.0, -150.0})).alerts, TensorAlertKind::ExtremeMagnitude));
  CHECK(insp.inspect("a", torch::tensor({1.0, -50.0})).alerts.empty());
  // Gradient alerts only for gradients.
  CHECK(insp.inspect("w", torch::full({4}, 1e-6), 0, /*is_gradient=*/false).alerts.empty());
  CHECK(has_alert(insp.inspect("w", torch::full({4}, 1e-6), 0, true).alerts, TensorAlertKind::VanishingGradient));
  CHECK(has_alert(insp.inspect("w", torch::full({4}, 8.0), 0, true).alerts, TensorAlertKind::ExplodingGradient));
  CHECK(insp.inspect("w", torch::full({4}, 1.0), 0, true).alerts.empty());
  // track_gradient keeps its own norm history.
  const auto s = torchdbg::compute_stats(torch::full({4}, 8.0));
  CHECK(has_alert(insp.track_gradient("w/grad", s, 3), TensorAlertKind::ExplodingGradient));
  const auto h = insp.gradient_history("w/grad");
  REQUIRE(h.size() == 1);
  CHECK(h[0].step == 3);
  CHECK(h[0].l2_norm == Approx(16.0));
}

TEST_CASE("inspector history is a ring of the configured capacity", "[inspector]") {
  TensorInspector insp(InspectorOptions().history_capacity(3).max_names(2));
  for (int64_t step = 0; step < 10; ++step) insp.inspect("x", torch::full({2}, static_cast<double>(step)), step);
  const auto h = insp.history("x");
  REQUIRE(h.size() == 3);
  CHECK(h[0].step == 7);
  CHECK(h[2].step == 9);
  CHECK(h[2].stats.mean == 9.0);
  insp.inspect("y", torch::zeros({1}));
  insp.inspect("z", torch::zeros({1}));  // evicts "x", the first name seen
  CHECK(insp.names() == std::vector<std::string>{"y", "z"});
  CHECK(insp.history("x").empty());
  insp.clear();
  CHECK(insp.names().empty());
  CHECK(insp.summary().inspections == 0);
}

TEST_CASE("inspector samples the distribution at the configured rate", "[inspector]") {
  TensorInspector insp(InspectorOptions().sample_rate(0.25));
  int with = 0;
  for (int i = 0; i < 40; ++i) with += insp.inspect("x", torch::randn({5})).stats.distribution.has_value();
  CHECK(with == 10);
  TensorInspector none(InspectorOptions().sample_rate(0.0));
  CHECK_FALSE(none.inspect("x", torch::randn({5})).stats.distribution.has_value());
}

TEST_CASE("comparison metrics are computed from the data", "[inspector]") {
  torchdbg_test::SeededRng rng(12);
  auto a = torch::randn({50}, torch::kDouble);
  auto b = 2.0 * a + 0.1 * torch::randn({50}, torch::kDouble);
  const auto c = torchdbg::compare_tensors(a, b);
  CHECK(c.shape_match);
  CHECK(c.dtype_match);
  CHECK(c.compared == 50);
  CHECK(c.mse == Approx((a - b).pow(2).mean().item<double>()));
  CHECK(c.mae == Approx((a - b).abs().mean().item<double>()));
  CHECK(c.max_abs_diff == Approx((a - b).abs().max().item<double>()));
  CHECK(c.cosine_similarity == Approx(torch::cosine_similarity(a, b, 0).item<double>()));
  const auto ac = a - a.mean(), bc = b - b.mean();
  CHECK(c.pearson == Approx(((ac * bc).sum() / (ac.norm() * bc.norm())).item<double>()));
  CHECK(c.pearson > 0.9);
  CHECK(c.pearson < 1.0);
  // NaN pairs are skipped; mismatched sizes only report the flags.
  auto an = a.clone();
  an[0] = std::numeric_limits<double>::quiet_NaN();
  CHECK(torchdbg::compare_tensors(an, b).skipped == 1);
  CHECK_THROWS_WITH(torchdbg::compare_tensors(a.view({5, -1}).to_sparse_csr(), b),
                    Catch::Contains("layout SparseCsr") && Catch::Contains(".to_dense()"));
  const auto m = torchdbg::compare_tensors(torch::zeros({3}), torch::zeros({4}, torch::kInt));
  CHECK_FALSE(m.shape_match);
  CHECK_FALSE(m.dtype_match);
  CHECK(std::isnan(m.mse));
  // Same numel, different shape: compared element-wise in memory order.
  CHECK(torchdbg::compare_tensors(torch::ones({2, 3}), torch::ones({3, 2})).mse == 0.0);
}

TEST_CASE("inspector compares recorded tensors only when asked to keep them", "[inspector]") {
  TensorInspector keep(InspectorOptions().keep_latest_tensor(true));
  keep.inspect("a", torch::tensor({1.0, 2.0, 3.0}));
  keep.inspect("b", torch::tensor({1.0, 2.0, 5.0}));
  const auto c = keep.compare("a", "b");
  CHECK(c.max_abs_diff == 2.0);
  CHECK(c.mse == Approx(4.0 / 3.0));
  CHECK_THROWS_AS(keep.compare("a", "nope"), torchdbg::Error);
  TensorInspector plain;
  plain.inspect("a", torch::ones({2}));
  CHECK_THROWS_WITH(plain.compare("a", "a"), Catch::Contains("keep_latest_tensor"));
}

TEST_CASE("inspector rejects bad options and bad data with the value named", "[inspector]") {
  CHECK_THROWS_WITH(TensorInspector(InspectorOptions().sample_rate(1.5)), Catch::Contains("1.5"));
  CHECK_THROWS_AS(TensorInspector(InspectorOptions().history_capacity(0)), torchdbg::Error);
  TensorInspector insp;
  std::vector<double> d = {1, 2, 3};
  CHECK_THROWS_AS(insp.inspect("x", d.data(), d.size(), {2, 2}), torchdbg::Error);
  CHECK(insp.inspect("x", d.data(), d.size(), {3}).stats.mean == 2.0);
  CHECK_THROWS_WITH(insp.inspect("c", torch::zeros({2}, torch::kComplexDouble)), Catch::Contains("ComplexDouble"));
  CHECK(insp.names() == std::vector<std::string>{"x"});  // nothing lost, nothing half-recorded
}

TEST_CASE("inspector summary lists the latest statistics as a table", "[inspector]") {
  TensorInspector insp;
  insp.inspect("layer.b", torch::ones({3}));
  insp.inspect("layer.a", torch::zeros({3}));
  const auto s = insp.summary();
  REQUIRE(s.latest.size() == 2);
  CHECK(s.latest[0].first == "layer.a");
  const std::string text = s.to_string();
  CHECK(text.find("layer.a") != std::string::npos);
  CHECK(text.find("2 tensors, 2 inspections") != std::string::npos);
}

TEST_CASE("inspector may be used from several threads at once", "[inspector]") {
  TensorInspector insp(InspectorOptions().history_capacity(1000));
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&insp, i] {
      for (int k = 0; k < 50; ++k) insp.inspect("t" + std::to_string(i % 2), torch::full({8}, static_cast<double>(k)), k);
    });
  }
  for (auto& t : threads) t.join();
  CHECK(insp.summary().inspections == 200);
  CHECK(insp.history("t0").size() == 100);
  CHECK(insp.history("t1").size() == 100);
}
