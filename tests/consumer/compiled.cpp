// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
//
// A project in the fast-build mode: torchdbg/lite.hpp and the installed compiled library
// (torchdbg::compiled), the README's quick start on a model held on the stack, and the
// single-thread variants (NullMutex), which the library holds too.
#include <torch/torch.h>
#include <torchdbg/lite.hpp>

#include <iostream>
#include <string>

#ifndef TORCHDBG_COMPILED_LIB
#error "torchdbg::compiled must define TORCHDBG_COMPILED_LIB for its users"
#endif

struct Net : torch::nn::Module {
  Net() : fc1(register_module("fc1", torch::nn::Linear(8, 16))), fc2(register_module("fc2", torch::nn::Linear(16, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};

template <typename Manager, typename Monitor>
int run(double lr, const std::string& expect) {
  torch::manual_seed(0);
  Net model;
  torch::optim::SGD opt(model.parameters(), lr);
  Manager hooks;
  Monitor health(torchdbg::HealthOptions().on_failure(torchdbg::OnFailure::Pause));
  auto fed = health.install(hooks);
  auto session = torchdbg::attach(model, hooks);
  int64_t steps = 0;
  for (int64_t step = 0; step < 60 && !hooks.is_paused(); ++step) {
    hooks.set_step(step);
    opt.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(model.forward(torch::randn({32, 8})),
                                                     torch::randint(0, 4, {32}));
    hooks.set_loss(loss.item<double>());
    loss.backward();
    if (hooks.is_paused()) break;
    opt.step();
    ++steps;
  }
  const std::string summary = torchdbg::diagnose(health).summary();
  std::cout << "lr " << lr << ": " << steps << " steps, " << session.forward_deliveries()
            << " forward deliveries; " << summary << "\n";
  if (session.forward_deliveries() == 0 || summary.find(expect) == std::string::npos) {
    std::cerr << "consumer (compiled): expected '" << expect << "'\n";
    return 1;
  }
  return 0;
}

int main() {
  int rc = run<torchdbg::HookManager, torchdbg::HealthMonitor>(0.05, "No failure detected");
  rc |= run<torchdbg::HookManagerSt, torchdbg::HealthMonitorSt>(0.05, "No failure detected");
  rc |= run<torchdbg::HookManager, torchdbg::HealthMonitorSt>(1e4, "Most likely cause");
  if (rc == 0) std::cout << "consumer (compiled): ok\n";
  return rc;
}
