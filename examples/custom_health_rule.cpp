// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
//
// A health rule of your own. The built-in rules judge dead units, saturation, explosions,
// vanishing gradients and the loss; this one flags a classifier whose logits grow so large
// that its softmax is saturated (overconfidence). Its findings become states, events,
// incidents, a pause and a hypothesis of diagnose(), like the built-in rules' findings.
#include <torch/torch.h>
#include <torchdbg/torchdbg.hpp>

#include <cmath>
#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join

namespace {

// [snippet rule]
/// Flags the output of the layers named `layer` when its largest |logit| exceeds `limit`.
class OverconfidentLogits : public torchdbg::HealthRule {
 public:
  OverconfidentLogits(std::string layer, double limit) : layer_(std::move(layer)), limit_(limit) {}

  std::string name() const override { return "overconfident_logits"; }

  std::optional<torchdbg::Finding> check_activation(const torchdbg::ActivationSignals& s) override {
    if (s.layer != layer_) return std::nullopt;
    const double largest = std::max(std::fabs(s.stats.min), std::fabs(s.stats.max));
    if (!(largest > limit_)) return std::nullopt;
    auto f = torchdbg::Finding::custom("overconfident_logits", largest, limit_,
                                       "logits up to " + fmt::format("{:.1f}", largest) +
                                           ": the softmax is saturated (label smoothing or weight decay help)");
    f.details["largest_logit"] = largest;
    return f;
  }

 private:
  std::string layer_;
  double limit_;
};
// [/snippet]

struct Classifier : torch::nn::Module {
  Classifier()
      : hidden(register_module("hidden", torch::nn::Linear(16, 32))),
        head(register_module("head", torch::nn::Linear(32, 4))) {}
  torch::Tensor forward(const torch::Tensor& x) { return head(torch::relu(hidden(x))); }
  torch::nn::Linear hidden, head;
};

}  // namespace

int main() {
  torch::manual_seed(0);
  auto model = std::make_shared<Classifier>();
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.5));
  // An easy task: labels from a linear teacher. Without regularization the logits keep growing.
  const auto x = torch::randn({256, 16});
  const auto y = x.matmul(torch::randn({16, 4})).argmax(1);

  torchdbg::HookManager hooks;
  // [snippet install]
  torchdbg::HealthMonitor health(torchdbg::HealthOptions()
                                     .rules({std::make_shared<OverconfidentLogits>("head", 25.0)})
                                     .on_failure(torchdbg::OnFailure::Pause)
                                     .pause_on({torchdbg::FailureKind::Custom}));
  auto installed = health.install(hooks);
  auto session = torchdbg::attach(*model, hooks);
  fmt::print("rules: {}\n", fmt::join(health.rule_names(), ", "));
  // [/snippet]

  int64_t step = 0;
  for (; step < 2000 && !hooks.is_paused(); ++step) {
    hooks.set_step(step);
    opt.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(model->forward(x), y);
    hooks.set_loss(loss.item<double>());
    loss.backward();
    opt.step();
  }
  hooks.set_step(step);
  if (hooks.is_paused()) fmt::print("training PAUSED at step {}: {}\n", step - 1, hooks.pause_info()->reason);
  const auto d = torchdbg::diagnose(health);
  fmt::print("diagnosis: {}\n", d.summary());
  return d.top() != nullptr && d.top()->kind == torchdbg::FailureKind::Custom ? 0 : 1;
}
