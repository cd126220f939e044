// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
//
// A project using torchdbg as a package (find_package, Release) or a subdirectory (built as
// Debug, without NDEBUG: RecordFunction's inputs() differs there, and attach must still see
// every forward output).
#include <torch/torch.h>
#include <torchdbg/torchdbg.hpp>

#include <iostream>
#include <string>
#include <vector>

int main() {
  torchdbg::HookManager hooks;
  hooks.create_tensor_inspection_hook({"fc"});
  const auto results = hooks.execute_hooks("fc1", at::arange(12, at::kFloat).reshape({3, 4}), true);
  const auto latest = hooks.inspector.latest("fc1");
  if (results.size() != 1 || !results[0].second.ok() || !latest || latest->stats.mean != 5.5) {
    std::cerr << "consumer: unexpected result\n";
    return 1;
  }

  auto net = torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 16),
                                   torch::nn::Tanh(), torch::nn::Linear(16, 2));
  torchdbg::HookManager attached;
  std::vector<std::string> names;
  attached.register_callback("names", [&](const torchdbg::HookContext& c) {
    if (c.is_forward()) names.emplace_back(c.layer_name());
  });
  attached.register_hook(torchdbg::HookConfig().trigger(torchdbg::HookTrigger::every_forward()).actions(
      {torchdbg::HookAction::custom_callback("names")}));
  auto session = torchdbg::attach(*net, attached);
  const std::vector<std::string> expected = {"0", "0/relu", "2", "2/tanh", "4"};
  for (int step = 0; step < 10; ++step) {
    names.clear();
    net->forward(torch::randn({4, 8})).sum().backward();
    if (names != expected) {
      std::cerr << "consumer: step " << step << " delivered " << names.size() << " forward outputs:";
      for (const auto& n : names) std::cerr << " " << n;
      std::cerr << "\n";
      return 1;
    }
  }
  std::cout << "consumer ok: torchdbg " << torchdbg::version_string() << "\n";
  return 0;
}
