// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// What attach measured about one forward delivery, as numbers: the health monitor reads them
// as they are, and the metadata entries they stand for ("input_rms", ...) are written only
// when a hook reads the metadata.

#include <cstdint>
#include <map>
#include <optional>
#include <string>

#include "torchdbg/detail/text.hpp"

namespace torchdbg::detail {

/// A forward delivery's measured metadata (docs/attach.md lists the keys). Each value is set
/// once: the first measurement of a delivery stands, as `Metadata::emplace` would keep it.
struct DeliveryFacts {
  std::optional<double> input_rms, input_data_rms, std_less_bias, norm_stats_error, norm_weight_rms,
      norm_momentum;
  std::optional<int64_t> input_nan, input_inf, input_count, norm_samples;
  std::optional<bool> input_alike;

  [[nodiscard]] bool empty() const noexcept {
    return !input_rms && !input_data_rms && !std_less_bias && !norm_stats_error && !norm_weight_rms &&
           !norm_momentum && !input_nan && !input_inf && !input_count && !norm_samples && !input_alike;
  }

  template <typename T>
  static void set(std::optional<T>& slot, T v) {
    if (!slot) slot = v;
  }

  /// Adds the entries to `md` as text (numbers in their shortest exact form), leaving keys
  /// `md` already has.
  template <typename Map>
  void add_to(Map& md) const {
    const auto real = [&](const char* key, const std::optional<double>& v) {
      if (v) md.emplace(key, number_text(*v));
    };
    const auto integer = [&](const char* key, const std::optional<int64_t>& v) {
      if (v) md.emplace(key, std::to_string(*v));
    };
    integer("input_nan", input_nan);
    integer("input_inf", input_inf);
    integer("input_count", input_count);
    real("input_data_rms", input_data_rms);
    real("input_rms", input_rms);
    if (input_alike) md.emplace("input_alike", *input_alike ? "1" : "0");
    real("std_less_bias", std_less_bias);
    real("norm_stats_error", norm_stats_error);
    integer("norm_samples", norm_samples);
    real("norm_momentum", norm_momentum);
    real("norm_weight_rms", norm_weight_rms);
  }
};

}  // namespace torchdbg::detail
