// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
//
// attach on the model patterns users write, each trained a few steps with SGD, Adam and
// AdamW: every forward delivery (name, call index, order, shape, values, statistics) and
// every gradient and gradient norm is checked against a reference taken inside the model's
// own forward (what each submodule returned; recording a tensor handle runs no operator, so
// attach sees the model as it is) and against the parameters' `.grad()`.
//
// Adding a model: derive from ZooNet, wrap each submodule call in `truth_("name", ...)` (and
// each activation attach delivers in `truth_("name/act", ...)`), and list it in zoo().
#include <torch/torch.h>
#include <torchdbg/attach.hpp>

#include <cmath>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <unordered_set>
#include <vector>

#include "delivery_check.hpp"
#include "helpers.hpp"

using torchdbg::AttachOptions;
using torchdbg::HookAction;
using torchdbg::HookConfig;
using torchdbg::HookManager;
using torchdbg::HookTrigger;
namespace nn = torch::nn;

namespace {

/// What each submodule returned in one forward, in order, with the call index per module.
class Truth {
 public:
  struct Out {
    std::string name;
    uint32_t call;
    torch::Tensor tensor;
  };
  /// Records `t` as the delivery `name` ("fc1", or "fc1/gelu" for an activation of fc1's
  /// latest output) and returns it.
  torch::Tensor operator()(const std::string& name, torch::Tensor t) {
    const auto slash = name.find('/');
    uint32_t call = 0;
    if (slash == std::string::npos) {
      call = calls_[name]++;
    } else {
      REQUIRE(calls_[name.substr(0, slash)] > 0);
      call = calls_[name.substr(0, slash)] - 1;
    }
    outs_.push_back({name, call, t});
    return t;
  }
  void clear() {
    outs_.clear();
    calls_.clear();
  }
  [[nodiscard]] const std::vector<Out>& outs() const { return outs_; }

 private:
  std::vector<Out> outs_;
  std::map<std::string, uint32_t> calls_;
};

struct ZooNet : nn::Module {
  Truth truth_;
  torch::Device device_ = torch::kCPU;  ///< where the model and its batches live
  /// A batch made on the CPU (the same values on every device) moved to the model's device.
  torch::Tensor in(const torch::Tensor& t) const { return t.to(device_); }
  /// One training step's forward on the step's batch, returning the loss.
  virtual torch::Tensor loss(int64_t step) = 0;
};

// --- the zoo ---------------------------------------------------------------------------

/// Pre-norm transformer block: causal multi-head self-attention written out with head
/// reshapes, GELU MLP, residuals.
struct Block : nn::Module {
  Block(Truth& truth, std::string prefix, int64_t e, int64_t heads)
      : truth_(truth), p_(std::move(prefix)), heads_(heads), e_(e) {
    ln1 = register_module("ln1", nn::LayerNorm(nn::LayerNormOptions({e})));
    q = register_module("q", nn::Linear(e, e));
    k = register_module("k", nn::Linear(e, e));
    v = register_module("v", nn::Linear(e, e));
    o = register_module("o", nn::Linear(e, e));
    ln2 = register_module("ln2", nn::LayerNorm(nn::LayerNormOptions({e})));
    fc1 = register_module("fc1", nn::Linear(e, 3 * e));
    fc2 = register_module("fc2", nn::Linear(3 * e, e));
  }
  torch::Tensor forward(torch::Tensor h) {
    const int64_t b = h.size(0), t = h.size(1), d = e_ / heads_;
    auto a = truth_(p_ + "ln1", ln1(h));
    auto qh = truth_(p_ + "q", q(a)).view({b, t, heads_, d}).transpose(1, 2);
    auto kh = truth_(p_ + "k", k(a)).view({b, t, heads_, d}).transpose(1, 2);
    auto vh = truth_(p_ + "v", v(a)).view({b, t, heads_, d}).transpose(1, 2);
    auto scores = qh.matmul(kh.transpose(-2, -1)) / std::sqrt(static_cast<double>(d));
    scores = scores.masked_fill(torch::ones({t, t}, torch::TensorOptions(torch::kBool).device(h.device())).triu(1), -1e9);
    auto y = torch::softmax(scores, -1).matmul(vh).transpose(1, 2).contiguous().view({b, t, e_});
    h = h + truth_(p_ + "o", o(y));
    auto a2 = truth_(p_ + "ln2", ln2(h));
    auto m = truth_(p_ + "fc1/gelu", torch::gelu(truth_(p_ + "fc1", fc1(a2))));
    return h + truth_(p_ + "fc2", fc2(m));
  }
  Truth& truth_;
  std::string p_;
  int64_t heads_, e_;
  nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  nn::Linear q{nullptr}, k{nullptr}, v{nullptr}, o{nullptr}, fc1{nullptr}, fc2{nullptr};
};

/// Token + position embeddings, two blocks, final LayerNorm, a bias-free decoder tied to the
/// token embedding (`decoder->weight = tok->weight`).
struct TransformerLM : ZooNet {
  static constexpr int64_t kVocab = 13, kLen = 6, kEmb = 8;
  TransformerLM() {
    tok = register_module("tok", nn::Embedding(kVocab, kEmb));
    pos = register_module("pos", nn::Embedding(kLen, kEmb));
    blocks = register_module("blocks", nn::ModuleList());
    for (int i = 0; i < 2; ++i)
      blocks->push_back(std::make_shared<Block>(truth_, "blocks." + std::to_string(i) + ".", kEmb, 2));
    lnf = register_module("lnf", nn::LayerNorm(nn::LayerNormOptions({kEmb})));
    decoder = register_module("decoder", nn::Linear(nn::LinearOptions(kEmb, kVocab).bias(false)));
    decoder->weight = tok->weight;
  }
  torch::Tensor loss(int64_t step) override {
    torch::manual_seed(500 + step);
    const auto idx = in(torch::randint(0, kVocab, {3, kLen + 1}));
    auto x = idx.slice(1, 0, kLen), target = idx.slice(1, 1);
    auto h = truth_("tok", tok(x));
    h = h + truth_("pos", pos(in(torch::arange(kLen))));
    for (const auto& blk : *blocks) h = blk->as<Block>()->forward(h);
    h = truth_("lnf", lnf(h));
    auto logits = truth_("decoder", decoder(h));
    return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), target.reshape(-1));
  }
  nn::Embedding tok{nullptr}, pos{nullptr};
  nn::ModuleList blocks{nullptr};
  nn::LayerNorm lnf{nullptr};
  nn::Linear decoder{nullptr};
};

/// A residual block, called twice in a row as the same module.
struct ResBlock : nn::Module {
  ResBlock(Truth& truth, int64_t c) : truth_(truth) {
    conv1 = register_module("conv1", nn::Conv2d(nn::Conv2dOptions(c, c, 3).padding(1).bias(false)));
    bn1 = register_module("bn1", nn::BatchNorm2d(c));
    conv2 = register_module("conv2", nn::Conv2d(nn::Conv2dOptions(c, c, 3).padding(1).bias(false)));
    bn2 = register_module("bn2", nn::BatchNorm2d(c));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    auto y = truth_("block.bn1/relu", torch::relu(truth_("block.bn1", bn1(truth_("block.conv1", conv1(x))))));
    y = truth_("block.bn2", bn2(truth_("block.conv2", conv2(y))));
    return torch::relu(y + x);  // the sum is no module's output: nothing is delivered for it
  }
  Truth& truth_;
  nn::Conv2d conv1{nullptr}, conv2{nullptr};
  nn::BatchNorm2d bn1{nullptr}, bn2{nullptr};
};

struct ResNetCNN : ZooNet {
  ResNetCNN() {
    stem = register_module("stem", nn::Conv2d(nn::Conv2dOptions(2, 4, 3).padding(1)));
    bn = register_module("bn", nn::BatchNorm2d(4));
    block = register_module("block", std::make_shared<ResBlock>(truth_, 4));
    fc = register_module("fc", nn::Linear(4, 5));
  }
  torch::Tensor loss(int64_t step) override {
    torch::manual_seed(600 + step);
    const auto x = in(torch::randn({4, 2, 7, 7}));
    const auto y = in(torch::randint(0, 5, {4}));
    auto h = truth_("bn/relu", torch::relu(truth_("bn", bn(truth_("stem", stem(x))))));
    h = block->forward(h);
    h = block->forward(h);
    h = torch::adaptive_avg_pool2d(h, {1, 1}).flatten(1);
    return torch::nn::functional::cross_entropy(truth_("fc", fc(h)), y);
  }
  nn::Conv2d stem{nullptr};
  nn::BatchNorm2d bn{nullptr};
  std::shared_ptr<ResBlock> block;
  nn::Linear fc{nullptr};
};

struct LstmLM : ZooNet {
  static constexpr int64_t kVocab = 11;
  LstmLM() {
    emb = register_module("emb", nn::Embedding(kVocab, 6));
    lstm = register_module("lstm", nn::LSTM(nn::LSTMOptions(6, 7).num_layers(2).batch_first(true)));
    head = register_module("head", nn::Linear(7, kVocab));
  }
  torch::Tensor loss(int64_t step) override {
    torch::manual_seed(700 + step);
    const auto idx = in(torch::randint(0, kVocab, {3, 6}));
    auto x = idx.slice(1, 0, 5), target = idx.slice(1, 1);
    auto out = truth_("lstm", std::get<0>(lstm(truth_("emb", emb(x)))));
    auto logits = truth_("head", head(out));
    return torch::nn::functional::cross_entropy(logits.reshape({-1, kVocab}), target.reshape(-1));
  }
  nn::Embedding emb{nullptr};
  nn::LSTM lstm{nullptr};
  nn::Linear head{nullptr};
};

struct Encoder : nn::Module {
  explicit Encoder(Truth& truth) : truth_(truth) {
    fc1 = register_module("fc1", nn::Linear(5, 8));
    fc2 = register_module("fc2", nn::Linear(8, 4));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return truth_("encoder.fc2", fc2(truth_("encoder.fc1/tanh", torch::tanh(truth_("encoder.fc1", fc1(x))))));
  }
  Truth& truth_;
  nn::Linear fc1{nullptr}, fc2{nullptr};
};

/// A Siamese encoder (both branches through one module), a layer called twice in one
/// expression, and a pair of Linears whose weights are tied (`second->weight = first->weight`).
struct Siamese : ZooNet {
  Siamese() {
    encoder = register_module("encoder", std::make_shared<Encoder>(truth_));
    mix = register_module("mix", nn::Linear(4, 4));
    first = register_module("first", nn::Linear(4, 4));
    second = register_module("second", nn::Linear(4, 4));
    second->weight = first->weight;
    head = register_module("head", nn::Linear(4, 2));
  }
  torch::Tensor loss(int64_t step) override {
    torch::manual_seed(800 + step);
    const auto a = in(torch::randn({6, 5})), b = in(torch::randn({6, 5}));
    const auto y = in(torch::randint(0, 2, {6}));
    auto ea = encoder->forward(a);
    auto eb = encoder->forward(b);
    auto ma = truth_("mix", mix(ea));
    auto mb = truth_("mix", mix(eb));
    auto d = (ma - mb).abs();
    auto t = truth_("second", second(truth_("first/relu", torch::relu(truth_("first", first(d))))));
    return torch::nn::functional::cross_entropy(truth_("head", head(t)), y);
  }
  std::shared_ptr<Encoder> encoder;
  nn::Linear mix{nullptr}, first{nullptr}, second{nullptr}, head{nullptr};
};

/// Parameters used functionally: the root's own weights (`x.matmul(w) + b`, two operators,
/// one output), a child's weight reused in a functional linear (a second call of it), and
/// an Embedding.
struct Functional : ZooNet {
  Functional() {
    w = register_parameter("w", torch::randn({5, 6}) * 0.4);
    b = register_parameter("b", torch::zeros({6}));
    proj = register_module("proj", nn::Linear(6, 6));
    emb = register_module("emb", nn::Embedding(9, 6));
    out = register_module("out", nn::Linear(6, 3));
  }
  torch::Tensor loss(int64_t step) override {
    torch::manual_seed(900 + step);
    const auto x = in(torch::randn({4, 5}));
    const auto tokens = in(torch::randint(0, 9, {4}));
    const auto y = in(torch::randint(0, 3, {4}));
    auto h = truth_("root/relu", torch::relu(truth_("root", x.matmul(w) + b)));
    auto p = truth_("proj", proj(h));
    auto p2 = truth_("proj", torch::nn::functional::linear(p, proj->weight));
    auto e = truth_("emb", emb(tokens));
    return torch::nn::functional::cross_entropy(truth_("out", out(p2 * e)), y);
  }
  torch::Tensor w, b;
  nn::Linear proj{nullptr}, out{nullptr};
  nn::Embedding emb{nullptr};
};

/// nn::MultiheadAttention between LayerNorms: `attn` delivers the attention output.
struct AttentionNet : ZooNet {
  AttentionNet() {
    ln = register_module("ln", nn::LayerNorm(nn::LayerNormOptions({8})));
    attn = register_module("attn", nn::MultiheadAttention(nn::MultiheadAttentionOptions(8, 2)));
    fc = register_module("fc", nn::Linear(8, 3));
  }
  torch::Tensor loss(int64_t step) override {
    torch::manual_seed(1000 + step);
    const auto x = in(torch::randn({5, 3, 8}));  // [L, N, E]
    const auto y = in(torch::randn({5, 3, 3}));
    auto a = truth_("ln", ln(x));
    auto h = x + truth_("attn", std::get<0>(attn(a, a, a)));
    return torch::mse_loss(truth_("fc", fc(h)), y);
  }
  nn::LayerNorm ln{nullptr};
  nn::MultiheadAttention attn{nullptr};
  nn::Linear fc{nullptr};
};

/// A GRU cell unrolled over time (each step consumes the previous call's output) and a Linear
/// applied to its own output: one delivery per call.
struct Recurrent : ZooNet {
  Recurrent() {
    cell = register_module("cell", nn::GRUCell(4, 6));
    fc = register_module("fc", nn::Linear(6, 6));
    head = register_module("head", nn::Linear(6, 2));
  }
  torch::Tensor loss(int64_t step) override {
    torch::manual_seed(1100 + step);
    const auto x = in(torch::randn({5, 3, 4}));  // [T, N, features]
    const auto y = in(torch::randn({3, 2}));
    auto h = in(torch::zeros({3, 6}));
    for (int64_t t = 0; t < x.size(0); ++t) h = truth_("cell", cell(x[t], h));
    h = truth_("fc/tanh", torch::tanh(truth_("fc", fc(truth_("fc", fc(h))))));
    return torch::mse_loss(truth_("head", head(h)), y);
  }
  nn::GRUCell cell{nullptr};
  nn::Linear fc{nullptr}, head{nullptr};
};

using Factory = std::function<std::shared_ptr<ZooNet>()>;
const std::vector<std::pair<std::string, Factory>>& zoo() {
  static const std::vector<std::pair<std::string, Factory>> z = {
      {"transformer LM", [] { return std::make_shared<TransformerLM>(); }},
      {"ResNet CNN", [] { return std::make_shared<ResNetCNN>(); }},
      {"LSTM LM", [] { return std::make_shared<LstmLM>(); }},
      {"Siamese", [] { return std::make_shared<Siamese>(); }},
      {"functional", [] { return std::make_shared<Functional>(); }},
      {"attention", [] { return std::make_shared<AttentionNet>(); }},
      {"recurrent", [] { return std::make_shared<Recurrent>(); }},
  };
  return z;
}

using OptFactory = std::function<std::unique_ptr<torch::optim::Optimizer>(std::vector<torch::Tensor>)>;
const std::vector<std::pair<std::string, OptFactory>>& optimizers() {
  static const std::vector<std::pair<std::string, OptFactory>> o = {
      {"sgd momentum",
       [](auto p) { return std::make_unique<torch::optim::SGD>(p, torch::optim::SGDOptions(0.05).momentum(0.9)); }},
      {"adam", [](auto p) { return std::make_unique<torch::optim::Adam>(p, torch::optim::AdamOptions(1e-2)); }},
      {"adamw",
       [](auto p) { return std::make_unique<torch::optim::AdamW>(p, torch::optim::AdamWOptions(1e-2)); }},
  };
  return o;
}

/// The tensor a parameter entry of `m` stands for in its forward: the member a built-in
/// layer reads (tied by assignment) or the registered tensor.
torch::Tensor used_tensor(nn::Module& m, const std::string& name, const torch::Tensor& registered) {
  if (name == "weight") {
    if (auto* l = dynamic_cast<nn::LinearImpl*>(&m)) return l->weight;
    if (auto* e = dynamic_cast<nn::EmbeddingImpl*>(&m)) return e->weight;
  }
  return registered;
}

/// Per module (dotted name, "root" for the model), the tensors whose gradient it reports:
/// each distinct tensor under the first module that registered it.
std::vector<std::pair<std::string, std::vector<std::pair<std::string, torch::Tensor>>>> gradient_owners(
    nn::Module& model) {
  std::vector<std::pair<std::string, std::vector<std::pair<std::string, torch::Tensor>>>> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& item : model.named_modules("", true)) {
    std::vector<std::pair<std::string, torch::Tensor>> own;
    const auto params = item.value()->named_parameters(false);
    for (const auto& p : params) {
      const auto t = used_tensor(*item.value(), p.key(), p.value());
      if (seen.insert(t.unsafeGetTensorImpl()).second) own.emplace_back(p.key(), t);
    }
    if (!own.empty()) out.emplace_back(item.key().empty() ? "root" : item.key(), std::move(own));
  }
  return out;
}

struct Seen {
  std::string name;
  std::string call;
  torch::Tensor tensor;  // a copy made at delivery
  torchdbg::TensorStats stats;
};

}  // namespace

namespace {

/// Trains each zoo model on `device` a few steps with each optimizer and checks every
/// delivery, gradient and norm against the model's own values.
void check_zoo(const torch::Device& device) {
  for (const auto& [model_name, make] : zoo()) {
    for (const auto& [opt_name, make_opt] : optimizers()) {
      for (bool no_grad_forward : {false, true}) {
        INFO(model_name << " with " << opt_name << ", no_grad_forward " << no_grad_forward << " on " << device);
        torchdbg_test::SeededRng rng(42);
        auto model = make();
        model->to(device);
        model->device_ = device;
        model->train();
        auto opt = make_opt(model->parameters());
        HookManager hooks;
        std::vector<Seen> fwd;
        std::map<std::string, std::vector<torch::Tensor>> bwd;  // "<module>.<parameter>"
        hooks.register_callback("record", [&](const torchdbg::HookContext& c) {
          if (c.is_forward()) {
            fwd.push_back({std::string(c.layer_name()), std::string(c.metadata_value("call").value_or("?")),
                           c.tensor().detach().clone(), c.stats()});
          } else {
            bwd[std::string(c.layer_name()) + "." + std::string(*c.metadata_value("parameter"))].push_back(
                c.tensor().detach().clone());
          }
        });
        hooks.register_hook(HookConfig().name("record").trigger(HookTrigger::every_n_steps(1)).actions(
            {HookAction::custom_callback("record")}));
        auto session = torchdbg::attach(*model, hooks, AttachOptions().no_grad_forward(no_grad_forward));
        const auto owners = gradient_owners(*model);
        for (int64_t step = 0; step < 3; ++step) {
          INFO("step " << step);
          hooks.set_step(step);
          fwd.clear();
          bwd.clear();
          model->truth_.clear();
          opt->zero_grad();
          auto loss = model->loss(step);
          loss.backward();
          session.flush();
          // Forward: the same deliveries in the same order, each equal to what the module returned.
          const auto& truth = model->truth_.outs();
          std::vector<std::string> got_names, want_names;
          for (const auto& s : fwd) got_names.push_back(s.name + "#" + s.call);
          for (const auto& o : truth) want_names.push_back(o.name + "#" + std::to_string(o.call));
          REQUIRE(got_names == want_names);
          for (std::size_t i = 0; i < fwd.size(); ++i) {
            INFO("delivery " << fwd[i].name << " call " << fwd[i].call);
            const auto& want = truth[i].tensor;
            REQUIRE(fwd[i].tensor.sizes() == want.sizes());
            CHECK(torch::equal(fwd[i].tensor, want.detach()));
            torchdbg_test::check_delivered_stats(fwd[i].stats, want);
          }
          // Backward: each distinct parameter once, equal to its .grad(); norms per module and global.
          std::size_t expected_grads = 0;
          double total = 0.0;
          std::map<std::string, double> want_norms;
          for (const auto& [module, params] : owners) {
            double sq = 0.0;
            for (const auto& [pname, t] : params) {
              if (!t.grad().defined()) continue;
              ++expected_grads;
              const std::string key = module + "." + pname;
              INFO("gradient " << key);
              REQUIRE(bwd.count(key) == 1);
              REQUIRE(bwd.at(key).size() == 1);
              CHECK(torch::equal(bwd.at(key)[0], t.grad()));
              for (double g : torchdbg_test::as_doubles(t.grad())) sq += g * g;
            }
            want_norms[module] = std::sqrt(sq);
            total += sq;
          }
          CHECK(bwd.size() == expected_grads);
          const auto norms = session.gradient_norms();
          CHECK(norms.size() == want_norms.size());
          for (const auto& [module, norm] : norms) {
            INFO("norm of " << module);
            REQUIRE(want_norms.count(module) == 1);
            CHECK_CLOSE(norm, want_norms.at(module), 1e-6);
          }
          REQUIRE(hooks.state().gradient_norm);
          CHECK_CLOSE(*hooks.state().gradient_norm, std::sqrt(total), 1e-6);
          // The optimizer's step delivers nothing, with or without no_grad_forward.
          const auto before = session.forward_deliveries();
          opt->step();
          session.flush();
          CHECK(session.forward_deliveries() == before);
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("attach on a model zoo: every delivery and gradient norm matches the model's own values", "[attach]") {
  check_zoo(torch::kCPU);
}

TEST_CASE("attach on the model zoo on CUDA: every delivery and gradient norm matches the model's own values",
          "[attach][cuda]") {
  if (!torch::cuda::is_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  check_zoo(torch::kCUDA);
}

TEST_CASE("tied weights: the gradient comes once, under its first module, naming the others", "[attach]") {
  torchdbg_test::SeededRng rng(7);
  auto lm = std::make_shared<TransformerLM>();
  HookManager hooks;
  std::vector<std::pair<std::string, torchdbg::Metadata>> grads;
  hooks.register_callback("g", [&](const torchdbg::HookContext& c) {
    if (!c.is_forward()) grads.emplace_back(std::string(c.layer_name()), c.metadata());
  });
  hooks.register_hook(HookConfig().name("g").trigger(HookTrigger::every_n_steps(1)).actions(
      {HookAction::custom_callback("g")}));
  auto session = torchdbg::attach(*lm, hooks);
  lm->loss(0).backward();
  int tok = 0;
  for (const auto& [layer, md] : grads) {
    CHECK(layer != "decoder");  // the decoder has no tensor of its own
    if (layer == "tok") {
      ++tok;
      CHECK(md.at("tied") == "decoder.weight");
    } else {
      CHECK(md.count("tied") == 0);
    }
  }
  CHECK(tok == 1);
}

TEST_CASE("MultiheadAttention delivers its attention output under its own name, also without out_proj selected",
          "[attach]") {
  for (const std::string pattern : {"", "attn$"}) {
    INFO("pattern '" << pattern << "'");
    torchdbg_test::SeededRng rng(8);
    auto net = std::make_shared<AttentionNet>();
    HookManager hooks;
    std::vector<std::pair<std::string, torch::Tensor>> fwd;
    hooks.register_callback("f", [&](const torchdbg::HookContext& c) {
      if (c.is_forward()) fwd.emplace_back(std::string(c.layer_name()), c.tensor().detach().clone());
    });
    hooks.register_hook(HookConfig().name("f").trigger(HookTrigger::every_n_steps(1)).actions(
        {HookAction::custom_callback("f")}));
    AttachOptions options;
    if (!pattern.empty()) options.patterns({pattern});
    auto session = torchdbg::attach(*net, hooks, options);
    CHECK(session.module_names() == (pattern.empty() ? std::vector<std::string>{"ln", "attn", "attn.out_proj", "fc"}
                                                     : std::vector<std::string>{"attn"}));
    const auto x = torch::randn({4, 2, 8});
    const auto out = std::get<0>(net->attn(x, x, x));
    session.flush();
    REQUIRE(fwd.size() == 1);
    CHECK(fwd[0].first == "attn");
    CHECK(torch::equal(fwd[0].second, out.detach()));
  }
}
