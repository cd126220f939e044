// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// What a layer looks like to the health monitor: its records, windows and baselines, and what
// its observations measure (the signals the rules judge). Internal to the monitor.

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "torchdbg/detail/compiled.hpp"
#include "torchdbg/detail/pattern.hpp"
#include "torchdbg/detail/rows_alike.hpp"
#include "torchdbg/detail/stats_kernel.hpp"
#include "torchdbg/health/layer.hpp"
#include "torchdbg/health/ledger.hpp"
#include "torchdbg/health/options.hpp"
#include "torchdbg/health/records.hpp"
#include "torchdbg/health/rules.hpp"
#include "torchdbg/health/units.hpp"
#include "torchdbg/hook_context.hpp"
#include "torchdbg/tensor_stats.hpp"

namespace torchdbg::detail {

/// The health monitor's per-layer records (in first-observation order; the gradient tracker
/// sums their backward passes), the step's forward bookkeeping (forward order, the previous
/// output's scale, the first non-finite output) and the loss history. Each measure_* call
/// turns one observation into the signals the rules judge; learn_* feeds a healthy one into
/// the baselines. Not thread-safe: the monitor's lock guards it.
class HealthSignals {
 public:
  using Layer = HealthLayer;

  /// Compiles the options' layer and pre-activation patterns (throws torchdbg::Error on a bad one).
  explicit HealthSignals(const HealthOptions& options);

  bool watched(std::string_view layer) const;
  [[nodiscard]] const ActivationKinds& kinds() const noexcept { return kinds_; }
  /// The layer's record, made on its first observation; null beyond `max_layers` (counted).
  Layer* layer_rec(std::string_view name);
  [[nodiscard]] const Layer* find(std::string_view name) const;

  /// A new step: the forward bookkeeping starts again.
  void begin_step();
  /// Something non-finite came before the next outputs in this step's forward (the input).
  void mark_forward_non_finite() { fwd_nonfinite_ = true; }
  /// An output of this step's forward was found exploding.
  void mark_forward_exploding() { fwd_exploding_ = true; }
  /// Whether an output before now in this step's forward was non-finite, or exploding: the
  /// model's input seen after it (`cat({pool(emb(ids)), dense})`) carries that layer's
  /// failure, not the data's.
  [[nodiscard]] bool forward_non_finite() const noexcept { return fwd_nonfinite_; }
  [[nodiscard]] bool forward_exploding() const noexcept { return fwd_exploding_; }
  /// Whether forward outputs may go unjudged on some evaluated steps (HealthCore::sparse_forward).
  void set_sparse_forward(bool sparse) noexcept { sparse_forward_ = sparse; }
  /// Whether a module zero-initialized on purpose (ActivationSignals::zero_initialized) has
  /// produced an output in `step`: Yes or No. With forward outputs judged every few steps
  /// (HealthOptions::activation_interval, activation_budget), in a step whose outputs were not
  /// measured: Yes while `step` is within the warm-up of a
  /// module the last measured forward found zero-initialized, and Unknown before any output
  /// was measured.
  enum class ZeroInit { No, Yes, Unknown };
  [[nodiscard]] ZeroInit zero_initialized_in_step(int64_t step) const noexcept {
    if (fwd_seq_ > 0 || !sparse_forward_)
      return zero_init_in_step_ ? ZeroInit::Yes : ZeroInit::No;
    if (!measured_any_) return ZeroInit::Unknown;
    return step < zero_init_until_carried_ ? ZeroInit::Yes : ZeroInit::No;
  }

  /// Measures a forward output of `L` (its order, scale, gain, dead and saturated units,
  /// normalization internals); `new_step`: its first output in `step`.
  ActivationSignals measure_activation(Layer& L, const at::Tensor& y, const TensorStats& s,
                                       int64_t step, const ActivationInfo& info, bool& new_step);
  /// A healthy output's gain goes into the layer's baselines.
  void learn_activation(Layer& L) const;

  /// The loss's signals (before it joins the history: `learn_loss`).
  LossSignals measure_loss(int64_t step, double loss);
  void learn_loss(double loss);
  [[nodiscard]] std::optional<double> last_loss() const { return last_loss_; }
  [[nodiscard]] std::optional<double> step_loss() const { return step_loss_; }

  /// The records, in first-observation order (the gradient tracker indexes them).
  std::vector<Layer>& records() noexcept { return layers_; }
  [[nodiscard]] const std::vector<Layer>& records() const noexcept { return layers_; }
  std::size_t index_of(const Layer& L) const;
  [[nodiscard]] uint64_t ignored() const noexcept { return ignored_; }
  /// Every layer's health in forward order.
  std::vector<LayerHealth> layers() const;
  void clear();

 private:
  /// The RMS of output `name`'s call `call` in `step`, when observed and finite.
  std::optional<double> output_rms(std::string_view name, int64_t call, int64_t step) const;

  // Gains up to this (an output no wider than its input) are not measured again on the
  // output's spread across the batch (never larger): ExplodingActivationRule's limits are at
  // least 2 unless configured lower.
  static constexpr double kGainSpreadFrom = 1.0;

  static std::vector<Pattern> compile_layers(const HealthOptions& options);

  const HealthOptions& options_;
  std::vector<Pattern> layer_patterns_;
  ActivationKinds kinds_;
  std::vector<Layer> layers_;
  std::unordered_map<std::string, std::size_t> index_;
  std::size_t last_rec_ = 0;  // layer_rec's guess
  uint64_t ignored_ = 0;
  int64_t fwd_seq_ = 0;
  bool sparse_forward_ = false;
  std::optional<double> prev_rms_;
  std::optional<bool> prev_alike_;
  bool fwd_nonfinite_ = false;
  bool fwd_exploding_ = false;
  bool zero_init_in_step_ = false;
  // The step before which this step's zero-initialized modules are in their warm-up, and the
  // same of the last step with measured outputs (activation_interval above 1).
  int64_t zero_init_until_ = std::numeric_limits<int64_t>::min();
  int64_t zero_init_until_carried_ = std::numeric_limits<int64_t>::min();
  bool measured_any_ = false;  // an output has been measured
  std::vector<double> losses_;
  std::optional<double> first_loss_, last_loss_, step_loss_;
};

#if TORCHDBG_DEFINITIONS

TORCHDBG_INLINE HealthSignals::HealthSignals(const HealthOptions& options)
    : options_(options), layer_patterns_(compile_layers(options)), kinds_(options) {}

TORCHDBG_INLINE std::vector<Pattern> HealthSignals::compile_layers(const HealthOptions& options) {
  std::vector<Pattern> out;
  for (const auto& p : options.layers()) out.push_back(compile_pattern(p, "health layer pattern"));
  return out;
}

TORCHDBG_INLINE bool HealthSignals::watched(std::string_view layer) const {
  if (layer_patterns_.empty()) return true;
  const std::string s(layer);
  for (const auto& re : layer_patterns_)
    if (re.search(s)) return true;
  return false;
}

TORCHDBG_INLINE std::size_t HealthSignals::index_of(const Layer& L) const {
  return static_cast<std::size_t>(&L - layers_.data());
}

TORCHDBG_INLINE auto HealthSignals::output_rms(std::string_view name, int64_t call,
                                               int64_t step) const -> std::optional<double> {
  auto it = index_.find(std::string(name));
  if (it == index_.end()) return std::nullopt;
  const Layer& P = layers_[it->second];
  if (!P.seen_fwd || P.act_step != step || P.rms_call != call || P.nonfinite_frac > 0.0 ||
      !(P.rms > 0.0))
    return std::nullopt;
  return P.rms;
}

TORCHDBG_INLINE auto HealthSignals::layer_rec(std::string_view name) -> Layer* {
  // Deliveries come in the same order every step: the last layer (a module's next
  // parameter) or the one after it is almost always the one asked for.
  for (const std::size_t i : {last_rec_, last_rec_ + 1}) {
    if (i < layers_.size() && layers_[i].name == name) {
      last_rec_ = i;
      return &layers_[i];
    }
  }
  const std::string key(name);
  auto it = index_.find(key);
  if (it != index_.end()) {
    last_rec_ = it->second;
    return &layers_[it->second];
  }
  if (layers_.size() >= options_.max_layers()) {
    ++ignored_;
    return nullptr;
  }
  Layer L;
  L.name = key;
  L.module = key.substr(0, key.find('/'));
  L.order = HealthLayer::kUnordered + static_cast<int64_t>(layers_.size());
  index_.emplace(key, layers_.size());
  last_rec_ = layers_.size();
  layers_.push_back(std::move(L));
  return &layers_.back();
}

TORCHDBG_INLINE auto HealthSignals::find(std::string_view name) const -> const Layer* {
  auto it = index_.find(std::string(name));
  return it == index_.end() ? nullptr : &layers_[it->second];
}

TORCHDBG_INLINE void HealthSignals::begin_step() {
  if (fwd_seq_ > 0) zero_init_until_carried_ = zero_init_until_;
  zero_init_until_ = std::numeric_limits<int64_t>::min();
  fwd_seq_ = 0;
  prev_rms_.reset();
  prev_alike_.reset();
  fwd_nonfinite_ = false;
  fwd_exploding_ = false;
  zero_init_in_step_ = false;
  step_loss_.reset();
}

TORCHDBG_INLINE ActivationSignals HealthSignals::measure_activation(Layer& L, const at::Tensor& y,
                                                                    const TensorStats& s,
                                                                    int64_t step,
                                                                    const ActivationInfo& info,
                                                                    bool& new_step) {
  const std::string_view activation = info.activation, op = info.op, module_type = info.module_type;
  L.last_step = step;
  // Persistence counts steps: a module called several times in a step judges each call,
  // and its second call in the same state is no further evidence of persistence.
  new_step = !L.seen_fwd || L.act_step != step;
  L.act_step = step;
  // Forward order: the position of the layer's output within the step (the module of an
  // activation takes the position of its first output).
  const int64_t pos = fwd_seq_++;
  measured_any_ = true;
  if (!L.order_from_forward || L.order != pos) {
    L.order = pos;
    L.order_from_forward = true;
  }
  const ActivationKinds::Kind k = kinds_.kind_of(L.name, info);
  if (k.known) {
    L.act_kind = k.name;
    L.pre_activation = k.pre;
  }
  // The gain is judged on module outputs that are not normalisations.
  L.gain_checked =
      activation.empty() && op.empty() && module_type.find("Norm") == std::string_view::npos;
  // Counts prefetched for this output hold when they were made for the kind judged here.
  const bool prefetch_valid = k.known && k.name == L.act_kind && k.pre == L.pre_activation;

  // ---- the measurements
  // The input's scale: measured by attach, the output it came from (observed in this
  // step, same call), or without attach's metadata the previous output.
  std::optional<double> in_rms;
  if (info.input_rms && *info.input_rms > 0.0) {
    in_rms = info.input_rms;
  } else if (!info.input_from.empty()) {
    in_rms = output_rms(info.input_from, info.input_call, step);
  } else if (!info.call) {
    in_rms = prev_rms_;
  }
  const double numel = static_cast<double>(s.numel);
  L.nonfinite_frac = numel > 0 ? static_cast<double>(s.nan_count + s.inf_count) / numel : 0.0;
  L.rms = s.finite_count > 0 ? std::sqrt(s.mean * s.mean + s.std * s.std) : detail::kNaN;
  L.rms_call = info.call.value_or(-1);
  prev_rms_ = (s.has_non_finite() || !(L.rms > 0.0)) ? std::optional<double>()
                                                     : std::optional<double>(L.rms);
  // The same output for every sample: two rows looked at, the whole batch measured where they
  // are alike (a Linear whose weight was zeroed gives its bias for any input). A module that
  // maps each row of its input alone (a Linear or Conv: whatever the first dimension holds,
  // time steps of a sequence-first input too) whose input rows differ makes that its doing
  // (`alike_spread` reaches the rules); an input alike too (copies of an environment reset
  // together) does not. The input's rows as attach read them (`input_alike`), or without
  // attach's metadata the previous output's.
  const bool per_row = module_type.find("Linear") != std::string_view::npos ||
                       module_type.find("Conv") != std::string_view::npos;
  std::optional<bool> input_alike;
  if (info.input_alike) {
    input_alike = info.input_alike;
  } else if (!info.call) {
    input_alike = prev_alike_;
  }
  std::optional<bool> rows_alike;
  double alike_spread = detail::kNaN;
  // Needed for a Linear's or Conv's own verdict, or as the next output's input without
  // attach's metadata (no `call`); with attach, every other module's rows go unread.
  if ((per_row || !info.call) && !s.has_non_finite() && L.rms > 0.0) {
    const double tol = options_.constant_ratio() * L.rms;
    rows_alike = detail::first_rows_alike(y, tol);
    if (rows_alike && *rows_alike) {
      alike_spread = detail::batch_spread(y);
      rows_alike = alike_spread <= tol;
    }
  }
  prev_alike_ = rows_alike;
  const bool alike_own = L.gain_checked && per_row && rows_alike == true && input_alike == false;
  if (rows_alike == false) L.alike_from_start = false;
  // The gain compares the output's spread with the input's scale: a shifted bias moves the
  // mean, not the spread, and is no explosion.
  // An embedding's call (attach saw its data input: token ids, no scale) is judged on its
  // output's std against its own history, kept apart from the gains of the layer's other
  // calls (a tied output head).
  const bool unscaled = L.gain_checked && !in_rms && info.call && !info.input_rms &&
                        info.input_from.empty() && module_type.find("Embedding") != std::string_view::npos;
  L.unscaled = unscaled;
  L.gain = (L.gain_checked && in_rms && std::isfinite(s.std)) ? s.std / *in_rms
           : unscaled && std::isfinite(s.std)                 ? s.std
                                                              : detail::kNaN;
  // A NaN/Inf output is the step's origin only when nothing before it in the step (the
  // model's input included) was non-finite, and it is not an activation of values user code
  // changed in place (an action mask's -Inf: the loss shows what was not on purpose).
  const bool origin = s.has_non_finite() && !fwd_nonfinite_ && !info.input_changed;
  if (s.has_non_finite()) fwd_nonfinite_ = true;

  // Dead units (ReLU family) are tracked on every delivery to fill the window.
  if (detail::is_dead_capable(L.act_kind) && y.dim() > 0) {
    const int64_t dim = y.dim() == 1 ? 0 : options_.unit_dim();
    int64_t per_unit = 0;
    try {
      std::vector<int64_t> counts;
      const int64_t units = y.size(detail::unit_dim_of(y, dim));
      if (prefetch_valid && info.unit_counts != nullptr &&
          static_cast<int64_t>(info.unit_counts->size()) == units) {
        counts.reserve(info.unit_counts->size());
        for (double c : *info.unit_counts) counts.push_back(static_cast<int64_t>(c));
        per_unit = units == 0 ? 0 : y.numel() / units;
      } else if (info.units_above_zero != nullptr &&
                 static_cast<int64_t>(info.units_above_zero->size()) == units) {
        counts = *info.units_above_zero;
        per_unit = units == 0 ? 0 : y.numel() / units;
      } else {
        counts = detail::count_above_per_unit(y, dim, 0.0, per_unit);
      }
      L.units.push(std::move(counts), per_unit, step,
                   static_cast<std::size_t>(options_.dead_window()), options_.dead_activity());
    } catch (const Error&) {
      // the unit dimension does not exist for this output: no dead-unit judgement
    }
    L.dead_frac = L.units.dead_fraction(options_.dead_window_samples(), options_.dead_activity(),
                                        &L.dead_since);
  }
  if (!s.has_non_finite() && ActivationKinds::saturating(L.act_kind, L.pre_activation)) {
    L.sat_frac = kinds_.saturated_fraction(
        L.act_kind, L.pre_activation, y, s,
        prefetch_valid && info.saturated_count != nullptr && info.saturated_count->size() == 1
            ? std::optional<double>((*info.saturated_count)[0])
            : std::nullopt);
  }
  const bool base_ready = L.gain_n >= options_.baseline_warmup() && std::isfinite(L.gain_base);
  // Nor do the bias's differences between units (an output of small inputs is mostly its
  // bias), or an output the same for every sample: the gain is also measured on the output's
  // spread across the batch, with its own baseline. That spread is never above the whole
  // std, so the extra pass runs only where a gain limit could be crossed; below, the whole
  // std's gain stands for it (an upper bound) in its baseline.
  L.spread_gain = detail::kNaN;
  double batch_spread = detail::kNaN;
  if (in_rms && L.gain > std::min(kGainSpreadFrom, options_.activation_gain()) && !s.has_non_finite()) {
    batch_spread = detail::batch_spread(y);
    L.spread_gain = batch_spread / *in_rms;
    // One sample: what varies besides the module's own bias (measured by attach).
    if (!std::isfinite(batch_spread) && y.dim() >= 2 && y.size(0) == 1 && info.std_less_bias &&
        std::isfinite(*info.std_less_bias))
      L.spread_gain = *info.std_less_bias / *in_rms;
  }
  // A normalization's output the same for every sample (its weight collapsed to 0) is
  // constant to the user: measured across the whole batch only where the first two samples'
  // outputs are alike (two rows read otherwise; CPU outputs, no device sync). Other modules
  // may be meant to give every sample the same output (a position embedding of expanded
  // ids): their spread across the batch judges only their gain.
  const bool normalization = module_type.find("Norm") != std::string_view::npos;
  if (normalization && !std::isfinite(batch_spread) && y.device().is_cpu() && !s.has_non_finite() &&
      y.dim() >= 2 && y.size(0) >= 2 && std::isfinite(L.rms)) {
    const double first_two = detail::batch_spread(y.narrow(0, 0, 2));
    if (first_two <= options_.constant_ratio() * L.rms) batch_spread = detail::batch_spread(y);
  }
  const bool spread_ready = base_ready && std::isfinite(L.spread_base);

  // ---- the rules
  ActivationSignals sig(y, s);
  sig.layer = L.name;
  sig.module = L.module;
  sig.step = step;
  sig.kind = L.act_kind;
  sig.pre_activation = L.pre_activation;
  sig.module_output = L.gain_checked;
  sig.rms = L.rms;
  sig.gain = L.gain;
  sig.gain_baseline = base_ready ? L.gain_base : detail::kNaN;
  sig.unscaled_gain = L.unscaled;
  if (L.unscaled)
    sig.gain_baseline = L.std_n >= options_.baseline_warmup() && std::isfinite(L.std_base) ? L.std_base : detail::kNaN;
  sig.gain_spread = L.spread_gain;
  sig.batch_spread = normalization                                                ? batch_spread
                     : alike_own ? alike_spread
                                 : detail::kNaN;
  sig.gain_spread_baseline = spread_ready ? L.spread_base : detail::kNaN;
  sig.dead_fraction = detail::is_dead_capable(L.act_kind) ? L.dead_frac : detail::kNaN;
  sig.dead_since = std::min(step, L.dead_since);
  sig.dead_activity = options_.dead_activity();
  sig.saturated_fraction =
      ActivationKinds::saturating(L.act_kind, L.pre_activation) && !s.has_non_finite()
          ? L.sat_frac
          : detail::kNaN;
  sig.origin = origin;
  if (info.norm_stats_error) {
    sig.norm_stats_error = *info.norm_stats_error;
    sig.norm_samples = info.norm_samples;
    sig.norm_momentum = info.norm_momentum;
    sig.norm_stats_previous = L.norm_stats_prev;
    sig.norm_stats_previous_step = L.norm_stats_prev_step;
    L.norm_stats_prev = *info.norm_stats_error;
    L.norm_stats_prev_step = step;
  }
  if (info.norm_weight_rms && std::isfinite(*info.norm_weight_rms)) {
    L.norm_weight_peak = std::isfinite(L.norm_weight_peak)
                             ? std::max(L.norm_weight_peak, *info.norm_weight_rms)
                             : *info.norm_weight_rms;
    sig.norm_weight_rms = *info.norm_weight_rms;
    sig.norm_weight_peak = L.norm_weight_peak;
  }
  // Zero-initialized on purpose: exactly 0 since the first call (the output, or a
  // normalization's weight whose bias alone comes out; or a Linear's or Conv's output the same
  // for every sample since then, its weight 0 and its bias not: an output head that starts at
  // the prior), for the first `baseline_warmup` steps; an output that is 0 because its input is
  // (nothing reaches it) is not, nor a ReLU-family activation's all-zero output of a nonzero
  // input (dead units: no weights of its own).
  sig.input_zero = info.input_rms && *info.input_rms == 0.0;
  const bool dead_capable_output = !L.pre_activation && detail::is_dead_capable(L.act_kind);
  // A head in that warm-up whose input rows are alike this time (an identical batch) cannot
  // show whether its weight moved: it stays in the warm-up, which does not advance.
  const bool undecided = L.zero_steps > 0 && per_row && L.gain_checked && L.alike_from_start &&
                         rows_alike == true && input_alike == true;
  const bool zero = ((L.rms == 0.0 && !L.output_nonzero) || sig.norm_weight_peak == 0.0 ||
                     (alike_own && L.alike_from_start) || undecided) &&
                    !sig.input_zero && !dead_capable_output;
  if (L.rms > 0.0) L.output_nonzero = true;
  if (!zero) {
    L.zero_steps = 0;
  } else if (new_step && !undecided) {
    if (L.zero_steps == 0) {
      L.zero_first = step;
      L.zero_steps = 1;
    } else if (sparse_forward_) {
      // Outputs judged every few steps: the warm-up counts steps, not judged outputs.
      L.zero_steps = std::max(L.zero_steps + 1, step - L.zero_first + 1);
    } else {
      ++L.zero_steps;
    }
  }
  sig.zero_steps = L.zero_steps;
  sig.zero_since = L.zero_first;
  sig.zero_initialized = zero && L.zero_steps <= options_.baseline_warmup();
  if (sig.zero_initialized) {
    zero_init_in_step_ = true;
    // Its warm-up ends baseline_warmup steps after its first zero output (as far as the
    // steps seen tell).
    const int64_t left = options_.baseline_warmup() - L.zero_steps;
    zero_init_until_ = std::max(zero_init_until_, step + left + 1);
  }
  return sig;
}

TORCHDBG_INLINE void HealthSignals::learn_activation(Layer& L) const {
  if (!std::isfinite(L.gain)) return;
  const double m = options_.baseline_momentum();
  if (L.unscaled) {
    L.std_base = std::isfinite(L.std_base) ? m * L.std_base + (1.0 - m) * L.gain : L.gain;
    ++L.std_n;
    return;
  }
  L.gain_base = std::isfinite(L.gain_base) ? m * L.gain_base + (1.0 - m) * L.gain : L.gain;
  ++L.gain_n;
  const double g = std::isfinite(L.spread_gain) ? L.spread_gain : L.gain;
  L.spread_base = std::isfinite(L.spread_base) ? m * L.spread_base + (1.0 - m) * g : g;
}

TORCHDBG_INLINE LossSignals HealthSignals::measure_loss(int64_t step, double loss) {
  last_loss_ = loss;
  step_loss_ = loss;
  if (std::isfinite(loss) && !first_loss_) first_loss_ = std::fabs(loss);
  LossSignals sig(loss, losses_);
  sig.step = step;
  sig.first_loss = first_loss_.value_or(kNaN);
  return sig;
}

TORCHDBG_INLINE void HealthSignals::learn_loss(double loss) {
  if (!std::isfinite(loss)) return;
  losses_.push_back(loss);
  const std::size_t keep =
      static_cast<std::size_t>(std::max({options_.loss_window(), options_.plateau_window(),
                                         options_.loss_growth_window(), int64_t{12}}));
  if (losses_.size() > 2 * keep)
    losses_.erase(losses_.begin(), losses_.end() - static_cast<std::ptrdiff_t>(keep));
}

TORCHDBG_INLINE auto HealthSignals::layers() const -> std::vector<LayerHealth> {
  std::vector<LayerHealth> out;
  out.reserve(layers_.size());
  for (const auto& L : layers_) out.push_back(L.health());
  std::stable_sort(out.begin(), out.end(),
                   [](const LayerHealth& a, const LayerHealth& b) { return a.order < b.order; });
  return out;
}

TORCHDBG_INLINE void HealthSignals::clear() {
  layers_.clear();
  index_.clear();
  last_rec_ = 0;
  ignored_ = 0;
  fwd_seq_ = 0;
  prev_rms_.reset();
  prev_alike_.reset();
  fwd_nonfinite_ = false;
  fwd_exploding_ = false;
  zero_init_in_step_ = false;
  zero_init_until_ = zero_init_until_carried_ = std::numeric_limits<int64_t>::min();
  measured_any_ = false;
  losses_.clear();
  last_loss_.reset();
  first_loss_.reset();
}

#endif  // TORCHDBG_DEFINITIONS

}  // namespace torchdbg::detail
