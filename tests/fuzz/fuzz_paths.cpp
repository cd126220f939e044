// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
//
// libFuzzer target: the submodule-path grammar. Any input must either parse (and resolve or
// fail to resolve with torchdbg::Error) or be rejected with torchdbg::Error — never crash,
// hang, read out of bounds or throw anything else.
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torchdbg/paths.hpp>

#include <cstdint>
#include <cstdlib>
#include <string>

namespace {
std::shared_ptr<torch::nn::Module> model() {
  static std::shared_ptr<torch::nn::Module> m = [] {
    auto root = std::make_shared<torch::nn::Module>();
    auto seq = torch::nn::Sequential(torch::nn::Linear(2, 2), torch::nn::Linear(2, 2));
    root->register_module("layers", seq);
    auto dict = torch::nn::ModuleDict(torch::OrderedDict<std::string, std::shared_ptr<torch::nn::Module>>{
        {"cls", torch::nn::Linear(2, 2).ptr()}});
    root->register_module("heads", dict);
    root->register_module("odd/name x", torch::nn::ModuleList(torch::nn::Linear(2, 2)));
    return root;
  }();
  return m;
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string path(reinterpret_cast<const char*>(data), size);
  try {
    const auto steps = torchdbg::parse_submodule_path(path);
    (void)steps;
  } catch (const torchdbg::Error&) {
    return 0;
  }
  try {
    (void)torchdbg::resolve_submodule_paths(model(), path);
  } catch (const torchdbg::Error&) {
  }
  try {
    (void)torchdbg::submodule_path_to_name(path);
  } catch (const torchdbg::Error&) {
  }
  try {
    (void)torchdbg::merge_paths(path, path);
  } catch (const torchdbg::Error&) {
  }
  return 0;
}
