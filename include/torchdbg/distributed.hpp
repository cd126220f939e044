// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// Per-layer statistics and the pause flag coordinated across processes through LibTorch's
// own c10d (ProcessGroupGloo on CPU; any group with allreduce/allgather, NCCL included),
// with a c10d Store (FileStore, TCPStore) for the few strings that travel: pause reasons and
// each rank's failure incidents. No networking of torchdbg's own.
//
// Every rank calls `step_boundary(step)` once per step, between steps. It runs one small
// allreduce (3 x world_size floats: who paused, who asked to resume, how many incidents each
// rank has), so a pause raised on any rank is seen by every rank at the same boundary. Every
// `report_interval` steps it also runs one allgather of every layer's packed moments (count,
// mean, M2 and its power-of-two scale, min, max, NaN, Inf per layer and rank), from which every
// rank computes exact global mean/std/min/max for values of any finite magnitude (Chan's
// merge, not an average of means); per-rank statistics stay available. Collectives wait at
// most `timeout_ms`: a rank that died or hangs makes the boundary throw torchdbg::Error
// saying so, instead of blocking forever.
//
// ```cpp
// auto store = c10::make_intrusive<c10d::FileStore>(path, world);
// auto group = torchdbg::make_gloo_group(store, rank, world);
// torchdbg::DistributedMonitor dist(group, store, hooks, &health);
// for (...) { ...; auto b = dist.step_boundary(step); if (b.paused) { ... } }
// ```

#if defined(__has_include)
#if !__has_include(<gloo/algorithm.h>) || !__has_include(<torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>)
#error "torchdbg/distributed.hpp needs LibTorch's c10d headers and Gloo's (Debian: libgloo-dev); the rest of torchdbg (torchdbg/torchdbg.hpp) does not"
#endif
#endif
#if !defined(USE_C10D_GLOO)
#error "torchdbg/distributed.hpp needs USE_C10D_GLOO defined, as LibTorch's CMake targets (torch) do"
#endif

#include <ATen/ATen.h>
#include <c10/util/intrusive_ptr.h>
#include <torch/arg.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <unordered_map>
#include <utility>
#include <vector>

#include "torchdbg/detail/stats_kernel.hpp"
#include "torchdbg/detail/text.hpp"
#include "torchdbg/diagnosis.hpp"
#include "torchdbg/error.hpp"
#include "torchdbg/health.hpp"
#include "torchdbg/hook_manager.hpp"
#include "torchdbg/tensor_stats.hpp"

namespace torchdbg {

struct DistributedOptions {
  /// Steps between global statistics reductions (step % report_interval == 0).
  TORCH_ARG(int64_t, report_interval) = 10;
  /// How long a collective may take before the boundary fails.
  TORCH_ARG(int64_t, timeout_ms) = 30000;
  /// Layer statistics exchanged at most (the packed vector has a fixed size).
  TORCH_ARG(std::size_t, max_layers) = 512;
  /// Prefix of this monitor's keys in the store.
  TORCH_ARG(std::string, key_prefix) = "torchdbg";
};

/// Moments of one layer's values: on one rank or merged over all. Exact for finite values of
/// any magnitude: `m2`, the sum of squared deviations from `mean`, is held in units of
/// 4^`scale` (detail::Moments's scale: 0 for magnitudes from about 2^-400 to 2^400, beyond
/// which sums of squares could leave a double's range); `std()` has the spread.
struct LayerMoments {
  int64_t finite = 0, nan = 0, inf = 0;
  double mean = detail::kNaN, m2 = 0.0, min = detail::kNaN, max = detail::kNaN;
  int scale = 0;

  /// The moments of the values `s` summarises (its counts, mean, std and extrema).
  [[nodiscard]] static LayerMoments of(const TensorStats& s) {
    LayerMoments m;
    m.finite = s.finite_count;
    m.nan = s.nan_count;
    m.inf = s.inf_count;
    if (s.finite_count > 0) {
      m.mean = s.mean;
      m.min = s.min;
      m.max = s.max;
      m.scale = detail::Moments::scale_for(std::max(std::fabs(s.min), std::fabs(s.max)));
      const double sd = std::ldexp(s.std, -m.scale);
      m.m2 = sd * sd * static_cast<double>(s.finite_count);
    }
    return m;
  }
  /// Population standard deviation of the finite values; NaN when there are none.
  [[nodiscard]] double std() const noexcept { return finite_moments().std_dev(); }
  /// Adds the values `o` summarises (Chan's merge, as detail::Moments::merge).
  void merge(const LayerMoments& o) {
    detail::Moments a = finite_moments();
    a.merge(o.finite_moments());
    if (a.finite > 0) {
      mean = a.mean;
      m2 = a.m2;
      scale = a.scale;
      min = a.min;
      max = a.max;
    }
    finite = a.finite;
    nan += o.nan;
    inf += o.inf;
  }

 private:
  [[nodiscard]] detail::Moments finite_moments() const noexcept {
    detail::Moments m;
    if (finite > 0) {
      m.count = m.finite = finite;
      m.mean = mean;
      m.m2 = m2;
      m.scale = scale;
      m.min = min;
      m.max = max;
      m.abs_max = std::max(std::fabs(min), std::fabs(max));
    }
    return m;
  }
};

/// A layer's statistics over every rank at one reporting step, and each rank's own.
struct GlobalLayerStats {
  std::string name;  ///< "fc1" (forward output) or "fc1.weight/grad"
  int64_t step = 0;
  LayerMoments global;
  std::vector<std::optional<LayerMoments>> per_rank;  ///< index: rank
};

/// What a step boundary decided, the same on every rank.
struct BoundaryResult {
  int64_t step = 0;
  bool paused = false;               ///< training is paused after this boundary
  bool newly_paused = false;         ///< the pause began at this boundary
  bool resumed = false;              ///< a resume was agreed at this boundary
  std::vector<int> pausers;          ///< ranks that raised the pause at this boundary
  std::vector<std::string> reasons;  ///< their reasons, in `pausers` order
  bool reported = false;             ///< global statistics were exchanged at this boundary
};

/// A Gloo process group over `store` with a `timeout` for every collective.
inline c10::intrusive_ptr<c10d::ProcessGroupGloo> make_gloo_group(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
    std::chrono::milliseconds timeout = std::chrono::seconds(30),
    const std::string& hostname = "127.0.0.1") {
  if (size < 1 || rank < 0 || rank >= size)
    throw Error("torchdbg: make_gloo_group: rank " + std::to_string(rank) +
                " out of range for world size " + std::to_string(size));
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(hostname));
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
}

namespace detail {

inline uint64_t fnv1a(std::string_view s) noexcept {
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h;
}

inline std::vector<uint8_t> to_bytes(const std::string& s) {
  return std::vector<uint8_t>(s.begin(), s.end());
}
inline std::string from_bytes(const std::vector<uint8_t>& b) {
  return std::string(b.begin(), b.end());
}

inline FailureKind failure_kind_from(std::string_view s) {
  for (int k = 0; k <= static_cast<int>(FailureKind::LossPlateau); ++k)
    if (s == to_string(static_cast<FailureKind>(k))) return static_cast<FailureKind>(k);
  throw Error("torchdbg: unknown failure kind '" + std::string(s) + "'");
}

inline Phase phase_from(std::string_view s) {
  if (s == "forward") return Phase::Forward;
  if (s == "loss") return Phase::Loss;
  if (s == "backward") return Phase::Backward;
  throw Error("torchdbg: unknown phase '" + std::string(s) + "'");
}

/// Inverse of to_json(Incident) (the fields diagnosis needs).
inline Incident incident_from_json(const nlohmann::json& j) {
  Incident i;
  i.kind = failure_kind_from(j.at("kind").get<std::string>());
  i.layer = j.at("layer").get<std::string>();
  i.module = j.at("module").get<std::string>();
  i.step = j.at("step").get<int64_t>();
  i.last_step = j.at("last_step").get<int64_t>();
  i.phase = phase_from(j.at("phase").get<std::string>());
  i.order = j.at("order").get<int64_t>();
  i.persisted = j.at("persisted").get<int64_t>();
  i.confidence = j.at("confidence").get<double>();
  i.value = j.at("value").is_number() ? j.at("value").get<double>() : kNaN;
  i.threshold = j.at("threshold").is_number() ? j.at("threshold").get<double>() : kNaN;
  i.details = j.value("details", nlohmann::json::object());
  i.rank = j.value("rank", -1);
  return i;
}

// hash hi, hash lo, finite, nan, inf, mean, m2, min, max, scale (LayerMoments's m2 in its units)
constexpr int64_t kPackedLayer = 10;

}  // namespace detail

/// Coordinates statistics, pauses and diagnosis of one training process with the others.
/// `Group` is a c10d process group (ProcessGroupGloo, ProcessGroupNCCL, a 2.x Backend).
///
/// Thread safety: `step_boundary` is a collective and belongs to the training loop's thread
/// (every rank calls it once per step); the queries may be called from any thread. The
/// manager's deliveries (autograd threads included) are recorded under an internal lock.
template <typename Group, typename M = std::mutex>
class BasicDistributedMonitor {
 public:
  BasicDistributedMonitor(c10::intrusive_ptr<Group> group, c10::intrusive_ptr<c10d::Store> store,
                          BasicHookManager<M>& hooks, HealthMonitor* health = nullptr,
                          DistributedOptions options = {})
      : group_(std::move(group)),
        store_(std::move(store)),
        hooks_(&hooks),
        health_(health),
        options_(std::move(options)) {
    if (!group_) throw Error("torchdbg: DistributedMonitor needs a process group");
    if (!store_) throw Error("torchdbg: DistributedMonitor needs a store");
    detail::require_at_least<int64_t>(options_.report_interval(), 1,
                                      "DistributedOptions::report_interval");
    detail::require_at_least<int64_t>(options_.timeout_ms(), 1, "DistributedOptions::timeout_ms");
    rank_ = group_->getRank();
    world_ = group_->getSize();
    callback_ = options_.key_prefix() + ".distributed." +
                std::to_string(reinterpret_cast<std::uintptr_t>(this));
    hooks_->register_callback(callback_, [this](const HookContext& ctx) { on_hook(ctx); }, CallbackStats::Moments);
    hook_ =
        hooks_->register_hook(HookConfig()
                                  .name("torchdbg.distributed")
                                  .trigger(HookTrigger::every_n_steps(options_.report_interval()))
                                  .actions({HookAction::custom_callback(callback_)}));
  }
  BasicDistributedMonitor(const BasicDistributedMonitor&) = delete;
  BasicDistributedMonitor& operator=(const BasicDistributedMonitor&) = delete;
  ~BasicDistributedMonitor() {
    try {
      (void)hooks_->remove_hook(hook_);
      (void)hooks_->remove_callback(callback_);
    } catch (...) {
    }
  }

  [[nodiscard]] int rank() const noexcept { return rank_; }
  [[nodiscard]] int world_size() const noexcept { return world_; }

  /// Asks every rank to resume; takes effect at the next boundary on all of them.
  void request_resume() {
    std::lock_guard<std::mutex> lock(mutex_);
    resume_requested_ = true;
  }
  [[nodiscard]] bool paused() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return paused_;
  }

  /// The collective between steps (see the header comment). Throws torchdbg::Error when a
  /// collective fails or exceeds the timeout (a rank died or hangs).
  BoundaryResult step_boundary(int64_t step) {
    BoundaryResult out;
    out.step = step;
    const int W = world_;
    // 1. What this rank brings: its own pause (not one it got from the others), resume
    //    request and incident count.
    bool local_pause = false;
    std::string reason;
    bool resume = false;
    int64_t incidents = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!paused_ && hooks_->is_paused()) {
        local_pause = true;
        const auto info = hooks_->pause_info();
        reason = info ? info->reason : "paused";
        if (info && !info->layer.empty()) reason += " (layer " + info->layer + ")";
      }
      resume = resume_requested_ && paused_;
      resume_requested_ = false;
    }
    if (health_ != nullptr) {
      const auto inc = health_->incidents();
      incidents = static_cast<int64_t>(inc.size());
      if (incidents != published_incidents_) {
        nlohmann::json arr = nlohmann::json::array();
        for (auto i : inc) {
          i.rank = rank_;
          arr.push_back(to_json(i));
        }
        store_->set(key("incidents/" + std::to_string(rank_)), detail::to_bytes(detail::dump_json(arr)));
        published_incidents_ = incidents;
      }
    }
    if (local_pause)
      store_->set(key("pause/" + std::to_string(step) + "/" + std::to_string(rank_)),
                  detail::to_bytes(reason));
    at::Tensor flags = at::zeros({3 * W}, at::kDouble);
    auto f = flags.accessor<double, 1>();
    f[rank_] = local_pause ? 1.0 : 0.0;
    f[W + rank_] = resume ? 1.0 : 0.0;
    f[2 * W + rank_] = static_cast<double>(incidents);
    std::vector<at::Tensor> bufs{flags};
    run("step-boundary", step, [&] { return group_->allreduce(bufs); });
    const at::Tensor got = bufs[0].contiguous();
    const double* g = got.data_ptr<double>();
    // 2. The decision, identical on every rank.
    bool any_resume = false;
    for (int r = 0; r < W; ++r) {
      if (g[r] > 0.5) out.pausers.push_back(r);
      any_resume = any_resume || g[W + r] > 0.5;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (int r = 0; r < W; ++r) incident_counts_[r] = static_cast<int64_t>(g[2 * W + r]);
    }
    for (int r : out.pausers) {
      std::string why = r == rank_
                            ? reason
                            : detail::from_bytes(store_->get(
                                  key("pause/" + std::to_string(step) + "/" + std::to_string(r))));
      out.reasons.push_back(why);
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!out.pausers.empty() && !paused_) {
        paused_ = true;
        out.newly_paused = true;
        pause_step_ = step;
        pausers_ = out.pausers;
        reasons_ = out.reasons;
      } else if (any_resume && paused_ && out.pausers.empty()) {
        paused_ = false;
        out.resumed = true;
      }
      out.paused = paused_;
    }
    if (out.newly_paused) {
      std::string all;
      for (std::size_t i = 0; i < out.pausers.size(); ++i)
        all += (i ? "; " : "") + std::string("rank ") + std::to_string(out.pausers[i]) + ": " +
               out.reasons[i];
      if (!hooks_->is_paused()) hooks_->pause_training(all);
      record_event(step, "running", "paused", all, out.pausers.front());
    }
    if (out.resumed) {
      hooks_->resume_training();
      record_event(step, "paused", "running", "resume agreed at the step boundary", -1);
    }
    // 3. Global statistics every report_interval steps.
    if (step % options_.report_interval() == 0) {
      exchange_stats(step);
      out.reported = true;
    }
    return out;
  }

  /// Global statistics of the last reporting step, by layer name (sorted).
  [[nodiscard]] std::vector<GlobalLayerStats> global_stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<GlobalLayerStats> out;
    for (const auto& kv : global_) out.push_back(kv.second);
    return out;
  }
  [[nodiscard]] std::optional<GlobalLayerStats> global_layer(const std::string& name) const {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = global_.find(name);
    if (it == global_.end()) return std::nullopt;
    return it->second;
  }
  /// The step at which the pause began, its ranks and reasons.
  [[nodiscard]] std::optional<int64_t> pause_step() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return pause_step_;
  }
  [[nodiscard]] std::vector<int> pausers() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return pausers_;
  }
  /// Layer names this rank can put on other ranks' statistics (those of the last exchange):
  /// at most world_size x max_layers.
  [[nodiscard]] std::size_t known_name_count() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return known_names_.size();
  }
  /// Pause/resume events with the rank that caused them.
  [[nodiscard]] std::vector<SemanticEvent> events() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return events_;
  }

  /// The diagnosis over every rank's incidents (as published at the last boundary); each
  /// hypothesis and link carries the rank where it happened. Reads the store; no collective.
  [[nodiscard]] Diagnosis global_diagnosis() const {
    HealthReport merged;
    std::map<int, int64_t> counts;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      counts = incident_counts_;
    }
    for (const auto& [r, n] : counts) {
      if (n <= 0) continue;
      const auto text = detail::from_bytes(store_->get(key("incidents/" + std::to_string(r))));
      for (const auto& j : nlohmann::json::parse(text)) {
        Incident i = detail::incident_from_json(j);
        i.rank = r;
        merged.incidents.push_back(std::move(i));
      }
    }
    if (health_ != nullptr) {
      const auto rep = health_->report();
      merged.step = rep.step;
      merged.layers = rep.layers;
    }
    merged.rank = rank_;
    return diagnose(merged);
  }

 private:
  std::string key(const std::string& k) const { return options_.key_prefix() + "/" + k; }

  template <typename F>
  void run(const char* what, int64_t step, F&& start) {
    try {
      auto work = start();
      if (!work->wait(std::chrono::milliseconds(options_.timeout_ms())))
        throw Error("wait returned false");
    } catch (const std::exception& e) {
      throw Error(
          "torchdbg distributed: the " + std::string(what) + " collective at step " +
          std::to_string(step) + " failed on rank " + std::to_string(rank_) + " of " +
          std::to_string(world_) + " (timeout " + std::to_string(options_.timeout_ms()) +
          " ms): a rank died or hangs, so the ranks can no longer proceed in lockstep. Cause: " +
          e.what());
    }
  }

  void record_event(int64_t step, const std::string& from, const std::string& to,
                    const std::string& why, int rank) {
    SemanticEvent e;
    e.id = events_.size() + 1;
    e.type = EventType::TrainingPaused;
    e.layer = "distributed";
    e.step = step;
    e.from = from;
    e.to = to;
    e.confidence = 1.0;
    e.metadata = {{"reason", why}};
    e.rank = rank;
    std::lock_guard<std::mutex> lock(mutex_);
    if (events_.size() < 10000) events_.push_back(std::move(e));
  }

  void on_hook(const HookContext& ctx) {
    std::string name(ctx.layer_name());
    if (!ctx.is_forward()) {
      const auto p = ctx.metadata_value("parameter");
      name += "." + std::string(p ? *p : "?") + "/grad";
    }
    const LayerMoments m = LayerMoments::of(ctx.moment_stats());
    std::lock_guard<std::mutex> lock(mutex_);
    if (ctx.step() != local_step_) {
      local_.clear();
      local_step_ = ctx.step();
    }
    auto it = local_.find(name);
    if (it == local_.end()) {
      if (local_.size() >= options_.max_layers()) return;
      local_.emplace(name, m);
    } else {
      it->second.merge(m);
    }
  }

  void exchange_stats(int64_t step) {
    const int64_t L = static_cast<int64_t>(options_.max_layers());
    at::Tensor mine = at::full({L * detail::kPackedLayer}, detail::kNaN, at::kDouble);
    std::unordered_map<uint64_t, std::string> names;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      double* p = mine.data_ptr<double>();
      int64_t k = 0;
      if (local_step_ == step) {
        for (const auto& [name, m] : local_) {
          const uint64_t h = detail::fnv1a(name);
          names[h] = name;
          double* q = p + k * detail::kPackedLayer;
          q[0] = static_cast<double>(h >> 32);
          q[1] = static_cast<double>(h & 0xffffffffULL);
          q[2] = static_cast<double>(m.finite);
          q[3] = static_cast<double>(m.nan);
          q[4] = static_cast<double>(m.inf);
          q[5] = m.mean;
          q[6] = m.m2;
          q[7] = m.min;
          q[8] = m.max;
          q[9] = static_cast<double>(m.scale);
          ++k;
        }
      }
      for (const auto& [h, n] : known_names_) names.emplace(h, n);
    }
    std::unordered_map<uint64_t, std::string> seen;  // the names this exchange resolved
    std::vector<at::Tensor> in{mine};
    std::vector<std::vector<at::Tensor>> outs(1);
    for (int r = 0; r < world_; ++r) outs[0].push_back(at::empty_like(mine));
    run("statistics", step, [&] { return group_->allgather(outs, in); });
    std::map<std::string, GlobalLayerStats> merged;
    for (int r = 0; r < world_; ++r) {
      const at::Tensor t = outs[0][static_cast<std::size_t>(r)].contiguous();
      const double* p = t.data_ptr<double>();
      for (int64_t k = 0; k < L; ++k) {
        const double* q = p + k * detail::kPackedLayer;
        if (std::isnan(q[0])) break;
        const uint64_t h = (static_cast<uint64_t>(q[0]) << 32) | static_cast<uint64_t>(q[1]);
        auto nit = names.find(h);
        const std::string name = nit != names.end() ? nit->second : "layer#" + std::to_string(h);
        if (nit != names.end()) seen.emplace(h, name);
        LayerMoments m;
        m.finite = static_cast<int64_t>(q[2]);
        m.nan = static_cast<int64_t>(q[3]);
        m.inf = static_cast<int64_t>(q[4]);
        m.mean = q[5];
        m.m2 = q[6];
        m.min = q[7];
        m.max = q[8];
        m.scale = static_cast<int>(q[9]);
        GlobalLayerStats& g = merged[name];
        g.name = name;
        g.step = step;
        if (g.per_rank.empty()) g.per_rank.resize(static_cast<std::size_t>(world_));
        g.per_rank[static_cast<std::size_t>(r)] = m;
        g.global.merge(m);
      }
    }
    // Keep the names of this exchange only: the table stays within world_size x max_layers
    // however many layer names come and go over a run.
    std::lock_guard<std::mutex> lock(mutex_);
    known_names_ = std::move(seen);
    global_ = std::move(merged);
  }

  c10::intrusive_ptr<Group> group_;
  c10::intrusive_ptr<c10d::Store> store_;
  BasicHookManager<M>* hooks_;
  HealthMonitor* health_;
  DistributedOptions options_;
  int rank_ = 0, world_ = 1;
  std::string callback_;
  HookId hook_;

  mutable std::mutex mutex_;
  bool paused_ = false, resume_requested_ = false;
  std::optional<int64_t> pause_step_;
  std::vector<int> pausers_;
  std::vector<std::string> reasons_;
  std::vector<SemanticEvent> events_;
  std::map<int, int64_t> incident_counts_;
  int64_t published_incidents_ = 0;
  std::map<std::string, LayerMoments> local_;
  int64_t local_step_ = -1;
  std::unordered_map<uint64_t, std::string> known_names_;
  std::map<std::string, GlobalLayerStats> global_;
};

using DistributedMonitor = BasicDistributedMonitor<c10d::ProcessGroupGloo, std::mutex>;

}  // namespace torchdbg
