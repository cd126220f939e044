// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// What attach() needs to know of one module, whatever kind of model it comes from.

#include <ATen/ATen.h>

#include <string>
#include <utility>
#include <vector>

namespace torchdbg::detail {

/// One module of a model as a session attaches it: its dotted name ("root" for the model),
/// its class, its own (not recursive) parameters and buffers. attach() builds the list from
/// a `torch::nn::Module` or (torchdbg/jit.hpp) a `torch::jit::Module`, root first.
struct ModuleSpec {
  std::string name;
  std::string type_name;  ///< "torch::nn::LinearImpl", or a TorchScript class "torch.nn.modules.linear.Linear"
  std::vector<std::pair<std::string, at::Tensor>> params;
  std::vector<std::pair<std::string, at::Tensor>> buffers;
  /// A MultiheadAttention: its child `out_proj`'s weights are applied by its own forward.
  bool attention = false;
  /// Python's MultiheadAttention (a TorchScript model's): its forward applies out_proj to the
  /// attention output flattened to (L * N, E) and returns the product viewed as (L, N, E),
  /// transposed to (N, L, E) when `batch_first`, squeezed to (L, E) for an unbatched query.
  bool python_attention = false;
  bool batch_first = false;
  /// Its code applies its own parameters in operators that do not follow one another (a
  /// traced GRUCell's gates): no operator's output is its output; it delivers its gradients.
  bool opaque = false;
  /// A parameter-free activation module that takes every output of this module's calls
  /// (TorchScript's `self.act(self.fc(x))`): the activation operator (`op`, a FollowUpOps
  /// name) applied to this module's output is that module's call, delivered under its name.
  struct NamedActivation {
    std::string op;
    std::string name;
    std::string type_name;
  };
  std::vector<NamedActivation> activations;
};

}  // namespace torchdbg::detail
