// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
//
// A GAN with torchdbg: a DCGAN-style generator and discriminator (as in PyTorch's C++ dcgan
// example) under one parent module, one `attach`, a health monitor that pauses on failures.
// Each step runs three backward passes (the discriminator on real images, on generated
// ones, then the generator through the discriminator) and calls the discriminator three
// times. The generator's tanh output saturates by design (images in [-1, 1]): one line of
// HealthOptions says so. After a healthy stretch the discriminator's learning rate is raised
// 1000x; torchdbg pauses and names the discriminator.
//
//   gan [steps before the learning rate is raised]      (default: 150)
#include <fmt/format.h>
#include <torch/torch.h>

#include <cstdlib>
#include <torchdbg/lite.hpp>

namespace {

namespace nn = torch::nn;

struct Generator : nn::Module {
  explicit Generator(int64_t noise)
      : conv1(register_module("conv1", nn::ConvTranspose2d(nn::ConvTranspose2dOptions(noise, 64, 4).bias(false)))),
        bn1(register_module("bn1", nn::BatchNorm2d(64))),
        conv2(register_module(
            "conv2", nn::ConvTranspose2d(nn::ConvTranspose2dOptions(64, 32, 4).stride(2).padding(1).bias(false)))),
        bn2(register_module("bn2", nn::BatchNorm2d(32))),
        conv3(register_module(
            "conv3", nn::ConvTranspose2d(nn::ConvTranspose2dOptions(32, 1, 4).stride(2).padding(1).bias(false)))) {}
  torch::Tensor forward(torch::Tensor z) {  // [N, noise, 1, 1] -> [N, 1, 16, 16]
    auto x = torch::relu(bn1(conv1(z)));
    x = torch::relu(bn2(conv2(x)));
    return torch::tanh(conv3(x));
  }
  nn::ConvTranspose2d conv1;
  nn::BatchNorm2d bn1;
  nn::ConvTranspose2d conv2;
  nn::BatchNorm2d bn2;
  nn::ConvTranspose2d conv3;
};

struct Discriminator : nn::Module {
  Discriminator()
      : conv1(register_module("conv1", nn::Conv2d(nn::Conv2dOptions(1, 32, 4).stride(2).padding(1).bias(false)))),
        conv2(register_module("conv2", nn::Conv2d(nn::Conv2dOptions(32, 64, 4).stride(2).padding(1).bias(false)))),
        bn2(register_module("bn2", nn::BatchNorm2d(64))),
        conv3(register_module("conv3", nn::Conv2d(nn::Conv2dOptions(64, 1, 4).bias(false)))) {}
  torch::Tensor forward(torch::Tensor x) {  // [N, 1, 16, 16] -> [N]
    x = torch::leaky_relu(conv1(x), 0.2);
    x = torch::leaky_relu(bn2(conv2(x)), 0.2);
    return torch::sigmoid(conv3(x)).view({-1});
  }
  nn::Conv2d conv1, conv2;
  nn::BatchNorm2d bn2;
  nn::Conv2d conv3;
};

/// Both models under one parent: one attach sees every call of either.
struct Gan : nn::Module {
  explicit Gan(int64_t noise)
      : generator(register_module("generator", std::make_shared<Generator>(noise))),
        discriminator(register_module("discriminator", std::make_shared<Discriminator>())) {}
  std::shared_ptr<Generator> generator;
  std::shared_ptr<Discriminator> discriminator;
};

/// Real images: a bright blob at a random place on a dark background, in [-1, 1].
torch::Tensor real_batch(int64_t n) {
  const auto grid = torch::arange(16, torch::kFloat);
  const auto cy = torch::randint(4, 12, {n, 1, 1, 1}).to(torch::kFloat);
  const auto cx = torch::randint(4, 12, {n, 1, 1, 1}).to(torch::kFloat);
  const auto d2 = (grid.view({1, 1, 16, 1}) - cy).pow(2) + (grid.view({1, 1, 1, 16}) - cx).pow(2);
  return torch::exp(-d2 / 8.0) * 2.0 - 1.0;
}

}  // namespace

int main(int argc, char** argv) {
  torch::manual_seed(1);
  torch::set_num_threads(1);
  const int64_t boost_at = argc > 1 ? std::atoll(argv[1]) : 150;
  constexpr int64_t kNoise = 16, kBatch = 32;

  auto gan = std::make_shared<Gan>(kNoise);
  auto& G = gan->generator;
  auto& D = gan->discriminator;
  torch::optim::Adam opt_g(G->parameters(), torch::optim::AdamOptions(2e-4).betas({0.5, 0.999}));
  torch::optim::Adam opt_d(D->parameters(), torch::optim::AdamOptions(2e-4).betas({0.5, 0.999}));

  // [snippet gan]
  torchdbg::HookManager hooks;
  torchdbg::HealthMonitor health(
      torchdbg::HealthOptions()
          .on_failure(torchdbg::OnFailure::Pause)
          // the generator's output tanh saturates by design: images in [-1, 1]
          .expected({{"generator\\.conv3/tanh", torchdbg::FailureKind::Saturation}}));
  auto installed = health.install(hooks);
  auto session = torchdbg::attach(*gan, hooks);  // both models, every call

  for (int64_t step = 0; step < boost_at + 100; ++step) {
    hooks.set_step(step);
    // The discriminator: real images, then generated ones (two backward passes).
    D->zero_grad();
    const auto real = real_batch(kBatch);
    const auto loss_real = torch::binary_cross_entropy(D->forward(real), torch::ones({kBatch}));
    loss_real.backward();
    const auto fake = G->forward(torch::randn({kBatch, kNoise, 1, 1}));
    const auto loss_fake = torch::binary_cross_entropy(D->forward(fake.detach()), torch::zeros({kBatch}));
    loss_fake.backward();
    // The discriminator's loss is the one to watch: it turns non-finite or spikes when
    // either model breaks, while the generator's swings by design.
    hooks.set_loss((loss_real + loss_fake).item<double>());
    if (hooks.is_paused()) break;  // the update would spread the failure
    opt_d.step();
    // The generator, through the discriminator (a third pass and call).
    G->zero_grad();
    const auto loss_g = torch::binary_cross_entropy(D->forward(fake), torch::ones({kBatch}));
    loss_g.backward();
    if (hooks.is_paused()) break;
    opt_g.step();
    if (step == boost_at) {
      fmt::print("step {}: healthy so far ({} incidents); discriminator learning rate x1000\n", step,
                 health.incidents().size());
      for (auto& g : opt_d.param_groups()) static_cast<torch::optim::AdamOptions&>(g.options()).lr(0.2);
    }
  }
  // [/snippet gan]

  if (auto info = hooks.pause_info()) {
    fmt::print("training PAUSED at step {} ({}): {}\n", info->step, info->layer, info->reason);
  } else {
    fmt::print("training ran to the end\n");
  }
  fmt::print("diagnosis: {}\n", torchdbg::diagnose(health).summary());
  return 0;
}
