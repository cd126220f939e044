// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// A hook's execution counters (hook_manager.hpp): updated lock-free while hooks run on any
// thread, read as HookStats.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <limits>

#include "torchdbg/hook_config.hpp"

namespace torchdbg {
namespace detail {

/// Executions, errors, skips and time of one hook. Thread safety: every member may be used
/// from any number of threads at once.
struct HookCounters {
  std::atomic<uint64_t> executions{0}, errors{0}, skipped{0}, total_ns{0};
  std::atomic<int64_t> last_step{std::numeric_limits<int64_t>::min()};

  /// An execution at `step` whose actions took `elapsed` (errors included).
  void executed(std::chrono::steady_clock::duration elapsed, int64_t step) {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(elapsed).count();
    total_ns.fetch_add(static_cast<uint64_t>(ns));
    executions.fetch_add(1);
    last_step.store(step);
  }

  [[nodiscard]] HookStats stats() const {
    HookStats s;
    s.executions = executions.load();
    s.errors = errors.load();
    s.skipped = skipped.load();
    const int64_t ls = last_step.load();
    if (ls != std::numeric_limits<int64_t>::min()) s.last_step = ls;
    s.total_time_us = static_cast<double>(total_ns.load()) / 1000.0;
    return s;
  }
};

}  // namespace detail
}  // namespace torchdbg
