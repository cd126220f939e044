// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// The hook manager's alert log, error handler and pause flag (hook_manager.hpp).

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "torchdbg/detail/compiled.hpp"
#include "torchdbg/detail/mutex.hpp"
#include "torchdbg/detail/ring_buffer.hpp"
#include "torchdbg/hook_config.hpp"

namespace torchdbg {

/// Why and where training was paused.
struct PauseInfo {
  int64_t step = 0;
  std::string layer;      ///< empty when paused by `pause_training(reason)`
  std::string hook_name;  ///< the hook, "torchdbg.health", or empty (`pause_training(reason)`)
  HookId hook_id;
  std::string reason;
};

namespace detail {

/// Alerts (a ring of `capacity`), the sink and error handler they go to, and the pause flag
/// with its reason. Sinks and handlers are called without the lock held. Thread safety: every
/// member may be used from any number of threads at once (with Mutex = std::mutex).
template <typename Mutex>
class AlertLog {
 public:
  using AlertSink = std::function<void(const Alert&)>;
  using ErrorHandler = std::function<void(const HookError&)>;

  explicit AlertLog(std::size_t capacity)
      : capacity_(capacity), alerts_(capacity), pause_(std::make_shared<std::atomic<bool>>(false)) {}

  /// Logs `al` (timed now) and hands it to the sink; the sink's exception propagates.
  void push(Alert al);
  [[nodiscard]] std::vector<Alert> alerts() const;
  [[nodiscard]] uint64_t count() const;
  void clear();
  void set_sink(AlertSink sink);
  void set_error_handler(ErrorHandler handler);
  /// Hands `error` to the error handler; the handler's own exception is swallowed.
  void report(const HookError& error) const;

  [[nodiscard]] const std::shared_ptr<std::atomic<bool>>& pause_flag() const noexcept { return pause_; }
  /// Raises the flag; the first request's reason is kept until resume().
  void request_pause(PauseInfo info);
  [[nodiscard]] std::optional<PauseInfo> pause_info() const;
  void resume();

 private:
  std::size_t capacity_;
  mutable Mutex mutex_;  // alerts_, sink, handler, pause_info_
  RingBuffer<Alert> alerts_;
  AlertSink sink_;
  ErrorHandler error_handler_;
  std::shared_ptr<std::atomic<bool>> pause_;
  std::optional<PauseInfo> pause_info_;
};

#if TORCHDBG_DEFINITIONS

template <typename Mutex>
void AlertLog<Mutex>::push(Alert al) {
  al.time = std::chrono::system_clock::now();
  AlertSink sink;
  {
    std::lock_guard<Mutex> lock(mutex_);
    alerts_.push(al);
    sink = sink_;
  }
  if (sink) sink(al);
}

template <typename Mutex>
std::vector<Alert> AlertLog<Mutex>::alerts() const {
  std::lock_guard<Mutex> lock(mutex_);
  return alerts_.to_vector();
}

template <typename Mutex>
uint64_t AlertLog<Mutex>::count() const {
  std::lock_guard<Mutex> lock(mutex_);
  return alerts_.total_pushed();
}

template <typename Mutex>
void AlertLog<Mutex>::clear() {
  std::lock_guard<Mutex> lock(mutex_);
  alerts_ = RingBuffer<Alert>(capacity_);
}

template <typename Mutex>
void AlertLog<Mutex>::set_sink(AlertSink sink) {
  std::lock_guard<Mutex> lock(mutex_);
  sink_ = std::move(sink);
}

template <typename Mutex>
void AlertLog<Mutex>::set_error_handler(ErrorHandler handler) {
  std::lock_guard<Mutex> lock(mutex_);
  error_handler_ = std::move(handler);
}

template <typename Mutex>
void AlertLog<Mutex>::report(const HookError& error) const {
  ErrorHandler handler;
  {
    std::lock_guard<Mutex> lock(mutex_);
    handler = error_handler_;
  }
  if (!handler) return;
  try {
    handler(error);
  } catch (...) {
    // The handler is the last stop for errors; its own failure must not reach the loop.
  }
}

template <typename Mutex>
void AlertLog<Mutex>::request_pause(PauseInfo info) {
  std::lock_guard<Mutex> lock(mutex_);
  if (!pause_->load()) pause_info_ = std::move(info);
  pause_->store(true);
}

template <typename Mutex>
std::optional<PauseInfo> AlertLog<Mutex>::pause_info() const {
  std::lock_guard<Mutex> lock(mutex_);
  return pause_info_;
}

template <typename Mutex>
void AlertLog<Mutex>::resume() {
  std::lock_guard<Mutex> lock(mutex_);
  pause_info_.reset();
  pause_->store(false);
}

#endif  // TORCHDBG_DEFINITIONS

TORCHDBG_EXTERN_TEMPLATE(class AlertLog<std::mutex>)
TORCHDBG_EXTERN_TEMPLATE(class AlertLog<NullMutex>)

}  // namespace detail
}  // namespace torchdbg
