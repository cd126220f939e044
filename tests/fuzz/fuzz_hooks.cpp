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
  // Every pattern is fuzzed: RE2 matches in time linear in the name, (a+)+ included.
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
