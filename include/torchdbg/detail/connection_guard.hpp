// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// The live page's connections: cpp-httplib's task queue with a bounded number of workers and
// of waiting connections, and a watchdog that bounds the time and bytes of every request.
//
// cpp-httplib's own timeouts apply per read (a client trickling a byte a second holds a
// worker forever) and 0.11 bounds neither the header lines nor the queue. It hands a task
// queue each accepted connection as a closure, without its socket; on Linux the guard finds
// that socket right after the accept, on the listening thread (the one in /proc/self/fd it
// does not know yet whose local address and port, in /proc/self/net/tcp, are the server's),
// keeps a duplicate of it and shuts it down when its request runs past the deadline or the
// byte limit, or when the server stops. A connection waits for a worker without a deadline
// (the others' deadlines bound the wait).
// Elsewhere only the bounded pool applies.

#include <httplib.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <algorithm>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef __linux__
#include <dirent.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>
#endif

namespace torchdbg::detail {

/// What one live server allows its connections.
struct ConnectionLimits {
  std::size_t workers = 4;      ///< requests served at once
  std::size_t queued = 16;      ///< connections waiting for a worker; more are closed at once
  std::chrono::milliseconds request_time{5000};  ///< from a worker's start or the last response
  uint64_t request_bytes = 1 << 20;              ///< received since the connection or the last response
};

/// The connection a worker thread serves now (0: none or not known), for the response hook.
inline thread_local uint64_t current_connection = 0;

/// The accepted sockets of one listening port and the watchdog that ends those past their
/// limits. Thread safety: every member from any thread.
class ConnectionGuard {
 public:
  /// For the server listening on `host` (an address or a name, as given to cpp-httplib) and
  /// `port`; `listening_before` (listening_sockets() before it bound) tells its own listening
  /// socket, whose address is then the one its connections have.
  ConnectionGuard(const std::string& host, int port, ConnectionLimits limits,
                  const std::vector<uint64_t>& listening_before = {})
      : port_(port), limits_(limits) {
#ifdef __linux__
    std::vector<LocalAddress> bound;
    for_each_row(port, [&](const TableRow& r) {
      if (r.state == kListening && std::find(listening_before.begin(), listening_before.end(), r.inode) == listening_before.end())
        bound.push_back(r.address);
    });
    addresses_ = bound.size() == 1 ? bound : local_addresses(host, port);  // a name's addresses: all of them
    watchdog_ = std::thread([this] { watch(); });
#else
    (void)host;
    (void)listening_before;
#endif
  }

  /// The inodes of the listening TCP sockets of the network namespace now (Linux; else none).
  static std::vector<uint64_t> listening_sockets() {
    std::vector<uint64_t> out;
#ifdef __linux__
    for_each_row(-1, [&](const TableRow& r) {
      if (r.state == kListening) out.push_back(r.inode);
    });
#endif
    return out;
  }
  ConnectionGuard(const ConnectionGuard&) = delete;
  ConnectionGuard& operator=(const ConnectionGuard&) = delete;
  ~ConnectionGuard() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ending_ = true;
    }
    wake_.notify_all();
    if (watchdog_.joinable()) watchdog_.join();
#ifdef __linux__
    for (const Connection& c : connections_) ::close(c.fd);
#endif
  }

  [[nodiscard]] const ConnectionLimits& limits() const noexcept { return limits_; }

  /// The connection accepted last (call on the listening thread, after its accept): its id,
  /// or 0 when its socket cannot be found (then no deadline applies to it).
  uint64_t adopt() {
#ifdef __linux__
    // The server's connections it does not know yet, from the TCP tables; then their
    // descriptors. Touches no descriptor but those (other threads' sockets are theirs), and
    // reads without the lock: only this thread adopts, and what the others change (releases)
    // cannot make a known socket unknown.
    std::vector<uint64_t> unknown = connections_here();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const Connection& c : connections_) unknown.erase(std::remove(unknown.begin(), unknown.end(), c.inode), unknown.end());
    }
    if (unknown.empty()) return 0;
    // Their descriptors, in ascending order (as /proc lists them): an accept takes the lowest
    // free number, so the scan usually ends long before the process's last descriptor.
    std::vector<std::pair<int, uint64_t>> found;  // descriptor, inode
    DIR* dir = ::opendir("/proc/self/fd");
    if (dir == nullptr) return 0;
    while (found.size() < unknown.size()) {
      const dirent* e = ::readdir(dir);
      if (e == nullptr) break;
      char* end = nullptr;
      const long fd = std::strtol(e->d_name, &end, 10);
      if (end == e->d_name || *end != '\0' || fd == ::dirfd(dir)) continue;
      const uint64_t ino = socket_inode(static_cast<int>(fd));
      if (ino != 0 && std::find(unknown.begin(), unknown.end(), ino) != unknown.end())
        found.emplace_back(static_cast<int>(fd), ino);
    }
    ::closedir(dir);
    // One unknown connection: the one just accepted. Several (one could not be adopted
    // before, e.g. out of descriptors): which is which is not known, so each gets the
    // time and bytes of one request from now, without the restart a response gives.
    uint64_t id = 0;
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [fd, inode] : found) {
      // A duplicate keeps the socket itself (not a number another thread may reuse) until
      // the connection's task has ended.
      const int copy = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
      if (copy < 0) continue;
      if (socket_inode(copy) != inode) {
        ::close(copy);
        continue;
      }
      Connection c;
      c.id = ++last_id_;
      c.fd = copy;
      c.inode = inode;
      c.deadline = Clock::now() + limits_.request_time;
      c.bytes_base = bytes_received(copy);
      c.orphan = found.size() != 1;
      if (stopping_) cut(c);
      connections_.push_back(c);
      if (!c.orphan) id = c.id;
    }
    wake_.notify_all();
    return id;
#else
    return 0;
#endif
  }

  /// The connection's task has ended (cpp-httplib closed its socket): forget it.
  void release(uint64_t id) {
    if (id == 0) return;
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = connections_.begin(); it != connections_.end(); ++it) {
      if (it->id != id) continue;
#ifdef __linux__
      ::close(it->fd);
#endif
      connections_.erase(it);
      return;
    }
  }

  /// Ends the connection now: its reads see the end, its writes fail.
  void refuse(uint64_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    for (Connection& c : connections_)
      if (c.id == id) cut(c);
  }

  /// A worker takes connection `id`: its first request's time counts from now (not from the
  /// wait for a worker, which the other connections' limits bound).
  void started(uint64_t id) {
    if (id == 0) return;
    std::lock_guard<std::mutex> lock(mutex_);
    for (Connection& c : connections_) {
      if (c.id != id) continue;
      c.deadline = Clock::now() + limits_.request_time;
      c.started = true;
    }
  }

  /// A response has left on connection `id`: the next request's time and bytes count from now.
  void responded(uint64_t id) {
    if (id == 0) return;
    std::lock_guard<std::mutex> lock(mutex_);
    for (Connection& c : connections_) {
      if (c.id != id) continue;
      c.deadline = Clock::now() + limits_.request_time;
      c.bytes_base = bytes_received(c.fd);
    }
  }

  /// Ends every connection, and each one adopted from now on.
  void stop() {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    for (Connection& c : connections_) cut(c);
  }

  /// Connections known and not yet released.
  [[nodiscard]] std::size_t open() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return connections_.size();
  }

  /// Connections ended by the watchdog (past the deadline or the byte limit) so far.
  [[nodiscard]] std::size_t cut_count() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return watchdog_cuts_;
  }

 private:
  using Clock = std::chrono::steady_clock;
  struct Connection {
    uint64_t id = 0;
    int fd = -1;
    uint64_t inode = 0;
    Clock::time_point deadline;
    uint64_t bytes_base = 0;
    bool cut = false;
    bool started = false;  ///< a worker serves it: its deadline applies
    bool orphan = false;   ///< its task is not known: its deadline applies, forgotten once cut
  };

  static void cut(Connection& c) {
#ifdef __linux__
    if (!c.cut) ::shutdown(c.fd, SHUT_RDWR);
#endif
    c.cut = true;
  }

#ifdef __linux__
  /// The inode of the socket behind descriptor `fd` ("socket:[N]"), or 0.
  static uint64_t socket_inode(int fd) {
    char path[64], target[64];
    std::snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    const ssize_t n = ::readlink(path, target, sizeof target - 1);
    if (n <= 8) return 0;
    target[n] = '\0';
    if (std::strncmp(target, "socket:[", 8) != 0) return 0;
    return std::strtoull(target + 8, nullptr, 10);
  }

  /// A local address the server listens on, as the kernel's TCP tables print it: the 32-bit
  /// words of the address in memory order (one for IPv4, four for IPv6), or any address of
  /// the family.
  struct LocalAddress {
    bool v6 = false;
    bool any = false;
    uint32_t words[4] = {};
  };

  /// The addresses `host` stands for, as cpp-httplib resolves it to listen (empty: unknown,
  /// then the port alone tells the server's connections).
  static std::vector<LocalAddress> local_addresses(const std::string& host, int port) {
    std::vector<LocalAddress> out;
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    addrinfo* list = nullptr;
    if (::getaddrinfo(host.empty() ? nullptr : host.c_str(), std::to_string(port).c_str(), &hints, &list) != 0) return out;
    for (const addrinfo* ai = list; ai != nullptr; ai = ai->ai_next) {
      LocalAddress a;
      if (ai->ai_family == AF_INET) {
        const in_addr& v4 = reinterpret_cast<const sockaddr_in*>(ai->ai_addr)->sin_addr;
        std::memcpy(a.words, &v4, sizeof v4);
        a.any = v4.s_addr == htonl(INADDR_ANY);
      } else if (ai->ai_family == AF_INET6) {
        const in6_addr& v6 = reinterpret_cast<const sockaddr_in6*>(ai->ai_addr)->sin6_addr;
        std::memcpy(a.words, &v6, sizeof v6);
        a.v6 = true;
        a.any = IN6_IS_ADDR_UNSPECIFIED(&v6);
      } else {
        continue;
      }
      out.push_back(a);
    }
    ::freeaddrinfo(list);
    return out;
  }

  /// Whether a connection's local address is one the server listens on.
  bool listens_on(const LocalAddress& local) const {
    if (addresses_.empty()) return true;
    for (const LocalAddress& a : addresses_) {
      if (a.v6 != local.v6) continue;
      if (a.any || std::memcmp(a.words, local.words, sizeof a.words) == 0) return true;
    }
    return false;
  }

  static constexpr unsigned kTimeWait = 0x06, kListening = 0x0A;

  /// A row of /proc/self/net/tcp or tcp6.
  struct TableRow {
    LocalAddress address;  ///< the socket's own end
    int port = 0;
    unsigned state = 0;
    uint64_t inode = 0;
  };

  /// Calls `f` with each row of the process's TCP tables (IPv4, then IPv6) whose own end is on
  /// `port` (every row when `port` < 0). Rows not naming the port are skipped unparsed.
  template <typename F>
  static void for_each_row(int port, F&& f) {
    char needle[16];
    std::snprintf(needle, sizeof needle, ":%04X ", static_cast<unsigned>(port < 0 ? 0 : port) & 0xFFFFu);
    for (const bool v6 : {false, true}) {
      const int fd = ::open(v6 ? "/proc/self/net/tcp6" : "/proc/self/net/tcp", O_RDONLY | O_CLOEXEC);
      if (fd < 0) continue;
      std::string text;
      char buf[16384];
      for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) > 0;) text.append(buf, static_cast<std::size_t>(n));
      ::close(fd);
      const std::size_t first = text.find('\n');  // past the column names
      if (first == std::string::npos) continue;
      for (std::size_t at = first + 1; at < text.size();) {
        if (port >= 0) {  // the next row naming the port
          const std::size_t hit = text.find(needle, at);
          if (hit == std::string::npos) break;
          at = text.rfind('\n', hit) + 1;
        }
        const std::size_t end = std::min(text.find('\n', at), text.size());
        TableRow row;
        if (parse_row(std::string_view(text).substr(at, end - at), v6, row) && (port < 0 || row.port == port)) f(row);
        at = end + 1;
      }
    }
  }

  /// "sl local(hex address:hex port) remote state(hex) tx:rx tr:when retransmits uid timeout
  /// inode ...": the fields a guard needs.
  static bool parse_row(std::string_view line, bool v6, TableRow& row) {
    std::string_view field[10];
    std::size_t n = 0;
    for (std::size_t i = 0; i < line.size() && n < 10;) {
      while (i < line.size() && line[i] == ' ') ++i;
      const std::size_t j = std::min(line.find(' ', i), line.size());
      if (j > i) field[n++] = line.substr(i, j - i);
      i = j;
    }
    if (n < 10) return false;
    const std::string_view local = field[1];
    const std::size_t colon = local.find(':');
    const std::size_t hex_len = v6 ? 32 : 8;
    if (colon != hex_len || local.size() > colon + 5) return false;
    row.address.v6 = v6;
    for (std::size_t w = 0; w < hex_len / 8; ++w) {
      char word[9] = {};
      local.copy(word, 8, 8 * w);
      row.address.words[w] = static_cast<uint32_t>(std::strtoul(word, nullptr, 16));
    }
    char small[24] = {};
    local.substr(colon + 1).copy(small, sizeof small - 1);
    row.port = static_cast<int>(std::strtol(small, nullptr, 16));
    std::memset(small, 0, sizeof small);
    field[3].substr(0, sizeof small - 1).copy(small, sizeof small - 1);
    row.state = static_cast<unsigned>(std::strtoul(small, nullptr, 16));
    std::memset(small, 0, sizeof small);
    field[9].substr(0, sizeof small - 1).copy(small, sizeof small - 1);
    row.inode = std::strtoull(small, nullptr, 10);
    return true;
  }

  /// The inodes of the TCP sockets that are the server's connections: not listening, their
  /// own end on its port and one of its addresses (a client's socket to it has another local
  /// port; another server's, another address).
  std::vector<uint64_t> connections_here() const {
    std::vector<uint64_t> out;
    for_each_row(port_, [&](const TableRow& r) {
      if (r.state != kListening && r.state != kTimeWait && r.inode != 0 && listens_on(r.address)) out.push_back(r.inode);
    });
    return out;
  }

  /// Bytes the kernel has received on the socket: tcpi_bytes_received, at byte 128 of
  /// struct tcp_info (linux/tcp.h, since Linux 4.1; the kernel only appends to it). glibc's
  /// copy of the struct stops before it. 0 where the kernel is older.
  static uint64_t bytes_received(int fd) {
    constexpr std::size_t kOffset = 128;
    unsigned char info[256] = {};
    socklen_t n = sizeof info;
    if (::getsockopt(fd, IPPROTO_TCP, TCP_INFO, info, &n) != 0 || n < kOffset + sizeof(uint64_t)) return 0;
    uint64_t v = 0;
    std::memcpy(&v, info + kOffset, sizeof v);
    return v;
  }

  /// Every 20 ms while connections are open: ends those past their deadline or byte limit.
  void watch() {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!ending_) {
      if (connections_.empty()) {
        wake_.wait(lock, [this] { return ending_ || !connections_.empty(); });
        continue;
      }
      wake_.wait_for(lock, std::chrono::milliseconds(20), [this] { return ending_; });
      const Clock::time_point now = Clock::now();
      for (Connection& c : connections_) {
        if (c.cut) continue;
        const bool late = (c.started || c.orphan) && now > c.deadline;  // waiting is not late
        if (late || bytes_received(c.fd) - c.bytes_base > limits_.request_bytes) {
          cut(c);
          ++watchdog_cuts_;
        }
      }
      // No task releases an orphan: once cut, cpp-httplib ends it; the duplicate goes now.
      for (auto it = connections_.begin(); it != connections_.end();) {
        if (it->orphan && it->cut) {
          ::close(it->fd);
          it = connections_.erase(it);
        } else {
          ++it;
        }
      }
    }
  }
#endif

  const int port_;
  const ConnectionLimits limits_;
#ifdef __linux__
  std::vector<LocalAddress> addresses_;
#endif
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<Connection> connections_;
  uint64_t last_id_ = 0;
  std::size_t watchdog_cuts_ = 0;
  bool stopping_ = false;
  bool ending_ = false;
  std::thread watchdog_;
};

/// cpp-httplib's task queue for one server: `workers` threads, at most `queued` connections
/// waiting for one (more are closed at once), each connection adopted by the guard.
class GuardedPool final : public httplib::TaskQueue {
 public:
  /// bool in cpp-httplib 0.18 (false: the server closes the socket), void in 0.11.
  using EnqueueResult = decltype(std::declval<httplib::TaskQueue&>().enqueue(std::function<void()>()));

  explicit GuardedPool(std::shared_ptr<ConnectionGuard> guard) : guard_(std::move(guard)) {
    const std::size_t n = std::max<std::size_t>(guard_->limits().workers, 1);
    for (std::size_t i = 0; i < n; ++i) workers_.emplace_back([this] { work(); });
  }
  GuardedPool(const GuardedPool&) = delete;
  GuardedPool& operator=(const GuardedPool&) = delete;
  ~GuardedPool() override { GuardedPool::shutdown(); }

  EnqueueResult enqueue(std::function<void()> fn) override { return enqueue_as<EnqueueResult>(std::move(fn)); }

  /// Serves what is queued, then joins the workers (cpp-httplib calls it as listening ends).
  void shutdown() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ending_ = true;
    }
    ready_.notify_all();
    for (std::thread& t : workers_)
      if (t.joinable()) t.join();
  }

 private:
  struct Task {
    uint64_t id = 0;
    std::function<void()> fn;
  };

  template <typename Result>
  Result enqueue_as(std::function<void()> fn) {
    constexpr bool closes = std::is_same_v<Result, bool>;  // cpp-httplib closes what is refused
    const uint64_t id = guard_->adopt();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      // Without `closes`, a connection whose socket is unknown cannot be refused: it waits.
      const bool room = queue_.size() < std::max<std::size_t>(guard_->limits().queued, 1);
      if (!ending_ && (room || (id == 0 && !closes))) {
        queue_.push_back({id, std::move(fn)});
        ready_.notify_one();
        if constexpr (closes) return true;
        else return;
      }
    }
    guard_->refuse(id);
    if constexpr (closes) {
      guard_->release(id);
      return false;
    } else {
      run({id, std::move(fn)});  // on a shut-down socket: returns at once and closes it
    }
  }

  void run(Task t) {
    guard_->started(t.id);
    current_connection = t.id;
    try {
      t.fn();
    } catch (...) {  // cpp-httplib catches its handlers' exceptions; nothing may end a worker
    }
    current_connection = 0;
    guard_->release(t.id);
  }

  void work() {
    for (;;) {
      Task t;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        ready_.wait(lock, [this] { return ending_ || !queue_.empty(); });
        if (queue_.empty()) return;
        t = std::move(queue_.front());
        queue_.pop_front();
      }
      run(std::move(t));
    }
  }

  std::shared_ptr<ConnectionGuard> guard_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<Task> queue_;
  bool ending_ = false;
  std::vector<std::thread> workers_;
};

}  // namespace torchdbg::detail
