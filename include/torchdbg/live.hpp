// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// A live page served by the training process (opt-in, not in the umbrella header): the step
// and loss as they advance, the layers' health heatmap, the loss curve, recent events and
// alerts, and when the run pauses the diagnosis with its causal graph; "Pause now" and
// "Resume" act on the loop through the manager's pause flag, which the loop already polls.
// Built on cpp-httplib (Debian: libcpp-httplib-dev; link `pkg-config --libs cpp-httplib`).
//
// ```cpp
// #include <torchdbg/live.hpp>
// torchdbg::LiveServer live(hooks, health, reporter);  // after reporter.install(hooks, &health)
// std::cout << "open " << live.url() << "\n";
// ```
//
// Security: it binds to 127.0.0.1 unless LiveOptions::host names another address; every
// request needs the random token of the printed URL (compared in constant time, before any
// route and before a body is read); pause and resume only by POST; no chunked, encoded or
// oversized bodies; worker threads and waiting connections are bounded, and so are each
// request's time and bytes in all (on Linux; see docs/reports.md); only its own routes exist.
// Requests read snapshots: the training thread never waits on one beyond the reporter's and
// the monitor's own short locks.
//
// Routes (each with `?token=...`, or the token in an `X-Torchdbg-Token` header):
//   GET  /          the page
//   GET  /state     JSON: {"step" (the last recorded), "manager_step", "loss" (null when
//                   none or not finite), "loss_text" ("nan", "inf", or 4 digits), "steps",
//                   "paused", "pause": {reason, layer, step, source} or null, "events",
//                   "alerts", "layers": [{name, state}] (the monitor's now, forward order),
//                   "diagnosis": {summary, hypotheses} or null (while paused)}
//   GET  /sections  the page's sections as HTML (what the page refreshes)
//   POST /pause     raises the pause flag (reason "paused from the live page")
//   POST /resume    clears it

#include <httplib.h>
#include <nlohmann/json.hpp>
#include <torch/arg.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "torchdbg/detail/connection_guard.hpp"
#include "torchdbg/diagnosis.hpp"
#include "torchdbg/error.hpp"
#include "torchdbg/exporters/exporter.hpp"
#include "torchdbg/exporters/html/diagnosis.hpp"
#include "torchdbg/exporters/html/heatmap.hpp"
#include "torchdbg/exporters/html/page.hpp"
#include "torchdbg/exporters/html/plots.hpp"
#include "torchdbg/exporters/html/run.hpp"
#include "torchdbg/health.hpp"
#include "torchdbg/hook_manager.hpp"
#include "torchdbg/report.hpp"

namespace torchdbg {

struct LiveOptions {
  /// The address to listen on; another than 127.0.0.1 only when named here.
  TORCH_ARG(std::string, host) = "127.0.0.1";
  /// The port (0: a free one, see LiveServer::port).
  TORCH_ARG(int, port) = 0;
  /// The token every request must carry (empty: 128 random bits, in hex).
  TORCH_ARG(std::string, token);
  /// Requests served at once (worker threads); more wait for a free worker.
  TORCH_ARG(std::size_t, max_connections) = 4;
  /// Connections waiting for a worker at most; more are closed at once.
  TORCH_ARG(std::size_t, max_queued) = 16;
  /// Bytes of a request body at most (pause and resume need none). A request's line and
  /// headers may add 64 KiB; a connection that sends more before its response is closed.
  TORCH_ARG(std::size_t, max_request_bytes) = 4096;
  /// Seconds a request may take in all, from when a worker takes its connection (or from
  /// the previous response on it) to the end of its response; a slower one's connection is
  /// closed (on Linux; elsewhere cpp-httplib's timeout applies to each read).
  TORCH_ARG(int64_t, timeout_seconds) = 5;
  /// How often the page refreshes, in milliseconds.
  TORCH_ARG(int64_t, refresh_ms) = 1000;
  /// Print "torchdbg live page: <url>" to stderr once serving.
  TORCH_ARG(bool, print_url) = true;
  /// What the page keeps and draws (title, loss points, heatmap columns, ...).
  TORCH_ARG(HtmlOptions, html) = HtmlOptions().title("torchdbg live");
};

namespace detail {

/// Whether `a` equals `b`, in a time that depends on their lengths only.
inline bool same_token(const std::string& a, const std::string& b) {
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  const std::size_t n = std::max(a.size(), b.size());
  for (std::size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff = static_cast<unsigned char>(diff | (x ^ y));
  }
  return diff == 0;
}

inline std::string random_token() {
  std::random_device rd;
  std::string t;
  for (int i = 0; i < 4; ++i) t += fmt::format("{:08x}", static_cast<uint32_t>(rd()));
  return t;
}

/// The reporter's steps as the live page draws them (an exporter of the reporter).
class LiveRecord : public BaseExporter<std::mutex> {
 public:
  explicit LiveRecord(const HtmlOptions& options) : run_(options) {}
  /// The page's sections now, drawn from a copy of the record (the lock is held for the copy
  /// only, so the reporter's next step never waits on the drawing).
  std::string sections(const std::optional<RunSummary>& summary, const std::string& layers_table) const {
    const HtmlRun run = snapshot();
    std::string h;
    h += "<section id=\"diagnosis\"><h2>Diagnosis</h2>" + diagnosis_html(summary) + "</section>";
    h += "<section id=\"layers\"><h2>Layers now</h2>" + layers_table + "</section>";
    h += "<section id=\"loss\"><h2>Loss</h2>" + loss_svg(run) + "</section>";
    h += "<section id=\"health-heatmap\"><h2>Health: layers &times; steps</h2>" + heatmap_svg(run) + "</section>";
    h += "<section id=\"gradient-flow\"><h2>Gradient flow</h2>" + gradient_flow_svg(run) + "</section>";
    h += "<section id=\"events\"><h2>Events</h2>" + events_svg(run) + "</section>";
    h += "<section id=\"alerts\"><h2>Alerts</h2>" + alerts_html(summary) + "</section>";
    return h;
  }
  /// What /state reports of the recorded steps.
  void state(nlohmann::json& j) const {
    std::optional<double> loss;
    const HtmlRun run = snapshot(&loss);
    j["steps"] = run.steps();
    j["step"] = run.steps() > 0 ? nlohmann::json(run.last_step()) : nlohmann::json();
    j["loss"] = loss ? json_number(*loss) : nlohmann::json();
    // A diverged loss is not "no loss yet": "nan", "inf", "-inf" or the number's 4 digits.
    j["loss_text"] = loss ? nlohmann::json(loss_text(*loss)) : nlohmann::json();
    j["events"] = run.events_total();
  }
  static std::string loss_text(double v) {
    if (std::isnan(v)) return "nan";
    if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
    return html_number(v);
  }
  /// After the server is gone the reporter still calls this exporter: it records nothing.
  void detach() noexcept { detached_ = true; }

 protected:
  void write_step_(const StepRecord& r) override {
    if (detached_) return;
    run_.add(r);
    if (r.loss) last_loss_ = *r.loss;
  }

 private:
  HtmlRun snapshot(std::optional<double>* loss = nullptr) const {
    std::lock_guard<std::mutex> lock(mutex_);
    if (loss != nullptr) *loss = last_loss_;
    return run_;
  }
  HtmlRun run_;
  std::optional<double> last_loss_;
  std::atomic<bool> detached_{false};
};

}  // namespace detail

/// Serves the live page on its own thread until destroyed (or stop()).
///
/// Thread safety: construct and destroy on one thread; url(), port(), token() and stop() from
/// any while the server exists (a stop() waits for one under way on another thread).
/// The manager, monitor and reporter must outlive the server.
class LiveServer {
 public:
  /// Starts serving; throws torchdbg::Error naming the address when it cannot listen there.
  LiveServer(HookManager& hooks, HealthMonitor& health, Reporter& reporter, LiveOptions options = {})
      : hooks_(hooks), health_(health), options_(std::move(options)) {
    detail::require_at_least<int64_t>(static_cast<int64_t>(options_.max_connections()), 1,
                                      "LiveOptions::max_connections");
    detail::require_at_least<int64_t>(options_.timeout_seconds(), 1, "LiveOptions::timeout_seconds");
    detail::require_at_least<int64_t>(options_.refresh_ms(), 100, "LiveOptions::refresh_ms");
    if (options_.port() < 0 || options_.port() > 65535)
      throw Error("torchdbg: LiveOptions::port must be in [0, 65535], got " + std::to_string(options_.port()));
    token_ = options_.token().empty() ? detail::random_token() : checked_token(options_.token());
    record_ = std::make_shared<detail::LiveRecord>(options_.html());
    routes();
    server_.set_payload_max_length(options_.max_request_bytes());
    server_.set_read_timeout(static_cast<time_t>(options_.timeout_seconds()), 0);
    server_.set_write_timeout(static_cast<time_t>(options_.timeout_seconds()), 0);
    server_.set_keep_alive_max_count(16);
    server_.set_keep_alive_timeout(2);
    // SO_REUSEADDR only: cpp-httplib's default also sets SO_REUSEPORT, which would let a
    // second server (or another process) bind the same port and take half its connections.
    server_.set_socket_options([](auto sock) {
      int yes = 1;
      ::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof yes);
    });
    const std::vector<uint64_t> listening = detail::ConnectionGuard::listening_sockets();
    port_ = options_.port() == 0 ? server_.bind_to_any_port(options_.host())
                                 : (server_.bind_to_port(options_.host(), options_.port()) ? options_.port() : -1);
    if (port_ <= 0)
      throw Error("torchdbg: LiveServer cannot listen on " + options_.host() + ":" + std::to_string(options_.port()));
    detail::ConnectionLimits limits;
    limits.workers = options_.max_connections();
    limits.queued = options_.max_queued();
    limits.request_time = std::chrono::seconds(options_.timeout_seconds());
    limits.request_bytes = (uint64_t{64} << 10) + options_.max_request_bytes();
    guard_ = std::make_shared<detail::ConnectionGuard>(options_.host(), port_, limits, listening);
    server_.new_task_queue = [guard = guard_] { return new detail::GuardedPool(guard); };
    server_.set_logger([guard = guard_](const httplib::Request&, const httplib::Response&) {
      guard->responded(detail::current_connection);
    });
    reporter.add_exporter(record_);  // only once listening: a failed start leaves none behind
    thread_ = std::thread([this] {
      server_.listen_after_bind();
      finished_ = true;
    });
    // Serving once this returns: stop() before the server runs would not reach it.
    for (int i = 0; i < 10000 && !server_.is_running() && !finished_; ++i)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    if (options_.print_url()) fmt::print(stderr, "torchdbg live page: {}\n", url());
  }
  LiveServer(const LiveServer&) = delete;
  LiveServer& operator=(const LiveServer&) = delete;
  ~LiveServer() {
    stop();
    record_->detach();
  }

  /// The page's address with its token, e.g. http://127.0.0.1:40123/?token=...
  [[nodiscard]] std::string url() const {
    const std::string host = options_.host().find(':') != std::string::npos ? "[" + options_.host() + "]" : options_.host();
    return "http://" + host + ":" + std::to_string(port_) + "/?token=" + token_;
  }
  [[nodiscard]] int port() const noexcept { return port_; }
  [[nodiscard]] const std::string& token() const noexcept { return token_; }
  /// Stops serving: closes every open connection and joins the server's thread (the
  /// reporter keeps the record, unused).
  void stop() {
    std::lock_guard<std::mutex> lock(stop_mutex_);  // one stop at a time, the destructor's too
    if (!thread_.joinable()) return;
    guard_->stop();  // open connections end now, slow clients' too
    while (!finished_) {  // until the listening loop has seen it
      server_.stop();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    thread_.join();
  }

 private:
  /// A token of the user's: 16 to 256 characters a URL carries as they are.
  static std::string checked_token(const std::string& t) {
    const bool plain = std::all_of(t.begin(), t.end(), [](char c) {
      return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_' ||
             c == '.' || c == '~';
    });
    if (!plain || t.size() < 16 || t.size() > 256)
      throw Error("torchdbg: LiveOptions::token must be 16 to 256 characters of A-Z, a-z, 0-9, '-', '_', '.', '~' (got " +
                  std::to_string(t.size()) + " characters" + (plain ? "" : ", some of them others") + ")");
    return t;
  }
  bool allowed(const httplib::Request& req) const {
    std::string given = req.get_header_value("X-Torchdbg-Token");
    if (given.empty() && req.has_param("token")) given = req.get_param_value("token");
    return detail::same_token(given, token_);
  }
  /// Before a request's body is read and before any route: the token, and no body beyond
  /// max_request_bytes (pause and resume need none). A refusal closes the connection.
  httplib::Server::HandlerResponse screen(const httplib::Request& req, httplib::Response& res) const {
    const auto refuse = [&](int status, const std::string& why) {
      res.status = status;
      res.set_header("Connection", "close");
      res.set_content("torchdbg live: " + why + "\n", "text/plain");
      return httplib::Server::HandlerResponse::Handled;
    };
    if (!allowed(req)) return refuse(403, "a valid token is needed (the one in the printed URL)");
    if (req.has_header("Transfer-Encoding") || req.has_header("Content-Encoding"))
      return refuse(413, "no chunked or encoded request bodies");
    if (req.has_header("Content-Length")) {
      const std::string n = req.get_header_value("Content-Length");
      const bool digits = !n.empty() && n.size() <= 18 && std::all_of(n.begin(), n.end(), [](char c) {
        return c >= '0' && c <= '9';
      });
      if (!digits || std::stoull(n) > options_.max_request_bytes())
        return refuse(413, "a request body is at most " + std::to_string(options_.max_request_bytes()) + " bytes");
    } else if (req.method == "POST" || req.method == "PUT" || req.method == "PATCH") {
      return refuse(411, "a Content-Length is needed");
    }
    return httplib::Server::HandlerResponse::Unhandled;
  }
  static void no_store(httplib::Response& res) {
    res.set_header("Cache-Control", "no-store");
    res.set_header("X-Content-Type-Options", "nosniff");
    res.set_header("Content-Security-Policy",
                   "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; "
                   "img-src data:");
  }
  /// The monitor's layers now, in forward order.
  std::vector<LayerHealth> layers_now() const {
    std::vector<LayerHealth> now = health_.layers();
    std::stable_sort(now.begin(), now.end(), [](const LayerHealth& a, const LayerHealth& b) { return a.order < b.order; });
    return now;
  }
  static int layer_rank(const LayerHealth& l) {
    int rank = 0;
    if (l.has_activation) rank = std::max(rank, detail::state_rank(to_string(l.activation)));
    if (l.has_gradient) rank = std::max(rank, detail::state_rank(to_string(l.gradient)));
    return rank;
  }
  /// The per-layer health table: each layer's state (the worse of its two) and both states.
  std::string layers_table() const {
    const std::vector<LayerHealth> now = layers_now();
    if (now.empty()) return "<p class=\"empty\">No layers observed yet.</p>";
    std::string t =
        "<table class=\"layers\"><tr><th>layer</th><th>state</th><th>activation</th><th>gradient</th></tr>";
    for (const LayerHealth& l : now) {
      const int rank = layer_rank(l);
      t += fmt::format("<tr class=\"{}\" data-layer=\"{}\"><td>{}</td><td><i style=\"background:{}\"></i> {}</td>"
                       "<td>{}</td><td>{}</td></tr>",
                       rank > 1 ? "alarm" : "info", detail::html_escape(l.name), detail::html_escape(l.name),
                       detail::rank_color(rank), detail::rank_name(rank),
                       l.has_activation ? to_string(l.activation) : "-", l.has_gradient ? to_string(l.gradient) : "-");
    }
    return t + "</table>";
  }
  /// The summary the sections show: the diagnosis while paused, and the alerts.
  std::optional<RunSummary> summary() {
    std::optional<RunSummary> out(std::in_place);
    RunSummary& s = *out;
    const auto alerts = hooks_.alerts();
    s.alerts_total = hooks_.alert_count();
    const std::size_t first = alerts.size() > 50 ? alerts.size() - 50 : 0;
    s.alerts.assign(alerts.begin() + static_cast<std::ptrdiff_t>(first), alerts.end());
    if (hooks_.is_paused()) s.diagnosis.emplace(diagnosis());
    return out;
  }
  /// The diagnosis, made once per pause (diagnose() reads the monitor under its lock): a
  /// new step, pause or alert makes it again.
  Diagnosis diagnosis() {
    std::lock_guard<std::mutex> lock(diagnosis_mutex_);
    std::string key = std::to_string(hooks_.step()) + "/" + std::to_string(hooks_.alert_count());
    if (const auto p = hooks_.pause_info()) key += "/" + std::to_string(p->step) + "/" + p->hook_name + "/" + p->layer + "/" + p->reason;
    if (!diagnosis_ || diagnosis_key_ != key) {
      diagnosis_ = diagnose(health_);
      diagnosis_key_ = std::move(key);
    }
    return *diagnosis_;
  }

  std::string page() const {
    std::string h =
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><meta name=\"viewport\" "
        "content=\"width=device-width\"><title>" +
        detail::html_escape(options_.html().title()) + "</title><style>";
    h += detail::html_style();
    h += "#bar{position:sticky;top:0;background:#fff;padding:6px 0;border-bottom:1px solid #ddd}"
         "#bar button{margin-right:8px}.paused{color:#b3001b}"
         "table.layers i{display:inline-block;width:10px;height:10px;vertical-align:middle}";
    h += "</style></head><body><h1>" + detail::html_escape(options_.html().title()) + "</h1>";
    h += "<div id=\"bar\" class=\"kpi\"><div>step <b id=\"step\">-</b></div><div>loss <b id=\"loss\">-</b></div>"
         "<div>state <b id=\"run-state\">-</b></div><div><button id=\"pause\">Pause now</button>"
         "<button id=\"resume\">Resume</button></div></div>";
    h += "<div id=\"sections\"></div>";
    h += fmt::format(
        "<script>(function(){{var token={};var every={};"
        "function q(p){{return p+'?token='+encodeURIComponent(token);}}"
        "function refresh(){{fetch(q('/state'),{{cache:'no-store'}}).then(function(r){{return r.json();}})"
        ".then(function(s){{document.getElementById('step').textContent=s.step===null?'-':s.step;"
        "document.getElementById('loss').textContent=s.loss_text===null?'-':s.loss_text;"
        "var st=document.getElementById('run-state');st.textContent=s.paused?'paused':'running';"
        "st.className=s.paused?'paused':'';"
        "document.body.setAttribute('data-step',s.step===null?'':s.step);"
        "document.body.setAttribute('data-paused',s.paused?'1':'0');}}).catch(function(){{}});"
        "fetch(q('/sections'),{{cache:'no-store'}}).then(function(r){{return r.text();}})"
        ".then(function(t){{document.getElementById('sections').innerHTML=t;"
        "document.body.setAttribute('data-refreshed',String(Date.now()));}}).catch(function(){{}});}}"
        "function post(p){{fetch(q(p),{{method:'POST',headers:{{'X-Torchdbg-Token':token}}}}).then(refresh);}}"
        "document.getElementById('pause').addEventListener('click',function(){{post('/pause');}});"
        "document.getElementById('resume').addEventListener('click',function(){{post('/resume');}});"
        "refresh();setInterval(refresh,every);}})();</script>",
        nlohmann::json(token_).dump(), options_.refresh_ms());
    h += "</body></html>\n";
    return h;
  }

  void routes() {
    server_.set_pre_routing_handler(
        [this](const httplib::Request& req, httplib::Response& res) { return screen(req, res); });
    server_.Get("/", [this](const httplib::Request&, httplib::Response& res) {
      no_store(res);
      res.set_content(page(), "text/html; charset=utf-8");
    });
    server_.Get("/state", [this](const httplib::Request&, httplib::Response& res) {
      nlohmann::json j;
      record_->state(j);
      const bool paused = hooks_.is_paused();  // read once: paused, pause and diagnosis agree
      j["paused"] = paused;
      j["pause"] = nullptr;
      // The monitor's layers now (the record's last step ends when the next one begins).
      nlohmann::json layers = nlohmann::json::array();
      for (const LayerHealth& l : layers_now())
        layers.push_back({{"name", detail::valid_utf8(l.name)}, {"state", detail::rank_name(layer_rank(l))}});
      j["layers"] = std::move(layers);
      if (const auto p = hooks_.pause_info(); p && paused)
        j["pause"] = {{"reason", detail::valid_utf8(p->reason)},
                      {"layer", detail::valid_utf8(p->layer)},
                      {"step", p->step},
                      {"source", detail::valid_utf8(p->hook_name)}};
      j["manager_step"] = hooks_.step();
      j["alerts"] = hooks_.alert_count();
      j["diagnosis"] = nullptr;
      if (paused) {
        const Diagnosis d = diagnosis();
        nlohmann::json hyps = nlohmann::json::array();
        for (std::size_t i = 0; i < d.hypotheses.size() && i < 10; ++i)
          hyps.push_back({{"kind", to_string(d.hypotheses[i].kind)},
                          {"layer", detail::valid_utf8(d.hypotheses[i].layer)},
                          {"step", d.hypotheses[i].step},
                          {"confidence", json_number(d.hypotheses[i].confidence)}});
        j["diagnosis"] = {{"summary", detail::valid_utf8(d.summary())}, {"hypotheses", std::move(hyps)}};
      }
      no_store(res);
      res.set_content(j.dump(), "application/json");
    });
    server_.Get("/sections", [this](const httplib::Request&, httplib::Response& res) {
      no_store(res);
      res.set_content(record_->sections(summary(), layers_table()), "text/html; charset=utf-8");
    });
    const auto act = [this](bool pause) {
      return [this, pause](const httplib::Request&, httplib::Response& res) {
        if (pause) {
          hooks_.pause_training("paused from the live page");
        } else {
          hooks_.resume_training();
        }
        no_store(res);
        res.set_content(nlohmann::json({{"paused", hooks_.is_paused()}}).dump(), "application/json");
      };
    };
    server_.Post("/pause", act(true));
    server_.Post("/resume", act(false));
    const auto post_only = [](const httplib::Request&, httplib::Response& res) {
      res.status = 405;
      res.set_header("Allow", "POST");
      res.set_content("torchdbg live: use POST\n", "text/plain");
    };
    server_.Get("/pause", post_only);
    server_.Get("/resume", post_only);
  }

  HookManager& hooks_;
  HealthMonitor& health_;
  LiveOptions options_;
  std::string token_;
  std::shared_ptr<detail::LiveRecord> record_;
  std::shared_ptr<detail::ConnectionGuard> guard_;
  httplib::Server server_;
  std::thread thread_;
  std::mutex stop_mutex_;
  std::atomic<bool> finished_{false};
  int port_ = -1;
  std::mutex diagnosis_mutex_;
  std::optional<Diagnosis> diagnosis_;
  std::string diagnosis_key_;
};

}  // namespace torchdbg
