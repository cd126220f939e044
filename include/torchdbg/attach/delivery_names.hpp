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
};

/// The module's output (`op` -1: its name, {"module_type", ..., "call", "<k>"}) or a follow-up
/// operator's ("<module>/<op>", {"activation"|"op": op, "call": "<k>"}), for the module's call
/// `call` in the step. Built on first use and kept for the first kCachedCalls calls, so a step
/// builds no strings. Thread-safe.
class DeliveryNames {
 public:
  static constexpr uint32_t kCachedCalls = 4096;

  std::shared_ptr<const DeliveryInfo> get(const ModuleTable& table, std::size_t module, int op, uint32_t call) {
    const auto make = [&] {
      auto f = std::make_shared<DeliveryInfo>();
      if (op < 0) {
        f->name = table.modules[module].name;
        f->md = table.modules[module].forward_md;
      } else {
        const char* n = FollowUpOps::kNames[op];
        f->name = table.modules[module].name + "/" + n;
        f->md.emplace(FollowUpOps::is_math(op) ? "op" : "activation", n);
      }
      f->md.emplace("call", std::to_string(call));
      return std::shared_ptr<const DeliveryInfo>(std::move(f));
    };
    if (call >= kCachedCalls) return make();
    std::lock_guard<std::mutex> lock(mutex_);
    auto& slot = cache_[{module, op, call}];
    if (!slot) slot = make();
    return slot;
  }

 private:
  std::mutex mutex_;
  std::map<std::tuple<std::size_t, int, uint32_t>, std::shared_ptr<const DeliveryInfo>> cache_;
};

}  // namespace torchdbg::detail
