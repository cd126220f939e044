// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// The HTML pages' health heatmap: layers × steps, each cell the worst state of its steps (SVG).

#include <fmt/format.h>

#include <algorithm>
#include <string>
#include <vector>

#include "torchdbg/exporters/html/run.hpp"
#include "torchdbg/exporters/html/text.hpp"

namespace torchdbg::detail {

/// Layers × steps, each cell the worst health state of its steps.
inline std::string heatmap_svg(const HtmlRun& run) {
  std::vector<const HtmlRun::Row*> rows;
  for (const HtmlRun::Row* r : run.ordered_rows())
    if (!r->cells.empty()) rows.push_back(r);
  if (rows.empty()) return "<p class=\"empty\">No health recorded (attach a HealthMonitor).</p>";
  std::size_t cols = 1;
  for (const HtmlRun::Row* r : rows) cols = std::max(cols, r->cells.size());
  const double rowh = rows.size() > 120 ? 5 : 12, L = 170, T = 6,
               cw = std::max(2.0, 700.0 / static_cast<double>(cols));
  const double W = L + cw * static_cast<double>(cols) + 10,
               H = T + rowh * static_cast<double>(rows.size()) + 30;
  std::string s = fmt::format(
      "<svg class=\"plot\" id=\"heatmap-plot\" viewBox=\"0 0 {:.0f} {:.0f}\" width=\"{:.0f}\" "
      "height=\"{:.0f}\">",
      W, H, W, H);
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const HtmlRun::Row& r = *rows[i];
    int worst = 0;
    for (auto c : r.cells) worst = std::max<int>(worst, c);
    const double y = T + rowh * static_cast<double>(i);
    s += fmt::format("<g class=\"hm-row\" data-layer=\"{}\" data-worst=\"{}\">",
                     html_escape(r.name), worst);
    if (rows.size() <= 120 || i % 5 == 0)
      s += fmt::format("<text x=\"{}\" y=\"{:.1f}\" class=\"tick\" text-anchor=\"end\">{}</text>",
                       L - 4, y + rowh - 1, html_escape(r.name));
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
            rank_color(r.cells[c]), html_escape(r.name), rank_name(r.cells[c]), run.column_step(c),
            run.column_last_step(e - 1));
      c = e;
    }
    s += "</g>";
  }
  s += fmt::format(
      "<text x=\"{}\" y=\"{:.0f}\" class=\"tick\">step {}</text><text x=\"{:.0f}\" y=\"{:.0f}\" "
      "class=\"tick\" text-anchor=\"end\">step {} ({} step{} per column)</text>",
      L, H - 8, *run.first_step(), W - 10, H - 8, run.last_step(), run.bucket(),
      run.bucket() > 1 ? "s" : "");
  s += "</svg><div class=\"legend\">";
  for (int k = 1; k <= 6; ++k)
    s += fmt::format("<span><i style=\"background:{}\"></i>{}</span>", rank_color(k), rank_name(k));
  return s + "</div>";
}

}  // namespace torchdbg::detail
