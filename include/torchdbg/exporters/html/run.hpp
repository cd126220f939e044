// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// What the HTML pages draw from, kept as a run goes, bounded for any number of steps: series
// are decimated (every other point dropped, stride doubled, when full) and heatmap columns
// merge pairwise (the worse state wins).

#include <torch/arg.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "torchdbg/exporters/exporter.hpp"
#include "torchdbg/exporters/html/text.hpp"

namespace torchdbg {

struct HtmlOptions {
  TORCH_ARG(std::string, title) = "torchdbg report";
  /// Points of the loss curve kept at most.
  TORCH_ARG(std::size_t, max_points) = 1000;
  /// Sampled steps drawn in the gradient-flow plot at most (the latest step is always drawn).
  TORCH_ARG(std::size_t, gradient_flow_lines) = 10;
  /// Columns of the health heatmap (each covers a power-of-two number of steps).
  TORCH_ARG(std::size_t, heatmap_columns) = 200;
  /// Layers tracked at most.
  TORCH_ARG(std::size_t, max_layers) = 1000;
  /// Activation histograms drawn at most (the first layers in forward order).
  TORCH_ARG(std::size_t, max_histograms) = 64;
  /// Events kept for the timeline and the table (the latest).
  TORCH_ARG(std::size_t, max_events) = 2000;
  /// Rewrite the file on every flush (true) or only on write_summary.
  TORCH_ARG(bool, write_on_flush) = true;
};

namespace detail {

/// A series that keeps at most `cap` points by dropping every other one when full.
template <typename T>
class Decimated {
 public:
  explicit Decimated(std::size_t cap = 1000) : cap_(std::max<std::size_t>(2, cap)) {}
  void add(T v) {
    if (seen_++ % stride_ != 0) return;
    items_.push_back(std::move(v));
    if (items_.size() > cap_) {
      std::vector<T> kept;
      for (std::size_t i = 0; i < items_.size(); i += 2) kept.push_back(std::move(items_[i]));
      items_ = std::move(kept);
      stride_ *= 2;
    }
  }
  [[nodiscard]] const std::vector<T>& items() const noexcept { return items_; }

 private:
  std::size_t cap_;
  std::size_t stride_ = 1;
  uint64_t seen_ = 0;
  std::vector<T> items_;
};

/// A run's steps as the HTML pieces draw them: the loss, the gradient flow, each layer's
/// heatmap row and latest histogram, the latest events. Not thread-safe: its owner locks.
class HtmlRun {
 public:
  struct Row {
    std::string name;
    int64_t order = 0;
    int64_t first_seen = 0;
    std::vector<uint8_t> cells;  // heatmap ranks per column
    std::vector<double> edges;
    std::vector<int64_t> counts;
    int64_t hist_step = -1;
  };
  struct Flow {
    int64_t step = 0;
    std::vector<std::pair<std::string, double>> norms;
  };

  /// Throws torchdbg::Error when `options` cannot be drawn (fewer than 2 heatmap columns).
  explicit HtmlRun(const HtmlOptions& options)
      : options_(options),
        loss_(options_.max_points()),
        flow_(std::max<std::size_t>(1, options_.gradient_flow_lines())) {
    if (options_.heatmap_columns() < 2)
      throw Error("torchdbg: HtmlOptions::heatmap_columns must be >= 2");
  }

  void add(const StepRecord& r) {
    if (!first_step_) first_step_ = r.step;
    last_step_ = r.step;
    ++steps_;
    if (r.loss) loss_.add({r.step, *r.loss});
    // Gradient flow: the step's per-module norm (L2 over its parameters' gradients).
    std::vector<std::pair<std::string, double>> flow;
    std::unordered_map<std::string, std::size_t> at;
    for (const auto& l : r.layers) {
      if (l.forward) {
        Row* row = row_of(l.layer);
        if (row != nullptr && l.stats.distribution && l.stats.distribution->bin_edges.size() >= 2 &&
            l.stats.finite_count > 0) {
          row->edges = l.stats.distribution->bin_edges;
          row->counts = l.stats.distribution->bin_counts;
          row->hist_step = r.step;
        }
        continue;
      }
      row_of(l.layer);
      auto it = at.find(l.layer);
      if (it == at.end()) {
        at[l.layer] = flow.size();
        flow.emplace_back(l.layer, l.stats.l2_norm * l.stats.l2_norm);
      } else {
        flow[it->second].second += l.stats.l2_norm * l.stats.l2_norm;
      }
    }
    if (!flow.empty()) {
      for (auto& f : flow) f.second = std::sqrt(f.second);
      flow_.add({r.step, flow});
      last_flow_ = {r.step, std::move(flow)};
    }
    for (const auto& h : r.health) {
      Row* row = row_of(h.name);
      if (row == nullptr) continue;
      row->order = h.order;
      int rank = 0;
      if (h.has_activation) rank = std::max(rank, state_rank(to_string(h.activation)));
      if (h.has_gradient) rank = std::max(rank, state_rank(to_string(h.gradient)));
      mark(*row, r.step, rank);
    }
    for (const auto& e : r.events) {
      events_.push_back(e);
      ++events_total_;
      if (events_.size() > options_.max_events())
        events_.erase(events_.begin(),
                      events_.begin() + static_cast<std::ptrdiff_t>(events_.size() / 4));
    }
  }

  [[nodiscard]] const HtmlOptions& options() const noexcept { return options_; }
  [[nodiscard]] const std::vector<Row>& rows() const noexcept { return rows_; }
  /// The rows in forward order (the health monitor's), then in order of appearance.
  [[nodiscard]] std::vector<const Row*> ordered_rows() const {
    std::vector<const Row*> out;
    for (const auto& r : rows_) out.push_back(&r);
    std::stable_sort(out.begin(), out.end(),
                     [](const Row* a, const Row* b) { return a->order < b->order; });
    return out;
  }
  [[nodiscard]] const std::vector<std::pair<int64_t, double>>& losses() const noexcept {
    return loss_.items();
  }
  /// The sampled steps' gradient flow, and the latest step's.
  [[nodiscard]] const std::vector<Flow>& flows() const noexcept { return flow_.items(); }
  [[nodiscard]] const Flow& last_flow() const noexcept { return last_flow_; }
  [[nodiscard]] const std::vector<SemanticEvent>& events() const noexcept { return events_; }
  [[nodiscard]] uint64_t events_total() const noexcept { return events_total_; }
  [[nodiscard]] const std::optional<int64_t>& first_step() const noexcept { return first_step_; }
  [[nodiscard]] int64_t last_step() const noexcept { return last_step_; }
  [[nodiscard]] int64_t steps() const noexcept { return steps_; }
  /// Steps per heatmap column.
  [[nodiscard]] uint64_t bucket() const noexcept { return bucket_; }

  /// The first step of heatmap column `c`.
  [[nodiscard]] int64_t column_step(std::size_t c) const {
    const uint64_t k = static_cast<uint64_t>(c);
    if (k != 0 && bucket_ > std::numeric_limits<uint64_t>::max() / k)
      return std::numeric_limits<int64_t>::max();
    return step_at(k * bucket_);
  }
  /// The last step of heatmap column `c`.
  [[nodiscard]] int64_t column_last_step(std::size_t c) const {
    const int64_t next = column_step(c + 1);
    return next == std::numeric_limits<int64_t>::max() ? next : next - 1;
  }

 private:
  Row* row_of(const std::string& name) {
    auto it = index_.find(name);
    if (it != index_.end()) return &rows_[it->second];
    if (rows_.size() >= options_.max_layers()) return nullptr;
    Row r;
    r.name = name;
    r.order = (int64_t{1} << 40) + static_cast<int64_t>(rows_.size());
    r.first_seen = static_cast<int64_t>(rows_.size());
    index_[name] = rows_.size();
    rows_.push_back(std::move(r));
    return &rows_.back();
  }

  /// Steps after the first one, without overflow for any int64 steps (earlier steps: 0).
  uint64_t offset(int64_t step) const {
    return step > *first_step_ ? static_cast<uint64_t>(step) - static_cast<uint64_t>(*first_step_)
                               : 0;
  }
  /// The step `off` steps after the first one, saturated at INT64_MAX.
  int64_t step_at(uint64_t off) const {
    const uint64_t room = static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) -
                          static_cast<uint64_t>(*first_step_);
    if (off >= room) return std::numeric_limits<int64_t>::max();
    return static_cast<int64_t>(static_cast<uint64_t>(*first_step_) + off);
  }

  void mark(Row& row, int64_t step, int rank) {
    const std::size_t cols = options_.heatmap_columns();
    auto column = [&] {
      return static_cast<std::size_t>(std::min<uint64_t>(offset(step) / bucket_, cols));
    };
    while (column() >= cols && bucket_ <= std::numeric_limits<uint64_t>::max() / 2) {
      // merge pairs of columns in every row: the worse state wins
      for (auto& r : rows_) {
        std::vector<uint8_t> merged((r.cells.size() + 1) / 2, 0);
        for (std::size_t i = 0; i < r.cells.size(); ++i)
          merged[i / 2] = std::max(merged[i / 2], r.cells[i]);
        r.cells = std::move(merged);
      }
      bucket_ *= 2;
    }
    const std::size_t c = std::min(column(), cols - 1);
    if (row.cells.size() <= c) row.cells.resize(c + 1, 0);
    row.cells[c] = static_cast<uint8_t>(std::max<int>(row.cells[c], rank));
  }

  HtmlOptions options_;
  std::vector<Row> rows_;
  std::unordered_map<std::string, std::size_t> index_;
  Decimated<std::pair<int64_t, double>> loss_;
  Decimated<Flow> flow_;
  Flow last_flow_;
  std::optional<int64_t> first_step_;
  int64_t last_step_ = 0, steps_ = 0;
  uint64_t bucket_ = 1;
  std::vector<SemanticEvent> events_;
  uint64_t events_total_ = 0;
};

}  // namespace detail
}  // namespace torchdbg
