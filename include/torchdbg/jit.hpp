// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// attach() for TorchScript models: a torch::jit::Module scripted or traced in Python and
// loaded with torch::jit::load. Not part of the umbrella header (it brings TorchScript's
// headers): include "torchdbg/jit.hpp" beside it.

#include <torch/csrc/jit/api/module.h>

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "torchdbg/attach/session.hpp"
#include "torchdbg/error.hpp"

namespace torchdbg {
namespace detail {

/// A TorchScript class's Python name: "__torch__.torch.nn.modules.linear.___torch_mangle_3.Linear"
/// -> "torch.nn.modules.linear.Linear" (the compiler's prefix and mangling dropped).
inline std::string jit_type_name(const torch::jit::Module& m) {
  const auto& qualified = m.type()->name();
  if (!qualified) return "";
  std::string out;
  for (const std::string& atom : qualified->atoms()) {
    if (atom == "__torch__" || atom.rfind("___torch_mangle_", 0) == 0) continue;
    if (!out.empty()) out += '.';
    out += atom;
  }
  return out;
}

/// Whether a method's graph holds a tensor as a constant: what torch.jit.freeze (and
/// optimize_for_inference) leaves of the weights it folds into the code.
inline bool holds_tensor_constants(const torch::jit::Module& m) {
  for (const auto& method : m.get_methods()) {
    const std::shared_ptr<torch::jit::Graph> graph = method.graph();
    for (const torch::jit::Node* n : graph->nodes()) {
      if (n->kind() == c10::prim::Constant && n->output()->type()->kind() == c10::TypeKind::TensorType)
        return true;
    }
  }
  return false;
}

/// A TorchScript model and its submodules, root first, as attach() describes them.
inline std::vector<ModuleSpec> jit_specs_of(const torch::jit::Module& model) {
  std::vector<ModuleSpec> out;
  bool any_tensor = false;
  for (const auto& item : model.named_modules()) {  // the model first, as ""
    ModuleSpec spec;
    spec.name = item.name.empty() ? "root" : item.name;
    spec.type_name = jit_type_name(item.value);
    const std::string_view type = spec.type_name;
    constexpr std::string_view kAttention = "MultiheadAttention";
    spec.attention = type.size() >= kAttention.size() &&
                     type.substr(type.size() - kAttention.size()) == kAttention;
    for (const auto& p : item.value.named_parameters(/*recurse=*/false)) spec.params.emplace_back(p.name, p.value);
    for (const auto& b : item.value.named_buffers(/*recurse=*/false)) spec.buffers.emplace_back(b.name, b.value);
    any_tensor = any_tensor || !spec.params.empty() || !spec.buffers.empty();
    out.push_back(std::move(spec));
  }
  if (!any_tensor) {
    if (holds_tensor_constants(model))
      throw Error(
          "torchdbg: attach: this TorchScript model keeps its weights as constants inside its code "
          "(torch.jit.freeze or optimize_for_inference inlined its submodules): no operator can be "
          "told apart by module. Attach the model before freezing it");
    throw Error("torchdbg: attach: this TorchScript model has no parameters or buffers: nothing to attach to");
  }
  return out;
}

}  // namespace detail

/// Attaches `hooks` to a TorchScript model (`torch::jit::load`), as attach() does to a
/// `torch::nn::Module`: every submodule that owns parameters or buffers delivers each call's
/// output under its dotted name ("b0.fc", "layers.1") with {"call": "<k>", "module_type":
/// "torch.nn.modules.linear.Linear"}, parameter-free activations after it as
/// "<module>/<activation>", every parameter's gradient with {"parameter": name}, and the
/// per-module and global gradient norms. Scripted and traced models alike; a frozen model
/// (its weights folded into its code) throws torchdbg::Error.
///
/// ```cpp
/// torch::jit::Module model = torch::jit::load("model.pt");
/// auto session = torchdbg::attach(model, hooks);
/// std::vector<at::Tensor> params;
/// for (const auto& p : model.parameters()) params.push_back(p);
/// torch::optim::SGD opt(params, 0.01);  // fine-tuning in C++
/// ```
template <typename Mutex>
[[nodiscard]] BasicAttachSession<Mutex> attach(torch::jit::Module& model, BasicHookManager<Mutex>& hooks,
                                               AttachOptions options = {}) {
  return BasicAttachSession<Mutex>(detail::jit_specs_of(model), hooks, std::move(options));
}

}  // namespace torchdbg
