// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// How far a BatchNorm's running statistics (what eval mode normalizes with) are from the
// statistics of the batch it normalizes in training.

#include <ATen/ATen.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace torchdbg::detail {

/// A BatchNorm call in training, taken when its `aten::batch_norm` operator starts: the
/// running statistics before the call updates them in place.
struct NormCapture {
  at::Tensor input;                      // the batch
  at::Tensor running_mean, running_var;  // the module's buffers, updated in place by the call
  at::Tensor mean_before, var_before;    // float64 copies taken before the update
  double momentum = 0.0;                 // the factor the call updates them with
  double eps = 0.0;
  int64_t samples = 0;  // the batch's samples (dim 0)
  int64_t count = 0;    // elements per channel
  /// The weight the initial statistics (mean 0, variance 1) still have in the running ones,
  /// (1 - m)^(k - 1) for a constant momentum m; NaN where it is not known (a momentum of 0).
  double init_weight = 0.0;
};

/// The error of a BatchNorm's running statistics against one batch's.
struct NormError {
  /// The RMS over channels of how far an eval-mode output of the batch is from its
  /// training-mode output, in units of the normalized output: per channel, the eval output is
  /// a x_hat + b with a = sqrt((var_batch + eps) / (running_var + eps)) and
  /// b = (mean_batch - running_mean) / sqrt(running_var + eps), so over a standardized x_hat
  /// its error's RMS is sqrt((a - 1)^2 + b^2).
  double error = 0.0;
  int64_t samples = 0;  ///< the batch's samples
};

/// Calls after which a BatchNorm with momentum 0 is judged: the warm-up of the default 0.1.
inline constexpr double kNormZeroMomentumWarmup = 44.0;

/// How much the initial statistics may still move the error for it to be judged.
inline constexpr double kNormWarmupError = 0.1;

/// A BatchNorm's previous training call (its num_batches_tracked and momentum): a cumulative
/// average (momentum None) updates by 1/k at its k-th call, which one call cannot tell from
/// a constant momentum that happens to equal 1/k. Races between concurrent forwards of one
/// module only delay the warm-up.
struct NormHistory {
  std::atomic<int64_t> batches{-1};
  std::atomic<double> momentum{0.0};
};

/// The capture of `aten::batch_norm(input, weight, bias, running_mean, running_var, training,
/// momentum, eps, cudnn_enabled)` when it normalizes a floating CPU batch of at least two
/// samples with the batch's statistics and keeps running ones whose initial values weigh less
/// than 1% (`batches_tracked`: the module's num_batches_tracked, counting this call; -1 when
/// it has none). nullopt otherwise: eval mode, no running statistics, a device batch (its
/// statistics would need a sync), a warm-up.
inline std::optional<NormCapture> capture_batch_norm(at::ArrayRef<const c10::IValue> in,
                                                     int64_t batches_tracked,
                                                     NormHistory& history) {
  if (in.size() < 8 || !in[0].isTensor() || !in[3].isTensor() || !in[4].isTensor() ||
      !in[5].isBool() || !in[6].isDouble() || !in[7].isDouble() || !in[5].toBool())
    return std::nullopt;
  NormCapture c;
  c.input = in[0].toTensor();
  c.running_mean = in[3].toTensor();
  c.running_var = in[4].toTensor();
  c.momentum = in[6].toDouble();
  c.eps = in[7].toDouble();
  const at::Tensor& x = c.input;
  if (!x.defined() || !c.running_mean.defined() || !c.running_var.defined() || !x.is_cpu() ||
      !c.running_mean.is_cpu() || !x.is_floating_point() || x.dim() < 2 || x.size(0) < 2 ||
      c.running_mean.numel() != x.size(1) || c.running_var.numel() != x.size(1) || x.size(1) == 0 ||
      !(c.momentum >= 0.0 && c.momentum <= 1.0) || !(c.eps >= 0.0))
    return std::nullopt;
  // The running statistics start at 0 and 1: after k updates by m their weight is (1-m)^k. A
  // cumulative average (momentum None: 1/k at the k-th call, and 1/(k-1) at the call before)
  // replaces them at its first update; a momentum of 0 never does, and is judged after as
  // many calls as the default 0.1 needs (44).
  if (batches_tracked >= 0) {
    const auto k = static_cast<double>(batches_tracked);  // counts this call
    const double m = c.momentum;
    const int64_t prev_k = history.batches.exchange(batches_tracked, std::memory_order_relaxed);
    const double prev_m = history.momentum.exchange(m, std::memory_order_relaxed);
    const auto is_inverse = [](double v, double n) {
      return n >= 1.0 && std::abs(v - 1.0 / n) <= 1e-9 / n;
    };
    const bool cumulative =
        is_inverse(m, k) && prev_k == batches_tracked - 1 && is_inverse(prev_m, k - 1.0);
    bool warm = false;
    if (cumulative || m >= 1.0) {
      warm = k >= 2.0;
    } else if (m > 0.0) {
      c.init_weight = std::exp((k - 1.0) * std::log1p(-m));
      warm = c.init_weight < 0.01;
    } else {
      c.init_weight = std::nan("");
      warm = k - 1.0 >= kNormZeroMomentumWarmup;
    }
    if (!warm) return std::nullopt;
  }
  c.samples = x.size(0);
  c.count = x.numel() / x.size(1);
  try {
    at::NoGradGuard no_grad;
    c.mean_before = c.running_mean.detach().to(at::kDouble, /*non_blocking=*/false, /*copy=*/true);
    c.var_before = c.running_var.detach().to(at::kDouble, /*non_blocking=*/false, /*copy=*/true);
  } catch (...) {
    return std::nullopt;  // out of memory: not measured, the operator runs on
  }
  return c;
}

/// The running statistics' error once the captured call ended. The batch's mean and unbiased
/// variance come from the update itself (new = (1 - m) old + m batch) where the momentum is
/// at least 1e-3, else from the batch. nullopt when a value is not finite, or while the
/// initial statistics still move the error by 0.1 or more (data whose variance is far from
/// 1 takes longer than 1% of weight to forget it); never throws.
inline std::optional<NormError> batch_norm_error(const NormCapture& c) noexcept try {
  at::NoGradGuard no_grad;
  const auto n = static_cast<double>(c.count);
  at::Tensor mean_b, var_b;  // the batch's mean and biased variance, per channel
  if (c.momentum >= 1e-3) {
    const double m = c.momentum;
    mean_b = (c.running_mean.detach().to(at::kDouble) - (1.0 - m) * c.mean_before) / m;
    const at::Tensor unbiased =
        (c.running_var.detach().to(at::kDouble) - (1.0 - m) * c.var_before) / m;
    var_b = n > 1.0 ? unbiased * ((n - 1.0) / n) : unbiased;
  } else {
    std::vector<int64_t> dims;
    std::vector<int64_t> shape(static_cast<std::size_t>(c.input.dim()), 1);  // [1, C, 1, ...]
    shape[1] = -1;
    for (int64_t d = 0; d < c.input.dim(); ++d)
      if (d != 1) dims.push_back(d);
    const at::Tensor x = c.input.detach().to(at::kDouble);
    mean_b = x.mean(dims);
    var_b = (x - mean_b.view(shape)).pow(2).mean(dims);
  }
  const at::Tensor batch_var = var_b.clamp_min(0.0);
  const auto error_of = [&](const at::Tensor& mean, const at::Tensor& var) {
    const at::Tensor denom = (var + c.eps).sqrt();
    const at::Tensor a = (batch_var + c.eps).sqrt() / denom;
    const at::Tensor b = (mean_b - mean) / denom;
    return ((a - 1.0).pow(2) + b.pow(2)).mean().sqrt().item<double>();
  };
  const double e = error_of(c.mean_before, c.var_before);
  if (!std::isfinite(e)) return std::nullopt;
  if (c.init_weight > 0.0) {  // the running statistics with their initial part taken out
    const double w = c.init_weight;
    const double unstarted =
        error_of(c.mean_before / (1.0 - w), ((c.var_before - w) / (1.0 - w)).clamp_min(0.0));
    if (!(std::abs(e - unstarted) < kNormWarmupError)) return std::nullopt;
  }
  return NormError{e, c.samples};
} catch (...) {
  return std::nullopt;
}

}  // namespace torchdbg::detail
