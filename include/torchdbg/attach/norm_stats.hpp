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
#include <limits>
#include <optional>
#include <vector>

namespace torchdbg::detail {

/// A BatchNorm call in training, taken when its `aten::batch_norm` operator starts: the
/// running statistics before the call updates them in place.
struct NormCapture {
  at::Tensor input;                      // the batch
  at::Tensor running_mean, running_var;  // the module's buffers, updated in place by the call
  std::vector<double> mean_before, var_before;  // copies taken before the update
  double momentum = 0.0;                        // the factor the call updates them with
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
  int64_t samples = 0;    ///< the batch's samples
  double momentum = 0.0;  ///< the update's momentum (the running statistics' own scatter)
};

/// Calls after which a BatchNorm with momentum 0 is judged: the warm-up of the default 0.1.
inline constexpr double kNormZeroMomentumWarmup = 44.0;

/// A host tensor's values as doubles (a BatchNorm's C running statistics).
inline std::vector<double> norm_doubles(const at::Tensor& t) {
  std::vector<double> out(static_cast<std::size_t>(t.numel()));
  const auto copy = [&](const auto* p) {
    for (std::size_t i = 0; i < out.size(); ++i) out[i] = static_cast<double>(p[i]);
  };
  if (t.is_contiguous() && t.scalar_type() == at::kFloat) {
    copy(t.data_ptr<float>());
  } else if (t.is_contiguous() && t.scalar_type() == at::kDouble) {
    copy(t.data_ptr<double>());
  } else {
    at::NoGradGuard no_grad;
    const at::Tensor d = t.detach().to(at::kDouble).contiguous();
    copy(d.data_ptr<double>());
  }
  return out;
}

/// Whether the batch's moments can be read back from the running statistics' update: buffers
/// of float32 or float64 whose rounding, divided by the momentum, stays under 1e-4 of each
/// channel's scale (a large mean, a small momentum and bfloat16 buffers need the batch).
inline bool derivable(const NormCapture& c) {
  const auto type = c.running_mean.scalar_type();
  if (c.momentum < 1e-3 || type != c.running_var.scalar_type() ||
      (type != at::kFloat && type != at::kDouble))
    return false;
  const double u = type == at::kFloat ? 6e-8 : 1.2e-16;
  for (std::size_t i = 0; i < c.mean_before.size(); ++i) {
    const double scale = std::sqrt(c.var_before[i] + c.eps);
    if (!(u * (std::abs(c.mean_before[i]) + scale) / c.momentum < 1e-4 * scale)) return false;
    if (!(u * c.var_before[i] / c.momentum < 1e-4 * (c.var_before[i] + c.eps))) return false;
  }
  return true;
}

/// How much worse the initial statistics may still make the error for it to be judged.
inline constexpr double kNormWarmupError = 0.1;

/// A BatchNorm's previous training call (its num_batches_tracked and momentum): a cumulative
/// average (momentum None) updates by 1/k at its k-th call, which one call cannot tell from
/// a constant momentum that happens to equal 1/k. Races between concurrent forwards of one
/// module only delay the warm-up.
struct NormHistory {
  std::atomic<int64_t> batches{-1};
  std::atomic<double> momentum{0.0};
  /// The initial statistics' weight before that call's update (NaN: not known).
  std::atomic<double> init_weight{std::nan("")};
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
  // The running statistics start at 0 and 1, and each update by m keeps (1-m) of their
  // weight. It is followed from call to call (a momentum lowered mid-training, or set to 0,
  // keeps what the earlier ones took off); at the first call seen, k - 1 updates by this
  // momentum are assumed. A cumulative average (momentum None: 1/k at the k-th call, 1/(k-1)
  // at the call before) replaces them at its first update; a momentum of 0 with nothing
  // known is judged after as many calls as the default 0.1 needs (44).
  if (batches_tracked >= 0) {
    const auto k = static_cast<double>(batches_tracked);  // counts this call
    const double m = c.momentum;
    const int64_t prev_k = history.batches.exchange(batches_tracked, std::memory_order_relaxed);
    const double prev_m = history.momentum.exchange(m, std::memory_order_relaxed);
    const double prev_w = history.init_weight.load(std::memory_order_relaxed);
    const auto is_inverse = [](double v, double n) {
      return n >= 1.0 && std::abs(v - 1.0 / n) <= 1e-9 / n;
    };
    const bool followed = prev_k >= 0 && prev_k < batches_tracked && std::isfinite(prev_w);
    double w = std::nan("");
    if (is_inverse(m, k) && prev_k == batches_tracked - 1 && is_inverse(prev_m, k - 1.0)) {
      w = 0.0;  // cumulative
    } else if (m >= 1.0) {
      w = k >= 2.0 ? 0.0 : 1.0;
    } else if (followed) {
      w = prev_w * (1.0 - prev_m) *
          std::exp(static_cast<double>(batches_tracked - prev_k - 1) * std::log1p(-m));
    } else if (m > 0.0) {
      w = std::exp((k - 1.0) * std::log1p(-m));
    }
    history.init_weight.store(w, std::memory_order_relaxed);
    c.init_weight = w;
    const bool warm = std::isfinite(w) ? w < 0.01 : k - 1.0 >= kNormZeroMomentumWarmup;
    if (!warm) return std::nullopt;
  }
  c.samples = x.size(0);
  c.count = x.numel() / x.size(1);
  try {
    c.mean_before = norm_doubles(c.running_mean);
    c.var_before = norm_doubles(c.running_var);
  } catch (...) {
    return std::nullopt;  // out of memory: not measured, the operator runs on
  }
  return c;
}

/// The running statistics' error once the captured call ended. The batch's mean and unbiased
/// variance come from the update itself (new = (1 - m) old + m batch) where the momentum is
/// at least 1e-3, else from the batch. nullopt when a value is not finite, or while the
/// initial statistics still make the error 0.1 or more worse (data whose variance is far from
/// 1 takes longer than 1% of weight to forget it); never throws.
inline std::optional<NormError> batch_norm_error(const NormCapture& c) noexcept try {
  const std::size_t channels = c.mean_before.size();
  const auto n = static_cast<double>(c.count);
  std::vector<double> mean_b, var_b;          // the batch's mean and biased variance, per channel
  for (std::size_t i = 0; i < channels; ++i)  // running statistics a NaN batch poisoned
    if (!std::isfinite(c.mean_before[i]) || !std::isfinite(c.var_before[i]))
      return NormError{std::numeric_limits<double>::infinity(), c.samples, c.momentum};
  if (derivable(c)) {
    const double m = c.momentum;
    mean_b = norm_doubles(c.running_mean);
    var_b = norm_doubles(c.running_var);
    if (mean_b.size() != channels || var_b.size() != channels) return std::nullopt;
    for (std::size_t i = 0; i < channels; ++i) {
      mean_b[i] = (mean_b[i] - (1.0 - m) * c.mean_before[i]) / m;
      const double unbiased = (var_b[i] - (1.0 - m) * c.var_before[i]) / m;
      var_b[i] = n > 1.0 ? unbiased * ((n - 1.0) / n) : unbiased;
    }
  } else {
    at::NoGradGuard no_grad;
    std::vector<int64_t> dims;
    std::vector<int64_t> shape(static_cast<std::size_t>(c.input.dim()), 1);  // [1, C, 1, ...]
    shape[1] = -1;
    for (int64_t d = 0; d < c.input.dim(); ++d)
      if (d != 1) dims.push_back(d);
    const at::Tensor x = c.input.detach().to(at::kDouble);
    const at::Tensor mean = x.mean(dims);
    mean_b = norm_doubles(mean);
    var_b = norm_doubles((x - mean.view(shape)).pow(2).mean(dims));
  }
  const auto error_of = [&](double init_weight) {
    double total = 0.0;
    for (std::size_t i = 0; i < channels; ++i) {
      // with the initial statistics' part taken out of the running ones when init_weight > 0
      const double keep = 1.0 - init_weight;
      const double rm = c.mean_before[i] / keep;
      const double rv = std::max(0.0, (c.var_before[i] - init_weight) / keep);
      const double denom = std::sqrt(rv + c.eps);
      const double a = std::sqrt(std::max(0.0, var_b[i]) + c.eps) / denom;
      const double b = (mean_b[i] - rm) / denom;
      total += (a - 1.0) * (a - 1.0) + b * b;
    }
    return std::sqrt(total / static_cast<double>(channels));
  };
  const double e = error_of(0.0);
  if (!std::isfinite(e)) return std::nullopt;
  // While the initial statistics make it look 0.1 or more worse than the data's own would
  // (inputs whose variance is far from 1 forget them later than 1% of weight).
  if (c.init_weight > 0.0 && e - error_of(c.init_weight) >= kNormWarmupError) return std::nullopt;
  return NormError{e, c.samples, c.momentum};
} catch (...) {
  return std::nullopt;
}

}  // namespace torchdbg::detail
