// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// The health monitor's record of one layer: its states, what its last output and gradient
// measured, and its windows and baselines. Internal to the monitor.

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

#include "torchdbg/detail/compiled.hpp"
#include "torchdbg/health/ledger.hpp"
#include "torchdbg/health/options.hpp"
#include "torchdbg/health/records.hpp"
#include "torchdbg/health/rules.hpp"
#include "torchdbg/health/units.hpp"

namespace torchdbg::detail {

/// One layer (a module's output, an activation in it, or a module seen by its gradients only).
struct HealthLayer {
  std::string name, module;
  std::string act_kind;  // activation that produced the output, or pre-activation kind
  bool pre_activation = false;
  bool gain_checked = true;  // false for activations, elementwise ops and normalization layers
  int64_t order = 0;
  bool order_from_forward = false;
  int64_t last_step = 0;
  // activation
  bool seen_fwd = false;
  ActivationHealth act = ActivationHealth::Normal;
  Track act_track;
  int64_t act_step = 0;  // the step of the last judged output
  int64_t act_calls = 0;       // outputs judged in act_step with gradients on
  int64_t act_calls_prev = 0;  // and in the layer's step before it
  int64_t act_calls_most = 0;  // and the most in any step
  int64_t first_act_step = 0;  // the step of its first output
  double rms = kNaN, gain = kNaN, sat_frac = kNaN, dead_frac = kNaN;
  int64_t rms_call = -1;  // the call (ActivationInfo::call) `rms` was measured on
  bool alike_from_start = true;  // no output with rows 0 and 1 apart yet (zero-initialized weight)
  double nonfinite_frac = 0.0;
  double gain_base = kNaN;
  int64_t gain_n = 0;
  bool unscaled = false;  // this output's `gain` is its std (an embedding's: no input scale)
  double std_base = kNaN;  // the EMA of those healthy stds
  int64_t std_n = 0;
  double spread_gain = kNaN;       // the gain on the output's spread across the batch
  double spread_base = kNaN;       // and its baseline (updated with gain_base)
  double norm_weight_peak = kNaN;  // a normalization's highest weight RMS so far
  double norm_stats_prev = kNaN;   // its previous running statistics' error
  int64_t norm_stats_prev_step = 0;
  bool output_nonzero = false;  // an output (finite, RMS > 0) was seen
  int64_t zero_steps = 0;       // steps exactly 0 since the first call (ActivationSignals)
  int64_t zero_first = 0;        // the first of those steps
  bool gated = false;            // GradientSignals::gated
  int64_t zero_grad_since = -1;  // the first step of the current run of exactly-zero gradients
  std::optional<FailureKind> act_found;  // the finding behind the current state
  bool act_found_unscaled = false;       // ...found on an embedding's lookup (`unscaled`) call
  bool act_found_grad = false;           // ...found, or confirmed since, with gradients on
  std::optional<int64_t> act_trained;    // the last step a call with gradients on found it
  std::optional<int64_t> act_deferred;   // a step whose call without it left it to the step's end
  UnitWindow units;
  int64_t dead_since = 0;  // the step of the first output of the dead units' inactive run
  // gradient
  bool seen_bwd = false;
  GradientHealth grad = GradientHealth::Healthy;
  Track grad_track;
  bool g_touched = false;
  double g_sq = 0.0;
  int64_t g_nonfinite = 0, g_count = 0;
  int64_t bwd_arrival = 0;
  double g_norm = kNaN;
  double g_log_base = kNaN;
  int64_t g_base_n = 0;

  /// Layers not yet placed by a forward output sort after every placed one.
  static constexpr int64_t kUnordered = int64_t{1} << 40;

  /// What the ledger files its events and incidents under.
  [[nodiscard]] Subject subject() const { return {name, module, order, act_kind}; }
  /// The layer's health as the monitor reports it.
  [[nodiscard]] LayerHealth health() const;
};
#if TORCHDBG_DEFINITIONS

TORCHDBG_INLINE LayerHealth HealthLayer::health() const {
  LayerHealth h;
  h.name = name;
  h.module = module;
  h.order = order;
  h.has_activation = seen_fwd;
  h.has_gradient = seen_bwd;
  h.activation = act;
  h.gradient = grad;
  h.activation_since = act_track.since;
  h.gradient_since = grad_track.since;
  h.last_step = last_step;
  h.activation_kind = act_kind;
  h.rms = rms;
  h.gain = gain;
  h.saturated_fraction = sat_frac;
  h.dead_fraction = dead_frac;
  h.non_finite_fraction = nonfinite_frac;
  h.gradient_norm = g_norm;
  h.gradient_baseline = g_base_n > 0 ? std::pow(10.0, g_log_base) : detail::kNaN;
  return h;
}

#endif  // TORCHDBG_DEFINITIONS

}  // namespace torchdbg::detail
