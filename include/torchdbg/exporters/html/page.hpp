// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// The HTML report page: its style, its sections and its script (no network access).

#include <fmt/format.h>

#include <optional>
#include <string>

#include "torchdbg/exporters/exporter.hpp"
#include "torchdbg/exporters/html/diagnosis.hpp"
#include "torchdbg/exporters/html/heatmap.hpp"
#include "torchdbg/exporters/html/plots.hpp"
#include "torchdbg/exporters/html/run.hpp"
#include "torchdbg/exporters/html/text.hpp"

namespace torchdbg::detail {

/// The pages' CSS.
inline const char* html_style() {
  return "body{font:14px/1.4 system-ui,sans-serif;margin:0 "
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
}

/// The report's script: the "only unhealthy layers" filter, and attributes a browser test
/// reads (data-rendered "ok" when every section is there and no script error occurred).
inline const char* html_report_script() {
  return "<script>(function(){var "
         "errs=[];window.addEventListener('error',function(e){errs.push(String(e.message));"
         "document."
         "body.setAttribute('data-errors',errs.length);});"
         "var "
         "box=document.getElementById('only-unhealthy');if(box){box.addEventListener('change',"
         "function(){var rows=document.querySelectorAll('.hm-row');"
         "for(var i=0;i<rows.length;i++){var "
         "bad=Number(rows[i].getAttribute('data-worst'))>1;rows[i].style.display=(box.checked&&!"
         "bad)"
         "?'none':'';}});}"
         "var "
         "ids=['summary','diagnosis','loss','gradient-flow','health-heatmap','histograms','events',"
         "'"
         "alerts'];var ok=ids.every(function(i){return document.getElementById(i);});"
         "document.body.setAttribute('data-sections',ids.filter(function(i){return "
         "document.getElementById(i);}).length);"
         "document.body.setAttribute('data-svg-count',document.querySelectorAll('svg.plot').length)"
         ";"
         "document.body.setAttribute('data-rendered',ok&&errs.length===0?'ok':'incomplete');})();</"
         "script>";
}

/// The whole report page of `run`, with the diagnosis and alerts of `summary` when given.
inline std::string html_page(const HtmlRun& run, const std::optional<RunSummary>& summary) {
  const std::string title = html_escape(run.options().title());
  std::string verdict = "no diagnosis yet";
  if (summary && summary->diagnosis)
    verdict = summary->diagnosis->healthy() ? "healthy" : "failure diagnosed";
  std::string h;
  h.reserve(1 << 16);
  h += "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><meta name=\"viewport\" "
       "content=\"width=device-width\"><title>" +
       title + "</title><style>";
  h += html_style();
  h += "</style></head><body><h1>" + title + "</h1>";
  h += fmt::format(
      "<section id=\"summary\"><div class=\"kpi\"><div>steps recorded <b>{}</b></div><div>last "
      "step <b>{}</b></div><div>layers <b>{}</b></div><div>events <b>{}</b></div><div>alerts "
      "<b>{}</b></div><div>verdict <b id=\"verdict\">{}</b></div></div></section>",
      run.steps(), run.last_step(), run.rows().size(), run.events_total(),
      summary ? summary->alerts_total : 0, verdict);
  h += "<section id=\"diagnosis\"><h2>Diagnosis</h2>" + diagnosis_html(summary) + "</section>";
  h += "<section id=\"loss\"><h2>Loss</h2>" + loss_svg(run) + "</section>";
  h += "<section id=\"gradient-flow\"><h2>Gradient flow</h2><p class=\"muted\">Per-layer "
       "gradient L2 norm across layers in forward order (log scale).</p>" +
       gradient_flow_svg(run) + "</section>";
  h += "<section id=\"health-heatmap\"><h2>Health: layers &times; steps</h2><label><input "
       "type=\"checkbox\" id=\"only-unhealthy\"> only layers that were ever unhealthy</label>" +
       heatmap_svg(run) + "</section>";
  h += "<section id=\"histograms\"><h2>Activation histograms</h2>" + histograms_html(run) +
       "</section>";
  h += "<section id=\"events\"><h2>Events</h2>" + events_svg(run) + "</section>";
  h += "<section id=\"alerts\"><h2>Alerts</h2>" + alerts_html(summary) + "</section>";
  h += "<footer class=\"muted\">torchdbg report; a self-contained file (no network "
       "access).</footer>";
  h += html_report_script();
  h += "</body></html>\n";
  return h;
}

}  // namespace torchdbg::detail
