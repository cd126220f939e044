// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// Per backward pass gradient bookkeeping: each pass's squared norms are its own.

#include <torch/csrc/autograd/engine.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace torchdbg::detail {

/// The backward passes a session is waiting on, each with the squared gradient norms of the
/// modules its gradients reached. A pass is an autograd graph task: passes run at once by
/// several threads (Hogwild training) or one after another are never summed together.
/// Thread-safe.
class PassLedger {
 public:
  struct Pass {
    const void* id = nullptr;  // the graph task's identity while it runs; null: handed over
    bool gradients = false;    // a gradient arrived
    bool ended = false;        // the pass ended; its norms wait for queued gradients (`held`)
    int held = 0;              // its gradients queued (DeferredQueue) whose squares are not in yet
    bool closed = false;
    std::vector<double> squares;  // per module
    std::vector<char> seen;       // per module: a gradient of it arrived in this pass
  };

  /// The identity of the autograd pass running on this thread, or null outside one.
  static const void* current_id() { return torch::autograd::get_current_graph_task_exec_info(); }

  /// The pass with identity `id` (see current_id), opened when new (`*opened` set then).
  std::shared_ptr<Pass> open(const void* id, std::size_t modules, bool* opened) {
    std::lock_guard<std::mutex> lock(mutex_);
    *opened = false;
    // A pass that ended may wait here for another thread's flush while a new graph task
    // takes its address: that is a new pass.
    for (const auto& p : open_)
      if (p->id == id && id != nullptr && !p->ended) return p;
    auto p = std::make_shared<Pass>();
    p->id = id;
    p->squares.assign(modules, 0.0);
    p->seen.assign(modules, 0);
    open_.push_back(p);
    *opened = true;
    return p;
  }

  /// Adds `sq` to module `m`'s squared norm in `pass` (nothing once the pass is closed).
  void add(Pass& pass, std::size_t m, double sq) {
    std::lock_guard<std::mutex> lock(mutex_);
    pass.gradients = true;
    if (m >= pass.squares.size()) return;
    pass.squares[m] += sq;
    pass.seen[m] = 1;
  }
  /// A gradient of `pass` was queued: its square comes with a later flush (release).
  void hold(Pass& pass) {
    std::lock_guard<std::mutex> lock(mutex_);
    ++pass.held;
  }
  /// A queued gradient of `pass` was flushed (its square added, or lost). True when the pass
  /// had ended and waited for it last: the caller finishes the pass then.
  [[nodiscard]] bool release(Pass& pass) {
    std::lock_guard<std::mutex> lock(mutex_);
    --pass.held;
    return pass.ended && pass.held == 0 && !pass.closed;
  }
  /// `pass` ended (its final callback). True when nothing it queued is still being flushed
  /// (by another thread): the caller finishes the pass now; otherwise the last release does.
  [[nodiscard]] bool end(Pass& pass) {
    std::lock_guard<std::mutex> lock(mutex_);
    pass.ended = true;
    return pass.held == 0;
  }
  /// Marks that a gradient arrived in `pass` (its norm not counted).
  void note_gradient(Pass& pass) {
    std::lock_guard<std::mutex> lock(mutex_);
    pass.gradients = true;
  }

  /// Whether a gradient arrived in `pass`.
  [[nodiscard]] bool had_gradients(const Pass& pass) const {
    std::lock_guard<std::mutex> lock(mutex_);
    return pass.gradients;
  }

  /// Ends `pass`: whether any gradient arrived, and (module, squared norm) for each module
  /// its gradients reached, in module order.
  std::pair<bool, std::vector<std::pair<std::size_t, double>>> close(Pass& pass) {
    std::lock_guard<std::mutex> lock(mutex_);
    open_.erase(std::remove_if(open_.begin(), open_.end(), [&](const auto& p) { return p.get() == &pass; }),
                open_.end());
    std::vector<std::pair<std::size_t, double>> out;
    for (std::size_t m = 0; m < pass.squares.size(); ++m)
      if (pass.seen[m]) out.emplace_back(m, pass.squares[m]);
    pass.closed = true;
    const bool gradients = pass.gradients;
    pass.squares.clear();
    pass.seen.clear();
    pass.gradients = false;
    return {gradients, std::move(out)};
  }

 private:
  mutable std::mutex mutex_;
  std::vector<std::shared_ptr<Pass>> open_;
};

}  // namespace torchdbg::detail
