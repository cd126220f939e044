// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
//
// attach() on TorchScript models made at test time by Python's torch (tests/jit/make_models.py),
// against what Python's own forward hooks and autograd record on the same eager models.

#include <torch/csrc/jit/passes/tensorexpr_fuser.h>
#include <torch/script.h>
#include <torch/serialize.h>
#include <torchdbg/diagnosis.hpp>
#include <torchdbg/health.hpp>
#include <torchdbg/jit.hpp>
#include <torchdbg/report.hpp>

#include <cstdlib>
#include <fstream>
#include <iterator>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "helpers.hpp"

using torchdbg::HookAction;
using torchdbg::HookConfig;
using torchdbg::HookManager;
using torchdbg::HookTrigger;

namespace {

/// The directory holding the models and references, made once per test run; empty (with a
/// warning) when no Python with torch is available.
const std::string& model_dir() {
  static const std::string dir = [] {
    const std::string python = TORCHDBG_TEST_PYTHON;
    if (python.empty() || std::system((python + " -c 'import torch' 2>/dev/null").c_str()) != 0) return std::string();
    const std::string out = torchdbg_test::tmp_dir("jit_models");
    const std::string script = std::string(TORCHDBG_TEST_SOURCE_DIR) + "/jit/make_models.py";
    if (std::system((python + " " + script + " " + out).c_str()) != 0) return std::string("failed");
    return out;
  }();
  return dir;
}

bool have_models() {
  // The TensorExpr fuser (on for CPU tensors in Debian's LibTorch 2.6, which has LLVM) would
  // compile kernels for minutes here and fuse activations away (docs/attach.md); these tests
  // compare every delivery, so they run unfused.
  torch::jit::setTensorExprFuserEnabled(false);
  if (model_dir().empty()) {
    WARN("no Python with torch (set TORCHDBG_TEST_PYTHON): skipped");
    return false;
  }
  REQUIRE(model_dir() != "failed");
  return true;
}

/// A model make_models.py wrote: "<name>_<variant>.pt" (scripted, traced, frozen).
torch::jit::Module load_model(const std::string& name, const std::string& variant) {
  return torch::jit::load(model_dir() + "/" + name + "_" + variant + ".pt");
}

/// The "mlp" model in training mode and an SGD optimizer over its parameters, as a C++ loop
/// fine-tuning a model from Python sets them up.
struct FineTuned {
  torch::jit::Module model;
  std::vector<at::Tensor> params;
  torch::optim::SGD opt;
  explicit FineTuned(const std::string& variant)
      : model(load_model("mlp", variant)), params(parameters_of(model)), opt(params, torch::optim::SGDOptions(1e-2)) {
    model.train();
  }
  static std::vector<at::Tensor> parameters_of(const torch::jit::Module& m) {
    std::vector<at::Tensor> out;
    for (const auto& p : m.parameters()) out.push_back(p);
    return out;
  }
};

/// What Python recorded: the input, each hooked module's outputs by call, each gradient.
struct Reference {
  torch::Tensor x;
  std::map<std::string, std::vector<torch::Tensor>> outputs;
  std::map<std::string, torch::Tensor> grads;
  /// A random model's deliveries: name -> what Python recorded ("<module>", "<function>:<module>").
  std::map<std::string, std::string> expect;
};

Reference load_reference(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const c10::IValue v = torch::pickle_load(bytes);
  Reference r;
  // A flat dict: "x", "out:<module>:<call>", "grad:<module>.<parameter>", and for a random
  // model "expect:<delivery>=<what>".
  std::map<std::string, std::map<std::size_t, torch::Tensor>> calls;
  for (const auto& e : v.toGenericDict()) {
    const std::string key = e.key().toStringRef();
    const torch::Tensor t = e.value().toTensor();
    if (key == "x") {
      r.x = t;
    } else if (key.rfind("grad:", 0) == 0) {
      r.grads[key.substr(5)] = t;
    } else if (key.rfind("expect:", 0) == 0) {
      const auto eq = key.find('=');
      r.expect[key.substr(7, eq - 7)] = key.substr(eq + 1);
    } else if (key.rfind("out:", 0) == 0) {
      const auto colon = key.rfind(':');
      calls[key.substr(4, colon - 4)][std::stoul(key.substr(colon + 1))] = t;
    }
  }
  for (const auto& [name, by_call] : calls)
    for (const auto& [k, t] : by_call) r.outputs[name].push_back(t);
  return r;
}

/// Every delivery: forward outputs by name and call, gradients by "<module>.<parameter>".
struct Recorder {
  std::map<std::string, std::vector<torch::Tensor>> fwd;
  std::map<std::string, torch::Tensor> bwd;
  std::map<std::string, std::string> types;  // module_type of each module's output
  std::vector<std::string> problems;
  void install(HookManager& hooks) {
    hooks.register_callback("record", [this](const torchdbg::HookContext& c) {
      std::string key(c.layer_name());
      if (c.is_forward()) {
        auto& calls = fwd[key];
        const auto call = c.metadata_value("call");
        if (!call || std::stoul(std::string(*call)) != calls.size())
          problems.push_back(key + ": call " + std::string(call ? *call : "none") + " after " +
                             std::to_string(calls.size()));
        calls.push_back(c.tensor().detach().clone());
        if (const auto type = c.metadata_value("module_type")) types[key] = std::string(*type);
      } else {
        const auto p = c.metadata_value("parameter");
        key += "." + std::string(p ? *p : "?");
        if (bwd.count(key)) problems.push_back(key + ": gradient delivered twice");
        bwd[key] = c.tensor().detach().clone();
      }
    });
    hooks.register_hook(HookConfig().name("record").trigger(HookTrigger::every_n_steps(1)).actions(
        {HookAction::custom_callback("record")}));
  }
  void clear() {
    fwd.clear();
    bwd.clear();
    types.clear();
  }
};

/// The deliveries one forward of each model makes, and the reference each equals: a Python
/// hook's output (by module name), or a function of one ("tanh:layers.0").
const std::map<std::string, std::map<std::string, std::string>>& expected_forward() {
  static const auto e = [] {
    std::map<std::string, std::map<std::string, std::string>> m = {
      {"net",
       {{"b0.fc", "b0.fc"},
        {"b0.act", "b0.act"},
        {"layers.0", "layers.0"},
        {"layers.0/tanh", "tanh:layers.0"},
        {"layers.1", "layers.1"},
        {"layers.1/tanh", "tanh:layers.1"},
        {"bn", "bn"},
        {"head", "head"}}},
      {"attention", {{"inp", "inp"}, {"mha", "mha"}, {"out", "out"}}},
      {"attention_bf", {{"inp", "inp"}, {"mha", "mha"}, {"out", "out"}}},
      {"attention_ub", {{"inp", "inp"}, {"mha", "mha"}, {"out", "out"}}},
      {"attention_sq", {{"inp", "inp"}, {"mha", "mha"}, {"out", "out"}}},
      {"attention_t", {{"inp", "inp"}, {"mha", "mha"}, {"out", "out"}}},
      {"attention_tok", {{"inp", "inp"}, {"mha", "mha"}, {"out", "out"}}},
      // a user's class named like MultiheadAttention: its own output, its out_proj its own
      {"user_attention",
       {{"inp", "inp"},
        {"attn.qkv", "attn.qkv"},
        {"attn.out_proj", "attn.out_proj"},
        {"attn.norm", "attn.norm"},
        {"attn", "attn"},
        {"head", "head"}}},
      {"cells", {{"gru", "gru"}, {"lstm", "lstm"}, {"rnn", "rnn"}, {"act", "act"}, {"fc", "fc"}}},
      // traced, the cells are their gates' operators: their outputs are not delivered
      {"cells#traced", {{"fc", "fc"}}},
      {"gates", {{"fc", "fc"}, {"fc/sigmoid", "sigmoid_t:fc"}, {"g", "g"}, {"g/sigmoid", "sigmoid:g"}, {"out", "out"}}},
      {"hidden", {{"fc", "fc"}, {"fc/relu", "relu:fc"}, {"g", "g"}, {"g/relu", "relu:g"}, {"out", "out"}}},
      // weights prepared apart (views, casts) are one call; a layer applying them in a loop none
      {"custom", {{"film", "film"}, {"act", "act"}, {"cast", "cast"}, {"act2", "act2"}, {"head", "head"}}},
      // TransformerEncoderLayer's fused inference path: its parts are not delivered
      {"encoder", {{"inp", "inp"}, {"out", "out"}}},
      {"conv", {{"conv", "conv"}, {"bn", "bn"}, {"bn/relu", "relu:bn"}, {"fc", "fc"}}},
      {"mlp", {{"fc1", "fc1"}, {"act", "act"}, {"fc2", "fc2"}, {"fc2/tanh", "tanh:fc2"}, {"fc3", "fc3"}}},
      {"loop", {{"fc", "fc"}, {"fc/relu", "relu:fc"}, {"head", "head"}}},
      // activation modules under their own names where their calls pair with one module's;
      // one shared by two Linears stays "<linear>/sigmoid", one after one of two calls "c/relu"
      {"named",
       {{"seq.0", "seq.0"},
        {"seq.1", "seq.1"},
        {"seq.2", "seq.2"},
        {"fc", "fc"},
        {"act", "act"},
        {"a", "a"},
        {"a/sigmoid", "sigmoid:a"},
        {"b", "b"},
        {"b/sigmoid", "sigmoid:b"},
        {"c", "c"},
        {"c/relu", "relu:c"},
        {"head", "head"}}},
    };
    for (int k = 0; k < 12; ++k) {  // deep: layers.0 ... layers.11 and the relu after each
      const std::string layer = "layers." + std::to_string(k);
      m["deep"][layer] = layer;
      m["deep"][layer + "/relu"] = "relu:" + layer;
    }
    return m;
  }();
  return e;
}

std::vector<torch::Tensor> reference_calls(const Reference& ref, const std::string& what) {
  const auto colon = what.find(':');
  if (colon == std::string::npos) return ref.outputs.at(what);
  std::vector<torch::Tensor> out;
  const std::string f = what.substr(0, colon);
  for (const auto& t : ref.outputs.at(what.substr(colon + 1)))
    out.push_back(f == "tanh"        ? torch::tanh(t)
                  : f == "sigmoid"   ? torch::sigmoid(t)
                  : f == "sigmoid_t" ? torch::sigmoid(t.t())
                  : f == "gelu"      ? torch::gelu(t)
                                     : torch::relu(t));
  return out;
}

bool close(const torch::Tensor& a, const torch::Tensor& b) {
  return a.sizes() == b.sizes() && torch::allclose(a.to(torch::kDouble), b.to(torch::kDouble), 1e-4, 1e-5);
}

/// Every forward delivery of one step against the reference: the names, each call's values.
/// `variant`: "<model>#<variant>" in expected_forward() where that variant delivers otherwise.
void check_forward(const Recorder& rec, const Reference& ref, const std::string& model_name,
                   const std::string& variant) {
  const auto& all = expected_forward();
  const auto own = all.find(model_name + "#" + variant);
  const std::map<std::string, std::string>& expected =
      !ref.expect.empty() ? ref.expect : own != all.end() ? own->second : all.at(model_name);
  std::set<std::string> names, want;
  for (const auto& [name, calls] : rec.fwd) names.insert(name);
  for (const auto& [name, what] : expected) want.insert(name);
  CHECK(names == want);
  for (const auto& [name, what] : expected) {
    if (!rec.fwd.count(name)) continue;
    INFO("delivery " << name);
    const auto wanted = reference_calls(ref, what);
    REQUIRE(rec.fwd.at(name).size() == wanted.size());
    for (std::size_t k = 0; k < wanted.size(); ++k) {
      INFO("call " << k << ": " << rec.fwd.at(name)[k].sizes() << " against " << wanted[k].sizes());
      CHECK(close(rec.fwd.at(name)[k], wanted[k]));
    }
  }
}

/// One model's every delivery, scripted and traced, on the graph executor's first runs and on
/// its optimized ones, against what Python's hooks and autograd recorded.
void check_model(const std::string& model_name) {
  const Reference ref = load_reference(model_dir() + "/" + model_name + "_ref.pt");
  for (const std::string variant : {"scripted", "traced"}) {
    INFO(model_name << " " << variant);
    torch::jit::Module model = load_model(model_name, variant);
    model.train();
    HookManager hooks;
    Recorder rec;
    rec.install(hooks);
    auto session = torchdbg::attach(model, hooks);
    // The profiling executor runs a model differently on its first calls and afterwards:
    // every step must deliver the same.
    for (int64_t step = 0; step < 4; ++step) {
      INFO("step " << step);
      hooks.set_step(step);
      rec.clear();
      const torch::Tensor out = model.forward({ref.x}).toTensor();
      out.square().mean().backward();
      for (const auto& p : model.parameters()) p.mutable_grad() = torch::Tensor();
      session.flush();
      std::string problems;
      for (const auto& p : rec.problems) problems += p + "; ";
      INFO(problems);
      CHECK(rec.problems.empty());
      check_forward(rec, ref, model_name, variant);
      std::set<std::string> grad_names, want_grads;
      for (const auto& [name, g] : rec.bwd) grad_names.insert(name);
      for (const auto& [name, g] : ref.grads) want_grads.insert(name);
      CHECK(grad_names == want_grads);
      for (const auto& [name, type] : rec.types) {
        INFO("module_type of " << name << ": " << type);
        // the Python class, unmangled: torch.nn's by its module path, a user's by its name
        const std::set<std::string> own{"MyMultiheadAttention", "FiLM", "CastLinear", "LoopLayer"};
        CHECK((type.rfind("torch.nn.modules.", 0) == 0 || own.count(type) != 0));
        CHECK(type.find("mangle") == std::string::npos);
        CHECK(type.find("__torch__") == std::string::npos);
      }
      if (model_name == "net") CHECK(rec.types.at("b0.fc") == "torch.nn.modules.linear.Linear");
      for (const auto& [name, g] : ref.grads) {
        INFO("gradient " << name);
        if (rec.bwd.count(name)) CHECK(close(rec.bwd.at(name), g));
      }
    }
  }
}

}  // namespace

TEST_CASE("attach on scripted and traced models delivers what Python's hooks and autograd record",
          "[jit]") {
  if (!have_models()) return;
  for (const std::string model_name :
       {"net", "attention", "attention_bf", "attention_ub", "attention_sq", "attention_t", "attention_tok",
        "user_attention", "cells", "gates", "hidden", "custom", "conv", "mlp", "loop", "deep", "named"})
    check_model(model_name);
}

TEST_CASE("attach on random TorchScript models delivers what Python's hooks record", "[jit]") {
  // make_models.py writes random models (Linears, activation modules and functions, residual
  // blocks, shared modules, LayerNorm, views, ModuleList loops, Sequentials) and the
  // deliveries each must make; TORCHDBG_TEST_SEED picks others.
  if (!have_models()) return;
  int models = 0;
  for (int k = 0; std::ifstream(model_dir() + "/random_" + std::to_string(k) + "_ref.pt").good(); ++k, ++models)
    check_model("random_" + std::to_string(k));
  CHECK(models >= 16);
}

TEST_CASE("attach on a frozen TorchScript model throws torchdbg::Error naming the cause", "[jit]") {
  if (!have_models()) return;
  HookManager hooks;
  // all folded; one buffer kept (its forward updates it); one submodule kept (preserved_attrs)
  for (const std::string name : {"net", "counter", "mlp_keep"}) {
    INFO(name);
    torch::jit::Module frozen = load_model(name, "frozen");
    try {
      auto session = torchdbg::attach(frozen, hooks);
      FAIL("attach accepted a frozen model");
    } catch (const torchdbg::Error& e) {
      CHECK(std::string(e.what()).find("freeze") != std::string::npos);
    }
  }
  // Nothing stayed attached: a normal model attaches to the same manager afterwards.
  torch::jit::Module model = load_model("net", "scripted");
  CHECK_NOTHROW(torchdbg::attach(model, hooks));
}

TEST_CASE("a TorchScript model defined in C++ attaches and delivers; once frozen it throws", "[jit]") {
  // Module::define gives no `training` attribute, which a frozen model lacks too: the frozen
  // one is told apart by the weights it keeps as constants.
  torch::manual_seed(3);
  auto linear = [](const char* type, int64_t in, int64_t out) {
    torch::jit::Module m(type);
    m.register_parameter("weight", torch::randn({out, in}).requires_grad_(), false);
    m.register_parameter("bias", torch::randn({out}).requires_grad_(), false);
    m.define("def forward(self, x):\n  return torch.linear(x, self.weight, self.bias)\n");
    return m;
  };
  torch::jit::Module net("Net");
  net.register_module("fc1", linear("Lin1", 5, 7));
  net.register_module("fc2", linear("Lin2", 7, 3));
  net.define("def forward(self, x):\n  return self.fc2.forward(torch.relu(self.fc1.forward(x)))\n");
  REQUIRE_FALSE(net.hasattr("training"));
  const torch::Tensor x = torch::randn({4, 5});
  const torch::Tensor w1 = net.attr("fc1").toModule().attr("weight").toTensor();
  const torch::Tensor b1 = net.attr("fc1").toModule().attr("bias").toTensor();
  const torch::Tensor w2 = net.attr("fc2").toModule().attr("weight").toTensor();
  const torch::Tensor b2 = net.attr("fc2").toModule().attr("bias").toTensor();
  HookManager hooks;
  Recorder rec;
  rec.install(hooks);
  {
    auto session = torchdbg::attach(net, hooks);
    for (int64_t step = 0; step < 3; ++step) {
      hooks.set_step(step);
      rec.clear();
      net.forward({x}).toTensor().sum().backward();
      session.flush();
      torch::NoGradGuard no_grad;
      const torch::Tensor h = torch::linear(x, w1, b1);
      const torch::Tensor y = torch::linear(torch::relu(h), w2, b2);
      CHECK(rec.problems.empty());
      REQUIRE(rec.fwd.count("fc1") == 1);
      REQUIRE(rec.fwd.count("fc2") == 1);
      REQUIRE(rec.fwd["fc1"].size() == 1);
      CHECK(torch::allclose(rec.fwd["fc1"][0], h, 1e-5, 1e-6));
      CHECK(torch::allclose(rec.fwd["fc2"][0], y, 1e-5, 1e-6));
      REQUIRE(rec.bwd.count("fc2.weight") == 1);
      CHECK(torch::allclose(rec.bwd["fc2.weight"], w2.grad(), 1e-5, 1e-6));
      CHECK(torch::allclose(rec.bwd["fc1.bias"], b1.grad(), 1e-5, 1e-6));
      for (const torch::Tensor& p : {w1, b1, w2, b2}) p.mutable_grad().zero_();
    }
  }
  torch::jit::Module frozen = torch::jit::freeze(net);
  CHECK_THROWS_AS(torchdbg::attach(frozen, hooks), torchdbg::Error);
}

TEST_CASE("inference on a TorchScript model: eval, NoGradGuard, no_grad_forward", "[jit]") {
  if (!have_models()) return;
  // No BatchNorm: eval computes what train did. attention_bf takes MultiheadAttention's fused
  // inference path (one `_native_multi_head_attention` operator over in_proj and out_proj).
  // encoder: TransformerEncoderLayer's fused path (one operator over all its submodules).
  for (const std::string model_name : {"mlp", "attention", "attention_bf", "encoder"}) {
    const Reference ref = load_reference(model_dir() + "/" + model_name + "_ref.pt");
    for (const std::string variant : {"scripted", "traced"}) {
      if (model_name != "mlp" && model_name != "attention" && variant == "traced") continue;  // traced in training: no fused path
      INFO(model_name << " " << variant);
      torch::jit::Module model = load_model(model_name, variant);
      model.eval();
      HookManager hooks;
      Recorder rec;
      rec.install(hooks);
      auto session = torchdbg::attach(model, hooks, torchdbg::AttachOptions().no_grad_forward(true).backward(false));
      for (int64_t step = 0; step < 3; ++step) {
        hooks.set_step(step);
        rec.clear();
        torch::NoGradGuard no_grad;
        (void)model.forward({ref.x});
        session.flush();
        check_forward(rec, ref, model_name, variant);
        CHECK(rec.bwd.empty());
      }
    }
  }
}

TEST_CASE("fine-tuning a TorchScript model in C++: healthy runs raise nothing, a blown-up layer is named",
          "[jit]") {
  if (!have_models()) return;
  for (const std::string variant : {"scripted", "traced"}) {
    for (const std::string blown : {"", "fc1", "fc2"}) {
      INFO(variant << " blown up: '" << blown << "'");
      torch::manual_seed(5);
      FineTuned tuned(variant);
      torch::jit::Module& model = tuned.model;
      torch::optim::SGD& opt = tuned.opt;
      HookManager hooks;
      torchdbg::HealthMonitor health(torchdbg::HealthOptions().on_failure(torchdbg::OnFailure::Pause));
      auto fed = health.install(hooks);
      auto session = torchdbg::attach(model, hooks);
      CHECK(session.module_names() == std::vector<std::string>{"fc1", "fc2", "fc3"});
      int64_t step = 0;
      for (; step < 40 && !hooks.is_paused(); ++step) {
        hooks.set_step(step);
        if (!blown.empty() && step == 25) {
          torch::NoGradGuard g;
          model.attr(blown).toModule().attr("weight").toTensor().mul_(1e3);
        }
        opt.zero_grad();
        const auto x = torch::randn({16, 8});
        const auto out = model.forward({x}).toTensor();
        auto loss = torch::mse_loss(out, torch::tanh(x.narrow(1, 0, 4)));
        hooks.set_loss(loss.item<double>());
        loss.backward();
        if (hooks.is_paused()) break;
        opt.step();
      }
      if (blown.empty()) {
        for (const auto& inc : health.incidents())
          UNSCOPED_INFO("incident " << torchdbg::to_string(inc.kind) << " at '" << inc.layer << "' step " << inc.step);
        CHECK(health.incidents().empty());
        CHECK_FALSE(hooks.is_paused());
        CHECK(session.forward_deliveries() > 0);
      } else {
        REQUIRE(hooks.is_paused());
        CHECK(step == 25);
        CHECK(hooks.pause_info()->layer.rfind(blown, 0) == 0);
        const auto d = torchdbg::diagnose(health);
        REQUIRE_FALSE(d.hypotheses.empty());
        CHECK(d.hypotheses[0].layer.rfind(blown, 0) == 0);
      }
    }
  }
}

TEST_CASE("the reporter, gradient norms and auto_step on a TorchScript model", "[jit]") {
  if (!have_models()) return;
  for (const std::string variant : {"scripted", "traced"}) {
    INFO(variant);
    torch::manual_seed(3);
    FineTuned tuned(variant);
    torch::jit::Module& model = tuned.model;
    const std::vector<at::Tensor>& params = tuned.params;
    torch::optim::SGD& opt = tuned.opt;
    HookManager hooks;
    torchdbg::HealthMonitor health;
    torchdbg::Reporter reporter;
    auto recorded = std::make_shared<torchdbg::RecordingExporter>();
    reporter.add_exporter(recorded);
    auto fed = health.install(hooks);
    auto reported = reporter.install(hooks, &health);
    auto session = torchdbg::attach(model, hooks, torchdbg::AttachOptions().auto_step(true));
    std::vector<double> norms;  // torch's own norm of all gradients, per step
    for (int s = 0; s < 6; ++s) {  // no set_step: each backward pass is a step
      opt.zero_grad();
      const auto x = torch::randn({16, 8});
      auto loss = model.forward({x}).toTensor().square().mean();
      hooks.set_loss(loss.item<double>());
      loss.backward();
      double sq = 0.0;
      for (const auto& p : params) sq += p.grad().to(torch::kDouble).pow(2).sum().item<double>();
      norms.push_back(std::sqrt(sq));
      opt.step();
    }
    CHECK(hooks.step() == 6);
    reporter.flush();
    const auto steps = recorded->steps();
    REQUIRE(steps.size() >= 5);
    for (const auto& r : steps) {
      INFO("step " << r.step);
      std::set<std::string> fwd, grads;
      for (const auto& l : r.layers) (l.forward ? fwd : grads).insert(l.forward ? l.layer : l.layer + "." + l.parameter);
      CHECK(fwd == std::set<std::string>{"fc1", "act", "fc2", "fc2/tanh", "fc3"});
      CHECK(grads == std::set<std::string>{"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias"});
      REQUIRE(r.gradient_norm.has_value());
      REQUIRE(r.step >= 0);
      REQUIRE(r.step < static_cast<int64_t>(norms.size()));
      CHECK(*r.gradient_norm == Approx(norms[static_cast<std::size_t>(r.step)]).epsilon(1e-4));
      CHECK(r.health.size() >= 5);
    }
  }
}
