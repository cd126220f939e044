// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// A single-file HTML report: inline SVG, CSS and a few lines of JS, no network access. It
// shows the loss, gradient flow (per-layer gradient norm across layers, log scale, a line per
// sampled step), per-layer activation histograms, a layers x steps health heatmap, the events
// timeline, the diagnosis with its causal graph, and the alerts. Memory and file size stay
// bounded for any number of steps: series are decimated (every other point dropped, stride
// doubled, when full) and heatmap columns merge pairwise (the worse state wins).

#include <fmt/format.h>
#include <torch/arg.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "torchdbg/detail/atomic_file.hpp"
#include "torchdbg/detail/text.hpp"
#include "torchdbg/exporters/exporter.hpp"

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

/// `s` as HTML text: markup characters escaped, invalid UTF-8 and NUL as U+FFFD.
inline std::string html_escape(std::string_view raw) {
  const std::string s = valid_utf8(raw);
  std::string o;
  o.reserve(s.size());
  for (char c : s) {
    switch (c) {
      case '&':
        o += "&amp;";
        break;
      case '<':
        o += "&lt;";
        break;
      case '>':
        o += "&gt;";
        break;
      case '"':
        o += "&quot;";
        break;
      case '\'':
        o += "&#39;";
        break;
      default:
        o += c;
    }
  }
  return o;
}

/// Severity rank of a state name, for the heatmap (the worse state of a cell wins).
inline int state_rank(std::string_view s) {
  if (s == "normal" || s == "healthy") return 1;
  if (s == "anomalous") return 2;
  if (s == "vanishing" || s == "saturated") return 3;
  if (s == "dead") return 4;
  if (s == "exploding") return 5;
  if (s == "non_finite") return 6;
  return 0;
}
inline const char* rank_name(int r) {
  static const char* const kNames[] = {"unobserved",          "healthy", "anomalous",
                                       "vanishing/saturated", "dead",    "exploding",
                                       "non-finite"};
  return kNames[std::clamp(r, 0, 6)];
}
inline const char* rank_color(int r) {
  static const char* const kColors[] = {"#f4f4f4", "#8fd19e", "#f5e08a", "#f0b35a",
                                        "#b07cc6", "#e8663d", "#b3001b"};
  return kColors[std::clamp(r, 0, 6)];
}

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

}  // namespace detail

/// The HTML report. Written atomically (temp + rename) on flush and on write_summary, so the
/// file on disk is always a complete report.
template <typename Mutex = std::mutex>
class BasicHtmlExporter : public BaseExporter<Mutex> {
 public:
  explicit BasicHtmlExporter(std::string path, HtmlOptions options = {})
      : path_(std::move(path)),
        options_(std::move(options)),
        loss_(options_.max_points()),
        flow_(std::max<std::size_t>(1, options_.gradient_flow_lines())) {
    if (path_.empty()) throw Error("torchdbg: HtmlExporter needs a path");
    if (options_.heatmap_columns() < 2)
      throw Error("torchdbg: HtmlOptions::heatmap_columns must be >= 2");
  }
  [[nodiscard]] const std::string& path() const noexcept { return path_; }

  /// The report as it would be written now.
  [[nodiscard]] std::string render() const {
    std::lock_guard<Mutex> lock(this->mutex_);
    return render_locked();
  }

 protected:
  void write_step_(const StepRecord& r) override {
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
      if (h.has_activation) rank = std::max(rank, detail::state_rank(to_string(h.activation)));
      if (h.has_gradient) rank = std::max(rank, detail::state_rank(to_string(h.gradient)));
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
  void write_summary_(const RunSummary& s) override {
    summary_ = s;
    write_file();
  }
  void flush_() override {
    if (options_.write_on_flush()) write_file();
  }

 private:
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
    return step > *first_step_ ? static_cast<uint64_t>(step) - static_cast<uint64_t>(*first_step_) : 0;
  }
  /// The step `off` steps after the first one, saturated at INT64_MAX.
  int64_t step_at(uint64_t off) const {
    const uint64_t room = static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) -
                          static_cast<uint64_t>(*first_step_);
    if (off >= room) return std::numeric_limits<int64_t>::max();
    return static_cast<int64_t>(static_cast<uint64_t>(*first_step_) + off);
  }
  /// The first step of heatmap column `c`.
  int64_t column_step(std::size_t c) const {
    const uint64_t k = static_cast<uint64_t>(c);
    if (k != 0 && bucket_ > std::numeric_limits<uint64_t>::max() / k) return std::numeric_limits<int64_t>::max();
    return step_at(k * bucket_);
  }

  /// The last step of heatmap column `c`.
  int64_t column_last_step(std::size_t c) const {
    const int64_t next = column_step(c + 1);
    return next == std::numeric_limits<int64_t>::max() ? next : next - 1;
  }

  void mark(Row& row, int64_t step, int rank) {
    const std::size_t cols = options_.heatmap_columns();
    auto column = [&] { return static_cast<std::size_t>(std::min<uint64_t>(offset(step) / bucket_, cols)); };
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

  std::vector<const Row*> ordered_rows() const {
    std::vector<const Row*> out;
    for (const auto& r : rows_) out.push_back(&r);
    std::stable_sort(out.begin(), out.end(),
                     [](const Row* a, const Row* b) { return a->order < b->order; });
    return out;
  }

  static std::string num(double v) {
    if (!std::isfinite(v)) return "n/a";
    return fmt::format("{:.4g}", v);
  }

  // ---- plots --------------------------------------------------------------------------

  std::string loss_svg() const {
    const auto& pts = loss_.items();
    std::vector<std::pair<int64_t, double>> finite;
    for (const auto& p : pts)
      if (std::isfinite(p.second)) finite.push_back(p);
    if (finite.size() < 2) return "<p class=\"empty\">Not enough finite losses recorded.</p>";
    const double W = 900, H = 240, L = 60, B = 30, T = 10, R = 10;
    double lo = finite[0].second, hi = lo;
    for (const auto& p : finite) {
      lo = std::min(lo, p.second);
      hi = std::max(hi, p.second);
    }
    const bool logy = lo > 0 && hi / lo > 100.0;
    auto fy = [&](double v) { return logy ? std::log10(v) : v; };
    double ylo = fy(lo), yhi = fy(hi);
    if (yhi - ylo < 1e-12) yhi = ylo + 1.0;
    const double x0 = static_cast<double>(std::min(pts.front().first, finite.front().first)),
                 x1 = std::max(
                     x0 + 1, static_cast<double>(std::max(pts.back().first, finite.back().first)));
    auto px = [&](double x) { return L + (x - x0) / (x1 - x0) * (W - L - R); };
    auto py = [&](double y) { return T + (1.0 - (fy(y) - ylo) / (yhi - ylo)) * (H - T - B); };
    std::string path;
    for (const auto& p : finite)
      path += fmt::format("{}{:.1f},{:.1f} ", path.empty() ? "M" : "L",
                          px(static_cast<double>(p.first)), py(p.second));
    std::string s = fmt::format(
        "<svg class=\"plot\" id=\"loss-plot\" viewBox=\"0 0 {} {}\" width=\"{}\" height=\"{}\">", W,
        H, W, H);
    s += axes(L, T, W - R, H - B);
    s +=
        fmt::format("<path d=\"{}\" fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"1.5\"/>", path);
    s += fmt::format(
        "<text x=\"4\" y=\"{}\" class=\"tick\">{}</text><text x=\"4\" y=\"{}\" "
        "class=\"tick\">{}</text>",
        T + 10, num(hi), H - B, num(lo));
    s += fmt::format(
        "<text x=\"{}\" y=\"{}\" class=\"tick\">step {}</text><text x=\"{}\" y=\"{}\" "
        "class=\"tick\" text-anchor=\"end\">step {}</text>",
        L, H - 8, static_cast<int64_t>(x0), W - R, H - 8, static_cast<int64_t>(x1));
    if (logy)
      s += fmt::format("<text x=\"{}\" y=\"{}\" class=\"tick\">log scale</text>", L + 6, T + 12);
    std::size_t bad = 0;
    for (const auto& p : pts) {
      if (std::isfinite(p.second)) continue;
      ++bad;
      const double x = static_cast<double>(p.first);
      s += fmt::format(
          "<line class=\"non-finite\" x1=\"{0:.1f}\" y1=\"{1}\" x2=\"{0:.1f}\" y2=\"{2}\" "
          "stroke=\"#b3001b\"><title>step {3}: loss {4}</title></line>",
          px(x), T, T + 8, p.first, num(p.second));
    }
    if (bad > 0)
      s += fmt::format(
          "<text x=\"{}\" y=\"{}\" class=\"tick\" text-anchor=\"end\" fill=\"#b3001b\">{} "
          "non-finite losses (red ticks)</text>",
          W - R, T + 12, bad);
    return s + "</svg>";
  }

  static std::string axes(double l, double t, double r, double b) {
    return fmt::format(
        "<line x1=\"{0}\" y1=\"{1}\" x2=\"{0}\" y2=\"{3}\" class=\"axis\"/><line x1=\"{0}\" "
        "y1=\"{3}\" x2=\"{2}\" y2=\"{3}\" class=\"axis\"/>",
        l, t, r, b);
  }

  std::string gradient_flow_svg() const {
    std::vector<Flow> lines = flow_.items();
    if (last_flow_.norms.empty()) return "<p class=\"empty\">No gradients recorded.</p>";
    if (lines.empty() || lines.back().step != last_flow_.step) lines.push_back(last_flow_);
    // x: layers in forward order, those that had gradients.
    std::vector<std::string> names;
    {
      std::map<std::string, bool> has;
      for (const auto& f : lines)
        for (const auto& n : f.norms) has[n.first] = true;
      for (const Row* r : ordered_rows())
        if (has.count(r->name)) names.push_back(r->name);
    }
    std::unordered_map<std::string, std::size_t> xi;
    for (std::size_t i = 0; i < names.size(); ++i) xi[names[i]] = i;
    double lo = 1e300, hi = -1e300;
    for (const auto& f : lines)
      for (const auto& n : f.norms)
        if (n.second > 0 && std::isfinite(n.second)) {
          lo = std::min(lo, std::log10(n.second));
          hi = std::max(hi, std::log10(n.second));
        }
    if (lo > hi) lo = -1, hi = 1;
    lo = std::floor(lo);
    hi = std::ceil(hi);
    if (hi - lo < 1) hi = lo + 1;
    const double W = 900, H = 300, L = 60, B = 90, T = 10, R = 20;
    const double n = static_cast<double>(std::max<std::size_t>(2, names.size()));
    auto px = [&](std::size_t i) { return L + static_cast<double>(i) / (n - 1) * (W - L - R); };
    auto py = [&](double v) { return T + (1.0 - (v - lo) / (hi - lo)) * (H - T - B); };
    std::string s = fmt::format(
        "<svg class=\"plot\" id=\"gradient-flow-plot\" viewBox=\"0 0 {} {}\" width=\"{}\" "
        "height=\"{}\">",
        W, H, W, H);
    s += axes(L, T, W - R, H - B);
    for (double d = lo; d <= hi + 1e-9; d += 1.0)
      s += fmt::format(
          "<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" class=\"grid\"/><text x=\"4\" "
          "y=\"{:.1f}\" class=\"tick\">1e{:.0f}</text>",
          L, py(d), W - R, py(d), py(d) + 4, d);
    const std::size_t label_every = std::max<std::size_t>(1, names.size() / 40);
    for (std::size_t i = 0; i < names.size(); i += label_every)
      s += fmt::format(
          "<text class=\"tick\" transform=\"translate({:.1f},{}) rotate(60)\">{}</text>", px(i),
          H - B + 12, detail::html_escape(names[i]));
    for (std::size_t k = 0; k < lines.size(); ++k) {
      const double age =
          lines.size() == 1 ? 1.0 : static_cast<double>(k) / static_cast<double>(lines.size() - 1);
      const int shade = static_cast<int>(200 - 170 * age);
      std::string path;
      std::string dots;
      std::vector<std::pair<std::size_t, double>> pts;
      for (const auto& nm : lines[k].norms) {
        auto it = xi.find(nm.first);
        if (it == xi.end()) continue;
        pts.emplace_back(it->second, nm.second);
      }
      std::sort(pts.begin(), pts.end());
      bool pen_down = false;
      for (const auto& [i, v] : pts) {
        if (!std::isfinite(v)) {  // NaN/Inf: a red mark at the top, the line breaks
          dots += fmt::format(
              "<circle class=\"non-finite\" cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3.5\" "
              "fill=\"#b3001b\"><title>step {}: non-finite</title></circle>",
              px(i), T + 4, lines[k].step);
          pen_down = false;
          continue;
        }
        const double y = v > 0 ? py(std::log10(v)) : H - B;
        path += fmt::format("{}{:.1f},{:.1f} ", pen_down ? "L" : "M", px(i), y);
        pen_down = true;
      }
      s += fmt::format(
          "<path class=\"flow-line\" data-step=\"{}\" d=\"{}\" fill=\"none\" "
          "stroke=\"rgb({},{},{})\" stroke-width=\"{}\"><title>step {}</title></path>{}",
          lines[k].step, path, shade, shade, 255, k + 1 == lines.size() ? 2.5 : 1.2, lines[k].step,
          dots);
    }
    s += fmt::format(
        "<text x=\"{}\" y=\"{}\" class=\"tick\" text-anchor=\"end\">{} sampled steps, darkest = "
        "latest (step {})</text>",
        W - R, T + 12, lines.size(), lines.back().step);
    return s + "</svg>";
  }

  std::string histograms_html() const {
    std::string s;
    std::size_t shown = 0, with = 0;
    for (const Row* r : ordered_rows()) {
      if (r->counts.empty()) continue;
      ++with;
      if (shown >= options_.max_histograms()) continue;
      ++shown;
      const double W = 200, H = 90;
      int64_t peak = 1;
      for (auto c : r->counts) peak = std::max(peak, c);
      const double bw = W / static_cast<double>(r->counts.size());
      std::string bars;
      for (std::size_t i = 0; i < r->counts.size(); ++i) {
        const double h = (H - 20) * static_cast<double>(r->counts[i]) / static_cast<double>(peak);
        bars += fmt::format(
            "<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"#4c78a8\"/>",
            i * bw, H - 14 - h, std::max(0.5, bw - 0.5), h);
      }
      s += fmt::format(
          "<figure class=\"hist\"><svg class=\"plot histogram\" viewBox=\"0 0 {} {}\" width=\"{}\" "
          "height=\"{}\">{}<text x=\"0\" y=\"{}\" class=\"tick\">{}</text><text x=\"{}\" y=\"{}\" "
          "class=\"tick\" text-anchor=\"end\">{}</text></svg><figcaption>{} <span "
          "class=\"muted\">(step {})</span></figcaption></figure>",
          W, H, W, H, bars, H - 2, num(r->edges.front()), W, H - 2, num(r->edges.back()),
          detail::html_escape(r->name), r->hist_step);
    }
    if (with == 0)
      return "<p class=\"empty\">No histograms recorded (ReporterOptions::histogram_interval).</p>";
    if (with > shown)
      s += fmt::format("<p class=\"muted\">Showing {} of {} layers.</p>", shown, with);
    return "<div class=\"hists\">" + s + "</div>";
  }

  std::string heatmap_svg() const {
    std::vector<const Row*> rows;
    for (const Row* r : ordered_rows())
      if (!r->cells.empty()) rows.push_back(r);
    if (rows.empty()) return "<p class=\"empty\">No health recorded (attach a HealthMonitor).</p>";
    std::size_t cols = 1;
    for (const Row* r : rows) cols = std::max(cols, r->cells.size());
    const double rowh = rows.size() > 120 ? 5 : 12, L = 170, T = 6,
                 cw = std::max(2.0, 700.0 / static_cast<double>(cols));
    const double W = L + cw * static_cast<double>(cols) + 10,
                 H = T + rowh * static_cast<double>(rows.size()) + 30;
    std::string s = fmt::format(
        "<svg class=\"plot\" id=\"heatmap-plot\" viewBox=\"0 0 {:.0f} {:.0f}\" width=\"{:.0f}\" "
        "height=\"{:.0f}\">",
        W, H, W, H);
    for (std::size_t i = 0; i < rows.size(); ++i) {
      const Row& r = *rows[i];
      int worst = 0;
      for (auto c : r.cells) worst = std::max<int>(worst, c);
      const double y = T + rowh * static_cast<double>(i);
      s += fmt::format("<g class=\"hm-row\" data-layer=\"{}\" data-worst=\"{}\">",
                       detail::html_escape(r.name), worst);
      if (rows.size() <= 120 || i % 5 == 0)
        s += fmt::format("<text x=\"{}\" y=\"{:.1f}\" class=\"tick\" text-anchor=\"end\">{}</text>",
                         L - 4, y + rowh - 1, detail::html_escape(r.name));
      // run-length: one rect per run of equal cells
      std::size_t c = 0;
      while (c < r.cells.size()) {
        std::size_t e = c;
        while (e < r.cells.size() && r.cells[e] == r.cells[c]) ++e;
        if (r.cells[c] != 0)
          s += fmt::format(
              "<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" "
              "fill=\"{}\"><title>{}: {} (steps {}-{})</title></rect>",
              L + cw * static_cast<double>(c), y, cw * static_cast<double>(e - c), rowh - 1,
              detail::rank_color(r.cells[c]), detail::html_escape(r.name),
              detail::rank_name(r.cells[c]), column_step(c),
              column_last_step(e - 1));
        c = e;
      }
      s += "</g>";
    }
    s += fmt::format(
        "<text x=\"{}\" y=\"{:.0f}\" class=\"tick\">step {}</text><text x=\"{:.0f}\" y=\"{:.0f}\" "
        "class=\"tick\" text-anchor=\"end\">step {} ({} step{} per column)</text>",
        L, H - 8, *first_step_, W - 10, H - 8, last_step_, bucket_, bucket_ > 1 ? "s" : "");
    s += "</svg><div class=\"legend\">";
    for (int k = 1; k <= 6; ++k)
      s += fmt::format("<span><i style=\"background:{}\"></i>{}</span>", detail::rank_color(k),
                       detail::rank_name(k));
    return s + "</div>";
  }

  std::string events_svg() const {
    if (events_.empty()) return "<p class=\"empty\">No events.</p>";
    std::vector<std::string> types;
    for (const auto& e : events_) {
      const std::string t = to_string(e.type);
      if (std::find(types.begin(), types.end(), t) == types.end()) types.push_back(t);
    }
    const double W = 900, rowh = 18, L = 170, T = 6;
    const double H = T + rowh * static_cast<double>(types.size()) + 24;
    const double x0 = static_cast<double>(events_.front().step);
    const double x1 =
        std::max(x0 + 1, static_cast<double>(std::max(last_step_, events_.back().step)));
    auto px = [&](double x) { return L + (x - x0) / (x1 - x0) * (W - L - 10); };
    std::string s = fmt::format(
        "<svg class=\"plot\" id=\"events-plot\" viewBox=\"0 0 {} {:.0f}\" width=\"{}\" "
        "height=\"{:.0f}\">",
        W, H, W, H);
    for (std::size_t i = 0; i < types.size(); ++i)
      s += fmt::format(
          "<text x=\"{}\" y=\"{:.1f}\" class=\"tick\" text-anchor=\"end\">{}</text><line x1=\"{}\" "
          "y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" class=\"grid\"/>",
          L - 4, T + rowh * static_cast<double>(i) + 12, types[i], L,
          T + rowh * static_cast<double>(i) + 8, W - 10, T + rowh * static_cast<double>(i) + 8);
    for (const auto& e : events_) {
      const std::size_t row = static_cast<std::size_t>(
          std::find(types.begin(), types.end(), std::string(to_string(e.type))) - types.begin());
      s += fmt::format(
          "<circle class=\"event\" cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"4\" fill=\"{}\"><title>step {} "
          "{}: {} -&gt; {} ({:.0f}%)</title></circle>",
          px(static_cast<double>(e.step)), T + rowh * static_cast<double>(row) + 8,
          e.is_alarm() ? "#d62728" : "#2ca02c", e.step, detail::html_escape(e.layer),
          detail::html_escape(e.from), detail::html_escape(e.to), e.confidence * 100);
    }
    s += fmt::format(
        "<text x=\"{}\" y=\"{:.0f}\" class=\"tick\">step {}</text><text x=\"{}\" y=\"{:.0f}\" "
        "class=\"tick\" text-anchor=\"end\">step {}</text></svg>",
        L, H - 4, static_cast<int64_t>(x0), W - 10, H - 4, static_cast<int64_t>(x1));
    std::string table =
        "<table "
        "class=\"events\"><tr><th>step</th><th>layer</th><th>event</th><th>from</th><th>to</"
        "th><th>confidence</th></tr>";
    const std::size_t first = events_.size() > 200 ? events_.size() - 200 : 0;
    for (std::size_t i = first; i < events_.size(); ++i) {
      const auto& e = events_[i];
      table += fmt::format(
          "<tr "
          "class=\"{}\"><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.0f}%</td></"
          "tr>",
          e.is_alarm() ? "alarm" : "info", e.step, detail::html_escape(e.layer), to_string(e.type),
          detail::html_escape(e.from), detail::html_escape(e.to), e.confidence * 100);
    }
    table += "</table>";
    std::string note =
        events_total_ > events_.size()
            ? fmt::format("<p class=\"muted\">{} events in all; the latest {} are kept.</p>",
                          events_total_, events_.size())
            : "";
    return s + note + "<details><summary>Event table (latest 200)</summary>" + table + "</details>";
  }

  std::string diagnosis_html() const {
    if (!summary_ || !summary_->diagnosis)
      return "<p class=\"empty\">No diagnosis (finish the reporter with make_summary).</p>";
    const Diagnosis& d = *summary_->diagnosis;
    std::string s =
        fmt::format("<p class=\"summary-text\">{}</p>", detail::html_escape(d.summary()));
    if (d.hypotheses.empty()) return s;
    s += "<table "
         "class=\"hypotheses\"><tr><th>#</th><th>kind</th><th>layer</th><th>step</"
         "th><th>confidence</th><th>description</th></tr>";
    for (std::size_t i = 0; i < d.hypotheses.size() && i < 20; ++i) {
      const auto& h = d.hypotheses[i];
      s += fmt::format(
          "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.0f}%</td><td>{}</td></tr>", i + 1,
          to_string(h.kind), detail::html_escape(h.layer), h.step, h.confidence * 100,
          detail::html_escape(h.description));
    }
    s += "</table>" + causal_svg(d);
    s += "<details><summary>Mermaid source</summary><pre>" + detail::html_escape(d.to_mermaid()) +
         "</pre></details>";
    return s;
  }

  static std::string causal_svg(const Diagnosis& d) {
    if (d.nodes.empty()) return {};
    // Layout: a column per distinct (step, phase) in time order, nodes stacked in each.
    std::vector<std::pair<int64_t, int>> keys;
    for (const auto& n : d.nodes) keys.emplace_back(n.step, static_cast<int>(n.phase));
    std::sort(keys.begin(), keys.end());
    keys.erase(std::unique(keys.begin(), keys.end()), keys.end());
    const std::size_t max_nodes = 60;
    std::vector<double> x(d.nodes.size()), y(d.nodes.size());
    std::map<std::size_t, int> per_col;
    const double NW = 190, NH = 34, GX = 40, GY = 12;
    double H = 0, W = 0;
    for (std::size_t i = 0; i < d.nodes.size() && i < max_nodes; ++i) {
      const auto key = std::make_pair(d.nodes[i].step, static_cast<int>(d.nodes[i].phase));
      const std::size_t col =
          static_cast<std::size_t>(std::lower_bound(keys.begin(), keys.end(), key) - keys.begin());
      const int row = per_col[col]++;
      x[i] = 10 + static_cast<double>(col) * (NW + GX);
      y[i] = 10 + row * (NH + GY);
      W = std::max(W, x[i] + NW + 10);
      H = std::max(H, y[i] + NH + 10);
    }
    std::string s = fmt::format(
        "<svg class=\"plot\" id=\"causal-graph\" viewBox=\"0 0 {:.0f} {:.0f}\" width=\"{:.0f}\" "
        "height=\"{:.0f}\"><defs><marker id=\"arrow\" viewBox=\"0 0 10 10\" refX=\"10\" refY=\"5\" "
        "markerWidth=\"7\" markerHeight=\"7\" orient=\"auto\"><path d=\"M0,0 L10,5 L0,10 z\" "
        "fill=\"#555\"/></marker></defs>",
        W, H, W, H);
    for (const auto& [a, b] : d.edges) {
      if (a >= max_nodes || b >= max_nodes) continue;
      s += fmt::format(
          "<line class=\"edge\" x1=\"{:.0f}\" y1=\"{:.0f}\" x2=\"{:.0f}\" y2=\"{:.0f}\" "
          "stroke=\"#555\" marker-end=\"url(#arrow)\"/>",
          x[a] + NW, y[a] + NH / 2, x[b], y[b] + NH / 2);
    }
    for (std::size_t i = 0; i < d.nodes.size() && i < max_nodes; ++i) {
      const bool root = std::find(d.roots.begin(), d.roots.end(), i) != d.roots.end();
      const bool top = !d.roots.empty() && d.roots.front() == i;
      s += fmt::format(
          "<g class=\"node{}\"><rect x=\"{:.0f}\" y=\"{:.0f}\" width=\"{}\" height=\"{}\" rx=\"5\" "
          "fill=\"{}\" stroke=\"{}\" stroke-width=\"{}\"/><text x=\"{:.0f}\" y=\"{:.0f}\" "
          "class=\"node-text\">{}</text><text x=\"{:.0f}\" y=\"{:.0f}\" class=\"node-text "
          "muted\">{} (step {})</text></g>",
          root ? " root" : "", x[i], y[i], NW, NH, root ? "#fde2e1" : "#eef2f7",
          top ? "#c00" : "#889", top ? 2.5 : 1, x[i] + 6, y[i] + 14, to_string(d.nodes[i].kind),
          x[i] + 6, y[i] + 28, detail::html_escape(d.nodes[i].layer.substr(0, 26)),
          d.nodes[i].step);
    }
    return s + "</svg>";
  }

  std::string alerts_html() const {
    if (!summary_ || summary_->alerts.empty()) return "<p class=\"empty\">No alerts.</p>";
    std::string s = fmt::format(
        "<p>{} alerts in all; the latest {}:</p><table "
        "class=\"alerts\"><tr><th>step</th><th>severity</th><th>layer</th><th>hook</"
        "th><th>message</th></tr>",
        summary_->alerts_total, summary_->alerts.size());
    for (const auto& a : summary_->alerts)
      s += fmt::format(
          "<tr class=\"{0}\"><td>{1}</td><td>{0}</td><td>{2}</td><td>{3}</td><td>{4}</td></tr>",
          to_string(a.severity), a.step, detail::html_escape(a.layer),
          detail::html_escape(a.hook_name), detail::html_escape(a.message));
    return s + "</table>";
  }

  std::string render_locked() const {
    const std::string title = detail::html_escape(options_.title());
    std::string verdict = "no diagnosis yet";
    if (summary_ && summary_->diagnosis)
      verdict = summary_->diagnosis->healthy() ? "healthy" : "failure diagnosed";
    std::string h;
    h.reserve(1 << 16);
    h += "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><meta name=\"viewport\" "
         "content=\"width=device-width\"><title>" +
         title + "</title><style>";
    h += "body{font:14px/1.4 system-ui,sans-serif;margin:0 "
         "auto;max-width:1100px;padding:16px;color:#222}"
         "h1{font-size:22px}h2{font-size:17px;border-bottom:1px solid "
         "#ddd;padding-bottom:4px;margin-top:28px}"
         "svg.plot{max-width:100%;height:auto;background:#fff}.axis{stroke:#444}.grid{stroke:#eee}"
         ".tick{font-size:10px;fill:#555}.node-text{font-size:11px;fill:#222}.muted{color:#777;"
         "fill:#666}"
         "table{border-collapse:collapse;font-size:12px;margin:6px 0}td,th{border:1px solid "
         "#ddd;padding:2px 6px;text-align:left}"
         "tr.alarm td,tr.critical td,tr.error "
         "td{background:#fff1f0}.hists{display:flex;flex-wrap:wrap;gap:6px}"
         "figure.hist{margin:0;width:200px}figcaption{font-size:11px;overflow:hidden;text-overflow:"
         "ellipsis;white-space:nowrap}"
         ".legend span{margin-right:12px;font-size:12px}.legend "
         "i{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:middle}"
         ".kpi{display:flex;gap:18px;flex-wrap:wrap}.kpi div{background:#f6f8fa;padding:8px "
         "12px;border-radius:6px}"
         ".empty{color:#888;font-style:italic}pre{background:#f6f8fa;padding:8px;overflow:auto}";
    h += "</style></head><body><h1>" + title + "</h1>";
    h += fmt::format(
        "<section id=\"summary\"><div class=\"kpi\"><div>steps recorded <b>{}</b></div><div>last "
        "step <b>{}</b></div><div>layers <b>{}</b></div><div>events <b>{}</b></div><div>alerts "
        "<b>{}</b></div><div>verdict <b id=\"verdict\">{}</b></div></div></section>",
        steps_, last_step_, rows_.size(), events_total_, summary_ ? summary_->alerts_total : 0,
        verdict);
    h += "<section id=\"diagnosis\"><h2>Diagnosis</h2>" + diagnosis_html() + "</section>";
    h += "<section id=\"loss\"><h2>Loss</h2>" + loss_svg() + "</section>";
    h += "<section id=\"gradient-flow\"><h2>Gradient flow</h2><p class=\"muted\">Per-layer "
         "gradient L2 norm across layers in forward order (log scale).</p>" +
         gradient_flow_svg() + "</section>";
    h += "<section id=\"health-heatmap\"><h2>Health: layers &times; steps</h2><label><input "
         "type=\"checkbox\" id=\"only-unhealthy\"> only layers that were ever unhealthy</label>" +
         heatmap_svg() + "</section>";
    h += "<section id=\"histograms\"><h2>Activation histograms</h2>" + histograms_html() +
         "</section>";
    h += "<section id=\"events\"><h2>Events</h2>" + events_svg() + "</section>";
    h += "<section id=\"alerts\"><h2>Alerts</h2>" + alerts_html() + "</section>";
    h += "<footer class=\"muted\">torchdbg report; a self-contained file (no network "
         "access).</footer>";
    h +=
        "<script>(function(){var "
        "errs=[];window.addEventListener('error',function(e){errs.push(String(e.message));document."
        "body.setAttribute('data-errors',errs.length);});"
        "var "
        "box=document.getElementById('only-unhealthy');if(box){box.addEventListener('change',"
        "function(){var rows=document.querySelectorAll('.hm-row');"
        "for(var i=0;i<rows.length;i++){var "
        "bad=Number(rows[i].getAttribute('data-worst'))>1;rows[i].style.display=(box.checked&&!bad)"
        "?'none':'';}});}"
        "var "
        "ids=['summary','diagnosis','loss','gradient-flow','health-heatmap','histograms','events','"
        "alerts'];var ok=ids.every(function(i){return document.getElementById(i);});"
        "document.body.setAttribute('data-sections',ids.filter(function(i){return "
        "document.getElementById(i);}).length);"
        "document.body.setAttribute('data-svg-count',document.querySelectorAll('svg.plot').length);"
        "document.body.setAttribute('data-rendered',ok&&errs.length===0?'ok':'incomplete');})();</"
        "script>";
    h += "</body></html>\n";
    return h;
  }

  void write_file() {
    const std::string text = render_locked();
    detail::atomic_write_file(path_, text.data(), text.size());
  }

  std::string path_;
  HtmlOptions options_;
  std::vector<Row> rows_;
  std::unordered_map<std::string, std::size_t> index_;
  detail::Decimated<std::pair<int64_t, double>> loss_;
  detail::Decimated<Flow> flow_;
  Flow last_flow_;
  std::optional<int64_t> first_step_;
  int64_t last_step_ = 0, steps_ = 0;
  uint64_t bucket_ = 1;  ///< steps per heatmap column
  std::vector<SemanticEvent> events_;
  uint64_t events_total_ = 0;
  std::optional<RunSummary> summary_;
};

using HtmlExporter = BasicHtmlExporter<std::mutex>;

}  // namespace torchdbg
