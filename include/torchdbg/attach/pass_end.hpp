// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// The end of an autograd pass, also when the pass throws.

#include <torch/csrc/autograd/engine.h>

#include <atomic>
#include <functional>
#include <memory>

namespace torchdbg::detail {

/// Queues `on_end` as a final callback of the running autograd pass, and calls `on_dropped`
/// instead when the pass ends without running it: LibTorch drops a pass's final callbacks when
/// the pass throws (a tensor hook, a custom Function's backward, anomaly mode's NaN check), and
/// whatever waited for the end would otherwise wait forever. `on_dropped` runs on the thread
/// that frees the pass (the one whose backward() is throwing). False, with neither called,
/// when no pass is running on this thread. Neither may throw.
inline bool queue_pass_end(std::function<void()> on_end, std::function<void()> on_dropped) {
  struct Token {
    std::function<void()> end, dropped;
    std::atomic<bool> ran{false};
    ~Token() {
      if (ran.load()) return;
      try {
        dropped();
      } catch (...) {
      }
    }
  };
  auto token = std::make_shared<Token>();
  token->end = std::move(on_end);
  token->dropped = std::move(on_dropped);
  try {
    torch::autograd::Engine::get_default_engine().queue_callback([token] {
      token->ran.store(true);
      token->end();
    });
  } catch (...) {
    token->ran.store(true);  // not inside a backward pass: nothing was queued
    return false;
  }
  return true;
}

}  // namespace torchdbg::detail
