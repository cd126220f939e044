// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// The HTML pages' plots of a run: the loss, the gradient flow and the activation histograms (SVG).

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "torchdbg/exporters/html/run.hpp"
#include "torchdbg/exporters/html/text.hpp"

namespace torchdbg::detail {

/// A plot's two axes.
inline std::string svg_axes(double l, double t, double r, double b) {
  return fmt::format(
      "<line x1=\"{0}\" y1=\"{1}\" x2=\"{0}\" y2=\"{3}\" class=\"axis\"/><line x1=\"{0}\" "
      "y1=\"{3}\" x2=\"{2}\" y2=\"{3}\" class=\"axis\"/>",
      l, t, r, b);
}

/// The loss curve (log scale when it spans more than 100×), non-finite losses as red ticks.
inline std::string loss_svg(const HtmlRun& run) {
  const auto& pts = run.losses();
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
               x1 = std::max(x0 + 1,
                             static_cast<double>(std::max(pts.back().first, finite.back().first)));
  auto px = [&](double x) { return L + (x - x0) / (x1 - x0) * (W - L - R); };
  auto py = [&](double y) { return T + (1.0 - (fy(y) - ylo) / (yhi - ylo)) * (H - T - B); };
  std::string path;
  for (const auto& p : finite)
    path += fmt::format("{}{:.1f},{:.1f} ", path.empty() ? "M" : "L",
                        px(static_cast<double>(p.first)), py(p.second));
  std::string s = fmt::format(
      "<svg class=\"plot\" id=\"loss-plot\" viewBox=\"0 0 {} {}\" width=\"{}\" height=\"{}\">", W,
      H, W, H);
  s += svg_axes(L, T, W - R, H - B);
  s += fmt::format("<path d=\"{}\" fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"1.5\"/>", path);
  s += fmt::format(
      "<text x=\"4\" y=\"{}\" class=\"tick\">{}</text><text x=\"4\" y=\"{}\" "
      "class=\"tick\">{}</text>",
      T + 10, html_number(hi), H - B, html_number(lo));
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
        px(x), T, T + 8, p.first, html_number(p.second));
  }
  if (bad > 0)
    s += fmt::format(
        "<text x=\"{}\" y=\"{}\" class=\"tick\" text-anchor=\"end\" fill=\"#b3001b\">{} "
        "non-finite losses (red ticks)</text>",
        W - R, T + 12, bad);
  return s + "</svg>";
}

/// Per-layer gradient L2 norm across layers in forward order (log scale), a line per sampled
/// step, the latest darkest.
inline std::string gradient_flow_svg(const HtmlRun& run) {
  std::vector<HtmlRun::Flow> lines = run.flows();
  if (run.last_flow().norms.empty()) return "<p class=\"empty\">No gradients recorded.</p>";
  if (lines.empty() || lines.back().step != run.last_flow().step) lines.push_back(run.last_flow());
  // x: layers in forward order, those that had gradients.
  std::vector<std::string> names;
  {
    std::map<std::string, bool> has;
    for (const auto& f : lines)
      for (const auto& n : f.norms) has[n.first] = true;
    for (const HtmlRun::Row* r : run.ordered_rows())
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
  s += svg_axes(L, T, W - R, H - B);
  for (double d = lo; d <= hi + 1e-9; d += 1.0)
    s += fmt::format(
        "<line x1=\"{}\" y1=\"{:.1f}\" x2=\"{}\" y2=\"{:.1f}\" class=\"grid\"/><text x=\"4\" "
        "y=\"{:.1f}\" class=\"tick\">1e{:.0f}</text>",
        L, py(d), W - R, py(d), py(d) + 4, d);
  const std::size_t label_every = std::max<std::size_t>(1, names.size() / 40);
  for (std::size_t i = 0; i < names.size(); i += label_every)
    s += fmt::format("<text class=\"tick\" transform=\"translate({:.1f},{}) rotate(60)\">{}</text>",
                     px(i), H - B + 12, html_escape(names[i]));
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

/// Each layer's latest activation histogram, the first `max_histograms` in forward order.
inline std::string histograms_html(const HtmlRun& run) {
  std::string s;
  std::size_t shown = 0, with = 0;
  for (const HtmlRun::Row* r : run.ordered_rows()) {
    if (r->counts.empty()) continue;
    ++with;
    if (shown >= run.options().max_histograms()) continue;
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
        W, H, W, H, bars, H - 2, html_number(r->edges.front()), W, H - 2,
        html_number(r->edges.back()), html_escape(r->name), r->hist_step);
  }
  if (with == 0)
    return "<p class=\"empty\">No histograms recorded (ReporterOptions::histogram_interval).</p>";
  if (with > shown)
    s += fmt::format("<p class=\"muted\">Showing {} of {} layers.</p>", shown, with);
  return "<div class=\"hists\">" + s + "</div>";
}

}  // namespace torchdbg::detail
