// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
//
// libFuzzer target: hook configuration and layer-pattern handling. The input is split on
// '\n' into layer patterns, an interval and a layer name. register_hook must either accept
// the config or throw torchdbg::Error; execute_hooks must never throw.
#include <ATen/ATen.h>
#include <torchdbg/hook_manager.hpp>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::vector<std::string> parts(1);
  for (size_t i = 0; i < size && parts.size() < 8; ++i) {
    if (data[i] == '\n') {
      parts.emplace_back();
    } else {
      parts.back().push_back(static_cast<char>(data[i]));
    }
  }
  const std::string layer = parts.back();
  parts.pop_back();
  // std::regex backtracks: a quantified group such as (a+)+, a quantifier on a quantifier
  // (`.**`) or a chain of many `.*` is exponential or high-degree polynomial in the name's
  // length (documented on HookConfig::layer_patterns). That is std::regex's cost, not
  // torchdbg's handling, so such patterns are not fuzzed.
  auto is_quant = [](char c) { return c == '*' || c == '+' || c == '?' || c == '{'; };
  for (const auto& p : parts) {
    int quantifiers = 0;
    for (size_t i = 0; i < p.size(); ++i) {
      if (!is_quant(p[i])) continue;
      if (++quantifiers > 3) return 0;
      if (i > 0 && (p[i - 1] == ')' || p[i - 1] == '}' || is_quant(p[i - 1]))) return 0;
    }
  }
  int64_t interval = parts.empty() || parts.back().empty() ? 1 : static_cast<int8_t>(parts.back()[0]);
  static torchdbg::HookManagerSt hooks;
  static const at::Tensor t = at::ones({4});
  hooks.clear_hooks();
  try {
    hooks.register_hook(torchdbg::HookConfig()
                            .name(layer)
                            .trigger(torchdbg::HookTrigger::every_n_steps(interval))
                            .actions({torchdbg::HookAction::inspect_tensor()})
                            .layer_patterns(parts));
  } catch (const torchdbg::Error&) {
    return 0;
  }
  try {
    (void)hooks.execute_hooks(layer, t, true);
  } catch (...) {
    std::abort();  // execute_hooks must contain everything
  }
  if (hooks.inspector.names().size() > 1024) hooks.inspector.clear();
  return 0;
}
