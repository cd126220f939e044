// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// What `attach` observes and when it computes: AttachOptions, StatsBatching.

#include <torch/arg.h>

#include <cstdint>
#include <string>
#include <vector>

namespace torchdbg {

/// When an attachment computes statistics and runs hooks (AttachOptions::batching).
enum class StatsBatching {
  /// Every delivery runs its hooks at once; a tensor on a device costs one small copy to the
  /// host (a sync) per delivery.
  PerDelivery,
  /// Tensors not on the CPU are reduced on their device and queued; the step's results come to
  /// the host in one copy per device, and their hooks run then. CPU tensors run at once.
  Device,
  /// As Device, for CPU tensors too: every hook of a step runs when the step's batch arrives.
  All,
};

/// What `attach` observes.
///
/// ```cpp
/// auto session = torchdbg::attach(*model, hooks, AttachOptions().patterns({"encoder\\."}).auto_step(true));
/// ```
struct AttachOptions {
  /// Regexes matched from the start of a module's dotted name (`$` anchors the end); a module
  /// is attached when one matches. Empty: every module that owns parameters or buffers.
  TORCH_ARG(std::vector<std::string>, patterns);
  /// Deliver forward outputs (and activations).
  TORCH_ARG(bool, forward) = true;
  /// Deliver parameter gradients.
  TORCH_ARG(bool, backward) = true;
  /// Deliver the parameter-free activation applied to a module's output as "<module>/<act>".
  TORCH_ARG(bool, activations) = true;
  /// Compute per-module gradient norms at the end of each backward pass with hooks due.
  TORCH_ARG(bool, gradient_norms) = true;
  /// One backward pass = one step: the manager's step advances at the end of each backward.
  TORCH_ARG(bool, auto_step) = false;
  /// Also observe forward passes run with gradients disabled (torch::NoGradGuard,
  /// evaluation). Off by default because optimizers update parameters under no-grad, and
  /// an update such as SGD's weight decay `grad + wd * param` is not a forward output.
  TORCH_ARG(bool, no_grad_forward) = false;
  /// Forward passes of observed models may run on other threads while a backward pass runs
  /// (Hogwild-style training, or an evaluation thread beside the training one). By default the operator observer is removed for the rest of a
  /// backward pass once it starts (it would only box operators it ignores, about 2% of an MLP
  /// step); with this set it stays, so those concurrent forward passes are seen.
  TORCH_ARG(bool, concurrent_forward) = false;
  /// When statistics come to the host and hooks run; see StatsBatching.
  TORCH_ARG(StatsBatching, batching) = StatsBatching::Device;
  /// Queued deliveries that force an early copy (bounds the tensors held when no backward pass
  /// or step change comes, e.g. in inference). At least 1.
  TORCH_ARG(int64_t, max_deferred) = 1024;
};

}  // namespace torchdbg
