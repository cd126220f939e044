// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#include <torchdbg/hooked.hpp>

#include <torch/torch.h>

#include <atomic>
#include <deque>
#include <thread>
#include <limits>
#include <map>
#include <random>

#include "helpers.hpp"

using torchdbg::ExactHook;
using torchdbg::HookDirection;
using torchdbg::HookTensors;
using torchdbg::ModuleCall;

namespace {

struct Net : torch::nn::Module {
  Net() {
    fc1 = register_module("fc1", torch::nn::Linear(4, 6));
    fc2 = register_module("fc2", torch::nn::Linear(6, 3));
  }
  torch::Tensor forward(const torch::Tensor& x) { return fc2(torch::relu(fc1(x))); }
  torchdbg::Hooked<torch::nn::Linear> fc1{nullptr};
  torchdbg::Hooked<torch::nn::Linear> fc2{nullptr};
};

torch::Tensor plain(Net& n, const torch::Tensor& x) {  // the same computation, no hooks
  return n.fc2->forward(torch::relu(n.fc1->forward(x)));
}

ExactHook fwd(std::function<std::optional<torch::Tensor>(const torch::Tensor& in, const torch::Tensor& out)> f) {
  return {HookDirection::Fwd, [f](const ModuleCall&, const HookTensors& t) { return f(t.input, t.output); }};
}

}  // namespace

TEST_CASE("a forward hook patches the output exactly, and removing it restores the original", "[hooked]") {
  torchdbg_test::SeededRng rng(1);
  auto net = std::make_shared<Net>();
  auto x = torch::randn({5, 4});
  const auto original = net->forward(x);
  CHECK(torch::equal(original, plain(*net, x)));
  {
    auto h = torchdbg::register_module_hook(net->fc1.ptr(), fwd([](const torch::Tensor&, const torch::Tensor& out) {
                                              return std::optional<torch::Tensor>(out * 0.5 - 1.0);
                                            }),
                                            "fc1");
    const auto patched = net->forward(x);
    torch::NoGradGuard ng;
    const auto expected = net->fc2->forward(torch::relu(net->fc1->forward(x) * 0.5 - 1.0));
    CHECK(torch::allclose(patched, expected));
    CHECK_FALSE(torch::allclose(patched, original));
  }
  CHECK(torch::equal(net->forward(x), original));
}

TEST_CASE("a pre-hook replaces the input; a mismatched replacement is an error naming both", "[hooked]") {
  torchdbg_test::SeededRng rng(2);
  auto net = std::make_shared<Net>();
  auto x = torch::randn({2, 4});
  auto h = torchdbg::register_module_hook(
      net->fc1.ptr(), {HookDirection::FwdPre, [](const ModuleCall&, const HookTensors& t) { return std::optional<torch::Tensor>(t.input.flip(1)); }},
      "fc1");
  CHECK(torch::allclose(net->forward(x), plain(*net, x.flip(1))));
  h.remove();
  auto bad = torchdbg::register_module_hook(net->fc2.ptr(), torchdbg::setting_hook(torch::zeros({2, 4})), "fc2");
  CHECK_THROWS_WITH(net->forward(x), Catch::Contains("fwd hook of 'fc2'") && Catch::Contains("[2, 3]") && Catch::Contains("[2, 4]"));
}

TEST_CASE("caching, setting from the cache and reading hooks", "[hooked]") {
  torchdbg_test::SeededRng rng(3);
  auto net = std::make_shared<Net>();
  auto cache = std::make_shared<torchdbg::TensorCache>();
  auto x1 = torch::randn({3, 4}), x2 = torch::randn({3, 4});
  torch::Tensor fc1_x1;
  {
    auto h = torchdbg::register_module_hook(net->fc1.ptr(), torchdbg::caching_hook(cache), "fc1");
    net->forward(x1);
    REQUIRE(cache->contains("fc1"));
    fc1_x1 = cache->get("fc1");
    CHECK_FALSE(fc1_x1.requires_grad());  // detached by default
    CHECK(torch::allclose(fc1_x1, net->fc1->forward(x1)));
  }
  // Activation patching: run x2 with fc1's output taken from the x1 run.
  std::vector<std::string> read;
  auto h = torchdbg::register_module_hook(net->fc1.ptr(), torchdbg::setting_hook(cache, "fc1"), "fc1") +
           torchdbg::register_module_hook(net->fc2.ptr(), torchdbg::reading_hook([&](const ModuleCall& c, const torch::Tensor& t) {
                                            read.push_back(std::string(c.path) + ":" + std::to_string(t.size(1)));
                                          }),
                                          "fc2");
  CHECK(h.size() == 2);
  CHECK(torch::allclose(net->forward(x2), net->forward(x1)));
  CHECK(read == std::vector<std::string>{"fc2:3", "fc2:3"});
  CHECK(h.remove());
  CHECK_FALSE(h.remove());  // removable once
  auto missing = torchdbg::register_module_hook(net->fc1.ptr(), torchdbg::setting_hook(cache, "nope"), "fc1");
  CHECK_THROWS_WITH(net->forward(x2), Catch::Contains("'nope'"));
}

TEST_CASE("backward hooks see and may replace gradients", "[hooked]") {
  torchdbg_test::SeededRng rng(4);
  auto net = std::make_shared<Net>();
  auto x = torch::randn({3, 4}).requires_grad_(true);
  // Reference gradients through autograd on the plain computation.
  auto h1 = net->fc1->forward(x);
  auto a1 = torch::relu(h1);
  auto y = net->fc2->forward(a1);
  auto ref = torch::autograd::grad({y.pow(2).sum()}, {h1, a1, x});
  torch::Tensor g_out_fc1, g_in_fc2, g_out_fc2;
  auto handle = torchdbg::register_module_hook(net->fc1.ptr(), torchdbg::caching_hook(std::make_shared<torchdbg::TensorCache>(), "", HookDirection::BwdPre), "fc1") +
                torchdbg::register_module_hook(net->fc1.ptr(), {HookDirection::BwdPre, [&](const ModuleCall&, const HookTensors& t) {
                                                  g_out_fc1 = t.grad_output;
                                                  return std::optional<torch::Tensor>();
                                                }}, "fc1") +
                torchdbg::register_module_hook(net->fc2.ptr(), {HookDirection::Bwd, [&](const ModuleCall&, const HookTensors& t) {
                                                  g_in_fc2 = t.grad_input;
                                                  g_out_fc2 = t.grad_output;
                                                  return std::optional<torch::Tensor>();
                                                }}, "fc2");
  net->forward(x).pow(2).sum().backward();
  REQUIRE(g_out_fc1.defined());
  CHECK(torch::allclose(g_out_fc1, ref[0]));
  CHECK(torch::allclose(g_in_fc2, ref[1]));
  CHECK(torch::allclose(g_out_fc2, 2 * y));
  const auto x_grad = x.grad().clone();
  CHECK(torch::allclose(x_grad, ref[2]));
  handle.remove();
  // Replacing fc1's output gradient with zeros silences every gradient below it.
  auto zero = torchdbg::register_module_hook(net->fc1.ptr(), torchdbg::setting_hook([](const torch::Tensor& g) { return torch::zeros_like(g); }, HookDirection::BwdPre), "fc1");
  net->zero_grad();
  x.mutable_grad() = torch::Tensor();
  net->forward(x).pow(2).sum().backward();
  CHECK(net->fc1->weight.grad().abs().sum().item<double>() == 0.0);
  CHECK(x.grad().abs().sum().item<double>() == 0.0);
  CHECK(net->fc2->weight.grad().abs().sum().item<double>() > 0.0);
}

TEST_CASE("property: exact hooks run by priority, then registration, prepended first; each sees the replacements before it", "[hooked]") {
  // Reference: one deque per priority (prepend pushes to the front), read from the highest;
  // affine hooks applied in that order to the plain tensor, reading hooks see the running value.
  std::mt19937 rng(34);
  struct Spec {
    bool reader;
    double a, b;
  };
  for (int trial = 0; trial < 40; ++trial) {
    torchdbg_test::SeededRng seed(100 + static_cast<uint64_t>(trial));
    auto net = std::make_shared<Net>();
    const auto x = torch::randn({3, 4}, torch::requires_grad());
    const HookDirection dir = trial % 2 == 0 ? HookDirection::Fwd : HookDirection::BwdPre;
    std::vector<torch::Tensor> seen(16);
    std::vector<Spec> specs;
    std::map<int, std::deque<int>, std::greater<int>> reference;
    torchdbg::ModuleHookHandle handles;
    // The first hook to run reads the untouched tensor (priority above every other).
    handles = std::move(handles) + torchdbg::register_module_hook(net->fc1.ptr(),
                  torchdbg::reading_hook([&seen](const ModuleCall&, const torch::Tensor& t) { seen[15] = t.clone(); }, dir)
                      .with_priority(100), "fc1");
    const int n = 1 + static_cast<int>(rng() % 8);
    for (int i = 0; i < n; ++i) {
      const Spec sp{rng() % 3 == 0, 0.5 + (rng() % 100) / 100.0, (static_cast<int>(rng() % 21) - 10) / 10.0};
      specs.push_back(sp);
      ExactHook h = sp.reader ? torchdbg::reading_hook([&seen, i](const ModuleCall&, const torch::Tensor& t) { seen[static_cast<std::size_t>(i)] = t.clone(); }, dir)
                              : torchdbg::setting_hook([sp](const torch::Tensor& t) { return t * sp.a + sp.b; }, dir);
      h.priority = static_cast<int>(rng() % 3) - 1;
      if (rng() % 3 == 0) h = h.prepended();
      if (h.prepend) {
        reference[h.priority].push_front(i);
      } else {
        reference[h.priority].push_back(i);
      }
      handles = std::move(handles) + torchdbg::register_module_hook(net->fc1.ptr(), h, "fc1");
    }
    const auto out = net->forward(x);
    out.pow(2).sum().backward();
    INFO("trial " << trial << (dir == HookDirection::Fwd ? " fwd" : " bwd_pre"));
    REQUIRE(seen[15].defined());
    torch::Tensor v = seen[15].to(torch::kDouble);
    for (const auto& [prio, ids] : reference) {
      for (int i : ids) {
        const Spec& sp = specs[static_cast<std::size_t>(i)];
        if (sp.reader) {
          REQUIRE(seen[static_cast<std::size_t>(i)].defined());
          CHECK(torch::allclose(seen[static_cast<std::size_t>(i)].to(torch::kDouble), v, 1e-5, 1e-5));
        } else {
          v = v * sp.a + sp.b;
        }
      }
    }
    if (dir == HookDirection::Fwd) {  // the final value is what fc2 received
      torch::NoGradGuard ng;
      CHECK(torch::allclose(out, net->fc2->forward(torch::relu(v.to(torch::kFloat))), 1e-4, 1e-4));
    }
  }
}

TEST_CASE("run_until stops the forward after the module and returns its output", "[hooked]") {
  torchdbg_test::SeededRng rng(5);
  auto seq = torchdbg::HookedSequential(torch::nn::Linear(4, 5), torch::nn::ReLU(), torch::nn::Linear(5, 2));
  int later = 0;
  auto count = torchdbg::register_module_hook(seq->ptr(2), torchdbg::reading_hook([&](const ModuleCall&, const torch::Tensor&) { ++later; }), "2");
  auto x = torch::randn({3, 4});
  seq->forward(x);
  CHECK(later == 1);
  auto cache = torchdbg::run_until(seq, x, "[1]");
  CHECK(later == 1);  // the last layer never ran
  REQUIRE(cache->contains("1"));
  CHECK(torch::allclose(cache->get("1"), torch::relu(seq[0]->as<torch::nn::Linear>()->forward(x))));
  CHECK_THROWS_WITH(torchdbg::run_until(seq, x, "[7]"), Catch::Contains("out of range"));
  // The cached output is the one the rest of the model would see: after every hook of the
  // module, whatever its priority.
  for (int priority : {std::numeric_limits<int>::min(), -1, 0, 7}) {
    auto fix = torchdbg::register_module_hook(seq->ptr(1), torchdbg::setting_hook(torch::full({3, 5}, 2.5)).with_priority(priority), "1");
    CHECK(torch::equal(torchdbg::run_until(seq, x, "[1]")->get("1"), torch::full({3, 5}, 2.5)));
  }
}

TEST_CASE("a multi-hook manager selects by pattern from the start, classes and relative root", "[hooked]") {
  struct Model : torch::nn::Module {
    Model() {
      layers = register_module("layers", torchdbg::HookedSequential(torch::nn::Linear(4, 4), torch::nn::ReLU(), torch::nn::Linear(4, 4), torch::nn::Tanh()));
      head = register_module("head", torch::nn::Linear(4, 2));  // plain: not hookable
    }
    torch::Tensor forward(const torch::Tensor& x) { return head(layers->forward(x)); }
    torchdbg::HookedSequential layers{nullptr};
    torch::nn::Linear head{nullptr};
  };
  auto model = std::make_shared<Model>();
  auto cache = std::make_shared<torchdbg::TensorCache>();
  torchdbg::MultiHookManager linears(torchdbg::MultiHookOptions().pattern("layers").classes_to_hook({torchdbg::module_type<torch::nn::LinearImpl>()}));
  CHECK(linears.matching(model) == std::vector<std::string>{"layers.0", "layers.2"});
  torchdbg::MultiHookManager not_relu(torchdbg::MultiHookOptions().pattern("layers\\.").classes_to_skip({torchdbg::module_type<torch::nn::ReLUImpl>()}));
  CHECK(not_relu.matching(model) == std::vector<std::string>{"layers.0", "layers.2", "layers.3"});
  torchdbg::MultiHookManager rel(torchdbg::MultiHookOptions().relative_path("layers").pattern("layers\\.[13]$"));
  CHECK(rel.matching(model) == std::vector<std::string>{"layers.1", "layers.3"});
  {
    auto h = linears.register_hook(model, torchdbg::caching_hook(cache));
    CHECK(h.size() == 2);
    auto x = torch::randn({2, 4});
    model->forward(x);
    CHECK(cache->keys() == std::vector<std::string>{"layers.0", "layers.2"});
    torch::NoGradGuard ng;
    CHECK(torch::allclose(cache->get("layers.0"), model->layers[0]->as<torch::nn::Linear>()->forward(x)));
  }
  cache->clear();
  model->forward(torch::randn({2, 4}));
  CHECK(cache->size() == 0);  // the handle went out of scope: hooks removed
  torchdbg::MultiHookManager head(torchdbg::MultiHookOptions().pattern("head"));
  CHECK(head.matching(model).empty());
  CHECK(head.unhookable(model) == std::vector<std::string>{"head"});
  CHECK(head.register_hook(model, torchdbg::caching_hook(cache)).size() == 0);  // as tdhook: an empty handle
  torchdbg::MultiHookManager head_required(torchdbg::MultiHookOptions().pattern("head").require_match(true));
  CHECK_THROWS_WITH(head_required.register_hook(model, torchdbg::caching_hook(cache)),
                    Catch::Contains("no hookable module matches 'head'") && Catch::Contains("not hookable: head"));
  CHECK_THROWS_WITH(torchdbg::register_module_hook(model->head.ptr(), torchdbg::caching_hook(cache), "head"),
                    Catch::Contains("not called through torchdbg"));
  CHECK_THROWS_WITH(torchdbg::MultiHookManager(torchdbg::MultiHookOptions().pattern("([")), Catch::Contains("(["));
}

TEST_CASE("a multi-hook manager registers with the hook's priority: a fix given priority runs before the caches on every module", "[hooked]") {
  torchdbg_test::SeededRng rng(12);
  auto model = torchdbg::HookedSequential(torch::nn::Linear(4, 4), torch::nn::Tanh(), torch::nn::Linear(4, 3));
  auto cache = std::make_shared<torchdbg::TensorCache>();
  torchdbg::MultiHookManager linears(torchdbg::MultiHookOptions().pattern("").classes_to_hook({torchdbg::module_type<torch::nn::LinearImpl>()}));
  auto caches = linears.register_hook(model.ptr(), torchdbg::caching_hook(cache));  // registered first, priority 0
  auto fixes = linears.register_hook(model.ptr(), torchdbg::setting_hook([](const torch::Tensor& t) { return t * 0 + 1; }).with_priority(1));
  const auto x = torch::randn({2, 4});
  const auto out = model->forward(x);
  REQUIRE(cache->keys() == std::vector<std::string>{"0", "2"});
  CHECK(torch::equal(cache->get("0"), torch::ones({2, 4})));  // the cache saw the fix
  CHECK(torch::equal(cache->get("2"), torch::ones({2, 3})));
  CHECK(torch::equal(out, torch::ones({2, 3})));
  fixes.remove();
  auto late = linears.register_hook(model.ptr(), torchdbg::setting_hook([](const torch::Tensor& t) { return t * 0 + 1; }));
  model->forward(x);  // same priority, registered after the caches: they see the original
  torch::NoGradGuard ng;
  CHECK(torch::allclose(cache->get("0"), model[0]->as<torch::nn::Linear>()->forward(x)));
}

TEST_CASE("children of a plain Sequential are hooked without changing the model", "[hooked]") {
  struct Model : torch::nn::Module {
    Model() {
      layers = register_module("layers", torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::ReLU(), torch::nn::Linear(4, 2)));
    }
    torch::Tensor forward(const torch::Tensor& x) { return layers->forward(x); }
    torch::nn::Sequential layers{nullptr};
  };
  torchdbg_test::SeededRng rng(6);
  auto model = std::make_shared<Model>();
  auto x = torch::randn({3, 4});
  const auto original = model->forward(x);
  const auto names_before = model->named_parameters().keys();
  auto* first = model->layers->ptr(0).get();
  {
    auto h = torchdbg::register_module_hook(model, "layers[0]", fwd([](const torch::Tensor&, const torch::Tensor& out) {
                                              return std::optional<torch::Tensor>(torch::zeros_like(out));
                                            }));
    CHECK(model->named_parameters().keys() == names_before);  // parameters untouched
    const auto patched = model->forward(x);
    torch::NoGradGuard ng;
    const auto bias_only = model->layers[2]->as<torch::nn::Linear>()->bias.expand({3, 2});
    CHECK(torch::allclose(patched, bias_only));  // relu(0) = 0, so only fc2's bias remains
  }
  CHECK(model->layers->ptr(0).get() == first);  // the original is back in place
  CHECK(torch::equal(model->forward(x), original));
  // MultiHookManager finds Sequential children the same way.
  auto cache = std::make_shared<torchdbg::TensorCache>();
  torchdbg::MultiHookManager mgr(torchdbg::MultiHookOptions().pattern("layers\\.[02]$"));
  {
    auto h = mgr.register_hook(model, torchdbg::caching_hook(cache));
    CHECK(h.size() == 2);
    CHECK(torch::equal(model->forward(x), original));  // reading does not change the output
  }
  CHECK(cache->keys() == std::vector<std::string>{"layers.0", "layers.2"});
  CHECK(torch::allclose(cache->get("layers.2"), original));
  CHECK(model->layers->ptr(2)->as<torch::nn::Linear>() != nullptr);
  // Cloning while hooked keeps the child's parameters reachable.
  auto h = torchdbg::register_module_hook(model, "layers[2]", torchdbg::caching_hook(cache));
  auto copy = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(model->layers->clone());
  REQUIRE(copy);
  CHECK(copy->parameters().size() == 4);
  CHECK(torch::allclose(copy->forward(x), original));
}

TEST_CASE("ModuleList items run their hooks when called through hooked_call", "[hooked]") {
  struct Model : torch::nn::Module {
    Model() { blocks = register_module("blocks", torch::nn::ModuleList(torch::nn::Linear(3, 3), torch::nn::Linear(3, 3))); }
    torch::Tensor forward(torch::Tensor x) {
      for (const auto& b : *blocks) x = torchdbg::hooked_call<torch::nn::LinearImpl>(b, x);
      return x;
    }
    torch::nn::ModuleList blocks{nullptr};
  };
  torchdbg_test::SeededRng rng(7);
  auto model = std::make_shared<Model>();
  auto x = torch::randn({2, 3});
  const auto original = model->forward(x);  // first call: the items become hookable
  auto cache = std::make_shared<torchdbg::TensorCache>();
  auto h = torchdbg::register_module_hook(model, "blocks[1]", torchdbg::caching_hook(cache));
  model->forward(x);
  CHECK(torch::allclose(cache->get("blocks.1"), original));
  CHECK_THROWS_WITH(torchdbg::hooked_call<torch::nn::Conv2dImpl>(model->blocks[0], x), Catch::Contains("not of the requested type"));
  auto fresh = torch::nn::ModuleList(torch::nn::Linear(3, 3));
  CHECK_THROWS_WITH(torchdbg::register_module_hook(fresh.ptr(), "[0]", torchdbg::caching_hook(cache)),
                    Catch::Contains("hooked_call"));
}

TEST_CASE("a module's hooks die with it: another module built at its address runs none of them", "[hooked]") {
  // Built in one buffer, so the second module has the first one's address (as a freed
  // block reused by malloc), whatever the allocator or sanitizer.
  alignas(torch::nn::LinearImpl) static unsigned char storage[sizeof(torch::nn::LinearImpl)];
  auto build = [] {
    return torchdbg::Hooked<torch::nn::Linear>(std::shared_ptr<torch::nn::LinearImpl>(
        new (storage) torch::nn::LinearImpl(3, 3), [](torch::nn::LinearImpl* p) { p->~LinearImpl(); }));
  };
  for (bool call_first : {true, false}) {  // the stale hooks found at a call, or at a registration
    INFO("call before registering " << call_first);
    int calls = 0;
    torchdbg::ModuleHookHandle kept;
    {
      auto first = build();
      kept = torchdbg::register_module_hook(first.ptr(), torchdbg::reading_hook([&](const ModuleCall&, const torch::Tensor&) { ++calls; }), "fc");
      first(torch::randn({1, 3}));
      CHECK(calls == 1);
    }
    auto second = build();
    REQUIRE(static_cast<void*>(second.ptr().get()) == static_cast<void*>(storage));
    if (call_first) second(torch::randn({1, 3}));
    int own = 0;
    auto h = torchdbg::register_module_hook(second.ptr(), torchdbg::reading_hook([&](const ModuleCall&, const torch::Tensor&) { ++own; }), "fc");
    kept.remove();  // the dead module's handle removes nothing of the second's
    second(torch::randn({1, 3}));
    CHECK(own == 1);
    CHECK(calls == 1);  // the first module's hook never ran on the second
  }
}

TEST_CASE("a Hooked member also held by a Sequential stays hookable after a hook by path comes and goes", "[hooked]") {
  struct Shared : torch::nn::Module {
    Shared() {
      fc = register_module("fc", torch::nn::Linear(3, 3));
      seq = register_module("seq", torch::nn::Sequential(fc.ptr()));
    }
    torch::Tensor forward(const torch::Tensor& x) { return seq->forward(fc(x)); }
    torchdbg::Hooked<torch::nn::Linear> fc{nullptr};
    torch::nn::Sequential seq{nullptr};
  };
  auto m = std::make_shared<Shared>();
  int calls = 0;
  auto count = torchdbg::reading_hook([&](const ModuleCall&, const torch::Tensor&) { ++calls; });
  { auto h = torchdbg::register_module_hook(m, "seq[0]", count); }
  auto h = torchdbg::register_module_hook(m->fc.ptr(), count, "fc");
  m->forward(torch::randn({2, 3}));
  CHECK(calls == 1);  // through the Hooked member; the Sequential's place was restored
  auto both = torchdbg::register_module_hook(m, "seq[0]", count);
  m->forward(torch::randn({2, 3}));
  CHECK(calls == 1 + 4);  // two hooks, each at both calls
}

TEST_CASE("modules that do not map one Tensor to one Tensor are refused in a Sequential, named; the model still runs", "[hooked]") {
  torchdbg_test::SeededRng rng(21);
  // Every LibTorch module torchdbg knows to take or return more than one Tensor.
  const std::vector<std::shared_ptr<torch::nn::Module>> known = {
      torch::nn::RNN(3, 4).ptr(), torch::nn::LSTM(3, 4).ptr(), torch::nn::GRU(3, 4).ptr(), torch::nn::LSTMCell(3, 4).ptr(),
      torch::nn::MultiheadAttention(4, 2).ptr(), torch::nn::AdaptiveLogSoftmaxWithLoss(torch::nn::AdaptiveLogSoftmaxWithLossOptions(4, 8, {4})).ptr(),
      torch::nn::Transformer(torch::nn::TransformerOptions(4, 2, 1, 1).dim_feedforward(8)).ptr(),
      torch::nn::TransformerDecoder(torch::nn::TransformerDecoderLayer(4, 2), 1).ptr(), torch::nn::TransformerDecoderLayer(4, 2).ptr(),
      torch::nn::Bilinear(3, 3, 2).ptr(), torch::nn::CosineSimilarity().ptr(), torch::nn::PairwiseDistance().ptr()};
  for (const auto& m : known) {
    INFO(m->name());
    CHECK(torchdbg::detail::not_tensor_to_tensor(*m) != nullptr);
  }
  CHECK(torchdbg::detail::not_tensor_to_tensor(*torch::nn::GRUCell(3, 4)) == nullptr);  // returns one Tensor
  CHECK(torchdbg::detail::not_tensor_to_tensor(*torch::nn::Linear(3, 4)) == nullptr);

  auto seq = torch::nn::Sequential(torch::nn::Linear(3, 3), torch::nn::LSTM(3, 4));
  using Out = std::tuple<torch::Tensor, std::tuple<torch::Tensor, torch::Tensor>>;
  const auto x = torch::randn({2, 1, 3});
  const auto plain = std::get<0>(seq->forward<Out>(x));
  torchdbg::MultiHookManager all(torchdbg::MultiHookOptions().pattern(""));
  CHECK(all.matching(seq.ptr()) == std::vector<std::string>{"0"});
  CHECK(all.unhookable(seq.ptr()) == std::vector<std::string>{"1"});
  auto cache = std::make_shared<torchdbg::TensorCache>();
  {
    auto h = all.register_hook(seq.ptr(), torchdbg::caching_hook(cache));
    CHECK(torch::equal(std::get<0>(seq->forward<Out>(x)), plain));  // the model still runs
    CHECK(cache->keys() == std::vector<std::string>{"0"});
    CHECK_THROWS_WITH(torchdbg::register_module_hook(seq.ptr(), "1", torchdbg::caching_hook(cache)),
                      Catch::Contains("'1'") && Catch::Contains("returns a tuple"));
  }
  CHECK(torch::equal(std::get<0>(seq->forward<Out>(x)), plain));
  // A module of the user's returning a tuple is found at its first hooked call, by name.
  struct Pair : torch::nn::Module {
    std::tuple<torch::Tensor, torch::Tensor> forward(const torch::Tensor& x) { return {x, x * 2}; }
  };
  auto mine = torch::nn::Sequential(torch::nn::Linear(3, 3));
  mine->push_back("pair", std::make_shared<Pair>());
  auto h = torchdbg::register_module_hook(mine.ptr(), "pair", torchdbg::caching_hook(cache));
  CHECK_THROWS_WITH((mine->forward<std::tuple<torch::Tensor, torch::Tensor>>(torch::randn({2, 3}))),
                    Catch::Contains("one Tensor to one Tensor") && Catch::Contains("Pair") && Catch::Contains("tuple"));
  h.remove();
  CHECK_NOTHROW(mine->forward<std::tuple<torch::Tensor, torch::Tensor>>(torch::randn({2, 3})));
}

TEST_CASE("copies of a hooked Sequential's entries keep working, with the child's parameters reachable", "[hooked]") {
  torchdbg_test::SeededRng rng(22);
  auto seq = torch::nn::Sequential(torch::nn::Linear(3, 3), torch::nn::Tanh());
  const auto x = torch::randn({2, 3});
  const auto original = seq->forward(x);
  torch::nn::Sequential copy;
  torch::nn::AnyModule first;
  {
    auto h = torchdbg::register_module_hook(seq.ptr(), "0", torchdbg::setting_hook([](const torch::Tensor& t) { return t * 0; }));
    CHECK(seq->ptr(0)->parameters().size() == 2);  // the forwarder shows the child's parameters
    CHECK(seq->parameters().size() == 2);          // and the Sequential's are unchanged
    copy->extend(*seq);
    first = *seq->begin();
    CHECK(torch::equal(copy->forward(x), torch::tanh(torch::zeros({2, 3}))));
  }
  CHECK(torch::equal(seq->forward(x), original));
  CHECK(torch::equal(copy->forward(x), original));  // the copy runs the original, hooks gone
  CHECK(torch::equal(first.forward(x), seq[0]->as<torch::nn::Linear>()->forward(x)));
}

TEST_CASE("a bwd hook on a module that changes its input in place is refused at the call; out of place it sees the true input gradient", "[hooked]") {
  torchdbg_test::SeededRng rng(23);
  for (bool inplace : {false, true}) {
    INFO("inplace " << inplace);
    auto seq = torch::nn::Sequential(torch::nn::Linear(3, 4), torch::nn::ReLU(torch::nn::ReLUOptions().inplace(inplace)), torch::nn::Linear(4, 2));
    auto x = torch::randn({5, 3}, torch::requires_grad());
    // Reference: the gradient w.r.t. the ReLU's input and output, by autograd.
    auto h1 = seq[0]->as<torch::nn::Linear>()->forward(x);
    auto a1 = torch::relu(h1);
    auto ref = torch::autograd::grad({seq[2]->as<torch::nn::Linear>()->forward(a1).sum()}, {h1, a1});
    torch::Tensor gi, go;
    auto h = torchdbg::register_module_hook(seq.ptr(), "1", ExactHook{HookDirection::Bwd, [&](const ModuleCall&, const HookTensors& t) {
                                                                        gi = t.grad_input.clone();
                                                                        go = t.grad_output.clone();
                                                                        return std::optional<torch::Tensor>();
                                                                      }});
    if (inplace) {
      CHECK_THROWS_WITH(seq->forward(x), Catch::Contains("bwd hook of '1'") && Catch::Contains("in place"));
      h.remove();
      auto pre = torchdbg::register_module_hook(seq.ptr(), "1", torchdbg::caching_hook(std::make_shared<torchdbg::TensorCache>(), "g", HookDirection::BwdPre));
      CHECK_NOTHROW(seq->forward(x).sum().backward());
    } else {
      seq->forward(x).sum().backward();
      CHECK(torch::allclose(gi, ref[0]));
      CHECK(torch::allclose(go, ref[1]));
    }
  }
}

TEST_CASE("a factory's hook follows the direction it is registered with", "[hooked]") {
  torchdbg_test::SeededRng rng(24);
  auto seq = torch::nn::Sequential(torch::nn::Linear(3, 3));
  auto cache = std::make_shared<torchdbg::TensorCache>();
  auto hook = torchdbg::caching_hook(cache, "k");
  hook.direction = HookDirection::FwdPre;  // changed after the factory made it
  auto h = torchdbg::register_module_hook(seq.ptr(), "0", hook);
  const auto x = torch::randn({2, 3});
  seq->forward(x);
  CHECK(torch::equal(cache->get("k"), x));
}

TEST_CASE("with a relative root, a module also held outside it runs its hooks at every call", "[hooked]") {
  struct Two : torch::nn::Module {
    Two() {
      auto shared = torch::nn::Linear(3, 3);
      a = register_module("a", torch::nn::Sequential(shared));
      b = register_module("b", torch::nn::Sequential(shared));
    }
    torch::Tensor forward(const torch::Tensor& x) { return b->forward(a->forward(x)); }
    torch::nn::Sequential a{nullptr}, b{nullptr};
  };
  auto m = std::make_shared<Two>();
  std::map<std::string, int> calls;
  torchdbg::MultiHookManager under_b(torchdbg::MultiHookOptions().pattern("").relative_path("b"));
  CHECK(under_b.matching(m) == std::vector<std::string>{"b.0"});
  auto h = under_b.register_hook(m, torchdbg::reading_hook([&](const ModuleCall& c, const torch::Tensor&) { ++calls[std::string(c.path)]; }));
  m->forward(torch::randn({2, 3}));
  CHECK(calls == std::map<std::string, int>{{"b.0", 2}});
}

TEST_CASE("a hook may remove its own handle during the call that runs it", "[hooked]") {
  torchdbg_test::SeededRng rng(25);
  auto seq = torch::nn::Sequential(torch::nn::Linear(3, 3), torch::nn::ReLU());
  const auto x = torch::randn({2, 3}, torch::requires_grad());
  const auto original = seq->forward(x);
  auto holder = std::make_shared<torchdbg::ModuleHookHandle>();
  std::weak_ptr<torchdbg::ModuleHookHandle> weak = holder;
  int runs = 0;
  *holder = torchdbg::register_module_hook(seq.ptr(), "0", ExactHook{HookDirection::Fwd, [weak, &runs](const ModuleCall&, const HookTensors&) {
                                                                        ++runs;
                                                                        if (auto h = weak.lock()) h->remove();  // one-shot
                                                                        return std::optional<torch::Tensor>();
                                                                      }});
  *holder = std::move(*holder) + torchdbg::register_module_hook(seq.ptr(), "0", torchdbg::reading_hook([](const ModuleCall&, const torch::Tensor&) {}, HookDirection::BwdPre));
  seq->forward(x).sum().backward();  // the forwarder is swapped out while it runs
  CHECK(runs == 1);
  CHECK(seq->ptr(0).get() == seq->named_children()[0].value().get());
  seq->forward(x);
  CHECK(runs == 1);
  CHECK(torch::equal(seq->forward(x), original));
}

TEST_CASE("hooks registered and removed from several threads on one Sequential leave it exact", "[hooked]") {
  torchdbg_test::SeededRng rng(26);
  auto seq = torch::nn::Sequential(torch::nn::Linear(3, 3), torch::nn::Tanh(), torch::nn::Linear(3, 3), torch::nn::Tanh());
  const auto x = torch::randn({2, 3});
  const auto original = seq->forward(x);
  std::atomic<int> errors{0};
  auto work = [&](std::string pattern, int rounds) {
    try {
      torchdbg::MultiHookManager mgr(torchdbg::MultiHookOptions().pattern(pattern));
      const std::size_t expected = pattern == "[02]$" ? 2 : 1;
      for (int i = 0; i < rounds; ++i) {
        auto h = mgr.register_hook(seq.ptr(), torchdbg::reading_hook([](const ModuleCall&, const torch::Tensor&) {}));
        if (h.size() != expected) ++errors;
      }
    } catch (...) {
      ++errors;
    }
  };
  std::vector<std::thread> threads;
  for (const char* p : {"0$", "2$", "0$", "[02]$"}) threads.emplace_back(work, p, 150);
  for (auto& t : threads) t.join();
  CHECK(errors == 0);
  const auto children = seq->named_children();
  for (std::size_t i = 0; i < seq->size(); ++i) CHECK(seq->ptr(i).get() == children[i].value().get());
  CHECK(torch::equal(seq->forward(x), original));
}

TEST_CASE("a clone made while a Sequential child is hooked computes the same, follows eval(), and is hookable", "[hooked]") {
  torchdbg_test::SeededRng rng(27);
  auto seq = torch::nn::Sequential(torch::nn::Linear(3, 3), torch::nn::BatchNorm1d(3), torch::nn::ReLU());
  int runs = 0;
  auto h = torchdbg::register_module_hook(seq.ptr(), "0", torchdbg::reading_hook([&](const ModuleCall&, const torch::Tensor&) { ++runs; }));
  auto bn = torchdbg::register_module_hook(seq.ptr(), "1", torchdbg::reading_hook([&](const ModuleCall&, const torch::Tensor&) { ++runs; }));
  CHECK(seq->ptr(0)->named_parameters().keys() == std::vector<std::string>{"module.weight", "module.bias"});
  auto copy = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(seq->clone());
  REQUIRE(copy);
  CHECK(copy->named_parameters().keys() == std::vector<std::string>{"0.module.weight", "0.module.bias", "1.module.weight", "1.module.bias"});
  const auto x = torch::randn({4, 3});
  copy->eval();
  seq->eval();
  CHECK(torch::allclose(copy->forward(x), seq->forward(x)));
  CHECK(runs == 2);  // the original's hooks ran on the original only
  int copy_runs = 0;
  auto on_copy = torchdbg::register_module_hook(copy, "0", torchdbg::reading_hook([&](const ModuleCall& c, const torch::Tensor&) {
    ++copy_runs;
    CHECK(c.path == "0");
  }));
  copy->forward(x);
  CHECK(copy_runs == 1);
  CHECK(runs == 2);
}

TEST_CASE("bwd hooks of a module whose input needs no gradient: keeping is fine, a replacement is refused", "[hooked]") {
  torchdbg_test::SeededRng rng(28);
  auto seq = torch::nn::Sequential(torch::nn::Linear(3, 3), torch::nn::Tanh());
  const auto x = torch::randn({2, 3});  // needs no gradient
  {
    auto h = torchdbg::register_module_hook(seq.ptr(), "0", torchdbg::setting_hook([](const torch::Tensor& g) { return g; }, HookDirection::Bwd));
    CHECK_NOTHROW(seq->forward(x).sum().backward());  // the identity keeps the (absent) value
  }
  {
    auto h = torchdbg::register_module_hook(seq.ptr(), "0", torchdbg::setting_hook(torch::ones({2, 3}), HookDirection::Bwd));
    CHECK_THROWS_WITH(seq->forward(x).sum().backward(), Catch::Contains("no input gradient to replace"));
  }
}

TEST_CASE("a module whose Sequential died is no longer hookable through it", "[hooked]") {
  auto lin = torch::nn::Linear(3, 3);
  auto seq = std::make_shared<torch::nn::SequentialImpl>();
  seq->push_back(lin);
  auto h1 = torchdbg::register_module_hook(seq, "0", torchdbg::reading_hook([](const ModuleCall&, const torch::Tensor&) {}));
  seq.reset();  // lin lives on
  CHECK_THROWS_WITH(torchdbg::register_module_hook(lin.ptr(), torchdbg::reading_hook([](const ModuleCall&, const torch::Tensor&) {}), "fc"),
                    Catch::Contains("not called through torchdbg"));
}
