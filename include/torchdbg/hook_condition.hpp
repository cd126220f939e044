// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "torchdbg/error.hpp"
#include "torchdbg/hook_context.hpp"

namespace torchdbg {

/// How a reported value is compared with a threshold.
enum class Comparison { Greater, Less, Equal, GreaterEqual, LessEqual };

/// The operator's spelling: ">", "<", "==", ">=", "<=".
inline const char* to_string(Comparison c) noexcept {
  switch (c) {
    case Comparison::Greater: return ">";
    case Comparison::Less: return "<";
    case Comparison::Equal: return "==";
    case Comparison::GreaterEqual: return ">=";
    case Comparison::LessEqual: return "<=";
  }
  return "?";
}

/// `value <op> threshold`; false when `value` is NaN.
inline bool compare(double value, Comparison c, double threshold) noexcept {
  switch (c) {
    case Comparison::Greater: return value > threshold;
    case Comparison::Less: return value < threshold;
    case Comparison::Equal: return value == threshold;
    case Comparison::GreaterEqual: return value >= threshold;
    case Comparison::LessEqual: return value <= threshold;
  }
  return false;
}

/// A predicate over the hook context, built from thresholds and combinators. A value the
/// loop never reported (no `set_loss` call, say) makes a condition on it false.
///
/// ```cpp
/// auto c = HookCondition::loss_above(10.0) || HookCondition::loss_non_finite();
/// auto late = HookCondition::step_range(100, 200) && !HookCondition::has_metadata("eval");
/// ```
class HookCondition {
 public:
  using Predicate = std::function<bool(const HookContext&)>;

  /// Reported loss `<op> threshold`.
  static HookCondition loss(Comparison op, double threshold) {
    check_threshold("loss", threshold);
    return HookCondition(Node{Threshold{Quantity::Loss, op, threshold}});
  }
  static HookCondition loss_above(double threshold) { return loss(Comparison::Greater, threshold); }
  static HookCondition loss_below(double threshold) { return loss(Comparison::Less, threshold); }
  /// The reported loss is NaN or +/-Inf (comparisons with NaN are always false, so
  /// `loss_above` alone never sees a NaN loss).
  static HookCondition loss_non_finite() { return HookCondition(Node{LossNonFinite{}}); }
  /// Reported gradient norm `<op> threshold`.
  static HookCondition gradient_norm(Comparison op, double threshold) {
    check_threshold("gradient norm", threshold);
    return HookCondition(Node{Threshold{Quantity::GradientNorm, op, threshold}});
  }
  static HookCondition gradient_norm_above(double threshold) {
    return gradient_norm(Comparison::Greater, threshold);
  }
  /// Reported memory use (MB) `<op> threshold`.
  static HookCondition memory_mb(Comparison op, double threshold_mb) {
    check_threshold("memory (MB)", threshold_mb);
    return HookCondition(Node{Threshold{Quantity::MemoryMb, op, threshold_mb}});
  }
  static HookCondition memory_above(double threshold_mb) {
    return memory_mb(Comparison::Greater, threshold_mb);
  }
  /// first <= step <= last.
  static HookCondition step_range(int64_t first, int64_t last) {
    if (first > last) {
      throw Error("torchdbg: step_range first (" + std::to_string(first) +
                  ") is after last (" + std::to_string(last) + ")");
    }
    return HookCondition(Node{StepRange{first, last}});
  }
  /// The call's metadata has `key` (with `value`, when given).
  static HookCondition has_metadata(std::string key) {
    return HookCondition(Node{MetadataKey{std::move(key), std::nullopt}});
  }
  static HookCondition metadata_equals(std::string key, std::string value) {
    return HookCondition(Node{MetadataKey{std::move(key), std::move(value)}});
  }
  /// Any predicate over the context; `description` is what `describe()` prints.
  static HookCondition custom(Predicate predicate, std::string description = "custom") {
    if (!predicate) throw Error("torchdbg: custom condition '" + description + "' is empty");
    return HookCondition(Node{Custom{std::move(predicate), std::move(description)}});
  }
  static HookCondition all_of(std::vector<HookCondition> parts) {
    if (parts.empty()) throw Error("torchdbg: all_of needs at least one condition");
    return HookCondition(Node{All{std::move(parts)}});
  }
  static HookCondition any_of(std::vector<HookCondition> parts) {
    if (parts.empty()) throw Error("torchdbg: any_of needs at least one condition");
    return HookCondition(Node{Any{std::move(parts)}});
  }
  static HookCondition negate(HookCondition c) { return HookCondition(Node{Not{{std::move(c)}}}); }

  friend HookCondition operator&&(HookCondition a, HookCondition b) {
    return all_of({std::move(a), std::move(b)});
  }
  friend HookCondition operator||(HookCondition a, HookCondition b) {
    return any_of({std::move(a), std::move(b)});
  }
  friend HookCondition operator!(HookCondition a) { return negate(std::move(a)); }

  /// Whether the condition holds in `ctx`. A custom predicate's exception propagates.
  [[nodiscard]] bool evaluate(const HookContext& ctx) const { return std::visit(Eval{ctx}, *node_); }

  /// A readable form, e.g. "(loss > 10 || loss non-finite)".
  [[nodiscard]] std::string describe() const { return std::visit(Describe{}, *node_); }

 private:
  enum class Quantity { Loss, GradientNorm, MemoryMb };
  struct Threshold {
    Quantity quantity;
    Comparison op;
    double threshold;
  };
  struct LossNonFinite {};
  struct StepRange {
    int64_t first, last;
  };
  struct MetadataKey {
    std::string key;
    std::optional<std::string> value;
  };
  struct Custom {
    Predicate predicate;
    std::string description;
  };
  struct All {
    std::vector<HookCondition> parts;
  };
  struct Any {
    std::vector<HookCondition> parts;
  };
  struct Not {
    std::vector<HookCondition> inner;  // exactly one
  };
  using Node = std::variant<Threshold, LossNonFinite, StepRange, MetadataKey, Custom, All, Any, Not>;

  explicit HookCondition(Node node) : node_(std::make_shared<const Node>(std::move(node))) {}

  static void check_threshold(const char* what, double v) {
    if (std::isnan(v)) throw Error(std::string("torchdbg: ") + what + " threshold is NaN");
  }

  struct Eval {
    const HookContext& ctx;
    bool operator()(const Threshold& t) const {
      std::optional<double> v;
      switch (t.quantity) {
        case Quantity::Loss: v = ctx.loss(); break;
        case Quantity::GradientNorm: v = ctx.gradient_norm(); break;
        case Quantity::MemoryMb: v = ctx.memory_mb(); break;
      }
      return v.has_value() && compare(*v, t.op, t.threshold);
    }
    bool operator()(const LossNonFinite&) const {
      return ctx.loss().has_value() && !std::isfinite(*ctx.loss());
    }
    bool operator()(const StepRange& r) const {
      return ctx.step() >= r.first && ctx.step() <= r.last;
    }
    bool operator()(const MetadataKey& m) const {
      auto v = ctx.metadata_value(m.key);
      return v.has_value() && (!m.value || *v == *m.value);
    }
    bool operator()(const Custom& c) const { return c.predicate(ctx); }
    bool operator()(const All& a) const {
      for (const auto& p : a.parts)
        if (!p.evaluate(ctx)) return false;
      return true;
    }
    bool operator()(const Any& a) const {
      for (const auto& p : a.parts)
        if (p.evaluate(ctx)) return true;
      return false;
    }
    bool operator()(const Not& n) const { return !n.inner.front().evaluate(ctx); }
  };

  struct Describe {
    static std::string num(double v) {
      std::ostringstream os;
      os << v;
      return os.str();
    }
    static std::string join(const std::vector<HookCondition>& parts, const char* sep) {
      std::string out = "(";
      for (std::size_t i = 0; i < parts.size(); ++i) {
        if (i) out += sep;
        out += parts[i].describe();
      }
      return out + ")";
    }
    std::string operator()(const Threshold& t) const {
      const char* q = t.quantity == Quantity::Loss           ? "loss"
                      : t.quantity == Quantity::GradientNorm ? "gradient_norm"
                                                             : "memory_mb";
      return std::string(q) + " " + to_string(t.op) + " " + num(t.threshold);
    }
    std::string operator()(const LossNonFinite&) const { return "loss non-finite"; }
    std::string operator()(const StepRange& r) const {
      return "step in [" + std::to_string(r.first) + ", " + std::to_string(r.last) + "]";
    }
    std::string operator()(const MetadataKey& m) const {
      return m.value ? "metadata[" + m.key + "] == '" + *m.value + "'" : "has metadata " + m.key;
    }
    std::string operator()(const Custom& c) const { return c.description; }
    std::string operator()(const All& a) const { return join(a.parts, " && "); }
    std::string operator()(const Any& a) const { return join(a.parts, " || "); }
    std::string operator()(const Not& n) const { return "!" + n.inner.front().describe(); }
  };

  std::shared_ptr<const Node> node_;
};

}  // namespace torchdbg
