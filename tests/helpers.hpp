// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once
// Shared test helpers: a seeded RNG fixture, NaN-aware comparison, and an independent
// double-precision reference for tensor statistics (a naive loop over torch's own
// conversion to double, sharing nothing with torchdbg's kernel).

#include <torch/torch.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "catch.hpp"

namespace torchdbg_test {

/// A fresh, empty directory for one test under $TORCHDBG_TEST_TMP (set by ctest).
inline std::string tmp_dir(const std::string& name) {
  const char* base = std::getenv("TORCHDBG_TEST_TMP");
  const auto dir =
      std::filesystem::path(base ? base : std::filesystem::temp_directory_path().string()) / name;
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

/// Puts LibTorch's intra-op thread count back when the scope ends, however it ends.
struct RestoreThreads {
  int before = torch::get_num_threads();
  RestoreThreads() = default;
  RestoreThreads(const RestoreThreads&) = delete;
  RestoreThreads& operator=(const RestoreThreads&) = delete;
  ~RestoreThreads() { torch::set_num_threads(before); }
};

/// Seeds LibTorch's generator for the duration of a test.
struct SeededRng {
  explicit SeededRng(uint64_t seed = 1234) { torch::manual_seed(seed); }
};

/// True when a and b are both NaN, or equal within rel/abs tolerance.
inline bool near(double a, double b, double rel = 1e-9, double abs_tol = 1e-12) {
  if (std::isnan(a) || std::isnan(b)) return std::isnan(a) && std::isnan(b);
  if (std::isinf(a) || std::isinf(b)) return a == b;
  return std::fabs(a - b) <= abs_tol + rel * std::max(std::fabs(a), std::fabs(b));
}

#define CHECK_CLOSE(a, b, rel)                                                   \
  do {                                                                          \
    const double va_ = (a), vb_ = (b);                                          \
    INFO(#a " = " << va_ << ", " #b " = " << vb_);                              \
    CHECK(torchdbg_test::near(va_, vb_, rel));                                  \
  } while (0)

/// |a - b| <= rel * scale: for moments of float32 data, whose error follows the data's
/// magnitude (mean |x|), not the possibly near-zero moment itself.
#define CHECK_SCALED(a, b, scale, rel)                                          \
  do {                                                                          \
    const double va_ = (a), vb_ = (b), sc_ = (scale);                           \
    INFO(#a " = " << va_ << ", " #b " = " << vb_ << ", scale " << sc_);         \
    CHECK(std::fabs(va_ - vb_) <= (rel) * sc_);                                 \
  } while (0)

/// Reference statistics over the finite values, computed naively in double.
struct Reference {
  int64_t numel = 0, finite = 0, nan = 0, pos_inf = 0, neg_inf = 0, zeros = 0, neg = 0, pos = 0;
  double mean = std::nan(""), std = std::nan(""), min = std::nan(""), max = std::nan("");
  double l1 = 0, l2 = 0, linf = 0;
  std::vector<double> sorted;  // finite values, ascending; empty unless asked for
  /// Mean |x| over the finite values: the scale of the data.
  [[nodiscard]] double scale() const { return finite > 0 ? l1 / static_cast<double>(finite) : 0.0; }
};

inline std::vector<double> as_doubles(const torch::Tensor& t) {
  torch::Tensor d = t.detach().to(torch::kCPU).to(torch::kDouble).contiguous().reshape(-1);
  return std::vector<double>(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
}

/// Counts, moments, norms and extrema of `t` in a double loop; with `sorted`, its finite
/// values in ascending order too (for quantiles: a sort costs most of the time on large data).
inline Reference reference(const torch::Tensor& t, bool sorted = true) {
  Reference r;
  const auto v = as_doubles(t);
  r.numel = static_cast<int64_t>(v.size());
  double sum = 0, lo = std::numeric_limits<double>::infinity(), hi = -lo;
  for (double x : v) {
    if (std::isnan(x)) {
      ++r.nan;
    } else if (std::isinf(x)) {
      (x > 0 ? r.pos_inf : r.neg_inf) += 1;
    } else {
      ++r.finite;
      if (sorted) r.sorted.push_back(x);
      sum += x;
      lo = std::min(lo, x);
      hi = std::max(hi, x);
      r.zeros += x == 0;
      r.neg += x < 0;
      r.pos += x > 0;
      r.l1 += std::fabs(x);
      r.l2 += x * x;
      r.linf = std::max(r.linf, std::fabs(x));
    }
  }
  r.l2 = std::sqrt(r.l2);
  std::sort(r.sorted.begin(), r.sorted.end());
  if (r.finite > 0) {
    r.mean = sum / static_cast<double>(r.finite);
    double ss = 0;
    for (double x : v)
      if (std::isfinite(x)) ss += (x - r.mean) * (x - r.mean);
    r.std = std::sqrt(ss / static_cast<double>(r.finite));
    r.min = lo;
    r.max = hi;
  }
  return r;
}

/// Linear-interpolation quantile of ascending data (numpy's default method).
inline double ref_quantile(const std::vector<double>& sorted, double q) {
  if (sorted.empty()) return std::nan("");
  const double pos = q * static_cast<double>(sorted.size() - 1);
  const auto lo = static_cast<std::size_t>(std::floor(pos));
  const std::size_t hi = std::min(lo + 1, sorted.size() - 1);
  return sorted[lo] + (pos - static_cast<double>(lo)) * (sorted[hi] - sorted[lo]);
}

/// Whether long double holds the square of any double (x86's 80-bit format: a 15-bit
/// exponent); where it does not, wide_reference's std and L2 norm are not a reference.
constexpr bool kWideLongDouble = std::numeric_limits<long double>::max_exponent > 2000;

/// Reference statistics of the finite values of float64 data of any magnitude (1e-308 to
/// 1e308), naively in long double: two passes, no scaling, nothing shared with torchdbg.
struct WideReference {
  int64_t finite = 0, nan = 0, pos_inf = 0, neg_inf = 0;
  long double mean = std::nanl(""), std = std::nanl(""), min = std::nanl(""), max = std::nanl("");
  long double l2 = 0, abs_max = 0;
};

inline WideReference wide_reference(const std::vector<double>& v) {
  WideReference r;
  long double sum = 0, ss = 0;
  for (double x : v) {
    if (std::isnan(x)) {
      ++r.nan;
    } else if (std::isinf(x)) {
      (x > 0 ? r.pos_inf : r.neg_inf) += 1;
    } else {
      const long double y = x;
      sum += y;
      ss += y * y;
      r.min = r.finite == 0 ? y : std::min(r.min, y);
      r.max = r.finite == 0 ? y : std::max(r.max, y);
      r.abs_max = std::max(r.abs_max, std::fabs(y));
      ++r.finite;
    }
  }
  r.l2 = std::sqrt(ss);
  if (r.finite > 0) {
    r.mean = sum / static_cast<long double>(r.finite);
    long double dev2 = 0;
    for (double x : v)
      if (std::isfinite(x)) dev2 += (x - r.mean) * (x - r.mean);
    r.std = std::sqrt(dev2 / static_cast<long double>(r.finite));
  }
  return r;
}

/// |got - want| <= rel * |want| for a wide_reference value; a `want` beyond a double's range
/// needs an infinite `got`, a `want` of 0 an exact 0.
inline bool wide_near(double got, long double want, double rel) {
  if (std::isnan(static_cast<double>(want))) return std::isnan(got);
  if (std::isinf(static_cast<double>(want))) return std::isinf(got) && (got > 0) == (want > 0);
  return std::fabs(static_cast<long double>(got) - want) <= rel * std::fabs(want);
}

/// A generated float64 case for the wide-range properties: values near 10^decade (decades
/// -300 to 307) in one of five shapes, NaN/+-Inf among them in some cases, and `cuts`: the
/// bounds of consecutive pieces (ranks, chunks; some pieces empty) that together hold them.
struct WideCase {
  int decade = 0;
  int shape = 0;  // 0 one-signed, 1 mixed signs, 2 offset, 3 +-v, 4 decades apart
  std::vector<double> values;
  std::vector<std::size_t> cuts;  // pieces + 1 ascending bounds, from 0 to values.size()
  [[nodiscard]] std::vector<double> piece(std::size_t i) const {
    return std::vector<double>(values.begin() + static_cast<std::ptrdiff_t>(cuts[i]),
                               values.begin() + static_cast<std::ptrdiff_t>(cuts[i + 1]));
  }
  /// The case as code to paste into a regression test (its values when there are at most 60).
  [[nodiscard]] std::string code() const {
    std::ostringstream o;
    o.precision(17);
    o << values.size() << " values (decade " << decade << ", shape " << shape << ")";
    if (values.size() <= 60) {
      o << " {";
      for (std::size_t i = 0; i < values.size(); ++i) o << (i ? ", " : "") << values[i];
      o << "}";
    }
    o << ", cuts {";
    for (std::size_t i = 0; i < cuts.size(); ++i) o << (i ? ", " : "") << cuts[i];
    o << "}";
    return o.str();
  }
};

/// 1 to `max_n` values cut into `pieces` pieces at random (a piece may be empty).
inline WideCase wide_case(std::mt19937_64& gen, int64_t max_n, int pieces) {
  WideCase c;
  c.decade = std::uniform_int_distribution<int>(-300, 307)(gen);
  c.shape = std::uniform_int_distribution<int>(0, 4)(gen);
  const auto n =
      std::uniform_int_distribution<std::size_t>(1, static_cast<std::size_t>(max_n))(gen);
  std::uniform_real_distribution<double> u(0.1, 1.7);
  const double p = std::pow(10.0, c.decade);
  for (std::size_t i = 0; i < n; ++i) {
    double x = u(gen) * p;
    if (c.shape == 1 && (gen() & 1)) x = -x;
    if (c.shape == 2) x = p * (1.0 + 1e-3 * u(gen));
    if (c.shape == 3) x = (i % 2 ? -1.0 : 1.0) * p;
    if (c.shape == 4) {  // each value 1 to 1e30 times smaller, either sign
      const int down = std::uniform_int_distribution<int>(0, 30)(gen);
      x = ((gen() & 1) ? -x : x) * std::pow(10.0, -down);
    }
    c.values.push_back(std::isfinite(x) ? x : 1.7e308);
  }
  if (gen() % 3 == 0) {  // a few NaN/+-Inf
    const double odd[] = {std::nan(""), HUGE_VAL, -HUGE_VAL};
    for (auto k = gen() % 3 + 1; k > 0; --k) c.values[gen() % n] = odd[gen() % 3];
  }
  c.cuts = {0, n};
  for (int i = 1; i < pieces; ++i) c.cuts.push_back(gen() % (n + 1));
  std::sort(c.cuts.begin(), c.cuts.end());
  return c;
}

}  // namespace torchdbg_test
