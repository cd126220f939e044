// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// Who the health monitor tells when a failure pauses training: the user's callback and the
// pause of every HookManager it is installed on. Internal to the monitor.

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "torchdbg/detail/compiled.hpp"
#include "torchdbg/health/ledger.hpp"

namespace torchdbg::detail {

/// The pause callbacks. Thread-safe (its own lock); the callbacks run without it.
class PauseCallbacks {
 public:
  /// (step, layer, reason).
  using PauseFn = std::function<void(int64_t, const std::string&, const std::string&)>;

  /// The user's callback (replaces the previous one).
  void set(PauseFn fn);
  /// An installation's pause of its manager; returns the token for `release`.
  uint64_t add(PauseFn fn);
  /// Takes back an installation's pause, waiting for a call of it running on another thread.
  void release(uint64_t token);
  /// Calls every callback for each pause (one that throws is skipped).
  void run(int64_t step, const Pauses& pauses) const;

 private:
  /// An installation's pause; the slot's lock makes release wait for a running call.
  struct Slot {
    std::mutex mutex;
    PauseFn fn;
    bool live = true;
  };
  mutable std::mutex mutex_;
  PauseFn user_;
  std::vector<std::pair<uint64_t, std::shared_ptr<Slot>>> slots_;
  uint64_t seq_ = 0;
};

#if TORCHDBG_DEFINITIONS

TORCHDBG_INLINE void PauseCallbacks::set(PauseFn fn) {
  std::lock_guard<std::mutex> lock(mutex_);
  user_ = std::move(fn);
}

TORCHDBG_INLINE uint64_t PauseCallbacks::add(PauseFn fn) {
  auto slot = std::make_shared<Slot>();
  slot->fn = std::move(fn);
  std::lock_guard<std::mutex> lock(mutex_);
  const uint64_t token = ++seq_;
  slots_.emplace_back(token, std::move(slot));
  return token;
}

TORCHDBG_INLINE void PauseCallbacks::release(uint64_t token) {
  std::shared_ptr<Slot> slot;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = slots_.begin(); it != slots_.end(); ++it) {
      if (it->first != token) continue;
      slot = it->second;
      slots_.erase(it);
      break;
    }
  }
  if (!slot) return;
  std::lock_guard<std::mutex> lock(slot->mutex);
  slot->live = false;
}

TORCHDBG_INLINE void PauseCallbacks::run(int64_t step, const Pauses& pauses) const {
  if (pauses.empty()) return;
  PauseFn fn;
  std::vector<std::shared_ptr<Slot>> slots;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    fn = user_;
    for (const auto& p : slots_) slots.push_back(p.second);
  }
  for (const auto& [layer, reason] : pauses) {
    try {
      if (fn) fn(step, layer, reason);
    } catch (...) {
    }
    for (const auto& s : slots) {
      try {
        std::lock_guard<std::mutex> lock(s->mutex);  // release waits for this call
        if (s->live) s->fn(step, layer, reason);
      } catch (...) {
      }
    }
  }
}

#endif  // TORCHDBG_DEFINITIONS

}  // namespace torchdbg::detail
