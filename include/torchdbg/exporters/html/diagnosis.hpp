// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// The HTML pages' diagnosis, causal graph, events timeline and alerts.

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "torchdbg/exporters/exporter.hpp"
#include "torchdbg/exporters/html/run.hpp"
#include "torchdbg/exporters/html/text.hpp"

namespace torchdbg::detail {

/// The causal graph: a column per (step, phase) in time order, roots outlined, the top one in red.
inline std::string causal_svg(const Diagnosis& d) {
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
        x[i] + 6, y[i] + 28, html_escape(d.nodes[i].layer.substr(0, 26)), d.nodes[i].step);
  }
  return s + "</svg>";
}

/// The diagnosis: its summary, the ranked hypotheses, the causal graph and its Mermaid source.
inline std::string diagnosis_html(const std::optional<RunSummary>& summary) {
  if (!summary || !summary->diagnosis)
    return "<p class=\"empty\">No diagnosis (finish the reporter with make_summary).</p>";
  const Diagnosis& d = *summary->diagnosis;
  std::string s = fmt::format("<p class=\"summary-text\">{}</p>", html_escape(d.summary()));
  if (d.hypotheses.empty()) return s;
  s += "<table "
       "class=\"hypotheses\"><tr><th>#</th><th>kind</th><th>layer</th><th>step</"
       "th><th>confidence</th><th>description</th></tr>";
  for (std::size_t i = 0; i < d.hypotheses.size() && i < 20; ++i) {
    const auto& h = d.hypotheses[i];
    s += fmt::format(
        "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.0f}%</td><td>{}</td></tr>", i + 1,
        to_string(h.kind), html_escape(h.layer), h.step, h.confidence * 100,
        html_escape(h.description));
  }
  s += "</table>" + causal_svg(d);
  s += "<details><summary>Mermaid source</summary><pre>" + html_escape(d.to_mermaid()) +
       "</pre></details>";
  return s;
}

/// The events on a timeline, a row per kind, and a table of the latest 200.
inline std::string events_svg(const HtmlRun& run) {
  if (run.events().empty()) return "<p class=\"empty\">No events.</p>";
  std::vector<std::string> types;
  for (const auto& e : run.events()) {
    const std::string t = to_string(e.type);
    if (std::find(types.begin(), types.end(), t) == types.end()) types.push_back(t);
  }
  const double W = 900, rowh = 18, L = 170, T = 6;
  const double H = T + rowh * static_cast<double>(types.size()) + 24;
  const double x0 = static_cast<double>(run.events().front().step);
  const double x1 =
      std::max(x0 + 1, static_cast<double>(std::max(run.last_step(), run.events().back().step)));
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
  for (const auto& e : run.events()) {
    const std::size_t row = static_cast<std::size_t>(
        std::find(types.begin(), types.end(), std::string(to_string(e.type))) - types.begin());
    s += fmt::format(
        "<circle class=\"event\" cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"4\" fill=\"{}\"><title>step {} "
        "{}: {} -&gt; {} ({:.0f}%)</title></circle>",
        px(static_cast<double>(e.step)), T + rowh * static_cast<double>(row) + 8,
        e.is_alarm() ? "#d62728" : "#2ca02c", e.step, html_escape(e.layer), html_escape(e.from),
        html_escape(e.to), e.confidence * 100);
  }
  s += fmt::format(
      "<text x=\"{}\" y=\"{:.0f}\" class=\"tick\">step {}</text><text x=\"{}\" y=\"{:.0f}\" "
      "class=\"tick\" text-anchor=\"end\">step {}</text></svg>",
      L, H - 4, static_cast<int64_t>(x0), W - 10, H - 4, static_cast<int64_t>(x1));
  std::string table =
      "<table "
      "class=\"events\"><tr><th>step</th><th>layer</th><th>event</th><th>from</th><th>to</"
      "th><th>confidence</th></tr>";
  const std::size_t first = run.events().size() > 200 ? run.events().size() - 200 : 0;
  for (std::size_t i = first; i < run.events().size(); ++i) {
    const auto& e = run.events()[i];
    table += fmt::format(
        "<tr "
        "class=\"{}\"><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{:.0f}%</td></"
        "tr>",
        e.is_alarm() ? "alarm" : "info", e.step, html_escape(e.layer), to_string(e.type),
        html_escape(e.from), html_escape(e.to), e.confidence * 100);
  }
  table += "</table>";
  std::string note =
      run.events_total() > run.events().size()
          ? fmt::format("<p class=\"muted\">{} events in all; the latest {} are kept.</p>",
                        run.events_total(), run.events().size())
          : "";
  return s + note + "<details><summary>Event table (latest 200)</summary>" + table + "</details>";
}

/// The latest alerts.
inline std::string alerts_html(const std::optional<RunSummary>& summary) {
  if (!summary || summary->alerts.empty()) return "<p class=\"empty\">No alerts.</p>";
  std::string s = fmt::format(
      "<p>{} alerts in all; the latest {}:</p><table "
      "class=\"alerts\"><tr><th>step</th><th>severity</th><th>layer</th><th>hook</"
      "th><th>message</th></tr>",
      summary->alerts_total, summary->alerts.size());
  for (const auto& a : summary->alerts)
    s += fmt::format(
        "<tr class=\"{0}\"><td>{1}</td><td>{0}</td><td>{2}</td><td>{3}</td><td>{4}</td></tr>",
        to_string(a.severity), a.step, html_escape(a.layer), html_escape(a.hook_name),
        html_escape(a.message));
  return s + "</table>";
}

}  // namespace torchdbg::detail
