// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// attach() for TorchScript models: a torch::jit::Module scripted or traced in Python and
// loaded with torch::jit::load. Not part of the umbrella header (it brings TorchScript's
// headers): include "torchdbg/jit.hpp" beside it.

#include <torch/csrc/jit/api/module.h>

#include <algorithm>
#include <iterator>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "torchdbg/attach/operators.hpp"
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
/// The model's own methods and every submodule's count.
inline bool holds_tensor_constants(const torch::jit::Module& model) {
  for (const torch::jit::Module& m : model.modules()) {
    for (const auto& method : m.get_methods()) {
      const std::shared_ptr<torch::jit::Graph> graph = method.graph();
      for (const torch::jit::Node* n : graph->nodes()) {
        if (n->kind() == c10::prim::Constant && n->output()->type()->kind() == c10::TypeKind::TensorType)
          return true;
      }
    }
  }
  return false;
}

/// Whether a Python MultiheadAttention returns its output transposed to batch-first: its
/// `batch_first` attribute where scripting kept it; a traced one keeps no attributes, and its
/// forward then returns an `aten::transpose` of the output.
inline bool attention_batch_first(const torch::jit::Module& m) {
  if (m.hasattr("batch_first")) {
    const c10::IValue bf = m.attr("batch_first");
    return bf.isBool() && bf.toBool();
  }
  const auto forward = m.find_method("forward");
  if (!forward) return false;
  const std::shared_ptr<torch::jit::Graph> graph = forward->graph();
  if (graph->outputs().empty()) return false;
  const torch::jit::Value* out = graph->outputs()[0];
  if (out->node()->kind() == c10::prim::TupleConstruct && !out->node()->inputs().empty())
    out = out->node()->inputs()[0];
  return out->node()->kind() == c10::aten::transpose;
}

/// Whether a module's code applies its own parameters to data in operators that do not follow
/// one another, or in a loop (ModuleSpec::opaque): a traced RNNCell, GRUCell or LSTMCell
/// (tracing records `gru_cell` as its parts, `linear(x, weight_ih)` and `linear(hx,
/// weight_hh)`), a layer that applies its weights once per iteration. Each of those operators
/// would look like a call of its own, with a part's value as its output. Operators on the
/// parameters alone (`weight.view(1, -1)`, `weight.to(x.dtype)`, `weight.size(1)`) prepare
/// them and do not count.
inline bool applies_weights_apart(const torch::jit::Module& m, const ModuleSpec& spec) {
  if (spec.params.empty()) return false;
  for (const auto& method : m.get_methods()) {
    const std::shared_ptr<torch::jit::Graph> graph = method.graph();
    if (graph->inputs().empty()) continue;
    const torch::jit::Value* self = graph->inputs()[0];
    std::set<const torch::jit::Value*> weights;  // parameters and what is made of them alone
    std::vector<const torch::jit::Node*> users;  // operators applying them to data, in order
    // Nodes in program order, blocks entered where they stand (depth first).
    std::vector<const torch::jit::Node*> order;
    std::vector<std::pair<torch::jit::const_graph_node_list_iterator, torch::jit::const_graph_node_list_iterator>>
        stack;
    const torch::jit::Block* top = graph->block();
    stack.emplace_back(top->nodes().begin(), top->nodes().end());
    while (!stack.empty()) {
      auto& [it, end] = stack.back();
      if (it == end) {
        stack.pop_back();
        continue;
      }
      const torch::jit::Node* n = *it;
      ++it;
      order.push_back(n);
      const auto blocks = n->blocks();
      for (std::size_t b = blocks.size(); b-- > 0;) {
        const torch::jit::Block* inner = blocks[b];
        stack.emplace_back(inner->nodes().begin(), inner->nodes().end());
      }
    }
    for (const torch::jit::Node* n : order) {
      if (n->kind() == c10::prim::GetAttr && n->inputs().size() == 1 && n->inputs()[0] == self) {
        const std::string& attr = n->s(c10::attr::name);
        for (const auto& p : spec.params)
          if (p.first == attr) weights.insert(n->output());
        continue;
      }
      bool reads_weights = false, reads_data = false;
      for (const torch::jit::Value* in : n->inputs()) {
        if (weights.count(in) != 0) {
          reads_weights = true;
        } else if (in->type()->kind() == c10::TypeKind::TensorType) {
          reads_data = true;
        }
      }
      if (!reads_weights) continue;
      if (!reads_data) {  // made of the parameters alone
        for (const torch::jit::Value* o : n->outputs()) weights.insert(o);
        continue;
      }
      if (n->kind().is_prim()) continue;  // a call or a list: what receives them decides
      for (const torch::jit::Block* b = n->owningBlock(); b->owningNode() != nullptr; b = b->owningNode()->owningBlock())
        if (b->owningNode()->kind() == c10::prim::Loop) return true;  // once per iteration
      users.push_back(n);
    }
    // Each such operator must take what the one before it in its block made, or a view of
    // it, as the observer continues a call (`x @ w + b`); operators in two branches of an
    // `if` are alternatives, not steps. Anything between (an activation: a traced loop's
    // next iteration) would start a call of its own.
    for (std::size_t i = 1; i < users.size(); ++i) {
      if (users[i]->owningBlock() != users[i - 1]->owningBlock()) continue;
      std::vector<const torch::jit::Value*> todo(users[i - 1]->outputs().begin(), users[i - 1]->outputs().end());
      bool reached = false;
      for (int guard = 0; !todo.empty() && !reached && guard < 4096; ++guard) {
        const torch::jit::Value* v = todo.back();
        todo.pop_back();
        for (const torch::jit::Use& u : v->uses()) {
          if (u.user == users[i]) reached = true;
          if (is_view_like_op(u.user->kind().toQualString()))
            for (const torch::jit::Value* o : u.user->outputs()) todo.push_back(o);
        }
      }
      if (!reached) return true;
    }
    // What `forward` returns must be the last of those operators' output (or a view of it):
    // code after it (`relu(x) + self.slope * x`, a child's output) would leave a part's value
    // delivered as the module's. A value from an `if` (an early return) is taken as it is.
    if (method.name() == "forward" && !users.empty() && !graph->outputs().empty()) {
      const torch::jit::Value* out = graph->outputs()[0];
      if (out->node()->kind() == c10::prim::TupleConstruct && !out->node()->inputs().empty())
        out = out->node()->inputs()[0];
      while (is_view_like_op(out->node()->kind().toQualString()) && !out->node()->inputs().empty())
        out = out->node()->inputs()[0];
      if (out->node() != users.back() && out->node()->kind() != c10::prim::If) return true;
    }
  }
  return false;
}

/// The operator a built-in parameter-free activation module of torch.nn runs on its input
/// (a FollowUpOps name), or empty: "torch.nn.modules.activation.ReLU" -> "relu".
inline std::string_view activation_module_op(std::string_view type) {
  constexpr std::string_view kPrefix = "torch.nn.modules.activation.";
  if (type.substr(0, kPrefix.size()) != kPrefix) return {};
  type.remove_prefix(kPrefix.size());
  static constexpr std::pair<std::string_view, std::string_view> kOps[] = {
      {"ReLU", "relu"},           {"ReLU6", "hardtanh"},      {"LeakyReLU", "leaky_relu"},
      {"ELU", "elu"},             {"SELU", "selu"},           {"CELU", "celu"},
      {"GELU", "gelu"},           {"SiLU", "silu"},           {"Mish", "mish"},
      {"Tanh", "tanh"},           {"Sigmoid", "sigmoid"},     {"Softplus", "softplus"},
      {"Softmax", "softmax"},     {"LogSoftmax", "log_softmax"}, {"Hardtanh", "hardtanh"},
      {"Hardsigmoid", "hardsigmoid"}, {"Hardswish", "hardswish"}, {"Threshold", "threshold"},
      {"Hardshrink", "hardshrink"}, {"Softshrink", "softshrink"}, {"LogSigmoid", "log_sigmoid"}};
  for (const auto& [cls, op] : kOps)
    if (type == cls) return op;
  return {};
}

/// Whether the output of call `s`, directly or through views, goes anywhere but call `m` and
/// operators that make new values of it (arithmetic, matmul, reductions, cat): an activation
/// function, another module or function (which may apply one), an operator that may hand the
/// same tensor back (`detach`, `to`, `dropout`), out of its block. At run time the first
/// activation applied to it takes the name.
inline bool followed_elsewhere(const torch::jit::Node* s, const torch::jit::Node* m) {
  static constexpr std::string_view kMakesNew[] = {
      "aten::add", "aten::sub",  "aten::mul",  "aten::div", "aten::matmul", "aten::mm",  "aten::bmm",
      "aten::cat", "aten::stack", "aten::sum", "aten::mean", "aten::linear", "aten::addmm", "aten::size",
      "aten::dim", "aten::numel", "prim::dtype", "prim::device"};
  std::vector<const torch::jit::Value*> todo(s->outputs().begin(), s->outputs().end());
  for (int guard = 0; !todo.empty() && guard < 4096; ++guard) {
    const torch::jit::Value* v = todo.back();
    todo.pop_back();
    for (const torch::jit::Use& u : v->uses()) {
      const torch::jit::Node* n = u.user;
      if (n == m) continue;
      const std::string op = n->kind().toQualString();
      if (is_view_like_op(op)) {
        for (const torch::jit::Value* o : n->outputs()) todo.push_back(o);
        continue;
      }
      if (std::find(std::begin(kMakesNew), std::end(kMakesNew), op) == std::end(kMakesNew)) return true;
    }
  }
  return false;
}

/// Names parameter-free activation modules by their calls in the model's code (the forward
/// graphs keep each submodule call as a `prim::CallMethod`, scripted and traced alike): an
/// activation module M whose every call takes the output of a call of one module S (directly
/// or through views), where every call of S feeds M, makes the activation operator after S's
/// output M's call (ModuleSpec::activations). Anything less certain keeps "<S>/<op>".
inline void name_activation_modules(const torch::jit::Module& model, std::vector<ModuleSpec>& specs) {
  struct Site {
    std::string owner;   // the module whose code makes the call (a type's code is walked per instance)
    std::string callee;  // the submodule called
    const torch::jit::Node* node;
  };
  std::vector<Site> sites;
  std::map<std::string, torch::jit::Module> by_name;
  for (const auto& item : model.named_modules()) by_name.emplace(item.name, item.value);
  // Every method's graph: a traced module called twice has `forward` and `forward1`, and a
  // scripted one may call helper methods of its own.
  std::vector<std::shared_ptr<torch::jit::Graph>> graphs;  // held while `sites` points into them
  for (const auto& [path, module] : by_name) {
    for (const auto& method : module.get_methods()) {
      const std::shared_ptr<torch::jit::Graph>& graph = graphs.emplace_back(method.graph());
      if (graph->inputs().empty()) continue;
      std::map<const torch::jit::Value*, std::string> rel{{graph->inputs()[0], path}};
      std::vector<const torch::jit::Block*> blocks{graph->block()};
      while (!blocks.empty()) {
        const torch::jit::Block* b = blocks.back();
        blocks.pop_back();
        for (const torch::jit::Node* n : b->nodes()) {
          for (const torch::jit::Block* inner : n->blocks()) blocks.push_back(inner);
          if (n->inputs().empty()) continue;
          const auto it = rel.find(n->inputs()[0]);
          if (it == rel.end()) continue;
          if (n->kind() == c10::prim::GetAttr) {
            const std::string& attr = n->s(c10::attr::name);
            rel[n->output()] = it->second.empty() ? attr : it->second + "." + attr;
          } else if (n->kind() == c10::prim::CallMethod && it->second != path) {
            sites.push_back({path, it->second, n});  // any method of a submodule: a call of it
          }
        }
      }
    }
  }
  // The call, in `owner`'s code, whose output `v` is, through views; null when none.
  const auto producer = [&](const std::string& owner, const torch::jit::Value* v) -> const Site* {
    for (int hops = 0; hops < 8; ++hops) {
      const torch::jit::Node* n = v->node();
      for (const Site& s : sites)
        if (s.node == n && s.owner == owner) return &s;
      if (n->inputs().empty() || !is_view_like_op(n->kind().toQualString())) return nullptr;
      v = n->inputs()[0];
    }
    return nullptr;
  };
  const auto find_spec = [&](const std::string& name) -> ModuleSpec* {
    const std::string want = name.empty() ? "root" : name;
    for (ModuleSpec& s : specs)
      if (s.name == want) return &s;
    return nullptr;
  };
  const auto activation_op = [&](const std::string& name) -> std::string_view {
    const ModuleSpec* spec = find_spec(name);
    if (spec == nullptr || !spec->params.empty() || !spec->buffers.empty()) return {};
    return activation_module_op(spec->type_name);
  };
  // S -> the activation module each of its calls feeds; unpaired when that is not one module
  // for all of them, or the module also takes anything else.
  std::map<std::string, std::string> feeds;
  std::set<std::string> unpaired;
  for (const Site& m : sites) {
    if (activation_op(m.callee).empty()) continue;
    const Site* s = m.node->inputs().size() == 2 ? producer(m.owner, m.node->inputs()[1]) : nullptr;
    // In the same block: a call under an `if` or in a loop the other is not in would not pair.
    // And M the only follow-up of S's output: an activation function on it (or on a view of
    // it) first, or the output leaving the block, would take the name at run time.
    if (s == nullptr || s->node->owningBlock() != m.node->owningBlock() || followed_elsewhere(s->node, m.node)) {
      unpaired.insert(m.callee);
      continue;
    }
    const auto [it, fresh] = feeds.emplace(s->callee, m.callee);
    if (!fresh && it->second != m.callee) unpaired.insert(s->callee);
  }
  for (const auto& [s, m] : feeds) {
    if (unpaired.count(s) != 0 || unpaired.count(m) != 0) continue;
    ModuleSpec* spec = find_spec(s);
    if (spec == nullptr || spec->attention || spec->opaque || (spec->params.empty() && spec->buffers.empty()))
      continue;
    // Every call of S feeds a call of M, and every call of M takes an output of S: one M call
    // per S call, in order.
    std::set<const torch::jit::Node*> feeding;  // the calls of S some call of M takes
    std::size_t s_calls = 0, m_calls = 0;
    for (const Site& site : sites) {
      s_calls += site.callee == s ? 1 : 0;
      if (site.callee != m) continue;
      ++m_calls;
      if (const Site* from = producer(site.owner, site.node->inputs()[1]); from != nullptr && from->callee == s)
        feeding.insert(from->node);
    }
    std::size_t s_sites = 0;
    for (const Site& site : sites) s_sites += site.callee == s && feeding.count(site.node) != 0 ? 1 : 0;
    if (s_calls == 0 || s_calls != m_calls || s_sites != s_calls) continue;
    const ModuleSpec* act = find_spec(m);
    spec->activations.push_back({std::string(activation_op(m)), act->name, act->type_name});
  }
}

/// A TorchScript model and its submodules, root first, as attach() describes them.
inline std::vector<ModuleSpec> jit_specs_of(const torch::jit::Module& model) {
  // torch.jit.freeze and optimize_for_inference drop the model's `training` attribute with
  // the rest they fold, whatever attributes or submodules they keep (preserved_attrs, a buffer
  // its forward updates), and leave the folded weights as tensor constants in its code. A
  // scripted or traced model always has `training`; one defined in C++ (`Module::define`) may
  // lack it, and holds no tensor constant unless frozen.
  if (!model.hasattr("training") && holds_tensor_constants(model))
    throw Error(
        "torchdbg: attach: this TorchScript model is frozen (torch.jit.freeze or "
        "optimize_for_inference): the weights it folded into its code are constants no operator "
        "can be told apart by. Attach the model before freezing it");
  std::vector<ModuleSpec> out;
  bool any_tensor = false;
  for (const auto& item : model.named_modules()) {  // the model first, as ""
    ModuleSpec spec;
    spec.name = item.name.empty() ? "root" : item.name;
    spec.type_name = jit_type_name(item.value);
    // torch.nn's own (a class of the user's with a name alike is not: its forward is its own)
    spec.attention = spec.type_name == "torch.nn.modules.activation.MultiheadAttention";
    spec.python_attention = spec.attention;
    if (spec.attention) spec.batch_first = attention_batch_first(item.value);
    for (const auto& p : item.value.named_parameters(/*recurse=*/false)) spec.params.emplace_back(p.name, p.value);
    for (const auto& b : item.value.named_buffers(/*recurse=*/false)) spec.buffers.emplace_back(b.name, b.value);
    spec.opaque = !spec.attention && applies_weights_apart(item.value, spec);
    any_tensor = any_tensor || !spec.params.empty() || !spec.buffers.empty();
    out.push_back(std::move(spec));
  }
  name_activation_modules(model, out);
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
/// "torch.nn.modules.linear.Linear"}, an activation module of torch.nn under its own name where
/// the model's code pairs its calls with one module's ("b0.act"), other activations after a
/// module as "<module>/<activation>", every parameter's gradient with {"parameter": name}, and the
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
