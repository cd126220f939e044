// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
//
// The demo: an MLP trained on synthetic data with torchdbg watching every layer. Midway the
// learning rate is raised until the loss explodes; an alert hook pauses training, the loop
// sees the pause flag between steps, prints what the debugger recorded, restores the last
// good checkpoint with a sane learning rate and resumes.
#include <torch/torch.h>
#include <torchdbg/torchdbg.hpp>

#include <fmt/format.h>

#include <cstdio>
#include <sstream>

namespace {

struct Mlp : torch::nn::Module {
  Mlp(int64_t in, int64_t hidden, int64_t classes)
      : fc1(register_module("fc1", torch::nn::Linear(in, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, hidden))),
        fc3(register_module("fc3", torch::nn::Linear(hidden, classes))) {}
  torch::nn::Linear fc1, fc2, fc3;
};

std::string serialize(torch::nn::Module& m) {
  std::ostringstream os;
  torch::serialize::OutputArchive ar;
  m.save(ar);
  ar.save_to(os);
  return os.str();
}

void restore(torch::nn::Module& m, const std::string& bytes) {
  std::istringstream is(bytes);
  torch::serialize::InputArchive ar;
  ar.load_from(is);
  m.load(ar);
}

}  // namespace

int main() {
  torch::manual_seed(42);
  torch::set_num_threads(1);
  constexpr int64_t kSteps = 400, kBoostStep = 200, kBatch = 128, kIn = 64, kClasses = 10;

  // Synthetic, learnable data: the class is the argmax of a fixed random projection.
  const auto projection = torch::randn({kIn, kClasses});
  auto make_batch = [&] {
    auto x = torch::randn({kBatch, kIn});
    return std::make_pair(x, x.matmul(projection).argmax(1));
  };

  auto model = std::make_shared<Mlp>(kIn, 128, kClasses);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  auto set_lr = [&](double lr) {
    for (auto& g : opt.param_groups()) static_cast<torch::optim::SGDOptions&>(g.options()).lr(lr);
  };

  // The debugger: statistics of every layer's output and gradient, and a guard on the loss.
  torchdbg::HookManager hooks(
      torchdbg::HookManagerOptions()
          .inspector(torchdbg::InspectorOptions().sample_rate(0.1).exploding_gradient_norm(50.0))
          .visualizer(torchdbg::VisualizerOptions().histogram_bins(12)));
  hooks.create_tensor_inspection_hook({"^fc"});
  hooks.create_gradient_tracking_hook({"^fc"});
  hooks.register_hook(torchdbg::HookConfig()
                          .name("loss guard")
                          .trigger(torchdbg::HookTrigger::conditional(
                              torchdbg::HookCondition::loss_above(10.0) ||
                              torchdbg::HookCondition::loss_non_finite()))
                          .actions({torchdbg::HookAction::alert("loss exploded", torchdbg::AlertSeverity::Critical),
                                    torchdbg::HookAction::pause_training("loss above 10 or not finite")}));
  auto pause = hooks.pause_flag();

  std::string checkpoint = serialize(*model);
  int64_t checkpoint_step = 0;
  for (int64_t step = 0; step < kSteps; ++step) {
    if (step == kBoostStep) {
      fmt::print("step {:>3}: raising the learning rate to 8.0 (a bad schedule)\n", step);
      set_lr(8.0);
    }
    auto [x, target] = make_batch();
    opt.zero_grad();
    auto h1 = torch::relu(model->fc1(x));
    auto h2 = torch::relu(model->fc2(h1));
    auto logits = model->fc3(h2);
    auto loss = torch::cross_entropy_loss(logits, target);
    loss.backward();

    hooks.set_step(step);
    hooks.set_loss(loss.item<double>());
    hooks.execute_hooks("fc1/relu", h1, true);
    hooks.execute_hooks("fc2/relu", h2, true);
    hooks.execute_hooks("fc3", logits, true);
    for (const auto& [name, layer] : {std::pair<const char*, torch::nn::Linear&>{"fc1", model->fc1},
                                      {"fc2", model->fc2}, {"fc3", model->fc3}}) {
      hooks.execute_hooks(name, layer->weight.grad(), false, {{"parameter", "weight"}});
    }

    // Between steps the loop polls the flag; the manager never blocks.
    if (pause->load()) {
      const auto info = hooks.pause_info();
      fmt::print("\nstep {:>3}: training PAUSED: {} (loss {:.4g})\n", step, info ? info->reason : "?",
                 loss.item<double>());
      fmt::print("alerts so far ({} total, last 5):\n", hooks.alert_count());
      auto alerts = hooks.alerts();
      for (std::size_t i = alerts.size() > 5 ? alerts.size() - 5 : 0; i < alerts.size(); ++i) {
        fmt::print("  [{}] step {} {}: {}\n", torchdbg::to_string(alerts[i].severity), alerts[i].step,
                   alerts[i].layer, alerts[i].message);
      }
      fmt::print("\nlatest layer statistics:\n{}", hooks.visualizer.summary_table());
      for (const char* g : {"fc1.weight/grad", "fc2.weight/grad", "fc3.weight/grad"}) {
        const auto hist = hooks.inspector.gradient_history(g);
        if (hist.size() >= 2) {
          fmt::print("  {:<16} gradient L2 norm {:>10.4g} -> {:>10.4g}\n", g, hist[hist.size() - 2].l2_norm,
                     hist.back().l2_norm);
        }
      }
      fmt::print("\n{}", hooks.visualizer.ascii_histogram("fc2/relu", 30));
      fmt::print("\nrestoring the checkpoint of step {} with learning rate 0.05 and resuming\n\n",
                 checkpoint_step);
      restore(*model, checkpoint);
      opt.state().clear();  // drop the momentum built up by the bad steps
      set_lr(0.05);
      hooks.resume_training();
      continue;  // this step's update is skipped
    }
    if (step % 25 == 0) {  // the weights that gave this step's healthy loss
      checkpoint = serialize(*model);
      checkpoint_step = step;
    }
    opt.step();
    if (step % 50 == 0 || step == kSteps - 1) {
      fmt::print("step {:>3}: loss {:.4f}, alerts {}\n", step, loss.item<double>(), hooks.alert_count());
    }
  }
  fmt::print("\nfinished {} steps; hook statistics:\n", kSteps);
  for (const auto& [id, cfg] : hooks.get_all_hooks()) {
    const auto s = *hooks.get_hook_stats(id);
    fmt::print("  {:<20} executions {:>5}  errors {}  mean {:.1f} us\n", cfg.name(), s.executions, s.errors,
               s.mean_time_us());
  }
  return 0;
}
