// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
//
// torchdbg on a user-defined network, with no change to the network's code: every layer's
// output, the activation after it and every parameter's gradient reach the HookManager.
// Then one layer is declared torchdbg::Hooked<...> to cache and patch its output exactly.
#include <torch/torch.h>
#include <torchdbg/torchdbg.hpp>

#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join

namespace {

// The user's own model: children called directly in forward(), nothing torchdbg-specific.
struct ConvNet : torch::nn::Module {
  ConvNet()
      : conv1(register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 8, 3).padding(1)))),
        bn1(register_module("bn1", torch::nn::BatchNorm2d(8))),
        conv2(register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 16, 3).padding(1)))),
        fc(register_module("fc", torch::nn::Linear(16 * 7 * 7, 10))) {}

  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(bn1(conv1(x))), 2);
    x = torch::max_pool2d(torch::tanh(conv2(x)), 2);
    return fc(x.flatten(1));
  }

  torch::nn::Conv2d conv1;
  torch::nn::BatchNorm2d bn1;
  torch::nn::Conv2d conv2;
  torch::nn::Linear fc;
};

// The same model with one word changed: `fc` is a torchdbg::Hooked<torch::nn::Linear>.
struct PatchableNet : torch::nn::Module {
  PatchableNet() : fc(register_module("fc", torch::nn::Linear(16, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) { return torch::softmax(fc(x), 1); }
  torchdbg::Hooked<torch::nn::Linear> fc;
};

}  // namespace

int main() {
  torch::manual_seed(0);
  auto model = std::make_shared<ConvNet>();
  torch::optim::Adam opt(model->parameters(), 1e-3);

  torchdbg::HookManager hooks;
  hooks.create_tensor_inspection_hook({});  // every forward output and activation
  hooks.create_gradient_tracking_hook({});  // every parameter gradient
  auto session = torchdbg::attach(*model, hooks, torchdbg::AttachOptions().auto_step(true));
  fmt::print("attached to: {}\n", fmt::join(session.module_names(), ", "));

  for (int i = 0; i < 20; ++i) {
    auto x = torch::randn({16, 1, 28, 28});
    auto target = torch::randint(0, 10, {16});
    opt.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(model->forward(x), target);
    hooks.set_loss(loss.item<double>());
    loss.backward();  // auto_step: each backward advances the manager's step
    opt.step();
  }
  fmt::print("steps counted by backward passes: {}\n", hooks.step());
  fmt::print("forward execution order: {}\n\n", fmt::join(session.execution_order(), " -> "));
  fmt::print("{}\n", hooks.visualizer.summary_table());
  fmt::print("gradient norms of the last backward:\n");
  for (const auto& [name, norm] : session.gradient_norms()) fmt::print("  {:<6} {:.4g}\n", name, norm);
  fmt::print("\n{}", hooks.visualizer.ascii_histogram("conv2/tanh", 30));
  session.detach();

  // Exact hooks: cache fc's output on one input and patch it into a run on another.
  auto net = std::make_shared<PatchableNet>();
  auto a = torch::randn({2, 16}), b = torch::randn({2, 16});
  auto cache = std::make_shared<torchdbg::TensorCache>();
  torch::NoGradGuard no_grad;
  {
    auto h = torchdbg::register_module_hook(net->fc.ptr(), torchdbg::caching_hook(cache), "fc");
    net->forward(a);
  }
  const auto clean_b = net->forward(b);
  torch::Tensor patched_b;
  {
    auto h = torchdbg::register_module_hook(net->fc.ptr(), torchdbg::setting_hook(cache, "fc"), "fc");
    patched_b = net->forward(b);
  }
  fmt::print("\nactivation patching: b's output with fc taken from a equals a's output: {}\n",
             torch::allclose(patched_b, net->forward(a)) ? "yes" : "no");
  fmt::print("after removing the hook b's output is restored exactly: {}\n",
             torch::equal(net->forward(b), clean_b) ? "yes" : "no");
  return 0;
}
