// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// The table of attached modules: parameters, kinds, tied tensors.

#include <ATen/ATen.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "torchdbg/attach/module_spec.hpp"
#include "torchdbg/attach/operators.hpp"
#include "torchdbg/hook_context.hpp"

namespace torchdbg::detail {

/// The modules a session attaches: names, types, parameters, and which module owns each
/// tensor (several for tied weights). Built once by the session's constructor, then read only.
struct ModuleTable {
  struct Param {
    std::string name;
    WeakImpl impl;
    Metadata grad_md;  // {"parameter", name}: built once, sent with every gradient
  };
  /// What a module computes, as far as telling tied modules apart needs: an embedding
  /// lookup and a matmul may read the same weight.
  enum class Kind { Other, Embedding, Linear, Conv };
  struct Module {
    std::string name;
    std::string type_name;
    std::vector<Param> params;
    Metadata forward_md;  // {"module_type", type_name}
    Kind kind = Kind::Other;
    /// The module whose output an operator on this module's tensors produces: itself, or for
    /// MultiheadAttention's out_proj the attention module (its forward applies out_proj's
    /// weights itself; out_proj's own forward never runs).
    std::size_t forward_as = 0;
    /// Operators on this module's own tensors are internal steps of its forward (the packed
    /// q/k/v projection of MultiheadAttention), not its output.
    bool internal = false;
    /// Activation modules named by ModuleSpec::activations: FollowUpOps index, name, type.
    struct NamedFollowUp {
      int op = -1;
      std::string name;
      std::string type_name;
    };
    std::vector<NamedFollowUp> named_follow_ups;
    [[nodiscard]] const NamedFollowUp* named_follow_up(int op) const {
      for (const auto& f : named_follow_ups)
        if (f.op == op) return &f;
      return nullptr;
    }
    /// Python's MultiheadAttention (ModuleSpec::python_attention) and its `batch_first`.
    bool python_attention = false;
    bool batch_first = false;
    /// Attached only so that its tensors are recognised (an unselected out_proj): no
    /// gradients, no name of its own.
    bool hidden = false;
    /// A BatchNorm (its `aten::batch_norm` calls are measured, see norm_stats.hpp) and its
    /// num_batches_tracked buffer, if it has one.
    bool batch_norm = false;
    std::optional<WeakImpl> batches_tracked;
  };

  static Kind kind_of_module(std::string_view type) {
    if (type.find("Embedding") != std::string_view::npos) return Kind::Embedding;
    if (type.find("Conv") != std::string_view::npos) return Kind::Conv;
    if (type.find("Linear") != std::string_view::npos) return Kind::Linear;
    return Kind::Other;
  }
  static Kind kind_of_op(std::string_view op) {
    if (op.substr(0, 6) != "aten::") return Kind::Other;
    op.remove_prefix(6);
    if (op == "embedding" || op == "embedding_bag" || op == "_embedding_bag") return Kind::Embedding;
    if (op.find("conv") != std::string_view::npos) return Kind::Conv;
    static constexpr std::string_view kLinear[] = {"linear", "addmm", "mm",    "matmul", "bmm",
                                                   "baddbmm", "addmv", "mv", "bilinear", "_trilinear"};
    for (auto k : kLinear)
      if (op == k) return Kind::Linear;
    return Kind::Other;
  }
  /// How well a module's kind fits an operator's: 2 the same kind, 0 another known kind
  /// (an embedding's weight read by a matmul is the tied decoder's), 1 unknown.
  static int kind_fit(Kind module, Kind op) {
    if (module == Kind::Other || op == Kind::Other) return 1;
    return module == op ? 2 : 0;
  }

  std::vector<Module> modules;
  /// Own parameters and buffers of attached modules -> the modules that registered them, in
  /// module order (several for tied weights). The weak references in `keep` hold the
  /// addresses, so a freed tensor's address is never reused for another.
  std::unordered_map<const c10::TensorImpl*, std::vector<std::size_t>> owner;
  std::vector<WeakImpl> keep;
  /// Own tensors of attached modules by data address: what `alias_of` looks up.
  std::unordered_map<const void*, std::vector<WeakImpl>> by_data;

  /// `t`'s data address, or null (no storage, none allocated).
  static const void* data_of(const at::Tensor& t) {
    if (!t.defined() || !t.has_storage()) return nullptr;
    try {
      return t.unsafeGetTensorImpl()->data();
    } catch (...) {
      return nullptr;
    }
  }

  /// The attached tensor `x` is a detached alias of (its data, sizes, strides and dtype), or
  /// null. TorchScript's graph executor hands each differentiable subgraph detached aliases
  /// of the module tensors it reads: however many there are, each is its module's.
  [[nodiscard]] const c10::TensorImpl* alias_of(const at::Tensor& x) const {
    if (by_data.empty() || !x.defined() || !x.has_storage()) return nullptr;
    const auto it = by_data.find(data_of(x));
    if (it == by_data.end()) return nullptr;
    for (const WeakImpl& w : it->second) {
      const at::Tensor t(w.lock());
      if (t.defined() && t.sizes() == x.sizes() && t.strides() == x.strides() && t.dtype() == x.dtype() &&
          t.storage_offset() == x.storage_offset())
        return t.unsafeGetTensorImpl();  // held by `keep`'s owner, the model
    }
    return nullptr;
  }

  /// The tensor members a built-in layer's forward reads (`LinearImpl::weight`, ...): a user
  /// may assign them to tie weights.
  static std::vector<std::pair<const char*, at::Tensor>> member_tensors(torch::nn::Module& m) {
    namespace nn = torch::nn;
    if (auto* l = dynamic_cast<nn::LinearImpl*>(&m)) return {{"weight", l->weight}, {"bias", l->bias}};
    if (auto* l = dynamic_cast<nn::BilinearImpl*>(&m)) return {{"weight", l->weight}, {"bias", l->bias}};
    if (auto* e = dynamic_cast<nn::EmbeddingImpl*>(&m)) return {{"weight", e->weight}};
    if (auto* e = dynamic_cast<nn::EmbeddingBagImpl*>(&m)) return {{"weight", e->weight}};
    const auto conv = [](auto* c) -> std::vector<std::pair<const char*, at::Tensor>> {
      return {{"weight", c->weight}, {"bias", c->bias}};
    };
    if (auto* c = dynamic_cast<nn::Conv1dImpl*>(&m)) return conv(c);
    if (auto* c = dynamic_cast<nn::Conv2dImpl*>(&m)) return conv(c);
    if (auto* c = dynamic_cast<nn::Conv3dImpl*>(&m)) return conv(c);
    if (auto* c = dynamic_cast<nn::ConvTranspose1dImpl*>(&m)) return conv(c);
    if (auto* c = dynamic_cast<nn::ConvTranspose2dImpl*>(&m)) return conv(c);
    if (auto* c = dynamic_cast<nn::ConvTranspose3dImpl*>(&m)) return conv(c);
    return {};
  }

  /// `m` (named `name`) as attach() sees it: a member a built-in layer's forward reads
  /// (`decoder->weight = emb->weight` ties the member; the registered entry keeps the old
  /// tensor, which no operator uses) stands for the registered parameter of that name.
  static ModuleSpec spec_of(const std::string& name, torch::nn::Module& m) {
    ModuleSpec spec;
    spec.name = name;
    spec.type_name = m.name();
    spec.attention = spec.type_name == "torch::nn::MultiheadAttention" ||
                     spec.type_name == "torch::nn::MultiheadAttentionImpl";
    const auto members = member_tensors(m);
    for (const auto& p : m.named_parameters(/*recurse=*/false)) {
      at::Tensor t = p.value();
      for (const auto& [member, tensor] : members)
        if (member == p.key() && tensor.defined()) t = tensor;
      spec.params.emplace_back(p.key(), t);
    }
    for (const auto& b : m.named_buffers(/*recurse=*/false)) spec.buffers.emplace_back(b.key(), b.value());
    return spec;
  }

  /// The model and its submodules, root first ("root", then dotted names), each module once:
  /// one registered under several names (`register_module("a", fc)` and
  /// `register_module("b", fc)`, or pushed into a ModuleList twice) under the first in
  /// pre-order, as PyTorch's named_modules() lists it, so all its calls are that name's.
  /// named_modules (include_self) would need the model held by a shared_ptr; one on the
  /// stack (`Net model;`) is described the same way.
  static std::vector<ModuleSpec> specs_of(torch::nn::Module& model) {
    std::vector<ModuleSpec> out{spec_of("root", model)};
    std::unordered_set<const torch::nn::Module*> seen{&model};
    for (const auto& item : model.named_modules("", /*include_self=*/false))
      if (seen.insert(item.value().get()).second) out.push_back(spec_of(item.key(), *item.value()));
    return out;
  }

  /// Adds the module `spec` describes when it owns parameters or buffers; false otherwise.
  bool add_module(const ModuleSpec& spec, bool hidden) {
    if (spec.params.empty() && spec.buffers.empty()) return false;
    const std::size_t idx = modules.size();
    Module info;
    info.name = spec.name;
    info.type_name = spec.type_name;
    info.forward_md = Metadata{{"module_type", info.type_name}};
    info.kind = kind_of_module(info.type_name);
    info.forward_as = idx;
    info.hidden = hidden;
    info.internal = spec.opaque;  // its operators' outputs are parts of its forward, none its output
    info.python_attention = spec.python_attention;
    info.batch_first = spec.batch_first;
    for (const auto& a : spec.activations) {
      const int op = FollowUpOps::find("aten::" + a.op);
      if (op >= 0) info.named_follow_ups.push_back({op, a.name, a.type_name});
    }
    const auto own = [&](const at::Tensor& t) {
      auto& list = owner[t.unsafeGetTensorImpl()];
      if (std::find(list.begin(), list.end(), idx) == list.end()) list.push_back(idx);
      keep.push_back(weak_of(t));
      if (const void* data = data_of(t)) by_data[data].push_back(weak_of(t));
    };
    for (const auto& [name, t] : spec.params) {
      if (!t.defined()) continue;
      info.params.push_back({name, weak_of(t), Metadata{{"parameter", name}}});
      own(t);
    }
    info.batch_norm = info.type_name.find("BatchNorm") != std::string::npos;
    for (const auto& [name, t] : spec.buffers) {
      if (!t.defined()) continue;
      own(t);
      if (name == "num_batches_tracked") info.batches_tracked = weak_of(t);
    }
    modules.push_back(std::move(info));
    return true;
  }

  /// Once every module is added: {"tied": "<module>.<param>, ..."} on the gradient of a
  /// parameter other modules registered too.
  void finish_modules() {
    for (std::size_t m = 0; m < modules.size(); ++m) {
      for (auto& p : modules[m].params) {
        at::Tensor t(p.impl.lock());
        if (!t.defined()) continue;
        const auto& list = owner.at(t.unsafeGetTensorImpl());
        if (list.size() < 2 || list.front() != m) continue;
        std::string tied;
        for (std::size_t k = 1; k < list.size(); ++k) {
          for (const auto& q : modules[list[k]].params) {
            if (q.impl._unsafe_get_target() != t.unsafeGetTensorImpl()) continue;
            if (!tied.empty()) tied += ", ";
            tied += modules[list[k]].name + "." + q.name;
          }
        }
        if (!tied.empty()) p.grad_md.emplace("tied", tied);
      }
    }
  }
};

}  // namespace torchdbg::detail
