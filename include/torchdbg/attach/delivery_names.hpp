// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// The names and metadata of forward deliveries, built once per module, operator and call.

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>

#include "torchdbg/attach/modules.hpp"
#include "torchdbg/attach/operators.hpp"
#include "torchdbg/hook_context.hpp"

namespace torchdbg::detail {

/// A forward delivery's name and metadata.
struct DeliveryInfo {
  std::string name;
  Metadata md;
  uint32_t call = 0;
  /// The same delivery without "input_from" when DeliveryNames keeps it (for as long as the
  /// session lives); null otherwise.
  const DeliveryInfo* base = nullptr;
};

/// The module's output (`op` -1: its name, {"module_type", ..., "call", "<k>"}) or a follow-up
/// operator's ("<module>/<op>", {"activation"|"op": op, "call": "<k>"}; an activation module's
/// name and {"module_type", ...} where Module::named_follow_ups names it), for the module's call
/// `call` in the step. A module output whose data input is another delivery's output (`from`)
/// also carries {"input_from": from's name, "input_call": from's call}. Built on first use
/// and kept for the first kCachedCalls calls, so a step builds no strings. Thread-safe.
class DeliveryNames {
 public:
  static constexpr uint32_t kCachedCalls = 4096;

  std::shared_ptr<const DeliveryInfo> get(const ModuleTable& table, std::size_t module, int op, uint32_t call,
                                          const DeliveryInfo* from = nullptr) {
    const auto make = [&](const DeliveryInfo* with) {
      auto f = std::make_shared<DeliveryInfo>();
      f->call = call;
      if (op < 0) {
        f->name = table.modules[module].name;
        f->md = table.modules[module].forward_md;
      } else {
        const char* n = FollowUpOps::kNames[op];
        const auto* named = table.modules[module].named_follow_up(op);
        f->name = named != nullptr ? named->name : table.modules[module].name + "/" + n;
        f->md.emplace(FollowUpOps::is_math(op) ? "op" : "activation", n);
        if (named != nullptr) f->md.emplace("module_type", named->type_name);
      }
      f->md.emplace("call", std::to_string(call));
      if (with != nullptr) {
        f->md.emplace("input_from", with->name);
        f->md.emplace("input_call", std::to_string(with->call));
      }
      return f;
    };
    if (call >= kCachedCalls || (from != nullptr && from->base == nullptr)) return make(from);
    std::lock_guard<std::mutex> lock(mutex_);
    auto& base = cache_[{module, op, call, nullptr}];
    if (!base) {
      auto f = make(nullptr);
      f->base = f.get();
      base = std::move(f);
    }
    if (from == nullptr) return base;
    auto& slot = cache_[{module, op, call, from->base}];  // one per source delivery
    if (!slot) {
      auto f = make(from);
      f->base = base.get();
      slot = std::move(f);
    }
    return slot;
  }

 private:
  std::mutex mutex_;
  std::map<std::tuple<std::size_t, int, uint32_t, const DeliveryInfo*>, std::shared_ptr<const DeliveryInfo>> cache_;
};

}  // namespace torchdbg::detail
