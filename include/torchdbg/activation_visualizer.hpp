// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <torch/arg.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "torchdbg/detail/bounded_map.hpp"
#include "torchdbg/detail/compiled.hpp"
#include "torchdbg/detail/mutex.hpp"
#include "torchdbg/detail/ring_buffer.hpp"
#include "torchdbg/error.hpp"
#include "torchdbg/tensor_stats.hpp"

namespace torchdbg {

/// ActivationVisualizer settings.
struct VisualizerOptions {
  /// ActivationStats kept per layer (ring).
  TORCH_ARG(std::size_t, history_capacity) = 100;
  /// Layers tracked at once; past it the layer seen first is evicted.
  TORCH_ARG(std::size_t, max_layers) = 1024;
  TORCH_ARG(int64_t, histogram_bins) = 50;
  /// Heatmaps are block-averaged down to at most this many rows and columns.
  TORCH_ARG(int64_t, heatmap_max_size) = 64;
  /// Build a heatmap on each record (reads the tensor once more).
  TORCH_ARG(bool, heatmap) = true;
};

/// One layer's activation statistics at one step (finite values; see TensorStats).
struct ActivationStats {
  int64_t step = 0;
  int64_t numel = 0;
  double mean = detail::kNaN, std = detail::kNaN, min = detail::kNaN, max = detail::kNaN;
  double median = detail::kNaN, q25 = detail::kNaN, q75 = detail::kNaN;
  int64_t zeros = 0, negatives = 0, positives = 0;
  int64_t outliers = 0;  ///< |x - mean| > 3 std
  int64_t non_finite = 0;
  double sparsity = detail::kNaN;
};

struct Histogram {
  std::vector<double> edges;    ///< bins + 1, ascending
  std::vector<int64_t> counts;  ///< bins
};

/// A rows x cols matrix (row-major) of mean activation values.
struct Heatmap {
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<double> values;
  [[nodiscard]] double at(int64_t r, int64_t c) const {
    return values[static_cast<std::size_t>(r * cols + c)];
  }
};

/// make_heatmap of `src` (>= 2-D) whose collapsed form `x` overlaps in memory (windows from
/// unfold, as_strided): each block is copied and reduced alone, so memory follows the block.
inline Heatmap overlapping_heatmap(const at::Tensor& src, const at::Tensor& x, int64_t max_size) {
  const int64_t rows = src.size(-2), cols = src.size(-1);
  Heatmap h;
  h.rows = std::min(rows, max_size);
  h.cols = std::min(cols, max_size);
  h.values.assign(static_cast<std::size_t>(h.rows * h.cols), detail::kNaN);
  std::vector<int64_t> lead;
  for (int64_t d = 0; d < x.dim() - 2; ++d) lead.push_back(d);
  const bool one_row = x.size(-2) == 1, one_col = x.size(-1) == 1;  // collapsed: equal rows/columns
  for (int64_t r = 0; r < h.rows; ++r) {
    const int64_t r0 = one_row ? 0 : r * rows / h.rows, r1 = one_row ? 1 : (r + 1) * rows / h.rows;
    for (int64_t c = 0; c < h.cols; ++c) {
      const int64_t c0 = one_col ? 0 : c * cols / h.cols,
                    c1 = one_col ? 1 : (c + 1) * cols / h.cols;
      at::Tensor cells =
          x.narrow(-2, r0, r1 - r0).narrow(-1, c0, c1 - c0).to(at::kCPU, at::kDouble);
      if (!lead.empty()) cells = cells.mean(lead);  // NaN propagates, as in make_heatmap
      const at::Tensor ok = cells.isnan().logical_not();
      const double n = ok.sum().item<double>();
      if (n > 0)
        h.values[static_cast<std::size_t>(r * h.cols + c)] =
            at::where(ok, cells, 0.0).sum().item<double>() / n;
    }
  }
  return h;
}

/// Heatmap of `t`: a >= 2-D tensor is averaged over its leading dimensions onto its last
/// two; a 1-D tensor is laid row by row into a near-square matrix (cells past the end are
/// NaN); a 0-d tensor is 1 x 1. Then block means (NaN cells ignored) reduce it to at most
/// `max_size` x `max_size`. An expanded dimension is read once (its copies are equal), and the
/// leading dimensions are reduced in place, so memory follows the tensor's storage.
inline Heatmap make_heatmap(const at::Tensor& t, int64_t max_size) {
  if (max_size < 1)
    throw Error(fmt::format("torchdbg: heatmap_max_size must be >= 1, got {}", max_size));
  if (t.is_sparse()) throw Error("torchdbg: no heatmap of a sparse tensor; pass t.to_dense()");
  const at::Tensor src = t.detach();
  const detail::Repeated rep = detail::collapse_repeats(src);
  at::Tensor x = rep.base;
  if (src.dim() >= 2 && detail::read_in_pieces(x)) return overlapping_heatmap(src, x, max_size);
  int64_t rows = 1, cols = 1;
  // The values, and how a cell (i, j) of the full matrix (or element k of a 1-D tensor) reads
  // them: a collapsed dimension has one row or column that stands for all.
  std::vector<double> vals;
  int64_t vrows = 1, vcols = 1;
  const auto read = [&](const at::Tensor& m) {
    const at::Tensor c = m.to(at::kCPU, at::kDouble).contiguous();
    vals.assign(c.data_ptr<double>(), c.data_ptr<double>() + c.numel());
  };
  if (src.dim() >= 2) {
    rows = src.size(-2);
    cols = src.size(-1);
    if (x.dim() > 2) {  // the mean over the leading dimensions, reduced where the data lies
      std::vector<int64_t> lead;
      for (int64_t d = 0; d < x.dim() - 2; ++d) lead.push_back(d);
      x = x.numel() == 0
              ? at::full({x.size(-2), x.size(-1)}, detail::kNaN, x.options().dtype(at::kDouble))
              : x.mean(lead, /*keepdim=*/false, at::kDouble);
    }
    vrows = x.size(-2);
    vcols = x.size(-1);
    read(x);
  } else {
    const int64_t n = src.numel();
    read(x.reshape({-1}));
    vcols = static_cast<int64_t>(vals.size());
    if (n > 0) {
      rows = static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(n))));
      cols = (n + rows - 1) / rows;
      std::swap(rows, cols);  // rows <= cols
    } else {
      rows = cols = 0;
    }
  }
  const int64_t n1 = src.dim() >= 2 ? 0 : src.numel();
  const auto at = [&](int64_t i, int64_t j) -> double {
    if (src.dim() >= 2) {
      return vals[static_cast<std::size_t>((vrows == 1 ? 0 : i) * vcols + (vcols == 1 ? 0 : j))];
    }
    const int64_t k = i * cols + j;
    if (k >= n1) return detail::kNaN;
    return vals[static_cast<std::size_t>(vcols == 1 ? 0 : k)];
  };
  Heatmap h;
  h.rows = std::min(rows, max_size);
  h.cols = std::min(cols, max_size);
  h.values.assign(static_cast<std::size_t>(h.rows * h.cols), detail::kNaN);
  // Equal rows (columns) of a collapsed dimension give a block the mean of one of them.
  const bool one_row = src.dim() >= 2 && vrows == 1, one_col = src.dim() >= 2 && vcols == 1;
  const bool one_value = src.dim() < 2 && vcols == 1;  // an expanded 1-D tensor or a 0-d one
  for (int64_t r = 0; r < h.rows; ++r) {
    const int64_t r0 = r * rows / h.rows, r1 = (r + 1) * rows / h.rows;
    for (int64_t c = 0; c < h.cols; ++c) {
      const int64_t c0 = c * cols / h.cols, c1 = (c + 1) * cols / h.cols;
      if (one_value) {  // the block's first cell is its smallest index: past the end, all are
        if (r0 * cols + c0 < n1 && !std::isnan(vals[0]))
          h.values[static_cast<std::size_t>(r * h.cols + c)] = vals[0];
        continue;
      }
      double sum = 0;
      int64_t n = 0;
      for (int64_t i = r0; i < (one_row ? std::min(r1, r0 + 1) : r1); ++i)
        for (int64_t j = c0; j < (one_col ? std::min(c1, c0 + 1) : c1); ++j) {
          const double v = at(i, j);
          if (!std::isnan(v)) {
            sum += v;
            ++n;
          }
        }
      if (n > 0) h.values[static_cast<std::size_t>(r * h.cols + c)] = sum / static_cast<double>(n);
    }
  }
  return h;
}

/// Per-layer activation statistics with bounded history, histograms, heatmaps, an ASCII
/// plot, JSON export (nlohmann_json) and a text table (fmt).
///
/// Thread safety: `ActivationVisualizer` (std::mutex) may be used from any thread;
/// `ActivationVisualizerSt` (NullMutex) from one thread only.
template <typename Mutex>
class BasicActivationVisualizer {
 public:
  explicit BasicActivationVisualizer(VisualizerOptions options = {});

  [[nodiscard]] const VisualizerOptions& options() const noexcept { return options_; }

  /// Computes and records the activations `t` of `layer` at `step`.
  void record(std::string_view layer, const at::Tensor& t, int64_t step = 0);

  /// Records statistics computed elsewhere; `stats` must carry the distribution. `t` is read
  /// again only for the heatmap.
  void record(std::string_view layer, int64_t step, const TensorStats& stats, const at::Tensor& t);

  [[nodiscard]] std::vector<std::string> layers() const;
  [[nodiscard]] std::optional<ActivationStats> latest(std::string_view layer) const;
  [[nodiscard]] std::vector<ActivationStats> history(std::string_view layer) const;
  [[nodiscard]] std::optional<Histogram> histogram(std::string_view layer) const;
  [[nodiscard]] std::optional<Heatmap> heatmap(std::string_view layer) const;

  /// The latest histogram of `layer` as text, one line per bin with a bar of '#' scaled to
  /// `width` characters. Throws torchdbg::Error for an unknown layer.
  [[nodiscard]] std::string ascii_histogram(std::string_view layer, int width = 40) const;

  /// Everything held, as JSON: {"layers": {name: {"latest", "history", "histogram", "heatmap"}}}.
  [[nodiscard]] nlohmann::json to_json() const;

  /// A text table (fmt) of each layer's latest statistics.
  [[nodiscard]] std::string summary_table() const;

  void clear();

 private:
  struct Entry {
    explicit Entry(std::size_t cap) : history(cap) {}
    detail::RingBuffer<ActivationStats> history;
    std::optional<Histogram> histogram;
    std::optional<Heatmap> heatmap;
  };

  static nlohmann::json stats_json(const ActivationStats& a);

  const Entry* find(std::string_view layer) const { return entries_.find(layer); }

  Entry& entry(std::string_view layer);

  VisualizerOptions options_;
  mutable Mutex mutex_;
  detail::BoundedMap<Entry> entries_;
};

#if TORCHDBG_DEFINITIONS

template <typename Mutex>
BasicActivationVisualizer<Mutex>::BasicActivationVisualizer(VisualizerOptions options)
    : options_(std::move(options)), entries_(options_.max_layers()) {
  if (options_.history_capacity() == 0)
    throw Error("torchdbg: history_capacity must be >= 1, got 0");
  if (options_.max_layers() == 0) throw Error("torchdbg: max_layers must be >= 1, got 0");
  if (options_.histogram_bins() < 1) {
    throw Error(
        fmt::format("torchdbg: histogram_bins must be >= 1, got {}", options_.histogram_bins()));
  }
  if (options_.heatmap_max_size() < 1) {
    throw Error(fmt::format("torchdbg: heatmap_max_size must be >= 1, got {}",
                            options_.heatmap_max_size()));
  }
}

template <typename Mutex>
void BasicActivationVisualizer<Mutex>::record(std::string_view layer, const at::Tensor& t,
                                              int64_t step) {
  record(
      layer, step,
      compute_stats(t, StatsOptions().distribution(true).histogram_bins(options_.histogram_bins())),
      t);
}

template <typename Mutex>
void BasicActivationVisualizer<Mutex>::record(std::string_view layer, int64_t step,
                                              const TensorStats& stats, const at::Tensor& t) {
  if (!stats.distribution) {
    throw Error("torchdbg: ActivationVisualizer::record needs statistics with a distribution");
  }
  const Distribution& d = *stats.distribution;
  ActivationStats a;
  a.step = step;
  a.numel = stats.numel;
  a.mean = stats.mean;
  a.std = stats.std;
  a.min = stats.min;
  a.max = stats.max;
  a.median = d.p50;
  a.q25 = d.p25;
  a.q75 = d.p75;
  a.zeros = stats.zero_count;
  a.negatives = stats.negative_count;
  a.positives = stats.positive_count;
  a.outliers = d.sigma3_outliers;
  a.non_finite = stats.nan_count + stats.inf_count;
  a.sparsity = stats.sparsity;
  std::optional<Heatmap> heat;
  if (options_.heatmap() && t.defined()) heat = make_heatmap(t, options_.heatmap_max_size());
  std::lock_guard<Mutex> lock(mutex_);
  Entry& e = entry(layer);
  e.history.push(a);
  e.histogram = Histogram{d.bin_edges, d.bin_counts};
  if (heat) e.heatmap = std::move(*heat);
}

template <typename Mutex>
auto BasicActivationVisualizer<Mutex>::layers() const -> std::vector<std::string> {
  std::lock_guard<Mutex> lock(mutex_);
  return entries_.names();
}

template <typename Mutex>
auto BasicActivationVisualizer<Mutex>::latest(std::string_view layer) const
    -> std::optional<ActivationStats> {
  std::lock_guard<Mutex> lock(mutex_);
  const Entry* e = find(layer);
  if (e == nullptr || e->history.empty()) return std::nullopt;
  return e->history.back();
}

template <typename Mutex>
auto BasicActivationVisualizer<Mutex>::history(std::string_view layer) const
    -> std::vector<ActivationStats> {
  std::lock_guard<Mutex> lock(mutex_);
  const Entry* e = find(layer);
  return e ? e->history.to_vector() : std::vector<ActivationStats>{};
}

template <typename Mutex>
auto BasicActivationVisualizer<Mutex>::histogram(std::string_view layer) const
    -> std::optional<Histogram> {
  std::lock_guard<Mutex> lock(mutex_);
  const Entry* e = find(layer);
  if (e == nullptr) return std::nullopt;
  return e->histogram;
}

template <typename Mutex>
auto BasicActivationVisualizer<Mutex>::heatmap(std::string_view layer) const
    -> std::optional<Heatmap> {
  std::lock_guard<Mutex> lock(mutex_);
  const Entry* e = find(layer);
  if (e == nullptr) return std::nullopt;
  return e->heatmap;
}

template <typename Mutex>
std::string BasicActivationVisualizer<Mutex>::ascii_histogram(std::string_view layer,
                                                              int width) const {
  auto h = histogram(layer);
  if (!h) throw Error("torchdbg: no activations recorded for layer '" + std::string(layer) + "'");
  const int64_t peak =
      h->counts.empty() ? 0 : *std::max_element(h->counts.begin(), h->counts.end());
  std::string out = fmt::format("{} (peak {})\n", layer, peak);
  for (std::size_t i = 0; i < h->counts.size(); ++i) {
    const int bar = peak > 0 ? static_cast<int>(std::lround(static_cast<double>(h->counts[i]) *
                                                            width / static_cast<double>(peak)))
                             : 0;
    out += fmt::format("[{:>10.4g}, {:>10.4g}) |{:<{}}| {}\n", h->edges[i], h->edges[i + 1],
                       std::string(static_cast<std::size_t>(bar), '#'), width, h->counts[i]);
  }
  return out;
}

template <typename Mutex>
auto BasicActivationVisualizer<Mutex>::to_json() const -> nlohmann::json {
  std::lock_guard<Mutex> lock(mutex_);
  nlohmann::json layers = nlohmann::json::object();
  entries_.for_each([&](const std::string& name, const Entry& e) {
    nlohmann::json j;
    j["history"] = nlohmann::json::array();
    for (std::size_t i = 0; i < e.history.size(); ++i)
      j["history"].push_back(stats_json(e.history.at(i)));
    if (!e.history.empty()) j["latest"] = stats_json(e.history.back());
    if (e.histogram)
      j["histogram"] = {{"edges", e.histogram->edges}, {"counts", e.histogram->counts}};
    if (e.heatmap) {
      j["heatmap"] = {
          {"rows", e.heatmap->rows}, {"cols", e.heatmap->cols}, {"values", e.heatmap->values}};
    }
    layers[name] = std::move(j);
  });
  return nlohmann::json{{"layers", std::move(layers)}};
}

template <typename Mutex>
std::string BasicActivationVisualizer<Mutex>::summary_table() const {
  std::lock_guard<Mutex> lock(mutex_);
  std::string out =
      fmt::format("{:<28} {:>6} {:>10} {:>10} {:>10} {:>10} {:>10} {:>8} {:>8}\n", "layer", "step",
                  "mean", "std", "min", "median", "max", "sparsity", "outliers");
  entries_.for_each([&](const std::string& name, const Entry& e) {
    if (e.history.empty()) return;
    const ActivationStats& a = e.history.back();
    out += fmt::format(
        "{:<28} {:>6} {:>10.4g} {:>10.4g} {:>10.4g} {:>10.4g} {:>10.4g} {:>8.3f} {:>8}\n", name,
        a.step, a.mean, a.std, a.min, a.median, a.max, a.sparsity, a.outliers);
  });
  return out;
}

template <typename Mutex>
void BasicActivationVisualizer<Mutex>::clear() {
  std::lock_guard<Mutex> lock(mutex_);
  entries_.clear();
}

template <typename Mutex>
auto BasicActivationVisualizer<Mutex>::stats_json(const ActivationStats& a) -> nlohmann::json {
  return {{"step", a.step},
          {"numel", a.numel},
          {"mean", a.mean},
          {"std", a.std},
          {"min", a.min},
          {"max", a.max},
          {"median", a.median},
          {"q25", a.q25},
          {"q75", a.q75},
          {"zeros", a.zeros},
          {"negatives", a.negatives},
          {"positives", a.positives},
          {"outliers", a.outliers},
          {"non_finite", a.non_finite},
          {"sparsity", a.sparsity}};
}

template <typename Mutex>
auto BasicActivationVisualizer<Mutex>::entry(std::string_view layer) -> Entry& {
  return entries_.get_or_create(layer, [&] { return Entry(options_.history_capacity()); });
}

#endif  // TORCHDBG_DEFINITIONS

using ActivationVisualizer = BasicActivationVisualizer<std::mutex>;
using ActivationVisualizerSt = BasicActivationVisualizer<detail::NullMutex>;

TORCHDBG_EXTERN_TEMPLATE(class BasicActivationVisualizer<std::mutex>)
TORCHDBG_EXTERN_TEMPLATE(class BasicActivationVisualizer<detail::NullMutex>)

}  // namespace torchdbg
