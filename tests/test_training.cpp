// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
// The pause contract inside a real LibTorch training loop.
#include <torchdbg/hook_manager.hpp>

#include <chrono>
#include <functional>
#include <thread>

#include "helpers.hpp"

using torchdbg::HookAction;
using torchdbg::HookCondition;
using torchdbg::HookConfig;
using torchdbg::HookTrigger;

namespace {

struct Mlp : torch::nn::Module {
  Mlp() {
    fc1 = register_module("fc1", torch::nn::Linear(8, 32));
    fc2 = register_module("fc2", torch::nn::Linear(32, 1));
  }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};

struct Run {
  std::vector<double> losses;          // loss of every executed step
  std::vector<int64_t> paused_at;      // steps at which the loop saw the flag
  int64_t steps_executed = 0;
};

/// Trains until `steps` steps have run; the learning rate jumps at `boost_step` so the loss
/// explodes. `on_pause` decides how the loop waits while paused.
Run train(torchdbg::HookManager& hooks, int64_t steps, int64_t boost_step,
          const std::function<void(Mlp&)>& on_pause) {
  torch::manual_seed(0);
  auto model = std::make_shared<Mlp>();
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.01));
  auto x = torch::randn({64, 8});
  auto y = x.sum(1, true);
  auto pause = hooks.pause_flag();
  Run run;
  for (int64_t step = 0; step < steps; ++step) {
    if (step == boost_step) {
      for (auto& g : opt.param_groups()) static_cast<torch::optim::SGDOptions&>(g.options()).lr(2.0);
    }
    hooks.set_step(step);
    opt.zero_grad();
    auto h = torch::relu(model->fc1(x));
    auto loss = torch::mse_loss(model->fc2(h), y);
    const double lv = loss.item<double>();
    hooks.set_loss(lv);
    hooks.execute_hooks("fc1", h, true);
    loss.backward();
    hooks.execute_hooks("fc1", model->fc1->weight.grad(), false, {{"parameter", "weight"}});
    run.losses.push_back(lv);
    if (pause->load()) {
      run.paused_at.push_back(step);
      on_pause(*model);
      if (pause->load()) break;  // not resumed: stop training
    }
    opt.step();
    ++run.steps_executed;
  }
  return run;
}

}  // namespace

TEST_CASE("a loss alert pauses training at the first step past the threshold, resume continues", "[training]") {
  torchdbg::HookManager hooks;
  const double threshold = 1e3;
  hooks.register_hook(HookConfig()
                          .name("loss guard")
                          .trigger(HookTrigger::conditional(HookCondition::loss_above(threshold) ||
                                                            HookCondition::loss_non_finite()))
                          .actions({HookAction::alert("loss exploded", torchdbg::AlertSeverity::Critical),
                                    HookAction::pause_training("loss above 1e3")})
                          .max_executions(1));
  hooks.create_tensor_inspection_hook({"fc"});
  int pauses_seen = 0;
  const auto run = train(hooks, 60, 20, [&](Mlp&) {
    ++pauses_seen;
    hooks.resume_training();
  });
  // The step the manager must have paused at, found independently from the losses.
  int64_t expected = -1;
  for (std::size_t i = 0; i < run.losses.size(); ++i) {
    if (!(run.losses[i] <= threshold)) {
      expected = static_cast<int64_t>(i);
      break;
    }
  }
  REQUIRE(expected >= 20);  // the boosted learning rate made it explode
  REQUIRE(run.paused_at.size() == 1);
  CHECK(run.paused_at[0] == expected);
  CHECK(pauses_seen == 1);
  CHECK(run.steps_executed == 60);  // resumed and ran to the end
  const auto alerts = hooks.alerts();
  REQUIRE_FALSE(alerts.empty());
  CHECK(alerts[0].step == expected);
  CHECK(alerts[0].message == "loss exploded");
  CHECK(hooks.inspector.latest("fc1"));
  CHECK(hooks.inspector.latest("fc1")->step == 59);
}

TEST_CASE("while paused the loop does not advance until another thread resumes it", "[training]") {
  torchdbg::HookManager hooks;
  hooks.register_hook(HookConfig()
                          .name("pause at 5")
                          .trigger(HookTrigger::conditional(HookCondition::step_range(5, 5)))
                          .actions({HookAction::pause_training()}));
  std::atomic<bool> params_changed_while_paused{false};
  std::atomic<int64_t> step_seen_by_watcher{-1};
  std::thread watcher;
  const auto run = train(hooks, 10, 1000, [&](Mlp& model) {
    // The loop's side of the contract: stop advancing and poll.
    watcher = std::thread([&hooks, &model, &params_changed_while_paused, &step_seen_by_watcher] {
      auto before = model.fc1->weight.detach().clone();
      step_seen_by_watcher = hooks.step();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      params_changed_while_paused = !torch::equal(before, model.fc1->weight.detach());
      hooks.resume_training();
    });
    while (hooks.pause_flag()->load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    watcher.join();
  });
  CHECK(run.paused_at == std::vector<int64_t>{5});
  CHECK(step_seen_by_watcher == 5);
  CHECK_FALSE(params_changed_while_paused);
  CHECK(run.steps_executed == 10);
}

TEST_CASE("a pause that is never resumed stops the loop at that step", "[training]") {
  torchdbg::HookManager hooks;
  hooks.register_hook(HookConfig()
                          .trigger(HookTrigger::conditional(HookCondition::step_range(3, 100)))
                          .actions({HookAction::pause_training("stop")}));
  const auto run = train(hooks, 10, 1000, [](Mlp&) {});
  CHECK(run.paused_at == std::vector<int64_t>{3});
  CHECK(run.steps_executed == 3);
  CHECK(hooks.pause_info()->step == 3);
}
