// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// Operator-level pieces of the forward observer: weak tensor identities, the scope of
// torchdbg's own work, and the follow-up operators (activations, elementwise math).

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <c10/util/intrusive_ptr.h>

#include <string_view>

namespace torchdbg::detail {

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

/// Operators whose output is a view (or a reshaped or made-contiguous copy) of their input's
/// values: a module's output seen through them is still that module's.
inline bool is_view_like_op(std::string_view op) {
  static constexpr std::string_view kOps[] = {
      "aten::view",      "aten::_unsafe_view", "aten::reshape", "aten::_reshape_alias", "aten::transpose",
      "aten::t",         "aten::permute",      "aten::flatten", "aten::unflatten",      "aten::squeeze",
      "aten::unsqueeze", "aten::contiguous",   "aten::expand",  "aten::view_as",        "aten::reshape_as",
      "aten::movedim",   "aten::swapaxes",     "aten::swapdims"};
  for (const auto& k : kOps)
    if (op == k) return true;
  return false;
}

/// Marks this thread as running torchdbg's own work (deliveries, hooks, statistics): the
/// forward observer ignores the operators run meanwhile. (RecordFunction stays on: the
/// statistics read tensor data without operators, so a delivery runs few, and turning it off
/// and on copies LibTorch's thread-local RecordFunction state, about 2.5K instructions each
/// way in 1.13.)
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
      "hardtanh", "hardsigmoid", "hardswish",  "threshold", "hardshrink", "softshrink", "log_sigmoid",
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
static_assert(same_name(FollowUpOps::kNames[FollowUpOps::kFirstMath - 1], "log_sigmoid") &&
                  same_name(FollowUpOps::kNames[FollowUpOps::kFirstMath], "log"),
              "kFirstMath must point at the first elementwise function");

}  // namespace torchdbg::detail
