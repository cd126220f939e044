// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#include <torch/torch.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <fcntl.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "catch.hpp"
#include "helpers.hpp"
#include "torchdbg/live.hpp"
#include "torchdbg/torchdbg.hpp"

namespace {

struct LiveNet : torch::nn::Module {
  LiveNet() {
    fc0 = register_module("fc0", torch::nn::Linear(8, 16));
    fc1 = register_module("fc1", torch::nn::Linear(16, 16));
    fc2 = register_module("fc2", torch::nn::Linear(16, 3));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(fc1(torch::relu(fc0(x))))); }
  torch::nn::Linear fc0{nullptr}, fc1{nullptr}, fc2{nullptr};
};

/// A monitored training loop the live page watches: attach, a pausing health monitor and a
/// reporter, as the README's quick start plus `LiveServer`.
struct Loop {
  std::shared_ptr<LiveNet> net = std::make_shared<LiveNet>();
  torch::optim::SGD opt{net->parameters(), 0.05};
  torchdbg::HookManager hooks;
  torchdbg::HealthMonitor health{torchdbg::HealthOptions().on_failure(torchdbg::OnFailure::Pause)};
  torchdbg::Reporter reporter;
  torchdbg::HealthInstallation<std::mutex, std::mutex> fed = health.install(hooks);
  torchdbg::ReporterInstallation rep = reporter.install(hooks, &health);
  torchdbg::AttachSession session = torchdbg::attach(*net, hooks);
  torch::Tensor x = torch::randn({32, 8}), y = torch::randint(0, 3, {32});
  double last_loss = 0;

  /// One step (its update skipped when the step paused); false when paused.
  bool step(int64_t s) {
    hooks.set_step(s);
    opt.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(net->forward(x), y);
    last_loss = loss.item<double>();
    hooks.set_loss(last_loss);
    loss.backward();
    if (hooks.is_paused()) return false;
    opt.step();
    return true;
  }
};

httplib::Headers with_token(const std::string& token) { return {{"X-Torchdbg-Token", token}}; }

/// A new connection to 127.0.0.1:`port`.
int connect_local(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  return fd;
}

/// A new connection to [::1]:`port`.
int connect_local6(int port) {
  const int fd = ::socket(AF_INET6, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in6 a{};
  a.sin6_family = AF_INET6;
  a.sin6_port = htons(static_cast<uint16_t>(port));
  a.sin6_addr = in6addr_loopback;
  REQUIRE(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  return fd;
}

/// Sends all of `text` on `fd`.
void send_all(int fd, const std::string& text) {
  REQUIRE(::send(fd, text.data(), text.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(text.size()));
}

/// Sends `head` (a request's line and headers) on a new connection to 127.0.0.1:`port`, then
/// nothing more, and returns the status of what comes back within 10 s (-1: nothing).
int raw_status(int port, const std::string& head) {
  const int fd = connect_local(port);
  timeval tv{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  send_all(fd, head);
  char buf[64] = {};
  const ssize_t n = ::recv(fd, buf, sizeof buf - 1, 0);
  ::close(fd);
  if (n < 12) return -1;
  return std::atoi(buf + 9);  // "HTTP/1.1 413 ..."
}

/// Whether the server has ended connection `fd` (its end arrives, or the reset) within `ms`;
/// whatever else it sent first is read and dropped.
bool ended_within(int fd, int ms) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(ms);
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - std::chrono::steady_clock::now());
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, static_cast<int>(std::max<int64_t>(left.count(), 0))) <= 0) return false;
    char buf[4096];
    const ssize_t n = ::recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n <= 0) return true;
  }
}

/// Seconds since `t0`.
double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// Whether the page answers a request for /state (a new connection, 10 s at most).
bool answers(const torchdbg::LiveServer& live) {
  httplib::Client c("127.0.0.1", live.port());
  c.set_read_timeout(10, 0);
  auto r = c.Get("/state", with_token(live.token()));
  return r && r->status == 200;
}

/// Sends a byte every 50 ms on `fd` (each read far inside any timeout) until the server ends
/// the connection: the seconds that took, or infinity when it had not after 10 s. No
/// assertions: it runs on other threads too.
double trickle(int fd) {
  const auto start = std::chrono::steady_clock::now();
  while (since(start) < 10)
    if (::send(fd, "a", 1, MSG_NOSIGNAL) != 1 || ended_within(fd, 50)) return since(start);
  return std::numeric_limits<double>::infinity();
}

/// One response read from `fd` (status line, headers, a Content-Length body): its status,
/// or -1 when the connection ends first.
int read_response(int fd) {
  std::string got;
  char buf[4096];
  std::size_t body_at = std::string::npos, length = 0;
  while (body_at == std::string::npos || got.size() < body_at + length) {
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) return -1;
    got.append(buf, static_cast<std::size_t>(n));
    if (body_at == std::string::npos && got.find("\r\n\r\n") != std::string::npos) {
      body_at = got.find("\r\n\r\n") + 4;
      const std::size_t cl = got.find("Content-Length: ");
      if (cl != std::string::npos && cl < body_at) length = std::stoul(got.substr(cl + 16));
    }
  }
  return std::atoi(got.c_str() + 9);
}

/// Two servers on one port number (`connect_a`/`connect_b` reach each): a kept-alive
/// connection to each, used past its 1 s timeout while both accept new connections; each
/// response restarts its time, and neither server's guard takes the other's connections.
void keep_apart(const torchdbg::LiveServer& a, int (*connect_a)(int), const torchdbg::LiveServer& b,
                int (*connect_b)(int)) {
  const auto request = [](const torchdbg::LiveServer& s, bool close) {
    return "GET /state?token=" + s.token() + " HTTP/1.1\r\nHost: x\r\n" + (close ? "Connection: close\r\n" : "") +
           "\r\n";
  };
  const int kept_a = connect_a(a.port()), kept_b = connect_b(b.port());
  for (int i = 0; i < 6; ++i) {
    INFO("round " << i);
    send_all(kept_a, request(a, false));
    CHECK(read_response(kept_a) == 200);
    send_all(kept_b, request(b, false));
    CHECK(read_response(kept_b) == 200);
    for (const auto& [server, connect] : {std::pair{&a, connect_a}, std::pair{&b, connect_b}}) {
      const int fresh = connect(server->port());
      send_all(fresh, request(*server, true));
      CHECK(read_response(fresh) == 200);
      ::close(fresh);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
  }
  ::close(kept_a);
  ::close(kept_b);
}

}  // namespace

TEST_CASE("live page: every route needs the token; pause and resume only by POST; nothing else is served",
          "[live]") {
  torchdbg::HookManager hooks;
  torchdbg::HealthMonitor health;
  torchdbg::Reporter reporter;
  torchdbg::LiveServer live(hooks, health, reporter);
  const std::string t = live.token();
  CHECK(t.size() == 32);
  CHECK(live.url() == "http://127.0.0.1:" + std::to_string(live.port()) + "/?token=" + t);
  httplib::Client c("127.0.0.1", live.port());
  c.set_read_timeout(10, 0);

  // The page, with the token in the URL as printed.
  auto r = c.Get(("/?token=" + t).c_str());
  REQUIRE(r);
  CHECK(r->status == 200);
  CHECK(r->body.find("Pause now") != std::string::npos);
  CHECK(r->body.find("Resume") != std::string::npos);
  CHECK(r->get_header_value("Cache-Control") == "no-store");
  // No token, a wrong one of the same length, a prefix, one with a byte more: refused.
  std::string wrong = t;
  wrong[7] = wrong[7] == 'a' ? 'b' : 'a';
  for (const std::string& path : std::vector<std::string>{"/", "/?token=" + wrong, "/?token=" + t.substr(0, 31), "/?token=" + t + "0", "/state",
        "/sections", "/state?token=", "/sections?token=" + wrong}) {
    INFO(path);
    auto x = c.Get(path.c_str());
    REQUIRE(x);
    CHECK(x->status == 403);
    CHECK(x->body.find(t) == std::string::npos);
  }
  CHECK(c.Post("/pause", with_token(wrong), "", "text/plain")->status == 403);
  CHECK(c.Get("/pause")->status == 403);  // the token first, whatever the route or method
  CHECK_FALSE(hooks.is_paused());
  // GET never changes state.
  for (const char* p : {"/pause", "/resume"}) {
    auto x = c.Get((std::string(p) + "?token=" + t).c_str());
    REQUIRE(x);
    CHECK(x->status == 405);
    CHECK(x->get_header_value("Allow") == "POST");
  }
  CHECK_FALSE(hooks.is_paused());
  // POST with the token, in a header or in the query.
  r = c.Post("/pause", with_token(t), "", "text/plain");
  REQUIRE(r);
  CHECK(r->status == 200);
  CHECK(nlohmann::json::parse(r->body)["paused"] == true);
  CHECK(hooks.is_paused());
  REQUIRE(hooks.pause_info().has_value());
  CHECK(hooks.pause_info()->reason == "paused from the live page");
  r = c.Post(("/resume?token=" + t).c_str(), "", "text/plain");
  REQUIRE(r);
  CHECK(r->status == 200);
  CHECK_FALSE(hooks.is_paused());
  // Only its own routes: paths outside them, traversals included, are not found.
  for (const std::string& path : std::vector<std::string>{"/../etc/passwd", "/%2e%2e/%2e%2e/etc/passwd", "/state/../../etc/passwd",
                                  "/index.html", "//etc/passwd", "/sections/x"}) {
    INFO(path);
    auto x = c.Get((path + "?token=" + t).c_str());
    REQUIRE(x);
    CHECK(x->status == 404);
  }
  // A body beyond max_request_bytes is refused before any handler runs.
  r = c.Post("/pause", with_token(t), std::string(64 << 10, 'x'), "text/plain");
  REQUIRE(r);
  CHECK(r->status == 413);
  CHECK_FALSE(hooks.is_paused());
  // Bodies are refused before they are read, with or without the token: chunked, encoded,
  // without a length, or a length that is not a small number.
  const std::string tok = "X-Torchdbg-Token: " + t + "\r\n";
  for (const auto& [head, status] : std::vector<std::pair<std::string, int>>{
           {"POST /pause HTTP/1.1\r\nHost: x\r\n" + tok + "Transfer-Encoding: chunked\r\n\r\n", 413},
           {"POST /nope HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", 403},
           {"POST /pause HTTP/1.1\r\nHost: x\r\n" + tok + "Content-Encoding: gzip\r\nContent-Length: 20\r\n\r\n", 413},
           {"POST /pause HTTP/1.1\r\nHost: x\r\n" + tok + "\r\n", 411},
           {"POST /pause HTTP/1.1\r\nHost: x\r\n" + tok + "Content-Length: 99999999999999999999999\r\n\r\n", 413},
           {"POST /pause HTTP/1.1\r\nHost: x\r\n" + tok + "Content-Length: 1e9\r\n\r\n", 413},
           {"POST /pause HTTP/1.1\r\nHost: x\r\n" + tok + "Content-Length: 100000\r\n\r\n", 413}}) {
    INFO(head);
    CHECK(raw_status(live.port(), head) == status);
  }
  CHECK_FALSE(hooks.is_paused());
  // A request line or headers beyond the library's limit (8 KiB) are refused too.
  r = c.Get(("/state?token=" + t + "&pad=" + std::string(16 << 10, 'y')).c_str());
  CHECK((!r || r->status >= 400));
}

TEST_CASE("live page: options are checked and the address is the one named", "[live]") {
  torchdbg::HookManager hooks;
  torchdbg::HealthMonitor health;
  torchdbg::Reporter reporter;
  CHECK_THROWS_WITH(torchdbg::LiveServer(hooks, health, reporter, torchdbg::LiveOptions().port(70000)),
                    Catch::Contains("LiveOptions::port") && Catch::Contains("70000"));
  CHECK_THROWS_WITH(torchdbg::LiveServer(hooks, health, reporter, torchdbg::LiveOptions().max_connections(0)),
                    Catch::Contains("max_connections"));
  CHECK_THROWS_WITH(torchdbg::LiveServer(hooks, health, reporter, torchdbg::LiveOptions().refresh_ms(5)),
                    Catch::Contains("refresh_ms"));
  CHECK_THROWS_WITH(torchdbg::LiveServer(hooks, health, reporter, torchdbg::LiveOptions().host("no.such.host.invalid")),
                    Catch::Contains("cannot listen") && Catch::Contains("no.such.host.invalid"));
  // A port already taken: refused with the address named.
  torchdbg::LiveServer first(hooks, health, reporter, torchdbg::LiveOptions().token("fixed-token-0123456789"));
  CHECK(first.token() == "fixed-token-0123456789");
  // A token of the user's: long enough, and only characters a URL carries as they are.
  for (const std::string& bad : std::vector<std::string>{"short", "</script><script>x()</script>", "a b&c#d-0123456789",
                                                         std::string("tok\xff\xfe-0123456789abcdef"), std::string(300, 'a')})
    CHECK_THROWS_WITH(torchdbg::LiveServer(hooks, health, reporter, torchdbg::LiveOptions().token(bad)),
                      Catch::Contains("LiveOptions::token"));
  CHECK_THROWS_WITH(torchdbg::LiveServer(hooks, health, reporter, torchdbg::LiveOptions().port(first.port())),
                    Catch::Contains("127.0.0.1:" + std::to_string(first.port())));
  // Two servers on one run get different random tokens.
  torchdbg::LiveServer second(hooks, health, reporter);
  torchdbg::LiveServer third(hooks, health, reporter);
  CHECK(second.token() != third.token());
  second.stop();
  second.stop();  // idempotent
}

TEST_CASE("live page: follows a training loop, shows the diagnosis when it pauses, resumes from the page",
          "[live]") {
  torch::manual_seed(21);
  Loop loop;
  torchdbg::LiveServer live(loop.hooks, loop.health, loop.reporter);
  httplib::Client c("127.0.0.1", live.port());
  c.set_read_timeout(30, 0);
  const auto state = [&] {
    auto r = c.Get("/state", with_token(live.token()));
    REQUIRE(r);
    REQUIRE(r->status == 200);
    return nlohmann::json::parse(r->body);
  };
  auto s = state();
  CHECK(s["step"].is_null());
  CHECK(s["paused"] == false);
  // The monitor finishes a step when the next one begins: the page shows the step before.
  std::vector<double> losses;
  for (int64_t step = 0; step < 6; ++step) {
    REQUIRE(loop.step(step));
    losses.push_back(loop.last_loss);
    s = state();
    CHECK(s["manager_step"] == step);
    CHECK(s["steps"] == step);
    if (step == 0) {
      CHECK(s["step"].is_null());
      CHECK(s["loss"].is_null());
      continue;
    }
    CHECK(s["step"] == step - 1);
    CHECK(s["loss"].get<double>() == losses[static_cast<std::size_t>(step - 1)]);
  }
  std::vector<std::string> names;
  for (const auto& l : s["layers"]) names.push_back(l["name"]);
  CHECK(std::find(names.begin(), names.end(), "fc1") != names.end());
  for (const auto& l : s["layers"]) CHECK(l["state"] == "healthy");
  auto sections = c.Get("/sections", with_token(live.token()));
  REQUIRE(sections);
  for (const char* id : {"id=\"loss-plot\"", "id=\"heatmap-plot\"", "id=\"gradient-flow-plot\"", "data-layer=\"fc1\""})
    CHECK(sections->body.find(id) != std::string::npos);
  CHECK(sections->body.find("id=\"causal-graph\"") == std::string::npos);  // not paused: no diagnosis
  // The per-layer table: the monitor's layers, each healthy.
  CHECK(sections->body.find("<tr class=\"info\" data-layer=\"fc1\">") != std::string::npos);
  CHECK(sections->body.find("<tr class=\"alarm\"") == std::string::npos);

  // Paused and resumed from the page at the start of step 6 (its diagnosis: no failure yet);
  // then fc1's weights explode in that same step: the monitor pauses the loop, and the page
  // says where and why, not what it said a moment before.
  loop.hooks.set_step(6);
  REQUIRE(c.Post("/pause", with_token(live.token()), "", "text/plain"));
  CHECK(state()["diagnosis"].is_object());
  REQUIRE(c.Post("/resume", with_token(live.token()), "", "text/plain"));
  {
    torch::NoGradGuard ng;
    loop.net->fc1->weight.mul_(1e4);
  }
  int64_t step = 6;
  while (loop.step(step) && step < 20) ++step;
  REQUIRE(loop.hooks.is_paused());
  s = state();
  CHECK(s["paused"] == true);
  REQUIRE(s["pause"].is_object());
  CHECK(s["pause"]["layer"] == loop.hooks.pause_info()->layer);
  CHECK(s["pause"]["source"] == "torchdbg.health");
  REQUIRE(s["diagnosis"].is_object());
  const torchdbg::Diagnosis d = torchdbg::diagnose(loop.health);
  REQUIRE(d.top() != nullptr);
  CHECK(s["diagnosis"]["summary"] == d.summary());
  REQUIRE_FALSE(s["diagnosis"]["hypotheses"].empty());
  CHECK(s["diagnosis"]["hypotheses"][0]["layer"] == d.top()->layer);
  CHECK(d.top()->layer == "fc1");
  // The layers as the monitor sees them now, in the paused step: fc1 is not healthy.
  bool fc1_seen = false;
  for (const auto& l : s["layers"])
    if (l["name"] == "fc1") {
      fc1_seen = true;
      CHECK(l["state"] != "healthy");
    }
  CHECK(fc1_seen);
  sections = c.Get("/sections", with_token(live.token()));
  REQUIRE(sections);
  CHECK(sections->body.find("id=\"causal-graph\"") != std::string::npos);
  CHECK(sections->body.find(torchdbg::detail::html_escape(d.summary())) != std::string::npos);
  CHECK(sections->body.find("<tr class=\"alarm\"") != std::string::npos);  // the table shows the failure

  // Resume from the page: the loop's flag clears.
  auto r = c.Post("/resume", with_token(live.token()), "", "text/plain");
  REQUIRE(r);
  CHECK_FALSE(loop.hooks.is_paused());
  CHECK(state()["paused"] == false);

  // A diverged loss is told from "no loss yet".
  loop.hooks.set_step(step + 1);
  loop.hooks.set_loss(std::nan(""));
  loop.hooks.set_step(step + 2);  // the monitor finishes step + 1
  s = state();
  CHECK(s["step"] == step + 1);
  CHECK(s["loss"].is_null());
  CHECK(s["loss_text"] == "nan");
}

TEST_CASE("live page: readers on other threads while the loop trains; Pause now stops it between steps",
          "[live][stress]") {
  torch::manual_seed(5);
  Loop loop;
  torchdbg::LiveServer live(loop.hooks, loop.health, loop.reporter, torchdbg::LiveOptions().max_connections(2));
  std::atomic<bool> done{false};
  std::atomic<int> served{0}, failed{0};
  std::vector<std::thread> readers;
  for (int k = 0; k < 4; ++k)
    readers.emplace_back([&, k] {
      httplib::Client c("127.0.0.1", live.port());
      c.set_read_timeout(30, 0);
      int64_t last = -1;
      while (!done.load()) {
        auto r = c.Get(k % 2 == 0 ? "/state" : "/sections", with_token(live.token()));
        if (!r || r->status != 200) {
          ++failed;
          continue;
        }
        ++served;
        if (k % 2 == 0) {
          const auto j = nlohmann::json::parse(r->body);
          if (!j["step"].is_null()) {
            const int64_t now = j["step"];
            if (now < last) ++failed;  // steps only advance
            last = now;
          }
        }
      }
    });
  std::thread pauser([&] {
    httplib::Client c("127.0.0.1", live.port());
    while (served.load() < 20 && !done.load()) std::this_thread::yield();
    c.Post("/pause", with_token(live.token()), "", "text/plain");
  });
  int64_t step = 0;
  while (step < 100000 && !loop.hooks.is_paused()) loop.step(step++);
  done = true;
  pauser.join();
  for (auto& t : readers) t.join();
  CHECK(loop.hooks.is_paused());
  CHECK(loop.hooks.pause_info()->reason == "paused from the live page");
  CHECK(served.load() >= 20);
  CHECK(failed.load() == 0);
  live.stop();
}

TEST_CASE("live page: connections are bounded in number, time and bytes in all; stopping does not wait for clients",
          "[live]") {
  torchdbg::HookManager hooks;
  torchdbg::HealthMonitor health;
  torchdbg::Reporter reporter;
  const auto opts = torchdbg::LiveOptions().max_connections(1).max_queued(1).timeout_seconds(1).print_url(false);
  const auto t0 = std::chrono::steady_clock::now();

  SECTION("a request sent a byte at a time loses its connection at the timeout; the page answers again") {
    torchdbg::LiveServer live(hooks, health, reporter, opts);
    const int fd = connect_local(live.port());
    const std::string head = "GET /state?token=" + live.token() + " HTTP/1.1\r\nHost: x\r\nX-Slow: ";
    send_all(fd, head);
    const double took = trickle(fd);
    ::close(fd);
    CHECK(took > 0.9);
    CHECK(took < 3.0);
    CHECK(answers(live));
  }

  SECTION("on any address (0.0.0.0, ::): a request sent a byte at a time loses its connection at the timeout") {
    for (const char* host : {"0.0.0.0", "::"}) {
      INFO(host);
      std::unique_ptr<torchdbg::LiveServer> live;
      try {
        live = std::make_unique<torchdbg::LiveServer>(hooks, health, reporter, torchdbg::LiveOptions(opts).host(host));
      } catch (const torchdbg::Error&) {
        WARN(std::string("cannot listen on ") + host + " here: skipped");
        continue;
      }
      const int fd = connect_local(live->port());  // 127.0.0.1 (IPv4-mapped on ::)
      send_all(fd, "GET /state?token=" + live->token() + " HTTP/1.1\r\nX-Slow: ");
      const double took = trickle(fd);
      ::close(fd);
      CHECK(took > 0.9);
      CHECK(took < 3.0);
    }
  }

  SECTION("one worker, one waiting: a third idle connection is closed at once, the two others at their timeout") {
    torchdbg::LiveServer live(hooks, health, reporter, opts);
    const int busy = connect_local(live.port());
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // a worker holds it
    const int waiting = connect_local(live.port());
    std::this_thread::sleep_for(std::chrono::milliseconds(100));  // it waits for the worker
    const int third = connect_local(live.port());
    const auto start = std::chrono::steady_clock::now();
    CHECK(ended_within(third, 2000));
    CHECK(since(start) < 0.5);
    CHECK_FALSE(ended_within(busy, 0));
    CHECK_FALSE(ended_within(waiting, 0));
    CHECK(ended_within(busy, 3000));
    CHECK(ended_within(waiting, 3000));
    for (int fd : {busy, waiting, third}) ::close(fd);
    CHECK(answers(live));
  }

  SECTION("header lines without end: the connection is closed once the request passes its bytes") {
    torchdbg::LiveServer live(hooks, health, reporter, torchdbg::LiveOptions(opts).timeout_seconds(30));
    const int fd = connect_local(live.port());
    const std::string head = "GET /state?token=" + live.token() + " HTTP/1.1\r\nHost: x\r\n";
    send_all(fd, head);
    const std::string line = "X-Fill: " + std::string(1000, 'f') + "\r\n";
    std::string block;
    while (block.size() < (64 << 10)) block += line;
    std::size_t sent = 0;
    const auto start = std::chrono::steady_clock::now();
    timeval tv{0, 200000};
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    bool ended = false;
    while (!ended && sent < (std::size_t{256} << 20) && since(start) < 20) {
      const ssize_t n = ::send(fd, block.data(), block.size(), MSG_NOSIGNAL);
      if (n > 0) sent += static_cast<std::size_t>(n);
      ended = (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK) || ended_within(fd, 0);
    }
    ::close(fd);
    INFO("sent " << sent << " bytes in " << since(start) << " s");
    CHECK(ended);
    CHECK(sent < (std::size_t{48} << 20));  // the limit (68 KiB) plus the kernel's buffers
  }

  SECTION("stopping closes slow clients' connections first: the destructor does not wait for them") {
    auto live = std::make_unique<torchdbg::LiveServer>(
        hooks, health, reporter, torchdbg::LiveOptions(opts).max_connections(4).max_queued(4).timeout_seconds(60));
    std::vector<int> slow;
    for (int i = 0; i < 6; ++i) {
      slow.push_back(connect_local(live->port()));
      const std::string part = "GET /state?token=" + live->token() + " HTTP/1.1\r\nHost:";
      send_all(slow.back(), part);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const auto start = std::chrono::steady_clock::now();
    live.reset();
    CHECK(since(start) < 1.0);
    for (int fd : slow) {
      CHECK(ended_within(fd, 1000));
      ::close(fd);
    }
  }

  SECTION("on an IPv6 address too: a request sent a byte at a time loses its connection at the timeout") {
    std::unique_ptr<torchdbg::LiveServer> live;
    try {
      live = std::make_unique<torchdbg::LiveServer>(hooks, health, reporter, torchdbg::LiveOptions(opts).host("::1"));
    } catch (const torchdbg::Error&) {
      WARN("no IPv6 loopback here: skipped");
      return;
    }
    const int fd = connect_local6(live->port());
    const std::string part = "GET /state?token=" + live->token() + " HTTP/1.1\r\nX-Slow: ";
    send_all(fd, part);
    const double took = trickle(fd);
    ::close(fd);
    CHECK(took > 0.9);
    CHECK(took < 3.0);
  }

  SECTION("a connection accepted while out of descriptors is bounded once the next one comes") {
    torchdbg::LiveServer live(hooks, health, reporter, opts);
    rlimit saved{};
    REQUIRE(::getrlimit(RLIMIT_NOFILE, &saved) == 0);
    // Room for two descriptors only: the client's socket and the server's accept; the guard
    // cannot open /proc/self/fd or keep a duplicate, so that connection is not adopted.
    int limit = 0;
    for (int free_seen = 0; free_seen < 2; ++limit)
      if (::fcntl(limit, F_GETFD) == -1) ++free_seen;
    rlimit low = saved;
    low.rlim_cur = static_cast<rlim_t>(limit);
    REQUIRE(::setrlimit(RLIMIT_NOFILE, &low) == 0);
    const int first = connect_local(live.port());
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    REQUIRE(::setrlimit(RLIMIT_NOFILE, &saved) == 0);
    const std::string head = "GET /state?token=" + live.token() + " HTTP/1.1\r\nX-Slow: ";
    send_all(first, head);
    // The next connection finds two it does not know: each gets one request's time.
    const int second = connect_local(live.port());
    CHECK(trickle(first) < 3.0);
    CHECK(ended_within(second, 3000));
    for (int fd : {first, second}) ::close(fd);
    CHECK(answers(live));
  }

  SECTION("two servers on one port number, IPv4 and IPv6: neither takes the other's connections for its own") {
    const auto two = torchdbg::LiveOptions(opts).max_connections(2);  // a kept connection and a new one
    torchdbg::LiveServer v4(hooks, health, reporter, two);
    std::unique_ptr<torchdbg::LiveServer> v6;
    try {
      v6 = std::make_unique<torchdbg::LiveServer>(hooks, health, reporter,
                                                  torchdbg::LiveOptions(two).host("::1").port(v4.port()));
    } catch (const torchdbg::Error&) {
      WARN("no IPv6 loopback on this port here: skipped");
      return;
    }
    keep_apart(v4, connect_local, *v6, connect_local6);
  }

  SECTION("a host name of two addresses: the server's connections are those of the address it listens on") {
    // "localhost" is 127.0.0.1 and ::1 on Debian; cpp-httplib listens on the first that works,
    // and another server takes the other address on the same port.
    const auto two = torchdbg::LiveOptions(opts).max_connections(2);
    torchdbg::LiveServer named(hooks, health, reporter, torchdbg::LiveOptions(two).host("localhost"));
    std::unique_ptr<torchdbg::LiveServer> other;
    int (*connect_named)(int) = nullptr;
    int (*connect_other)(int) = nullptr;
    for (const bool v6 : {false, true}) {
      try {
        other = std::make_unique<torchdbg::LiveServer>(
            hooks, health, reporter, torchdbg::LiveOptions(two).host(v6 ? "::1" : "127.0.0.1").port(named.port()));
        connect_other = v6 ? connect_local6 : connect_local;
        connect_named = v6 ? connect_local : connect_local6;
        break;
      } catch (const torchdbg::Error&) {
      }
    }
    if (!other) {
      WARN("localhost has one address here: skipped");
      return;
    }
    keep_apart(named, connect_named, *other, connect_other);
  }

  SECTION("an honest request waiting behind slow ones is served, not cut, when a worker is free") {
    torchdbg::LiveServer live(hooks, health, reporter, torchdbg::LiveOptions(opts).max_queued(4));
    const std::string slow_head = "GET /state?token=" + live.token() + " HTTP/1.1\r\nX-Slow: ";
    std::vector<std::thread> slow;
    std::vector<double> slow_took(2);
    for (std::size_t i = 0; i < 2; ++i) {  // one holds the worker, one waits ahead of the honest one
      const int fd = connect_local(live.port());
      send_all(fd, slow_head);
      slow.emplace_back([fd, &slow_took, i] {
        slow_took[i] = trickle(fd);
        ::close(fd);
      });
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
    const int honest = connect_local(live.port());
    timeval tv{10, 0};
    ::setsockopt(honest, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    const auto start = std::chrono::steady_clock::now();
    send_all(honest, "GET /state?token=" + live.token() + " HTTP/1.1\r\nHost: x\r\n\r\n");
    CHECK(read_response(honest) == 200);
    CHECK(since(start) > 1.0);  // it waited for both slow ones
    ::close(honest);
    for (std::thread& t : slow) t.join();
    for (double took : slow_took) CHECK(took < 3.5);
  }

  SECTION("stop() from several threads at once") {
    torchdbg::LiveServer live(hooks, health, reporter, opts);
    std::vector<std::thread> stoppers;
    for (int i = 0; i < 4; ++i) stoppers.emplace_back([&live] { live.stop(); });
    for (std::thread& t : stoppers) t.join();
    CHECK_FALSE(answers(live));
  }

  SECTION("a kept-alive connection's timeout starts again with each response") {
    torchdbg::LiveServer live(hooks, health, reporter, opts);
    const int fd = connect_local(live.port());
    const std::string req = "GET /state?token=" + live.token() + " HTTP/1.1\r\nHost: x\r\n\r\n";
    for (int i = 0; i < 6; ++i) {  // 6 x 400 ms on one connection, past the 1 s timeout
      INFO("request " << i);
      send_all(fd, req);
      CHECK(read_response(fd) == 200);
      std::this_thread::sleep_for(std::chrono::milliseconds(400));
    }
    ::close(fd);
  }
  CHECK(since(t0) < 30);
}
