// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#include <ATen/autocast_mode.h>
#include <torch/version.h>
#include <torchdbg/attach.hpp>
#include <torchdbg/attach/observer.hpp>  // ForwardObserver, which the compiled mode leaves out of attach.hpp
#include <torchdbg/health.hpp>

#include <functional>

#include <atomic>
#include <condition_variable>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <thread>

#include "delivery_check.hpp"
#include "helpers.hpp"

using torchdbg::AttachOptions;
using torchdbg::HookAction;
using torchdbg::HookConfig;
using torchdbg::HookManager;
using torchdbg::HookTrigger;

namespace {

// A user's own network: not a Sequential, children called directly in forward().
struct Net : torch::nn::Module {
  explicit Net(int64_t width)
      : conv(register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 4, 3).padding(1)))),
        bn(register_module("bn", torch::nn::BatchNorm2d(4))),
        fc(register_module("fc", torch::nn::Linear(4 * 6 * 6, width))),
        lstm(register_module("lstm", torch::nn::LSTM(torch::nn::LSTMOptions(width, 8).batch_first(true)))),
        emb(register_module("emb", torch::nn::Embedding(20, 8))),
        head(register_module("head", torch::nn::Linear(8, 3))) {}

  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& tokens) {
    auto h = torch::relu(bn(conv(x)));
    auto f = fc(h.flatten(1));
    auto seq = std::get<0>(lstm(f.unsqueeze(1))).squeeze(1);
    return head(seq + emb(tokens));
  }

  torch::nn::Conv2d conv;
  torch::nn::BatchNorm2d bn;
  torch::nn::Linear fc;
  torch::nn::LSTM lstm;
  torch::nn::Embedding emb;
  torch::nn::Linear head;
};

/// Records every delivered tensor (cloned) per step and name.
struct Recorder {
  std::map<int64_t, std::map<std::string, std::vector<torch::Tensor>>> fwd, bwd;
  void install(HookManager& hooks) {
    hooks.register_callback("record", [this](const torchdbg::HookContext& c) {
      std::string key(c.layer_name());
      if (auto p = c.metadata_value("parameter")) key += "." + std::string(*p);
      (c.is_forward() ? fwd : bwd)[c.step()][key].push_back(c.tensor().detach().clone());
    });
    hooks.register_hook(HookConfig().name("record").trigger(HookTrigger::every_n_steps(1)).actions(
        {HookAction::custom_callback("record")}));
  }
};

const std::vector<std::string> kForwardNames = {"conv", "bn", "bn/relu", "fc", "lstm", "emb", "head"};

}  // namespace

TEST_CASE("every child's forward output equals running that child alone, once per step", "[attach]") {
  for (int64_t width : {5, 12}) {
    torchdbg_test::SeededRng rng(100 + width);
    auto net = std::make_shared<Net>(width);
    torch::optim::SGD opt(net->parameters(), 0.05);
    HookManager hooks;
    Recorder rec;
    rec.install(hooks);
    auto session = torchdbg::attach(*net, hooks);
    CHECK(session.module_names() == std::vector<std::string>{"conv", "bn", "fc", "lstm", "emb", "head"});
    for (int64_t step = 0; step < 3; ++step) {
      hooks.set_step(step);
      auto x = torch::randn({6, 1, 6, 6});
      auto tokens = torch::randint(0, 20, {6});
      opt.zero_grad();
      auto out = net->forward(x, tokens);
      // The reference: each child run alone on the same input, before the update.
      std::map<std::string, torch::Tensor> ref;
      {
        hooks.set_enabled(false);  // the reference run must not be observed itself
        torch::NoGradGuard ng;
        ref["conv"] = net->conv(x);
        ref["bn"] = net->bn(ref["conv"]);
        ref["bn/relu"] = torch::relu(ref["bn"]);
        ref["fc"] = net->fc(ref["bn/relu"].flatten(1));
        ref["lstm"] = std::get<0>(net->lstm(ref["fc"].unsqueeze(1)));
        ref["emb"] = net->emb(tokens);
        ref["head"] = net->head(ref["lstm"].squeeze(1) + ref["emb"]);
        hooks.set_enabled(true);
      }
      torch::nn::functional::cross_entropy(out, torch::randint(0, 3, {6})).backward();
      INFO("width " << width << " step " << step);
      const auto& seen = rec.fwd[step];
      CHECK(seen.size() == kForwardNames.size());
      for (const auto& name : kForwardNames) {
        INFO("layer " << name);
        REQUIRE(seen.count(name) == 1);
        CHECK(seen.at(name).size() == 1);  // exactly once per step
        CHECK(torch::allclose(seen.at(name)[0], ref[name], 1e-6, 1e-7));
      }
      // Gradients: what autograd delivered equals param.grad after backward.
      const auto& grads = rec.bwd[step];
      for (const auto& item : net->named_parameters()) {
        INFO("parameter " << item.key());
        REQUIRE(grads.count(item.key()) == 1);
        CHECK(grads.at(item.key()).size() == 1);
        CHECK(torch::equal(grads.at(item.key())[0], item.value().grad()));
      }
      opt.step();
    }
    hooks.set_step(99);  // delivers anything still pending from step 2
    // Counted again after the optimizer steps: an update is never a forward output.
    for (int64_t step = 0; step < 3; ++step) {
      INFO("step " << step);
      CHECK(rec.fwd[step].size() == kForwardNames.size());
      for (const auto& [name, list] : rec.fwd[step]) {
        INFO("layer " << name);
        CHECK(list.size() == 1);
      }
    }
    CHECK(session.execution_order() == std::vector<std::string>{"conv", "bn", "fc", "lstm", "emb", "head"});
  }
}

TEST_CASE("a module registered under several names delivers every call under its first name", "[attach]") {
  // One Linear registered twice, and pushed into a ModuleList three times (ALBERT-style
  // sharing): PyTorch's named_modules() lists it once, under its first name, and a hook on it
  // sees each of its calls.
  struct Twice : torch::nn::Module {
    Twice() {
      fc = register_module("first", torch::nn::Linear(4, 4));
      register_module("second", fc);
      for (int i = 0; i < 3; ++i) layers->push_back(fc);
      register_module("layers", layers);
    }
    torch::Tensor forward(const torch::Tensor& x, int64_t calls) {
      torch::Tensor h = x;
      for (int64_t i = 0; i < calls; ++i) h = fc(i % 2 == 0 ? h : 2.0 * h);
      return h;
    }
    torch::nn::Linear fc{nullptr};
    torch::nn::ModuleList layers;
  };
  for (int64_t calls : {1, 2, 3, 5}) {
    torchdbg_test::SeededRng rng(40 + calls);
    auto net = std::make_shared<Twice>();
    HookManager hooks;
    Recorder rec;
    rec.install(hooks);
    auto session = torchdbg::attach(*net, hooks);
    CHECK(session.module_names() == std::vector<std::string>{"first"});
    for (int64_t step = 0; step < 2; ++step) {
      hooks.set_step(step);
      const auto x = torch::randn({3, 4});
      std::vector<torch::Tensor> ref;
      {
        hooks.set_enabled(false);
        torch::NoGradGuard ng;
        torch::Tensor h = x;
        for (int64_t i = 0; i < calls; ++i) ref.push_back(h = net->fc(i % 2 == 0 ? h : 2.0 * h));
        hooks.set_enabled(true);
      }
      net->zero_grad();
      // Two forwards in one step: the second one's calls follow the first one's.
      auto loss = net->forward(x, calls).sum() + net->forward(x, calls).sum();
      loss.backward();
      hooks.set_step(step + 100);
      INFO("calls " << calls << " step " << step);
      const auto& seen = rec.fwd[step];
      CHECK(seen.size() == 1);
      REQUIRE(seen.count("first") == 1);
      REQUIRE(seen.at("first").size() == static_cast<std::size_t>(2 * calls));
      for (std::size_t i = 0; i < seen.at("first").size(); ++i)
        CHECK(torch::allclose(seen.at("first")[i], ref[i % static_cast<std::size_t>(calls)], 1e-6, 1e-7));
      CHECK(rec.bwd[step].count("first.weight") == 1);
      CHECK(rec.bwd[step].size() == 2);  // first.weight, first.bias
    }
  }
}

TEST_CASE("property: an activation of an output changed in place is the module's, marked input_changed, with the values it made",
          "[attach]") {
  // A residual added in place before the ReLU (`out += identity`), an action mask's
  // `masked_fill_(forbidden, -inf)` before `log_softmax`: the module's output is delivered as
  // it returned it, the activation with what it made of the changed values.
  const std::vector<std::string> changes = {"masked_fill", "mul", "add", "clamp", "none"};
  const std::vector<std::string> activations = {"log_softmax", "relu", "tanh", "sigmoid", "softmax"};
  std::mt19937_64 gen(33);
  for (int trial = 0; trial < 30; ++trial) {
    const std::string change = changes[gen() % changes.size()];
    const std::string act = activations[gen() % activations.size()];
    const bool inplace = gen() % 2 == 0;
    INFO("trial " << trial << ": " << change << (inplace ? " in place" : " out of place") << " then " << act);
    torch::manual_seed(500 + trial);
    auto policy = torch::nn::Sequential(torch::nn::Linear(8, 16), torch::nn::ReLU(), torch::nn::Linear(16, 6));
    HookManager hooks;
    std::vector<std::pair<std::string, std::string>> seen;  // name, input_changed
    std::map<std::string, torch::Tensor> values;
    hooks.register_callback("record", [&](const torchdbg::HookContext& c) {
      if (!c.is_forward()) return;
      const auto changed = c.metadata_value("input_changed");
      seen.emplace_back(std::string(c.layer_name()), changed ? std::string(*changed) : std::string());
      values[std::string(c.layer_name())] = c.tensor().detach().clone();
    });
    hooks.register_hook(HookConfig().name("record").trigger(HookTrigger::every_forward()).actions(
        {HookAction::custom_callback("record")}));
    auto session = torchdbg::attach(*policy, hooks);
    hooks.set_step(0);
    const auto x = torch::randn({5, 8});
    auto forbidden = torch::rand({5, 6}) < 0.3;
    forbidden.select(1, 0).fill_(false);
    torch::Tensor logits = policy->forward(x);
    torch::Tensor returned;
    {
      torch::NoGradGuard ng;
      returned = logits.detach().clone();
    }
    if (change == "masked_fill") {
      logits = inplace ? logits.masked_fill_(forbidden, -INFINITY) : logits.masked_fill(forbidden, -INFINITY);
    } else if (change == "mul") {
      logits = inplace ? logits.mul_(0.5) : logits.mul(0.5);
    } else if (change == "add") {
      logits = inplace ? logits.add_(1.0) : logits.add(1.0);
    } else if (change == "clamp") {
      logits = inplace ? logits.clamp_(-1.0, 1.0) : logits.clamp(-1.0, 1.0);
    }
    const torch::Tensor y = act == "log_softmax" ? torch::log_softmax(logits, 1)
                            : act == "softmax"   ? torch::softmax(logits, 1)
                            : act == "relu"      ? torch::relu(logits)
                            : act == "tanh"      ? torch::tanh(logits)
                                                 : torch::sigmoid(logits);
    y.select(1, 0).sum().backward();
    hooks.set_step(1);
    REQUIRE(values.count("2") == 1);
    CHECK(torch::equal(values["2"], returned));  // as the module returned it
    const bool changed_in_place = inplace && change != "none";
    const bool activation_delivered = change == "none" || inplace;
    CHECK(values.count("2/" + act) == (activation_delivered ? 1u : 0u));
    if (activation_delivered) {
      CHECK(torch::equal(values["2/" + act].isfinite(), y.isfinite()));
      CHECK(torch::allclose(values["2/" + act].nan_to_num(0, 0, 0), y.detach().nan_to_num(0, 0, 0)));
    }
    for (const auto& [name, changed] : seen) {
      INFO("delivery " << name);
      CHECK(changed == (name == "2/" + act && changed_in_place ? "1" : ""));
    }
  }
}

TEST_CASE("an output changed in place with gradients off is delivered as the module returned it", "[attach]") {
  // With gradients off the observer skips operators, except one reading a pending output: it
  // is delivered before the operator changes it (a metric's in-place clamp, a masked fill).
  torchdbg_test::SeededRng rng(5);
  for (const bool inference : {false, true}) {
    INFO("inference mode " << inference);
    auto fc = torch::nn::Linear(6, 4);
    HookManager hooks;
    std::vector<torch::Tensor> got;
    hooks.register_callback("rec", [&](const torchdbg::HookContext& c) {
      if (c.is_forward()) got.push_back(c.tensor().detach().clone());
    });
    hooks.register_hook(HookConfig().trigger(HookTrigger::every_forward()).actions({HookAction::custom_callback("rec")}));
    auto session = torchdbg::attach(*fc, hooks);
    for (int64_t step = 0; step < 3; ++step) {
      hooks.set_step(step);
      got.clear();
      const auto x = torch::randn({5, 6});
      torch::Tensor expected;
      {
        torch::NoGradGuard guard;  // fc's own arithmetic, computed unobserved
        expected = torch::addmm(fc->bias, x, fc->weight.t());
      }
      auto y = fc(x);  // nothing with gradients on reads y before the change
      if (inference) {
        c10::InferenceMode guard;
        y.detach().mul_(0.0).add_(7.0);  // the same storage, changed
      } else {
        torch::NoGradGuard guard;
        y.mul_(0.0).add_(7.0);
      }
      session.flush();
      REQUIRE(got.size() == 1);
      CHECK(torch::allclose(got[0], expected, 1e-6, 1e-7));
      CHECK(torch::equal(y.detach(), torch::full_like(y, 7.0)));
    }
  }
}

TEST_CASE("a no-grad call reading a tensor made from the module's weights is no forward output, "
          "whatever other sessions observe",
          "[attach]") {
  // A module keeping a weight computed from its parameters (`(v * 2).t()`, kept between calls)
  // is called with gradients off between two training calls; another model's session
  // observing no-grad forwards must not make it this session's call.
  struct CachedImpl : torch::nn::Module {
    torch::Tensor v, b, cached;
    CachedImpl() {
      v = register_parameter("v", torch::randn({3, 4}));
      b = register_parameter("b", torch::zeros({3}));
    }
    torch::Tensor forward(const torch::Tensor& x) {
      if (!cached.defined()) cached = (v * 2.0).t().detach();
      return x.matmul(cached) + b;
    }
  };
  torchdbg_test::SeededRng rng(23);
  for (const bool other_no_grad : {false, true}) {
    INFO("another model's session observes no-grad forwards: " << other_no_grad);
    auto m = std::make_shared<CachedImpl>();
    torch::nn::Linear other(2, 2);
    HookManager hooks, other_hooks;
    std::vector<std::pair<int64_t, std::string>> got;  // (step, call)
    hooks.register_callback("rec", [&](const torchdbg::HookContext& c) {
      const auto call = c.metadata_value("call");
      got.emplace_back(c.step(), call ? std::string(*call) : "-");
    });
    hooks.register_hook(HookConfig().trigger(HookTrigger::every_forward()).actions({HookAction::custom_callback("rec")}));
    other_hooks.register_callback("n", [](const torchdbg::HookContext&) {});
    other_hooks.register_hook(
        HookConfig().trigger(HookTrigger::every_forward()).actions({HookAction::custom_callback("n")}));
    auto session = torchdbg::attach(*m, hooks);
    std::optional<torchdbg::AttachSession> other_session;
    if (other_no_grad) other_session.emplace(torchdbg::attach(*other, other_hooks, AttachOptions().no_grad_forward(true)));
    for (int64_t step = 0; step < 3; ++step) {
      hooks.set_step(step);
      m->forward(torch::randn({2, 4})).sum().backward();
      {
        torch::NoGradGuard guard;  // an evaluation call
        (void)m->forward(torch::randn({2, 4}));
      }
      auto y = m->forward(torch::randn({2, 4}));
      session.flush();
    }
    // per step: the training call, and the one after its backward pass (calls count from 0 again)
    const std::vector<std::pair<int64_t, std::string>> expected{{0, "0"}, {0, "0"}, {1, "0"}, {1, "0"}, {2, "0"}, {2, "0"}};
    CHECK(got == expected);
  }
}

TEST_CASE("optimizer updates and no-grad passes are not forward outputs unless asked", "[attach]") {
  torchdbg_test::SeededRng rng(11);
  auto net = std::make_shared<Net>(4);
  torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-3).weight_decay(0.1));
  torch::optim::SGD sgd(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9).weight_decay(0.1));
  HookManager hooks;
  Recorder rec;
  rec.install(hooks);
  auto session = torchdbg::attach(*net, hooks);
  for (int64_t step = 0; step < 2; ++step) {
    hooks.set_step(step);
    net->forward(torch::randn({2, 1, 6, 6}), torch::randint(0, 20, {2})).sum().backward();
    adam.step();
    sgd.step();
  }
  hooks.set_step(2);
  {
    torch::NoGradGuard ng;  // an evaluation pass: not observed by default
    net->forward(torch::randn({2, 1, 6, 6}), torch::randint(0, 20, {2}));
  }
  hooks.set_step(3);
  for (int64_t step = 0; step < 2; ++step) {
    INFO("step " << step);
    for (const auto& [name, list] : rec.fwd[step]) {
      INFO("layer " << name);
      CHECK(list.size() == 1);
    }
  }
  CHECK(rec.fwd.count(2) == 0);
  auto eval_session = torchdbg::attach(*net, hooks, AttachOptions().no_grad_forward(true).backward(false));
  session.detach();
  {
    torch::NoGradGuard ng;
    net->forward(torch::randn({2, 1, 6, 6}), torch::randint(0, 20, {2})).sum();
    adam.step();  // in-place updates stay invisible even then
  }
  hooks.set_step(4);
  CHECK(rec.fwd[3].size() == kForwardNames.size());
  for (const auto& [name, list] : rec.fwd[3]) {
    INFO("layer " << name);
    CHECK(list.size() == 1);
  }
}

TEST_CASE("attached statistics match an independent reference", "[attach]") {
  torchdbg_test::SeededRng rng(7);
  auto net = std::make_shared<Net>(8);
  HookManager hooks;
  hooks.create_tensor_inspection_hook({});
  auto session = torchdbg::attach(*net, hooks);
  auto x = torch::randn({4, 1, 6, 6});
  net->forward(x, torch::randint(0, 20, {4})).sum().backward();
  torch::Tensor conv_ref;
  {
    hooks.set_enabled(false);
    torch::NoGradGuard ng;
    conv_ref = net->conv(x);
  }
  const auto r = torchdbg_test::reference(conv_ref);
  const auto rec = hooks.inspector.latest("conv");
  REQUIRE(rec);
  CHECK_SCALED(rec->stats.mean, r.mean, r.scale(), 1e-6);
  CHECK_CLOSE(rec->stats.std, r.std, 1e-6);
  CHECK(rec->stats.numel == r.numel);
  CHECK(hooks.visualizer.latest("bn/relu")->zeros > 0);
}

TEST_CASE("per-module gradient norms and the global norm come from one backward", "[attach]") {
  torchdbg_test::SeededRng rng(8);
  auto net = std::make_shared<Net>(6);
  HookManager hooks;
  hooks.create_gradient_tracking_hook({});
  auto session = torchdbg::attach(*net, hooks);
  net->forward(torch::randn({3, 1, 6, 6}), torch::randint(0, 20, {3})).pow(2).mean().backward();
  const auto norms = session.gradient_norms();
  REQUIRE(norms.size() == 6);
  double total = 0;
  for (const auto& [name, n] : norms) {
    double ref = 0;
    const auto module = net->named_modules()[name];
    for (const auto& p : module->parameters(false)) ref += p.grad().to(torch::kDouble).pow(2).sum().item<double>();
    INFO("module " << name);
    CHECK_CLOSE(n, std::sqrt(ref), 1e-6);  // float32 gradients: the kernel's float path
    total += ref;
  }
  REQUIRE(hooks.state().gradient_norm);
  CHECK_CLOSE(*hooks.state().gradient_norm, std::sqrt(total), 1e-6);
  CHECK(hooks.inspector.gradient_history("lstm.weight_ih_l0/grad").size() == 1);
}

TEST_CASE("the observer runs only on steps where a forward hook is due", "[attach]") {
  auto net = std::make_shared<Net>(4);
  HookManager hooks;
  Recorder rec;
  hooks.register_callback("record", [&](const torchdbg::HookContext& c) {
    rec.fwd[c.step()][std::string(c.layer_name())].push_back(c.tensor());
  });
  hooks.register_hook(HookConfig().trigger(HookTrigger::every_n_steps(5)).actions({HookAction::custom_callback("record")}));
  auto& observer = torchdbg::detail::ForwardObserver::instance();
  auto session = torchdbg::attach(*net, hooks);
  for (int64_t step = 0; step < 11; ++step) {
    hooks.set_step(step);
    CHECK(observer.registered() == (step % 5 == 0));
    net->forward(torch::randn({2, 1, 6, 6}), torch::randint(0, 20, {2})).sum().backward();
  }
  CHECK(rec.fwd.size() == 3);  // steps 0, 5, 10
  CHECK(rec.fwd.count(5) == 1);
  const auto before = session.forward_deliveries();
  hooks.clear_hooks();
  CHECK_FALSE(observer.registered());
  net->forward(torch::randn({2, 1, 6, 6}), torch::randint(0, 20, {2})).sum().backward();
  CHECK(session.forward_deliveries() == before);
  CHECK(session.backward_deliveries() > 0);
}

TEST_CASE("hooks reached through attach count runs, skips and errors like execute_hooks", "[attach]") {
  auto net = std::make_shared<Net>(4);
  HookManager hooks;
  std::vector<torchdbg::HookError> errors;
  hooks.set_error_handler([&](const torchdbg::HookError& e) { errors.push_back(e); });
  hooks.register_callback("throw", [](const torchdbg::HookContext& c) {
    if (c.layer_name() == "fc") throw std::runtime_error("fc rejected");
  });
  const auto fwd = hooks.register_hook(
      HookConfig().name("fwd").trigger(HookTrigger::every_forward()).actions({HookAction::inspect_tensor()}));
  const auto bwd = hooks.register_hook(
      HookConfig().name("bwd").trigger(HookTrigger::every_backward()).actions({HookAction::track_gradients()}));
  const auto thr = hooks.register_hook(
      HookConfig().name("thr").trigger(HookTrigger::every_forward()).actions({HookAction::custom_callback("throw")}));
  auto session = torchdbg::attach(*net, hooks);
  for (int64_t step = 0; step < 2; ++step) {
    hooks.set_step(step);
    net->forward(torch::randn({2, 1, 6, 6}), torch::randint(0, 20, {2})).sum().backward();
  }
  const uint64_t nf = session.forward_deliveries(), nb = session.backward_deliveries();
  REQUIRE(nf > 0);
  REQUIRE(nb > 0);
  const auto sf = *hooks.get_hook_stats(fwd), sb = *hooks.get_hook_stats(bwd), st = *hooks.get_hook_stats(thr);
  CHECK(sf.executions == nf);
  CHECK(sf.skipped == nb);
  CHECK(sb.executions == nb);
  CHECK(sb.skipped == nf);
  CHECK(st.errors == 2);  // "fc" once per step; the handler saw each with its message
  REQUIRE(errors.size() == 2);
  CHECK(errors[0].layer == "fc");
  CHECK_THAT(errors[0].message, Catch::Contains("fc rejected"));
  CHECK(hooks.inspector.history("fc").size() == 2);
}

TEST_CASE("detaching stops every callback and removes the observer", "[attach]") {
  auto net = std::make_shared<Net>(4);
  HookManager hooks;
  int calls = 0;
  hooks.register_callback("count", [&](const torchdbg::HookContext&) { ++calls; });
  hooks.register_hook(HookConfig().trigger(HookTrigger::every_n_steps(1)).actions({HookAction::custom_callback("count")}));
  auto run = [&] { net->forward(torch::randn({2, 1, 6, 6}), torch::randint(0, 20, {2})).sum().backward(); };
  {
    auto session = torchdbg::attach(*net, hooks);
    run();
    CHECK(calls > 0);
    session.detach();
    CHECK_FALSE(session.attached());
    const int after = calls;
    run();
    CHECK(calls == after);
  }  // destroying a detached session is a no-op
  CHECK_FALSE(torchdbg::detail::ForwardObserver::instance().registered());
  const int after = calls;
  run();
  CHECK(calls == after);
  // Attaching again works, and a moved session keeps the attachment.
  auto s1 = torchdbg::attach(*net, hooks);
  auto s2 = std::move(s1);
  run();
  CHECK(calls > after);
}

TEST_CASE("a session may outlive its model and a model may die after detaching", "[attach]") {
  HookManager hooks;
  hooks.create_tensor_inspection_hook({});
  hooks.create_gradient_tracking_hook({});
  std::optional<torchdbg::AttachSession> session;
  {
    auto net = std::make_shared<Net>(4);
    session.emplace(torchdbg::attach(*net, hooks));
    net->forward(torch::randn({2, 1, 6, 6}), torch::randint(0, 20, {2})).sum().backward();
  }  // model gone, session alive
  auto other = torch::nn::Linear(3, 3);  // new tensors must not be mistaken for the dead model's
  other(torch::randn({2, 3})).sum().backward();
  CHECK(hooks.inspector.latest("fc"));
  CHECK_FALSE(hooks.inspector.latest("weight"));
  session.reset();  // detaching with the model gone
  {
    auto net = std::make_shared<Net>(4);
    auto s = torchdbg::attach(*net, hooks);
    s.detach();
  }  // model dies after detaching
  SUCCEED();
}

TEST_CASE("auto step counts one step per backward pass", "[attach]") {
  auto net = std::make_shared<Net>(4);
  HookManager hooks;
  hooks.create_gradient_tracking_hook({});
  auto session = torchdbg::attach(*net, hooks, AttachOptions().auto_step(true));
  for (int i = 0; i < 4; ++i) net->forward(torch::randn({2, 1, 6, 6}), torch::randint(0, 20, {2})).sum().backward();
  CHECK(hooks.step() == 4);
}

TEST_CASE("patterns select modules from the start of their dotted names", "[attach]") {
  struct Outer : torch::nn::Module {
    Outer() {
      enc = register_module("enc", std::make_shared<Net>(4));
      fc = register_module("fc", torch::nn::Linear(3, 3));
    }
    std::shared_ptr<Net> enc;
    torch::nn::Linear fc{nullptr};
  };
  auto outer = std::make_shared<Outer>();
  HookManager hooks;
  CHECK(torchdbg::attach(*outer, hooks).module_names().size() == 7);
  auto fc_only = torchdbg::attach(*outer, hooks, AttachOptions().patterns({"fc"}));
  CHECK(fc_only.module_names() == std::vector<std::string>{"fc"});  // not "enc.fc": matched from the start
  fc_only.detach();
  auto enc = torchdbg::attach(*outer, hooks, AttachOptions().patterns({"enc\\.(conv|bn)$"}));
  CHECK(enc.module_names() == std::vector<std::string>{"enc.conv", "enc.bn"});
  CHECK_THROWS_WITH(torchdbg::attach(*outer, hooks, AttachOptions().patterns({"(("})), Catch::Contains("(("));
}

TEST_CASE("custom modules, activation modules and weight views are attributed correctly", "[attach]") {
  // A module with its own parameters used through a transposed view, and a ReLU module.
  struct Custom : torch::nn::Module {
    Custom() {
      w = register_parameter("w", torch::randn({5, 3}));
      b = register_parameter("b", torch::randn({5}));
      act = register_module("act", torch::nn::Tanh());
    }
    torch::Tensor forward(const torch::Tensor& x) { return act(x.matmul(w.t()) + b); }
    torch::Tensor w, b;
    torch::nn::Tanh act{nullptr};
  };
  torchdbg_test::SeededRng rng(9);
  auto m = std::make_shared<Custom>();
  HookManager hooks;
  Recorder rec;
  rec.install(hooks);
  auto session = torchdbg::attach(*m, hooks);
  auto x = torch::randn({4, 3});
  m->forward(x).sum().backward();
  hooks.set_enabled(false);
  const auto& seen = rec.fwd[0];
  REQUIRE(seen.count("root") == 1);
  REQUIRE(seen.count("root/tanh") == 1);
  CHECK(seen.size() == 2);
  torch::NoGradGuard ng;
  CHECK(torch::allclose(seen.at("root")[0], x.matmul(m->w.t()) + m->b));
  CHECK(torch::allclose(seen.at("root/tanh")[0], torch::tanh(x.matmul(m->w.t()) + m->b)));
  CHECK(rec.bwd[0].count("root.w") == 1);
}

TEST_CASE("an output not yet consumed is delivered under the step it was computed in", "[attach]") {
  auto fc = torch::nn::Linear(3, 2);
  HookManager hooks;
  std::vector<int64_t> steps;
  hooks.register_callback("s", [&](const torchdbg::HookContext& c) { steps.push_back(c.step()); });
  hooks.register_hook(HookConfig().trigger(HookTrigger::every_forward()).actions({HookAction::custom_callback("s")}));
  auto session = torchdbg::attach(*fc, hooks);
  hooks.set_step(7);
  auto y = fc(torch::randn({4, 3}));  // nothing consumes y yet
  CHECK(steps.empty());
  hooks.set_step(8);  // the output belongs to step 7
  CHECK(steps == std::vector<int64_t>{7});
  auto z = fc(torch::randn({4, 3}));
  session.flush();  // or deliver it explicitly
  CHECK(steps == std::vector<int64_t>{7, 8});
}

TEST_CASE("each built-in layer kind delivers exactly its own output once", "[attach]") {
  using torch::nn::Module;
  struct Case {
    std::string name;
    std::shared_ptr<Module> module;
    std::function<torch::Tensor(const torch::Tensor&)> call;
    torch::Tensor input;
  };
  torchdbg_test::SeededRng rng(12);
  auto ln = torch::nn::LayerNorm(torch::nn::LayerNormOptions({6}));
  auto gn = torch::nn::GroupNorm(2, 4);
  auto c1 = torch::nn::Conv1d(torch::nn::Conv1dOptions(2, 3, 3));
  auto c3 = torch::nn::Conv3d(torch::nn::Conv3dOptions(1, 2, 2));
  auto gru = torch::nn::GRU(torch::nn::GRUOptions(6, 5));
  auto rnn = torch::nn::RNN(torch::nn::RNNOptions(6, 5));
  auto bn1 = torch::nn::BatchNorm1d(6);
  auto in1 = torch::nn::InstanceNorm1d(torch::nn::InstanceNorm1dOptions(2).affine(true));
  std::vector<Case> cases = {
      {"LayerNorm", ln.ptr(), [&](const torch::Tensor& x) { return ln(x); }, torch::randn({3, 6})},
      {"GroupNorm", gn.ptr(), [&](const torch::Tensor& x) { return gn(x); }, torch::randn({3, 4, 5})},
      {"Conv1d", c1.ptr(), [&](const torch::Tensor& x) { return c1(x); }, torch::randn({2, 2, 7})},
      {"Conv3d", c3.ptr(), [&](const torch::Tensor& x) { return c3(x); }, torch::randn({1, 1, 3, 3, 3})},
      {"GRU", gru.ptr(), [&](const torch::Tensor& x) { return std::get<0>(gru(x)); }, torch::randn({4, 2, 6})},
      {"RNN", rnn.ptr(), [&](const torch::Tensor& x) { return std::get<0>(rnn(x)); }, torch::randn({4, 2, 6})},
      {"BatchNorm1d", bn1.ptr(), [&](const torch::Tensor& x) { return bn1(x); }, torch::randn({5, 6})},
      {"InstanceNorm1d", in1.ptr(), [&](const torch::Tensor& x) { return in1(x); }, torch::randn({2, 2, 5})},
  };
  for (auto& c : cases) {
    INFO("module " << c.name);
    HookManager hooks;
    Recorder rec;
    rec.install(hooks);
    auto session = torchdbg::attach(*c.module, hooks);
    auto y = c.call(c.input);
    y.sum().backward();
    hooks.set_enabled(false);
    const auto& seen = rec.fwd[0];
    REQUIRE(seen.count("root") == 1);
    CHECK(seen.size() == 1);
    CHECK(seen.at("root").size() == 1);
    CHECK(torch::allclose(seen.at("root")[0], y.detach()));
    CHECK(rec.bwd[0].size() == c.module->parameters().size());
  }
}

TEST_CASE("detaching while a backward pass is pending or running is safe", "[attach]") {
  torchdbg_test::SeededRng rng(14);
  auto net = std::make_shared<Net>(4);
  HookManager hooks;
  std::atomic<int> grads{0};
  hooks.register_callback("g", [&](const torchdbg::HookContext& c) {
    if (!c.is_forward()) grads.fetch_add(1);
  });
  hooks.register_hook(HookConfig().trigger(HookTrigger::every_n_steps(1)).actions({HookAction::custom_callback("g")}));
  {
    auto session = torchdbg::attach(*net, hooks);
    auto loss = net->forward(torch::randn({2, 1, 6, 6}), torch::randint(0, 20, {2})).sum();
    session.detach();  // the graph is built, backward not run yet
    loss.backward();
    CHECK(grads.load() == 0);
  }
  for (int round = 0; round < 5; ++round) {  // detach racing a backward on another thread
    auto session = torchdbg::attach(*net, hooks);
    auto loss = net->forward(torch::randn({2, 1, 6, 6}), torch::randint(0, 20, {2})).sum();
    std::thread t([&] { loss.backward(); });
    session.detach();
    t.join();
  }
  SUCCEED();
}

TEST_CASE("a parameter used only as a shape template is not a forward output", "[attach]") {
  torch::manual_seed(2);
  torch::nn::Linear fc(4, 3);
  HookManager hooks;
  std::vector<std::string> seen;
  hooks.register_callback("log", [&](const torchdbg::HookContext& c) { seen.emplace_back(c.layer_name()); });
  hooks.register_hook(HookConfig().trigger(HookTrigger::every_forward()).actions({HookAction::custom_callback("log")}));
  auto session = torchdbg::attach(*fc, hooks);
  auto flat = torch::randn({15});
  auto w = flat.slice(0, 0, 12).view_as(fc->weight);  // all-reduce code reshaping a gradient buffer
  auto z = torch::zeros_like(fc->bias);
  auto n = flat.new_zeros({2});
  session.flush();
  CHECK(seen.empty());
  auto y = fc(torch::randn({2, 4}));  // a real forward still counts
  session.flush();
  CHECK(seen == std::vector<std::string>{"root"});
  (void)w;
  (void)z;
  (void)n;
  (void)y;
}

namespace {

/// One delivery as a hook saw it.
struct Delivery {
  int64_t step;
  std::string key;
  bool forward;
  torchdbg::TensorStats stats;
  std::optional<std::string> input_rms;
};

void record_deliveries(HookManager& hooks, std::vector<Delivery>& out) {
  hooks.register_callback("deliveries", [&out](const torchdbg::HookContext& c) {
    std::string key(c.layer_name());
    if (auto p = c.metadata_value("parameter")) key += "." + std::string(*p);
    std::optional<std::string> rms;
    if (auto r = c.metadata_value("input_rms")) rms = std::string(*r);
    out.push_back({c.step(), key, c.is_forward(), c.stats(), rms});
  });
  hooks.register_hook(HookConfig().trigger(HookTrigger::every_n_steps(1)).actions(
      {HookAction::custom_callback("deliveries")}));
}

}  // namespace

TEST_CASE("queued deliveries arrive at the end of backward with the statistics of immediate ones", "[attach]") {
  torchdbg_test::SeededRng rng(31);
  auto a = std::make_shared<Net>(6);
  auto b = std::make_shared<Net>(6);
  {
    torch::NoGradGuard ng;
    const auto pa = a->parameters(), pb = b->parameters();
    for (std::size_t i = 0; i < pa.size(); ++i) pb[i].copy_(pa[i]);
  }
  HookManager ha, hb;
  std::vector<Delivery> da, db;
  record_deliveries(ha, da);
  record_deliveries(hb, db);
  auto sa = torchdbg::attach(*a, ha, AttachOptions().batching(torchdbg::StatsBatching::PerDelivery));
  auto sb = torchdbg::attach(*b, hb, AttachOptions().batching(torchdbg::StatsBatching::All));
  torch::optim::SGD oa(a->parameters(), 0.05), ob(b->parameters(), 0.05);
  std::vector<double> x_rms;  // per step: the RMS of the finite values of the data input
  for (int64_t step = 0; step < 3; ++step) {
    ha.set_step(step);
    hb.set_step(step);
    auto x = torch::randn({5, 1, 6, 6});
    if (step == 2) x[1][0][2][3] = std::numeric_limits<float>::quiet_NaN();  // NaN in one sample
    {
      const auto xd = x.to(torch::kDouble).flatten();
      const auto fin = xd.masked_select(torch::isfinite(xd));
      x_rms.push_back(std::sqrt(fin.pow(2).sum().item<double>() / static_cast<double>(fin.numel())));
    }
    auto tokens = torch::randint(0, 20, {5});
    oa.zero_grad();
    ob.zero_grad();
    const std::size_t had_a = da.size(), had_b = db.size();
    auto ya = a->forward(x, tokens), yb = b->forward(x, tokens);
    CHECK(da.size() > had_a);   // immediate: the forward outputs ran their hooks already
    CHECK(db.size() == had_b);  // queued: nothing until the end of backward
    ya.pow(2).mean().backward();
    yb.pow(2).mean().backward();
    CHECK(db.size() == da.size());
    CHECK(sb.host_transfers() == static_cast<uint64_t>(step + 1));  // one copy per step
    oa.step();
    ob.step();
  }
  CHECK(sa.host_transfers() == 0);
  REQUIRE(da.size() == db.size());
  for (std::size_t i = 0; i < da.size(); ++i) {
    const Delivery &p = da[i], &q = db[i];
    INFO("delivery " << i << ": " << p.key << " at step " << p.step);
    REQUIRE(p.key == q.key);
    CHECK(p.step == q.step);
    CHECK(p.forward == q.forward);
    CHECK(p.stats.numel == q.stats.numel);
    CHECK(p.stats.shape == q.stats.shape);
    CHECK(p.stats.finite_count == q.stats.finite_count);
    CHECK(p.stats.nan_count == q.stats.nan_count);
    CHECK(p.stats.inf_count == q.stats.inf_count);
    CHECK(p.stats.zero_count == q.stats.zero_count);
    CHECK(p.stats.negative_count == q.stats.negative_count);
    CHECK(p.stats.positive_count == q.stats.positive_count);
    const double scale = p.stats.finite_count > 0 ? p.stats.l1_norm / p.stats.finite_count : 0.0;
    if (std::isnan(p.stats.mean)) {
      CHECK(std::isnan(q.stats.mean));  // no finite value
    } else {
      CHECK_SCALED(p.stats.mean, q.stats.mean, scale, 1e-6);
    }
    CHECK_CLOSE(p.stats.std, q.stats.std, 1e-5);
    CHECK_CLOSE(p.stats.min, q.stats.min, 0.0);
    CHECK_CLOSE(p.stats.max, q.stats.max, 0.0);
    CHECK_CLOSE(p.stats.l2_norm, q.stats.l2_norm, 1e-6);
    CHECK(p.input_rms.has_value() == q.input_rms.has_value());
    if (p.input_rms && q.input_rms) CHECK_CLOSE(std::stod(*p.input_rms), std::stod(*q.input_rms), 1e-6);
  }
  // The first module of each step carries its data input's RMS (the health gain's input).
  for (int64_t step = 0; step < 3; ++step) {
    for (const auto* d : {&da, &db}) {
      auto it = std::find_if(d->begin(), d->end(), [&](const Delivery& e) { return e.step == step && e.input_rms; });
      REQUIRE(it != d->end());
      CHECK(it->key == "conv");
      CHECK_CLOSE(std::stod(*it->input_rms), x_rms[static_cast<std::size_t>(step)], 1e-6);
    }
  }
  // The NaN of step 2 reached the deliveries downstream of it through both paths.
  CHECK(std::any_of(db.begin(), db.end(), [](const Delivery& d) { return d.step == 2 && d.stats.nan_count > 0; }));
  const auto na = sa.gradient_norms(), nb = sb.gradient_norms();
  REQUIRE(na.size() == nb.size());
  for (std::size_t i = 0; i < na.size(); ++i) {
    CHECK(na[i].first == nb[i].first);
    CHECK_CLOSE(na[i].second, nb[i].second, 1e-6);
  }
}

TEST_CASE("queued deliveries are bounded and arrive at step changes, flush() and detach", "[attach]") {
  auto net = torch::nn::Sequential(torch::nn::Linear(4, 3), torch::nn::ReLU(), torch::nn::Linear(3, 2));
  HookManager hooks;
  std::vector<std::pair<int64_t, std::string>> seen;
  hooks.register_callback("s", [&](const torchdbg::HookContext& c) {
    seen.emplace_back(c.step(), std::string(c.layer_name()));
  });
  hooks.register_hook(HookConfig().trigger(HookTrigger::every_forward()).actions({HookAction::custom_callback("s")}));
  auto session = torchdbg::attach(*net, hooks, AttachOptions().batching(torchdbg::StatsBatching::All).max_deferred(2));
  hooks.set_step(3);
  auto y = net->forward(torch::randn({5, 4}));
  // "0" and "0/relu" filled the queue (2): one early copy; "2" waits for a consumer.
  CHECK(session.host_transfers() == 1);
  CHECK(seen == std::vector<std::pair<int64_t, std::string>>{{3, "0"}, {3, "0/relu"}});
  session.flush();
  CHECK(session.host_transfers() == 2);
  CHECK(seen.size() == 3);
  CHECK(seen.back() == std::pair<int64_t, std::string>{3, "2"});
  net->forward(torch::randn({5, 4})).sum();  // "0", "0/relu" (a copy), "2" consumed by sum: queued
  CHECK(seen.size() == 5);
  hooks.set_step(4);  // the queued "2" belongs to step 3
  CHECK(seen.size() == 6);
  CHECK(seen.back() == std::pair<int64_t, std::string>{3, "2"});
  net->forward(torch::randn({5, 4})).sum();
  const std::size_t before_detach = seen.size();
  session.detach();  // what is queued is delivered, then nothing more
  CHECK(seen.size() == before_detach + 1);
  CHECK(seen.back() == std::pair<int64_t, std::string>{4, "2"});
  net->forward(torch::randn({5, 4})).sum();
  CHECK(seen.size() == before_detach + 1);

  CHECK_THROWS_WITH(torchdbg::attach(*net, hooks, AttachOptions().max_deferred(0)),
                    Catch::Contains("max_deferred") && Catch::Contains("got 0"));
}

TEST_CASE("prefetched values of a queued delivery reach its hooks; immediate ones carry none", "[attach]") {
  for (auto mode : {torchdbg::StatsBatching::All, torchdbg::StatsBatching::PerDelivery}) {
    const bool queued = mode == torchdbg::StatsBatching::All;
    INFO("queued " << queued);
    auto net = torch::nn::Sequential(torch::nn::Linear(4, 3), torch::nn::Linear(3, 2));
    HookManager hooks;
    hooks.add_prefetch("sum", [](std::string_view, const at::Tensor& t, bool, const torchdbg::Metadata&) {
      return t.detach().to(at::kDouble).sum();
    });
    int checked = 0, without = 0;
    hooks.register_callback("read", [&](const torchdbg::HookContext& c) {
      const auto* v = c.prefetched("sum");
      if (v == nullptr) {
        ++without;
        return;
      }
      REQUIRE(v->size() == 1);
      CHECK_CLOSE((*v)[0], c.tensor().to(torch::kDouble).sum().item<double>(), 1e-9);
      ++checked;
    });
    hooks.register_hook(HookConfig().trigger(HookTrigger::every_n_steps(1)).actions({HookAction::custom_callback("read")}));
    auto session = torchdbg::attach(*net, hooks, AttachOptions().batching(mode));
    net->forward(torch::randn({5, 4})).sum().backward();
    // forward outputs "0", "1" and four gradients
    CHECK(checked + without == 6);
    CHECK(checked == (queued ? 6 : 0));
    CHECK(session.host_transfers() == (queued ? 1u : 0u));
  }
}

TEST_CASE("queued deliveries may be flushed from another thread while steps run", "[attach]") {
  auto net = torch::nn::Sequential(torch::nn::Linear(8, 8), torch::nn::ReLU(), torch::nn::Linear(8, 2));
  HookManager hooks;
  std::atomic<int> calls{0};
  hooks.register_callback("count", [&](const torchdbg::HookContext& c) {
    (void)c.stats();
    calls.fetch_add(1);
  });
  hooks.register_hook(HookConfig().trigger(HookTrigger::every_n_steps(1)).actions({HookAction::custom_callback("count")}));
  auto session = torchdbg::attach(*net, hooks, AttachOptions().batching(torchdbg::StatsBatching::All));
  std::atomic<bool> done{false};
  std::thread flusher([&] {
    while (!done.load()) session.flush();
  });
  for (int i = 0; i < 20; ++i) net->forward(torch::randn({4, 8})).sum().backward();
  done.store(true);
  flusher.join();
  session.flush();
  CHECK(calls.load() == 20 * (3 + 4));  // "0", "0/relu", "2" and four gradients per step, once each
  CHECK(session.host_transfers() >= 20);
}

namespace {

/// Counts device-to-host copies as ATen's RecordFunction (the operator events the profiler
/// records) sees them: copy_ into a CPU tensor from another device, and item() of a tensor
/// on another device (_local_scalar_dense). Counts on every thread while alive.
class HostCopyCounter {
 public:
  HostCopyCounter() {
    count().store(0);
    handle_ = at::addGlobalCallback(at::RecordFunctionCallback(&on_start).needsInputs(true));
  }
  ~HostCopyCounter() { at::removeCallback(handle_); }
  HostCopyCounter(const HostCopyCounter&) = delete;
  HostCopyCounter& operator=(const HostCopyCounter&) = delete;
  [[nodiscard]] int copies() const { return count().load(); }

 private:
  static std::atomic<int>& count() {
    static std::atomic<int> c{0};
    return c;
  }
  static std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
    const std::string_view name = fn.name();
    const bool copy = name == "aten::copy_", scalar = name == "aten::_local_scalar_dense";
    if (!copy && !scalar) return nullptr;
    // An operator recorded without its inputs (LibTorch asserts that in its debug checks):
    // not a copy this counter can judge.
    at::ArrayRef<const c10::IValue> in;
    try {
      in = fn.inputs();
    } catch (const c10::Error&) {
      return nullptr;
    }
    auto on_device = [&](std::size_t i) {
      return in.size() > i && in[i].isTensor() && !in[i].toTensor().device().is_cpu();
    };
    if (copy && in.size() >= 2 && in[0].isTensor() && in[0].toTensor().device().is_cpu() && on_device(1))
      count().fetch_add(1);
    if (scalar && on_device(0)) count().fetch_add(1);
    return nullptr;
  }
  at::CallbackHandle handle_ = 0;
};

}  // namespace

TEST_CASE("a monitored CUDA training step copies to the host once", "[attach][cuda]") {
  // Without a GPU the same step runs on the CPU with every delivery queued (StatsBatching::All):
  // the batching is the same, there is just no device copy to count.
  const bool cuda = torch::cuda::is_available();
  if (!cuda) WARN("no CUDA device: the step runs on the CPU with StatsBatching::All");
  const torch::Device dev = cuda ? torch::Device(torch::kCUDA) : torch::Device(torch::kCPU);
  torchdbg_test::SeededRng rng(3);
  auto net = torch::nn::Sequential(torch::nn::Linear(32, 64), torch::nn::ReLU(), torch::nn::Linear(64, 64),
                                   torch::nn::Tanh(), torch::nn::Linear(64, 10));
  net->to(dev);
  torch::optim::SGD opt(net->parameters(), 0.01);
  // What the bench's "full" mode installs: statistics of every output and gradient, health.
  HookManager hooks(torchdbg::HookManagerOptions().inspector(torchdbg::InspectorOptions().sample_rate(0.0)));
  torchdbg::HealthMonitor health;
  auto fed = health.install(hooks);
  // (create_tensor_inspection_hook would also record activations: the visualizer's
  // distributions and heatmaps are read per delivery, not batched.)
  hooks.register_hook(torchdbg::HookConfig()
                          .name("fwd")
                          .trigger(torchdbg::HookTrigger::every_forward())
                          .direction(torchdbg::CallDirection::Forward)
                          .actions({torchdbg::HookAction::inspect_tensor()}));
  hooks.create_gradient_tracking_hook({});
  auto session = torchdbg::attach(
      *net, hooks, AttachOptions().batching(cuda ? torchdbg::StatsBatching::Device : torchdbg::StatsBatching::All));
  const auto x = torch::randn({16, 32}, dev);
  const auto y = torch::randint(0, 10, {16}, torch::TensorOptions().dtype(torch::kLong).device(dev));
  for (int64_t step = 0; step < 3; ++step) {
    hooks.set_step(step);
    int copies = 0;
    {
      HostCopyCounter counter;
      opt.zero_grad();
      torch::nn::functional::cross_entropy(net->forward(x), y).backward();
      if (step < 2) opt.step();  // the last step's parameters stay for the reference below
      copies = counter.copies();
    }
    INFO("step " << step);
    CHECK(copies == (cuda ? 1 : 0));
  }
  CHECK(session.host_transfers() == 3);
  CHECK(session.forward_deliveries() == 3 * 5);  // 0, 0/relu, 2, 2/tanh, 4
  CHECK(session.backward_deliveries() == 3 * 6);
  // What arrived is right: the last step's first output against its CPU reference.
  const auto rec = hooks.inspector.latest("0");
  REQUIRE(rec);
  hooks.set_enabled(false);
  torch::Tensor out;
  {
    torch::NoGradGuard ng;
    out = net[0]->as<torch::nn::Linear>()->forward(x).cpu();
  }
  const auto r = torchdbg_test::reference(out);
  CHECK(rec->stats.device == (cuda ? "cuda:0" : "cpu"));
  CHECK(rec->stats.numel == r.numel);
  CHECK(rec->stats.positive_count == r.pos);
  CHECK_SCALED(rec->stats.mean, r.mean, r.scale(), 1e-6);
  CHECK_CLOSE(rec->stats.std, r.std, 1e-5);
  REQUIRE(health.layer("0/relu"));
  CHECK(std::isfinite(health.layer("0/relu")->rms));
  REQUIRE(hooks.state().gradient_norm);
  CHECK(std::isfinite(*hooks.state().gradient_norm));
}

namespace {

/// Autocast on for one device type with the given lower-precision dtype while alive, as
/// Python's `torch.autocast(device_type, dtype)` block.
class AutocastScope {
 public:
  AutocastScope(at::DeviceType type, at::ScalarType dtype) : type_(type) {
#if TORCH_VERSION_MAJOR >= 2
    prev_dtype_ = at::autocast::get_autocast_dtype(type);
    at::autocast::set_autocast_dtype(type, dtype);
    at::autocast::set_autocast_enabled(type, true);
#else
    prev_dtype_ = type == at::kCPU ? at::autocast::get_autocast_cpu_dtype() : at::autocast::get_autocast_gpu_dtype();
    if (type == at::kCPU) {
      at::autocast::set_autocast_cpu_dtype(dtype);
      at::autocast::set_cpu_enabled(true);
    } else {
      at::autocast::set_autocast_gpu_dtype(dtype);
      at::autocast::set_enabled(true);
    }
#endif
  }
  ~AutocastScope() {
#if TORCH_VERSION_MAJOR >= 2
    at::autocast::set_autocast_enabled(type_, false);
    at::autocast::set_autocast_dtype(type_, prev_dtype_);
#else
    if (type_ == at::kCPU) {
      at::autocast::set_cpu_enabled(false);
      at::autocast::set_autocast_cpu_dtype(prev_dtype_);
    } else {
      at::autocast::set_enabled(false);
      at::autocast::set_autocast_gpu_dtype(prev_dtype_);
    }
#endif
    at::autocast::clear_cache();  // the weights' low-precision copies
  }
  AutocastScope(const AutocastScope&) = delete;
  AutocastScope& operator=(const AutocastScope&) = delete;

 private:
  at::DeviceType type_;
  at::ScalarType prev_dtype_ = at::kFloat;
};

/// Linear, GELU, Linear, [LayerNorm], Linear, recording what each module and activation
/// returned. LibTorch 1.13's CPU autocast has no LayerNorm rule (a bfloat16 input meets float
/// weights), so the norm is left out there.
struct AmpNet : torch::nn::Module {
  explicit AmpNet(bool norm) {
    fc1 = register_module("fc1", torch::nn::Linear(24, 48));
    fc2 = register_module("fc2", torch::nn::Linear(48, 32));
    if (norm) ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({32})));
    head = register_module("head", torch::nn::Linear(32, 10));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    outs.clear();
    auto h = keep("fc1", fc1(x));
    h = keep("fc1/gelu", torch::gelu(h));
    h = keep("fc2", fc2(h));
    if (ln) h = keep("ln", ln(h));
    return keep("head", head(h));
  }
  torch::Tensor keep(const std::string& name, torch::Tensor t) {
    outs.emplace_back(name, t);
    return t;
  }
  std::vector<std::pair<std::string, torch::Tensor>> outs;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr}, head{nullptr};
  torch::nn::LayerNorm ln{nullptr};
};

/// Three SGD steps of AmpNet under autocast on `dev` with `dtype`: every output is delivered
/// once under its module's name in the dtype autocast ran it in, with that tensor's values and
/// statistics; every gradient (float32, the parameters' dtype) equals `.grad()`; on CUDA each
/// step copies to the host once.
void check_autocast_training(const torch::Device& dev, at::ScalarType dtype) {
  INFO("autocast on " << dev << " in " << c10::toString(dtype));
  torchdbg_test::SeededRng rng(17);
  const bool norm = dev.is_cuda() || TORCH_VERSION_MAJOR >= 2;
  auto net = std::make_shared<AmpNet>(norm);
  net->to(dev);
  torch::optim::SGD opt(net->parameters(), 0.05);
  HookManager hooks;
  struct Got {
    std::string name;
    torch::Tensor tensor;
    torchdbg::TensorStats stats;
  };
  std::vector<Got> fwd;
  std::map<std::string, torch::Tensor> grads;
  hooks.register_callback("record", [&](const torchdbg::HookContext& c) {
    if (c.is_forward()) {
      fwd.push_back({std::string(c.layer_name()), c.tensor().detach().clone(), c.stats()});
    } else {
      grads[std::string(c.layer_name()) + "." + std::string(*c.metadata_value("parameter"))] =
          c.tensor().detach().clone();
    }
  });
  hooks.register_hook(
      HookConfig().name("record").trigger(HookTrigger::every_n_steps(1)).actions({HookAction::custom_callback("record")}));
  auto session = torchdbg::attach(*net, hooks);
  for (int64_t step = 0; step < 3; ++step) {
    INFO("step " << step);
    hooks.set_step(step);
    fwd.clear();
    grads.clear();
    const auto x = torch::randn({16, 24}).to(dev);
    const auto y = torch::randint(0, 10, {16}).to(dev);
    int copies = 0;
    {
      HostCopyCounter counter;
      opt.zero_grad();
      torch::Tensor loss;
      {
        AutocastScope amp(dev.type(), dtype);
        loss = torch::nn::functional::cross_entropy(net->forward(x), y);
      }
      loss.backward();
      session.flush();
      copies = counter.copies();
    }
    if (dev.is_cuda()) CHECK(copies == 1);
    REQUIRE(fwd.size() == net->outs.size());
    for (std::size_t i = 0; i < fwd.size(); ++i) {
      const auto& [name, want] = net->outs[i];
      INFO("delivery " << fwd[i].name << ", expected " << name << " (" << want.scalar_type() << ")");
      REQUIRE(fwd[i].name == name);
      CHECK(fwd[i].tensor.scalar_type() == want.scalar_type());
      CHECK(torch::equal(fwd[i].tensor, want.detach()));
      torchdbg_test::check_delivered_stats(fwd[i].stats, want);
    }
    // The linear layers ran in the low precision (what autocast is for).
    CHECK(net->outs.front().second.scalar_type() == dtype);
    double total = 0.0;
    std::size_t n = 0;
    for (const auto& p : net->named_parameters()) {
      INFO("gradient " << p.key());
      REQUIRE(p.value().grad().defined());
      REQUIRE(grads.count(p.key()) == 1);
      CHECK(grads.at(p.key()).scalar_type() == torch::kFloat);
      CHECK(torch::equal(grads.at(p.key()), p.value().grad()));
      for (double g : torchdbg_test::as_doubles(p.value().grad())) total += g * g;
      ++n;
    }
    CHECK(grads.size() == n);
    REQUIRE(hooks.state().gradient_norm);
    CHECK_CLOSE(*hooks.state().gradient_norm, std::sqrt(total), 1e-6);
    opt.step();
  }
}

}  // namespace

TEST_CASE("a mixed-precision (autocast) training step on the CPU delivers bfloat16 outputs and float gradients",
          "[attach]") {
  check_autocast_training(torch::kCPU, torch::kBFloat16);
}

TEST_CASE("a mixed-precision (autocast) CUDA training step delivers half and bfloat16 outputs, one host copy a step",
          "[attach][cuda]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  check_autocast_training(torch::kCUDA, torch::kHalf);
  check_autocast_training(torch::kCUDA, torch::kBFloat16);
}

TEST_CASE("the observer is off while a backward pass runs and back for the next forward", "[attach]") {
  auto& observer = torchdbg::detail::ForwardObserver::instance();
  for (bool concurrent : {false, true}) {
    INFO("concurrent_forward " << concurrent);
    auto net = torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 2));
    HookManager hooks;
    std::vector<std::string> names;
    hooks.register_callback("n", [&](const torchdbg::HookContext& c) { names.emplace_back(c.layer_name()); });
    hooks.register_hook(HookConfig().trigger(HookTrigger::every_forward()).actions({HookAction::custom_callback("n")}));
    auto session = torchdbg::attach(*net, hooks, AttachOptions().concurrent_forward(concurrent));
    // Seen from inside the backward pass: a tensor hook on the first layer's weight runs late
    // in the pass, after the first backward node.
    std::vector<bool> during;
    auto w = net[0]->as<torch::nn::Linear>()->weight;
    const auto h = w.register_hook([&](const torch::Tensor&) { during.push_back(observer.registered()); });
    // No set_step between iterations: the observer must come back on its own.
    for (int i = 0; i < 3; ++i) {
      names.clear();
      CHECK(observer.registered());
      net->forward(torch::randn({5, 4})).sum().backward();
      CHECK(names == std::vector<std::string>{"0", "0/relu", "2"});
      CHECK(observer.registered());
    }
    w.remove_hook(h);
    CHECK(during == std::vector<bool>(3, concurrent));
  }
}

TEST_CASE("gradient statistics skip the sign counts unless a due hook reads them", "[attach]") {
  torchdbg_test::SeededRng rng(21);
  auto net = torch::nn::Sequential(torch::nn::Linear(64, 48), torch::nn::ReLU(), torch::nn::Linear(48, 5));
  HookManager hooks;
  hooks.create_gradient_tracking_hook({});
  std::map<std::string, torchdbg::TensorStats> moments;  // "<module>.<parameter>"
  hooks.register_callback(
      "moments",
      [&](const torchdbg::HookContext& c) {
        if (!c.is_forward()) moments[std::string(c.layer_name()) + "." + std::string(*c.metadata_value("parameter"))] = c.moment_stats();
      },
      torchdbg::CallbackStats::Moments);
  hooks.register_hook(HookConfig().name("m").trigger(HookTrigger::every_backward()).actions(
      {HookAction::custom_callback("moments")}));
  auto session = torchdbg::attach(*net, hooks);
  auto x = torch::randn({16, 64});
  x.select(1, 0).zero_();  // the first layer's weight gradient gets a zero column
  auto step = [&] {
    net->zero_grad();
    net->forward(x).pow(2).mean().backward();
  };
  step();
  REQUIRE(moments.size() == 4);
  for (const auto& [key, s] : moments) {
    INFO(key);
    CHECK_FALSE(s.sign_counts);  // shared by the norm, the tracking hook and the callback
    CHECK(s.zero_count == -1);
  }
  const auto w = net->named_parameters()["0.weight"].grad();
  CHECK_CLOSE(moments["0.weight"].l2_norm, w.to(torch::kDouble).norm().item<double>(), 1e-6);

  // A hook that reads every count, registered after attaching: the next backward computes
  // them once for everyone.
  std::map<std::string, int64_t> zeros;
  hooks.register_callback("full", [&](const torchdbg::HookContext& c) {
    if (!c.is_forward()) zeros[std::string(c.layer_name()) + "." + std::string(*c.metadata_value("parameter"))] = c.stats().zero_count;
  });
  hooks.register_hook(HookConfig().name("f").trigger(HookTrigger::every_backward()).actions(
      {HookAction::custom_callback("full")}));
  moments.clear();
  step();
  REQUIRE(zeros.size() == 4);
  for (const auto& p : net->named_parameters()) {
    INFO(p.key());
    CHECK(zeros[p.key()] == (p.value().grad() == 0).sum().item<int64_t>());
    CHECK(moments[p.key()].sign_counts);
  }
  CHECK(zeros["0.weight"] >= 48);
}

TEST_CASE("one manager, two models: a second gradient session is refused; a parent module gives one norm and one step",
          "[attach]") {
  torchdbg_test::SeededRng rng(19);
  auto gen = torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::Tanh(), torch::nn::Linear(8, 4));
  auto disc = torch::nn::Sequential(torch::nn::Linear(4, 6), torch::nn::ReLU(), torch::nn::Linear(6, 1));
  HookManager hooks;
  const auto tracking = hooks.create_gradient_tracking_hook({});
  {
    auto a = torchdbg::attach(*gen, hooks);
    CHECK_THROWS_WITH(torchdbg::attach(*disc, hooks), Catch::Contains("register_module"));
    // Nothing of the refused session stays: only gen's 4 parameters deliver gradients.
    disc->forward(gen->forward(torch::randn({3, 4}))).sum().backward();
    CHECK(hooks.get_hook_stats(tracking)->executions == 4);
    CHECK(a.backward_deliveries() == 4);
    // A forward-only session may stand beside it.
    auto eval = torchdbg::attach(*disc, hooks, AttachOptions().backward(false));
    CHECK(eval.attached());
    a.detach();
    auto b = torchdbg::attach(*disc, hooks);  // the place is free again
    CHECK(b.attached());
  }
  // A constructor that fails (a bad pattern) gives the place back too.
  CHECK_THROWS(torchdbg::attach(*gen, hooks, AttachOptions().patterns({"(("})));
  // Both models under one parent: one session, one global norm, one step per backward pass.
  struct Pair : torch::nn::Module {
    Pair(torch::nn::Sequential g, torch::nn::Sequential d) {
      gen = register_module("gen", std::move(g));
      disc = register_module("disc", std::move(d));
    }
    torch::nn::Sequential gen{nullptr}, disc{nullptr};
  };
  auto pair = std::make_shared<Pair>(gen, disc);
  auto session = torchdbg::attach(*pair, hooks, AttachOptions().auto_step(true));
  hooks.set_step(0);
  for (int pass = 0; pass < 3; ++pass) {
    for (auto& p : pair->parameters()) p.mutable_grad() = torch::Tensor();
    const auto x = torch::randn({5, 4});
    const auto loss = pair->disc->forward(pair->gen->forward(x)).pow(2).mean() + pair->gen->forward(x).abs().mean();
    loss.backward();
    double sq = 0.0;
    for (const auto& p : pair->parameters()) sq += p.grad().to(torch::kDouble).pow(2).sum().item<double>();
    INFO("pass " << pass);
    REQUIRE(hooks.state().gradient_norm);
    CHECK_CLOSE(*hooks.state().gradient_norm, std::sqrt(sq), 1e-6);
    CHECK(hooks.step() == pass + 1);
    std::vector<std::string> names;
    for (const auto& [name, norm] : session.gradient_norms()) names.push_back(name);
    CHECK(names == std::vector<std::string>{"gen.0", "gen.2", "disc.0", "disc.2"});
  }
}

TEST_CASE("no optimizer's state or arithmetic is a forward output, with or without no_grad_forward", "[attach]") {
  // Each optimizer from its first step (where its state is created with zeros_like/full_like)
  // while attach observes no-grad operators too: every step delivers each forward output
  // once, and nothing is delivered during the optimizer's step or carried into the next.
  using OptFactory = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>;
  const std::vector<std::pair<std::string, OptFactory>> optimizers = {
      {"sgd", [](auto p) { return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.01)); }},
      {"sgd momentum nesterov wd",
       [](auto p) {
         return std::make_unique<torch::optim::SGD>(
             p, torch::optim::SGDOptions(0.01).momentum(0.9).nesterov(true).weight_decay(0.01));
       }},
      {"adam wd", [](auto p) { return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(1e-3).weight_decay(0.1)); }},
      {"adam amsgrad",
       [](auto p) { return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(1e-3).amsgrad(true)); }},
      {"adamw", [](auto p) { return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(1e-3)); }},
      {"rmsprop",
       [](auto p) {
         return std::make_unique<torch::optim::RMSprop>(p, torch::optim::RMSpropOptions(1e-3).momentum(0.5).centered(true));
       }},
      {"adagrad", [](auto p) { return std::make_unique<torch::optim::Adagrad>(p, torch::optim::AdagradOptions(1e-2)); }},
  };
  for (bool no_grad_forward : {true, false}) {
    for (const auto& [name, make] : optimizers) {
      INFO(name << ", no_grad_forward " << no_grad_forward);
      torchdbg_test::SeededRng rng(23);
      auto net = std::make_shared<Net>(4);
      auto opt = make(net->parameters());
      HookManager hooks;
      Recorder rec;
      rec.install(hooks);
      auto session = torchdbg::attach(*net, hooks, AttachOptions().no_grad_forward(no_grad_forward));
      for (int64_t step = 0; step < 3; ++step) {
        hooks.set_step(step);
        opt->zero_grad();
        net->forward(torch::randn({2, 1, 6, 6}), torch::randint(0, 20, {2})).sum().backward();
        const auto before = session.forward_deliveries();
        opt->step();
        session.flush();
        CHECK(session.forward_deliveries() == before);
      }
      hooks.set_step(3);
      for (int64_t step = 0; step < 3; ++step) {
        INFO("step " << step);
        std::vector<std::string> names;
        for (const auto& [layer, list] : rec.fwd[step]) {
          names.push_back(layer);
          CHECK(list.size() == 1);
        }
        std::vector<std::string> expected = kForwardNames;
        std::sort(expected.begin(), expected.end());
        CHECK(names == expected);
      }
    }
  }
}

TEST_CASE("an activation after a view, reshape or transpose of a module's output is still the module's", "[attach]") {
  struct Viewed : torch::nn::Module {
    Viewed() {
      a = register_module("a", torch::nn::Linear(6, 8));
      b = register_module("b", torch::nn::Linear(8, 12));
      c = register_module("c", torch::nn::Linear(12, 4));
    }
    torch::Tensor forward(const torch::Tensor& x) {
      auto h = torch::relu(a(x).view({-1, 2, 4}));                     // view -> relu
      auto g = torch::gelu(b(h.flatten(1)).reshape({-1, 3, 4}).transpose(1, 2));  // chain -> gelu
      return torch::tanh(c(g.flatten(1)).t());                        // t -> tanh
    }
    torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
  };
  torchdbg_test::SeededRng rng(31);
  auto net = std::make_shared<Viewed>();
  HookManager hooks;
  Recorder rec;
  rec.install(hooks);
  auto session = torchdbg::attach(*net, hooks);
  const auto x = torch::randn({5, 6});
  const auto y = net->forward(x);
  session.flush();
  auto& got = rec.fwd[0];
  std::vector<std::string> names;
  for (const auto& [name, list] : got) {
    names.push_back(name);
    CHECK(list.size() == 1);
  }
  REQUIRE(names == std::vector<std::string>{"a", "a/relu", "b", "b/gelu", "c", "c/tanh"});
  // Independent reference: the same computation by hand.
  torch::NoGradGuard ng;
  const auto ra = net->a(x);
  const auto rh = torch::relu(ra.view({-1, 2, 4}));
  const auto rb = net->b(rh.flatten(1));
  const auto rg = torch::gelu(rb.reshape({-1, 3, 4}).transpose(1, 2));
  const auto rc = net->c(rg.flatten(1));
  CHECK(got["a"][0].sizes() == ra.sizes());  // what the module returned, before the view
  CHECK(torch::allclose(got["a"][0], ra));
  CHECK(got["a/relu"][0].sizes() == rh.sizes());
  CHECK(torch::allclose(got["a/relu"][0], rh));
  CHECK(torch::allclose(got["b"][0], rb));
  CHECK(got["b/gelu"][0].sizes() == rg.sizes());
  CHECK(torch::allclose(got["b/gelu"][0], rg));
  CHECK(torch::allclose(got["c"][0], rc));
  CHECK(torch::allclose(got["c/tanh"][0], torch::tanh(rc.t())));
  CHECK(torch::allclose(got["c/tanh"][0], y));
  // A view of something else followed by an activation delivers nothing.
  const auto before = session.forward_deliveries();
  (void)torch::relu(torch::randn({4, 2}).view({8}));
  session.flush();
  CHECK(session.forward_deliveries() == before);
}

namespace {

/// LibTorch 2.x runs a leaf's tensor hooks for torch::autograd::grad; 1.x does not.
constexpr bool kHooksRunForGrad = TORCH_VERSION_MAJOR >= 2;

/// A custom autograd Function whose backward throws.
struct ThrowingBackward : torch::autograd::Function<ThrowingBackward> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, const torch::Tensor& x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list) {
    throw std::runtime_error("custom Function's backward failed");
  }
};

/// fc1 -> (a place where backward can throw) -> tanh -> fc2: a failing pass has delivered
/// fc2's gradients and not fc1's when it throws.
struct FailNet : torch::nn::Module {
  FailNet()
      : fc1(register_module("fc1", torch::nn::Linear(4, 8))), fc2(register_module("fc2", torch::nn::Linear(8, 2))) {}
  torch::Tensor forward(const torch::Tensor& x, int fail) {
    torch::Tensor h = fc1(x);
    if (fail == 1) h.register_hook([](const torch::Tensor&) -> torch::Tensor { throw std::runtime_error("tensor hook failed"); });
    if (fail == 2) h = ThrowingBackward::apply(h);
    if (fail == 3) h = h + torch::sqrt(h - h) * 0;  // NaN gradient: anomaly mode throws
    return fc2(torch::tanh(h));
  }
  torch::nn::Linear fc1, fc2;
};

}  // namespace

TEST_CASE("a backward pass that throws leaves attach working: the next pass is observed as if it had not happened",
          "[attach]") {
  auto& observer = torchdbg::detail::ForwardObserver::instance();
  const char* sources[] = {"", "a tensor hook", "a custom Function", "anomaly mode's NaN check"};
  for (int fail = 1; fail <= 3; ++fail) {
    INFO("the pass throws in " << sources[fail]);
    torchdbg_test::SeededRng rng(40 + static_cast<uint64_t>(fail));
    auto net = std::make_shared<FailNet>();
    HookManager hooks;
    hooks.create_gradient_tracking_hook({});
    std::vector<std::string> names;
    hooks.register_callback("n", [&](const torchdbg::HookContext& c) { names.emplace_back(c.layer_name()); });
    hooks.register_hook(HookConfig().trigger(HookTrigger::every_forward()).actions({HookAction::custom_callback("n")}));
    torchdbg::HealthMonitor health;
    auto installed = health.install(hooks);
    auto session = torchdbg::attach(*net, hooks, AttachOptions().auto_step(true));
    const auto x = torch::randn({5, 4});
    const auto reference_norm = [&] {
      double sq = 0;
      for (const auto& p : net->parameters()) sq += p.grad().to(torch::kDouble).pow(2).sum().item<double>();
      return std::sqrt(sq);
    };
    const auto good_pass = [&] {
      names.clear();
      net->zero_grad();
      net->forward(x, 0).pow(2).mean().backward();
    };
    good_pass();
    const std::vector<std::string> expected = names;
    CHECK(expected == std::vector<std::string>{"fc1", "fc1/tanh", "fc2", "fc2/pow"});
    CHECK(hooks.step() == 1);

    for (int round = 0; round < 2; ++round) {  // twice: a second failure is counted as well
      net->zero_grad();
      {
        std::optional<torch::autograd::DetectAnomalyGuard> anomaly;
        if (fail == 3) anomaly.emplace();
        const torch::Tensor loss = net->forward(x, fail).pow(2).mean();
        CHECK_THROWS(loss.backward());
      }
      CHECK(session.failed_backward_passes() == static_cast<uint64_t>(round + 1));
      CHECK(hooks.step() == 1 + round);  // a failed pass is not a step
      CHECK(observer.registered());      // forward observation is back

      good_pass();
      CHECK(names == expected);  // forward deliveries go on
      CHECK(hooks.step() == 2 + round);
      REQUIRE(hooks.state().gradient_norm);
      // Only this pass's gradients: the failed pass's partial squares (fc2's) are dropped.
      CHECK_CLOSE(*hooks.state().gradient_norm, reference_norm(), 1e-6);
      const auto norms = session.gradient_norms();
      REQUIRE(norms.size() == 2);
      const double fc2_norm = std::sqrt(net->fc2->weight.grad().to(torch::kDouble).pow(2).sum().item<double>() +
                                        net->fc2->bias.grad().to(torch::kDouble).pow(2).sum().item<double>());
      CHECK_CLOSE(norms[1].second, fc2_norm, 1e-6);
      // The health monitor judged this pass's gradients alone, too.
      const auto fc2 = health.layer("fc2");
      REQUIRE(fc2);
      CHECK_CLOSE(fc2->gradient_norm, fc2_norm, 1e-6);
    }
  }
}

TEST_CASE("two threads training their own models keep their call counts and deliveries apart", "[attach]") {
  struct Twice : torch::nn::Module {
    Twice() : fc(register_module("fc", torch::nn::Linear(6, 6))) {}
    torch::Tensor forward(const torch::Tensor& x) {  // calls 0 and 1
      const auto a = torch::tanh(fc(x));
      const auto b = fc(x * 0.5);
      return a + b;
    }
    torch::nn::Linear fc;
  };
  constexpr int kIters = 150;
  struct Worker {
    std::shared_ptr<Twice> net = std::make_shared<Twice>();
    HookManager hooks;
    std::vector<std::vector<std::string>> seen = std::vector<std::vector<std::string>>(kIters);
    int iter = 0;
  };
  Worker w[2];
  std::vector<torchdbg::AttachSession> sessions;
  for (auto& wk : w) {
    wk.hooks.register_callback("r", [&wk](const torchdbg::HookContext& c) {
      if (c.is_forward() && wk.iter < kIters)
        wk.seen[static_cast<std::size_t>(wk.iter)].push_back(std::string(c.layer_name()) + "#" +
                                                             std::string(c.metadata_value("call").value_or("?")));
    });
    wk.hooks.register_hook(HookConfig().trigger(HookTrigger::every_forward()).actions({HookAction::custom_callback("r")}));
    sessions.push_back(torchdbg::attach(*wk.net, wk.hooks));  // no set_step: backward passes restart the counts
  }
  std::vector<std::thread> threads;
  for (auto& wk : w) {
    threads.emplace_back([&wk] {
      for (wk.iter = 0; wk.iter < kIters; ++wk.iter) {
        wk.net->zero_grad();
        wk.net->forward(torch::randn({4, 6})).sum().backward();
      }
    });
  }
  for (auto& t : threads) t.join();
  const std::vector<std::string> expected = {"fc#0", "fc/tanh#0", "fc#1"};
  for (int k = 0; k < 2; ++k) {
    for (int i = 0; i < kIters; ++i) {
      INFO("thread " << k << ", iteration " << i);
      CHECK(w[k].seen[static_cast<std::size_t>(i)] == expected);
    }
  }
}

TEST_CASE("a session attached or due while another thread's backward pass runs sees its forward from its first step",
          "[attach]") {
  // Thread A's backward pass takes the observer's callback off while A's is the only session;
  // thread B attaches its own model meanwhile (inside A's pass: a gradient hook there waits
  // for B), and later becomes due again inside another of A's passes. B's forward outputs are
  // delivered on every step, those first ones included.
  auto a = std::make_shared<torch::nn::LinearImpl>(4, 4);
  auto b = torch::nn::Sequential(torch::nn::Linear(4, 6), torch::nn::Tanh(), torch::nn::Linear(6, 2));
  HookManager ha, hb;
  auto sa = torchdbg::attach(*a, ha);
  ha.create_tensor_inspection_hook({});
  std::vector<std::vector<std::string>> seen(6);
  int64_t b_step = 0;
  hb.register_callback("r", [&](const torchdbg::HookContext& c) {
    if (c.is_forward()) seen[static_cast<std::size_t>(b_step)].push_back(std::string(c.layer_name()));
  });
  // Due on even steps only: on odd ones B's session leaves the observer, on even ones it is due again.
  hb.register_hook(HookConfig().trigger(HookTrigger::every_n_steps(2)).direction(torchdbg::CallDirection::Forward).actions(
      {HookAction::custom_callback("r")}));
  std::optional<torchdbg::AttachSession> sb;
  const auto b_steps = [&](int64_t from, int64_t to) {
    std::thread tb([&] {
      if (!sb) sb.emplace(torchdbg::attach(*b, hb));
      for (b_step = from; b_step < to; ++b_step) {
        hb.set_step(b_step);
        b->forward(torch::randn({3, 4})).sum().backward();
      }
    });
    tb.join();
  };
  for (int64_t step = 0; step < 3; ++step) {
    ha.set_step(step);
    auto h = a->forward(torch::randn({2, 4}));
    if (step == 0 || step == 2)
      h.register_hook([&, step](const torch::Tensor& g) {  // inside A's pass
        if (step == 0) b_steps(0, 3);  // attached, due, not due, due
        if (step == 2) b_steps(3, 6);  // not due, due (again), not due
        return g;
      });
    h.sum().backward();
  }
  const std::vector<std::string> expected = {"0", "0/tanh", "2"};
  for (std::size_t i = 0; i < seen.size(); ++i) {
    INFO("B's step " << i);
    CHECK(seen[i] == (i % 2 == 0 ? expected : std::vector<std::string>{}));
  }
}

TEST_CASE("a model run once on the main thread, then trained on its own, is observed while the main thread's passes run",
          "[attach]") {
  // Model B is checked on the main thread first (its step 0: a forward and a backward), then
  // trained on its own thread while the main thread trains model A. A's backward pass takes
  // the observer's callback off (every session's last step and forward were on its thread);
  // B's next steps begin on B's thread inside that pass (a gradient hook of A's waits for
  // them) and put it back: their forward outputs are delivered.
  auto a = std::make_shared<torch::nn::LinearImpl>(4, 4);
  auto b = torch::nn::Sequential(torch::nn::Linear(4, 6), torch::nn::Tanh(), torch::nn::Linear(6, 2));
  HookManager ha, hb;
  ha.create_tensor_inspection_hook({});
  std::vector<std::vector<std::string>> seen(4);
  std::atomic<int64_t> b_step{0};
  hb.register_callback("r", [&](const torchdbg::HookContext& c) {
    if (c.is_forward()) seen[static_cast<std::size_t>(b_step.load())].push_back(std::string(c.layer_name()));
  });
  hb.register_hook(HookConfig().trigger(HookTrigger::every_n_steps(1)).direction(torchdbg::CallDirection::Forward).actions(
      {HookAction::custom_callback("r")}));
  auto sa = torchdbg::attach(*a, ha);
  auto sb = torchdbg::attach(*b, hb);
  hb.set_step(0);
  b->forward(torch::randn({3, 4})).sum().backward();  // the check, on this thread
  ha.set_step(0);
  std::promise<void> go, done;
  std::thread tb([&, go_f = go.get_future()] {
    go_f.wait();  // inside A's pass
    for (int64_t s = 1; s < 4; ++s) {
      hb.set_step(s);
      b_step = s;
      b->forward(torch::randn({3, 4})).sum().backward();
    }
    done.set_value();
  });
  auto h = a->forward(torch::randn({2, 4}));
  auto done_f = done.get_future();
  h.register_hook([&](const torch::Tensor& g) {
    go.set_value();
    done_f.wait();
    return g;
  });
  h.sum().backward();
  tb.join();
  const std::vector<std::string> expected = {"0", "0/tanh", "2"};
  for (std::size_t i = 0; i < seen.size(); ++i) {
    INFO("B's step " << i);
    CHECK(seen[i] == expected);
  }
}

TEST_CASE("an activation after another module's call or another reader is still the module's", "[attach]") {
  struct Between : torch::nn::Module {
    Between() : fc(register_module("fc", torch::nn::Linear(5, 5))), other(register_module("other", torch::nn::Linear(5, 5))) {}
    torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& z) {
      y = fc(x);
      h = other(z);          // another module runs between fc's call and its activation
      logged = y.detach().clone();  // another reader of fc's output
      flat = y.view({-1}).clone();  // a view of it, read
      a = torch::tanh(y);
      return a.sum() + h.sum();
    }
    torch::nn::Linear fc, other;
    torch::Tensor y, h, logged, flat, a;  // handles: the reference
  };
  auto net = std::make_shared<Between>();
  HookManager hooks;
  std::map<std::string, torch::Tensor> got;
  hooks.register_callback("r", [&](const torchdbg::HookContext& c) {
    if (c.is_forward()) got[std::string(c.layer_name())] = c.tensor().detach().clone();
  });
  hooks.register_hook(HookConfig().trigger(HookTrigger::every_forward()).actions({HookAction::custom_callback("r")}));
  auto session = torchdbg::attach(*net, hooks);
  net->forward(torch::randn({3, 5}), torch::randn({3, 5})).backward();
  REQUIRE(got.count("fc/tanh"));
  CHECK(torch::equal(got["fc/tanh"], net->a));
  CHECK(torch::equal(got["fc"], net->y));
  CHECK(torch::equal(got["other"], net->h));
  CHECK(got.size() == 3);
}

TEST_CASE("gradients from torch::autograd::grad are handed over with observe_gradients; a step without any is warned of once",
          "[attach]") {
  torchdbg_test::SeededRng rng(23);
  auto net = torch::nn::Sequential(torch::nn::Linear(4, 6), torch::nn::Tanh(), torch::nn::Linear(6, 2));
  HookManager hooks;
  hooks.create_gradient_tracking_hook({});
  hooks.create_tensor_inspection_hook({});  // forward hooks: the warning needs them
  std::map<std::string, double> delivered;  // "<module>.<parameter>" -> L2 norm
  hooks.register_callback("g", [&](const torchdbg::HookContext& c) {
    if (!c.is_forward()) delivered[std::string(c.layer_name()) + "." + std::string(*c.metadata_value("parameter"))] = c.stats().l2_norm;
  });
  hooks.register_hook(HookConfig().trigger(HookTrigger::every_backward()).actions({HookAction::custom_callback("g")}));
  auto session = torchdbg::attach(*net, hooks, AttachOptions().auto_step(true));
  const auto params = net->parameters();
  for (int step = 0; step < 3; ++step) {
    delivered.clear();
    const auto loss = net->forward(torch::randn({5, 4})).pow(2).mean();
    const auto grads = torch::autograd::grad({loss}, params);
    // LibTorch 1.x runs no tensor hook for autograd::grad, 2.x does: either way each gradient
    // is delivered once, and the pass is one step.
    CHECK(delivered.empty() == !kHooksRunForGrad);
    session.observe_gradients(params, grads);
    double total = 0;
    const auto named = net->named_parameters();
    for (std::size_t i = 0; i < params.size(); ++i) {
      const double ref = grads[i].to(torch::kDouble).norm().item<double>();
      total += ref * ref;
      INFO(named.keys()[i]);
      REQUIRE(delivered.count(named.keys()[i]));
      CHECK_CLOSE(delivered[named.keys()[i]], ref, 1e-6);
    }
    REQUIRE(hooks.state().gradient_norm);
    CHECK_CLOSE(*hooks.state().gradient_norm, std::sqrt(total), 1e-6);
    CHECK(hooks.step() == step + 1);  // auto_step: the handed-over pass was a step
  }
  CHECK(hooks.alerts().empty());
  // Bad input is refused whole, by position.
  CHECK_THROWS_WITH(session.observe_gradients(params, {}), Catch::Contains("parameters and 0 gradients"));
  CHECK_THROWS_WITH(session.observe_gradients({params[0], torch::randn({2})}, {torch::randn_like(params[0]), torch::randn({2})}),
                    Catch::Contains("params[1]"));
  CHECK_THROWS_WITH(session.observe_gradients({params[0], params[0]}, {torch::randn_like(params[0]), torch::randn_like(params[0])}),
                    Catch::Contains("params[1] is params[0] again"));
  CHECK_THROWS_WITH(session.observe_gradients({params[0]}, {torch::randn({3})}), Catch::Contains("has shape"));
  CHECK(hooks.step() == 3);  // nothing was delivered or stepped
  // A user who does not hand them over hears of it once, at the step change.
  for (int step = 0; step < 3; ++step) {
    const auto loss = net->forward(torch::randn({5, 4})).pow(2).mean();
    (void)torch::autograd::grad({loss}, params);
    hooks.set_step(hooks.step() + 1);
  }
  const auto alerts = hooks.alerts();
  if (kHooksRunForGrad) {
    CHECK(alerts.empty());  // the gradients arrived through the hooks
  } else {
    REQUIRE(alerts.size() == 1);
    CHECK_THAT(alerts[0].message, Catch::Contains("observe_gradients"));
    CHECK(alerts[0].hook_name == "torchdbg.attach");
  }
}

TEST_CASE("sparse gradients (Embedding sparse(true)) are delivered with the statistics of every element and counted in the norms",
          "[attach]") {
  torchdbg_test::SeededRng rng(24);
  struct Net : torch::nn::Module {
    Net()
        : emb(register_module("emb", torch::nn::Embedding(torch::nn::EmbeddingOptions(50, 6).sparse(true)))),
          fc(register_module("fc", torch::nn::Linear(6, 3))) {}
    torch::Tensor forward(const torch::Tensor& t) { return fc(emb(t)); }
    torch::nn::Embedding emb;
    torch::nn::Linear fc;
  };
  auto net = std::make_shared<Net>();
  HookManager hooks;
  hooks.create_gradient_tracking_hook({});
  std::optional<torchdbg::TensorStats> got;
  hooks.register_callback("g", [&](const torchdbg::HookContext& c) {
    if (!c.is_forward() && c.layer_name() == "emb") got = c.stats();
  });
  hooks.register_hook(HookConfig().trigger(HookTrigger::every_backward()).actions({HookAction::custom_callback("g")}));
  auto session = torchdbg::attach(*net, hooks);
  const auto tokens = torch::tensor({3, 7, 3, 3, 11, 7, 49}, torch::kLong);  // repeats: duplicate indices
  net->forward(tokens).pow(2).sum().backward();
  REQUIRE(net->emb->weight.grad().is_sparse());
  REQUIRE(got);
  const torch::Tensor dense = net->emb->weight.grad().to_dense();
  const auto ref = torchdbg_test::reference(dense);
  CHECK(got->numel == 300);
  CHECK(got->zero_count == ref.zeros);  // the implicit zeros of 46 untouched rows, and any stored
  CHECK(got->finite_count == ref.finite);
  CHECK_CLOSE(got->mean, ref.mean, 1e-6);
  CHECK_CLOSE(got->std, ref.std, 1e-6);
  CHECK_CLOSE(got->l2_norm, ref.l2, 1e-6);
  CHECK(got->min == ref.min);
  CHECK(got->max == ref.max);
  const double fc_sq = net->fc->weight.grad().to(torch::kDouble).pow(2).sum().item<double>() +
                       net->fc->bias.grad().to(torch::kDouble).pow(2).sum().item<double>();
  REQUIRE(hooks.state().gradient_norm);
  CHECK_CLOSE(*hooks.state().gradient_norm, std::sqrt(ref.l2 * ref.l2 + fc_sq), 1e-6);
  const auto norms = session.gradient_norms();
  REQUIRE(norms.size() == 2);
  CHECK(norms[0].first == "emb");
  CHECK_CLOSE(norms[0].second, ref.l2, 1e-6);
  // The distribution covers every element too.
  const auto with_dist = torchdbg::compute_stats(net->emb->weight.grad(), torchdbg::StatsOptions().distribution(true));
  REQUIRE(with_dist.distribution);
  CHECK(with_dist.distribution->p50 == 0.0);  // most elements are implicit zeros
}

TEST_CASE("with auto_step, gradients never handed over are warned of once; a pass that throws before any gradient is counted",
          "[attach]") {
  torchdbg_test::SeededRng rng(25);
  auto net = torch::nn::Sequential(torch::nn::Linear(4, 6), torch::nn::Tanh(), torch::nn::Linear(6, 2));
  HookManager hooks;
  hooks.create_gradient_tracking_hook({});
  hooks.create_tensor_inspection_hook({});
  auto session = torchdbg::attach(*net, hooks, AttachOptions().auto_step(true));
  for (int i = 0; i < 4; ++i) (void)torch::autograd::grad({net->forward(torch::randn({3, 4})).sum()}, net->parameters());
  const int64_t steps = kHooksRunForGrad ? 4 : 0;  // 1.x: no gradient, no step
  CHECK(hooks.step() == steps);
  if (!kHooksRunForGrad) {
    REQUIRE(hooks.alerts().size() == 1);
    CHECK_THAT(hooks.alerts()[0].message, Catch::Contains("observe_gradients"));
  }
  // A loss hook that throws: the pass fails before any parameter's gradient.
  const auto loss = net->forward(torch::randn({3, 4})).sum();
  loss.register_hook([](const torch::Tensor&) -> torch::Tensor { throw std::runtime_error("loss hook"); });
  CHECK_THROWS(loss.backward());
  CHECK(session.failed_backward_passes() == 1);
  net->forward(torch::randn({3, 4})).sum().backward();
  CHECK(hooks.step() == steps + 1);
}

namespace {

/// The statistics each forward delivery carried, by name, as one manager's callback saw them.
struct ForwardLog {
  std::mutex mutex;
  std::vector<std::pair<std::string, double>> seen;  // (name, mean)
  explicit ForwardLog(HookManager& hooks) {
    hooks.register_callback("log", [this](const torchdbg::HookContext& c) {
      if (!c.is_forward()) return;
      std::lock_guard<std::mutex> lock(mutex);
      seen.emplace_back(std::string(c.layer_name()), c.stats().mean);
    });
    hooks.register_hook(HookConfig().trigger(HookTrigger::every_forward()).actions({HookAction::custom_callback("log")}));
  }
};

}  // namespace

TEST_CASE("sessions on one model each receive every forward output: a validation session beside training, two managers",
          "[attach]") {
  torchdbg_test::SeededRng rng(41);
  auto net = torch::nn::Sequential(torch::nn::Linear(6, 8), torch::nn::ReLU(), torch::nn::Linear(8, 3));
  const auto x = torch::randn({5, 6});
  // The reference, before anything is attached: what each layer returns for x.
  const auto y0 = net[0]->as<torch::nn::Linear>()->forward(x);
  const auto y1 = torch::relu(y0);
  const auto y2 = net[2]->as<torch::nn::Linear>()->forward(y1);
  const std::vector<std::pair<std::string, double>> want{
      {"0", y0.mean().item<double>()}, {"0/relu", y1.mean().item<double>()}, {"2", y2.mean().item<double>()}};
  const auto same = [&](const std::vector<std::pair<std::string, double>>& got) {
    if (got.size() != want.size()) return false;
    for (std::size_t i = 0; i < got.size(); ++i)
      if (got[i].first != want[i].first || std::fabs(got[i].second - want[i].second) > 1e-6) return false;
    return true;
  };
  HookManager train_hooks, eval_hooks, other_hooks;
  ForwardLog train(train_hooks), eval(eval_hooks), other(other_hooks);
  for (auto* h : {&train_hooks, &eval_hooks, &other_hooks}) h->create_gradient_tracking_hook({});
  auto training = torchdbg::attach(*net, train_hooks);
  auto validation = torchdbg::attach(*net, eval_hooks, AttachOptions().backward(false).no_grad_forward(true));
  auto second = torchdbg::attach(*net, other_hooks);  // a full session on a second manager
  for (int step = 0; step < 2; ++step) {
    INFO("step " << step);
    for (auto* h : {&train_hooks, &eval_hooks, &other_hooks}) h->set_step(step);
    train.seen.clear();
    eval.seen.clear();
    other.seen.clear();
    net->zero_grad();
    net->forward(x).sum().backward();
    CHECK(same(train.seen));
    CHECK(same(eval.seen));
    CHECK(same(other.seen));
    // An evaluation pass: only the session observing no-grad forwards sees it.
    for (auto* h : {&train_hooks, &eval_hooks, &other_hooks}) h->set_step(10 + step);
    train.seen.clear();
    eval.seen.clear();
    other.seen.clear();
    {
      torch::NoGradGuard no_grad;
      net->forward(x);
    }
    for (auto* h : {&train_hooks, &eval_hooks, &other_hooks}) h->set_step(20 + step);
    CHECK(train.seen.empty());
    CHECK(same(eval.seen));
    CHECK(other.seen.empty());
  }
  // Both gradient sessions have every gradient, each in its own norms.
  double total = 0;
  for (const auto& p : net->parameters()) total += p.grad().to(torch::kDouble).pow(2).sum().item<double>();
  REQUIRE(train_hooks.state().gradient_norm);
  REQUIRE(other_hooks.state().gradient_norm);
  CHECK_CLOSE(*train_hooks.state().gradient_norm, std::sqrt(total), 1e-6);
  CHECK_CLOSE(*other_hooks.state().gradient_norm, std::sqrt(total), 1e-6);
  CHECK(training.gradient_norms() == second.gradient_norms());
  CHECK(training.backward_deliveries() == second.backward_deliveries());
  CHECK(validation.backward_deliveries() == 0);
}

TEST_CASE("Hogwild: two threads' passes on one model keep their own norms, also when one runs inside the other",
          "[attach]") {
  torchdbg_test::SeededRng rng(43);
  auto net = torch::nn::Sequential(torch::nn::Linear(6, 8), torch::nn::Tanh(), torch::nn::Linear(8, 8),
                                   torch::nn::Tanh(), torch::nn::Linear(8, 2));
  const auto xa = torch::randn({4, 6}), xb = torch::randn({7, 6}) * 3;
  const auto loss_of = [&](const torch::Tensor& x) { return net->forward(x).pow(2).mean(); };
  // The reference: each pass's gradients alone, before anything is attached.
  const auto named = net->named_parameters();
  struct Norms {
    double global = 0;
    std::map<std::string, double> modules;
  };
  const auto reference = [&](const torch::Tensor& x) {
    std::vector<torch::Tensor> params;
    for (const auto& p : named) params.push_back(p.value());
    const auto grads = torch::autograd::grad({loss_of(x)}, params);
    Norms n;
    for (std::size_t i = 0; i < grads.size(); ++i) {
      const double sq = grads[i].to(torch::kDouble).pow(2).sum().item<double>();
      const std::string key = named.keys()[i];
      n.modules[key.substr(0, key.find('.'))] += sq;
      n.global += sq;
    }
    n.global = std::sqrt(n.global);
    for (auto& [m, v] : n.modules) v = std::sqrt(v);
    return n;
  };
  const Norms ref_a = reference(xa), ref_b = reference(xb);
  HookManager hooks;
  hooks.create_gradient_tracking_hook({});
  auto session = torchdbg::attach(*net, hooks, AttachOptions().concurrent_forward(true));
  std::mutex m;
  std::vector<std::pair<std::thread::id, Norms>> ends;
  hooks.add_listener([&](HookManager::Change c) {
    if (c != HookManager::Change::GradientNorm) return;
    Norms n;
    n.global = *hooks.reported_gradient_norm();
    for (const auto& [name, v] : session.gradient_norms()) n.modules[name] = v;
    std::lock_guard<std::mutex> lock(m);
    ends.emplace_back(std::this_thread::get_id(), n);
  });
  // A's pass blocks after its last layer's gradients (a hook on the first Tanh's output)
  // until B's whole pass has run on another thread.
  std::condition_variable cv;
  int phase = 0;
  std::thread::id thread_b;
  const auto check = [&](const Norms& got, const Norms& ref) {
    CHECK_CLOSE(got.global, ref.global, 1e-6);
    REQUIRE(got.modules.size() == ref.modules.size());
    for (const auto& [name, v] : ref.modules) {
      INFO(name);
      CHECK_CLOSE(got.modules.at(name), v, 1e-6);
    }
  };
  for (int step = 0; step < 3; ++step) {
    INFO("step " << step);
    hooks.set_step(step);
    ends.clear();
    phase = 0;
    const auto h = net[1]->as<torch::nn::Tanh>()->forward(net[0]->as<torch::nn::Linear>()->forward(xa));
    h.register_hook([&](const torch::Tensor&) {
      std::unique_lock<std::mutex> lock(m);
      phase = 1;
      cv.notify_all();
      cv.wait(lock, [&] { return phase == 2; });
    });
    auto rest = net[4]->as<torch::nn::Linear>()->forward(
        net[3]->as<torch::nn::Tanh>()->forward(net[2]->as<torch::nn::Linear>()->forward(h)));
    std::thread b([&] {
      thread_b = std::this_thread::get_id();
      {
        std::unique_lock<std::mutex> lock(m);
        cv.wait(lock, [&] { return phase == 1; });
      }
      loss_of(xb).backward();
      std::lock_guard<std::mutex> lock(m);
      phase = 2;
      cv.notify_all();
    });
    rest.pow(2).mean().backward();
    b.join();
    REQUIRE(ends.size() == 2);
    CHECK(ends[0].first == thread_b);
    check(ends[0].second, ref_b);
    check(ends[1].second, ref_a);
  }
}

TEST_CASE("a model on the stack is attached like one held by a shared_ptr", "[attach]") {
  struct Net : torch::nn::Module {
    Net() {
      fc1 = register_module("fc1", torch::nn::Linear(4, 6));
      fc2 = register_module("fc2", torch::nn::Linear(6, 2));
    }
    torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))); }
    torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  };
  Net model;  // as PyTorch's mnist example builds it
  HookManager hooks;
  std::vector<std::string> names;
  hooks.register_callback("n", [&](const torchdbg::HookContext& c) {
    names.push_back(std::string(c.layer_name()) + (c.is_forward() ? "" : "." + std::string(*c.metadata_value("parameter"))));
  });
  hooks.register_hook(HookConfig().trigger(HookTrigger::every_n_steps(1)).actions({HookAction::custom_callback("n")}));
  auto session = torchdbg::attach(model, hooks);
  hooks.set_step(0);
  model.forward(torch::randn({3, 4})).sum().backward();
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"fc1", "fc1.bias", "fc1.weight", "fc1/relu", "fc2", "fc2.bias", "fc2.weight"});
  CHECK(session.execution_order() == std::vector<std::string>{"fc1", "fc2"});
}

TEST_CASE("Hogwild at full speed: every pass's norms are its reference's, one step a pass, thrown passes counted",
          "[attach]") {
  for (const auto batching : {torchdbg::StatsBatching::Device, torchdbg::StatsBatching::All}) {
    INFO("batching " << static_cast<int>(batching));
    torchdbg_test::SeededRng rng(47);
    auto net = torch::nn::Sequential(torch::nn::Linear(6, 12), torch::nn::Tanh(), torch::nn::Linear(12, 2));
    const int threads = 3, passes = 12;
    const auto named = net->named_parameters();
    std::vector<torch::Tensor> params;
    for (const auto& p : named) params.push_back(p.value());
    // The reference of each pass, before anything is attached: its global and module norms.
    std::vector<torch::Tensor> xs;
    std::vector<std::pair<double, std::map<std::string, double>>> refs;
    for (int i = 0; i < threads * passes; ++i) {
      xs.push_back(torch::randn({3 + i % 4, 6}) * (1.0 + 0.25 * i));
      const auto grads = torch::autograd::grad({net->forward(xs.back()).pow(2).mean()}, params);
      std::map<std::string, double> modules;
      double total = 0;
      for (std::size_t k = 0; k < grads.size(); ++k) {
        const double sq = grads[k].to(torch::kDouble).pow(2).sum().item<double>();
        modules[named.keys()[k].substr(0, 1)] += sq;
        total += sq;
      }
      for (auto& [m, v] : modules) v = std::sqrt(v);
      refs.emplace_back(std::sqrt(total), modules);
    }
    HookManager hooks;
    hooks.create_gradient_tracking_hook({});
    auto session = torchdbg::attach(*net, hooks, AttachOptions().concurrent_forward(true).batching(batching).auto_step(true));
    std::mutex m;
    std::vector<std::pair<double, std::map<std::string, double>>> seen;
    std::atomic<int> failed{0};
    hooks.add_listener([&](HookManager::Change c) {
      if (c == HookManager::Change::BackwardFailed) ++failed;
      if (c != HookManager::Change::GradientNorm) return;
      std::map<std::string, double> modules;
      for (const auto& [name, v] : session.gradient_norms()) modules[name] = v;  // this pass's
      const double global = *hooks.reported_gradient_norm();
      std::lock_guard<std::mutex> lock(m);
      seen.emplace_back(global, std::move(modules));
    });
    hooks.set_step(0);
    std::atomic<int> thrown{0};
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        for (int i = 0; i < passes; ++i) {
          const auto& x = xs[static_cast<std::size_t>(t * passes + i)];
          torch::Tensor loss;
          if (t == 0 && i % 4 == 3) {
            // This pass throws after the last layer's gradients, before the first layer's.
            auto h = net[0]->as<torch::nn::Linear>()->forward(x);
            h.register_hook([](const torch::Tensor&) -> torch::Tensor { throw std::runtime_error("hook"); });
            loss = net[2]->as<torch::nn::Linear>()->forward(torch::tanh(h)).pow(2).mean();
          } else {
            loss = net->forward(x).pow(2).mean();
          }
          try {
            loss.backward();
          } catch (const std::exception&) {
            ++thrown;
          }
        }
      });
    }
    for (auto& th : pool) th.join();
    CHECK(thrown.load() == 3);
    CHECK(failed.load() == 3);
    CHECK(session.failed_backward_passes() == 3);
    CHECK(hooks.step() == threads * passes - 3);
    // Each pass that ended matches one reference, each reference (but the thrown) once.
    REQUIRE(seen.size() == static_cast<std::size_t>(threads * passes - 3));
    std::vector<bool> used(refs.size(), false);
    for (int i = 0; i < passes; ++i)
      if (i % 4 == 3) used[static_cast<std::size_t>(i)] = true;  // thread 0's thrown passes
    for (const auto& [global, modules] : seen) {
      std::size_t k = 0;
      while (k < refs.size() && (used[k] || std::fabs(refs[k].first - global) > 1e-6 * std::max(1.0, global))) ++k;
      INFO("global " << global);
      REQUIRE(k < refs.size());
      used[k] = true;
      REQUIRE(modules.size() == refs[k].second.size());
      for (const auto& [name, v] : refs[k].second) CHECK_CLOSE(modules.at(name), v, 1e-6);
    }
  }
}

TEST_CASE("observe_gradients after a backward pass in the same step delivers the handed gradients", "[attach]") {
  torchdbg_test::SeededRng rng(53);
  auto net = torch::nn::Sequential(torch::nn::Linear(4, 5), torch::nn::Tanh(), torch::nn::Linear(5, 2));
  const auto x1 = torch::randn({3, 4}), x2 = torch::randn({6, 4}) * 2;
  const auto params = net->parameters();
  const auto ref = torch::autograd::grad({net->forward(x2).pow(2).sum()}, params);
  double ref_sq = 0;
  for (const auto& g : ref) ref_sq += g.to(torch::kDouble).pow(2).sum().item<double>();
  HookManager hooks;
  hooks.create_gradient_tracking_hook({});  // gradients only: no forward delivery opens the pass
  auto session = torchdbg::attach(*net, hooks, AttachOptions().auto_step(true));
  hooks.set_step(0);
  net->forward(x1).pow(2).sum().backward();
  CHECK(session.backward_deliveries() == 4);
  CHECK(hooks.step() == 1);
  const auto grads = torch::autograd::grad({net->forward(x2).pow(2).sum()}, params);
  session.observe_gradients(params, grads);
  // On LibTorch 1.x handed over; on 2.x delivered by the hooks autograd::grad runs, and not twice.
  CHECK(session.backward_deliveries() == 8);
  REQUIRE(hooks.state().gradient_norm);
  CHECK_CLOSE(*hooks.state().gradient_norm, std::sqrt(ref_sq), 1e-6);
  CHECK(hooks.step() == 2);
}

TEST_CASE("six sessions on one model: a two-operator call, an activation after other calls, tied weights", "[attach]") {
  struct Model : torch::nn::Module {
    Model() {
      tok = register_module("tok", torch::nn::Embedding(10, 6));
      fc = register_module("fc", torch::nn::Linear(6, 6));
      o1 = register_module("o1", torch::nn::Linear(6, 6));
      o2 = register_module("o2", torch::nn::Linear(6, 6));
      dec = register_module("dec", torch::nn::Linear(6, 10));
      dec->weight = tok->weight;  // tied
      w = register_parameter("w", torch::randn({6, 6}));
    }
    torch::Tensor forward(const torch::Tensor& ids) {
      const auto e = torch::relu(tok(ids));
      const auto y = fc(e);
      auto h = o1(e);
      h = h + o2(e);
      const auto mm = e.matmul(w.t()) + 1.0;  // the root's own call: two operators
      return dec(torch::tanh(y) + h + mm);
    }
    torch::nn::Embedding tok{nullptr};
    torch::nn::Linear fc{nullptr}, o1{nullptr}, o2{nullptr}, dec{nullptr};
    torch::Tensor w;
  };
  torchdbg_test::SeededRng rng(59);
  auto model = std::make_shared<Model>();
  const int n = 6;
  std::vector<std::unique_ptr<HookManager>> managers;
  std::vector<std::vector<std::string>> names(n);
  std::vector<torchdbg::AttachSession> sessions;
  for (int i = 0; i < n; ++i) {
    managers.push_back(std::make_unique<HookManager>());
    auto& list = names[static_cast<std::size_t>(i)];
    managers.back()->register_callback("n", [&list](const torchdbg::HookContext& c) {
      if (c.is_forward()) list.push_back(std::string(c.layer_name()) + "#" + std::string(*c.metadata_value("call")));
    });
    managers.back()->register_hook(
        HookConfig().trigger(HookTrigger::every_forward()).actions({HookAction::custom_callback("n")}));
    sessions.push_back(torchdbg::attach(*model, *managers.back()));
  }
  model->forward(torch::randint(0, 10, {4})).sum().backward();
  const std::vector<std::string> want{"tok#0", "tok/relu#0", "fc#0", "o1#0", "o2#0", "root#0", "fc/tanh#0", "dec#0"};
  for (int i = 0; i < n; ++i) {
    INFO("session " << i);
    auto got = names[static_cast<std::size_t>(i)];
    std::sort(got.begin(), got.end());
    auto w = want;
    std::sort(w.begin(), w.end());
    CHECK(got == w);
  }
}

namespace {

/// A BatchNorm alone (any dimension), its input the data.
struct BnNet : torch::nn::Module {
  explicit BnNet(torch::nn::AnyModule m) : bn(std::move(m)) { register_module("bn", bn.ptr()); }
  torch::Tensor forward(const torch::Tensor& x) { return bn.forward(x); }
  torch::nn::AnyModule bn;
};

/// The eval-mode error of running statistics (mean `rm`, variance `rv`) against batch `x`'s,
/// per channel sqrt((a-1)^2 + b^2) with a = sqrt((var+eps)/(rv+eps)), b = (mean-rm)/sqrt(rv+eps),
/// then the RMS over channels: a naive loop in double.
double norm_error_reference(const torch::Tensor& x, const std::vector<double>& rm, const std::vector<double>& rv,
                            double eps) {
  const auto v = torchdbg_test::as_doubles(x.contiguous());
  const int64_t channels = x.size(1);
  const int64_t inner = x.numel() / (x.size(0) * channels);
  std::vector<double> sum(channels, 0.0), sq(channels, 0.0);
  std::vector<int64_t> n(channels, 0);
  for (std::size_t i = 0; i < v.size(); ++i) {
    const auto c = static_cast<std::size_t>((static_cast<int64_t>(i) / inner) % channels);
    sum[c] += v[i];
    ++n[c];
  }
  for (std::size_t i = 0; i < v.size(); ++i) {
    const auto c = static_cast<std::size_t>((static_cast<int64_t>(i) / inner) % channels);
    const double d = v[i] - sum[c] / static_cast<double>(n[c]);
    sq[c] += d * d;
  }
  double total = 0.0;
  for (std::size_t c = 0; c < static_cast<std::size_t>(channels); ++c) {
    const double mean = sum[c] / static_cast<double>(n[c]), var = sq[c] / static_cast<double>(n[c]);
    const double a = std::sqrt((var + eps) / (rv[c] + eps)), b = (mean - rm[c]) / std::sqrt(rv[c] + eps);
    total += (a - 1.0) * (a - 1.0) + b * b;
  }
  return std::sqrt(total / static_cast<double>(channels));
}

}  // namespace

TEST_CASE("property: a BatchNorm's training calls report their running statistics' error against the batch; a "
          "normalization its weight's RMS",
          "[attach]") {
  torchdbg_test::SeededRng seed(31337);
  std::mt19937 gen(2024);
  auto pick = [&](int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(gen); };
  const c10::optional<double> momenta[] = {0.1, 0.5, c10::nullopt, 0.0, 5e-4, 1.0, 0.01};
  int64_t judged = 0, warming = 0, direct = 0, late = 0;
  for (int trial = 0; trial < 28; ++trial) {
    const int64_t dims = 2 + trial % 4;  // [N, C], [N, C, L], [N, C, H, W], [N, C, D, H, W]
    const int64_t channels = pick(1, 6), batch = pick(2, 9);
    const c10::optional<double> momentum = momenta[static_cast<std::size_t>(trial) % std::size(momenta)];
    const bool affine = pick(0, 1) == 1;
    const bool loaded = pick(0, 2) == 0;  // buffers from a checkpoint: random statistics, long history
    const double unit = std::pow(10.0, static_cast<double>(pick(-3, 3)));
    INFO("trial " << trial << " dims " << dims << " C " << channels << " N " << batch << " momentum "
                  << (momentum ? std::to_string(*momentum) : "None") << " affine " << affine << " loaded " << loaded
                  << " unit " << unit);
    torch::nn::AnyModule any;
    torch::Tensor *rm = nullptr, *rv = nullptr, *nbt = nullptr, *weight = nullptr;
    std::function<void(c10::optional<double>)> set_momentum;
    auto setup = [&](auto holder) {
      holder->options.momentum(momentum);
      set_momentum = [holder](c10::optional<double> v) mutable { holder->options.momentum(v); };
      any = torch::nn::AnyModule(holder);
      rm = &holder->running_mean;
      rv = &holder->running_var;
      nbt = &holder->num_batches_tracked;
      weight = &holder->weight;
    };
    if (dims <= 3) setup(torch::nn::BatchNorm1d(torch::nn::BatchNorm1dOptions(channels).affine(affine)));
    if (dims == 4) setup(torch::nn::BatchNorm2d(torch::nn::BatchNorm2dOptions(channels).affine(affine)));
    if (dims == 5) setup(torch::nn::BatchNorm3d(torch::nn::BatchNorm3dOptions(channels).affine(affine)));
    auto net = std::make_shared<BnNet>(any);
    // float64 models; data far from 0 against its spread (the update cannot be read back in
    // float32); a momentum lowered mid-training (0.1 -> 0.01, 0.5 -> 0.05)
    const bool float64 = trial % 5 == 3;
    const double offset = trial % 3 == 1 ? 1e4 : 0.0;
    const bool lowered = momentum && *momentum > 0.0 && *momentum < 1.0 && trial % 2 == 0;
    INFO("float64 " << float64 << " offset " << offset << " lowered " << lowered);
    if (float64) net->to(torch::kDouble);
    if (loaded) {
      torch::NoGradGuard g;
      rm->copy_(torch::randn({channels}) * unit);
      rv->copy_((torch::rand({channels}) + 0.2) * unit * unit);
      nbt->fill_(100000);
    }
    torchdbg::HookManager hooks;
    std::vector<std::optional<std::string>> got, weight_rms;
    hooks.register_callback("rec", [&](const torchdbg::HookContext& c) {
      if (c.layer_name() != "bn") return;
      auto e = c.metadata_value("norm_stats_error");
      got.push_back(e ? std::optional<std::string>(std::string(*e)) : std::nullopt);
      auto w = c.metadata_value("norm_weight_rms");
      weight_rms.push_back(w ? std::optional<std::string>(std::string(*w)) : std::nullopt);
    });
    hooks.register_hook(HookConfig().name("rec").trigger(HookTrigger::every_n_steps(1)).actions(
        {HookAction::custom_callback("rec")}));
    auto session = torchdbg::attach(*net, hooks, AttachOptions().no_grad_forward(true));
    const int64_t steps = 50;
    int64_t ref_k = -1;  // the reference's record of the previous training call
    double ref_m = 0.0, ref_w = std::nan("");
    for (int64_t step = 0; step < steps + 3; ++step) {
      hooks.set_step(step);
      std::vector<int64_t> shape{batch, channels};
      for (int64_t d = 2; d < dims; ++d) shape.push_back(pick(1, 4));
      // the data's distribution drifts per channel, so the running statistics lag behind
      std::vector<int64_t> per_channel(static_cast<std::size_t>(dims), 1);
      per_channel[1] = channels;
      const double t = static_cast<double>(step);
      const auto scale = (torch::rand({channels}) * 0.5 + 0.75 + 0.02 * t).view(per_channel);
      const auto shift = (torch::randn({channels}) * 0.3 + 0.03 * t).view(per_channel);
      const torch::Tensor x =
          ((torch::randn(shape) * scale + shift + offset) * unit).to(float64 ? torch::kDouble : torch::kFloat);
      if (lowered && step == 25) set_momentum(*momentum * 0.1);
      const c10::optional<double> momentum_now = lowered && step >= 25 ? c10::optional<double>(*momentum * 0.1) : momentum;
      const bool train = step < steps;
      net->train(train);
      const auto mean_before = torchdbg_test::as_doubles(*rm), var_before = torchdbg_test::as_doubles(*rv);
      const int64_t k = nbt->item<int64_t>() + (train ? 1 : 0);  // counts this call, as the module does
      got.clear();
      weight_rms.clear();
      if (step == steps + 2) {
        torch::NoGradGuard g;
        (void)net->forward(x);
      } else {
        (void)net->forward(x);
      }
      session.flush();  // the call's output is pending until something else runs
      REQUIRE(got.size() == 1);
      // the weight's RMS on every delivery of an affine norm; 1 without parameters
      REQUIRE(weight_rms[0].has_value());
      CHECK_CLOSE(std::stod(*weight_rms[0]), affine ? weight->pow(2).mean().sqrt().item<double>() : 1.0, 1e-6);
      // warm: the initial statistics weigh under 1% (momentum 0: after 44 calls)
      const double m = momentum_now ? *momentum_now : 1.0 / static_cast<double>(k);
      // warm: the initial statistics' weight, followed from call to call, under 1% (momentum
      // 0 with nothing known: after 44 calls), and not making the error 0.1 or more worse
      bool warm = false;
      double init = std::nan("");
      if (train) {
        const auto inverse = [](double v, double n) { return n >= 1.0 && std::abs(v - 1.0 / n) <= 1e-9 / n; };
        if (inverse(m, static_cast<double>(k)) && ref_k == k - 1 && inverse(ref_m, static_cast<double>(k - 1)))
          init = 0.0;
        else if (m >= 1.0)
          init = k >= 2 ? 0.0 : 1.0;
        else if (ref_k >= 0 && ref_k < k && std::isfinite(ref_w))
          init = ref_w * (1.0 - ref_m) * std::pow(1.0 - m, static_cast<double>(k - ref_k - 1));
        else if (m > 0.0)
          init = std::pow(1.0 - m, static_cast<double>(k - 1));
        ref_k = k;
        ref_m = m;
        ref_w = init;
        warm = std::isfinite(init) ? init < 0.01 : k - 1 >= 44;
      }
      if (warm && init > 0.0) {
        std::vector<double> mean_started = mean_before, var_started = var_before;
        for (std::size_t c = 0; c < mean_started.size(); ++c) {
          mean_started[c] /= 1.0 - init;
          var_started[c] = std::max(0.0, (var_started[c] - init) / (1.0 - init));
        }
        warm = norm_error_reference(x, mean_before, var_before, 1e-5) -
                   norm_error_reference(x, mean_started, var_started, 1e-5) <
               0.1;
        if (!warm) ++late;
      }
      if (!train || !warm) {
        INFO("step " << step << " k " << k << " train " << train);
        CHECK_FALSE(got[0].has_value());
        if (train) ++warming;
        continue;
      }
      REQUIRE(got[0].has_value());
      const double want = norm_error_reference(x, mean_before, var_before, 1e-5);
      // Read back from the update, the batch's moments carry the float32 buffers' rounding
      // (6e-8 relative) divided by the momentum; from the batch, double sums.
      double spread = 1.0;
      for (std::size_t c = 0; c < mean_before.size(); ++c)
        spread = std::max(spread, std::abs(mean_before[c]) / std::sqrt(var_before[c] + 1e-5));
      const double tol = m >= 1e-3 ? 1e-6 + 6e-7 * (1.0 + spread) / m : 1e-9;
      INFO("step " << step << " k " << k << " got " << *got[0] << " want " << want << " tol " << tol);
      CHECK(std::abs(std::stod(*got[0]) - want) <= tol * (1.0 + want));
      ++judged;
      if (m < 1e-3) ++direct;
    }
  }
  CHECK(judged > 200);
  CHECK(warming > 100);
  CHECK(direct > 20);
  CHECK(late > 0);  // data of a small variance (unit 1e-3) forgets the initial statistics later
  // Modules without batch statistics: no error; LayerNorm reports its weight's RMS
  torch::nn::Sequential model(torch::nn::Linear(6, 8), torch::nn::BatchNorm1d(torch::nn::BatchNorm1dOptions(8).track_running_stats(false)),
                              torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})));
  {
    torch::NoGradGuard g;
    model[2]->named_parameters()["weight"].mul_(0.25);
  }
  torchdbg::HookManager hooks;
  std::map<std::string, std::map<std::string, std::string>> md;
  hooks.register_callback("rec", [&](const torchdbg::HookContext& c) {
    for (const char* key : {"norm_stats_error", "norm_weight_rms", "norm_samples"})
      if (auto v = c.metadata_value(key)) md[std::string(c.layer_name())][key] = std::string(*v);
  });
  hooks.register_hook(HookConfig().name("rec").trigger(HookTrigger::every_n_steps(1)).actions(
      {HookAction::custom_callback("rec")}));
  auto session = torchdbg::attach(*model, hooks);
  for (int64_t step = 0; step < 60; ++step) {
    hooks.set_step(step);
    (void)model->forward(torch::randn({16, 6}));
  }
  // Running statistics a NaN batch poisoned are infinitely off from every later batch's
  {
    auto bn = torch::nn::BatchNorm1d(torch::nn::BatchNorm1dOptions(4).momentum(0.5));
    auto poisoned = std::make_shared<BnNet>(torch::nn::AnyModule(bn));
    torchdbg::HookManager h;
    std::vector<std::string> errors;
    h.register_callback("rec", [&](const torchdbg::HookContext& c) {
      if (auto v = c.metadata_value("norm_stats_error")) errors.emplace_back(*v);
    });
    h.register_hook(HookConfig().name("rec").trigger(HookTrigger::every_n_steps(1)).actions(
        {HookAction::custom_callback("rec")}));
    auto s2 = torchdbg::attach(*poisoned, h);
    for (int64_t step = 0; step < 14; ++step) {
      h.set_step(step);
      auto x = torch::randn({8, 4});
      if (step == 12) x[3][1] = std::numeric_limits<float>::quiet_NaN();
      (void)poisoned->forward(x);
      s2.flush();
    }
    REQUIRE(errors.size() >= 3);
    CHECK(std::isfinite(std::stod(errors[errors.size() - 3])));  // step 11
    CHECK(std::isinf(std::stod(errors.back())));                 // step 13: the buffers hold NaN
  }
  CHECK(md["1"].count("norm_stats_error") == 0);
  CHECK(md["0"].empty());
  REQUIRE(md["2"].count("norm_weight_rms") == 1);
  CHECK_CLOSE(std::stod(md["2"]["norm_weight_rms"]), 0.25, 1e-9);
}

TEST_CASE("a hook reads attach's measured metadata as text while the health monitor reads it as numbers",
          "[attach]") {
  // A batch of one through a Linear (std_less_bias), a model input with +Inf (input_inf), a
  // BatchNorm with momentum 0.3 (norm_momentum, norm_samples), all against references
  // computed here; metadata() and metadata_value() agree, and the health monitor installed on
  // the same manager judges the same deliveries.
  struct Net : torch::nn::Module {
    Net() {
      fc = register_module("fc", torch::nn::Linear(6, 4));
      bn = register_module("bn", torch::nn::BatchNorm1d(torch::nn::BatchNorm1dOptions(4).momentum(0.3)));
    }
    torch::Tensor forward(const torch::Tensor& x) { return bn(fc(x)); }
    torch::nn::Linear fc{nullptr};
    torch::nn::BatchNorm1d bn{nullptr};
  };
  torchdbg_test::SeededRng rng(41);
  auto net = std::make_shared<Net>();
  torchdbg::HookManager h;
  torchdbg::HealthMonitor health;
  auto fed = health.install(h);
  std::map<std::string, torchdbg::Metadata> seen;
  bool agree = true;
  h.register_callback("rec", [&](const torchdbg::HookContext& c) {
    const torchdbg::Metadata& md = c.metadata();
    for (const auto& [k, v] : md) agree = agree && c.metadata_value(k) == std::optional<std::string_view>(v);
    seen[std::string(c.layer_name())] = md;
  });
  h.register_hook(HookConfig().name("rec").trigger(HookTrigger::every_forward()).actions(
      {HookAction::custom_callback("rec")}));
  auto session = torchdbg::attach(*net, h);
  // The batch-of-one call: fc's std with its bias taken out.
  h.set_step(0);
  {
    net->eval();  // a batch of one through BatchNorm needs its running statistics
    const auto x = torch::randn({1, 6});
    (void)net->forward(x);
    session.flush();
    REQUIRE(seen["fc"].count("std_less_bias") == 1);
    const std::string got = seen["fc"]["std_less_bias"];
    // x W^T in double, read from the raw values (no operator the attachment would see).
    const auto xs = torchdbg_test::as_doubles(x.contiguous());
    const auto w = torchdbg_test::as_doubles(net->fc->weight.detach().contiguous());
    std::vector<double> less(4, 0.0);
    for (std::size_t j = 0; j < 4; ++j)
      for (std::size_t k = 0; k < 6; ++k) less[j] += xs[k] * w[j * 6 + k];
    double mean = 0.0, sq = 0.0;
    for (double v : less) mean += v / 4.0;
    for (double v : less) sq += (v - mean) * (v - mean);
    const double ref = std::sqrt(sq / 4.0);
    CHECK_CLOSE(std::stod(got), ref, 1e-5 * std::max(1.0, ref));
    net->train();
  }
  std::map<std::string, torchdbg::Metadata> before;  // the step before the +Inf
  for (int64_t step = 1; step < 30; ++step) {
    h.set_step(step);
    auto x = torch::randn({8, 6});
    if (step == 29) x[2][3] = std::numeric_limits<float>::infinity();
    before = seen;
    seen.clear();
    (void)net->forward(x);
    session.flush();
  }
  REQUIRE(seen.count("fc") == 1);
  CHECK(seen["fc"]["input_inf"] == "1");
  CHECK(seen["fc"]["input_nan"] == "0");
  CHECK(seen["fc"]["input_count"] == "47");
  CHECK(before["fc"]["input_inf"] == "0");
  REQUIRE(before.count("bn") == 1);
  CHECK(before["bn"]["norm_momentum"] == "0.3");
  CHECK(before["bn"]["norm_samples"] == "8");
  CHECK(before["bn"].count("norm_stats_error") == 1);
  CHECK(before["bn"]["norm_weight_rms"] == "1");  // BatchNorm's weight starts at ones
  CHECK(agree);
  // The health monitor judged the same deliveries: the +Inf in the model's input is named as
  // bad input, not a failure of the layers.
  health.flush();
  std::vector<torchdbg::Incident> bad;
  for (const auto& i : health.incidents())
    if (i.kind == torchdbg::FailureKind::BadInput) bad.push_back(i);
  REQUIRE(bad.size() == 1);
  CHECK(bad[0].layer == "input");
  CHECK(bad[0].step == 29);
}

TEST_CASE("a hook may read a delivery's metadata from several threads at once", "[attach]") {
  // The measured entries are written into the metadata by the first reader; readers racing
  // for it see one map, the same text.
  torchdbg_test::SeededRng rng(43);
  auto net = torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 2));
  torchdbg::HookManager h;
  std::atomic<int> reads{0}, missing{0}, differing{0};
  h.register_callback("par", [&](const torchdbg::HookContext& c) {
    if (!c.is_forward()) return;
    std::atomic<bool> go{false};
    std::vector<std::string> got(4);
    std::vector<std::thread> threads;
    for (std::size_t i = 0; i < got.size(); ++i)
      threads.emplace_back([&, i] {
        while (!go.load()) std::this_thread::yield();
        for (int k = 0; k < 3; ++k) {
          const torchdbg::Metadata& md = c.metadata();
          std::string all;  // every entry, as a hook that logs them reads them
          for (const auto& [key, value] : md) all += key + "=" + value + ";";
          const auto v = c.metadata_value("input_alike");
          const auto it = md.find("input_alike");
          if (!v || it == md.end()) {
            // the Linears' calls have it (not the ReLU's output, delivered as "0/relu")
            if (c.layer_name() == "0" || c.layer_name() == "2") ++missing;
          } else if (*v != it->second) {
            ++differing;
          }
          got[i] = all;
          ++reads;
        }
      });
    go = true;
    for (auto& t : threads) t.join();
    for (const auto& g : got)
      if (g != got[0]) ++differing;
  });
  h.register_hook(HookConfig().name("par").trigger(HookTrigger::every_n_steps(1)).actions(
      {HookAction::custom_callback("par")}));
  auto session = torchdbg::attach(*net, h);
#if defined(__SANITIZE_THREAD__)
  constexpr int64_t kSteps = 60;  // ThreadSanitizer sees the race itself
#else
  constexpr int64_t kSteps = 3000;  // enough racing readers to crash on an unguarded write
#endif
  for (int64_t step = 0; step < kSteps; ++step) {
    h.set_step(step);
    net->forward(torch::randn({3, 4})).sum().backward();
  }
  CHECK(reads.load() == kSteps * 3 * 4 * 3);  // three forward deliveries a step
  CHECK(missing.load() == 0);
  CHECK(differing.load() == 0);
}

namespace {
/// Counts the operators a second RecordFunction observer sees, by name.
struct OpCounter {
  static std::map<std::string, int>& counts() {
    static std::map<std::string, int> c;
    return c;
  }
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  at::CallbackHandle handle = at::addGlobalCallback(
      at::RecordFunctionCallback(
          [](const at::RecordFunction& fn) -> std::unique_ptr<at::ObserverContext> {
            std::lock_guard<std::mutex> lock(mutex());
            ++counts()[fn.name()];
            return nullptr;
          },
          nullptr)
          .scopes({at::RecordScope::FUNCTION}));
  OpCounter() { counts().clear(); }
  ~OpCounter() { at::removeCallback(handle); }
  int of(const std::string& name) {
    std::lock_guard<std::mutex> lock(mutex());
    return counts()[name];
  }
};

/// A GRUCell unrolled over time, an LSTM, a BatchNorm'd Conv2d, a LayerNorm and an attention:
/// composite operators that run many operators inside them.
struct CompositeNet : torch::nn::Module {
  CompositeNet()
      : cell(register_module("cell", torch::nn::GRUCell(6, 8))),
        lstm(register_module("lstm", torch::nn::LSTM(torch::nn::LSTMOptions(8, 8).batch_first(true)))),
        conv(register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 2, 3).padding(1)))),
        bn(register_module("bn", torch::nn::BatchNorm2d(2))),
        ln(register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})))),
        att(register_module("att", torch::nn::MultiheadAttention(8, 2))),
        head(register_module("head", torch::nn::Linear(8, 3))) {}
  torch::Tensor forward(const torch::Tensor& x) {  // [batch, time, 6]
    auto h = torch::zeros({x.size(0), 8});
    std::vector<torch::Tensor> hs;
    for (int64_t t = 0; t < x.size(1); ++t) hs.push_back(h = cell(x.select(1, t), h));
    auto seq = std::get<0>(lstm(torch::stack(hs, 1)));                              // [b, t, 8]
    auto img = bn(conv(seq.unsqueeze(1))).mean(1);                                  // [b, t, 8]
    auto q = ln(img).transpose(0, 1);                                               // [t, b, 8]
    return head(std::get<0>(att(q, q, q)).mean(0));
  }
  torch::nn::GRUCell cell;
  torch::nn::LSTM lstm;
  torch::nn::Conv2d conv;
  torch::nn::BatchNorm2d bn;
  torch::nn::LayerNorm ln;
  torch::nn::MultiheadAttention att;
  torch::nn::Linear head;
};
}  // namespace

TEST_CASE("the operators inside a decided composite operator are not boxed for the observer; "
          "deliveries and other observers are unchanged",
          "[attach]") {
  // Same seeds, two runs: torchdbg alone (it turns RecordFunction off inside gru_cell, lstm,
  // batch_norm, ... on this thread), and beside another observer (which must then see every
  // operator, so nothing is turned off). Every delivered tensor must be equal.
  const auto run = [](bool other_observer, std::map<std::string, int>* seen) {
    torch::manual_seed(11);
    auto net = std::make_shared<CompositeNet>();
    torch::optim::SGD opt(net->parameters(), 0.05);
    HookManager hooks;
    Recorder rec;
    rec.install(hooks);
    std::optional<OpCounter> counter;
    if (other_observer) counter.emplace();
    auto session = torchdbg::attach(*net, hooks);
    for (int64_t step = 0; step < 4; ++step) {
      hooks.set_step(step);
      opt.zero_grad();
      auto loss = net->forward(torch::randn({3, 5, 6})).pow(2).mean();
      CHECK(at::isRecordFunctionEnabled());
      loss.backward();
      opt.step();
      CHECK(at::isRecordFunctionEnabled());
    }
    if (seen != nullptr && counter)
      for (const char* name : {"aten::sigmoid_", "aten::tanh_", "aten::sigmoid", "aten::tanh", "aten::native_batch_norm", "aten::native_layer_norm",
                               "aten::addmm", "aten::bmm"})
        (*seen)[name] = counter->of(name);
    return rec;
  };
  std::map<std::string, int> with_torchdbg;
  const Recorder alone = run(false, nullptr);
  const Recorder beside = run(true, &with_torchdbg);
  REQUIRE(alone.fwd.size() == 4);
  REQUIRE(alone.fwd.size() == beside.fwd.size());
  for (const auto& [step, layers] : alone.fwd) {
    INFO("step " << step);
    REQUIRE(beside.fwd.at(step).size() == layers.size());
    CHECK(layers.count("cell") == 1);
    CHECK(layers.at("cell").size() == 5);  // one delivery per call
    for (const auto& [name, tensors] : layers) {
      INFO(name);
      const auto& other = beside.fwd.at(step).at(name);
      REQUIRE(other.size() == tensors.size());
      for (std::size_t i = 0; i < tensors.size(); ++i) CHECK(torch::equal(tensors[i], other[i]));
    }
  }
  CHECK(alone.bwd.size() == beside.bwd.size());
  // The other observer saw as many of gru_cell's, lstm's, batch_norm's, ... inner operators
  // with torchdbg attached as it sees without torchdbg.
  std::map<std::string, int> without;
  {
    torch::manual_seed(11);
    auto net = std::make_shared<CompositeNet>();
    torch::optim::SGD opt(net->parameters(), 0.05);
    OpCounter counter;
    for (int64_t step = 0; step < 4; ++step) {
      opt.zero_grad();
      auto loss = net->forward(torch::randn({3, 5, 6})).pow(2).mean();
      loss.backward();
      opt.step();
    }
    for (const auto& [name, n] : with_torchdbg) without[name] = counter.of(name);
  }
  CHECK(with_torchdbg == without);
  CHECK(without.at("aten::native_layer_norm") > 0);
  CHECK(without.at("aten::native_batch_norm") > 0);
}

TEST_CASE("a sampling manager's gradient norms are estimates within their sampling error; NaN gradients stay exact",
          "[attach]") {
  torchdbg_test::SeededRng rng(82);
  auto net = torch::nn::Sequential(torch::nn::Linear(512, 300), torch::nn::Tanh(), torch::nn::Linear(300, 5));
  torchdbg::HookManager hooks(torchdbg::HookManagerOptions().sampling(torchdbg::StatsSampling().stride(4)));
  hooks.create_gradient_tracking_hook({});
  std::map<std::string, torchdbg::TensorStats> grads;
  hooks.register_callback("grads", [&](const torchdbg::HookContext& c) {
    if (!c.is_forward()) grads[std::string(c.layer_name()) + "." + std::string(*c.metadata_value("parameter"))] = c.moment_stats();
  });
  hooks.register_hook(HookConfig().name("grads").trigger(HookTrigger::every_n_steps(1)).actions(
      {HookAction::custom_callback("grads")}));
  auto session = torchdbg::attach(*net, hooks);
  for (int step = 0; step < 3; ++step) {
    hooks.set_step(step);
    net->zero_grad();
    grads.clear();
    const auto x = torch::randn({64, 512});
    net->forward(x).pow(2).mean().backward();
    const auto w = net[0]->as<torch::nn::Linear>()->weight.grad();  // 153600 values: sampled
    INFO("step " << step);
    REQUIRE(grads.count("0.weight") == 1);
    const auto& s = grads.at("0.weight");
    CHECK(s.sampled_count > 0);
    CHECK(s.sampled_count < w.numel());
    const double exact = w.to(torch::kDouble).norm().item<double>();
    CHECK(std::fabs(s.l2_norm - exact) < 0.1 * exact);
    CHECK(grads.at("0.bias").sampled_count == 0);  // 300 values: read whole
    double global = 0.0;
    for (const auto& p : net->parameters()) global += p.grad().to(torch::kDouble).pow(2).sum().item<double>();
    REQUIRE(hooks.reported_gradient_norm());
    CHECK(std::fabs(*hooks.reported_gradient_norm() - std::sqrt(global)) < 0.1 * std::sqrt(global));
  }
  // A NaN in the input makes every gradient NaN: counted exactly, not estimated.
  hooks.set_step(3);
  net->zero_grad();
  auto x = torch::randn({64, 512});
  x[5][7] = std::numeric_limits<float>::quiet_NaN();
  net->forward(x).pow(2).mean().backward();
  const auto& s = grads.at("0.weight");
  CHECK(s.sampled_count == 0);
  CHECK(s.nan_count == net[0]->as<torch::nn::Linear>()->weight.grad().isnan().sum().item<int64_t>());
}

TEST_CASE("property: a call reading data made from deliveries (token + position embeddings) does not take the model's input",
          "[attach]") {
  // Embeddings read token ids; what the first floating call reads is their sum (or product,
  // or concatenation, or the sum through dropout and a scale, or masked or divided by a length
  // made from the ids, or a mean of an activation of theirs), not the model's input. A dense
  // input a Linear reads after the embeddings ran is the model's input (a recommender's dense
  // features), and so is an embedding plus, or times, raw floating data or counts converted
  // in the step, also where the raw data is written in place (into their sum, or into zeros).
  // Concatenated with them (`cat`, `stack`, through a view or a dropout), the input's NaN count
  // and RMS (`input_data_rms`) are the raw data's alone, against an independent reference,
  // whatever the embeddings add (a NaN row of theirs included); arithmetic on the mix is
  // judged whole.
  struct Mixed : torch::nn::Module {
    torch::nn::Embedding tok{nullptr}, pos{nullptr};
    torch::nn::Linear dense{nullptr}, first{nullptr}, head{nullptr};
    int combine = 0;
    bool dense_first = false;
    torch::Tensor raw;  // combine 4, 11, 12: raw floating data added to the embedding (12: copied into
                        // zeros first, 11: in place); 7: per-token weights; 9: counts; 13-15:
                        // concatenated to it
    Mixed(int64_t vocab, int64_t d, int combine_, bool dense_first_) : combine(combine_), dense_first(dense_first_) {
      tok = register_module("tok", torch::nn::Embedding(vocab, d));
      pos = register_module("pos", torch::nn::Embedding(16, d));
      dense = register_module("dense", torch::nn::Linear(5, d));
      first = register_module("first", torch::nn::Linear(combine == 2 || combine >= 13 ? 2 * d : d, d));
      head = register_module("head", torch::nn::Linear(2 * d, 3));
    }
    torch::Tensor forward(const torch::Tensor& ids, const torch::Tensor& x) {
      torch::Tensor dn;
      if (dense_first) dn = dense->forward(x);
      const auto t = tok->forward(ids), p = pos->forward(torch::arange(ids.size(1)));
      const auto e = combine == 0   ? t + p
                     : combine == 1 ? t * p.sigmoid()
                     : combine == 2 ? torch::cat({t, p.expand_as(t)}, -1)
                     : combine == 3 ? torch::dropout(t + p, 0.1, true) * 2.0
                     : combine == 4 ? t + raw
                     : combine == 5 ? t * (ids != 0).to(torch::kFloat).unsqueeze(-1)
                     : combine == 6 ? (t + p) / (ids != 0).sum(1, true).to(torch::kFloat).clamp_min(1).unsqueeze(-1)
                     : combine == 7 ? t * raw.unsqueeze(-1)
                     : combine == 8 ? t * torch::ones({ids.size(0), ids.size(1), 1}).masked_fill((ids == 0).unsqueeze(-1), 0.0)
                     : combine == 9 ? t * raw.to(torch::kFloat).unsqueeze(-1)
                     : combine == 10 ? torch::tanh(t).mean(1, true) + p
                     : combine == 11 ? (t + p).clone().add_(raw)
                     : combine == 12 ? t + torch::zeros({ids.size(0), ids.size(1), t.size(2)}).copy_(raw)
                     : combine == 13 ? torch::cat({t + p, raw}, -1)
                     : combine == 14 ? torch::dropout(torch::cat({raw, t}, -1), 0.1, true)
                                     : torch::stack({t, raw}, 2).flatten(2);
      const auto h = first->forward(e).mean(1);
      if (!dense_first) dn = dense->forward(x);
      return head->forward(torch::cat({h, dn}, -1));
    }
  };
  std::mt19937 rng(20261207);
  for (int trial = 0; trial < 64; ++trial) {
    torch::manual_seed(static_cast<uint64_t>(trial));
    auto net = std::make_shared<Mixed>(10 + static_cast<int64_t>(rng() % 30), 4 + static_cast<int64_t>(rng() % 8),
                                       static_cast<int>(trial % 16), rng() % 2 == 0);
    HookManager hooks;
    std::map<std::string, std::map<std::string, std::string>> md;
    hooks.register_callback("md", [&](const torchdbg::HookContext& c) {
      if (!c.is_forward()) return;
      auto& m = md[std::string(c.layer_name())];
      for (const char* k : {"input_nan", "input_rms", "input_data_rms", "input_count"})
        if (auto v = c.metadata_value(k)) m[k] = std::string(*v);
    });
    hooks.register_hook(HookConfig().name("md").trigger(HookTrigger::every_n_steps(1)).actions(
        {HookAction::custom_callback("md")}));
    auto session = torchdbg::attach(*net, hooks);
    for (int64_t step = 0; step < 2; ++step) {
      md.clear();
      hooks.set_step(step);
      const int64_t batch = 2 + static_cast<int64_t>(rng() % 4), len = 2 + static_cast<int64_t>(rng() % 14);
      auto x = torch::randn({batch, 5});
      net->raw = net->combine == 7   ? torch::rand({batch, len})
                 : net->combine == 9 ? torch::randint(0, 20, {batch, len})
                                     : torch::randn({batch, len, net->tok->options.embedding_dim()});
      // Step 1: one raw value NaN, or one embedding row (ids 1 appear in every batch).
      const int poison = step == 1 ? static_cast<int>(trial % 3) : 0;  // 1 raw, 2 embedding
      if (poison == 1 && net->combine != 9) net->raw.view(-1)[0] = std::nan("");
      auto ids = torch::randint(0, 10, {batch, len});
      ids[0][0] = 1;
      if (poison == 2) {
        torch::NoGradGuard g;
        net->tok->weight[1].fill_(std::nan(""));
      }
      const double raw_rms = net->raw.to(torch::kDouble).nan_to_num(0.0).square().sum().item<double>();
      const int64_t raw_count = net->raw.numel() - (poison == 1 && net->combine != 9 ? 1 : 0);
      net->forward(ids, x).sum().backward();
      if (poison == 2) {
        torch::NoGradGuard g;
        net->tok->weight[1].normal_();
      }
      // The call that takes the model's input: the first on raw floating data.
      const bool raw = net->combine == 4 || net->combine == 7 || net->combine == 9 || net->combine >= 11;
      const bool joined = net->combine >= 13;  // concatenated: the raw part is judged
      const std::string model_input = raw && !net->dense_first ? "first" : "dense";
      INFO("trial " << trial << " combine " << net->combine << " dense first " << net->dense_first << " step " << step
                    << " poison " << poison);
      REQUIRE(md.count("first") == 1);
      REQUIRE(md.count("dense") == 1);
      CHECK(md["first"].count("input_nan") == (model_input == "first" ? 1u : 0u));
      if (model_input == "first" && joined) {
        // What the concatenation read of the raw data: its values, its NaN.
        CHECK(md["first"]["input_nan"] == (poison == 1 && net->combine != 9 ? "1" : "0"));
        CHECK(md["first"]["input_count"] == std::to_string(raw_count));
        REQUIRE(md["first"].count("input_data_rms") == 1);
        CHECK(std::stod(md["first"]["input_data_rms"]) ==
              Approx(std::sqrt(raw_rms / static_cast<double>(raw_count))).epsilon(1e-5));
      }
      for (const char* layer : {"first", "dense", "head", "tok"})
        if (model_input != "first" || !joined || std::string(layer) != "first")
          CHECK(md[layer].count("input_data_rms") == 0);
      // Its scale measured all the same (unless a NaN embedding row left no finite value).
      if (poison != 2) CHECK(md["first"].count("input_rms") == 1);
      CHECK(md["dense"].count("input_nan") == (model_input == "dense" ? 1u : 0u));
      CHECK(md["head"].count("input_nan") == 0);
      CHECK(md["tok"].count("input_nan") == 0);
    }
  }
}
