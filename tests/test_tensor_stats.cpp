// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#include <limits>
#include <random>
#include <regex>
#include <sstream>
#include <fmt/ranges.h>
#include <torchdbg/tensor_stats.hpp>
#if defined(__unix__)
#include <sys/mman.h>
#include <unistd.h>
#endif
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#endif

#include "helpers.hpp"

using torchdbg_test::near;
using torchdbg_test::Reference;
using torchdbg_test::reference;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

/// Float32/half/bfloat16 data is summed in float within 2048-element blocks (see
/// stats_kernel.hpp): moments are checked to 1e-6 of the data's scale, double and integer data
/// to `rel`. Counts and extrema are exact for every dtype.
void check_summary(const torchdbg::TensorStats& s, const torch::Tensor& t, double rel = 1e-9) {
  const Reference r = reference(t, /*sorted=*/false);
  const auto st = t.scalar_type();
  if (st == torch::kFloat || st == torch::kHalf || st == torch::kBFloat16)
    rel = std::max(rel, 1e-6);
  const double scale = r.finite > 0 ? r.l1 / static_cast<double>(r.finite) : 0.0;  // mean |x|
  CHECK(s.numel == r.numel);
  CHECK(s.shape == t.sizes().vec());
  CHECK(s.dtype == std::string(c10::toString(t.scalar_type())));
  CHECK(s.bytes == r.numel * static_cast<int64_t>(t.element_size()));
  CHECK(s.finite_count == r.finite);
  CHECK(s.nan_count == r.nan);
  CHECK(s.pos_inf_count == r.pos_inf);
  CHECK(s.neg_inf_count == r.neg_inf);
  CHECK(s.inf_count == r.pos_inf + r.neg_inf);
  CHECK(s.zero_count == r.zeros);
  CHECK(s.negative_count == r.neg);
  CHECK(s.positive_count == r.pos);
  if (std::isnan(r.mean)) {
    CHECK(std::isnan(s.mean));
  } else {
    CHECK_SCALED(s.mean, r.mean, scale, rel);
  }
  CHECK_CLOSE(s.std, r.std, std::max(rel, 1e-7));
  CHECK_CLOSE(s.min, r.min, 0.0);
  CHECK_CLOSE(s.max, r.max, 0.0);
  CHECK_CLOSE(s.l1_norm, r.l1, rel);
  CHECK_CLOSE(s.l2_norm, r.l2, rel);
  CHECK_CLOSE(s.linf_norm, r.linf, 0.0);
  CHECK_CLOSE(s.sparsity,
              r.numel ? static_cast<double>(r.zeros) / static_cast<double>(r.numel) : kNaN, 1e-15);
}

torch::Tensor with_non_finite(torch::Tensor t) {
  auto flat = t.view(-1);
  flat[3] = kNaN;
  flat[7] = kInf;
  flat[11] = -kInf;
  flat[13] = kNaN;
  flat[17] = 0.0;
  return t;
}

}  // namespace

TEST_CASE("statistics of float data match a double reference, NaN and Inf counted apart",
          "[stats]") {
  torchdbg_test::SeededRng rng(1);
  auto t = with_non_finite(torch::randn({37, 29}) * 3.0 + 1.5);
  const auto s = torchdbg::compute_stats(t);
  check_summary(s, t);
  CHECK(s.nan_count == 2);
  CHECK(s.pos_inf_count == 1);
  CHECK(s.neg_inf_count == 1);
  CHECK(s.has_non_finite());
  CHECK(std::isnan(s.median));  // no distribution asked
  CHECK_FALSE(s.distribution.has_value());
}

TEST_CASE("every supported dtype gives the reference statistics", "[stats]") {
  torchdbg_test::SeededRng rng(2);
  const auto base = torch::randn({8, 33}) * 20.0;
  const std::vector<torch::ScalarType> types = {torch::kFloat,    torch::kDouble, torch::kHalf,
                                                torch::kBFloat16, torch::kInt8,   torch::kUInt8,
                                                torch::kInt16,    torch::kInt32,  torch::kInt64};
  for (auto st : types) {
    INFO("dtype " << c10::toString(st));
    auto t = st == torch::kUInt8 ? base.abs().to(st) : base.to(st);
    check_summary(torchdbg::compute_stats(t), t);
  }
  SECTION("half and bfloat16 keep NaN/Inf") {
    for (auto st : {torch::kHalf, torch::kBFloat16}) {
      auto t = with_non_finite(base.clone()).to(st);
      const auto s = torchdbg::compute_stats(t);
      check_summary(s, t);
      CHECK(s.nan_count == 2);
      CHECK(s.inf_count == 2);
    }
  }
  SECTION("bool counts true as one") {
    auto t = base > 5.0;
    const auto s = torchdbg::compute_stats(t);
    check_summary(s, t);
    CHECK(s.positive_count == t.sum().item<int64_t>());
  }
}

TEST_CASE("empty, 0-d and all-NaN tensors give the documented statistics", "[stats]") {
  SECTION("empty") {
    const auto s = torchdbg::compute_stats(torch::empty({0, 5}));
    CHECK(s.numel == 0);
    CHECK(s.shape == std::vector<int64_t>{0, 5});
    CHECK(s.finite_count == 0);
    CHECK(std::isnan(s.mean));
    CHECK(std::isnan(s.std));
    CHECK(std::isnan(s.min));
    CHECK(std::isnan(s.max));
    CHECK(std::isnan(s.sparsity));
    CHECK(s.l1_norm == 0.0);
    CHECK(s.l2_norm == 0.0);
    CHECK(s.linf_norm == 0.0);
    const auto d =
        torchdbg::compute_stats(torch::empty({0}), torchdbg::StatsOptions().distribution(true));
    REQUIRE(d.distribution);
    CHECK(std::isnan(d.distribution->p50));
    CHECK(d.distribution->bin_counts.size() == 50);
  }
  SECTION("0-d") {
    auto t = torch::tensor(-2.5);
    const auto s = torchdbg::compute_stats(t, torchdbg::StatsOptions().distribution(true));
    check_summary(s, t);
    CHECK(s.shape.empty());
    CHECK(s.numel == 1);
    CHECK(s.std == 0.0);
    CHECK(s.median == -2.5);
  }
  SECTION("all NaN") {
    auto t = torch::full({4, 4}, kNaN);
    const auto s = torchdbg::compute_stats(t);
    CHECK(s.nan_count == 16);
    CHECK(s.finite_count == 0);
    CHECK(std::isnan(s.mean));
    CHECK(std::isnan(s.max));
    CHECK(s.l2_norm == 0.0);
    CHECK(s.sparsity == 0.0);
  }
}

TEST_CASE("non-contiguous and expanded tensors are read through their strides", "[stats]") {
  torchdbg_test::SeededRng rng(3);
  auto base = with_non_finite(torch::randn({24, 40}));
  auto transposed = base.t();
  auto strided =
      base.index({torch::indexing::Slice(1, torch::indexing::None, 3),
                  torch::indexing::Slice(torch::indexing::None, torch::indexing::None, 2)});
  auto expanded = torch::randn({1, 7}).expand({9, 7});
  REQUIRE_FALSE(transposed.is_contiguous());
  REQUIRE_FALSE(strided.is_contiguous());
  REQUIRE_FALSE(expanded.is_contiguous());
  check_summary(torchdbg::compute_stats(transposed), transposed);
  check_summary(torchdbg::compute_stats(strided), strided);
  check_summary(torchdbg::compute_stats(expanded), expanded);
}

TEST_CASE("property: a strided float, half or bfloat16 tensor read through its strides gives its copy's moments, bit for bit",
          "[stats]") {
  using torchdbg::detail::compute_moments;
  std::mt19937_64 g(20261203);
  const auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(g); };
  const std::vector<torch::ScalarType> dtypes = {torch::kFloat, torch::kHalf, torch::kBFloat16};
  int gathered = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const auto dtype = dtypes[static_cast<std::size_t>(trial % 3)];
    // A batch-first sequence and one time step of it (a recurrent cell's input), a transposed
    // matrix, or a sliced block; sizes cross the kernel's 2048-element blocks and its lanes.
    const int64_t a = pick(1, 70), b = pick(1, 90), c = pick(1, 3000 / std::max<int64_t>(1, a));
    const uint64_t seed = g();
    torch::manual_seed(seed);
    torch::Tensor x = torch::randn({a, b, c}) * std::pow(10.0, static_cast<double>(pick(-6, 6)));
    if (pick(0, 1) == 1) x = x.abs();  // non-negative blocks take their own kernel
    if (pick(0, 2) == 0 && x.numel() > 3) {
      auto flat = x.view(-1);
      flat[pick(0, x.numel() - 1)] = kNaN;
      flat[pick(0, x.numel() - 1)] = pick(0, 1) == 1 ? kInf : -kInf;
    }
    x = x.to(dtype);
    torch::Tensor v;
    std::string what;
    switch (pick(0, 3)) {
      case 0: {
        const int64_t t = pick(0, b - 1);
        v = x.select(1, t);
        what = "x.select(1, " + std::to_string(t) + ")";
        break;
      }
      case 1:
        v = x.transpose(0, 2);
        what = "x.transpose(0, 2)";
        break;
      case 2: {
        const int64_t step = pick(1, 3);
        v = x.slice(2, 0, c, step).slice(0, pick(0, a - 1));
        what = "x.slice(2, 0, c, step).slice(0, ...)";
        break;
      }
      default:
        v = x.permute({1, 0, 2}).slice(1, 0, std::max<int64_t>(1, a / 2));
        what = "x.permute({1, 0, 2}).slice(1, 0, a / 2)";
        break;
    }
    const bool signs = pick(0, 1) == 1;
    INFO("trial " << trial << " seed " << seed << " dtype " << dtype << " x " << x.sizes() << " " << what
                  << " shape " << v.sizes() << " strides " << v.strides() << " signs " << signs);
    gathered += torchdbg::detail::gather_moments(v) ? 1 : 0;
    const auto got = compute_moments(v, signs);
    const auto want = compute_moments(v.contiguous(), signs);
    CHECK(got.count == want.count);
    CHECK(got.finite == want.finite);
    CHECK(got.nan == want.nan);
    CHECK(got.pos_inf == want.pos_inf);
    CHECK(got.neg_inf == want.neg_inf);
    CHECK(got.signs == want.signs);
    CHECK(got.zeros == want.zeros);
    CHECK(got.negatives == want.negatives);
    CHECK(got.positives == want.positives);
    CHECK(got.mean == want.mean);  // exact: the same blocks in the same order
    CHECK(got.m2 == want.m2);
    CHECK(got.min == want.min);
    CHECK(got.max == want.max);
    CHECK(got.abs_sum == want.abs_sum);
    CHECK(got.abs_max == want.abs_max);
  }
  CHECK(gathered > 200);  // most views take the gathered path
}

TEST_CASE("large tensors split across threads give the single-thread result", "[stats]") {
  torchdbg_test::SeededRng rng(4);
  const int prev = torch::get_num_threads();
  torch::set_num_threads(2);
  // A large offset checks that the variance does not cancel catastrophically.
  auto t = torch::randn({3 * (1 << 18) + 17}, torch::kDouble) + 1e6;
  t[12345] = kNaN;
  const auto s = torchdbg::compute_stats(t);
  check_summary(s, t, 1e-12);
  CHECK_CLOSE(s.std, reference(t).std, 1e-9);
  torch::set_num_threads(prev);
}

TEST_CASE("the on-device reduction path agrees with the CPU kernel", "[stats]") {
  // pack_moments is what non-CPU tensors use; it runs on CPU tensors too.
  torchdbg_test::SeededRng rng(5);
  for (auto st : {torch::kFloat, torch::kDouble, torch::kHalf, torch::kInt32}) {
    INFO("dtype " << c10::toString(st));
    auto t = st == torch::kInt32 ? (torch::randn({33, 17}) * 50).to(st)
                                 : with_non_finite(torch::randn({33, 17})).to(st);
    const auto m = torchdbg::detail::unpack_moments(torchdbg::detail::pack_moments(t));
    const auto s = torchdbg::stats_from_moments(m, t);
    check_summary(s, t, 1e-9);
  }
  const auto empty =
      torchdbg::detail::unpack_moments(torchdbg::detail::pack_moments(torch::empty({0})));
  CHECK(empty.count == 0);
  CHECK(empty.finite == 0);
}

TEST_CASE("the distribution matches torch.quantile, a naive histogram and reference moments",
          "[stats]") {
  torchdbg_test::SeededRng rng(6);
  auto t = with_non_finite(torch::randn({1001}).pow(3));  // skewed, heavy-tailed
  const int64_t bins = 17;
  const auto s =
      torchdbg::compute_stats(t, torchdbg::StatsOptions().distribution(true).histogram_bins(bins));
  REQUIRE(s.distribution);
  const auto& d = *s.distribution;
  const Reference r = reference(t);
  const auto finite = torch::tensor(r.sorted, torch::kDouble);
  const std::vector<std::pair<double, double>> qs = {{0.05, d.p5},  {0.25, d.p25}, {0.5, d.p50},
                                                     {0.75, d.p75}, {0.95, d.p95}, {0.99, d.p99}};
  for (auto [q, got] : qs) {
    INFO("q = " << q);
    CHECK_CLOSE(got, torch::quantile(finite, q).item<double>(), 1e-12);
  }
  CHECK(s.median == d.p50);
  // Histogram: naive edge comparison over the finite values.
  REQUIRE(d.bin_edges.size() == static_cast<std::size_t>(bins + 1));
  CHECK(d.bin_edges.front() == r.min);
  CHECK_CLOSE(d.bin_edges.back(), r.max, 1e-12);
  int64_t total = 0;
  for (int64_t b = 0; b < bins; ++b) {
    int64_t n = 0;
    for (double x : r.sorted) {
      const bool last = b == bins - 1;
      if (x >= d.bin_edges[b] && (x < d.bin_edges[b + 1] || (last && x <= d.bin_edges[b + 1]))) ++n;
    }
    INFO("bin " << b);
    CHECK(std::llabs(n - d.bin_counts[b]) <= 1);  // an edge value may round either way
    total += d.bin_counts[b];
  }
  CHECK(total == r.finite);
  // Shape moments and outliers.
  double m2 = 0, m3 = 0, m4 = 0;
  for (double x : r.sorted) {
    const double z = x - r.mean;
    m2 += z * z;
    m3 += z * z * z;
    m4 += z * z * z * z;
  }
  const double n = static_cast<double>(r.finite);
  m2 /= n;
  m3 /= n;
  m4 /= n;
  CHECK_CLOSE(d.skewness, m3 / std::pow(m2, 1.5), 1e-6);  // around the float-path mean
  CHECK_CLOSE(d.excess_kurtosis, m4 / (m2 * m2) - 3.0, 1e-6);
  CHECK(d.skewness > 0.5);
  const double q1 = torchdbg_test::ref_quantile(r.sorted, 0.25),
               q3 = torchdbg_test::ref_quantile(r.sorted, 0.75);
  int64_t iqr = 0, sig = 0;
  for (double x : r.sorted) {
    iqr += (x < q1 - 1.5 * (q3 - q1) || x > q3 + 1.5 * (q3 - q1));
    sig += std::fabs(x - r.mean) > 3 * r.std;
  }
  CHECK(d.iqr_outliers == iqr);
  CHECK(d.sigma3_outliers == sig);
  CHECK(iqr > 0);
}

TEST_CASE("a constant tensor gets a unit-wide histogram range and no shape moments", "[stats]") {
  const auto s = torchdbg::compute_stats(
      torch::full({10}, 4.0), torchdbg::StatsOptions().distribution(true).histogram_bins(4));
  REQUIRE(s.distribution);
  CHECK(s.distribution->bin_edges.front() == 3.0);
  CHECK(s.distribution->bin_edges.back() == 5.0);
  CHECK(s.distribution->bin_counts == std::vector<int64_t>{0, 0, 10, 0});
  CHECK(std::isnan(s.distribution->skewness));
  CHECK(s.distribution->sigma3_outliers == 0);
}

TEST_CASE("raw data with a shape is viewed without copying; a mismatch names both", "[stats]") {
  std::vector<float> data = {1.f, -2.f, 0.f, 4.f, std::nanf(""), 6.f};
  const auto s = torchdbg::compute_stats(data.data(), data.size(), {2, 3});
  check_summary(s, torch::tensor(data).reshape({2, 3}));
  std::vector<c10::Half> half = {c10::Half(1.5f), c10::Half(-0.5f)};
  CHECK(torchdbg::compute_stats(half.data(), half.size(), {2}).mean == 0.5);
  std::vector<int64_t> ints = {3, 4, 5};
  CHECK(torchdbg::compute_stats(ints.data(), ints.size(), {3}).l2_norm == Approx(std::sqrt(50.0)));
  try {
    (void)torchdbg::compute_stats(data.data(), data.size(), {4, 2});
    FAIL("expected an error");
  } catch (const torchdbg::Error& e) {
    CHECK(std::string(e.what()).find("6 elements") != std::string::npos);
    CHECK(std::string(e.what()).find("[4, 2]") != std::string::npos);
  }
  CHECK_THROWS_AS(torchdbg::compute_stats(data.data(), data.size(), {-1, -6}), torchdbg::Error);
}

TEST_CASE("unsupported dtypes and undefined tensors are rejected with the dtype named", "[stats]") {
  try {
    (void)torchdbg::compute_stats(torch::randn({3}, torch::kComplexFloat));
    FAIL("expected an error");
  } catch (const torchdbg::Error& e) {
    CHECK(std::string(e.what()).find("ComplexFloat") != std::string::npos);
  }
  CHECK_THROWS_AS(torchdbg::compute_stats(torch::Tensor()), torchdbg::Error);
  CHECK_THROWS_AS(
      torchdbg::compute_stats(torch::randn({3}),
                              torchdbg::StatsOptions().distribution(true).histogram_bins(0)),
      torchdbg::Error);
}

TEST_CASE("tensors of an unreadable layout are rejected with the layout and its conversion named", "[stats]") {
  const torch::Tensor dense = torch::randn({4, 6});
  std::vector<std::pair<torch::Tensor, std::string>> odd = {{dense.to_sparse_csr(), "SparseCsr"}};
#if TORCH_VERSION_MAJOR >= 2
  odd.emplace_back(dense.to_sparse_csc(), "SparseCsc");
  odd.emplace_back(dense.to_sparse_bsr({2, 2}), "SparseBsr");
#endif
  if (at::hasMKLDNN()) odd.emplace_back(dense.to_mkldnn(), "Mkldnn");
  for (const auto& [t, layout] : odd) {
    INFO("layout " << layout);
    // Named: a matcher joined with && refers to its parts.
    const auto names_layout = Catch::Contains("layout " + layout);
    const auto names_fix = Catch::Contains(".to_dense()");
    CHECK_THROWS_WITH(torchdbg::compute_stats(t), names_layout && names_fix);
    CHECK_THROWS_WITH(torchdbg::compute_stats(t, torchdbg::StatsOptions().distribution(true)), names_layout && names_fix);
    CHECK_THROWS_WITH(torchdbg::compute_stats(t, torchdbg::StatsOptions().sign_counts(false)), names_layout && names_fix);
    CHECK_THROWS_WITH(torchdbg::detail::batch_spread(t), names_layout && names_fix);
    int64_t per_unit = 0;
    CHECK_THROWS_WITH(torchdbg::detail::count_above_per_unit(t, 1, 0.0, per_unit), names_layout && names_fix);
  }
  // The layouts that are read: strided and sparse COO.
  CHECK(torchdbg::compute_stats(dense.to_sparse()).numel == 24);
  CHECK(torchdbg::compute_stats(dense.t()).numel == 24);
}

TEST_CASE("statistics serialise to JSON with NaN as null", "[stats]") {
  auto t = torch::tensor({1.0, 2.0, kNaN});
  nlohmann::json j =
      torchdbg::compute_stats(t, torchdbg::StatsOptions().distribution(true).histogram_bins(2));
  CHECK(j["nan_count"] == 1);
  CHECK(j["mean"].get<double>() == 1.5);
  CHECK(j["distribution"]["bin_counts"] == nlohmann::json::array({1, 1}));
  nlohmann::json e = torchdbg::compute_stats(torch::empty({0}));
  CHECK(std::isnan(e["mean"].get<double>()));                // in memory: a NaN number
  CHECK(nlohmann::json::parse(e.dump())["mean"].is_null());  // written: null
}

TEST_CASE("CUDA tensors are reduced on the device", "[stats][cuda]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  torchdbg_test::SeededRng rng(7);
  auto t = with_non_finite(torch::randn({513, 257})).to(torch::kCUDA);
  const auto s = torchdbg::compute_stats(t, torchdbg::StatsOptions().distribution(true));
  check_summary(s, t.cpu(), 1e-9);
  CHECK(s.device == "cuda:0");
}

namespace {

/// `n` random tensors on `device` with the code that made each: every dtype, random shapes
/// (empty ones too), magnitudes from 1e-30 to 1e30 (clipped to the dtype's range), NaN/Inf,
/// and views: transposes, stepped slices, expanded dimensions.
std::vector<std::pair<std::string, torch::Tensor>> random_stat_cases(torch::Device device, int n, uint64_t generator_seed) {
  std::mt19937_64 g(generator_seed);
  const auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(g); };
  const std::vector<torch::ScalarType> dtypes = {torch::kFloat, torch::kDouble, torch::kHalf,  torch::kBFloat16,
                                                 torch::kInt8,  torch::kUInt8,  torch::kInt16, torch::kInt32,
                                                 torch::kInt64, torch::kBool};
  std::vector<std::pair<std::string, torch::Tensor>> cases;
  for (int i = 0; i < n; ++i) {
    const auto dtype = dtypes[static_cast<std::size_t>(pick(0, static_cast<int64_t>(dtypes.size()) - 1))];
    std::vector<int64_t> shape;
    for (int64_t d = pick(0, 4); d > 0; --d) shape.push_back(pick(0, 5) == 0 ? pick(0, 1) : pick(1, 40));
    const uint64_t seed = g();
    torch::manual_seed(static_cast<int64_t>(seed & 0x7fffffff));
    const double scale = std::pow(10.0, static_cast<double>(pick(-30, 30)));
    torch::Tensor x = torch::randn(shape, torch::kDouble) * scale + static_cast<double>(pick(-3, 3)) * scale;
    const bool floating = dtype == torch::kFloat || dtype == torch::kDouble || dtype == torch::kHalf ||
                          dtype == torch::kBFloat16;
    if (floating && x.numel() > 0 && pick(0, 1) == 1) {
      auto flat = x.view(-1);
      for (int64_t k = pick(1, 4); k > 0; --k) {
        const int64_t at = pick(0, x.numel() - 1);
        flat[at] = std::vector<double>{kNaN, kInf, -kInf, 0.0, -0.0}[static_cast<std::size_t>(pick(0, 4))];
      }
    }
    if (dtype == torch::kHalf) x = torch::where(x.isinf(), x, x.clamp(-60000.0, 60000.0));  // NaN stays NaN
    if (!floating && dtype != torch::kBool) x = (x / scale * 30.0).nan_to_num(0.0, 0.0, 0.0);
    if (dtype == torch::kUInt8) x = x.abs();
    if (dtype == torch::kInt8) x = x.clamp(-120.0, 120.0);
    torch::Tensor t = dtype == torch::kBool ? (x > 0) : x.to(dtype);
    std::ostringstream code;
    code << "seed " << seed << " " << dtype << " shape " << torch::IntArrayRef(shape) << " scale " << scale;
    t = t.to(device);
    for (int64_t ops = pick(0, 3); ops > 0 && t.dim() > 0; --ops) {
      switch (pick(0, 2)) {
        case 0:
          if (t.dim() >= 2) {
            t = t.transpose(0, t.dim() - 1);
            code << ".transpose(0, -1)";
          }
          break;
        case 1: {
          const int64_t d = pick(0, t.dim() - 1), step = pick(1, 3);
          t = t.slice(d, 0, t.size(d), step);
          code << ".slice(" << d << ", 0, end, " << step << ")";
          break;
        }
        default: {
          const int64_t at = pick(0, t.dim());
          std::vector<int64_t> sizes = t.unsqueeze(at).sizes().vec();
          sizes[static_cast<std::size_t>(at)] = pick(2, 6);
          t = t.unsqueeze(at).expand(sizes);
          code << ".unsqueeze(" << at << ").expand(" << torch::IntArrayRef(sizes) << ")";
        }
      }
    }
    cases.emplace_back(code.str(), t);
  }
  return cases;
}

/// Adds every case that MomentsBatch takes to one batch, reduces it once and checks each
/// row against the double reference on a host copy; returns how many were batched.
int check_batched(const std::vector<std::pair<std::string, torch::Tensor>>& cases) {
  torchdbg::detail::MomentsBatch batch;
  struct Row {
    std::size_t index;
    int64_t row, repeats;
  };
  std::vector<Row> rows;
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const auto r = torchdbg::detail::collapse_repeats(cases[i].second);
    if (!torchdbg::detail::MomentsBatch::accepts(r.base)) continue;
    rows.push_back({i, batch.add(r.base), r.repeats});
  }
  REQUIRE(batch.rows() == static_cast<int64_t>(rows.size()));
  const torch::Tensor packed = batch.reduce().cpu().contiguous();
  CHECK(batch.rows() == 0);
  REQUIRE(packed.size(0) == static_cast<int64_t>(rows.size()));
  for (const Row& r : rows) {
    const auto& [code, t] = cases[r.index];
    INFO("batched row " << r.row << ": " << code);
    const auto m = torchdbg::detail::repeated(
        torchdbg::detail::unpack_moments(packed.data_ptr<double>() + r.row * torchdbg::detail::kPackedMoments),
        r.repeats);
    check_summary(torchdbg::stats_from_moments(m, t), t.cpu(), 1e-9);
  }
  return static_cast<int>(rows.size());
}

}  // namespace

TEST_CASE("property: thresholds between two floats count float values as double comparisons do", "[stats]") {
  // A double bound rounded to the nearest float would put a value next to it on the wrong
  // side; every count must equal the comparison of the values as doubles.
  std::mt19937_64 g(77);
  for (int trial = 0; trial < 200; ++trial) {
    INFO("trial " << trial);
    const int64_t rows = 1 + static_cast<int64_t>(g() % 9), cols = 1 + static_cast<int64_t>(g() % 37);
    torch::manual_seed(static_cast<int64_t>(g() % 100000));
    const torch::Tensor x = torch::randn({rows, cols}) * std::pow(10.0, static_cast<double>(g() % 9) - 4.0);
    const torch::Tensor xd = x.to(torch::kDouble);
    // Bounds at a value, or half a float step beside it (not a float themselves).
    const double v = xd.view(-1)[static_cast<int64_t>(g() % static_cast<uint64_t>(x.numel()))].item<double>();
    const double step = std::abs(v) * 6e-8 + 1e-45;
    const double lo = v + (g() % 3 == 0 ? 0.0 : (g() % 2 ? 0.5 : -0.5) * step);
    const double hi = v + (g() % 3 == 0 ? 0.0 : (g() % 2 ? 0.5 : -0.5) * step);
    CHECK(torchdbg::detail::count_outside(x, lo, hi) == ((xd < lo).logical_or(xd > hi)).sum().item<int64_t>());
    int64_t per_unit = 0;
    for (int64_t dim : {0, 1}) {
      const auto got = torchdbg::detail::count_above_per_unit(x, dim, hi, per_unit);
      const auto ref = (xd > hi).sum(1 - dim);
      REQUIRE(got.size() == static_cast<std::size_t>(ref.numel()));
      for (int64_t u = 0; u < ref.numel(); ++u) CHECK(got[static_cast<std::size_t>(u)] == ref[u].item<int64_t>());
    }
    const auto x3 = x.view({rows, 1, cols}).expand({rows, 2, cols}).contiguous();  // units with inner > 1
    const auto got3 = torchdbg::detail::count_above_per_unit(x3, 0, hi, per_unit);
    const auto ref3 = (x3.to(torch::kDouble) > hi).sum({1, 2});
    for (int64_t u = 0; u < ref3.numel(); ++u) CHECK(got3[static_cast<std::size_t>(u)] == ref3[u].item<int64_t>());
  }
  CHECK(torchdbg::detail::float_at_or_below(1e300) == std::numeric_limits<float>::max());
  CHECK(std::isinf(torchdbg::detail::float_at_or_above(1e300)));
  CHECK(torchdbg::detail::float_at_or_above(-1e300) == -std::numeric_limits<float>::max());
  CHECK(torchdbg::detail::float_at_or_below(0.1) < 0.1f);
  CHECK(torchdbg::detail::float_at_or_above(0.1) == 0.1f);
}

TEST_CASE("property: moments batched in one reduction are each tensor's own", "[stats]") {
  // A step's queued deliveries are reduced together (MomentsBatch); each row must be that
  // tensor's statistics, whatever its neighbours.
  for (uint64_t seed : {1u, 2u, 3u}) {
    INFO("seed " << seed);
    const auto cases = random_stat_cases(torch::kCPU, 120, seed);
    CHECK(check_batched(cases) > 80);
  }
  // More than kMaxHeld elements: the rows so far are reduced on the way, in order (twice
  // here: at the fifth and the ninth).
  static_assert(torchdbg::detail::MomentsBatch::kMaxHeld == 4 * torchdbg::detail::MomentsBatch::kMaxElements);
  torchdbg_test::SeededRng rng(12);
  std::vector<std::pair<std::string, torch::Tensor>> big;
  for (int i = 0; i < 10; ++i)
    big.emplace_back("big " + std::to_string(i),
                     torch::randn({torchdbg::detail::MomentsBatch::kMaxElements}) * (i + 1) + i);
  big.emplace_back("one more than a batch takes", torch::randn({torchdbg::detail::MomentsBatch::kMaxElements + 1}));
  big.emplace_back("tail", torch::tensor({kNaN, 1.0, -kInf}));
  CHECK(check_batched(big) == 11);
  // Magnitudes at the ends of float64: a constant has no deviation, a sum near the largest
  // double does not overflow, denormals keep their mean and spread.
  {
    torchdbg::detail::MomentsBatch batch;
    const std::vector<torch::Tensor> extremes = {
        torch::full({1000}, 1e300, torch::kDouble), torch::full({4}, 1.7e308, torch::kDouble),
        torch::tensor({-1e300, -1e300, kNaN, -1e300}, torch::kDouble),
        torch::tensor({1e-310, 3e-310, 5e-310, 0.0}, torch::kDouble), torch::randn({5}, torch::kDouble) + 1e6};
    for (const auto& t : extremes) batch.add(t);
    const torch::Tensor packed = batch.reduce().contiguous();
    const auto row = [&](int64_t i) {
      return torchdbg::detail::unpack_moments(packed.data_ptr<double>() + i * torchdbg::detail::kPackedMoments);
    };
    CHECK(row(0).mean == 1e300);
    CHECK(row(0).m2 == 0.0);
    CHECK(row(1).mean == 1.7e308);
    CHECK(row(1).m2 == 0.0);
    CHECK(row(2).mean == -1e300);
    CHECK(row(2).nan == 1);
    CHECK(row(2).m2 == 0.0);
    CHECK_CLOSE(row(3).mean, reference(extremes[3]).mean, 1e-12);
    CHECK(row(3).min == 0.0);
    CHECK(row(3).max == 5e-310);
    const Reference r4 = reference(extremes[4]);
    CHECK_SCALED(row(4).mean, r4.mean, 1e6, 1e-15);
    CHECK_CLOSE(std::sqrt(row(4).m2 / 5.0), r4.std, 1e-9);
  }
  // A negative view's memory holds the values' negatives: every reader sees the values.
  {
    const auto v = torch::randn({6, 5}) + 0.5;
    const auto neg = v._neg_view();
    REQUIRE(neg.is_neg());
    check_summary(torchdbg::compute_stats(neg), neg.resolve_neg());
    CHECK(torchdbg::detail::count_outside(neg, -0.1, 10.0) == (neg.resolve_neg() < -0.1).sum().item<int64_t>());
    int64_t per_unit = 0;
    CHECK(torchdbg::detail::count_above_per_unit(neg, 1, 0.0, per_unit)[0] ==
          (neg.resolve_neg().select(1, 0) > 0).sum().item<int64_t>());
    CHECK(check_batched({{"neg view", neg}, {"neg view transposed", neg.t()}}) == 2);
  }
  // An empty batch reduces to no rows; a tensor of a dtype without moments is refused.
  torchdbg::detail::MomentsBatch empty;
  CHECK_THROWS_AS(empty.add(torch::zeros({2}, torch::kComplexFloat)), torchdbg::Error);
  CHECK(empty.rows() == 0);
}

TEST_CASE("property: CUDA tensors of every dtype, view and magnitude give the double reference's statistics",
          "[stats][cuda]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  auto cases = random_stat_cases(torch::kCUDA, 80, 20261204);
  // The step's batched reduction (MomentsBatch) on the device, every case in one batch.
  CHECK(check_batched(cases) > 50);
  // Large ones: more elements than one block of any reduction, 2^26 + 3 floats (256 MiB),
  // half and bfloat16 with Inf.
  torch::manual_seed(11);
  cases.emplace_back("2^26 + 3 floats", (torch::randn({(int64_t{1} << 26) + 3}, torch::kCUDA) * 4.0 + 2.0));
  cases.emplace_back("2^24 halfs with Inf",
                     with_non_finite(torch::randn({int64_t{1} << 24}, torch::kCUDA)).to(torch::kHalf));
  cases.emplace_back("2^24 bfloat16 transposed",
                     (torch::randn({4096, 4096}, torch::kCUDA) * 1e20).to(torch::kBFloat16).t());
  for (const auto& [code, t] : cases) {
    INFO(code);
    const auto host = t.cpu();
    const auto opts = torchdbg::StatsOptions().distribution(true);
    const auto s = torchdbg::compute_stats(t, opts);
    CHECK(s.device == "cuda:0");
    check_summary(s, host, 1e-9);
    // The distribution, the counts and the batch spread read the device tensor; the CPU
    // kernel on a host copy is the reference.
    const auto c = torchdbg::compute_stats(host, opts);
    REQUIRE(s.distribution.has_value() == c.distribution.has_value());
    if (s.distribution && c.distribution) {
      CHECK(s.distribution->bin_counts == c.distribution->bin_counts);
      for (auto q : {&torchdbg::Distribution::p5, &torchdbg::Distribution::p50, &torchdbg::Distribution::p99}) {
        const double a = (*s.distribution).*q, b = (*c.distribution).*q;
        CHECK((a == b || (std::isnan(a) && std::isnan(b))));
      }
    }
    if (t.numel() == 0) continue;
    const double a = 0.5 * host.to(torch::kDouble).nan_to_num(0.0, 0.0, 0.0).abs().mean().item<double>();
    CHECK(torchdbg::detail::count_outside(t, -a, a) == torchdbg::detail::count_outside(host, -a, a));
    if (t.dim() >= 1) {
      int64_t per_dev = 0, per_host = 0;
      CHECK(torchdbg::detail::count_above_per_unit(t, -1, a, per_dev) ==
            torchdbg::detail::count_above_per_unit(host, -1, a, per_host));
      CHECK(per_dev == per_host);
    }
    const double bs_dev = torchdbg::detail::batch_spread(t), bs_host = torchdbg::detail::batch_spread(host);
    // Rows that are all alike have no spread; a reduction in another order may leave one
    // rounding of the data's scale instead of 0.
    INFO("batch spread " << bs_dev << " on the device, " << bs_host << " on the host");
    CHECK(torchdbg_test::near(bs_dev, bs_host, 1e-9, 1e-14 * std::max(a, 1e-300)));
  }
}

TEST_CASE("the SIMD float path is exact on counts and extrema at every lane and block boundary",
          "[stats]") {
  torchdbg_test::SeededRng rng(8);
  for (int64_t n : {1, 7, 8, 9, 15, 16, 17, 2047, 2048, 2049, 4096 + 5, 3 * 2048 + 7}) {
    INFO("n = " << n);
    auto t = torch::randn({n}) * 10.0 + 3.0;
    // Non-finite values, zeros and -0 at lane and block edges.
    for (int64_t i : {int64_t{0}, int64_t{7}, int64_t{8}, n - 1, int64_t{2047}, int64_t{2048}}) {
      if (i >= n) continue;
      const int64_t kind = i % 5;
      t[i] = kind == 0 ? kNaN : kind == 1 ? kInf : kind == 2 ? -kInf : kind == 3 ? 0.0 : -0.0;
    }
    const auto s = torchdbg::compute_stats(t);
    check_summary(s, t);
    const auto half = t.to(torch::kHalf);
    check_summary(torchdbg::compute_stats(half), half);
  }
  SECTION("non-negative blocks followed by a negative value, a NaN and a -0") {
    // After a block without negative values the kernel reads the next in its non-negative
    // mode; a block that breaks the pattern is read again with every count.
    auto t = torch::relu(torch::randn({5 * 2048 + 11}));
    t[3 * 2048 + 700] = -2.5;
    t[4 * 2048 + 9] = kNaN;
    t[2 * 2048] = -0.0;
    t[5 * 2048 + 5] = -1.0;  // in the scalar tail
    check_summary(torchdbg::compute_stats(t), t);
    const auto half = t.to(torch::kHalf);
    check_summary(torchdbg::compute_stats(half), half);
  }
  SECTION("all values non-finite in a whole block") {
    auto t = torch::full({2048 + 3}, kNaN);
    t[2049] = 5.0;
    const auto s = torchdbg::compute_stats(t);
    CHECK(s.finite_count == 1);
    CHECK(s.mean == 5.0);
    CHECK(s.min == 5.0);
    CHECK(s.linf_norm == 5.0);
  }
}

#if defined(TORCHDBG_HAVE_VECTOR_EXT)  // the vector kernels' widths
TEST_CASE("every vector width this CPU runs agrees with the double reference, fast and exact paths",
          "[stats]") {
  namespace d = torchdbg::detail;
  torchdbg_test::SeededRng rng(9);
  const auto variants = d::block_kernel_variants();
  REQUIRE(!variants.empty());
  CHECK(std::string(variants.back().name) == "baseline");
  // One block's sums relative to `shift`, recomputed in double over the finite values.
  auto check_block = [](const d::FloatBlock& b, const torch::Tensor& t, float shift) {
    const Reference r = reference(t);
    CHECK(b.finite == r.finite);
    CHECK(b.nan == r.nan);
    CHECK(b.pos_inf == r.pos_inf);
    CHECK(b.zeros == r.zeros);
    CHECK(b.negatives == r.neg);
    if (r.finite > 0) {
      CHECK(b.min == r.min);
      CHECK(b.max == r.max);
    }
    double s1 = 0, s2 = 0;
    const auto acc = t.accessor<float, 1>();
    for (int64_t i = 0; i < t.size(0); ++i) {
      if (!std::isfinite(acc[i])) continue;
      const double dv = static_cast<double>(acc[i]) - shift;
      s1 += dv;
      s2 += dv * dv;
    }
    CHECK_SCALED(b.s1, s1, r.l1 + 1.0, 1e-5);
    CHECK_SCALED(b.s2, s2, s2 + 1.0, 1e-5);
    CHECK_SCALED(b.abs_sum, r.l1, r.l1 + 1.0, 1e-5);
  };
  for (const auto& k : variants) {
    INFO("variant " << k.name);
    for (int64_t n : {1, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 1000, 2047, 2048}) {
      INFO("n = " << n);
      auto t = torch::randn({n}) * 10.0 + 3.0;
      for (int64_t i : {int64_t{0}, int64_t{15}, int64_t{16}, int64_t{31}, int64_t{32}, n - 1}) {
        if (i < n) t[i] = i % 2 ? 0.0 : -0.0;  // zeros and -0 (not negative) at lane edges
      }
      if (n > 40) t[40] = -7.25;
      // Row 0 is the shift; rows 1.. are summed (handed over from row 1, as batch_spread does).
      const float* p = t.data_ptr<float>();
      d::FloatBlock fast, exact, moments;
      REQUIRE(k.finite(p, n, 0.5f, fast));
      check_block(fast, t, 0.5f);
      // Moments only: the same sums and extrema, bit for bit (the same operations in the same
      // order), no sign counts.
      REQUIRE(k.finite_moments(p, n, 0.5f, moments));
      CHECK(moments.s1 == fast.s1);
      CHECK(moments.s2 == fast.s2);
      CHECK(moments.min == fast.min);
      CHECK(moments.max == fast.max);
      CHECK(moments.finite == fast.finite);
      k.exact(p, n, 0.5f, exact);
      check_block(exact, t, 0.5f);
      // The non-negative mode: refuses a block with a negative value in its vector part, and
      // is exact when it accepts one (a short block is all scalar tail).
      d::FloatBlock nonneg;
      if (k.finite_non_negative(p, n, 0.5f, nonneg)) {
        CHECK(n < 64);
        check_block(nonneg, t, 0.5f);
      }
      // On non-negative data (zeros and -0 included) it equals the full mode.
      auto r = torch::relu(t);
      for (int64_t i : {int64_t{0}, n - 1}) r[i] = -0.0;
      const float* rp = r.data_ptr<float>();
      d::FloatBlock rf, rn;
      REQUIRE(k.finite(rp, n, 0.5f, rf));
      REQUIRE(k.finite_non_negative(rp, n, 0.5f, rn));
      check_block(rn, r, 0.5f);
      CHECK(rn.negatives == 0);
      CHECK(rn.zeros == rf.zeros);
      CHECK(rn.s1 == rf.s1);
      CHECK(rn.s2 == rf.s2);
      CHECK(rn.min == rf.min);
      CHECK(rn.max == rf.max);
      // NaN or Inf sends the block to the exact path, wherever it sits.
      for (double bad : {kNaN, kInf, -kInf}) {
        for (int64_t i : {int64_t{0}, n / 2, n - 1}) {
          auto u = t.clone();
          u[i] = bad;
          INFO("bad " << bad << " at " << i);
          d::FloatBlock o;
          CHECK_FALSE(k.finite(u.data_ptr<float>(), n, 0.0f, o));
          CHECK_FALSE(k.finite_moments(u.data_ptr<float>(), n, 0.0f, o));
          CHECK_FALSE(k.finite_non_negative(u.data_ptr<float>(), n, 0.0f, o));
          k.exact(u.data_ptr<float>(), n, 0.0f, o);
          check_block(o, u, 0.0f);
        }
      }
    }
    // Finite values whose squares overflow float within the vector lanes: sent back too.
    auto huge = torch::full({2048}, 3.0e38);
    d::FloatBlock o;
    CHECK_FALSE(k.finite(huge.data_ptr<float>(), 2048, 0.0f, o));
    CHECK_FALSE(k.finite_moments(huge.data_ptr<float>(), 2048, 0.0f, o));
    CHECK_FALSE(k.finite_non_negative(huge.data_ptr<float>(), 2048, 0.0f, o));
  }
}
#endif

TEST_CASE("statistics without sign counts equal the full ones and mark what they skip", "[stats]") {
  torchdbg_test::SeededRng rng(11);
  const auto skipped = torchdbg::StatsOptions().sign_counts(false);
  auto relu_like = torch::relu(torch::randn({3, 5000}) * 4.0 + 1.0);  // zeros and positives
  auto offset = torch::randn({7000}) * 0.01 + 1000.0;  // large mean: the shifted sums matter
  auto strided = torch::randn({64, 96}).t();
  for (const torch::Tensor& t :
       {relu_like, offset, strided, torch::randn({5000}).to(torch::kHalf),
        torch::randn({5000}).to(torch::kBFloat16)}) {
    INFO("dtype " << t.scalar_type() << ", numel " << t.numel());
    const auto full = torchdbg::compute_stats(t);
    const auto fast = torchdbg::compute_stats(t, skipped);
    CHECK(full.sign_counts);
#if defined(TORCHDBG_HAVE_VECTOR_EXT)
    CHECK_FALSE(fast.sign_counts);
    CHECK(fast.zero_count == -1);
    CHECK(fast.negative_count == -1);
    CHECK(fast.positive_count == -1);
    CHECK(std::isnan(fast.l1_norm));
    CHECK(std::isnan(fast.sparsity));
#else  // the scalar kernel counts them anyway, and says so
    CHECK(fast.sign_counts);
    CHECK(fast.zero_count == full.zero_count);
    CHECK(fast.negative_count == full.negative_count);
    CHECK(fast.positive_count == full.positive_count);
    CHECK(fast.l1_norm == full.l1_norm);
#endif
    CHECK(fast.numel == full.numel);
    CHECK(fast.finite_count == full.finite_count);
    CHECK(fast.nan_count == full.nan_count);
    CHECK(fast.inf_count == full.inf_count);
    // The same block sums in the same order: equal, not merely close.
    CHECK(((fast.mean == full.mean) || (std::isnan(fast.mean) && std::isnan(full.mean))));
    CHECK(((fast.std == full.std) || (std::isnan(fast.std) && std::isnan(full.std))));
    CHECK(((fast.min == full.min) || (std::isnan(fast.min) && std::isnan(full.min))));
    CHECK(((fast.max == full.max) || (std::isnan(fast.max) && std::isnan(full.max))));
    CHECK(fast.l2_norm == full.l2_norm);
    CHECK(fast.linf_norm == full.linf_norm);
    // ... and both match the double reference
    const Reference r = reference(t);
    CHECK_CLOSE(fast.l2_norm, r.l2, 1e-6);
    CHECK_CLOSE(fast.std, r.std, 1e-6);
    const auto j = nlohmann::json::parse(nlohmann::json(fast).dump());
    CHECK(j["zero_count"].is_null() == !fast.sign_counts);
    CHECK(j["l1_norm"].is_null() == !fast.sign_counts);
    CHECK(nlohmann::json(full)["zero_count"] == full.zero_count);
  }
  // A NaN/Inf block takes the exact path, which counts everything; float64 and integer data
  // always have their counts, and an empty tensor's are known.
  for (const torch::Tensor& t : {with_non_finite(torch::randn({1000})), torch::randn({100}).to(torch::kDouble),
                                 torch::arange(-50, 50, torch::kInt), torch::empty({0})}) {
    INFO("dtype " << t.scalar_type());
    const auto fast = torchdbg::compute_stats(t, skipped);
    CHECK(fast.sign_counts);
    check_summary(fast, t);
  }
  // Mixed: one block with NaN, the others finite: the result cannot claim the counts.
  auto mixed = torch::randn({3 * 2048});
  mixed[5] = kNaN;
#if defined(TORCHDBG_HAVE_VECTOR_EXT)
  CHECK_FALSE(torchdbg::compute_stats(mixed, skipped).sign_counts);
#endif
  check_summary(torchdbg::compute_stats(mixed), mixed);
  // The distribution's readers want the counts: asking for it computes them.
  const auto dist = torchdbg::compute_stats(relu_like, torchdbg::StatsOptions().sign_counts(false).distribution(true));
  CHECK(dist.sign_counts);
  check_summary(dist, relu_like);
}

#if defined(TORCHDBG_HAVE_VECTOR_EXT)  // the vector kernels' widths
TEST_CASE("every vector width counts values above a threshold per column like a naive loop",
          "[stats]") {
  namespace d = torchdbg::detail;
  torchdbg_test::SeededRng rng(10);
  for (const auto& k : d::block_kernel_variants()) {
    INFO("variant " << k.name);
    for (int64_t units : {1, 3, 4, 15, 16, 17, 63, 64, 65, 130}) {
      for (int64_t rows : {0, 1, 7, 33}) {
        INFO("rows " << rows << " units " << units);
        auto t = torch::randn({rows, units});
        if (rows > 0) {
          for (int64_t u = 0; u < units; u += 5) t[0][u] = 0.25;  // equal to the threshold: not above
          t[rows - 1][units - 1] = std::numeric_limits<float>::quiet_NaN();
          if (units > 16) t[0][16] = std::numeric_limits<float>::infinity();
          if (units > 2) t[rows - 1][2] = -std::numeric_limits<float>::infinity();
        }
        std::vector<int32_t> counts(static_cast<std::size_t>(units), 5);  // added to, not set
        k.rows_above(t.data_ptr<float>(), rows, units, 0.25f, counts.data());
        const auto acc = t.accessor<float, 2>();
        for (int64_t u = 0; u < units; ++u) {
          int32_t ref = 5;
          for (int64_t r = 0; r < rows; ++r) ref += acc[r][u] > 0.25f ? 1 : 0;
          CHECK(counts[static_cast<std::size_t>(u)] == ref);
        }
      }
    }
    // One contiguous run (a channel's plane of an [N, C, H, W] output): every length around
    // the unrolled loop's 4 vectors, NaN/Inf and values equal to the threshold included.
    for (int64_t n : {0, 1, 15, 16, 63, 64, 65, 127, 128, 129, 1000}) {
      INFO("n " << n);
      auto t = torch::randn({n});
      if (n > 3) {
        t[0] = 0.25;
        t[1] = std::numeric_limits<float>::quiet_NaN();
        t[2] = std::numeric_limits<float>::infinity();
        t[n - 1] = 0.3;
      }
      const auto acc = t.accessor<float, 1>();
      int64_t ref = 0;
      for (int64_t i = 0; i < n; ++i) ref += acc[i] > 0.25f ? 1 : 0;
      CHECK(k.count_above(t.data_ptr<float>(), n, 0.25f) == ref);
    }
  }
}
#endif

namespace {

/// Checks statistics of data of any magnitude against the double reference: counts and
/// extrema exact, moments and norms to `rel` of the data's RMS (float sums in blocks).
void check_any_magnitude(const torchdbg::TensorStats& s, const torch::Tensor& t, double rel) {
  const Reference r = reference(t);
  CHECK(s.finite_count == r.finite);
  CHECK(s.nan_count == r.nan);
  CHECK(s.pos_inf_count == r.pos_inf);
  CHECK(s.neg_inf_count == r.neg_inf);
  if (s.sign_counts) {
    CHECK(s.zero_count == r.zeros);
    CHECK(s.negative_count == r.neg);
    CHECK(s.positive_count == r.pos);
    CHECK_CLOSE(s.l1_norm, r.l1, rel);
  }
  CHECK_CLOSE(s.min, r.min, 0.0);
  CHECK_CLOSE(s.max, r.max, 0.0);
  CHECK_CLOSE(s.linf_norm, r.linf, 0.0);
  CHECK(std::isfinite(s.l2_norm));
  CHECK_CLOSE(s.l2_norm, r.l2, rel);
  if (r.finite == 0) return;
  const double rms = r.l2 / std::sqrt(static_cast<double>(r.finite));
  CHECK(std::isfinite(s.mean));
  CHECK(std::isfinite(s.std));
  CHECK_SCALED(s.mean, r.mean, rms, rel);
  CHECK_SCALED(s.std, r.std, rms, rel);
}

/// Random data: |x| log-uniform between 10^lo and 10^hi (capped at the dtype's largest
/// finite value), signs mixed or not, an optional common offset, NaN/Inf sprinkled.
torch::Tensor any_magnitude(std::mt19937_64& gen, int64_t n, double lo, double hi, bool mixed,
                            double offset, int64_t non_finite, double cap) {
  std::uniform_real_distribution<double> u(0.0, 1.0);
  std::vector<double> v(static_cast<std::size_t>(n));
  for (auto& x : v) {
    x = std::min(cap, std::pow(10.0, lo + (hi - lo) * u(gen)));
    if (mixed && u(gen) < 0.5) x = -x;
    x = std::max(-cap, std::min(cap, x + offset));
  }
  const double bad[] = {kNaN, kInf, -kInf};
  for (int64_t k = 0; k < non_finite && n > 0; ++k)
    v[static_cast<std::size_t>(u(gen) * static_cast<double>(n)) % v.size()] = bad[k % 3];
  return torch::tensor(v, torch::kDouble);
}

}  // namespace

TEST_CASE("float32 values far beyond float's sum range give exact std, L2 and mean", "[stats]") {
  // Activations around 1e20: float lane sums of squares would overflow; std is 1e20-ish.
  torchdbg_test::SeededRng rng(21);
  auto t = (torch::randn({4096}, torch::kDouble) * 1e20 + 5e19).to(torch::kFloat);
  check_any_magnitude(torchdbg::compute_stats(t), t, 1e-6);
  check_any_magnitude(torchdbg::compute_stats(t, torchdbg::StatsOptions().sign_counts(false)), t, 1e-6);
  const auto s = torchdbg::compute_stats(t);
  CHECK(s.std > 0.5e20);
  CHECK(s.std < 2e20);
  // Alternating +-FLT_MAX: mean 0, std and RMS FLT_MAX, L2 FLT_MAX * sqrt(n).
  const double fmax = std::numeric_limits<float>::max();
  auto alt = torch::full({5000}, fmax, torch::kFloat);
  alt.index_put_({torch::indexing::Slice(1, torch::indexing::None, 2)}, -fmax);
  const auto a = torchdbg::compute_stats(alt);
  CHECK(a.mean == 0.0);
  CHECK_CLOSE(a.std, fmax, 1e-12);
  CHECK_CLOSE(a.l2_norm, fmax * std::sqrt(5000.0), 1e-12);
  CHECK_CLOSE(a.l1_norm, fmax * 5000.0, 1e-12);
  // Tiny values: squares of their deviations are below float's normal range.
  auto tiny = (torch::rand({3000}, torch::kDouble) * 1e-37).to(torch::kFloat);
  check_any_magnitude(torchdbg::compute_stats(tiny), tiny, 1e-6);
  // The same through the half and bfloat16 paths (bfloat16 reaches 3e38).
  auto bf = (torch::randn({3000}, torch::kDouble) * 1e36).to(torch::kBFloat16);
  check_any_magnitude(torchdbg::compute_stats(bf), bf, 1e-6);
}

TEST_CASE("property: magnitudes 1e-38 to FLT_MAX, mixed signs, NaN/Inf, every dtype and vector width",
          "[stats]") {
  namespace d = torchdbg::detail;
  std::mt19937_64 gen(20261130);
  std::uniform_real_distribution<double> u(0.0, 1.0);
  const double fmax = std::numeric_limits<float>::max();
  int64_t cases = 0;
  for (int trial = 0; trial < 40; ++trial) {
    const int64_t sizes[] = {1, 9, 100, 2047, 2048, 2049, 6000, 20000};
    const int64_t n = sizes[trial % 8];
    double lo = -38.0 + 76.5 * u(gen), hi = -38.0 + 76.5 * u(gen);
    if (lo > hi) std::swap(lo, hi);
    const bool mixed = u(gen) < 0.6;
    const double offset = u(gen) < 0.3 ? std::pow(10.0, -38.0 + 76.5 * u(gen)) : 0.0;
    const int64_t non_finite = u(gen) < 0.4 ? 1 + trial % 5 : 0;
    INFO("trial " << trial << ": n " << n << ", |x| in 1e" << lo << "..1e" << hi << ", mixed " << mixed
                  << ", offset " << offset << ", non-finite " << non_finite);
    const auto base = any_magnitude(gen, n, lo, hi, mixed, offset, non_finite, fmax);
    // float32 at every vector width this CPU runs, with and without sign counts.
    const auto f = base.to(torch::kFloat);
#if defined(TORCHDBG_HAVE_VECTOR_EXT)
    for (const auto& k : d::block_kernel_variants()) {
      for (bool signs : {true, false}) {
        INFO("variant " << k.name << ", signs " << signs);
        d::Moments m;
        bool non_negative = false;
        const float* p = f.data_ptr<float>();
        for (int64_t b = 0; b < n; b += d::kFloatBlock)
          m.merge(d::float_block_moments(p + b, std::min(d::kFloatBlock, n - b), signs, non_negative, k));
        check_any_magnitude(torchdbg::stats_from_moments(m, f), f, 1e-5);
        ++cases;
      }
    }
#endif
    // Every other dtype through compute_stats, and float32 strided.
    check_any_magnitude(torchdbg::compute_stats(f), f, 1e-5);
    check_any_magnitude(torchdbg::compute_stats(base), base, 1e-10);
    const auto h = base.clamp(-65504.0, 65504.0).to(torch::kHalf);
    check_any_magnitude(torchdbg::compute_stats(h), h, 1e-5);
    const auto bf = base.to(torch::kBFloat16);
    check_any_magnitude(torchdbg::compute_stats(bf), bf, 1e-5);
    const auto strided = torch::stack({f, f}, 1).select(1, 1);
    check_any_magnitude(torchdbg::compute_stats(strided), strided, 1e-5);
    const auto ints = base.nan_to_num(0.0, 0.0, 0.0).clamp(-9.0e18, 9.0e18).to(torch::kLong);
    check_any_magnitude(torchdbg::compute_stats(ints), ints, 1e-10);
    const auto i16 = base.nan_to_num(0.0, 0.0, 0.0).clamp(-32768.0, 32767.0).to(torch::kShort);
    check_any_magnitude(torchdbg::compute_stats(i16), i16, 1e-10);
    cases += 7;
  }
  CHECK(cases >= 280);
}

TEST_CASE("empty tensors of any shape, zero tensors without storage and meta tensors", "[stats]") {
  for (const auto& shape : std::vector<std::vector<int64_t>>{{3, 0, 5}, {0, 4, 4}, {2, 3, 0}, {0}}) {
    INFO("shape " << torch::IntArrayRef(shape));
    const auto s = torchdbg::compute_stats(torch::empty(shape), torchdbg::StatsOptions().distribution(true));
    CHECK(s.numel == 0);
    CHECK(s.shape == shape);
    CHECK(std::isnan(s.mean));
    CHECK(s.l2_norm == 0.0);
  }
  // Autograd's storage-less zeros read as zeros.
  const auto z = at::_efficientzerotensor({4, 5}, torch::kFloat);
  const auto zs = torchdbg::compute_stats(z, torchdbg::StatsOptions().distribution(true));
  CHECK(zs.numel == 20);
  CHECK(zs.zero_count == 20);
  CHECK(zs.mean == 0.0);
  CHECK(zs.std == 0.0);
  CHECK(zs.distribution->p50 == 0.0);
  CHECK(torchdbg::detail::count_outside(z, -1.0, 1.0) == 0);
  // A meta tensor has no data: a clear error, not a crash.
  CHECK_THROWS_WITH(torchdbg::compute_stats(torch::empty({3}, torch::device(torch::kMeta))),
                    Catch::Contains("meta tensor"));
}

TEST_CASE("beyond max_quantile_values the quantiles come from a sample; histogram, moments and outliers stay exact",
          "[stats]") {
  torchdbg_test::SeededRng rng(33);
  auto t = torch::randn({200000}) * 3.0 + 1.0;
  t.index_put_({torch::indexing::Slice(0, 1000)}, kNaN);
  t[5000] = kInf;
  const auto s = torchdbg::compute_stats(
      t, torchdbg::StatsOptions().distribution(true).histogram_bins(40).max_quantile_values(5000));
  REQUIRE(s.distribution);
  const auto& d = *s.distribution;
  CHECK(d.quantile_values == 5000);
  // Quantiles of the sample: within a few standard errors of the exact ones (N(1, 3)).
  const Reference r = reference(t);
  for (auto [q, got] : {std::pair{0.05, d.p5}, {0.25, d.p25}, {0.5, d.p50}, {0.75, d.p75}, {0.95, d.p95}}) {
    INFO("q " << q);
    CHECK(std::fabs(got - torchdbg_test::ref_quantile(r.sorted, q)) < 0.25);
  }
  // Exact: histogram counts, shape moments and outlier counts over all finite values.
  std::vector<int64_t> counts(40, 0);
  double s2 = 0, s3 = 0, s4 = 0;
  int64_t sig = 0, iqr = 0;
  const double fence_lo = d.p25 - 1.5 * (d.p75 - d.p25), fence_hi = d.p75 + 1.5 * (d.p75 - d.p25);
  for (double v : r.sorted) {
    auto b = static_cast<int64_t>((v - r.min) * 40.0 / (r.max - r.min));
    ++counts[static_cast<std::size_t>(std::min<int64_t>(b, 39))];
    const double dv = v - s.mean;
    s2 += dv * dv, s3 += dv * dv * dv, s4 += dv * dv * dv * dv;
    sig += std::fabs(dv) > 3.0 * s.std;
    iqr += v < fence_lo || v > fence_hi;
  }
  CHECK(d.bin_counts == counts);
  const double n = static_cast<double>(r.finite);
  CHECK_CLOSE(d.skewness, (s3 / n) / std::pow(s2 / n, 1.5), 1e-9);
  CHECK_CLOSE(d.excess_kurtosis, (s4 / n) / ((s2 / n) * (s2 / n)) - 3.0, 1e-9);
  CHECK(d.sigma3_outliers == sig);
  CHECK(d.iqr_outliers == iqr);
  // The same tensor gives the same sample; below the cap every finite value is used.
  const auto again = torchdbg::compute_stats(
      t, torchdbg::StatsOptions().distribution(true).histogram_bins(40).max_quantile_values(5000));
  CHECK(again.distribution->p50 == d.p50);
  const auto exact = torchdbg::compute_stats(t, torchdbg::StatsOptions().distribution(true));
  CHECK(exact.distribution->quantile_values == r.finite);
  CHECK_THROWS_WITH(torchdbg::compute_stats(t, torchdbg::StatsOptions().distribution(true).max_quantile_values(0)),
                    Catch::Contains("max_quantile_values"));
}

namespace {

/// A random tensor as users make them by broadcasting and windowing: expanded dimensions
/// (stride 0), transposes, strided slices and overlapping windows (unfold), of a random dtype
/// with NaN/Inf in floating data. `code` is the C++ that builds it, for a regression test.
struct ViewCase {
  torch::Tensor t;
  std::string code;
};

ViewCase random_view(std::mt19937_64& g) {
  const auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(g); };
  const std::vector<torch::ScalarType> dtypes = {torch::kFloat, torch::kFloat, torch::kDouble, torch::kHalf,
                                                 torch::kBFloat16, torch::kInt, torch::kByte, torch::kBool};
  const auto dtype = dtypes[static_cast<std::size_t>(pick(0, static_cast<int64_t>(dtypes.size()) - 1))];
  std::vector<int64_t> shape;
  for (int64_t d = pick(1, 3); d > 0; --d) shape.push_back(pick(1, 24));
  const uint64_t seed = g();
  torch::manual_seed(seed);
  torch::Tensor t = (torch::randn(shape) * 3).to(dtype);
  std::ostringstream code;
  code << "torch::manual_seed(" << seed << "); auto t = (torch::randn(" << torch::IntArrayRef(shape)
       << ") * 3).to(" << dtype << ")";
  if (t.is_floating_point() && t.numel() > 4) {
    auto flat = t.view(-1);
    flat[0] = kNaN;
    flat[t.numel() / 2] = kInf;
    flat[t.numel() - 1] = -kInf;
    code << "; /* [0] = NaN, [n/2] = Inf, [n-1] = -Inf */";
  }
  constexpr int64_t kMaxNumel = int64_t{1} << 21;  // the reference copies and sorts the values
  for (int64_t ops = pick(1, 4); ops > 0; --ops) {
    const torch::Tensor before = t;
    const std::size_t code_len = code.str().size();
    switch (pick(0, 3)) {
      case 0: {  // broadcast: a new or existing size-1 dimension expanded
        const int64_t at = pick(0, t.dim());
        const int64_t n = pick(2, 400);
        t = t.unsqueeze(at);
        std::vector<int64_t> sizes = t.sizes().vec();
        sizes[static_cast<std::size_t>(at)] = n;
        t = t.expand(sizes);
        code << ".unsqueeze(" << at << ").expand(" << torch::IntArrayRef(sizes) << ")";
        break;
      }
      case 1:
        if (t.dim() >= 2) {
          const int64_t a = pick(0, t.dim() - 1), b = pick(0, t.dim() - 1);
          t = t.transpose(a, b);
          code << ".transpose(" << a << ", " << b << ")";
        }
        break;
      case 2: {  // overlapping windows
        const int64_t d = pick(0, t.dim() - 1);
        if (t.size(d) >= 2) {
          const int64_t size = pick(2, t.size(d)), step = pick(1, std::max<int64_t>(1, size - 1));
          t = t.unfold(d, size, step);
          code << ".unfold(" << d << ", " << size << ", " << step << ")";
        }
        break;
      }
      default: {
        const int64_t d = pick(0, t.dim() - 1);
        code << ".slice(" << d << ", 0, " << t.size(d) << ", 2)";
        t = t.slice(d, 0, t.size(d), 2);
        break;
      }
    }
    if (t.numel() > kMaxNumel) {  // too large for the reference: undone
      t = before;
      std::string kept = code.str().substr(0, code_len);
      code.str(kept);
      code.seekp(0, std::ios_base::end);
    }
  }
  code << ";";
  return {t, code.str()};
}

}  // namespace

TEST_CASE("property: expanded, windowed and strided views give the statistics of their values", "[stats]") {
  std::mt19937_64 g(20261201);
  int pieces = 0;
  std::vector<ViewCase> cases;
  torch::manual_seed(5);  // overlapping windows beyond a piece: read piece by piece
  cases.push_back({with_non_finite(torch::randn({1 << 19})).unfold(0, 8, 2),
                   "auto t = with_non_finite(torch::randn({1 << 19})).unfold(0, 8, 2);"});
  for (int i = 0; i < 40; ++i) cases.push_back(random_view(g));
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const ViewCase& c = cases[i];
    const torch::Tensor& t = c.t;
    INFO("case " << i << ": " << c.code << " shape " << t.sizes() << " strides " << t.strides());
    pieces += torchdbg::detail::read_in_pieces(torchdbg::detail::collapse_repeats(t).base) ? 1 : 0;
    const auto s = torchdbg::compute_stats(t, torchdbg::StatsOptions().distribution(true).histogram_bins(9));
    check_summary(s, t);
    const Reference r = reference(t);
    REQUIRE(s.distribution);
    if (r.finite > 0 && r.finite <= (int64_t{1} << 20)) {  // all values: exact quantiles
      CHECK_CLOSE(s.distribution->p25, torchdbg_test::ref_quantile(r.sorted, 0.25), 1e-12);
      CHECK_CLOSE(s.distribution->p50, torchdbg_test::ref_quantile(r.sorted, 0.5), 1e-12);
      CHECK_CLOSE(s.distribution->p99, torchdbg_test::ref_quantile(r.sorted, 0.99), 1e-12);
    }
    int64_t total = 0;
    for (auto n : s.distribution->bin_counts) total += n;
    CHECK(total == r.finite);
    // Counts where the values lie, against torch on a contiguous copy.
    const torch::Tensor dense = t.contiguous().to(torch::kDouble);
    CHECK(torchdbg::detail::count_outside(t, -1.0, 2.0) ==
          ((dense < -1.0).logical_or(dense > 2.0)).sum().item<int64_t>());
    if (t.dim() >= 1 && t.numel() > 0) {
      const int64_t dim = t.dim() - 1;
      int64_t per_unit = 0;
      const auto counts = torchdbg::detail::count_above_per_unit(t, dim, 0.0, per_unit);
      const torch::Tensor ref = (dense > 0.0).to(torch::kLong).reshape({-1, t.size(dim)}).sum(0);
      REQUIRE(counts.size() == static_cast<std::size_t>(t.size(dim)));
      for (int64_t u = 0; u < t.size(dim); ++u) CHECK(counts[static_cast<std::size_t>(u)] == ref[u].item<int64_t>());
      CHECK(per_unit == t.numel() / t.size(dim));
    }
  }
  CHECK(pieces > 0);  // some cases overlap beyond a piece and are read piece by piece
}

namespace {

/// sqrt(mean((x - x.mean(0))^2)) in float64 torch ops on a contiguous copy; NaN where
/// batch_spread documents NaN.
double reference_batch_spread(const torch::Tensor& t) {
  if (t.dim() < 2 || t.size(0) < 2 || t.numel() == 0) return kNaN;
  const torch::Tensor x = t.contiguous().to(torch::kDouble);
  if (!torch::isfinite(x).all().item<bool>()) return kNaN;
  return (x - x.mean(0, true)).pow(2).mean().sqrt().item<double>();
}

}  // namespace

TEST_CASE("property: batch_spread is the spread across the batch of a double reference, on any view",
          "[stats]") {
  std::mt19937_64 g(20261202);
  const auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(g); };
  const std::vector<torch::ScalarType> dtypes = {torch::kFloat, torch::kDouble, torch::kHalf, torch::kBFloat16,
                                                 torch::kInt, torch::kLong, torch::kByte, torch::kBool};
  int nonzero = 0;
  for (int i = 0; i < 120; ++i) {
    const auto dtype = dtypes[static_cast<std::size_t>(pick(0, static_cast<int64_t>(dtypes.size()) - 1))];
    std::vector<int64_t> shape;
    for (int64_t d = pick(1, 4); d > 0; --d) shape.push_back(pick(1, 70));
    const uint64_t seed = g();
    torch::manual_seed(static_cast<int64_t>(seed & 0x7fffffff));
    // A per-position offset shared by every row (a bias) far larger than the spread, so a
    // kernel that does not take each position's batch mean out is off by orders.
    const double spread = std::pow(10.0, static_cast<double>(pick(-3, 3)));
    std::vector<int64_t> pos_shape = shape;
    pos_shape[0] = 1;
    torch::Tensor t = torch::randn(shape, torch::kDouble) * spread + torch::randn(pos_shape, torch::kDouble) * 1e3 * spread;
    t = t.to(dtype);
    std::ostringstream code;
    code << "seed " << seed << " shape " << torch::IntArrayRef(shape) << " spread " << spread << " " << dtype;
    for (int64_t ops = pick(0, 3); ops > 0; --ops) {
      switch (pick(0, 3)) {
        case 0: {  // a size-1 dimension expanded (the batch one included)
          const int64_t at = pick(0, t.dim());
          std::vector<int64_t> sizes = t.unsqueeze(at).sizes().vec();
          sizes[static_cast<std::size_t>(at)] = pick(2, 9);
          t = t.unsqueeze(at).expand(sizes);
          code << ".unsqueeze(" << at << ").expand(" << torch::IntArrayRef(sizes) << ")";
          break;
        }
        case 1:
          if (t.dim() >= 2) {
            const int64_t a = pick(0, t.dim() - 1), b = pick(0, t.dim() - 1);
            t = t.transpose(a, b);
            code << ".transpose(" << a << ", " << b << ")";
          }
          break;
        case 2: {
          const int64_t d = pick(0, t.dim() - 1);
          const int64_t step = pick(1, 3);
          t = t.slice(d, 0, t.size(d), step);
          code << ".slice(" << d << ", 0, end, " << step << ")";
          break;
        }
        default:
          if (t.numel() > 0 && t.numel() < (int64_t{1} << 20)) {
            t = t.contiguous();
            code << ".contiguous()";
          }
      }
    }
    if (t.numel() > (int64_t{1} << 22)) continue;
    INFO("case " << i << ": " << code.str() << " -> " << t.sizes() << " strides " << t.strides());
    const double want = reference_batch_spread(t);
    const double got = torchdbg::detail::batch_spread(t);
    if (std::isnan(want)) {
      CHECK(std::isnan(got));
    } else {
      // The reference's own rounding follows the values' magnitude (its batch means of
      // identical rows are off by an ulp of the offset).
      const double scale = t.to(torch::kDouble).pow(2).mean().sqrt().item<double>();
      INFO("got " << got << " want " << want << " scale " << scale);
      CHECK(std::fabs(got - want) <= 1e-9 * (want + scale));
      if (want > 1e-6 * scale) ++nonzero;
    }
  }
  CHECK(nonzero > 40);
  // Float rows wider than one chunk of positions (4096) and taller than one block of rows (32),
  // and a NaN or Inf past the first chunk, in the shift row or another.
  for (const auto& shape : std::vector<std::vector<int64_t>>{{3, 2 * 4096 + 5}, {70, 4100}, {2, 4097}}) {
    const torch::Tensor t = torch::randn(shape) * 0.5 + torch::randn({1, shape[1]}) * 100;
    const double want = reference_batch_spread(t), got = torchdbg::detail::batch_spread(t);
    INFO("shape " << torch::IntArrayRef(shape) << " got " << got << " want " << want);
    CHECK(std::fabs(got - want) <= 1e-9 * want);
    const int64_t past = std::min<int64_t>(4096 + 17, shape[1] - 1);  // in the second chunk
    for (const auto& [row, col] : std::vector<std::pair<int64_t, int64_t>>{{0, past}, {shape[0] - 1, shape[1] - 1}}) {
      for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
        torch::Tensor u = t.clone();
        u.index_put_({row, col}, bad);
        INFO("bad value " << bad << " at [" << row << ", " << col << "]");
        CHECK(std::isnan(torchdbg::detail::batch_spread(u)));
      }
    }
  }
  // float64 values whose squares, or their sums over the batch, overflow (rows of 0 and of up
  // to 1e308, any row first): the spread of the reference on the values scaled by a power of two
  // (exact), and NaN still where a value is NaN or Inf.
  for (const int64_t rows : {2, 3, 10, 100, 1000}) {
    for (const double big : {1e150, 1e153, 5e153, 2e154, 1e200, 1e307}) {
      torch::Tensor t = torch::zeros({rows, 6}, torch::kDouble);
      t.narrow(0, 1, rows - 1).copy_(torch::rand({rows - 1, 6}, torch::kDouble).add(0.5).mul(big));
      t = t.index_select(0, torch::randperm(rows));
      const double scale = std::ldexp(1.0, std::ilogb(big) + 1);
      const double want = reference_batch_spread(t / scale) * scale, got = torchdbg::detail::batch_spread(t);
      INFO("rows " << rows << " magnitude " << big << " got " << got << " want " << want);
      CHECK(std::isfinite(want));
      CHECK(std::fabs(got - want) <= 1e-9 * want);
      t[rows - 1][5] = kInf;
      CHECK(std::isnan(torchdbg::detail::batch_spread(t)));
      t[rows - 1][5] = kNaN;
      CHECK(std::isnan(torchdbg::detail::batch_spread(t)));
    }
  }
  // float64 deviations too small for their squares (down to subnormals), also beside a column
  // of huge values, and values more than DBL_MAX apart: the reference on the deviations scaled
  // by a power of two, with a long double loop on two rows as a second one.
  const auto tensor2 = [](std::vector<double> v, std::vector<int64_t> shape) {
    return torch::tensor(v, torch::kDouble).reshape(shape);
  };
  struct Tiny {
    torch::Tensor t;
    double want;
  };
  for (const Tiny& c : std::vector<Tiny>{
           {tensor2({1e-300, -1e-300}, {2, 1}), 1e-300},
           {tensor2({2.5e-308, -2.5e-308}, {2, 1}), 2.5e-308},
           {tensor2({1e-160, -1e-160}, {2, 1}), 1e-160},
           {tensor2({1e150, 3e-300, 1e150, -3e-300}, {2, 2}), std::sqrt(0.5) * 3e-300},
           {tensor2({1e308, 1e-200, 1e308, -1e-200}, {2, 2}), std::sqrt(0.5) * 1e-200},
           {tensor2({1.7e308, -1.7e308}, {2, 1}), 1.7e308},
           {tensor2({-1.7e308, 1.7e308, 1.0, 1.0}, {2, 2}), 0.85e308},
           {tensor2({-1.7e308, 1.7e308, 1.7e308, -1.7e308}, {2, 2}), 1.7e308}}) {
    const double got = torchdbg::detail::batch_spread(c.t);
    INFO("values " << c.t << " got " << got << " want " << c.want);
    CHECK(std::fabs(got - c.want) <= 1e-9 * c.want);
  }
  CHECK(torchdbg::detail::batch_spread(tensor2({1e-320, 0.0}, {2, 1})) > 0.0);  // subnormal: not 0
  for (const double tiny : {1e-150, 1e-200, 1e-300, 1e-310}) {
    const torch::Tensor t = (torch::randn({8, 16}, torch::kDouble) + torch::randn({1, 16}, torch::kDouble) * 1e3) * tiny;
    const torch::Tensor dev = t - t.narrow(0, 0, 1);
    const int k = -std::ilogb(tiny), half = k / 2;  // 2^k itself may be beyond double
    const double want = reference_batch_spread(dev * std::ldexp(1.0, half) * std::ldexp(1.0, k - half)) *
                        std::ldexp(1.0, -half) * std::ldexp(1.0, half - k);
    const double got = torchdbg::detail::batch_spread(t);
    INFO("magnitude " << tiny << " got " << got << " want " << want);
    CHECK(want > 0.0);
    if (tiny >= 1e-300) CHECK(std::fabs(got - want) <= 1e-9 * want);  // 1e-310 itself is subnormal
    CHECK(torchdbg::detail::batch_spread((torch::randn({4, 1}, torch::kDouble) * tiny).expand({4, 7})) > 0.0);
  }
  // Many rows and a first row far from the others (the shift of the first pass): the
  // closed form of one value 0 among rows - 1 values v.
  for (const int64_t rows : {int64_t{10000}, int64_t{100000}, int64_t{1000000}}) {
    for (const auto dtype : {torch::kDouble, torch::kFloat}) {
      torch::Tensor t = torch::full({rows, 3}, 0.1, dtype);
      t[0] = 0.0;
      const double v = t[1][0].item<double>();
      const double want = v * std::sqrt(static_cast<double>(rows - 1)) / static_cast<double>(rows);
      const double got = torchdbg::detail::batch_spread(t);
      INFO("rows " << rows << " " << dtype << " got " << got << " want " << want);
      CHECK(std::fabs(got - want) <= 1e-9 * want);
      // Summed again about the means: a NaN or Inf in another position still makes NaN.
      t[rows - 1][2] = dtype == torch::kFloat ? kInf : kNaN;
      CHECK(std::isnan(torchdbg::detail::batch_spread(t)));
    }
  }
  // Rows that are all alike have no spread, however large the values.
  CHECK(torchdbg::detail::batch_spread(torch::randn({1, 7}).mul(1e6).expand({32, 7})) == 0.0);
  CHECK(torchdbg::detail::batch_spread(torch::randn({5}).mul(1e6).repeat({16, 1})) == 0.0);
  // No batch, a NaN or an Inf: NaN. Bad input: the documented error.
  CHECK(std::isnan(torchdbg::detail::batch_spread(torch::randn({9}))));
  CHECK(std::isnan(torchdbg::detail::batch_spread(torch::randn({1, 9}))));
  CHECK(std::isnan(torchdbg::detail::batch_spread(torch::zeros({0, 9}))));
  torch::Tensor bad = torch::randn({4, 9});
  bad[2][3] = kInf;
  CHECK(std::isnan(torchdbg::detail::batch_spread(bad)));
  bad[2][3] = kNaN;
  CHECK(std::isnan(torchdbg::detail::batch_spread(bad)));
  CHECK(std::isnan(torchdbg::detail::batch_spread(torch::full({1, 4}, kNaN).expand({6, 4}))));
  CHECK(std::isnan(torchdbg::detail::batch_spread(bad.narrow(0, 2, 1).expand({6, 9}))));
  CHECK_THROWS_AS(torchdbg::detail::batch_spread(torch::Tensor()), torchdbg::Error);
  CHECK_THROWS_AS(torchdbg::detail::batch_spread(torch::zeros({2, 2}, torch::kComplexFloat)), torchdbg::Error);
}

TEST_CASE("an expanded tensor of 2^40 elements is summarised from its storage, exactly", "[stats]") {
  torchdbg_test::SeededRng rng(11);
  auto base = with_non_finite(torch::randn({1024, 1}));
  const int64_t repeats = int64_t{1} << 30;
  const auto t = base.expand({1024, repeats});  // 4 TiB as float32 if it were made contiguous
  const Reference r = reference(base);
  const auto s = torchdbg::compute_stats(t, torchdbg::StatsOptions().distribution(true).histogram_bins(16));
  CHECK(s.numel == 1024 * repeats);
  CHECK(s.finite_count == r.finite * repeats);
  CHECK(s.nan_count == r.nan * repeats);
  CHECK(s.pos_inf_count == r.pos_inf * repeats);
  CHECK(s.neg_inf_count == r.neg_inf * repeats);
  CHECK(s.zero_count == r.zeros * repeats);
  CHECK(s.positive_count == r.pos * repeats);
  CHECK_SCALED(s.mean, r.mean, r.scale(), 1e-6);
  CHECK_CLOSE(s.std, r.std, 1e-6);
  CHECK(s.min == r.min);
  CHECK(s.max == r.max);
  CHECK_CLOSE(s.l2_norm, r.l2 * std::sqrt(static_cast<double>(repeats)), 1e-6);
  CHECK_CLOSE(s.l1_norm, r.l1 * static_cast<double>(repeats), 1e-6);
  REQUIRE(s.distribution);
  int64_t total = 0;
  for (auto n : s.distribution->bin_counts) {
    CHECK(n % repeats == 0);  // every distinct value stands 2^30 times
    total += n;
  }
  CHECK(total == r.finite * repeats);
  // Quantiles from a uniform sample of the values: near the base's own.
  CHECK(std::fabs(s.distribution->p50 - torchdbg_test::ref_quantile(r.sorted, 0.5)) < 0.1);
  CHECK(torchdbg::detail::count_outside(t, -1.0, 1.0) ==
        repeats * ((base < -1.0).logical_or(base > 1.0)).sum().item<int64_t>());
  int64_t per_unit = 0;
  const auto per_row = torchdbg::detail::count_above_per_unit(t, 0, 0.0, per_unit);
  CHECK(per_unit == repeats);
  CHECK(per_row[5] == (base[5][0].item<double>() > 0 ? repeats : 0));
  const auto per_col = torchdbg::detail::count_above_per_unit(t.narrow(1, 0, 3), 1, 0.0, per_unit);
  CHECK(per_col == std::vector<int64_t>(3, (base > 0).sum().item<int64_t>()));
  // On the device path (torch operators), the same counts come back scaled.
  const auto packed = torchdbg::detail::unpack_moments(torchdbg::detail::pack_moments(t));
  CHECK(packed.count == 1024 * repeats);
  CHECK(packed.finite == r.finite * repeats);
  CHECK_SCALED(packed.mean, r.mean, r.scale(), 1e-12);

  // Autograd's storage-less zeros of many elements: read in pieces of zeros.
  const auto z = at::_efficientzerotensor({3, int64_t{1} << 21}, torch::kFloat);
  const auto zs = torchdbg::compute_stats(z, torchdbg::StatsOptions().distribution(true));
  CHECK(zs.zero_count == 3 * (int64_t{1} << 21));
  CHECK(zs.max == 0.0);
}

TEST_CASE("sparse COO tensors: stored values with duplicates summed and implicit zeros, without densifying", "[stats]") {
  torchdbg_test::SeededRng rng(31);
  const auto indices = torch::tensor({0, 3, 3, 7, 7, 7, 2, 9, 1, 1, 5, 5}, torch::kLong).view({2, 6});
  auto values = torch::randn({6});
  values[1] = std::numeric_limits<float>::infinity();
  const auto sp = torch::sparse_coo_tensor(indices, values, {10, 12});  // uncoalesced: duplicates
  const torch::Tensor dense = sp.to_dense();
  const auto s = torchdbg::compute_stats(sp, torchdbg::StatsOptions().distribution(true).histogram_bins(7));
  check_summary(s, dense);
  const Reference r = reference(dense);
  REQUIRE(s.distribution);
  CHECK_CLOSE(s.distribution->p50, torchdbg_test::ref_quantile(r.sorted, 0.5), 1e-12);
  CHECK_CLOSE(s.distribution->p95, torchdbg_test::ref_quantile(r.sorted, 0.95), 1e-12);
  int64_t total = 0;
  for (auto n : s.distribution->bin_counts) total += n;
  CHECK(total == r.finite);
  CHECK(torchdbg::detail::count_outside(sp, -0.5, 0.5) ==
        ((dense < -0.5).logical_or(dense > 0.5)).sum().item<int64_t>());
  CHECK(torchdbg::detail::count_outside(sp, 0.5, 1.0) == ((dense < 0.5).logical_or(dense > 1.0)).sum().item<int64_t>());
  int64_t per_unit = 0;
  CHECK_THROWS_AS(torchdbg::detail::count_above_per_unit(sp, 0, 0.0, per_unit), torchdbg::Error);
  // 2^27 elements of which 1000 are stored: a sample in proportion, the rest exact.
  const auto big_idx = torch::stack({torch::randint(0, 1 << 14, {1000}), torch::randint(0, 1 << 13, {1000})});
  const auto big = torch::sparse_coo_tensor(big_idx, torch::rand({1000}) + 1.0, {1 << 14, 1 << 13});
  const auto b = torchdbg::compute_stats(big, torchdbg::StatsOptions().distribution(true));
  CHECK(b.numel == int64_t{1} << 27);
  CHECK(b.distribution->p50 == 0.0);
  int64_t big_total = 0;
  for (auto n : b.distribution->bin_counts) big_total += n;
  CHECK(big_total == int64_t{1} << 27);
  CHECK(b.distribution->quantile_values == int64_t{1} << 20);
}

TEST_CASE("property: printed statistics read back as the reference's, to 4 significant digits", "[stats]") {
  std::mt19937 rng(33);
  const std::regex form(
      R"(TensorStats\((\w+) \[([0-9, ]*)\] cpu, mean (\S+), std (\S+), min (\S+), max (\S+), nan (\d+), inf (\d+)\))");
  const auto close = [](const std::string& text, double ref) {
    if (std::isnan(ref)) return text == "nan";
    const double v = std::stod(text);
    return std::abs(v - ref) <= 5e-4 * std::abs(ref) + 1e-300;
  };
  for (int trial = 0; trial < 60; ++trial) {
    torchdbg_test::SeededRng seed(500 + static_cast<uint64_t>(trial));
    const int64_t rows = 1 + static_cast<int64_t>(rng() % 40), cols = 1 + static_cast<int64_t>(rng() % 30);
    const double scale = std::pow(10.0, static_cast<double>(rng() % 13) - 6.0);
    auto t = torch::randn({rows, cols}, torch::kDouble) * scale + scale * 0.3;
    if (rng() % 3 == 0) t = with_non_finite(torch::randn({rows + 9, 2}) * scale);
    if (rng() % 3 == 0) t = t.t();  // non-contiguous
    if (rng() % 4 == 0) t = t.to(rng() % 2 ? torch::kHalf : torch::kBFloat16);
    const auto s = torchdbg::compute_stats(t);
    const std::string text = fmt::format("{}", s);
    std::ostringstream os;
    os << s;
    CHECK(os.str() == text);
    std::smatch m;
    INFO(text);
    REQUIRE(std::regex_match(text, m, form));
    CHECK(m[1] == c10::toString(t.scalar_type()));
    CHECK(m[2] == fmt::format("{}", fmt::join(t.sizes(), ", ")));
    const Reference r = reference(t);
    CHECK(close(m[3], r.mean));
    CHECK(close(m[4], r.std));
    CHECK(close(m[5], r.min));
    CHECK(close(m[6], r.max));
    CHECK(std::stoll(m[7]) == r.nan);
    CHECK(std::stoll(m[8]) == r.pos_inf + r.neg_inf);
  }
  CHECK(fmt::format("{}", torchdbg::compute_stats(torch::empty({0, 5}))) == "TensorStats(Float [0, 5] cpu, empty)");
  CHECK(fmt::format("{}", torchdbg::compute_stats(torch::full({3}, kNaN))) ==
        "TensorStats(Float [3] cpu, mean nan, std nan, min nan, max nan, nan 3, inf 0)");
}

namespace {

/// `n` values of one of six kinds: iid normal with an offset, ReLU'd normal (zeros), a heavy
/// tail (normal cubed), rows of very different scales, a trend along the tensor, and groups of
/// `stride` blocks of 2048 whose blocks carry different offsets (a sampler taking the same
/// place in every group would be biased there).
torch::Tensor sampled_kind_data(int kind, int64_t n, int64_t stride, std::mt19937_64& gen) {
  std::uniform_real_distribution<double> u(0.0, 1.0);
  const double scale = std::pow(10.0, -6.0 + 12.0 * u(gen));
  const double offset = scale * (6.0 * u(gen) - 3.0);
  switch (kind) {
    case 0:
      return torch::randn({n}) * scale + offset;
    case 1:
      return torch::relu(torch::randn({n}) + 0.3) * scale;
    case 2:
      return torch::randn({n}).pow(3) * scale + offset;
    case 3: {
      const int64_t cols = 512, rows = n / cols;
      auto t = torch::randn({rows, cols}) * torch::exp(2.0 * torch::randn({rows, 1}));
      return torch::cat({t.reshape(-1), torch::randn({n - rows * cols})}) * scale;
    }
    case 4:
      return (torch::linspace(0.0, 1.0, n) + 0.01 * torch::randn({n})) * scale + offset;
    default: {
      auto block_offsets = torch::randn({stride}) * 5.0;
      auto idx = torch::floor_divide(torch::arange(n), 2048).remainder(stride);
      return (torch::randn({n}) + block_offsets.index_select(0, idx)) * scale;
    }
  }
}

struct DoubleRef {
  double mean, std, min, max;
  int64_t zeros, negatives;
};

DoubleRef double_ref(const torch::Tensor& t) {
  const auto d = t.to(torch::kDouble);
  return {d.mean().item<double>(), d.std(/*unbiased=*/false).item<double>(), d.min().item<double>(),
          d.max().item<double>(), (d == 0).sum().item<int64_t>(), (d < 0).sum().item<int64_t>()};
}

}  // namespace

TEST_CASE("property: a sampled reading's counts, mean, std and L2 norm are a full reading's; its sign counts estimate them",
          "[stats]") {
  namespace d = torchdbg::detail;
  torchdbg_test::SeededRng rng(77);
  std::mt19937_64 gen(77);
  for (int trial = 0; trial < 120; ++trial) {
    const int kind = trial % 6;
    const int64_t stride = 2 + (trial * 7) % 9;
    const int64_t n = d::kMinSampleGroups * stride * 2048 + static_cast<int64_t>(gen() % 200000);
    const bool signs = trial % 3 != 0;
    const auto t = sampled_kind_data(kind, n, stride, gen).contiguous();
    INFO("trial " << trial << " kind " << kind << " n " << n << " stride " << stride << " signs " << signs);
    REQUIRE(t.scalar_type() == torch::kFloat);
    const DoubleRef r = double_ref(t);
    d::Moments m;
    d::SampleInfo info;
    REQUIRE(d::sample_float(t.data_ptr<float>(), n, signs, stride, /*seed=*/trial, m, info));
    CHECK(m.count == n);
    CHECK(m.finite == n);
    CHECK(m.nan + m.pos_inf + m.neg_inf == 0);
    // One full block of each group, and the partial last block, through the full kernel.
    const int64_t full = n / 2048, groups = (full + stride - 1) / stride;
    CHECK(info.values == groups * 2048 + n % 2048);
    // The full kernel's precision (float sums within blocks, merged in double).
    const double scale = std::fabs(r.mean) + r.std;
    CHECK(std::fabs(m.mean - r.mean) <= 1e-6 * scale);
    CHECK(std::fabs(std::sqrt(m.variance()) - r.std) <= 1e-5 * r.std + 1e-7 * std::fabs(r.mean));
    const double l2 = std::sqrt(static_cast<double>(n) * (r.mean * r.mean + r.std * r.std));
    CHECK(std::fabs(std::sqrt(m.sum_squares()) - l2) <= 1e-6 * l2);
    CHECK(m.min >= r.min);  // the blocks read: within the true range
    CHECK(m.max <= r.max);
    CHECK(m.abs_max <= std::max(-r.min, r.max));
    if (m.signs) {
      CHECK(m.zeros + m.negatives + m.positives == n);
      CHECK(m.zeros >= 0);
      CHECK(m.negatives >= 0);
      if (r.zeros == 0) CHECK(m.zeros == 0);
      if (r.negatives == 0) CHECK(m.negatives == 0);
      if (kind == 0 || kind == 1) {  // iid values: thousands of them read give the fractions to a few percent
        CHECK(std::fabs(static_cast<double>(m.negatives - r.negatives)) <= 0.05 * static_cast<double>(n));
        CHECK(std::fabs(static_cast<double>(m.zeros - r.zeros)) <= 0.05 * static_cast<double>(n));
      }
    } else {
      CHECK(!signs);
    }
    // The same seed reads the same blocks.
    d::Moments again;
    d::SampleInfo info2;
    REQUIRE(d::sample_float(t.data_ptr<float>(), n, signs, stride, trial, again, info2));
    CHECK(again.zeros == m.zeros);
    CHECK(again.min == m.min);
  }
  // The sign counts are unbiased: over many draws their mean is the exact count.
  const auto relu = torch::relu(torch::randn({640 * 1024}) - 0.2);
  const auto exact = torchdbg::compute_stats(relu);
  double zeros = 0.0;
  for (uint64_t seed = 0; seed < 64; ++seed) {
    d::Moments m;
    d::SampleInfo info;
    REQUIRE(d::sample_float(relu.data_ptr<float>(), relu.numel(), true, 8, seed, m, info));
    zeros += static_cast<double>(m.zeros) / 64.0;
  }
  CHECK(std::fabs(zeros - static_cast<double>(exact.zero_count)) < 0.01 * static_cast<double>(exact.zero_count));
}

TEST_CASE("a full or sampled reading of constant, sparse, tiny, offset or outlier-led data gives the reference's mean, std and L2 norm",
          "[stats]") {
  namespace d = torchdbg::detail;
  torchdbg_test::SeededRng rng(78);
  const int64_t n = 1 << 20;
  std::vector<std::pair<std::string, torch::Tensor>> cases;
  cases.emplace_back("constant 2.5", torch::full({n}, 2.5f));
  cases.emplace_back("zeros", torch::zeros({n}));
  cases.emplace_back("negative zeros", torch::full({n}, -0.0f));
  auto one = torch::zeros({n});
  one[12345] = 1.0f;  // one value in a block the sample may skip
  cases.emplace_back("one 1.0 in zeros", one);
  auto ones = torch::ones({n});
  ones.narrow(0, 0, 100).fill_(1.001f);
  cases.emplace_back("ones, 100 at 1.001", ones);
  cases.emplace_back("randn * 1e-23", torch::randn({n}) * 1e-23);
  cases.emplace_back("randn * 1e-30", torch::randn({n}) * 1e-30);
  cases.emplace_back("+/- 1e-25 (squares underflow float)", torch::randn({n}).sign() * 1e-25);
  cases.emplace_back("1e6 + randn * 1e-3", torch::randn({n}) * 1e-3 + 1e6);
  auto spikes = torch::randn({n}) + 1000.0;
  spikes.narrow(0, 777, 5).fill_(1100.0f);
  cases.emplace_back("N(1000, 1) with five 1100", spikes);
  cases.emplace_back("randn * 1e17", torch::randn({n}) * 1e17);
  // Every block's first value an outlier: sums about it would cancel.
  auto first = torch::randn({n / 2048, 2048});
  first.select(1, 0).fill_(1e7f);
  cases.emplace_back("blocks led by 1e7, randn after", first.reshape(-1));
  auto huge_first = torch::full({n / 2048, 2048}, -1.3e11f);
  huge_first.select(1, 0).fill_(2.3e17f);
  cases.emplace_back("blocks led by 2.3e17, -1.3e11 after", huge_first.reshape(-1));
  for (const auto& [name, t] : cases) {
    INFO(name);
    const d::Moments whole = d::compute_moments(t, true);
    const DoubleRef r = double_ref(t);
    // the full reading itself
    CHECK(std::fabs(std::sqrt(whole.variance()) - r.std) <= 1e-5 * r.std + 1e-7 * std::fabs(r.mean) + 1e-45);
    for (uint64_t seed = 0; seed < 8; ++seed) {
      d::Moments m;
      d::SampleInfo info;
      REQUIRE(d::sample_float(t.data_ptr<float>(), n, true, 8, seed, m, info));
      INFO("seed " << seed);
      CHECK(m.mean == Approx(whole.mean).epsilon(1e-7).margin(1e-6 * (std::fabs(r.mean) + r.std)));
      CHECK(std::fabs(std::sqrt(m.variance()) - r.std) <= 1e-5 * r.std + 1e-7 * std::fabs(r.mean) + 1e-45);
      const double l2 = std::sqrt(static_cast<double>(n) * (r.mean * r.mean + r.std * r.std));
      CHECK(std::fabs(std::sqrt(m.sum_squares()) - l2) <= 1e-6 * l2);
    }
  }
}

TEST_CASE("a sampled reading of data holding NaN/Inf, or of too few blocks, or too large, reads every value", "[stats]") {
  namespace d = torchdbg::detail;
  torchdbg_test::SeededRng rng(79);
  std::mt19937_64 gen(79);
  const int64_t n = 400000;
  d::Moments m;
  d::SampleInfo info;
  for (int trial = 0; trial < 60; ++trial) {
    auto t = torch::randn({n});
    const auto pos = static_cast<int64_t>(gen() % n);
    const float bad = trial % 4 == 0   ? std::numeric_limits<float>::quiet_NaN()
                      : trial % 4 == 1 ? std::numeric_limits<float>::infinity()
                      : trial % 4 == 2 ? -std::numeric_limits<float>::infinity()
                                       : 3e38f;  // finite, but its squared deviation overflows float
    t[pos] = bad;
    INFO("trial " << trial << " at " << pos << " value " << bad);
    if (trial % 4 == 3) {
      // Read in full when its block is skimmed; through the full kernel (which sums such a
      // block in double) when drawn: a full reading's moments either way.
      if (d::sample_float(t.data_ptr<float>(), n, true, 2 + trial % 9, trial, m, info))
        CHECK(m.mean == Approx(d::compute_moments(t).mean).epsilon(1e-9));
      continue;
    }
    info = d::SampleInfo{};
    CHECK_FALSE(d::sample_float(t.data_ptr<float>(), n, trial % 2 == 0, 2 + trial % 9, trial, m, info));
    CHECK(info.values == 0);  // untouched
  }
  // Fewer than kMinSampleGroups groups of full blocks, or a stride too large to form them.
  auto small = torch::randn({2048 * 8 * d::kMinSampleGroups - 1});
  CHECK_FALSE(d::sample_float(small.data_ptr<float>(), small.numel(), true, 8, 1, m, info));
  CHECK_FALSE(d::sample_float(small.data_ptr<float>(), small.numel(), true, 1, 1, m, info));
  for (int64_t huge : {int64_t{1} << 40, int64_t{1} << 62, std::numeric_limits<int64_t>::max()})
    CHECK_FALSE(d::sample_float(small.data_ptr<float>(), small.numel(), true, huge, 1, m, info));
  auto enough = torch::randn({2048 * 8 * d::kMinSampleGroups});
  CHECK(d::sample_float(enough.data_ptr<float>(), enough.numel(), true, 8, 1, m, info));
  auto over = torch::randn({d::kMaxSampleValues + 1});
  CHECK_FALSE(d::sample_float(over.data_ptr<float>(), over.numel(), true, 8, 1, m, info));
  // The partial last block is read every time and weighs its own values only.
  const int64_t odd = 127 * 2048 + 1;
  auto spike = torch::zeros({odd});
  spike[odd - 1] = 1.0f;
  for (uint64_t seed = 0; seed < 50; ++seed) {
    REQUIRE(d::sample_float(spike.data_ptr<float>(), odd, true, 4, seed, m, info));
    CHECK(m.mean == 1.0 / static_cast<double>(odd));
    CHECK(m.positives == 1);
    CHECK(m.max == 1.0);
  }
}

#if defined(TORCHDBG_HAVE_VECTOR_EXT)  // the vector kernels' widths
TEST_CASE("every vector width's column deviations are a double loop's, NaN and Inf carried", "[stats]") {
  namespace d = torchdbg::detail;
  std::mt19937_64 g(20261205);
  const auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(g); };
  for (const auto& k : d::block_kernel_variants()) {
    INFO("variant " << k.name);
    for (int round = 0; round < 60; ++round) {
      const int64_t rows = pick(1, 40), n = pick(0, 70), stride = n + pick(0, 9);
      torchdbg_test::SeededRng rng(static_cast<uint64_t>(round) + 7);
      // Each position's offset (a bias) far above the spread, as batch_spread is given.
      const double offset = std::pow(10.0, static_cast<double>(pick(-2, 5)));
      torch::Tensor t = torch::randn({rows, std::max<int64_t>(stride, 1)}) + torch::randn({1, std::max<int64_t>(stride, 1)}) * offset;
      if (pick(0, 3) == 0 && rows > 1 && n > 0) {
        const float bad[] = {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                             -std::numeric_limits<float>::infinity()};
        t.index_put_({pick(0, rows - 1), pick(0, n - 1)}, bad[pick(0, 2)]);
      }
      const float* p = t.data_ptr<float>();
      // Sums already held (another chunk's): added to, not replaced.
      std::vector<double> s1(static_cast<std::size_t>(n)), s2(s1.size());
      for (auto& x : s1) x = static_cast<double>(pick(-5, 5));
      for (auto& x : s2) x = static_cast<double>(pick(0, 5));
      // Every other round the sums start from nothing (`fresh`), whatever the buffers held.
      const bool fresh = round % 2 == 1;
      std::vector<double> w1 = s1, w2 = s2, mag(s1.size(), 0.0);
      if (fresh) {
        std::fill(w1.begin(), w1.end(), 0.0);
        std::fill(w2.begin(), w2.end(), 0.0);
      }
      for (int64_t i = 0; i < n; ++i) {
        const auto u = static_cast<std::size_t>(i);
        for (int64_t r = 1; r < rows; ++r) {
          const double dv = static_cast<double>(p[r * stride + i]) - static_cast<double>(p[i]);
          w1[u] += dv;
          w2[u] += dv * dv;
          mag[u] += std::fabs(dv) + dv * dv;
        }
      }
      k.column_deviations(p, p + stride, rows - 1, stride, n, fresh, s1.data(), s2.data());
      INFO("rows " << rows << " n " << n << " stride " << stride << " offset " << offset);
      for (std::size_t u = 0; u < s1.size(); ++u) {
        INFO("position " << u << " got " << s1[u] << ", " << s2[u] << " want " << w1[u] << ", " << w2[u]);
        if (std::isnan(w1[u]) || std::isnan(w2[u])) {
          CHECK((std::isnan(s1[u]) || std::isnan(s2[u])));
        } else if (std::isinf(w2[u])) {
          CHECK(std::isinf(s2[u]));
        } else {
          // only the rounding of a fused multiply-add may differ from the loop's
          CHECK(std::fabs(s1[u] - w1[u]) <= 1e-13 * (mag[u] + 10.0));
          CHECK(std::fabs(s2[u] - w2[u]) <= 1e-13 * (mag[u] + 10.0));
        }
      }
    }
  }
}
#endif

#if defined(TORCHDBG_HAVE_VECTOR_EXT)  // the vector kernels' widths
TEST_CASE("every vector width's sums about a shift are a double loop's, and NaN/Inf anywhere are refused", "[stats]") {
  namespace d = torchdbg::detail;
  torchdbg_test::SeededRng rng(80);
  for (const auto& k : d::block_kernel_variants()) {
    INFO("variant " << k.name);
    for (int64_t n : {0, 1, 15, 16, 31, 32, 33, 63, 64, 65, 127, 128, 129, 2047, 2048}) {
      for (double offset : {0.0, 3.0, -1e4}) {
        auto t = torch::randn({n}) + offset;
        const float shift = n > 0 ? t[0].item<float>() : 0.0f;
        const auto acc = t.accessor<float, 1>();
        double s1 = 0.0, s2 = 0.0, abs1 = 0.0;
        for (int64_t i = 0; i < n; ++i) {
          const double dv = static_cast<double>(acc[i] - shift);
          s1 += dv;
          s2 += dv * dv;
          abs1 += std::fabs(dv);
        }
        d::FloatBlock a;
        INFO("n " << n << " offset " << offset);
        REQUIRE(k.finite_sums(t.data_ptr<float>(), n, shift, a));
        CHECK(a.finite == n);
        // at most 256 float additions per lane (the 4-lane baseline) before double
        CHECK(std::fabs(a.s1 - s1) <= 256 * 6e-8 * abs1);
        CHECK(std::fabs(a.s2 - s2) <= 256 * 6e-8 * s2);
        for (int64_t pos : {int64_t{0}, n / 2, n - 1}) {
          if (n == 0) continue;
          for (float bad : {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity()}) {
            auto u = t.clone();
            u[pos] = bad;
            INFO("pos " << pos << " value " << bad);
            d::FloatBlock b;
            CHECK_FALSE(k.finite_sums(u.data_ptr<float>(), n, shift, b));
          }
          // A square beyond FLT_MAX: refused in the float lanes, summed in double in the tail.
          auto u = t.clone();
          u[pos] = 3e19f;
          d::FloatBlock b;
          if (k.finite_sums(u.data_ptr<float>(), n, shift, b)) {
            const double dv = 3e19 - static_cast<double>(shift);
            CHECK(b.s2 >= dv * dv * (1.0 - 1e-6));
          }
        }
      }
    }
  }
}
#endif

TEST_CASE("compute_stats with sampling: large float32 tensors estimated, the rest read whole, bad options named",
          "[stats]") {
  using torchdbg::StatsOptions;
  using torchdbg::StatsSampling;
  torchdbg_test::SeededRng rng(80);
  const auto sampled = StatsOptions().sampling(StatsSampling().stride(8));
  const auto exact_json = [](const torch::Tensor& t) {
    return nlohmann::json(torchdbg::compute_stats(t)).dump();
  };
  for (int trial = 0; trial < 20; ++trial) {
    auto t = torch::randn({2048 + trial * 77, 128}) * (1.0 + trial) - 0.5 * trial;
    t = t.contiguous();
    INFO("trial " << trial << " n " << t.numel());
    const auto s = torchdbg::compute_stats(t, sampled);
    const DoubleRef r = double_ref(t);
    CHECK(s.sampled_count > 0);
    CHECK(s.sampled_count < s.numel);
    CHECK(s.numel == t.numel());
    CHECK(s.finite_count == t.numel());
    CHECK(s.nan_count + s.inf_count == 0);
    CHECK(s.min >= r.min);
    CHECK(s.max <= r.max);
    const auto whole = torchdbg::compute_stats(t);
    CHECK(s.mean == Approx(whole.mean).epsilon(1e-7).margin(1e-6 * whole.std));
    CHECK(s.std == Approx(whole.std).epsilon(1e-6));
    CHECK(s.l2_norm == Approx(whole.l2_norm).epsilon(1e-6));
    CHECK(s.zero_count + s.negative_count + s.positive_count == s.numel);
    const auto j = nlohmann::json(s);
    CHECK(j.at("sampled_count").get<int64_t>() == s.sampled_count);
    CHECK(nlohmann::json(whole).count("sampled_count") == 0);
    // A NaN or Inf anywhere: every value is read, as without sampling.
    auto bad = t.clone();
    bad.view({-1})[(trial * 7919) % bad.numel()] = trial % 2 ? std::numeric_limits<float>::quiet_NaN()
                                                             : -std::numeric_limits<float>::infinity();
    const auto b = torchdbg::compute_stats(bad, sampled);
    CHECK(b.sampled_count == 0);
    CHECK(nlohmann::json(b).dump() == exact_json(bad));
  }
  // Read whole: small, float64, half, strided, a distribution, stride 1.
  const auto big = torch::randn({2048, 160});
  for (const auto& t : {torch::randn({32768}), big.to(torch::kDouble), big.to(torch::kHalf), big.t(),
                        big.to(torch::kInt)}) {
    INFO(t.scalar_type() << " " << t.sizes() << " contiguous " << t.is_contiguous());
    const auto s = torchdbg::compute_stats(t, sampled);
    CHECK(s.sampled_count == 0);
    CHECK(nlohmann::json(s).dump() == exact_json(t));
  }
  // Up to 2^22 values (16 MiB, which may be in cache): sampled, unless the full kernel splits
  // it between threads; above, read in full.
  const auto cap = torch::randn({int64_t{1} << 22});
  if (at::get_num_threads() == 1)
    CHECK(torchdbg::compute_stats(cap, sampled).sampled_count > 0);
  else
    CHECK(torchdbg::compute_stats(cap, sampled).sampled_count == 0);
  const auto over = torch::randn({(int64_t{1} << 22) + 1});
  CHECK(torchdbg::compute_stats(over, sampled).sampled_count == 0);
  CHECK(torchdbg::compute_stats(big, StatsOptions().sampling(StatsSampling().stride(1))).sampled_count == 0);
  CHECK(torchdbg::compute_stats(big, StatsOptions(sampled).distribution(true)).sampled_count == 0);
  CHECK(torchdbg::compute_stats(big, StatsOptions().sampling(StatsSampling().stride(8).above(1000))).sampled_count > 0);
  CHECK_THROWS_WITH(torchdbg::compute_stats(big, StatsOptions().sampling(StatsSampling().stride(0))),
                    Catch::Contains("stride must be at least 1, got 0"));
  CHECK_THROWS_WITH(torchdbg::compute_stats(big, StatsOptions().sampling(StatsSampling().stride(4).above(-5))),
                    Catch::Contains("above must be at least 0, got -5"));
}

TEST_CASE("data that ends where an unreadable page begins is read to its end and not beyond", "[stats]") {
#if defined(__unix__)
  namespace d = torchdbg::detail;
  // 512 KiB of data followed by 64 KiB nobody may read: every kernel, on every vector width,
  // must stop at the data's end (its read-ahead may only prefetch, which never faults).
  const std::size_t data_bytes = std::size_t{512} << 10, guard_bytes = std::size_t{64} << 10;
  REQUIRE(data_bytes % static_cast<std::size_t>(sysconf(_SC_PAGESIZE)) == 0);
  void* base = mmap(nullptr, data_bytes + guard_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(base != MAP_FAILED);
  struct Unmap {
    void* p;
    std::size_t n;
    ~Unmap() { munmap(p, n); }
  } unmap{base, data_bytes + guard_bytes};
  REQUIRE(mprotect(static_cast<char*>(base) + data_bytes, guard_bytes, PROT_NONE) == 0);
  float* const end = reinterpret_cast<float*>(static_cast<char*>(base) + data_bytes);
  torchdbg_test::SeededRng rng(31);
  for (int64_t n : {1, 15, 16, 31, 33, 2047, 2048, 2049, 4103, 70001, 131072}) {
    for (bool relu : {false, true}) {
      INFO("n " << n << (relu ? " relu" : ""));
      float* const p = end - n;
      torch::Tensor src = torch::randn({n});
      if (relu) src = torch::relu(src);
      std::memcpy(p, src.data_ptr<float>(), static_cast<std::size_t>(n) * sizeof(float));
      const torch::Tensor view = torch::from_blob(p, {n});
      check_summary(torchdbg::compute_stats(view), src);
      const auto moments = torchdbg::compute_stats(view, torchdbg::StatsOptions().sign_counts(false));
      CHECK(moments.finite_count == n);
      CHECK(moments.max == src.max().item<float>());
      const auto sampled = torchdbg::compute_stats(
          view, torchdbg::StatsOptions().sampling(torchdbg::StatsSampling().stride(2).above(0)));
      CHECK((sampled.sampled_count > 0) == (n >= 16 * 2 * d::kFloatBlock));
      CHECK(sampled.finite_count == n);
      CHECK_CLOSE(sampled.std, src.std(false).item<double>(), 1e-6);
#if defined(TORCHDBG_HAVE_VECTOR_EXT)  // the vector kernels' widths
      const Reference r = reference(src);
      for (const auto& k : d::block_kernel_variants()) {
        INFO("variant " << k.name);
        const int64_t len = std::min<int64_t>(n, d::kFloatBlock);
        const float* q = end - len;  // the last block, ending at the guard
        const torch::Tensor last = src.narrow(0, n - len, len);
        const Reference rl = reference(last);
        d::FloatBlock b;
        CHECK(k.finite(q, len, q[0], b));
        CHECK(b.finite == len);
        CHECK(b.zeros == rl.zeros);
        CHECK(b.min == rl.min);
        CHECK(b.max == rl.max);
        CHECK(k.finite_moments(q, len, q[0], b));
        CHECK(b.max == rl.max);
        const bool accepted = k.finite_non_negative(q, len, q[0], b);  // refuses negatives in its vectors
        if (relu) CHECK(accepted);
        if (!relu && len >= 2047) CHECK(!accepted);
        if (accepted) {
          CHECK(b.zeros == rl.zeros);
          CHECK(b.negatives == rl.neg);
        }
        CHECK(k.finite_sums(q, len, q[0], b));
        k.exact(q, len, q[0], b);
        CHECK(b.finite == len);
        CHECK(b.negatives == rl.neg);
        CHECK(k.count_above(p, n, 0.0f) == r.pos);
      }
#endif
    }
  }
  // Per-unit counts of an [N, C, H, W] output ending at the guard.
  const int64_t n = 8 * 4 * 64 * 64;
  float* const p = end - n;
  const torch::Tensor src = torch::relu(torch::randn({8, 4, 64, 64}));
  std::memcpy(p, src.data_ptr<float>(), static_cast<std::size_t>(n) * sizeof(float));
  int64_t per_unit = 0;
  const auto counts = d::count_above_per_unit(torch::from_blob(p, {8, 4, 64, 64}), 1, 0.0, per_unit);
  const torch::Tensor ref = (src > 0).sum({0, 2, 3});
  CHECK(per_unit == 8 * 64 * 64);
  for (int64_t u = 0; u < 4; ++u) CHECK(counts[static_cast<std::size_t>(u)] == ref[u].item<int64_t>());
#else
  SUCCEED("no mmap here");
#endif
}

#if defined(TORCHDBG_X86_DISPATCH)
namespace {
/// Whether XGETBV reads XINUSE (ECX = 1): which state components are in use, not initial.
bool xinuse_readable() {
  unsigned a = 0, b = 0, c = 0, dx = 0;
  if (!__get_cpuid(1, &a, &b, &c, &dx) || !(c & bit_OSXSAVE)) return false;
  return __get_cpuid_count(0xD, 1, &a, &b, &c, &dx) && (a & 4u);
}
uint64_t xinuse() {
  uint32_t lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(1));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}
}  // namespace
#endif

TEST_CASE("the wide kernels return with the upper halves of the vector registers clean", "[stats]") {
#if defined(TORCHDBG_X86_DISPATCH)
  // Dirty upper halves (XINUSE bit 2: AVX, bit 6: the upper 256 bits of zmm0-15) make every
  // SSE instruction the caller runs next slower; GCC clears them by itself only at -O2 and up,
  // and this suite is built at -O0 with sanitizers.
  if (!xinuse_readable()) {
    SUCCEED("this CPU cannot say which of its register states are in use");
    return;
  }
#if defined(__SANITIZE_ADDRESS__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 13
  // Newer GCCs' AddressSanitizer (14 here) poisons a kernel's stack shadow with vector stores
  // at its exit, after the kernel's vzeroupper: the state seen would be the sanitizer's.
  SUCCEED("AddressSanitizer's exit code dirties the vector registers itself with this GCC");
  return;
#endif
  namespace d = torchdbg::detail;
  constexpr uint64_t kDirtyUpper = (1u << 2) | (1u << 6);
  torchdbg_test::SeededRng rng(47);
  const torch::Tensor data = torch::randn({64, 96});
  const float* p = data.data_ptr<float>();
  std::vector<int32_t> counts(96, 0);
  std::vector<double> s1(96), s2(96);
  int wide = 0;
  for (const auto& k : d::block_kernel_variants()) {
    if (std::string(k.name) == "baseline") continue;
    ++wide;
    INFO("variant " << k.name);
    d::FloatBlock b;
    std::vector<std::pair<const char*, uint64_t>> after;
    k.finite(p, 2048, 0.0f, b);
    after.emplace_back("finite", xinuse());
    k.finite_moments(p, 2048, 0.0f, b);
    after.emplace_back("finite_moments", xinuse());
    k.finite_non_negative(p, 2048, 0.0f, b);
    after.emplace_back("finite_non_negative", xinuse());
    k.exact(p, 2048, 0.0f, b);
    after.emplace_back("exact", xinuse());
    k.finite_sums(p, 2048, 0.0f, b);
    after.emplace_back("finite_sums", xinuse());
    k.rows_above(p, 64, 96, 0.0f, counts.data());
    after.emplace_back("rows_above", xinuse());
    (void)k.count_above(p, 64 * 96, 0.0f);
    after.emplace_back("count_above", xinuse());
    k.column_deviations(p, p + 96, 63, 96, 96, true, s1.data(), s2.data());
    after.emplace_back("column_deviations", xinuse());
    for (const auto& [kernel, state] : after) {
      INFO(kernel << ": XINUSE " << std::hex << state);
      CHECK((state & kDirtyUpper) == 0);
    }
  }
  if (wide == 0) SUCCEED("no AVX2 or AVX-512 on this CPU");
#else
  SUCCEED("no x86-64 vector kernels in this build");
#endif
}

TEST_CASE("property: float64 data of any magnitude, 1e-300 to 1e308, gives a long-double reference's moments, norms and distribution",
          "[stats]") {
  // Squares of such values overflow or underflow a double: the reference sums in long double
  // (x86's 64-bit mantissa and 15-bit exponent; elsewhere the test keeps what it can check).
  constexpr bool kWideExponent = std::numeric_limits<long double>::max_exponent > 2000;
  std::mt19937_64 gen(1206);
  const auto relative = [](double got, long double want, double rel) {
    if (std::isinf(static_cast<double>(want))) return std::isinf(got);
    return std::fabs(static_cast<long double>(got) - want) <= rel * std::fabs(want) + 1e-4000L;
  };
  for (int trial = 0; trial < 120; ++trial) {
    const int decade = std::uniform_int_distribution<int>(-300, 307)(gen);
    const int64_t n = std::uniform_int_distribution<int64_t>(1, trial % 4 == 0 ? 9000 : 40)(gen);
    const int shape = std::uniform_int_distribution<int>(0, 3)(gen);  // 0 one-signed, 1 mixed, 2 offset, 3 two values
    std::vector<double> v(static_cast<std::size_t>(n));
    std::uniform_real_distribution<double> u(0.1, 1.7);
    for (int64_t i = 0; i < n; ++i) {
      double x = u(gen) * std::pow(10.0, decade);
      if (shape == 1 && (gen() & 1)) x = -x;
      if (shape == 2) x = std::pow(10.0, decade) * (1.0 + 1e-3 * u(gen));
      if (shape == 3) x = (i % 2 ? -1.0 : 1.0) * std::pow(10.0, decade);
      v[static_cast<std::size_t>(i)] = std::isfinite(x) ? x : 1.7e308;
    }
    torch::Tensor t = torch::from_blob(v.data(), {n}, torch::kDouble).clone();
    if (trial % 5 == 0 && n >= 2) t = t.view({n / 2 * 2 == n ? 2 : 1, -1}).t();  // a strided view
    long double s = 0, mx = 0;
    for (double x : v) {
      s += x;
      mx = std::max(mx, std::fabs(static_cast<long double>(x)));
    }
    const long double mean = s / n;
    long double ss = 0, dev2 = 0, dev3 = 0, dev4 = 0;
    for (double x : v) {
      const long double d = x - mean;
      ss += static_cast<long double>(x) * x;
      dev2 += d * d;
      dev3 += d * d * d;
      dev4 += d * d * d * d;
    }
    INFO("trial " << trial << ": " << n << " values near 1e" << decade << ", shape " << shape);
    const auto st = torchdbg::compute_stats(t, torchdbg::StatsOptions().distribution(true).histogram_bins(7));
    CHECK(st.finite_count == n);
    CHECK(std::fabs(st.mean - mean) <= 1e-12L * mx);  // a mean that cancels to about 0 included
    if (kWideExponent) {
      INFO("std " << st.std << " l2 " << st.l2_norm);
      CHECK(relative(st.std, std::sqrt(dev2 / n), 1e-6));
      CHECK(relative(st.l2_norm, std::sqrt(ss), 1e-12));
      CHECK(std::isfinite(st.std));
      CHECK(std::isfinite(st.l2_norm));
      if (dev2 > 0 && dev2 / n > 1e-20L * mean * mean) {
        const long double skew = (dev3 / n) / std::pow(dev2 / n, 1.5L);
        CHECK(std::fabs(st.distribution->skewness - skew) <= 1e-6L * std::max(1.0L, std::fabs(skew)));
        CHECK(relative(st.distribution->excess_kurtosis + 3.0, (dev4 / n) / ((dev2 / n) * (dev2 / n)), 1e-6));
      }
    }
    // The histogram: finite ascending edges from min to max, every value counted once in the
    // bin a long-double reckoning gives it.
    const auto& d = *st.distribution;
    REQUIRE(d.bin_edges.size() == 8);
    for (double e : d.bin_edges) CHECK(std::isfinite(e));
    for (std::size_t i = 1; i < d.bin_edges.size(); ++i) CHECK(d.bin_edges[i] >= d.bin_edges[i - 1]);
    int64_t total = 0;
    for (int64_t c : d.bin_counts) total += c;
    CHECK(total == n);
    if (st.max > st.min) {
      CHECK(d.bin_edges.front() == st.min);
      CHECK(d.bin_edges.back() == st.max);
      std::vector<int64_t> want(7, 0);
      const long double lo = st.min, hi = st.max;
      for (double x : v) {
        auto b = static_cast<int64_t>((x - lo) * 7 / (hi - lo));
        ++want[static_cast<std::size_t>(std::min<int64_t>(b, 6))];
      }
      int64_t moved = 0;  // a value within rounding of an edge may fall either side
      for (std::size_t b = 0; b < 7; ++b) moved += std::abs(want[b] - d.bin_counts[b]);
      CHECK(moved <= 2);
      CHECK(d.sigma3_outliers <= n / 9 + 1);  // Chebyshev: at most 1/9 beyond 3 std
    }
  }
  // The ends of the range: values whose squares, or whose difference, leave a double.
  const double big = std::numeric_limits<double>::max();
  const auto two = torchdbg::compute_stats(torch::tensor({1e200, -1e200}, torch::kDouble));
  CHECK(two.std == 1e200);
  CHECK_CLOSE(two.l2_norm, std::sqrt(2.0) * 1e200, 1e-15);
  CHECK(two.mean == 0.0);
  const auto edge = torchdbg::compute_stats(torch::tensor({1.5e308, -1.5e308}, torch::kDouble),
                                            torchdbg::StatsOptions().distribution(true).histogram_bins(4));
  CHECK(edge.mean == 0.0);
  CHECK(edge.std == 1.5e308);
  CHECK(std::isinf(edge.l2_norm));  // 2.1e308: beyond a double, as torch.norm
  CHECK(edge.distribution->bin_counts == std::vector<int64_t>{1, 0, 0, 1});
  CHECK(edge.distribution->bin_edges[2] == 0.0);
  const auto tiny = torchdbg::compute_stats(torch::tensor({1e-200, -1e-200}, torch::kDouble));
  CHECK(tiny.std == 1e-200);
  CHECK_CLOSE(tiny.l2_norm / 1e-200, std::sqrt(2.0), 1e-15);
  const auto spread = torchdbg::compute_stats(torch::tensor({-1e308, 0.0, 1e308}, torch::kDouble),
                                              torchdbg::StatsOptions().distribution(true).histogram_bins(4));
  CHECK(spread.distribution->bin_counts == std::vector<int64_t>{1, 0, 1, 1});
  CHECK(spread.distribution->sigma3_outliers == 0);
  CHECK(std::isfinite(spread.distribution->excess_kurtosis));
  const auto top = torchdbg::compute_stats(torch::full({3}, big, torch::kDouble),
                                           torchdbg::StatsOptions().distribution(true).histogram_bins(3));
  CHECK(top.std == 0.0);
  int64_t counted = 0;
  for (int64_t c : top.distribution->bin_counts) counted += c;
  CHECK(counted == 3);
  for (double e : top.distribution->bin_edges) CHECK(std::isfinite(e));
}

TEST_CASE(
    "property: the on-device reduction of float64 data of any magnitude, 1e-300 to 1e307, "
    "whole, in chunks and batched, gives a long-double reference's moments",
    "[stats]") {
  // pack_moments and MomentsBatch (what non-CPU tensors use; they run on CPU tensors too)
  // against torchdbg_test::wide_reference: squares of such values leave a double's range.
  using torchdbg::detail::Moments;
  const auto check = [](const Moments& m, const std::vector<double>& v, const char* what) {
    const auto r = torchdbg_test::wide_reference(v);
    INFO(what << ": mean " << m.mean << " std " << m.std_dev() << " l2 " << m.l2_norm() << " min "
              << m.min << " max " << m.max);
    CHECK(m.count == static_cast<int64_t>(v.size()));
    CHECK(m.finite == r.finite);
    CHECK(m.nan == r.nan);
    CHECK(m.pos_inf == r.pos_inf);
    CHECK(m.neg_inf == r.neg_inf);
    if (r.finite == 0) {
      CHECK(std::isnan(m.std_dev()));
      return;
    }
    // to the data's scale: a mean that cancels to about 0 included
    CHECK(std::fabs(m.mean - r.mean) <= 1e-12L * r.abs_max);
    CHECK(m.min == r.min);
    CHECK(m.max == r.max);
    CHECK(m.abs_max == r.abs_max);
    if (torchdbg_test::kWideLongDouble) {
      CHECK(std::isfinite(m.std_dev()));
      CHECK(torchdbg_test::wide_near(m.std_dev(), r.std, 1e-9));
      CHECK(torchdbg_test::wide_near(m.l2_norm(), r.l2, 1e-12));
      CHECK(torchdbg_test::wide_near(m.rms(), r.l2 / std::sqrt(static_cast<long double>(r.finite)),
                                     1e-12));
    }
  };
  for (int trial = 0; trial < 150; ++trial) {
    std::mt19937_64 gen(20260311 + static_cast<uint64_t>(trial));
    const auto c = torchdbg_test::wide_case(gen, trial % 5 == 0 ? 5000 : 40, 1 + trial % 5);
    INFO("trial " << trial << ": " << c.code() << " (wide_case with seed " << 20260311 + trial
                  << ")");
    const auto n = static_cast<int64_t>(c.values.size());
    torch::Tensor t = torch::tensor(c.values, torch::kDouble);
    if (trial % 3 == 0 && n % 2 == 0) t = t.view({2, -1}).t();  // a strided view
    check(torchdbg::detail::unpack_moments(torchdbg::detail::pack_moments(t)), c.values, "whole");
    // The chunks on their own and merged: each a packed vector, and again as rows of one batch.
    Moments merged;
    torchdbg::detail::MomentsBatch batch;
    std::vector<std::size_t> batched;
    for (std::size_t i = 0; i + 1 < c.cuts.size(); ++i) {
      const auto piece = c.piece(i);
      const auto tp = torch::tensor(piece, torch::kDouble);
      const Moments m = torchdbg::detail::unpack_moments(torchdbg::detail::pack_moments(tp));
      check(m, piece, "a chunk");
      merged.merge(m);
      if (torchdbg::detail::MomentsBatch::accepts(tp)) {
        (void)batch.add(tp);
        batched.push_back(i);
      }
    }
    check(merged, c.values, "chunks merged");
    if (batched.empty()) continue;
    const torch::Tensor rows = batch.reduce().contiguous();
    Moments rows_merged;
    for (std::size_t k = 0; k < batched.size(); ++k) {
      const Moments m = torchdbg::detail::unpack_moments(
          rows.data_ptr<double>() + static_cast<int64_t>(k) * torchdbg::detail::kPackedMoments);
      check(m, c.piece(batched[k]), "a batched row");
      rows_merged.merge(m);
    }
    check(rows_merged, c.values, "batched rows merged");
  }
  // The ends of the range, as the CPU kernel gives them; an RMS whose L2 norm leaves a double
  // stays finite.
  const auto packed = [](std::vector<double> v) {
    return torchdbg::detail::unpack_moments(
        torchdbg::detail::pack_moments(torch::tensor(v, torch::kDouble)));
  };
  const auto two = packed({1e200, -1e200});
  CHECK(two.std_dev() == 1e200);
  CHECK(two.mean == 0.0);
  CHECK_CLOSE(two.l2_norm(), std::sqrt(2.0) * 1e200, 1e-15);
  const auto edge = packed({1.5e308, -1.5e308, 1.5e308});
  CHECK_CLOSE(edge.mean, 0.5e308, 1e-15);
  CHECK_CLOSE(edge.std_dev(), std::sqrt(2.0) * 1e308, 1e-15);
  const auto tiny = packed({1e-200, -1e-200});
  CHECK(tiny.std_dev() == 1e-200);
  CHECK_CLOSE(tiny.rms(), 1e-200, 1e-15);
  const auto constant = packed({1.7e308, 1.7e308, 1.7e308});
  CHECK(constant.std_dev() == 0.0);
  CHECK(constant.mean == 1.7e308);
  CHECK_CLOSE(constant.rms(), 1.7e308, 1e-15);
  CHECK(torchdbg::detail::compute_moments(torch::full({4}, 1.5e308, torch::kDouble)).rms() == 1.5e308);
  // Ordinary magnitudes: the packed vector's columns are those a float64 reckoning gives.
  const auto ordinary = packed({1.0, 2.0, 4.0, kNaN});
  CHECK(std::fabs(ordinary.m2 - 14.0 / 3.0) < 1e-14);
  CHECK(ordinary.scale == 0);
}
