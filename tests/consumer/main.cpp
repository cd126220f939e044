// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#include <torchdbg/torchdbg.hpp>

#include <iostream>

int main() {
  torchdbg::HookManager hooks;
  hooks.create_tensor_inspection_hook({"fc"});
  const auto results = hooks.execute_hooks("fc1", at::arange(12, at::kFloat).reshape({3, 4}), true);
  const auto latest = hooks.inspector.latest("fc1");
  if (results.size() != 1 || !results[0].second.ok() || !latest || latest->stats.mean != 5.5) {
    std::cerr << "consumer: unexpected result\n";
    return 1;
  }
  std::cout << "consumer ok: torchdbg " << torchdbg::version_string() << "\n";
  return 0;
}
