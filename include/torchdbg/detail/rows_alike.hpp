// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// A cheap first look at whether every sample of a batch gives the same values: rows 0 and 1
// compared at a few positions, before a full pass measures the spread across the batch.

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>

namespace torchdbg::detail {

/// Whether rows 0 and 1 of `t` (its first dimension) differ by at most `tol` plus `rel` times
/// the largest magnitude among the values looked at, at up to `samples` positions spread
/// evenly over a row; a NaN/Inf at a position looked at is a difference. nullopt where it
/// cannot tell: not a host floating (strided) tensor of two dimensions or more and two rows
/// or more. Reads 2 x `samples` values; never throws.
///
/// ```cpp
/// first_rows_alike(torch::ones({8, 4}), 0.0);  // true
/// ```
inline std::optional<bool> first_rows_alike(const at::Tensor& t, double tol, double rel = 0.0,
                                            int64_t samples = 64) noexcept {
  try {
    if (!t.defined() || t.layout() != at::kStrided || t.is_meta() || !t.device().is_cpu() ||
        !t.is_floating_point() || t.dim() < 2 || t.size(0) < 2 || t.numel() == 0 || !(tol >= 0.0) ||
        !(rel >= 0.0))
      return std::nullopt;
    const int64_t inner = t.numel() / t.size(0);
    const int64_t n = std::min(samples, inner);
    const c10::IntArrayRef sizes = t.sizes(), strides = t.strides();
    const int64_t nd = t.dim(), row_stride = strides[0];
    // Rows laid out densely (a contiguous tensor, or a slice of one along another dimension,
    // `x.select(1, t)` of a [B, T, F] sequence): a position's offset in a row is its index.
    bool dense = true;
    for (int64_t d = nd - 1, expected = 1; d >= 1 && dense; --d) {
      if (sizes[d] == 1) continue;
      dense = strides[d] == expected;
      expected *= sizes[d];
    }
    const auto run = [&](const auto* base) -> std::optional<bool> {
      double gap = 0.0, largest = 0.0;
      for (int64_t k = 0; k < n; ++k) {
        int64_t rem = n == inner ? k : k * inner / n, off = dense ? rem : 0;
        for (int64_t d = nd - 1; !dense && d >= 1; --d) {
          off += (rem % sizes[d]) * strides[d];
          rem /= sizes[d];
        }
        const double a = static_cast<double>(base[off]), b = static_cast<double>(base[row_stride + off]);
        if (!(std::isfinite(a) && std::isfinite(b))) return false;
        gap = std::max(gap, std::abs(a - b));
        largest = std::max(largest, std::max(std::abs(a), std::abs(b)));
      }
      return gap <= tol + rel * largest;
    };
    switch (t.scalar_type()) {
      case at::kFloat:
        return run(t.data_ptr<float>());
      case at::kDouble:
        return run(t.data_ptr<double>());
      case at::kHalf:
        return run(t.data_ptr<at::Half>());
      case at::kBFloat16:
        return run(t.data_ptr<at::BFloat16>());
      default:
        return std::nullopt;
    }
  } catch (...) {
    return std::nullopt;
  }
}

}  // namespace torchdbg::detail
