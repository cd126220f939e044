// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// Pluggable report outputs, in the style of spdlog's sinks: an abstract Exporter, a base that
// takes a lock and calls a protected writer, and concrete exporters (JSONL, CSV, summary JSON,
// HTML) of which several can be attached to one Reporter (report.hpp) at once.

#include <cmath>
#include <cstdint>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "torchdbg/detail/mutex.hpp"
#include "torchdbg/diagnosis.hpp"
#include "torchdbg/health.hpp"
#include "torchdbg/hook_config.hpp"
#include "torchdbg/tensor_stats.hpp"

namespace torchdbg {

/// The statistics of one delivery: a layer's forward output or one parameter's gradient.
struct LayerRecord {
  std::string layer;
  bool forward = true;
  std::string parameter;  ///< for gradients ("weight")
  TensorStats stats;
};

/// One step as the exporters see it.
struct StepRecord {
  int64_t step = 0;
  std::optional<double> loss;
  std::optional<double> gradient_norm;  ///< global L2 over the step's gradient deliveries
  std::vector<LayerRecord> layers;      ///< in delivery order
  std::vector<LayerHealth> health;      ///< empty without a HealthMonitor
  std::vector<SemanticEvent> events;    ///< produced in this step
  LossHealth loss_health = LossHealth::Healthy;
};

/// What is known at the end of a run (or at an intermediate flush).
struct RunSummary {
  int64_t steps = 0;  ///< steps recorded
  int64_t last_step = 0;
  std::optional<Diagnosis> diagnosis;
  std::vector<Alert> alerts;
  uint64_t alerts_total = 0;
  std::vector<LayerHealth> layers;  ///< the latest health of every layer, in forward order
  uint64_t events_total = 0;
};

inline nlohmann::json json_number(double v) {
  return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json();
}

inline nlohmann::json to_json(const Alert& a) {
  return {{"step", a.step},
          {"layer", a.layer},
          {"hook", a.hook_name},
          {"message", a.message},
          {"severity", to_string(a.severity)}};
}

/// The interface every exporter implements. Calls may come from the training thread and from
/// autograd threads; BaseExporter serializes them.
class Exporter {
 public:
  virtual ~Exporter() = default;
  virtual void write_step(const StepRecord& record) = 0;
  virtual void write_summary(const RunSummary& summary) = 0;
  virtual void flush() = 0;
};

/// Takes the lock and calls the protected writers, as spdlog's base_sink. Mutex: std::mutex
/// (thread-safe) or detail::NullMutex (one thread).
template <typename Mutex = std::mutex>
class BaseExporter : public Exporter {
 public:
  void write_step(const StepRecord& record) final {
    std::lock_guard<Mutex> lock(mutex_);
    write_step_(record);
  }
  void write_summary(const RunSummary& summary) final {
    std::lock_guard<Mutex> lock(mutex_);
    write_summary_(summary);
  }
  void flush() final {
    std::lock_guard<Mutex> lock(mutex_);
    flush_();
  }

 protected:
  virtual void write_step_(const StepRecord& record) = 0;
  virtual void write_summary_(const RunSummary& summary) { (void)summary; }
  virtual void flush_() {}
  mutable Mutex mutex_;
};

/// Keeps what it is given (bounded by `capacity` steps), for tests and custom post-processing.
template <typename Mutex = std::mutex>
class BasicRecordingExporter : public BaseExporter<Mutex> {
 public:
  explicit BasicRecordingExporter(std::size_t capacity = 100000) : capacity_(capacity) {}
  [[nodiscard]] std::vector<StepRecord> steps() const {
    std::lock_guard<Mutex> lock(this->mutex_);
    return steps_;
  }
  [[nodiscard]] std::optional<RunSummary> summary() const {
    std::lock_guard<Mutex> lock(this->mutex_);
    return summary_;
  }
  [[nodiscard]] uint64_t flushes() const {
    std::lock_guard<Mutex> lock(this->mutex_);
    return flushes_;
  }

 protected:
  void write_step_(const StepRecord& r) override {
    if (steps_.size() >= capacity_) steps_.erase(steps_.begin());
    steps_.push_back(r);
  }
  void write_summary_(const RunSummary& s) override { summary_ = s; }
  void flush_() override { ++flushes_; }

 private:
  std::size_t capacity_;
  std::vector<StepRecord> steps_;
  std::optional<RunSummary> summary_;
  uint64_t flushes_ = 0;
};

using RecordingExporter = BasicRecordingExporter<std::mutex>;

}  // namespace torchdbg
