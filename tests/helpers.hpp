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
  std::vector<double> sorted;  // finite values, ascending
  /// Mean |x| over the finite values: the scale of the data.
  [[nodiscard]] double scale() const { return finite > 0 ? l1 / static_cast<double>(finite) : 0.0; }
};

inline std::vector<double> as_doubles(const torch::Tensor& t) {
  torch::Tensor d = t.detach().to(torch::kCPU).to(torch::kDouble).contiguous().reshape(-1);
  return std::vector<double>(d.data_ptr<double>(), d.data_ptr<double>() + d.numel());
}

inline Reference reference(const torch::Tensor& t) {
  Reference r;
  const auto v = as_doubles(t);
  r.numel = static_cast<int64_t>(v.size());
  double sum = 0;
  for (double x : v) {
    if (std::isnan(x)) {
      ++r.nan;
    } else if (std::isinf(x)) {
      (x > 0 ? r.pos_inf : r.neg_inf) += 1;
    } else {
      r.sorted.push_back(x);
      sum += x;
      r.zeros += x == 0;
      r.neg += x < 0;
      r.pos += x > 0;
      r.l1 += std::fabs(x);
      r.l2 += x * x;
      r.linf = std::max(r.linf, std::fabs(x));
    }
  }
  r.finite = static_cast<int64_t>(r.sorted.size());
  r.l2 = std::sqrt(r.l2);
  std::sort(r.sorted.begin(), r.sorted.end());
  if (r.finite > 0) {
    r.mean = sum / static_cast<double>(r.finite);
    double ss = 0;
    for (double x : r.sorted) ss += (x - r.mean) * (x - r.mean);
    r.std = std::sqrt(ss / static_cast<double>(r.finite));
    r.min = r.sorted.front();
    r.max = r.sorted.back();
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

}  // namespace torchdbg_test
