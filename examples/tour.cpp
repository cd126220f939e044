// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
//
// A tour of the API, one short section per guide in docs/: the hook manager, attach, exact
// hooks, health and diagnosis, a health rule of your own, and the reports. The guides' code
// blocks are excerpts of this file (ctest checks they match it, and runs it).
#include <torch/torch.h>
#include <torchdbg/torchdbg.hpp>

#include <cmath>
#include <filesystem>
#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join
#include <iostream>

namespace {

struct Net : torch::nn::Module {
  Net()
      : fc1(register_module("fc1", torch::nn::Linear(8, 16))),
        fc2(register_module("fc2", torch::nn::Linear(16, 4))) {}
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(x))); }
  torch::nn::Linear fc1, fc2;
};

/// Trains `model` for `steps` steps on random data, telling `hooks` the step and the loss;
/// stops early when training is paused.
void train(const std::shared_ptr<Net>& model, torchdbg::HookManager& hooks, int64_t steps, int64_t first_step = 0) {
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05));
  for (int64_t step = first_step; step < first_step + steps && !hooks.is_paused(); ++step) {
    hooks.set_step(step);
    opt.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(model->forward(torch::randn({32, 8})),
                                                     torch::randint(0, 4, {32}));
    hooks.set_loss(loss.item<double>());
    loss.backward();
    opt.step();
  }
}

void quick_start() {
  auto model = std::make_shared<Net>();
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05));
  // [snippet quickstart]
  torchdbg::HookManager hooks;
  torchdbg::HealthMonitor health(torchdbg::HealthOptions().on_failure(torchdbg::OnFailure::Pause));
  auto fed = health.install(hooks);                // fed by every delivery, set_step, set_loss
  auto session = torchdbg::attach(*model, hooks);  // no change to the model's code
  for (int64_t step = 0; step < 100 && !hooks.is_paused(); ++step) {
    hooks.set_step(step);
    opt.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(model->forward(torch::randn({32, 8})),
                                                     torch::randint(0, 4, {32}));
    hooks.set_loss(loss.item<double>());
    loss.backward();
    if (hooks.is_paused()) break;  // the failing step's update is not applied
    opt.step();
  }
  std::cout << torchdbg::diagnose(health).summary() << "\n";  // what went wrong, and where
  // [/snippet]
}

void hooks_section() {
  // [snippet manager]
  torchdbg::HookManager hooks;
  hooks.create_tensor_inspection_hook({"^fc"});  // regex over layer names
  hooks.create_alert_hook(torchdbg::HookCondition::loss_above(10.0), "loss exploded",
                          torchdbg::AlertSeverity::Critical);
  auto pause = hooks.pause_flag();  // shared_ptr<atomic<bool>>
  auto model = std::make_shared<Net>();
  for (int64_t step = 0; step < 3; ++step) {
    hooks.set_step(step);
    auto h = torch::relu(model->fc1(torch::randn({32, 8})));
    hooks.set_loss(h.mean().item<double>());
    hooks.execute_hooks("fc1", h, /*is_forward=*/true);  // any device, dtype, strides
    if (pause->load()) hooks.resume_training();
  }
  auto fc1 = hooks.inspector.latest("fc1");  // mean, std, NaN count, ...
  // [/snippet]
  fmt::print("manager: fc1 mean {:.3f}, NaN {}\n", fc1->stats.mean, fc1->stats.nan_count);

  // [snippet config]
  using namespace torchdbg;
  const auto dir = std::filesystem::temp_directory_path() / "torchdbg-tour";
  auto id = hooks.register_hook(HookConfig()
                                    .name("fc snapshots")
                                    .trigger(HookTrigger::every_n_steps(100))
                                    .actions({HookAction::inspect_tensor(), HookAction::save_snapshot(dir.string())})
                                    .layer_patterns({"^fc[0-9]+$"})  // RE2, searched: unanchored unless ^...$
                                    .direction(CallDirection::Forward)
                                    .max_executions(10));
  hooks.register_callback(
      "log", [](const HookContext& c) { fmt::print("{} std {:.3f}\n", c.layer_name(), c.moment_stats().std); },
      CallbackStats::Moments);
  hooks.register_hook(HookConfig().name("log").actions({HookAction::custom_callback("log")}));
  // [/snippet]
  hooks.set_step(100);
  const auto results = hooks.execute_hooks("fc1", torch::randn({4, 16}), true);
  fmt::print("config: {} hooks ran on fc1, snapshot hook executions {}\n", results.size(),
             hooks.get_hook_stats(id)->executions);
  std::filesystem::remove_all(dir);
}

void attach_section() {
  torchdbg::HookManager hooks;
  hooks.create_tensor_inspection_hook({});
  hooks.create_gradient_tracking_hook({});
  // [snippet attach]
  auto model = std::make_shared<Net>();  // your own module; fc1(x) called in forward()
  auto session = torchdbg::attach(*model, hooks, torchdbg::AttachOptions().auto_step(true));
  // ... the unchanged training loop: forward, loss, backward, optimizer step ...
  // [/snippet]
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.05));
  for (int i = 0; i < 3; ++i) {
    opt.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(model->forward(torch::randn({32, 8})),
                                                     torch::randint(0, 4, {32}));
    loss.backward();
    opt.step();
  }
  double fc1_norm = 0.0;
  for (const auto& [name, norm] : session.gradient_norms())
    if (name == "fc1") fc1_norm = norm;
  fmt::print("attach: {} steps, execution order {}, fc1 gradient norm {:.3g}\n", hooks.step(),
             fmt::join(session.execution_order(), " -> "), fc1_norm);
}

void exact_section() {
  // [snippet exact]
  struct Model : torch::nn::Module {
    torchdbg::Hooked<torch::nn::Linear> fc1{nullptr};  // one word changed
    torch::nn::Sequential body{nullptr};               // Sequential children: no change
    Model() {
      fc1 = register_module("fc1", torch::nn::Linear(4, 8));
      body = register_module("body", torch::nn::Sequential(torch::nn::Linear(8, 8), torch::nn::ReLU()));
    }
    torch::Tensor forward(torch::Tensor x) { return body->forward(fc1(x)); }  // call the holder
  };
  auto model = std::make_shared<Model>();
  auto x = torch::randn({2, 4});
  auto cache = std::make_shared<torchdbg::TensorCache>();
  {
    auto h = torchdbg::register_module_hook(model, "body[0]", torchdbg::caching_hook(cache)) +
             torchdbg::register_module_hook(model->fc1.ptr(), torchdbg::setting_hook(torch::zeros({2, 8})), "fc1");
    model->forward(x);  // fc1's output replaced by zeros; body[0]'s output cached
  }  // the handle's end removes both hooks
  auto early = torchdbg::run_until(model, x, "fc1");  // stops the forward after fc1
  torchdbg::MultiHookManager linears(torchdbg::MultiHookOptions().pattern("body\\.").classes_to_hook(
      {torchdbg::module_type<torch::nn::LinearImpl>()}));
  auto all = linears.register_hook(
      model, torchdbg::reading_hook([](const torchdbg::ModuleCall& c, const torch::Tensor& out) {
        fmt::print("{} -> {}\n", c.path, fmt::join(out.sizes(), "x"));
      }));
  // [/snippet]
  model->forward(x);
  fmt::print("exact: body.0 cached {}, fc1 output by run_until {}\n", cache->contains("body.0") ? "yes" : "no",
             fmt::join(early->get("fc1").sizes(), "x"));
}

void health_section() {
  auto model = std::make_shared<Net>();
  // [snippet health]
  torchdbg::HookManager hooks;
  torchdbg::HealthMonitor health(torchdbg::HealthOptions().on_failure(torchdbg::OnFailure::Pause));
  auto fed = health.install(hooks);  // fed by every delivery, set_step, set_loss
  auto session = torchdbg::attach(*model, hooks);
  train(model, hooks, 20);  // the training loop; it stops when hooks.is_paused()
  // the state when the failure was detected (or now, when there was none):
  const auto report = health.failure_report().value_or(health.report());
  const auto d = torchdbg::diagnose(report);
  std::cout << d.summary() << "\n" << d.to_mermaid();  // or d.to_dot(), d.to_json()
  // [/snippet]
  fmt::print("health: {} layers, {} incidents\n", health.layers().size(), health.incidents().size());
}

// [snippet rule]
/// Flags module outputs whose mean is far from zero relative to their spread.
struct MeanDrift : torchdbg::HealthRule {
  std::string name() const override { return "mean_drift"; }
  std::optional<torchdbg::Finding> check_activation(const torchdbg::ActivationSignals& s) override {
    if (!s.module_output || !(s.stats.std > 0.0)) return std::nullopt;
    const double z = std::fabs(s.stats.mean) / s.stats.std;
    if (!(z > 3.0)) return std::nullopt;
    return torchdbg::Finding::custom("mean_drift", z, 3.0, "output mean far from zero");
  }
};
// [/snippet]

void rule_section() {
  auto model = std::make_shared<Net>();
  // [snippet add-rule]
  torchdbg::HealthMonitor health(torchdbg::HealthOptions().rules({std::make_shared<MeanDrift>()}));
  // [/snippet]
  torchdbg::HookManager hooks;
  auto fed = health.install(hooks);
  auto session = torchdbg::attach(*model, hooks);
  train(model, hooks, 5);
  {
    torch::NoGradGuard no_grad;
    model->fc2->bias.add_(50.0);  // every logit +50: the loss does not change, the mean drifts
  }
  train(model, hooks, 3, 5);
  const auto d = torchdbg::diagnose(health);
  fmt::print("rule: {}\n", d.top() ? d.top()->description : std::string("no finding"));
}

void reports_section() {
  const auto dir = std::filesystem::temp_directory_path() / "torchdbg-tour-report";
  std::filesystem::create_directories(dir);
  auto model = std::make_shared<Net>();
  torchdbg::HookManager hooks;
  torchdbg::HealthMonitor health;
  auto health_fed = health.install(hooks);
  // [snippet reports]
  torchdbg::Reporter reporter(torchdbg::ReporterOptions().histogram_interval(50));
  reporter.add_exporter(std::make_shared<torchdbg::HtmlExporter>((dir / "report.html").string()));
  reporter.add_exporter(std::make_shared<torchdbg::JsonlExporter>((dir / "run.jsonl").string()));
  reporter.add_exporter(std::make_shared<torchdbg::CsvExporter>((dir / "layers.csv").string()));
  reporter.add_exporter(std::make_shared<torchdbg::SummaryJsonExporter>((dir / "summary.json").string()));
  auto fed = reporter.install(hooks, &health);  // statistics, health, events, loss per step
  auto session = torchdbg::attach(*model, hooks);
  train(model, hooks, 10);
  std::cout << torchdbg::health_table(health.layers());
  reporter.finish(torchdbg::make_summary(hooks, health));
  // [/snippet]
  fmt::print("reports: {} files, exporter errors {}\n",
             std::distance(std::filesystem::directory_iterator(dir), std::filesystem::directory_iterator{}),
             reporter.exporter_errors());
  std::filesystem::remove_all(dir);
}

}  // namespace

int main() {
  torch::manual_seed(0);
  quick_start();
  hooks_section();
  attach_section();
  exact_section();
  health_section();
  rule_section();
  reports_section();
  return 0;
}
