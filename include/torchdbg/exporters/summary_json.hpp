// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <string>

#include "torchdbg/detail/atomic_file.hpp"
#include "torchdbg/detail/text.hpp"
#include "torchdbg/exporters/exporter.hpp"

namespace torchdbg {

/// A JSON summary of the run (loss range, latest layer health, alerts, diagnosis), rewritten
/// atomically (temp + rename) on each summary or flush: readers see a complete file.
template <typename Mutex = std::mutex>
class BasicSummaryJsonExporter : public BaseExporter<Mutex> {
 public:
  explicit BasicSummaryJsonExporter(std::string path) : path_(std::move(path)) {
    if (path_.empty()) throw Error("torchdbg: SummaryJsonExporter needs a path");
  }
  [[nodiscard]] const std::string& path() const noexcept { return path_; }
  /// The summary as it would be written now.
  [[nodiscard]] nlohmann::json json() const {
    std::lock_guard<Mutex> lock(this->mutex_);
    return json_locked();
  }

 protected:
  void write_step_(const StepRecord& r) override {
    ++steps_;
    last_step_ = r.step;
    if (r.loss && std::isfinite(*r.loss)) {
      if (!first_loss_) first_loss_ = *r.loss;
      last_loss_ = *r.loss;
      min_loss_ = min_loss_ ? std::min(*min_loss_, *r.loss) : *r.loss;
    } else if (r.loss) {
      ++non_finite_losses_;
    }
    for (const auto& e : r.events) {
      if (e.is_alarm()) ++alarms_;
    }
  }
  void write_summary_(const RunSummary& s) override {
    summary_ = s;
    write_file();
  }
  void flush_() override { write_file(); }

 private:
  nlohmann::json json_locked() const {
    auto opt = [](const std::optional<double>& v) {
      return v ? json_number(*v) : nlohmann::json();
    };
    nlohmann::json j = {{"steps", steps_},
                        {"last_step", last_step_},
                        {"loss",
                         {{"first", opt(first_loss_)},
                          {"last", opt(last_loss_)},
                          {"min", opt(min_loss_)},
                          {"non_finite", non_finite_losses_}}},
                        {"alarms", alarms_}};
    if (summary_) {
      nlohmann::json layers = nlohmann::json::array();
      for (const auto& l : summary_->layers) layers.push_back(to_json(l));
      nlohmann::json alerts = nlohmann::json::array();
      for (const auto& a : summary_->alerts) alerts.push_back(to_json(a));
      j["layers"] = layers;
      j["alerts"] = alerts;
      j["alerts_total"] = summary_->alerts_total;
      j["events_total"] = summary_->events_total;
      if (summary_->diagnosis) j["diagnosis"] = summary_->diagnosis->to_json();
    }
    return j;
  }
  void write_file() {
    const std::string text = detail::dump_json(json_locked(), 2) + "\n";
    detail::atomic_write_file(path_, text.data(), text.size());
  }

  std::string path_;
  int64_t steps_ = 0, last_step_ = 0, non_finite_losses_ = 0;
  uint64_t alarms_ = 0;
  std::optional<double> first_loss_, last_loss_, min_loss_;
  std::optional<RunSummary> summary_;
};

using SummaryJsonExporter = BasicSummaryJsonExporter<std::mutex>;

}  // namespace torchdbg
