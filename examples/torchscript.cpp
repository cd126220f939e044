// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
//
// A model scripted or traced in Python, loaded with torch::jit::load and fine-tuned in C++
// with torchdbg watching it: every layer's output and gradient, the health monitor, and the
// diagnosis when a layer blows up. Run it with a model file (`torchscript model.pt`, a model
// taking a (batch, 8) input); without one it defines a small TorchScript model itself.
#include <torch/csrc/jit/passes/tensorexpr_fuser.h>
#include <torch/script.h>
#include <torch/torch.h>
#include <torchdbg/jit.hpp>
#include <torchdbg/torchdbg.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join

namespace {

/// What `torch.jit.script` of this Python model gives:
///   class Net(nn.Module):  fc1 = Linear(8, 16), fc2 = Linear(16, 4)
///       def forward(self, x): return self.fc2(torch.relu(self.fc1(x)))
torch::jit::Module define_model() {
  auto linear = [](const char* type, int64_t in, int64_t out) {
    torch::jit::Module m(type);
    m.register_parameter("weight", (torch::randn({out, in}) / std::sqrt(static_cast<double>(in))).requires_grad_(), false);
    m.register_parameter("bias", torch::zeros({out}).requires_grad_(), false);
    m.define("def forward(self, x):\n  return torch.linear(x, self.weight, self.bias)\n");
    return m;
  };
  torch::jit::Module net("Net");
  net.register_module("fc1", linear("Linear1", 8, 16));
  net.register_module("fc2", linear("Linear2", 16, 4));
  net.define("def forward(self, x):\n  return self.fc2.forward(torch.relu(self.fc1.forward(x)))\n");
  return net;
}

}  // namespace

int main(int argc, char** argv) {
  torch::manual_seed(0);
  // The graph executor's fuser off: an activation fused into a kernel has no delivery, and
  // where LibTorch has LLVM (Debian's 2.6) compiling a CPU kernel can take minutes.
  torch::jit::setTensorExprFuserEnabled(false);
  // [snippet torchscript]
  torch::jit::Module model = argc > 1 ? torch::jit::load(argv[1]) : define_model();
  model.train();
  std::vector<at::Tensor> params;
  for (const auto& p : model.parameters()) params.push_back(p);
  torch::optim::SGD opt(params, 0.01);

  torchdbg::HookManager hooks;
  torchdbg::HealthMonitor health(torchdbg::HealthOptions().on_failure(torchdbg::OnFailure::Pause));
  auto fed = health.install(hooks);
  auto session = torchdbg::attach(model, hooks);  // torchdbg/jit.hpp
  // [/snippet]
  fmt::print("attached to: {}\n", fmt::join(session.module_names(), ", "));

  int64_t step = 0;
  for (; step < 60 && !hooks.is_paused(); ++step) {
    hooks.set_step(step);
    if (step == 40) {  // a bad update to the first layer, as a learning rate x1000 would make
      torch::NoGradGuard no_grad;
      params.front().mul_(1e3);
    }
    opt.zero_grad();
    const auto x = torch::randn({32, 8});
    const auto out = model.forward({x}).toTensor();
    auto loss = torch::mse_loss(out, torch::tanh(x.narrow(1, 0, out.size(1))));
    hooks.set_loss(loss.item<double>());
    loss.backward();
    if (hooks.is_paused()) break;
    opt.step();
  }
  fmt::print("forward outputs delivered: {}, gradients: {}\n", session.forward_deliveries(),
             session.backward_deliveries());
  if (const auto info = hooks.pause_info())
    fmt::print("training PAUSED at step {} in '{}': {}\n", info->step, info->layer, info->reason);
  fmt::print("diagnosis: {}\n", torchdbg::diagnose(health).summary());
  return 0;
}
