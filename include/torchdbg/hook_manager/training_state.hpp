// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// The hook manager's training state and its listeners (hook_manager.hpp): step, loss,
// gradient norm and memory as the loop reports them, and who is told of each change.

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "torchdbg/detail/compiled.hpp"
#include "torchdbg/detail/mutex.hpp"
#include "torchdbg/hook_context.hpp"

namespace torchdbg {
namespace detail {

/// The state the loop reports and the listeners of its changes, told with `Change` (the
/// manager's enum: Before, After, Loss, GradientNorm, ...). Listeners are called without a
/// lock held. Thread safety: every member may be used from any number of threads at once
/// (with Mutex = std::mutex); `advance` moves one step per call however many threads call it.
template <typename Mutex, typename Change>
class StepState {
 public:
  using Listener = std::function<void(Change)>;

  uint64_t add_listener(Listener listener);
  void remove_listener(uint64_t id);
  /// Calls every listener with `change`.
  void notify(Change change) const;

  /// Moves to `step` (Before and After around it); a new step has no loss yet.
  void set_step(int64_t step) {
    change_step([step](int64_t) { return step; });
  }
  /// Moves to the current step + 1, as one change.
  void advance();
  void set_loss(double loss);
  /// Records `norm` and tells the listeners (GradientNorm), which read it with reported_norm().
  void set_gradient_norm(double norm);
  /// In a GradientNorm listener, the norm this thread reports; elsewhere the last recorded.
  [[nodiscard]] std::optional<double> reported_norm() const;
  void set_memory_mb(double mb);
  [[nodiscard]] TrainingState state() const;

 private:
  template <typename Next>
  void change_step(Next next) {
    notify(Change::Before);
    {
      std::lock_guard<Mutex> lock(mutex_);
      const int64_t step = next(state_.step);
      if (state_.step != step) {
        state_.loss.reset();
        state_.loss_step.reset();
      }
      state_.step = step;
    }
    notify(Change::After);
  }
  /// The norm being reported on this thread, and by which state.
  static std::pair<const void*, double>& current();

  mutable Mutex mutex_;
  std::recursive_mutex advance_mutex_;  // advance's read and set, as one
  TrainingState state_;
  mutable Mutex listener_mutex_;
  uint64_t listener_seq_ = 0;
  std::shared_ptr<const std::vector<std::pair<uint64_t, Listener>>> listeners_ =
      std::make_shared<const std::vector<std::pair<uint64_t, Listener>>>();
};

#if TORCHDBG_DEFINITIONS

template <typename Mutex, typename Change>
uint64_t StepState<Mutex, Change>::add_listener(Listener listener) {
  std::lock_guard<Mutex> lock(listener_mutex_);
  const uint64_t id = ++listener_seq_;
  auto next = std::make_shared<std::vector<std::pair<uint64_t, Listener>>>(*listeners_);
  next->emplace_back(id, std::move(listener));
  listeners_ = std::move(next);
  return id;
}

template <typename Mutex, typename Change>
void StepState<Mutex, Change>::remove_listener(uint64_t id) {
  std::lock_guard<Mutex> lock(listener_mutex_);
  auto next = std::make_shared<std::vector<std::pair<uint64_t, Listener>>>();
  for (const auto& l : *listeners_)
    if (l.first != id) next->push_back(l);
  listeners_ = std::move(next);
}

template <typename Mutex, typename Change>
void StepState<Mutex, Change>::notify(Change change) const {
  std::shared_ptr<const std::vector<std::pair<uint64_t, Listener>>> ls;
  {
    std::lock_guard<Mutex> lock(listener_mutex_);
    ls = listeners_;
  }
  for (const auto& l : *ls) l.second(change);
}

template <typename Mutex, typename Change>
void StepState<Mutex, Change>::advance() {
  std::lock_guard<std::recursive_mutex> lock(advance_mutex_);
  // The next step is read after the Before listeners, which may end a queued pass that
  // advances first (auto_step with StatsBatching::All).
  change_step([](int64_t current) { return current + 1; });
}

template <typename Mutex, typename Change>
void StepState<Mutex, Change>::set_loss(double loss) {
  {
    std::lock_guard<Mutex> lock(mutex_);
    state_.loss = loss;
    state_.loss_step = state_.step;
  }
  notify(Change::Loss);
}

template <typename Mutex, typename Change>
void StepState<Mutex, Change>::set_gradient_norm(double norm) {
  {
    std::lock_guard<Mutex> lock(mutex_);
    state_.gradient_norm = norm;
  }
  // The norm this thread reports, for its listeners (another thread's pass may end meanwhile).
  struct Reporting {
    Reporting(const void* m, double n) : saved(current()) { current() = {m, n}; }
    ~Reporting() { current() = saved; }
    std::pair<const void*, double> saved;
  } reporting(this, norm);
  notify(Change::GradientNorm);
}

template <typename Mutex, typename Change>
std::optional<double> StepState<Mutex, Change>::reported_norm() const {
  if (current().first == this) return current().second;
  return state().gradient_norm;
}

template <typename Mutex, typename Change>
auto StepState<Mutex, Change>::current() -> std::pair<const void*, double>& {
  thread_local std::pair<const void*, double> c{nullptr, 0.0};
  return c;
}

template <typename Mutex, typename Change>
void StepState<Mutex, Change>::set_memory_mb(double mb) {
  std::lock_guard<Mutex> lock(mutex_);
  state_.memory_mb = mb;
}

template <typename Mutex, typename Change>
TrainingState StepState<Mutex, Change>::state() const {
  std::lock_guard<Mutex> lock(mutex_);
  return state_;
}

#endif  // TORCHDBG_DEFINITIONS

}  // namespace detail
}  // namespace torchdbg
