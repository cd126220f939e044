// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#include <torchdbg/paths.hpp>

#include <torch/torch.h>

#include <optional>
#include <random>

#include "helpers.hpp"

namespace {
struct Block : torch::nn::Module {
  Block() {
    linear = register_module("linear", torch::nn::ModuleList(torch::nn::Linear(2, 2), torch::nn::Linear(2, 3)));
  }
  torch::nn::ModuleList linear{nullptr};
};
struct Model : torch::nn::Module {
  Model() {
    layers = register_module("layers", torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::ReLU(),
                                                             torch::nn::Linear(4, 2), torch::nn::Tanh()));
    heads = register_module("heads", torch::nn::ModuleDict(torch::OrderedDict<std::string, std::shared_ptr<torch::nn::Module>>{
                                          {"cls", torch::nn::Linear(2, 3).ptr()}, {"reg", torch::nn::Linear(2, 1).ptr()}}));
    m1 = register_module("m1", torch::nn::ModuleList(std::make_shared<Block>()));
    odd = register_module("block0/module", std::make_shared<Block>());
  }
  torch::nn::Sequential layers{nullptr};
  torch::nn::ModuleDict heads{nullptr};
  torch::nn::ModuleList m1{nullptr};
  std::shared_ptr<Block> odd;
};
}  // namespace

TEST_CASE("good paths resolve to the modules their grammar names", "[paths]") {
  auto model = std::make_shared<Model>();
  const std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> table = {
      {"", model},
      {"layers", model->layers.ptr()},
      {"[0]", model->layers.ptr()},
      {"[-1][0]", model->odd->linear.ptr()},
      {"layers[0]", model->layers->ptr(0)},
      {"layers[-1]", model->layers->ptr(3)},
      {"layers.2", model->layers->ptr(2)},
      {"heads['cls']", model->heads["cls"]},
      {"heads[\"reg\"]", model->heads["reg"]},
      {"<block0/module>", model->odd},
      {"<block0/module>.linear[1]", model->odd->linear->ptr(1)},
      {"m1.<0>.linear[0]", model->m1[0]->as<Block>()->linear->ptr(0)},
      {"m1[0].linear[-2]", model->m1[0]->as<Block>()->linear->ptr(0)},
  };
  for (const auto& [path, expected] : table) {
    INFO("path " << path);
    CHECK(torchdbg::resolve_submodule_path(model, path).get() == expected.get());
  }
  const auto sliced = torchdbg::resolve_submodule_paths(model, "layers[1:3]");
  REQUIRE(sliced.size() == 2);
  CHECK(sliced[0].name == "layers.1");
  CHECK(sliced[1].name == "layers.2");
  CHECK(torchdbg::resolve_submodule_paths(model, "layers[::2]").size() == 2);
  CHECK(torchdbg::resolve_submodule_paths(model, "layers[-2:]")[0].name == "layers.2");
  CHECK(torchdbg::resolve_submodule_paths(model, "layers[5:9]").empty());
}

TEST_CASE("bad paths fail with the position and the reason", "[paths]") {
  auto model = std::make_shared<Model>();
  const std::vector<std::tuple<std::string, std::string, std::string>> table = {
      {"layers[0", "position 6", "missing ']'"},
      {"layers[1:2:3:4]", "position 7", "too many ':'"},
      {"layers[a:2]", "position 7", "not an integer"},
      {"layers[::0]", "position 7", "step cannot be zero"},
      {"layers[]", "position 6", "empty index"},
      {"nope", "position 0", "no child 'nope'"},
      {"layers[7]", "position 6", "index 7 out of range"},
      {"layers[-5]", "position 6", "index -5 out of range"},
      {"heads['x']", "position 5", "no child 'x'"},
      {"heads['x]", "position 6", "missing closing '"},
      {"<block0", "position 0", "missing '>'"},
      {"layers..0", "position 7", "expected a name"},
      {"layers.", "position 7", "expected a name after '.'"},
      {"layers]", "position 6", "unexpected ']'"},
      {"layers[1:3]", "", "selects 2 modules"},
  };
  for (const auto& [path, where, why] : table) {
    INFO("path " << path);
    try {
      (void)torchdbg::resolve_submodule_path(model, path);
      FAIL("expected an error");
    } catch (const torchdbg::Error& e) {
      const std::string msg = e.what();
      CHECK(msg.find(why) != std::string::npos);
      CHECK(msg.find(where) != std::string::npos);
    }
  }
}

TEST_CASE("paths convert to names and merge under a relative root", "[paths]") {
  CHECK(torchdbg::submodule_path_to_name("layers[0]") == "layers.0");
  CHECK(torchdbg::submodule_path_to_name("m1.<0>.layers.<module>.linear[0]") == "m1.0.layers.module.linear.0");
  CHECK(torchdbg::submodule_path_to_name("heads['cls']") == "heads.cls");
  CHECK(torchdbg::submodule_path_to_name("<block0/module>") == "block0/module");
  CHECK(torchdbg::submodule_path_to_name("") == "");
  CHECK(torchdbg::submodule_path_to_name("[2].fc") == "2.fc");
  CHECK_THROWS_WITH(torchdbg::submodule_path_to_name("layers[-1]"), Catch::Contains("needs the model"));
  CHECK_THROWS_WITH(torchdbg::submodule_path_to_name("layers[0:2]"), Catch::Contains("needs the model"));
  CHECK(torchdbg::merge_paths("encoder", "layers[0]") == "encoder.layers[0]");
  CHECK(torchdbg::merge_paths("layers", "[0]") == "layers[0]");
  CHECK(torchdbg::merge_paths("", "fc") == "fc");
  CHECK(torchdbg::merge_paths("fc", "") == "fc");
  CHECK_THROWS_AS(torchdbg::merge_paths("enc[", "fc"), torchdbg::Error);
}

namespace {
// Python's slice(start, stop, step).indices(count) and range(), written out as CPython does.
std::vector<int64_t> python_slice(int64_t count, std::optional<int64_t> start, std::optional<int64_t> stop, int64_t step) {
  int64_t lo, hi;
  if (step < 0) {
    lo = start ? *start : count - 1;
    hi = stop ? *stop : -count - 1;
    if (start && lo < 0) lo = std::max<int64_t>(lo + count, -1);
    if (start && lo >= count) lo = count - 1;
    if (stop && hi < 0) hi = std::max<int64_t>(hi + count, -1);
    if (stop && hi >= count) hi = count - 1;
    if (!stop) hi = -1;
  } else {
    lo = start ? *start : 0;
    hi = stop ? *stop : count;
    if (lo < 0) lo = std::max<int64_t>(lo + count, 0);
    if (lo > count) lo = count;
    if (hi < 0) hi = std::max<int64_t>(hi + count, 0);
    if (hi > count) hi = count;
  }
  std::vector<int64_t> out;
  for (int64_t k = lo; step > 0 ? k < hi : k > hi; k += step) out.push_back(k);
  return out;
}
}  // namespace

TEST_CASE("property: slices select what Python's slicing of the children selects, negative steps included", "[paths]") {
  std::mt19937 gen(31);
  std::uniform_int_distribution<int> bound(-8, 8), step(-4, 4), size(0, 6), coin(0, 2);
  int nonempty = 0, reversed = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    const int n = size(gen);
    torch::nn::ModuleList list;
    for (int i = 0; i < n; ++i) list->push_back(torch::nn::Identity());
    auto root = std::make_shared<torch::nn::Module>();
    root->register_module("l", list.ptr());
    std::optional<int64_t> a, b;
    if (coin(gen)) a = bound(gen);
    if (coin(gen)) b = bound(gen);
    int st = step(gen);
    if (st == 0) st = 1;
    const bool write_step = st != 1 || coin(gen) == 0;
    const std::string path = "l[" + (a ? std::to_string(*a) : "") + ":" + (b ? std::to_string(*b) : "") +
                             (write_step ? ":" + std::to_string(st) : "") + "]";
    INFO("path " << path << " over " << n << " children");
    const auto expected = python_slice(n, a, b, st);
    const auto found = torchdbg::resolve_submodule_paths(root, path);
    REQUIRE(found.size() == expected.size());
    for (std::size_t k = 0; k < found.size(); ++k) {
      CHECK(found[k].module.get() == list->ptr(static_cast<std::size_t>(expected[k])).get());
      CHECK(found[k].name == "l." + std::to_string(expected[k]));
    }
    nonempty += !expected.empty();
    reversed += expected.size() > 1 && st < 0;
  }
  CHECK(nonempty > 500);
  CHECK(reversed > 100);
  auto root = std::make_shared<torch::nn::Module>();
  root->register_module("l", torch::nn::ModuleList(torch::nn::Identity(), torch::nn::Identity()).ptr());
  CHECK(torchdbg::resolve_submodule_paths(root, "l[0::9223372036854775807]").size() == 1);  // no overflow
  CHECK(torchdbg::resolve_submodule_paths(root, "l[::-9223372036854775807]").size() == 1);
  CHECK_THROWS_WITH(torchdbg::resolve_submodule_paths(root, "l[::-9223372036854775808]"), Catch::Contains("out of range"));
}

TEST_CASE("a path's error shows a whole UTF-8 character; merge_paths checks both sides, empty or not", "[paths]") {
  auto root = std::make_shared<torch::nn::Module>();
  root->register_module("\xc3\xbc", torch::nn::Identity().ptr());  // ü
  CHECK(torchdbg::resolve_submodule_path(root, "<\xc3\xbc>") != nullptr);
  CHECK_THROWS_WITH(torchdbg::resolve_submodule_path(root, "\xc3\xbc"), Catch::Contains("unexpected '\xc3\xbc'"));
  CHECK_THROWS_WITH(torchdbg::resolve_submodule_path(root, "a.\xe2\x82\xac"), Catch::Contains("unexpected '\xe2\x82\xac'"));
  CHECK_THROWS_AS(torchdbg::merge_paths("", "a..b"), torchdbg::Error);
  CHECK_THROWS_AS(torchdbg::merge_paths("a..b", ""), torchdbg::Error);
  CHECK(torchdbg::merge_paths("", "") == "");
  CHECK(torchdbg::merge_paths("a", "<b/c>") == "a.<b/c>");
}
