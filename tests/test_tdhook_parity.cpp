// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
//
// tdhook's hook tests (tests/test_hooks.py), case by case, on torchdbg's exact hooks and
// paths: what tdhook checks holds here, or the C++ counterpart is checked (a compile-time
// refusal where Python raises at run time). docs/exact-hooks.md has the table of
// counterparts and intended differences. Then two generators: random models whose modules
// are reached by randomly spelled paths, and random models with shared modules hooked by a
// MultiHookManager, against a reference selection and a reference forward.
#include <torchdbg/hooked.hpp>
#include <torchdbg/paths.hpp>

#include <torch/torch.h>

#include <functional>
#include <map>
#include <random>
#include <regex>
#include <set>
#include <sstream>
#include <type_traits>
#include <unordered_set>

#include "helpers.hpp"

using torchdbg::ExactHook;
using torchdbg::HookDirection;
using torchdbg::HookTensors;
using torchdbg::ModuleCall;

namespace {

// tdhook's default_test_model: three Linears with activations between them.
struct TdNet : torch::nn::Module {
  TdNet() {
    linear1 = register_module("linear1", torch::nn::Linear(10, 8));
    linear2 = register_module("linear2", torch::nn::Linear(8, 6));
    linear3 = register_module("linear3", torch::nn::Linear(6, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) { return linear3(torch::tanh(linear2(torch::relu(linear1(x))))); }
  torchdbg::Hooked<torch::nn::Linear> linear1{nullptr}, linear2{nullptr}, linear3{nullptr};
};

// A hook factory as tdhook's tests write it: output + 1 on every module it is given.
torchdbg::ExactHookFactory plus_one_factory() {
  return [](const std::string&) { return torchdbg::setting_hook([](const torch::Tensor& t) { return t + 1; }); };
}

template <typename A, typename B, typename = void>
struct can_add : std::false_type {};
template <typename A, typename B>
struct can_add<A, B, std::void_t<decltype(std::declval<A>() + std::declval<B>())>> : std::true_type {};

}  // namespace

TEST_CASE("tdhook registration: a forward hook and a manager's hooks change the output, and removing them restores it", "[tdhook]") {
  torchdbg_test::SeededRng rng(101);
  auto model = std::make_shared<TdNet>();
  const auto x = torch::randn({2, 10});
  const auto original = model->forward(x);
  SECTION("test_register_forward_hook") {
    auto handle = torchdbg::register_module_hook(model->linear1.ptr(), torchdbg::setting_hook([](const torch::Tensor& t) { return t + 1; }), "linear1");
    CHECK(handle.size() == 1);
    CHECK_FALSE(torch::allclose(model->forward(x), original));
    CHECK(handle.remove());
    CHECK(torch::equal(model->forward(x), original));
  }
  SECTION("test_multi_hook_manager") {
    torchdbg::MultiHookManager manager(torchdbg::MultiHookOptions().pattern("linear\\d+"));
    auto handle = manager.register_hook(model, plus_one_factory());
    CHECK(handle.size() == 3);
    CHECK_FALSE(torch::allclose(model->forward(x), original));
    handle.remove();
    CHECK(torch::equal(model->forward(x), original));
  }
}

TEST_CASE("tdhook hook factory: caching, setting by value and by function, stopping; a setting function's nullopt keeps the value", "[tdhook]") {
  torchdbg_test::SeededRng rng(102);
  auto model = std::make_shared<TdNet>();
  const auto x = torch::randn({2, 10});
  const auto original = model->forward(x);
  torch::Tensor fc1_out;
  {
    torch::NoGradGuard ng;
    fc1_out = model->linear1->forward(x);
  }
  SECTION("test_make_caching_hook") {
    auto cache = std::make_shared<torchdbg::TensorCache>();
    auto h = torchdbg::register_module_hook(model->linear1.ptr(), torchdbg::caching_hook(cache, "key"), "linear1");
    model->forward(x);
    CHECK(torch::equal(cache->get("key"), fc1_out));
  }
  SECTION("test_make_setting_hook") {
    auto h = torchdbg::register_module_hook(model->linear3.ptr(), torchdbg::setting_hook([](const torch::Tensor& t) { return t + 1; }), "linear3");
    CHECK(torch::allclose(model->forward(x), original + 1));
  }
  SECTION("test_make_stopping_hook") {
    auto h = torchdbg::register_module_hook(model->linear2.ptr(), torchdbg::stopping_hook(), "linear2");
    CHECK_THROWS_AS(model->forward(x), torchdbg::StopForward);
    try {
      model->forward(x);
    } catch (const torchdbg::StopForward& stop) {
      CHECK(stop.path() == "linear2");
    }
  }
  SECTION("test_setting_hook_none_does_not_change_value, in every direction") {
    // tdhook: make_setting_hook(None) and a callback returning None leave the value as it
    // was. Here: a function returning std::nullopt, in each of the four directions.
    auto xg = x.clone().requires_grad_(true);
    auto grads = [&]() {
      model->zero_grad();
      xg.mutable_grad() = torch::Tensor();
      auto out = model->forward(xg);
      out.pow(2).sum().backward();
      return std::vector<torch::Tensor>{out.detach(), xg.grad().clone(), model->linear1->weight.grad().clone(),
                                        model->linear2->weight.grad().clone()};
    };
    const auto reference = grads();
    for (auto d : {HookDirection::FwdPre, HookDirection::Fwd, HookDirection::BwdPre, HookDirection::Bwd}) {
      INFO("direction " << torchdbg::to_string(d));
      int calls = 0;
      auto keep = torchdbg::setting_hook(
          [&calls](const torch::Tensor&) -> std::optional<torch::Tensor> {
            ++calls;
            return std::nullopt;
          },
          d);
      auto h = torchdbg::register_module_hook(model->linear2.ptr(), keep, "linear2");
      const auto got = grads();
      CHECK(calls == 1);
      for (std::size_t i = 0; i < got.size(); ++i) CHECK(torch::equal(got[i], reference[i]));
    }
    // A function that returns a Tensor replaces; an undefined one is an error that says how
    // to keep the value.
    auto h = torchdbg::register_module_hook(model->linear2.ptr(), torchdbg::setting_hook([](const torch::Tensor&) { return torch::Tensor(); }), "linear2");
    CHECK_THROWS_WITH(model->forward(x), Catch::Contains("undefined tensor") && Catch::Contains("std::nullopt"));
  }
}

TEST_CASE("tdhook handles: + combines, removing the sum removes all, scope end removes, an empty handle's remove is a no-op", "[tdhook]") {
  torchdbg_test::SeededRng rng(103);
  auto model = std::make_shared<TdNet>();
  const auto x = torch::randn({2, 10});
  const auto original = model->forward(x);
  SECTION("test_add_handles_and_remove_all") {
    torchdbg::MultiHookManager manager1(torchdbg::MultiHookOptions().pattern("linear1$"));
    torchdbg::MultiHookManager manager2(torchdbg::MultiHookOptions().pattern("linear2$|linear3$"));
    auto combined = manager1.register_hook(model, plus_one_factory()) + manager2.register_hook(model, plus_one_factory());
    CHECK(combined.size() == 3);
    CHECK_FALSE(torch::allclose(model->forward(x), original));
    combined.remove();
    CHECK(torch::equal(model->forward(x), original));
    // tdhook raises TypeError for `handle + 123`; here it does not compile.
    static_assert(can_add<torchdbg::ModuleHookHandle, torchdbg::ModuleHookHandle>::value);
    static_assert(!can_add<torchdbg::ModuleHookHandle, int>::value);
  }
  SECTION("test_context_manager_removes_on_exit") {
    torchdbg::MultiHookManager manager(torchdbg::MultiHookOptions().pattern("linear1$"));
    {
      auto handle = manager.register_hook(model, plus_one_factory());
      CHECK_FALSE(torch::allclose(model->forward(x), original));
    }
    CHECK(torch::equal(model->forward(x), original));
  }
  SECTION("test_empty_handle_remove_noop") {
    torchdbg::ModuleHookHandle handle;
    CHECK_NOTHROW(handle.remove());
    CHECK_FALSE(handle.remove());
  }
}

TEST_CASE("tdhook pattern setter: set_pattern changes what the next registration selects", "[tdhook]") {
  torchdbg_test::SeededRng rng(104);
  auto model = std::make_shared<TdNet>();
  const auto x = torch::randn({2, 10});
  const auto original = model->forward(x);
  torchdbg::MultiHookManager manager(torchdbg::MultiHookOptions().pattern("linear1$"));
  CHECK(manager.pattern() == "linear1$");
  auto handle1 = manager.register_hook(model, plus_one_factory());
  CHECK(manager.matching(model) == std::vector<std::string>{"linear1"});
  CHECK_FALSE(torch::allclose(model->forward(x), original));
  handle1.remove();
  CHECK(torch::equal(model->forward(x), original));
  manager.set_pattern("linear2$");
  CHECK(manager.pattern() == "linear2$");
  CHECK(manager.matching(model) == std::vector<std::string>{"linear2"});
  auto handle2 = manager.register_hook(model, plus_one_factory());
  CHECK_FALSE(torch::allclose(model->forward(x), original));
  handle2.remove();
  CHECK(torch::equal(model->forward(x), original));
  CHECK_THROWS_WITH(manager.set_pattern("(["), Catch::Contains("(["));
  CHECK(manager.pattern() == "linear2$");  // an invalid pattern keeps the previous one
  CHECK(manager.matching(model) == std::vector<std::string>{"linear2"});
}

TEST_CASE("tdhook backward: backward and backward-pre hooks run during autograd; keyword-argument directions are refused by name", "[tdhook]") {
  torchdbg_test::SeededRng rng(105);
  auto model = std::make_shared<TdNet>();
  std::vector<std::string> calls;
  auto record = [&calls](HookDirection d) {
    return ExactHook{d, [&calls](const ModuleCall& c, const HookTensors&) -> std::optional<torch::Tensor> {
                       calls.push_back(torchdbg::to_string(c.direction));
                       return std::nullopt;
                     }};
  };
  auto handle = torchdbg::register_module_hook(model->linear2.ptr(), record(HookDirection::Bwd), "linear2") +
                torchdbg::register_module_hook(model->linear2.ptr(), record(HookDirection::BwdPre), "linear2");
  auto x = torch::randn({4, 10}, torch::requires_grad());
  model->forward(x).sum().backward();
  CHECK(calls == std::vector<std::string>{"bwd_pre", "bwd"});  // PyTorch's order
  // tdhook's direction names, read from text (a config file): the four directions, and a
  // clear refusal for the rest.
  for (auto d : {HookDirection::FwdPre, HookDirection::Fwd, HookDirection::BwdPre, HookDirection::Bwd}) {
    CHECK(torchdbg::parse_hook_direction(torchdbg::to_string(d)) == d);
  }
  CHECK_THROWS_WITH(torchdbg::parse_hook_direction("fwd_kwargs"), Catch::Contains("'fwd_kwargs'") && Catch::Contains("keyword"));
  CHECK_THROWS_WITH(torchdbg::parse_hook_direction("fwd_pre_kwargs"), Catch::Contains("'fwd_pre_kwargs'"));
  CHECK_THROWS_WITH(torchdbg::parse_hook_direction("nope"), Catch::Contains("'nope'") && Catch::Contains("fwd_pre, fwd, bwd_pre or bwd"));
  CHECK_THROWS_AS(torchdbg::parse_hook_direction("FWD"), torchdbg::Error);
  CHECK_THROWS_AS(torchdbg::parse_hook_direction(""), torchdbg::Error);
}

TEST_CASE("tdhook signatures: a hook or callback of the wrong shape is refused when the program is compiled", "[tdhook]") {
  // tdhook inspects signatures at registration (ValueError); C++ refuses them at compile time.
  auto bad_hook = [](const ModuleCall&) { return std::optional<torch::Tensor>(); };          // no tensors
  auto bad_return = [](const ModuleCall&, const HookTensors&) { return 1.0; };               // not a tensor
  auto good_hook = [](const ModuleCall&, const HookTensors&) { return std::optional<torch::Tensor>(); };
  static_assert(!std::is_constructible_v<torchdbg::ExactHookFn, decltype(bad_hook)>);
  static_assert(!std::is_constructible_v<torchdbg::ExactHookFn, decltype(bad_return)>);
  static_assert(std::is_constructible_v<torchdbg::ExactHookFn, decltype(good_hook)>);
  auto bad_reader = [](const ModuleCall&) {};
  static_assert(!std::is_constructible_v<std::function<void(const ModuleCall&, const torch::Tensor&)>, decltype(bad_reader)>);
  // A setting function must take the tensor and return a Tensor or an optional Tensor.
  auto keep = [](const torch::Tensor&) -> std::optional<torch::Tensor> { return std::nullopt; };
  CHECK(torchdbg::setting_hook(keep).direction == HookDirection::Fwd);
  CHECK_THROWS_WITH(torchdbg::setting_hook(std::function<torch::Tensor(const torch::Tensor&)>()), Catch::Contains("needs a function"));
  CHECK_THROWS_WITH(torchdbg::setting_hook(std::function<std::optional<torch::Tensor>(const torch::Tensor&)>()), Catch::Contains("needs a function"));
  CHECK_THROWS_WITH(torchdbg::reading_hook(nullptr), Catch::Contains("needs a function"));
}

TEST_CASE("tdhook edge cases: invalid directions, the required pattern, no match, a value of another type", "[tdhook]") {
  torchdbg_test::SeededRng rng(106);
  auto model = std::make_shared<TdNet>();
  const auto x = torch::randn({2, 10});
  const auto original = model->forward(x);
  auto cache = std::make_shared<torchdbg::TensorCache>();
  SECTION("test_register_invalid_direction_raises: at registration, naming the value") {
    for (int bad : {4, 7, -1, 1000}) {
      INFO("direction " << bad);
      const auto d = static_cast<HookDirection>(bad);
      ExactHook hook{d, [](const ModuleCall&, const HookTensors&) { return std::optional<torch::Tensor>(); }};
      CHECK_THROWS_WITH(torchdbg::register_module_hook(model->linear1.ptr(), hook, "linear1"),
                        Catch::Contains("invalid HookDirection " + std::to_string(bad)) && Catch::Contains("'linear1'"));
      CHECK_THROWS_WITH(torchdbg::register_module_hook(model, "linear1", hook), Catch::Contains("invalid HookDirection " + std::to_string(bad)));
      torchdbg::MultiHookManager all(torchdbg::MultiHookOptions().pattern(""));
      CHECK_THROWS_WITH(all.register_hook(model, hook), Catch::Contains("invalid HookDirection " + std::to_string(bad)));
      // test_make_caching_hook_invalid_direction_raises, and the other factories.
      CHECK_THROWS_WITH(torchdbg::caching_hook(cache, "k", d), Catch::Contains("caching_hook") && Catch::Contains(std::to_string(bad)));
      CHECK_THROWS_WITH(torchdbg::setting_hook(torch::zeros({2, 8}), d), Catch::Contains("setting_hook"));
      CHECK_THROWS_WITH(torchdbg::setting_hook(cache, "k", d), Catch::Contains("setting_hook"));
      CHECK_THROWS_WITH(torchdbg::setting_hook([](const torch::Tensor& t) { return t; }, d), Catch::Contains("setting_hook"));
      CHECK_THROWS_WITH(torchdbg::reading_hook([](const ModuleCall&, const torch::Tensor&) {}, d), Catch::Contains("reading_hook"));
    }
    CHECK(torch::equal(model->forward(x), original));  // nothing was registered
    CHECK(cache->size() == 0);
  }
  SECTION("test_multihookmanager_default_pattern_matches_nothing: a pattern is required, and no match is an empty handle") {
    CHECK_THROWS_WITH(torchdbg::MultiHookManager(torchdbg::MultiHookOptions()), Catch::Contains("needs a pattern"));
    CHECK_THROWS_WITH(torchdbg::MultiHookManager(torchdbg::MultiHookOptions().classes_to_hook({torchdbg::module_type<torch::nn::LinearImpl>()})),
                      Catch::Contains("needs a pattern"));
    static_assert(!std::is_default_constructible_v<torchdbg::MultiHookManager>);
    torchdbg::MultiHookManager none(torchdbg::MultiHookOptions().pattern("a^"));  // tdhook's own default
    auto handle = none.register_hook(model, plus_one_factory());
    CHECK(handle.size() == 0);
    CHECK(torch::equal(model->forward(x), original));
    torchdbg::MultiHookManager nothing(torchdbg::MultiHookOptions().pattern("conv"));
    CHECK(nothing.register_hook(model, plus_one_factory()).size() == 0);
    torchdbg::MultiHookManager at_least_one(torchdbg::MultiHookOptions().pattern("conv").require_match(true));
    CHECK_THROWS_WITH(at_least_one.register_hook(model, plus_one_factory()), Catch::Contains("no hookable module matches 'conv'"));
    torchdbg::MultiHookManager every(torchdbg::MultiHookOptions().pattern(""));  // re.match("", name): every module
    CHECK(every.matching(model) == std::vector<std::string>{"linear1", "linear2", "linear3"});
  }
  SECTION("test_make_setting_hook_type_mismatch_raises: a replacement of another dtype, shape or device") {
    auto h = torchdbg::register_module_hook(model->linear1.ptr(), torchdbg::setting_hook([](const torch::Tensor& t) { return t.to(torch::kDouble); }), "linear1");
    CHECK_THROWS_WITH(model->forward(x), Catch::Contains("fwd hook of 'linear1'") && Catch::Contains("Double"));
  }
  SECTION("test_make_setting_hook_cacheproxy_resolve_branch: a cached value is read when the hook runs") {
    auto h = torchdbg::register_module_hook(model->linear3.ptr(), torchdbg::setting_hook(cache, "k"), "linear3");
    CHECK_THROWS_WITH(model->forward(x), Catch::Contains("'k'"));
    cache->set("k", torch::full({2, 4}, 123.0));
    CHECK(torch::equal(model->forward(x), torch::full({2, 4}, 123.0)));
    cache->set("k", torch::full({2, 4}, -1.0));
    CHECK(torch::equal(model->forward(x), torch::full({2, 4}, -1.0)));
  }
  SECTION("a hook factory's empty hook is refused before any is registered") {
    torchdbg::MultiHookManager all(torchdbg::MultiHookOptions().pattern(""));
    auto factory = [](const std::string& name) { return name == "linear2" ? ExactHook{} : torchdbg::setting_hook([](const torch::Tensor& t) { return t + 1; }); };
    CHECK_THROWS_WITH(all.register_hook(model, factory), Catch::Contains("empty hook for 'linear2'"));
    CHECK(torch::equal(model->forward(x), original));
  }
}

TEST_CASE("tdhook paths: tdhook's resolve cases on modules, adjacent escaped names included", "[tdhook]") {
  struct Leaf : torch::nn::Module {};
  struct Block : torch::nn::Module {
    Block() {
      sub = register_module("subblock0/module", torch::nn::ModuleList(std::make_shared<Leaf>(), std::make_shared<Leaf>()));
    }
    torch::nn::ModuleList sub{nullptr};
  };
  struct Root : torch::nn::Module {
    Root() {
      items = register_module("items", torch::nn::ModuleList(std::make_shared<Leaf>(), std::make_shared<Leaf>(), std::make_shared<Leaf>()));
      data = register_module("data", torch::nn::ModuleDict(torch::OrderedDict<std::string, std::shared_ptr<torch::nn::Module>>{
                                         {"first", std::make_shared<Leaf>()}, {"second", std::make_shared<Leaf>()}}));
      b0 = register_module("block0/module", std::make_shared<Leaf>());
      b1 = register_module("block1/module", torch::nn::ModuleList(std::make_shared<Leaf>()));
      b2 = register_module("block2/module", std::make_shared<Block>());
      child = register_module("child", std::make_shared<Block>());
    }
    torch::nn::ModuleList items{nullptr}, b1{nullptr};
    torch::nn::ModuleDict data{nullptr};
    std::shared_ptr<Leaf> b0;
    std::shared_ptr<Block> b2, child;
  };
  auto root = std::make_shared<Root>();
  auto at = [&](std::string_view path) { return torchdbg::resolve_submodule_path(root, path).get(); };
  // test_empty_key_returns_root, test_simple_attribute_access, test_nested_attribute_access
  CHECK(at("") == root.get());
  CHECK(at("items") == root->items.get());
  CHECK(at("child.<subblock0/module>") == root->child->sub.get());
  // test_list_indexing
  CHECK(at("items[0]") == root->items[0].get());
  CHECK(at("items[1]") == root->items[1].get());
  CHECK(at("items[-1]") == root->items[2].get());
  CHECK(at("items[-2]") == root->items[1].get());
  const auto sliced = torchdbg::resolve_submodule_paths(root, "items[1:3]");
  REQUIRE(sliced.size() == 2);
  CHECK(sliced[0].module.get() == root->items[1].get());
  CHECK(sliced[1].module.get() == root->items[2].get());
  // test_dict_indexing
  CHECK(at("data['first']") == root->data["first"].get());
  CHECK(at("data[\"second\"]") == root->data["second"].get());
  // test_custom_attributes_with_angles, the adjacent form included
  CHECK(at("<block0/module>") == root->b0.get());
  CHECK(at("<block1/module>[0]") == root->b1[0].get());
  CHECK(at("<block2/module>.<subblock0/module>[0]") == root->b2->sub[0].get());
  CHECK(at("<block2/module><subblock0/module>[0]") == root->b2->sub[0].get());
  CHECK(at("<block2/module><subblock0/module>[-1]") == root->b2->sub[1].get());
  CHECK(at("child<subblock0/module>[1]") == root->child->sub[1].get());
  CHECK(torchdbg::resolve_submodule_paths(root, "<block2/module><subblock0/module>[1]").front().name == "block2/module.subblock0/module.1");
  CHECK(torchdbg::submodule_path_to_name("<block2/module><subblock0/module>[0]") == "block2/module.subblock0/module.0");
  // test_number_attribute_access, test_mixed_attribute_and_indexing
  CHECK(at("items.0") == root->items[0].get());
  CHECK(at("items.2") == root->items[2].get());
  CHECK(at("<block2/module>.<subblock0/module>.1") == root->b2->sub[1].get());
  CHECK(at("[0][1]") == root->items[1].get());
  // test_invalid_paths_raise_value_error, and the forms tdhook's parser refuses
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"nonexistent", "no child 'nonexistent'"},
      {"items[999]", "index 999 out of range"},
      {":block0/module", "unexpected ':'"},
      {"block0/module:", "unexpected '/'"},
      {"<block0/module", "missing '>'"},
      {"<block0<module>", "'<' inside '<...>'"},
      {"items.[0]", "expected a name"},
      {"items.", "expected a name after '.'"},
      {"<>", "empty name"},
      {"items[1]x", "unexpected 'x'"},
  };
  for (const auto& [path, why] : bad) {
    INFO("path " << path);
    CHECK_THROWS_WITH(torchdbg::resolve_submodule_path(root, path), Catch::Contains(why) && Catch::Contains("'" + path + "'"));
  }
}

namespace {

// A random module tree whose children carry names of every kind a path must spell.
struct TreeNode : torch::nn::Module {};

const std::vector<std::string> kChildNames = {"fc", "layer_1", "0", "7", "block0/module", "a-b", "x y", "k.v", "q'uote", "d\"q", "[i]", "(p)"};

void grow(const std::shared_ptr<torch::nn::Module>& node, std::mt19937& gen, int depth) {
  std::uniform_int_distribution<int> count(0, depth > 0 ? 4 : 0);
  const int n = count(gen);
  std::set<std::string> used;
  for (int i = 0; i < n; ++i) {
    std::string name = kChildNames[std::uniform_int_distribution<std::size_t>(0, kChildNames.size() - 1)(gen)];
    if (name.find('.') != std::string::npos) continue;  // LibTorch refuses '.' in a child's name
    if (!used.insert(name).second) continue;
    auto child = std::make_shared<TreeNode>();
    node->register_module(name, child);
    grow(child, gen, depth - 1);
  }
}

bool plain_name(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-'; });
}

}  // namespace

TEST_CASE("property: every module of a random tree is reached by any spelling of its path, adjacent escapes included", "[tdhook]") {
  std::mt19937 gen(2024);
  int checked = 0;
  for (int trial = 0; trial < 120; ++trial) {
    auto root = std::make_shared<TreeNode>();
    grow(root, gen, 4);
    // The reference: the tree itself, walked with each step's (key, position, count).
    struct Step {
      std::string key;
      int64_t position, count;
    };
    std::vector<std::pair<std::vector<Step>, torch::nn::Module*>> all;
    std::function<void(torch::nn::Module&, std::vector<Step>)> visit = [&](torch::nn::Module& m, std::vector<Step> chain) {
      const auto children = m.named_children();
      for (std::size_t i = 0; i < children.size(); ++i) {
        auto next = chain;
        next.push_back({children[i].key(), static_cast<int64_t>(i), static_cast<int64_t>(children.size())});
        all.emplace_back(next, children[i].value().get());
        visit(*children[i].value(), next);
      }
    };
    visit(*root, {});
    for (const auto& [chain, module] : all) {
      std::string path, dotted;
      bool by_position = false;  // a positional index spells no name
      for (std::size_t k = 0; k < chain.size(); ++k) {
        const auto& st = chain[k];
        dotted += (k ? "." : "") + st.key;
        std::vector<std::string> forms;
        const bool escapable = st.key.find('<') == std::string::npos && st.key.find('>') == std::string::npos;
        if (plain_name(st.key)) forms.push_back((k ? "." : "") + st.key);
        if (escapable) {
          forms.push_back((k ? "." : "") + ("<" + st.key + ">"));
          if (k) forms.push_back("<" + st.key + ">");  // adjacent: no '.'
        }
        if (st.key.find('\'') == std::string::npos) forms.push_back("['" + st.key + "']");
        if (st.key.find('"') == std::string::npos) forms.push_back("[\"" + st.key + "\"]");
        forms.push_back("[" + std::to_string(st.position) + "]");
        forms.push_back("[" + std::to_string(st.position - st.count) + "]");
        const auto& form = forms[std::uniform_int_distribution<std::size_t>(0, forms.size() - 1)(gen)];
        by_position = by_position || (form[0] == '[' && form[1] != '\'' && form[1] != '"');
        path += form;
      }
      INFO("path " << path << " for module " << dotted);
      const auto found = torchdbg::resolve_submodule_paths(root, path);
      REQUIRE(found.size() == 1);
      CHECK(found.front().module.get() == module);
      CHECK(found.front().name == dotted);
      if (!by_position) CHECK(torchdbg::submodule_path_to_name(path) == dotted);
      ++checked;
    }
  }
  CHECK(checked > 500);
}

namespace {

struct BlockImpl : torch::nn::Module {
  explicit BlockImpl(torch::nn::Sequential b) {
    body = register_module("body", std::move(b));
    spare = register_module("spare", torch::nn::ModuleDict(torch::OrderedDict<std::string, std::shared_ptr<torch::nn::Module>>{
                                         {"lin", torch::nn::Linear(3, 3).ptr()}}));  // never called
  }
  torch::Tensor forward(const torch::Tensor& x) { return body->forward(x); }
  torch::nn::Sequential body{nullptr};
  torch::nn::ModuleDict spare{nullptr};
};
TORCH_MODULE(Block);

// A random Sequential of Linears, Tanhs and Blocks; a Linear is sometimes reused (shared by
// two places, or twice in one Sequential).
torch::nn::Sequential random_sequential(std::mt19937& gen, int depth, std::vector<torch::nn::Linear>& linears) {
  torch::nn::Sequential seq;
  const int n = std::uniform_int_distribution<int>(1, 4)(gen);
  for (int i = 0; i < n; ++i) {
    const int kind = std::uniform_int_distribution<int>(0, depth > 0 ? 3 : 2)(gen);
    if (kind == 0 && !linears.empty()) {
      seq->push_back(linears[std::uniform_int_distribution<std::size_t>(0, linears.size() - 1)(gen)]);
    } else if (kind <= 1) {
      linears.push_back(torch::nn::Linear(3, 3));
      seq->push_back(linears.back());
    } else if (kind == 2) {
      seq->push_back(torch::nn::Tanh());
    } else {
      seq->push_back(Block(random_sequential(gen, depth - 1, linears)));
    }
  }
  return seq;
}

// The model computed without torchdbg: each module's own forward, plus one after every call
// of a module in `plus_one`; `calls` counts the calls of each module.
torch::Tensor reference_forward(torch::nn::Module& m, torch::Tensor x, const std::set<const torch::nn::Module*>& plus_one,
                                std::map<const torch::nn::Module*, int>& calls) {
  if (auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(&m)) {
    for (const auto& child : seq->named_children()) x = reference_forward(*child.value(), x, plus_one, calls);
  } else if (auto* block = dynamic_cast<BlockImpl*>(&m)) {
    x = reference_forward(*block->body, x, plus_one, calls);
  } else if (auto* lin = dynamic_cast<torch::nn::LinearImpl*>(&m)) {
    x = lin->forward(x);
  } else {
    x = torch::tanh(x);
  }
  ++calls[&m];
  return plus_one.count(&m) ? x + 1 : x;
}

std::string sequential_code(torch::nn::Module& m) {  // the model as code, for a failure's message
  std::ostringstream out;
  if (auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(&m)) {
    out << "Sequential(";
    bool first = true;
    for (const auto& child : seq->named_children()) {
      out << (first ? "" : ", ") << sequential_code(*child.value());
      first = false;
    }
    out << ")";
  } else if (auto* block = dynamic_cast<BlockImpl*>(&m)) {
    out << "Block(" << sequential_code(*block->body) << ")";
  } else if (dynamic_cast<torch::nn::LinearImpl*>(&m)) {
    out << "Linear@" << static_cast<const void*>(&m);
  } else {
    out << "Tanh";
  }
  return out.str();
}

}  // namespace

TEST_CASE("property: a multi-hook manager hooks each selected module once, wherever it is called, on random models with shared modules", "[tdhook]") {
  torchdbg_test::SeededRng rng(107);
  std::mt19937 gen(77);
  const std::vector<std::string> patterns = {"", "0", "[0-9]+$", "0\\.", "[0-9]+\\.body", "[0-9]+\\.body\\.[0-9]+$", ".*spare", "1|2", "a^"};
  int shared_models = 0, hooked_total = 0;
  for (int trial = 0; trial < 150; ++trial) {
    std::vector<torch::nn::Linear> linears;
    auto model = random_sequential(gen, 3, linears);
    const std::string pattern = patterns[std::uniform_int_distribution<std::size_t>(0, patterns.size() - 1)(gen)];
    const bool only_linears = std::uniform_int_distribution<int>(0, 2)(gen) == 0;
    INFO("model " << sequential_code(*model) << ", pattern '" << pattern << "'" << (only_linears ? ", Linears only" : ""));
    // Reference selection: LibTorch's named_modules() (pre-order, no de-duplication) kept at
    // each module's first name, matched with std::regex from the start of the name.
    const std::regex re(pattern);
    std::vector<std::string> expected, expected_unhookable;
    std::set<const torch::nn::Module*> seen, selected;
    std::map<const torch::nn::Module*, int> holders;  // how many places hold it
    for (const auto& item : model->named_modules("", false)) {
      const auto* m = item.value().get();
      ++holders[m];
      if (!seen.insert(m).second) continue;
      if (!std::regex_search(item.key(), re, std::regex_constants::match_continuous)) continue;
      if (only_linears && !item.value()->as<torch::nn::LinearImpl>()) continue;
      // Hookable: held by a Sequential (a Block's body and its spare dict's items are not).
      const bool in_sequential = item.key().find("spare") == std::string::npos &&
                                 (item.key().size() < 5 || item.key().compare(item.key().size() - 5, 5, ".body") != 0);
      (in_sequential ? expected : expected_unhookable).push_back(item.key());
      if (in_sequential) selected.insert(m);
    }
    shared_models += std::any_of(holders.begin(), holders.end(), [](const auto& kv) { return kv.second > 1; });
    auto options = torchdbg::MultiHookOptions().pattern(pattern);
    if (only_linears) options.classes_to_hook({torchdbg::module_type<torch::nn::LinearImpl>()});
    torchdbg::MultiHookManager manager(options);
    REQUIRE(manager.matching(model.ptr()) == expected);
    REQUIRE(manager.unhookable(model.ptr()) == expected_unhookable);

    const auto x = torch::randn({2, 3});
    const auto original = model->forward(x);
    std::map<const torch::nn::Module*, int> ref_calls;
    const auto expected_out = reference_forward(*model, x, selected, ref_calls);
    std::map<std::string, int> calls;
    {
      auto adds = manager.register_hook(model.ptr(), [](const std::string&) {
        return torchdbg::setting_hook([](const torch::Tensor& t) { return t + 1; });
      });
      auto counts = manager.register_hook(model.ptr(), [&calls](const std::string& name) {
        return torchdbg::reading_hook([&calls, name](const ModuleCall& c, const torch::Tensor&) {
          CHECK(c.path == name);
          ++calls[name];
        });
      });
      REQUIRE(adds.size() == expected.size());
      hooked_total += static_cast<int>(adds.size());
      CHECK(torch::allclose(model->forward(x), expected_out, 1e-5, 1e-5));
    }
    for (const auto& item : model->named_modules("", false)) {
      if (!selected.count(item.value().get())) continue;
      if (std::find(expected.begin(), expected.end(), item.key()) == expected.end()) continue;  // a second name
      INFO("calls of " << item.key());
      CHECK(calls[item.key()] == ref_calls[item.value().get()]);
    }
    CHECK(torch::equal(model->forward(x), original));  // every hook gone, every list restored
    for (const auto& item : model->named_modules("", false)) {
      if (auto* seq = item.value()->as<torch::nn::SequentialImpl>()) {
        const auto children = seq->named_children();
        for (std::size_t i = 0; i < seq->size(); ++i) CHECK(seq->ptr(i).get() == children[i].value().get());
      }
    }
  }
  CHECK(shared_models > 20);
  CHECK(hooked_total > 150);
}
