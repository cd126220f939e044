// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// The health monitor's backward-pass bookkeeping: each module's gradient norm summed over its
// parameters as they arrive, and the signals of a finished pass (amplification between
// neighbours, baselines). Internal to the monitor.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "torchdbg/detail/compiled.hpp"
#include "torchdbg/health/layer.hpp"
#include "torchdbg/health/options.hpp"
#include "torchdbg/health/rules.hpp"
#include "torchdbg/tensor_stats.hpp"

namespace torchdbg::detail {

/// The modules a backward pass reached, in arrival order, until the pass is judged. Not
/// thread-safe: the monitor's lock guards it.
class GradientTracker {
 public:
  /// The modules of one backward pass in forward order, with what their signals share.
  struct GradientPass {
    int64_t step = 0;
    std::vector<std::size_t> mods;
    double max_norm = 0.0;
    std::optional<std::size_t> nf_origin;  // the first non-finite gradient in backward order
    bool zero_initialized_in_step = false;  // HealthSignals::zero_initialized_in_step: Yes
    bool forward_unknown = false;           // ... Unknown: no output measured yet
  };
  /// One module's gradient signals and the context its event and incident carry.
  struct GradientMeasure {
    GradientSignals sig;
    double amplification = kNaN, usual_amplification = kNaN;
    bool base_ready = false;
  };

  explicit GradientTracker(const HealthOptions& options) : options_(options) {}

  /// A gradient of one of `L`'s parameters (`index`: its place among the records), summed
  /// into the module's norm.
  void add(HealthLayer& L, std::size_t index, const TensorStats& s);
  [[nodiscard]] bool pending() const noexcept { return grads_pending_; }
  /// Forgets the gradients received since the last pass was judged.
  void abandon(std::vector<HealthLayer>& layers);
  /// The pass's modules in forward order, taken out of the pending set.
  GradientPass begin(std::vector<HealthLayer>& layers, int64_t step);
  /// The signals of `pass.mods[k]` (after the upstream modules' baselines learned).
  GradientMeasure measure(std::vector<HealthLayer>& layers, const GradientPass& pass,
                          std::size_t k);
  /// A healthy norm goes into the module's baseline.
  void learn(HealthLayer& L) const;
  /// A new step: arrivals count from 0 again.
  void begin_step() noexcept { bwd_arrivals_ = 0; }
  void clear() noexcept {
    touched_.clear();
    grads_pending_ = false;
  }

 private:
  const HealthOptions& options_;
  int64_t bwd_arrivals_ = 0;
  bool grads_pending_ = false;
  std::vector<std::size_t> touched_;
};

#if TORCHDBG_DEFINITIONS

TORCHDBG_INLINE void GradientTracker::add(HealthLayer& L, std::size_t index, const TensorStats& s) {
  if (!L.g_touched) {
    L.g_touched = true;
    L.g_sq = 0.0;
    L.g_nonfinite = 0;
    L.g_count = 0;
    L.bwd_arrival = bwd_arrivals_++;
    touched_.push_back(index);
  }
  L.g_sq += s.l2_norm * s.l2_norm;
  L.g_nonfinite += s.nan_count + s.inf_count;
  L.g_count += s.numel;
  grads_pending_ = true;
}

TORCHDBG_INLINE void GradientTracker::abandon(std::vector<HealthLayer>& layers) {
  for (const auto i : touched_) {
    HealthLayer& L = layers[i];
    L.g_touched = false;
    L.g_sq = 0.0;
    L.g_nonfinite = 0;
    L.g_count = 0;
  }
  touched_.clear();
  grads_pending_ = false;
}

TORCHDBG_INLINE auto GradientTracker::begin(std::vector<HealthLayer>& layers, int64_t step)
    -> GradientPass {
  GradientPass pass;
  pass.step = step;
  grads_pending_ = false;
  pass.mods = std::move(touched_);
  touched_.clear();
  for (auto i : pass.mods) {
    HealthLayer& L = layers[i];
    L.g_norm = std::sqrt(L.g_sq);
    if (!L.order_from_forward)
      L.order = HealthLayer::kUnordered - L.bwd_arrival;  // backward runs output -> input
    if (L.g_nonfinite == 0 && std::isfinite(L.g_norm))
      pass.max_norm = std::max(pass.max_norm, L.g_norm);
  }
  std::sort(pass.mods.begin(), pass.mods.end(),
            [&](std::size_t a, std::size_t b) { return layers[a].order < layers[b].order; });
  // The first non-finite gradient in backward order (arrival order) is the backward origin.
  for (auto i : pass.mods) {
    const HealthLayer& L = layers[i];
    if (L.g_nonfinite > 0 &&
        (!pass.nf_origin || L.bwd_arrival < layers[*pass.nf_origin].bwd_arrival))
      pass.nf_origin = i;
  }
  return pass;
}

TORCHDBG_INLINE auto GradientTracker::measure(std::vector<HealthLayer>& layers,
                                              const GradientPass& pass, std::size_t k)
    -> GradientMeasure {
  HealthLayer& L = layers[pass.mods[k]];
  L.g_touched = false;
  L.last_step = std::max(L.last_step, pass.step);
  GradientMeasure g;
  // Adjacent ratio: upstream neighbour's norm over this layer's. Large where this layer
  // amplifies the backward signal (an explosion starts here).
  g.base_ready = L.g_base_n >= options_.baseline_warmup() && std::isfinite(L.g_log_base);
  const double base = g.base_ready ? std::pow(10.0, L.g_log_base) : kNaN;
  if (k > 0 && L.g_norm > 0.0 && std::isfinite(layers[pass.mods[k - 1]].g_norm)) {
    const HealthLayer& up = layers[pass.mods[k - 1]];
    g.amplification = up.g_norm / L.g_norm;
    // The same ratio over its usual value (from both baselines): a uniformly scaled
    // backward pass amplifies nothing more than usual anywhere.
    if (g.base_ready && up.g_base_n >= options_.baseline_warmup() && std::isfinite(up.g_log_base))
      g.usual_amplification = g.amplification / std::pow(10.0, up.g_log_base - L.g_log_base);
  }
  g.sig.layer = L.name;
  g.sig.step = pass.step;
  g.sig.norm = L.g_norm;
  g.sig.non_finite = L.g_nonfinite;
  g.sig.count = L.g_count;
  g.sig.max_norm = pass.max_norm;
  g.sig.baseline = base;
  g.sig.recent = L.g_base_n > 0 && std::isfinite(L.g_log_base) ? std::pow(10.0, L.g_log_base) : kNaN;
  g.sig.origin = pass.nf_origin && *pass.nf_origin == pass.mods[k];
  // An exactly-zero gradient while a module zero-initialized on purpose is still at 0 is that
  // module's doing: the layer is behind a gate, and its gradient grows with the gate's weights.
  if (L.g_norm == 0.0 && L.g_nonfinite == 0) {
    if (L.zero_grad_since < 0) L.zero_grad_since = pass.step;
    if (pass.zero_initialized_in_step) L.gated = true;
  } else {
    L.zero_grad_since = -1;
  }
  // Unknown (outputs judged every few steps, none yet): an exactly-zero gradient is not judged,
  // and is no evidence of a gate.
  g.sig.zero_initialized_in_step = pass.zero_initialized_in_step || pass.forward_unknown;
  g.sig.gated = L.gated;
  g.sig.zero_since = L.zero_grad_since;
  return g;
}

TORCHDBG_INLINE void GradientTracker::learn(HealthLayer& L) const {
  if (!std::isfinite(L.g_norm) || !(L.g_norm > 0.0)) return;
  const double lg = std::log10(L.g_norm);
  const double m = options_.baseline_momentum();
  L.g_log_base = std::isfinite(L.g_log_base) ? m * L.g_log_base + (1.0 - m) * lg : lg;
  ++L.g_base_n;
}

#endif  // TORCHDBG_DEFINITIONS

}  // namespace torchdbg::detail
