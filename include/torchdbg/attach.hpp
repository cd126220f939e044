// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// Attaching a HookManager to any torch::nn::Module without changing the model's code.
//
// Mechanism (measured and chosen on LibTorch 1.13, valid on 2.x):
// * Backward: a tensor hook on every parameter of every attached module delivers the
//   gradient (`is_forward == false`, metadata {"parameter": name}) as autograd produces it.
//   The hook is registered on a parameter's first attach and stays for the tensor's life
//   (sessions subscribe to it): LibTorch cannot add or remove a tensor hook safely while a
//   backward pass on another thread may run it, and detach() must be safe at any time.
//   The first hook of a backward pass queues an autograd final callback, which computes the
//   per-module gradient norms (one host copy for all modules), reports the global norm to
//   the manager (`set_gradient_norm`) and, with `auto_step`, advances the step. A pass that
//   throws (LibTorch then drops its final callbacks) is noticed when the pass is freed: it is
//   counted (`failed_backward_passes`), its partial norms are dropped and the next pass
//   starts afresh.
// * Forward: Module::forward is not virtual and `fc1(x)` inside a user's forward never
//   passes through any registry, so the output is observed one level down: an ATen
//   RecordFunction observer sees every operator with its inputs and outputs. An operator
//   that takes a module's own parameter or buffer (or a tensor derived only from them, such
//   as `weight.t()`) together with data is attributed to that module; the outermost such
//   operator wins (nested ones are ignored). Each call of a module is one delivery with
//   metadata {"call": "<k>"}, its index among the module's calls in the step (from 0; the
//   count restarts at each step change and each backward pass), so `fc(a) + fc(b)` and a
//   Siamese encoder's two branches deliver two outputs, calls 0 and 1, as PyTorch's forward
//   hooks fire twice. An operator of the same module that consumes the call's output and
//   reads module tensors the call has not read yet continues the call (`x.matmul(w) + b`
//   delivers the sum once); one that reads the same tensors again (`fc(fc(x))`) is a new
//   call. The output is delivered when the next operator consumes it or another module
//   starts (at the latest when backward begins).
//   A parameter-free activation (relu, tanh, sigmoid, gelu, softmax, ... as a function or a
//   module) that consumes a module's output is delivered as "<module>/<activation>", e.g.
//   "fc1/relu" with metadata {"activation": "relu", "call": "0"}, also when view-like
//   operators (view, reshape, transpose, permute, flatten, squeeze, unsqueeze, contiguous,
//   expand, ...) stand between them: `relu(fc1(x).view(n, 2, 4))` delivers "fc1" as fc1
//   returned it and "fc1/relu" in the view's shape; an elementwise function that can make
//   finite values non-finite (log, sqrt, rsqrt, reciprocal, exp, pow, ...) is delivered the
//   same way with metadata {"op": "log"}, so a NaN born there is attributed to it. Module
//   outputs carry {"module_type": "torch::nn::LinearImpl"}; the first module output after a
//   step change also carries {"input_rms": "<RMS of its data input>"} and, when the input
//   holds NaN or ±Inf, {"input_nan": "<count>", "input_inf": "<count>"}. Operators inside
//   backward are ignored.
// * Tied weights: a tensor several modules read (`decoder->weight = tok->weight`, also by
//   assigning a built-in layer's `weight`/`bias` member) belongs to all of them; an
//   operator goes to the module whose kind fits it (an embedding lookup to the Embedding, a
//   matmul or linear to the Linear, a convolution to the Conv), then to the one whose own
//   tensors it reads most (a bias outranks a shared weight), then to the one called least in
//   the step. The tensor's gradient is delivered once, under the module that registered it
//   first, with metadata {"tied": "decoder.weight"} naming the others; it counts once in
//   the gradient norms, toward that module.
// * MultiheadAttention: its output is the attention output (what it returns), delivered
//   under its own name; its packed q/k/v projection is internal, and `out_proj`, whose
//   weights it applies itself, has gradients but no forward output of its own (as in
//   PyTorch, where out_proj's forward never runs).
// * Tensors on a device (StatsBatching::Device, the default): a delivery never syncs. Its
//   statistics are reduced on the device into 14 doubles and queued; at the end of the
//   backward pass (or at the next step change, `flush()`, or when `max_deferred` deliveries
//   are queued) every queued vector of a device is stacked and copied to the host at once,
//   and the queued deliveries run their hooks then, in arrival order, with those statistics.
//   The gradient norms come from the same copy. A queued tensor is held until then: hooks see
//   its data as it is at that time (an in-place change made later in the step shows), and a
//   gradient held this way is copied, not stolen, by AccumulateGrad. CPU tensors are handled
//   at once (StatsBatching::All queues them too, StatsBatching::PerDelivery queues nothing).
// * Cost: the observer is registered only while some hook could fire for a forward call at
//   the current step (HookManager::may_fire, re-evaluated on every set_step and hook change)
//   and removed otherwise, so a step with no hook due runs no torchdbg code in the forward.
//   It is also removed from the first backward node of a pass to the pass's end (unless
//   AttachOptions::concurrent_forward). Gradient hooks cost one atomic check when no hook is
//   due.
//
// Not forward outputs: in-place updates of a module's own tensors and the operators they run
// inside, operators that take a parameter together with its own gradient (optimizer
// arithmetic such as weight decay), operators that use a parameter only as a shape or dtype
// template (`g.view_as(weight)`: gradient all-reduce code does this), fresh tensors shaped
// like a parameter (`zeros_like(weight)`, `new_*`: optimizer state such as Adam's `exp_avg`,
// which is therefore never taken for the module's own), and by default anything run with
// gradients disabled (AttachOptions::no_grad_forward opts in to observing evaluation passes
// under torch::NoGradGuard). Tested with SGD (momentum, Nesterov, weight decay), Adam
// (weight decay, AMSGrad), AdamW, RMSprop (centered, momentum) and Adagrad, with and without
// no_grad_forward.
//
// Limits (attribution follows the operators; a module's forward is not itself observable):
// - a module whose forward runs several operator groups on its own tensors with something
//   between them (two linear maps of its own weights with an activation between) reports
//   each group as a call of its own;
// - a module's tensors used outside its forward (`torch::linear(h, emb->weight)` in the
//   parent's forward) are attributed to that module, as a call of it;
// - two modules of the same kind that share every tensor an operator reads (two bias-free
//   Linears tied to one weight) are told apart only by call order: the first use in a step
//   goes to the first registered;
// - a module output that nothing consumes before the step ends is delivered at the step
//   change or `flush()`, and an in-place change made to it before then is what hooks see;
// - an operator that reads a module's output before its activation does (a
//   `y.detach().clone()` kept for logging between `fc(x)` and `relu`) is what the output
//   was consumed by: the activation after it is not delivered as "<module>/<activation>".
// Where a call must be seen exactly as the module made it (one delivery per call, the
// returned tensor, read/replace/stop), route it through torchdbg: `Hooked<>` members or
// `hooked_call` (hooked.hpp).

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/arg.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "torchdbg/detail/pattern.hpp"
#include "torchdbg/error.hpp"
#include "torchdbg/hook_context.hpp"
#include "torchdbg/hook_manager.hpp"

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
  /// (Hogwild-style training). By default the operator observer is removed for the rest of a
  /// backward pass once it starts (it would only box operators it ignores, about 2% of an MLP
  /// step); with this set it stays, so those concurrent forward passes are seen.
  TORCH_ARG(bool, concurrent_forward) = false;
  /// When statistics come to the host and hooks run; see StatsBatching.
  TORCH_ARG(StatsBatching, batching) = StatsBatching::Device;
  /// Queued deliveries that force an early copy (bounds the tensors held when no backward pass
  /// or step change comes, e.g. in inference). At least 1.
  TORCH_ARG(int64_t, max_deferred) = 1024;
};

namespace detail {

using WeakImpl = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;

inline WeakImpl weak_of(const at::Tensor& t) { return WeakImpl(t.getIntrusivePtr()); }

#ifndef NDEBUG
// In a translation unit built without NDEBUG (a Debug build), RecordFunction::inputs()
// asserts on `inputs_valid_`, a member that exists only in such builds: LibTorch, built with
// NDEBUG, never sets it, and the assert reads a padding byte of LibTorch's object. It fails
// at random, each failure building a c10::Error with a backtrace (milliseconds), and the
// operator's inputs are lost. The observer sets the member before reading the inputs; in
// LibTorch's layout the byte is padding after `called_start_callbacks_` (1.13 and 2.x).
// The member is reached through an explicit instantiation (which ignores access), per
// translation unit (unnamed namespace).
namespace {
template <bool at::RecordFunction::*Member>
struct RecordFunctionInputsValid {
  friend bool at::RecordFunction::*record_function_inputs_valid() { return Member; }
};
bool at::RecordFunction::*record_function_inputs_valid();
template struct RecordFunctionInputsValid<&at::RecordFunction::inputs_valid_>;
}  // namespace
#endif

/// Marks this thread as running torchdbg's own work (deliveries, hooks, statistics): the
/// forward observer ignores the operators run meanwhile. (RecordFunction stays on: turning it
/// off per scope copies its thread-local state in LibTorch 1.13, which costs more than the
/// boxing it saves.)
class DeliveringScope {
 public:
  DeliveringScope() { ++depth(); }
  ~DeliveringScope() { --depth(); }
  DeliveringScope(const DeliveringScope&) = delete;
  DeliveringScope& operator=(const DeliveringScope&) = delete;
  static bool active() { return depth() > 0; }

 private:
  static int& depth() {
    thread_local int d = 0;
    return d;
  }
};

/// Operators whose output, when they consume a module's output, is delivered too: activations
/// ("<module>/relu") and elementwise functions that can turn finite values into NaN/Inf
/// ("<module>/log"). Indices into this table identify them.
struct FollowUpOps {
  static constexpr const char* kNames[] = {
      "relu",     "relu6",      "leaky_relu",  "elu",       "selu",       "celu",     "gelu",
      "silu",     "mish",       "tanh",        "sigmoid",   "softplus",   "softmax",  "log_softmax",
      "hardtanh", "hardsigmoid", "hardswish",  "threshold", "softsign",   "tanhshrink", "logsigmoid",
      // math: the first index of the elementwise functions
      "log",      "log2",       "log10",       "log1p",     "sqrt",       "rsqrt",    "reciprocal",
      "exp",      "exp2",       "expm1",       "pow",       "acos",       "asin",     "atanh",
      "acosh",    "lgamma",     "digamma",     "erfinv"};
  static constexpr int kFirstMath = 21;
  static constexpr int kCount = static_cast<int>(sizeof(kNames) / sizeof(kNames[0]));

  /// "aten::relu_" -> index of "relu", "aten::_softmax" -> index of "softmax"; -1 for any
  /// other operator.
  static int find(std::string_view op) {
    if (op.substr(0, 6) != "aten::") return -1;
    op.remove_prefix(6);
    if (!op.empty() && op.front() == '_') op.remove_prefix(1);
    if (!op.empty() && op.back() == '_') op.remove_suffix(1);
    for (int i = 0; i < kCount; ++i)
      if (op == kNames[i]) return i;
    return -1;
  }
  static bool is_math(int i) { return i >= kFirstMath; }
};

constexpr bool same_name(const char* a, const char* b) {
  return *a == *b && (*a == '\0' || same_name(a + 1, b + 1));
}
static_assert(same_name(FollowUpOps::kNames[FollowUpOps::kFirstMath - 1], "logsigmoid") &&
                  same_name(FollowUpOps::kNames[FollowUpOps::kFirstMath], "log"),
              "kFirstMath must point at the first elementwise function");

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

/// State shared by a session, its gradient hooks and the forward observer. Held by
/// shared_ptr so that a hook still running while the session detaches finds it alive.
class AttachCore : public std::enable_shared_from_this<AttachCore> {
 public:
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
    /// Attached only so that its tensors are recognised (an unselected out_proj): no
    /// gradients, no name of its own.
    bool hidden = false;
  };

  static uint64_t next_id() {
    static std::atomic<uint64_t> n{0};
    return ++n;
  }

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

  /// Unique in the process (never reused, unlike an address): what thread-local state that
  /// outlives a session names it by.
  const uint64_t id = next_id();
  AttachOptions options;
  std::vector<Module> modules;
  /// Own parameters and buffers of attached modules -> the modules that registered them, in
  /// module order (several for tied weights). The weak references in `keep` hold the
  /// addresses, so a freed tensor's address is never reused for another.
  std::unordered_map<const c10::TensorImpl*, std::vector<std::size_t>> owner;
  std::vector<WeakImpl> keep;

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

  /// Adds `m` when it owns parameters or buffers; false otherwise.
  bool add_module(const std::string& name, torch::nn::Module& m, bool hidden) {
    const auto params = m.named_parameters(/*recurse=*/false);
    const auto buffers = m.named_buffers(/*recurse=*/false);
    if (params.is_empty() && buffers.is_empty()) return false;
    const std::size_t idx = modules.size();
    Module info;
    info.name = name;
    info.type_name = m.name();
    info.forward_md = Metadata{{"module_type", info.type_name}};
    info.kind = kind_of_module(info.type_name);
    info.forward_as = idx;
    info.hidden = hidden;
    const auto own = [&](const at::Tensor& t) {
      auto& list = owner[t.unsafeGetTensorImpl()];
      if (std::find(list.begin(), list.end(), idx) == list.end()) list.push_back(idx);
      keep.push_back(weak_of(t));
    };
    const auto members = member_tensors(m);
    for (const auto& p : params) {
      // `decoder->weight = emb->weight` ties the member the forward reads; the registered
      // entry keeps the old tensor, which no operator uses. The member is the module's.
      at::Tensor t = p.value();
      for (const auto& [member, tensor] : members)
        if (member == p.key() && tensor.defined()) t = tensor;
      info.params.push_back({p.key(), weak_of(t), Metadata{{"parameter", p.key()}}});
      own(t);
    }
    for (const auto& b : buffers)
      if (b.value().defined()) own(b.value());
    modules.push_back(std::move(info));
    return true;
  }

  /// Once every module is added: the call counters, and {"tied": "<module>.<param>, ..."} on
  /// the gradient of a parameter other modules registered too.
  void finish_modules() {
    calls_ = std::make_unique<std::atomic<uint32_t>[]>(modules.size());
    for (std::size_t i = 0; i < modules.size(); ++i) calls_[i].store(0);
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
  /// The step the call counters belong to.
  std::atomic<int64_t> calls_step{std::numeric_limits<int64_t>::min()};
  /// Calls of module `m` seen since the step (or the backward pass) began.
  [[nodiscard]] uint32_t calls(std::size_t m) const { return calls_[m].load(std::memory_order_relaxed); }
  /// The index of a new call of module `m` in this step: 0 for its first.
  uint32_t next_call(std::size_t m) { return calls_[m].fetch_add(1, std::memory_order_relaxed); }
  /// A new step or backward pass: calls count from 0 again.
  void reset_calls() {
    for (std::size_t i = 0; i < modules.size(); ++i) calls_[i].store(0, std::memory_order_relaxed);
  }

  std::atomic<bool> active{true};
  std::atomic<bool> forward_due{false};
  std::atomic<bool> backward_due{false};
  /// Whether a hook due for gradients reads sign counts (BasicHookManager::reads_sign_counts):
  /// the gradient statistics computed here for the norms are shared with the hooks.
  std::atomic<bool> gradient_signs{true};
  /// Set at each step change: the next module output also reports the RMS of its data input
  /// (the model's input), so the first layer's gain is known too.
  std::atomic<bool> input_due{true};
  std::atomic<uint64_t> forward_deliveries{0};
  std::atomic<uint64_t> backward_deliveries{0};
  /// Backward passes with hooks due that threw before their end (their norm is not reported).
  std::atomic<uint64_t> failed_passes{0};
  /// Copies that brought queued statistics to the host (one per device per flush).
  std::atomic<uint64_t> host_transfers{0};

  std::function<void(std::string_view, const at::Tensor&, bool, const Metadata&, const TensorStats*,
                     const Prefetched*)>
      deliver;
  /// The manager's prefetches for a delivery being queued (BasicHookManager::run_prefetches).
  std::function<std::vector<std::pair<std::string, at::Tensor>>(std::string_view, const at::Tensor&, bool,
                                                                const Metadata&)>
      prefetch;
  std::function<void(double)> report_gradient_norm;
  std::function<void()> report_failed_pass;
  std::function<void()> advance_step;

  /// Whether a delivery of `t` is queued for the step's batch rather than run at once.
  [[nodiscard]] bool defers(const at::Tensor& t) const {
    switch (options.batching()) {
      case StatsBatching::PerDelivery:
        return false;
      case StatsBatching::Device:
        return !t.device().is_cpu();
      default:
        return true;
    }
  }

  /// The moments of a module's data input, reported as "input_rms": on the host, or packed
  /// on the input's device (not synced yet).
  struct InputMoments {
    std::optional<Moments> host;
    at::Tensor packed;
  };

  /// Sends one tensor to the manager, or queues it (see StatsBatching); never throws.
  /// `base_md` is copied only when the input's RMS is added to it.
  void send(std::size_t module, std::string_view name, const at::Tensor& t, bool is_forward,
            const Metadata& base_md, const TensorStats* precomputed = nullptr, InputMoments input = {}) {
    if (!active.load()) return;
    if (is_forward) {
      note_order(module);
      forward_deliveries.fetch_add(1);
    } else {
      backward_deliveries.fetch_add(1);
    }
    DeliveringScope scope;  // the statistics' operators and the hooks' are not forward outputs
    std::optional<Metadata> own;  // base_md plus "input_rms", once a step
    const auto md_with_input = [&](const Moments& m) {
      if (!own) own = base_md;
      add_input_rms(*own, m);
    };
    try {
      if (input.host) md_with_input(*input.host);
    } catch (...) {
    }
    const Metadata& md = own ? *own : base_md;
    if (precomputed == nullptr && defers(t)) {
      try {
        Deferred d{module, std::string(name), t, is_forward, md, pack_moments(t.detach()),
                   input.packed, {}};
        if (prefetch) d.extras = prefetch(name, t, is_forward, md);
        bool full = false;
        {
          std::lock_guard<std::mutex> lock(defer_mutex_);
          deferred_.push_back(std::move(d));
          full = static_cast<int64_t>(deferred_.size()) >= options.max_deferred();
        }
        if (full) flush_deferred();
        return;
      } catch (...) {
        // could not reduce on the device: deliver at once, the hooks compute what they need
      }
    }
    try {
      if (input.packed.defined()) md_with_input(unpack_moments(input.packed.to(at::kCPU)));
      deliver(name, t, is_forward, own ? *own : base_md, precomputed, nullptr);
    } catch (...) {
      // execute_hooks turns hook failures into results; anything else (bad_alloc) is
      // dropped rather than thrown into an operator or the autograd engine.
    }
  }

  /// Brings every queued delivery's statistics to the host (one copy per device) and runs
  /// their hooks in arrival order; never throws.
  void flush_deferred() {
    std::vector<Deferred> batch;
    {
      std::lock_guard<std::mutex> lock(defer_mutex_);
      batch.swap(deferred_);
    }
    if (batch.empty()) return;
    DeliveringScope scope;
    const std::size_t n = batch.size();
    std::vector<std::optional<Moments>> stats(n), inputs(n);
    std::vector<Prefetched> extras(n);
    try {
      std::vector<at::Device> devices;
      for (const auto& d : batch)
        if (std::find(devices.begin(), devices.end(), d.packed.device()) == devices.end())
          devices.push_back(d.packed.device());
      for (const at::Device& dev : devices) {
        // Everything queued on `dev`, laid end to end: moments, input moments, prefetches.
        std::vector<at::Tensor> parts;
        for (const auto& d : batch) {
          if (d.packed.device() != dev) continue;
          parts.push_back(d.packed);
          if (d.input_packed.defined()) parts.push_back(d.input_packed.to(dev));
          for (const auto& e : d.extras) parts.push_back(e.second.to(dev, at::kDouble));
        }
        const at::Tensor host = at::cat(parts).to(at::kCPU, at::kDouble).contiguous();
        host_transfers.fetch_add(1);
        const double* v = host.data_ptr<double>();
        for (std::size_t i = 0; i < n; ++i) {
          if (batch[i].packed.device() != dev) continue;
          stats[i] = unpack_moments(v);
          v += kPackedMoments;
          if (batch[i].input_packed.defined()) {
            inputs[i] = unpack_moments(v);
            v += kPackedMoments;
          }
          for (const auto& e : batch[i].extras) {
            const auto len = static_cast<std::size_t>(e.second.numel());
            extras[i][e.first].assign(v, v + len);
            v += len;
          }
        }
      }
    } catch (...) {
      // the copy failed (a device error): the deliveries still run and compute their own
      for (auto& s : stats) s.reset();
      for (auto& s : inputs) s.reset();
      for (auto& e : extras) e.clear();
    }
    for (std::size_t i = 0; i < n; ++i) {
      Deferred& d = batch[i];
      try {
        std::optional<TensorStats> s;
        if (stats[i]) s = stats_from_moments(*stats[i], d.tensor);
        if (inputs[i]) add_input_rms(d.md, *inputs[i]);
        if (!d.is_forward && s) add_gradient_square(d.module, s->l2_norm * s->l2_norm);
        if (active.load()) deliver(d.name, d.tensor, d.is_forward, d.md, s ? &*s : nullptr, &extras[i]);
      } catch (...) {
      }
    }
    // The queue's buffer serves the next step: no reallocation per step.
    batch.clear();
    std::lock_guard<std::mutex> lock(defer_mutex_);
    if (deferred_.empty() && deferred_.capacity() < batch.capacity()) deferred_.swap(batch);
  }

  void on_grad(std::size_t m, std::size_t param, const at::Tensor& g);

  [[nodiscard]] std::vector<std::string> execution_order() const {
    std::lock_guard<std::mutex> lock(order_mutex_);
    std::vector<std::string> out;
    for (auto i : order_) out.push_back(modules[i].name);
    return out;
  }
  [[nodiscard]] std::vector<std::pair<std::string, double>> gradient_norms() const {
    std::lock_guard<std::mutex> lock(grad_mutex_);
    return last_norms_;
  }

  /// A forward delivery's name and metadata: the module's output (`op` -1: its name,
  /// {"module_type", ..., "call", "<k>"}) or a follow-up operator's ("<module>/<op>",
  /// {"activation"|"op": op, "call": "<k>"}), for the module's call `call` in the step. Built
  /// on first use and kept for the first kCachedCalls calls, so a step builds no strings.
  struct FollowUp {
    std::string name;
    Metadata md;
  };
  static constexpr uint32_t kCachedCalls = 4096;
  std::shared_ptr<const FollowUp> delivery_info(std::size_t module, int op, uint32_t call) {
    const auto make = [&] {
      auto f = std::make_shared<FollowUp>();
      if (op < 0) {
        f->name = modules[module].name;
        f->md = modules[module].forward_md;
      } else {
        const char* n = FollowUpOps::kNames[op];
        f->name = modules[module].name + "/" + n;
        f->md.emplace(FollowUpOps::is_math(op) ? "op" : "activation", n);
      }
      f->md.emplace("call", std::to_string(call));
      return std::shared_ptr<const FollowUp>(std::move(f));
    };
    if (call >= kCachedCalls) return make();
    std::lock_guard<std::mutex> lock(follow_mutex_);
    auto& slot = follow_ups_[{module, op, call}];
    if (!slot) slot = make();
    return slot;
  }

 private:
  struct Deferred {
    std::size_t module;
    std::string name;
    at::Tensor tensor;
    bool is_forward;
    Metadata md;
    at::Tensor packed;        // kPackedMoments doubles, on the tensor's device
    at::Tensor input_packed;  // the data input's, or undefined
    std::vector<std::pair<std::string, at::Tensor>> extras;  // the manager's prefetches
  };

  /// The data input's "input_rms" and, when it holds any, "input_nan" and "input_inf" counts.
  static void add_input_rms(Metadata& md, const Moments& m) {
    if (m.nan > 0) md.emplace("input_nan", std::to_string(m.nan));
    if (m.pos_inf + m.neg_inf > 0) md.emplace("input_inf", std::to_string(m.pos_inf + m.neg_inf));
    if (m.finite <= 0) return;
    char buf[40];
    std::snprintf(buf, sizeof buf, "%.17g", std::sqrt(m.sum_squares() / static_cast<double>(m.finite)));
    md.emplace("input_rms", buf);
  }

  void add_gradient_square(std::size_t m, double sq) {
    if (!options.gradient_norms()) return;
    std::lock_guard<std::mutex> lock(grad_mutex_);
    if (grad_sq_.size() < modules.size()) grad_sq_.resize(modules.size());
    grad_sq_[m].seen = true;
    grad_sq_[m].sum += sq;
  }

  void note_order(std::size_t m) {
    std::lock_guard<std::mutex> lock(order_mutex_);
    if (seen_.size() < modules.size()) seen_.assign(modules.size(), 0);
    if (!seen_[m]) {
      seen_[m] = 1;
      order_.push_back(m);
    }
  }

  void on_backward_end() {
    end_queued_.store(false);
    flush_deferred();  // the step's queued statistics, gradients' included: one copy per device
    if (active.load() && options.gradient_norms()) {
      std::vector<std::pair<std::string, double>> norms;
      double total = 0.0;
      {
        std::lock_guard<std::mutex> lock(grad_mutex_);
        for (std::size_t i = 0; i < grad_sq_.size(); ++i) {
          if (!grad_sq_[i].seen) continue;
          norms.emplace_back(modules[i].name, std::sqrt(grad_sq_[i].sum));
          total += grad_sq_[i].sum;
          grad_sq_[i] = GradSq{};
        }
        if (!norms.empty()) last_norms_ = norms;
      }
      if (!norms.empty() && report_gradient_norm) {
        try {
          report_gradient_norm(std::sqrt(total));
        } catch (...) {
        }
      }
    }
    if (active.load() && options.auto_step() && advance_step) {
      try {
        advance_step();
      } catch (...) {
      }
    }
  }

  /// The pass threw: what it queued is delivered (those gradients were computed), its partial
  /// norms are dropped, the step does not advance, and the next pass starts afresh.
  void on_backward_failed() noexcept {
    end_queued_.store(false);
    failed_passes.fetch_add(1);
    flush_deferred();
    try {
      {
        std::lock_guard<std::mutex> lock(grad_mutex_);
        for (auto& g : grad_sq_) g = GradSq{};
      }
      if (active.load() && report_failed_pass) report_failed_pass();
    } catch (...) {
    }
  }

  mutable std::mutex order_mutex_;
  std::vector<std::size_t> order_;
  std::vector<char> seen_;
  mutable std::mutex grad_mutex_;
  /// A module's squared gradient norm during one backward pass.
  struct GradSq {
    bool seen = false;
    double sum = 0.0;
  };
  std::vector<GradSq> grad_sq_;
  std::vector<std::pair<std::string, double>> last_norms_;
  std::atomic<bool> end_queued_{false};
  std::mutex follow_mutex_;
  std::map<std::tuple<std::size_t, int, uint32_t>, std::shared_ptr<const FollowUp>> follow_ups_;
  std::unique_ptr<std::atomic<uint32_t>[]> calls_;
  std::mutex defer_mutex_;
  std::vector<Deferred> deferred_;
};

inline void AttachCore::on_grad(std::size_t m, std::size_t param, const at::Tensor& g) {
  if (!active.load()) return;
  // The end-of-backward callback is needed for norms and queued deliveries (when hooks are
  // due) and auto_step only: a step with nothing due costs this one check per gradient.
  const bool due = backward_due.load();
  if ((due || options.auto_step()) && !end_queued_.exchange(true)) {
    std::weak_ptr<AttachCore> self = weak_from_this();
    const bool queued = queue_pass_end(
        [self] {
          if (auto s = self.lock()) s->on_backward_end();
        },
        [self] {
          if (auto s = self.lock()) s->on_backward_failed();
        });
    if (!queued) end_queued_.store(false);  // not inside a backward pass (a manual hook call)
  }
  if (!due || !g.defined()) return;
  const Metadata& md = modules[m].params[param].grad_md;
  if (defers(g)) {  // the norm comes with the batch
    send(m, modules[m].name, g, false, md);
    return;
  }
  std::optional<TensorStats> stats;
  if (options.gradient_norms()) {
    // One pass: the same statistics serve the norm and every hook of this delivery.
    try {
      stats = compute_stats(g, StatsOptions().sign_counts(gradient_signs.load()));
      add_gradient_square(m, stats->l2_norm * stats->l2_norm);
    } catch (...) {
    }
  }
  send(m, modules[m].name, g, false, md, stats ? &*stats : nullptr);
}

/// The one tensor hook torchdbg puts on a parameter, shared by every session that watches it.
/// LibTorch's tensor hooks cannot be added or removed while a backward pass may run them
/// (removal frees the hook while it runs; adding may move the list being walked), so a tap
/// is registered once, on the first attach, and stays for the tensor's life: sessions
/// subscribe and unsubscribe under the tap's own lock, from any thread, at any time. With no
/// subscriber a tap costs one list check per gradient.
class GradientTap {
 public:
  struct Subscriber {
    std::shared_ptr<AttachCore> core;
    std::size_t module = 0;
    std::size_t param = 0;
  };

  /// The tap of `t`, registering its hook if `t` has none yet.
  static std::shared_ptr<GradientTap> of(const at::Tensor& t) {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mutex);
    auto& slot = r.taps[t.unsafeGetTensorImpl()];
    if (auto tap = slot.lock(); tap && !tap->tensor_.expired() && tap->tensor_._unsafe_get_target() == t.unsafeGetTensorImpl())
      return tap;
    auto tap = std::shared_ptr<GradientTap>(new GradientTap(weak_of(t)));
    // The hook owns the tap; the registry only finds it.
    t.register_hook([tap](const at::Tensor& g) { tap->fire(g); });
    slot = tap;
    if (r.taps.size() >= 2 * r.live_at_sweep + 64) {  // forget the taps of freed tensors
      for (auto it = r.taps.begin(); it != r.taps.end();)
        it = it->second.expired() ? r.taps.erase(it) : std::next(it);
      r.live_at_sweep = r.taps.size();
    }
    return tap;
  }

  void subscribe(Subscriber s) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto next = std::make_shared<List>(*std::atomic_load(&subscribers_));
    next->push_back(std::move(s));
    std::atomic_store(&subscribers_, std::shared_ptr<const List>(std::move(next)));
  }
  void unsubscribe(const AttachCore* core) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto next = std::make_shared<List>();
    const auto current = std::atomic_load(&subscribers_);
    for (const auto& s : *current)
      if (s.core.get() != core) next->push_back(s);
    std::atomic_store(&subscribers_, std::shared_ptr<const List>(std::move(next)));
  }

 private:
  using List = std::vector<Subscriber>;
  struct Registry {
    std::mutex mutex;
    std::unordered_map<const c10::TensorImpl*, std::weak_ptr<GradientTap>> taps;
    std::size_t live_at_sweep = 0;
  };
  static Registry& registry() {
    static Registry* r = new Registry();  // never destroyed: hooks may run during static destruction
    return *r;
  }

  explicit GradientTap(WeakImpl tensor) : tensor_(std::move(tensor)) {}

  void fire(const at::Tensor& g) const {
    const auto subscribers = std::atomic_load(&subscribers_);  // held for the whole loop
    for (const auto& s : *subscribers) s.core->on_grad(s.module, s.param, g);
  }

  WeakImpl tensor_;
  std::mutex mutex_;
  std::shared_ptr<const List> subscribers_ = std::make_shared<const List>();
};

/// The process-wide ATen observer behind forward attachment. RecordFunction callbacks are
/// plain function pointers, so the attached sessions live in a registry here; the callback
/// is registered while at least one session wants forward outputs.
class ForwardObserver {
 public:
  static ForwardObserver& instance() {
    static ForwardObserver o;
    return o;
  }

  /// Adds (`on`) or removes `core` from the sessions the observer serves. A detached core is
  /// never added: a manager listener racing with detach() on another thread cannot bring it
  /// back (detach clears `active` before it removes the core, both under this lock's order).
  void set(const std::shared_ptr<AttachCore>& core, bool on) {
    std::lock_guard<std::mutex> lock(mutex_);
    on = on && core->active.load();
    auto next = std::make_shared<std::vector<std::shared_ptr<AttachCore>>>();
    bool present = false;
    const auto current = cores();
    for (const auto& c : *current) {
      if (c == core) {
        present = true;
        if (!on) continue;
      }
      next->push_back(c);
    }
    if (on && !present) next->push_back(core);
    if (on == present) return;
    std::atomic_store(&cores_, std::shared_ptr<const std::vector<std::shared_ptr<AttachCore>>>(next));
    if (!next->empty() && handle_ == 0 && !paused_) {
      handle_ = add_callback();
    } else if (next->empty()) {
      if (handle_ != 0) at::removeCallback(handle_);
      handle_ = 0;
      paused_ = false;
    }
  }

  /// Called at the first backward node of a pass: removes the ATen callback until the pass
  /// ends (an autograd final callback puts it back). While registered, RecordFunction boxes
  /// every operator's inputs and outputs, backward and optimizer included: about 2% of an
  /// MLP step here, for operators the observer ignores. Not done when a session asked for
  /// `concurrent_forward` (a forward on another thread would go unobserved meanwhile).
  void pause_for_backward() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (handle_ == 0 || paused_) return;
      const auto current = cores();
      for (const auto& c : *current)
        if (c->options.concurrent_forward()) return;
    }
    // Back at the pass's end, also when the pass throws and LibTorch drops its callbacks.
    if (!queue_pass_end([] { instance().resume(); }, [] { instance().resume(); })) {
      return;  // not inside a running backward pass
    }
    std::lock_guard<std::mutex> lock(mutex_);
    if (handle_ == 0 || paused_) return;
    at::removeCallback(handle_);  // safe in a callback: running operators keep their snapshot
    handle_ = 0;
    paused_ = true;
  }

  /// Puts the callback back after a backward pass (if some session still wants it).
  void resume() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!paused_) return;
    paused_ = false;
    if (!cores()->empty() && handle_ == 0) handle_ = add_callback();
  }

  /// Whether the ATen callback is registered now.
  [[nodiscard]] bool registered() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return handle_ != 0;
  }

  /// Delivers this thread's pending output of `core` (all cores when null).
  static void flush(const AttachCore* core = nullptr) {
    Tls& t = tls();
    if (t.pending.core && (core == nullptr || t.pending.core.get() == core)) flush_pending(t);
  }

  /// Forgets this thread's pending output and derived tensors of `core` without delivering.
  static void discard(const AttachCore* core) {
    Tls& t = tls();
    if (t.pending.core.get() == core) t.pending = {};
    if (t.alias.core == core->id) t.alias = {};
    for (auto& d : t.derived)
      if (d.core == core->id) d = {};
  }

 private:
  /// A few tensor identities (the module tensors one call reads); beyond capacity, the
  /// extra ones are not remembered.
  struct TensorSet {
    std::array<const c10::TensorImpl*, 8> items{};
    std::size_t size = 0;
    void add(const c10::TensorImpl* p) {
      if (!contains(p) && size < items.size()) items[size++] = p;
    }
    [[nodiscard]] bool contains(const c10::TensorImpl* p) const {
      return std::find(items.begin(), items.begin() + static_cast<std::ptrdiff_t>(size), p) !=
             items.begin() + static_cast<std::ptrdiff_t>(size);
    }
    [[nodiscard]] bool meets(const TensorSet& o) const {
      for (std::size_t i = 0; i < size; ++i)
        if (o.contains(items[i])) return true;
      return false;
    }
  };
  struct Pending {
    std::shared_ptr<AttachCore> core;
    std::size_t module = 0;
    uint32_t call = 0;  // the module's call index in the step
    std::shared_ptr<const AttachCore::FollowUp> info;  // the delivery's name and metadata
    TensorSet used;  // the module's tensors its operators read so far in this call
    at::Tensor out;
    AttachCore::InputMoments input;
  };
  struct Derived {
    uint64_t core = 0;  // AttachCore::id; 0: empty
    std::size_t module = 0;  // alias: the module whose output it views
    uint32_t call = 0;       // alias: that output's call
    /// Weights: the module-registered tensor this one is derived from (`weight.t()`).
    const c10::TensorImpl* source = nullptr;
    std::optional<WeakImpl> impl;
  };
  /// A module an operator's tensors point to: through tensors it registered itself (direct)
  /// or through tensors derived from them (`weight.t()`).
  struct Candidate {
    std::size_t core = 0;  // index in the observer's list of sessions
    std::size_t module = 0;
    int direct = 0;
    int derived = 0;
  };
  struct Tls {
    int backward_depth = 0;
    int skip_depth = 0;
    Pending pending;
    /// A view of a delivered module output (`fc(x).view(...)`, `.transpose(...)`): an
    /// activation applied to it is still "<module>/<activation>".
    Derived alias;
    std::array<Derived, 16> derived;
    std::size_t next_derived = 0;
    std::vector<const c10::TensorImpl*> grads_of_owned;  // on_start's scratch, kept allocated
    std::array<Candidate, 8> candidates;                  // on_start's scratch
  };
  struct OpCtx : at::ObserverContext {
    /// Update: an in-place update of a module's own tensor or an optimizer's arithmetic; the
    /// operators it runs inside (`mul_` calling `mul` with a wrapped scalar) are not looked at.
    /// Internal: a step inside a module's forward that is not its output (Module::internal).
    /// Alias: a view-like operator on a module's output; its output becomes Tls::alias.
    enum Kind { Backward, Forward, Weights, Activation, Update, Internal, Alias } kind = Backward;
    std::shared_ptr<AttachCore> core;
    std::size_t module = 0;
    uint32_t call = 0;                   // Activation, Alias: the call of the module's output
    const c10::TensorImpl* source = nullptr;  // Weights
    TensorSet used;                           // Forward: the module tensors it reads
    int follow_up = -1;  // Activation: index in FollowUpOps
    std::optional<AttachCore::InputMoments> input;
  };

  static Tls& tls() {
    thread_local Tls t;
    return t;
  }

  /// Operators whose output is a view (or a reshaped or made-contiguous copy) of their input's
  /// values: a module's output seen through them is still that module's.
  static bool is_alias_op(std::string_view op) {
    static constexpr std::string_view kOps[] = {
        "aten::view",      "aten::_unsafe_view", "aten::reshape", "aten::_reshape_alias", "aten::transpose",
        "aten::t",         "aten::permute",      "aten::flatten", "aten::unflatten",      "aten::squeeze",
        "aten::unsqueeze", "aten::contiguous",   "aten::expand",  "aten::view_as",        "aten::reshape_as",
        "aten::movedim",   "aten::swapaxes",     "aten::swapdims"};
    for (const auto& k : kOps)
      if (op == k) return true;
    return false;
  }

  std::shared_ptr<const std::vector<std::shared_ptr<AttachCore>>> cores() const {
    return std::atomic_load(&cores_);
  }

  static void flush_pending(Tls& t) {
    Pending p = std::move(t.pending);
    t.pending = {};
    if (!p.core || !p.out.defined() || !p.info) return;
    p.core->send(p.module, p.info->name, p.out, true, p.info->md, nullptr, std::move(p.input));
  }

  static at::ArrayRef<const c10::IValue> safe_inputs(const at::RecordFunction& fn) {
#ifndef NDEBUG
    const_cast<at::RecordFunction&>(fn).*record_function_inputs_valid() = true;  // see above
#endif
    try {
      return fn.inputs();
    } catch (...) {
      return {};
    }
  }

  template <typename F>
  static void for_each_tensor(const c10::IValue& v, F&& f) {
    if (v.isTensor()) {
      f(v.toTensor());
    } else if (v.isTensorList()) {
      const std::vector<at::Tensor> list = v.toTensorList().vec();
      for (const at::Tensor& t : list) f(t);
    } else if (v.isList()) {
      for (const c10::IValue& e : v.toListRef())
        if (e.isTensor()) f(e.toTensor());
    } else if (v.isTuple()) {
      const auto& tuple = v.toTupleRef();
      for (const c10::IValue& e : tuple.elements())
        if (e.isTensor()) f(e.toTensor());
    }
  }

  static at::Tensor first_output(const at::RecordFunction& fn) {
    const auto& outs = fn.outputs();
    if (outs.empty()) return {};
    at::Tensor first;
    for_each_tensor(outs.front(), [&](const at::Tensor& t) {
      if (!first.defined()) first = t;
    });
    return first;
  }

  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
    Tls& t = tls();
    if (DeliveringScope::active()) return nullptr;
    if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION) {
      if (t.backward_depth == 0) {
        if (t.pending.core) flush_pending(t);
        const auto cores = instance().cores();  // held: the loop must not outlive a temporary
        for (const auto& c : *cores) c->reset_calls();  // the next forward counts from 0
      }
      if (++t.backward_depth == 1) instance().pause_for_backward();
      return std::make_unique<OpCtx>();
    }
    if (t.backward_depth > 0 || t.skip_depth > 0) return nullptr;
    const auto cores = instance().cores();
    if (cores->empty()) return nullptr;
    const bool grad_mode = at::GradMode::is_enabled();
    // An in-place operator whose `self` is a module's own tensor updates state (optimizer
    // steps, running statistics); it is never a forward output.
    const std::string_view op_name = fn.name();
    const bool in_place = !op_name.empty() && op_name.back() == '_';
    // `x.view_as(weight)`: a parameter passed as a shape or dtype template does not make the
    // operator the module's. `zeros_like(weight)`, `weight.new_zeros(...)`: a fresh tensor
    // holding none of the parameter's values (an optimizer's state, `exp_avg`), neither the
    // module's output nor derived from its weights, even with the parameter as `self`.
    auto ends_with = [&](std::string_view suf) {
      return op_name.size() >= suf.size() && op_name.substr(op_name.size() - suf.size()) == suf;
    };
    const bool fresh_op = ends_with("_like") || op_name.substr(0, 10) == "aten::new_";
    const bool template_op = ends_with("_as");
    // The modules whose tensors this operator reads (several when weights are tied).
    std::array<Candidate, 8>& cands = t.candidates;
    std::size_t ncand = 0;
    const c10::TensorImpl* source = nullptr;  // the first module tensor read, for Weights
    TensorSet used;                           // every module tensor read
    const auto add_candidates = [&](std::size_t ci, const std::vector<std::size_t>& mods, bool direct) {
      for (const std::size_t m : mods) {
        std::size_t k = 0;
        while (k < ncand && !(cands[k].core == ci && cands[k].module == m)) ++k;
        if (k == ncand) {
          if (ncand == cands.size()) continue;
          cands[ncand++] = Candidate{ci, m, 0, 0};
        }
        ++(direct ? cands[k].direct : cands[k].derived);
      }
    };
    bool has_data = false;
    at::Tensor data_in;  // the first data input
    bool consumes_pending = false, consumes_alias = false;
    const c10::TensorImpl* pending_impl =
        t.pending.core && t.pending.out.defined() ? t.pending.out.unsafeGetTensorImpl() : nullptr;
    const c10::TensorImpl* alias_impl = t.alias.core != 0 && t.alias.impl && !t.alias.impl->expired()
                                            ? t.alias.impl->_unsafe_get_target()
                                            : nullptr;
    bool first_input = true;
    bool updates_owned = false;
    const at::ArrayRef<const c10::IValue> inputs = safe_inputs(fn);
    // An operator taking a parameter together with that parameter's own gradient is an
    // optimizer's (weight decay `grad + wd * p`, ...), whatever the grad mode.
    std::vector<const c10::TensorImpl*>& grads_of_owned = t.grads_of_owned;
    grads_of_owned.clear();
    for (const c10::IValue& v : inputs) {
      for_each_tensor(v, [&](const at::Tensor& x) {
        if (!x.defined() || !x.requires_grad()) return;
        for (const auto& c : *cores) {
          if (c->owner.count(x.unsafeGetTensorImpl()) && x.grad().defined()) {
            grads_of_owned.push_back(x.grad().unsafeGetTensorImpl());
          }
        }
      });
    }
    for (const c10::IValue& v : inputs) {
      for_each_tensor(v, [&](const at::Tensor& x) {
        const bool is_self = first_input;
        first_input = false;
        if (!x.defined()) return;
        if (template_op && !is_self) return;  // a shape/dtype template, not an operand
        const c10::TensorImpl* impl = x.unsafeGetTensorImpl();
        if (fresh_op) {  // only its shape and dtype are used
          if (impl == pending_impl) consumes_pending = true;
          if (impl == alias_impl) consumes_alias = true;
          return;
        }
        for (std::size_t ci = 0; ci < cores->size(); ++ci) {
          const AttachCore& c = *(*cores)[ci];
          auto it = c.owner.find(impl);
          if (it != c.owner.end()) {
            if (!grad_mode && !c.options.no_grad_forward()) return;
            add_candidates(ci, it->second, /*direct=*/true);
            if (source == nullptr) source = impl;
            used.add(impl);
            updates_owned = updates_owned || (in_place && is_self);
            return;
          }
        }
        for (const auto& d : t.derived) {
          if (d.core != 0 && d.impl && d.impl->_unsafe_get_target() == impl && !d.impl->expired()) {
            for (std::size_t ci = 0; ci < cores->size(); ++ci) {
              const AttachCore& c = *(*cores)[ci];
              if (c.id != d.core) continue;
              auto it = c.owner.find(d.source);
              if (it == c.owner.end()) return;
              add_candidates(ci, it->second, /*direct=*/false);
              if (source == nullptr) source = d.source;
              used.add(d.source);
              return;
            }
          }
        }
        if (std::find(grads_of_owned.begin(), grads_of_owned.end(), impl) != grads_of_owned.end()) {
          updates_owned = true;  // an optimizer's arithmetic, not a forward
        }
        has_data = true;
        if (!data_in.defined()) data_in = x;
        if (impl == pending_impl) consumes_pending = true;
        if (impl == alias_impl) consumes_alias = true;
      });
    }
    if (updates_owned) {
      auto ctx = std::make_unique<OpCtx>();
      ctx->kind = OpCtx::Update;
      ++t.skip_depth;
      return ctx;
    }
    if (ncand > 0) {
      // Tied tensors: the module whose kind fits the operator (an embedding lookup vs a
      // matmul), then the one whose own tensors the operator reads most (a bias outranks a
      // shared weight), then tensors derived from its own; among modules alike in all of
      // these, the one called least in this step, then the first registered.
      std::size_t best = 0;
      if (ncand > 1) {
        const AttachCore::Kind op_kind = AttachCore::kind_of_op(op_name);
        const auto rank = [&](const Candidate& c) {
          const AttachCore& core = *(*cores)[c.core];
          const std::size_t target = core.modules[c.module].forward_as;
          return std::make_tuple(AttachCore::kind_fit(core.modules[c.module].kind, op_kind), c.direct, c.derived,
                                 -static_cast<int64_t>(core.calls(target)), -static_cast<int64_t>(c.core),
                                 -static_cast<int64_t>(c.module));
        };
        for (std::size_t k = 1; k < ncand; ++k)
          if (rank(cands[k]) > rank(cands[best])) best = k;
      }
      const std::shared_ptr<AttachCore>& owner = (*cores)[cands[best].core];
      const std::size_t module = owner->modules[cands[best].module].forward_as;
      auto ctx = std::make_unique<OpCtx>();
      ctx->core = owner;
      ctx->module = module;
      if (!has_data) {
        ctx->kind = OpCtx::Weights;  // e.g. weight.t(): remember its output as the module's
        ctx->source = source;
      } else if (owner->modules[module].internal && cands[best].module == module) {
        ctx->kind = OpCtx::Internal;
        if (t.pending.core) flush_pending(t);  // what it consumes is delivered now
        t.alias = {};
      } else {
        ctx->kind = OpCtx::Forward;
        if (owner->input_due.exchange(false) && data_in.is_floating_point()) {
          DeliveringScope scope;
          try {
            AttachCore::InputMoments in;
            if (owner->defers(data_in)) {
              in.packed = pack_moments(data_in.detach());  // no sync: comes with the batch
            } else {
              in.host = compute_moments(data_in.detach(), /*signs=*/false);  // the RMS only
            }
            ctx->input = std::move(in);
          } catch (...) {
          }
        }
        // The same module's operator on its pending output, reading module tensors the call
        // has not read yet, continues that call (`x @ w + b` as two operators); anything
        // else is a new call (`fc(a) + fc(b)`, `fc(fc(x))`), and the pending output is
        // delivered first.
        const bool continues = t.pending.core == owner && t.pending.module == module && consumes_pending &&
                               !used.meets(t.pending.used);
        ctx->used = used;
        if (t.pending.core && !continues) flush_pending(t);
      }
      ++t.skip_depth;
      return ctx;
    }
    if (consumes_pending || consumes_alias) {
      std::shared_ptr<AttachCore> core;
      std::size_t m = 0;
      uint32_t call = 0;
      if (consumes_pending) {  // the module's output as it returned it is delivered now
        core = t.pending.core;
        m = t.pending.module;
        call = t.pending.call;
        flush_pending(t);
      } else {
        for (const auto& c : *cores)
          if (c->id == t.alias.core) core = c;
        m = t.alias.module;
        call = t.alias.call;
      }
      t.alias = {};
      if (!core) return nullptr;
      if (!fresh_op && is_alias_op(op_name)) {  // a view of it: an activation may follow
        auto ctx = std::make_unique<OpCtx>();
        ctx->kind = OpCtx::Alias;
        ctx->core = std::move(core);
        ctx->module = m;
        ctx->call = call;
        ++t.skip_depth;
        return ctx;
      }
      if (core->options.activations()) {
        const int op = FollowUpOps::find(fn.name());
        if (op >= 0) {
          auto ctx = std::make_unique<OpCtx>();
          ctx->kind = OpCtx::Activation;
          ctx->core = std::move(core);
          ctx->module = m;
          ctx->call = call;
          ctx->follow_up = op;
          ++t.skip_depth;
          return ctx;
        }
      }
    }
    return nullptr;
  }

  static void on_end(const at::RecordFunction& fn, at::ObserverContext* raw) {
    if (raw == nullptr) return;
    auto* ctx = static_cast<OpCtx*>(raw);
    Tls& t = tls();
    if (ctx->kind == OpCtx::Backward) {
      --t.backward_depth;
      return;
    }
    --t.skip_depth;
    if (ctx->kind == OpCtx::Update || ctx->kind == OpCtx::Internal) return;
    at::Tensor out = first_output(fn);
    if (!out.defined()) return;
    try {
      switch (ctx->kind) {
        case OpCtx::Weights: {
          t.derived[t.next_derived] = Derived{ctx->core->id, ctx->module, 0, ctx->source, weak_of(out)};
          t.next_derived = (t.next_derived + 1) % t.derived.size();
          break;
        }
        case OpCtx::Forward: {
          Pending p;
          if (t.pending.core == ctx->core && t.pending.module == ctx->module) {  // the same call goes on
            p = std::move(t.pending);
            if (ctx->input) p.input = std::move(*ctx->input);
            for (std::size_t i = 0; i < ctx->used.size; ++i) p.used.add(ctx->used.items[i]);
          } else {
            p.used = ctx->used;
            p.core = ctx->core;
            p.module = ctx->module;
            p.call = ctx->core->next_call(ctx->module);
            p.info = ctx->core->delivery_info(ctx->module, -1, p.call);
            p.input = ctx->input.value_or(AttachCore::InputMoments{});
          }
          p.out = std::move(out);
          t.pending = std::move(p);
          break;
        }
        case OpCtx::Alias:
          t.alias = Derived{ctx->core->id, ctx->module, ctx->call, nullptr, weak_of(out)};
          break;
        case OpCtx::Activation: {
          const auto f = ctx->core->delivery_info(ctx->module, ctx->follow_up, ctx->call);
          ctx->core->send(ctx->module, f->name, out, true, f->md);
          break;
        }
        default:
          break;
      }
    } catch (...) {
      // out of memory for a name: the delivery is lost, the operator is not
    }
  }

  static at::CallbackHandle add_callback() {
    return at::addGlobalCallback(
        at::RecordFunctionCallback(&ForwardObserver::on_start, &ForwardObserver::on_end)
            .needsInputs(true)
            .needsOutputs(true)
            .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
  }

  mutable std::mutex mutex_;
  bool paused_ = false;  // removed for a running backward pass; resume() restores it
  std::shared_ptr<const std::vector<std::shared_ptr<AttachCore>>> cores_ =
      std::make_shared<const std::vector<std::shared_ptr<AttachCore>>>();
  at::CallbackHandle handle_ = 0;
};

}  // namespace detail

/// An attachment of a HookManager to a model; detaches (removing every tensor hook, the
/// observer and the manager listener) when destroyed or on `detach()`. Movable, not copyable.
/// A manager has at most one session that attaches gradients (`AttachOptions::backward`, the
/// default): its gradient norm and `auto_step` count one backward pass, so a second such
/// `attach` to the same manager throws torchdbg::Error. To watch several models with one
/// manager (a GAN's generator and discriminator), attach a module that holds them all
/// (`register_module` each). Forward-only sessions (`backward(false)`, e.g. with
/// `no_grad_forward(true)` for evaluation passes) may be added beside it.
/// The manager must outlive the session; the model need not (a session outliving its model
/// is safe, and so is a model destroyed after detaching).
///
/// Thread safety: `detach()` and the queries may be called from any thread, also while a
/// forward or backward pass runs; callbacks already running finish, later ones do nothing.
template <typename Mutex>
class BasicAttachSession {
 public:
  BasicAttachSession(torch::nn::Module& model, BasicHookManager<Mutex>& hooks, AttachOptions options)
      : hooks_(&hooks), core_(std::make_shared<detail::AttachCore>()) {
    detail::require_at_least<int64_t>(options.max_deferred(), 1, "AttachOptions::max_deferred");
    std::vector<detail::Pattern> patterns;
    for (const auto& p : options.patterns()) patterns.push_back(detail::compile_pattern(p, "attach pattern"));
    const bool gradients = options.backward();
    if (gradients && hooks.attached_.fetch_add(1) != 0) {
      hooks.attached_.fetch_sub(1);
      throw Error(
          "torchdbg: attach: this HookManager already has a session attaching gradients; one per "
          "manager keeps its gradient norm and auto_step to one backward pass. Attach a module "
          "that holds every model (register_module each), detach the other session first, use "
          "a second manager, or attach this one with AttachOptions().backward(false)");
    }
    struct Release {  // gives the place back when the constructor fails below
      BasicHookManager<Mutex>* m;
      ~Release() {
        if (m != nullptr) m->attached_.fetch_sub(1);
      }
    } release{gradients ? &hooks : nullptr};
    core_->options = std::move(options);
    // MultiheadAttention applies its out_proj child's weights in its own forward: those
    // operators produce the attention module's output, also when out_proj is not selected.
    std::vector<std::pair<std::size_t, std::shared_ptr<torch::nn::Module>>> attention;
    for (const auto& item : model.named_modules("", /*include_self=*/true)) {
      const std::string name = item.key().empty() ? "root" : item.key();
      torch::nn::Module& m = *item.value();
      if (!patterns.empty()) {
        bool hit = false;
        for (const auto& re : patterns)
          hit = hit || re.match_prefix(name);
        if (!hit) continue;
      }
      if (!core_->add_module(name, m, /*hidden=*/false)) continue;
      if (m.name() == "torch::nn::MultiheadAttention" || m.name() == "torch::nn::MultiheadAttentionImpl") {
        for (const auto& child : m.named_children())
          if (child.key() == "out_proj") attention.emplace_back(core_->modules.size() - 1, child.value());
      }
    }
    for (const auto& [mha, out_proj] : attention) {
      const std::string child = core_->modules[mha].name == "root" ? "out_proj" : core_->modules[mha].name + ".out_proj";
      std::size_t idx = core_->modules.size();
      for (std::size_t i = 0; i < core_->modules.size(); ++i)
        if (core_->modules[i].name == child) idx = i;
      if (idx == core_->modules.size() && !core_->add_module(child, *out_proj, /*hidden=*/true)) continue;
      core_->modules[idx].forward_as = mha;
      core_->modules[mha].internal = true;
    }
    core_->finish_modules();
    BasicHookManager<Mutex>* mgr = hooks_;
    core_->deliver = [mgr](std::string_view layer, const at::Tensor& t, bool fwd, const Metadata& md,
                           const TensorStats* stats, const Prefetched* extra) {
      mgr->run_checked(layer, t, fwd, md, stats, extra, /*out=*/nullptr);
    };
    core_->prefetch = [mgr](std::string_view layer, const at::Tensor& t, bool fwd, const Metadata& md) {
      return mgr->run_prefetches(layer, t, fwd, md);
    };
    core_->report_gradient_norm = [mgr](double n) { mgr->set_gradient_norm(n); };
    core_->report_failed_pass = [mgr] { mgr->backward_failed(); };
    core_->advance_step = [mgr] { mgr->set_step(mgr->step() + 1); };
    if (core_->options.backward()) {
      for (std::size_t m = 0; m < core_->modules.size(); ++m) {
        auto& params = core_->modules[m].params;
        if (core_->modules[m].hidden) continue;
        for (std::size_t i = 0; i < params.size(); ++i) {
          auto& p = params[i];
          at::Tensor t(p.impl.lock());
          if (!t.defined() || !t.requires_grad()) continue;
          // A tied tensor's gradient (the sum over its uses) comes once, under the module
          // that registered it first.
          if (core_->owner.at(t.unsafeGetTensorImpl()).front() != m) continue;
          auto tap = detail::GradientTap::of(t);
          tap->subscribe({core_, m, i});
          taps_.push_back(std::move(tap));
        }
      }
    }
    std::weak_ptr<detail::AttachCore> weak = core_;
    try {
      listener_ = hooks_->add_listener([weak, mgr](typename BasicHookManager<Mutex>::Change change) {
        auto c = weak.lock();
        if (!c) return;
        using Change = typename BasicHookManager<Mutex>::Change;
        if (change == Change::Before) {
          detail::ForwardObserver::flush(c.get());  // an output pending under the old state
          c->flush_deferred();                      // and what is queued, under the old step
        } else if (change == Change::After) {
          update(c, *mgr);
        }
      });
      update(core_, *hooks_);
    } catch (...) {  // nothing stays attached
      core_->active.store(false);
      for (const auto& tap : taps_) tap->unsubscribe(core_.get());
      if (listener_ != 0) hooks_->remove_listener(listener_);
      detail::ForwardObserver::instance().set(core_, false);
      throw;
    }
    release.m = nullptr;  // attached: detach() gives the place back
  }

  BasicAttachSession(const BasicAttachSession&) = delete;
  BasicAttachSession& operator=(const BasicAttachSession&) = delete;
  BasicAttachSession(BasicAttachSession&& o) noexcept
      : hooks_(o.hooks_), core_(std::move(o.core_)), listener_(o.listener_), taps_(std::move(o.taps_)) {
    o.hooks_ = nullptr;
  }
  BasicAttachSession& operator=(BasicAttachSession&& o) noexcept {
    if (this != &o) {
      detach();
      hooks_ = o.hooks_;
      core_ = std::move(o.core_);
      listener_ = o.listener_;
      taps_ = std::move(o.taps_);
      o.hooks_ = nullptr;
    }
    return *this;
  }
  ~BasicAttachSession() { detach(); }

  /// Removes every hook and observer this session installed; idempotent.
  void detach() noexcept {
    if (!core_ || !core_->active.load()) return;
    core_->flush_deferred();  // queued deliveries run before the hooks go
    if (!core_->active.exchange(false)) return;
    if (core_->options.backward()) hooks_->attached_.fetch_sub(1);
    try {
      hooks_->remove_listener(listener_);
      detail::ForwardObserver::instance().set(core_, false);
      detail::ForwardObserver::discard(core_.get());
      // Unsubscribed, not removed: a pass running on another thread may be calling the taps.
      for (const auto& tap : taps_) tap->unsubscribe(core_.get());
      taps_.clear();
    } catch (...) {
    }
  }

  [[nodiscard]] bool attached() const noexcept { return core_ && core_->active.load(); }

  /// Dotted names of the attached modules ("root" for the model itself), in module order.
  [[nodiscard]] std::vector<std::string> module_names() const {
    std::vector<std::string> out;
    for (const auto& m : core_->modules)
      if (!m.hidden) out.push_back(m.name);
    return out;
  }

  /// Attached modules in the order their forward outputs were first seen.
  [[nodiscard]] std::vector<std::string> execution_order() const { return core_->execution_order(); }

  /// Per-module gradient L2 norms of the last backward pass that had hooks due.
  [[nodiscard]] std::vector<std::pair<std::string, double>> gradient_norms() const {
    return core_->gradient_norms();
  }

  /// Forward outputs and gradients delivered so far.
  [[nodiscard]] uint64_t forward_deliveries() const noexcept { return core_->forward_deliveries.load(); }
  [[nodiscard]] uint64_t backward_deliveries() const noexcept { return core_->backward_deliveries.load(); }
  /// Backward passes that threw (a tensor hook, a custom Function, anomaly mode) while this
  /// session waited for their end. Such a pass reports no gradient norm and does not advance
  /// the step; the gradients it delivered before it threw were delivered; the next pass is
  /// observed as if it had not happened.
  [[nodiscard]] uint64_t failed_backward_passes() const noexcept { return core_->failed_passes.load(); }

  /// Delivers the calling thread's last module output now if it has not been consumed yet
  /// (e.g. after an inference-only forward whose result is not used by another operator),
  /// then brings every queued delivery's statistics to the host and runs their hooks.
  void flush() {
    detail::ForwardObserver::flush(core_.get());
    core_->flush_deferred();
  }

  /// Copies that brought queued statistics to the host: one per device per flush (normally
  /// one per step), never one per delivery.
  [[nodiscard]] uint64_t host_transfers() const noexcept { return core_->host_transfers.load(); }

 private:
  static void update(const std::shared_ptr<detail::AttachCore>& c, BasicHookManager<Mutex>& mgr) {
    if (!c->active.load()) return;
    const int64_t step = mgr.step();
    const bool fwd = c->options.forward() && mgr.may_fire(true, step);
    const bool bwd = c->options.backward() && mgr.may_fire(false, step);
    c->forward_due.store(fwd);
    c->backward_due.store(bwd);
    c->gradient_signs.store(bwd && mgr.reads_sign_counts(false, step));
    c->input_due.store(true);
    if (c->calls_step.exchange(step) != step) c->reset_calls();
    detail::ForwardObserver::instance().set(c, fwd);
  }

  BasicHookManager<Mutex>* hooks_;
  std::shared_ptr<detail::AttachCore> core_;
  uint64_t listener_ = 0;
  std::vector<std::shared_ptr<detail::GradientTap>> taps_;  // subscribed to for gradients
};

using AttachSession = BasicAttachSession<std::mutex>;

/// Attaches `hooks` to every module of `model` that owns parameters or buffers (or those
/// matching `options.patterns()`), without changing the model's code.
///
/// ```cpp
/// auto session = torchdbg::attach(*model, hooks);
/// // the unchanged training loop: forward outputs arrive as execute_hooks(name, out, true),
/// // gradients as execute_hooks(name, grad, false, {{"parameter", "weight"}})
/// ```
template <typename Mutex>
[[nodiscard]] BasicAttachSession<Mutex> attach(torch::nn::Module& model, BasicHookManager<Mutex>& hooks,
                                               AttachOptions options = {}) {
  return BasicAttachSession<Mutex>(model, hooks, std::move(options));
}

}  // namespace torchdbg
