// torchdbg — module hooks and a training debugger for LibTorch.
// SPDX-License-Identifier: MIT
#pragma once

// The live page's connections: cpp-httplib's task queue with a bounded number of workers and
// of waiting connections, and a watchdog that bounds the time and bytes of every request.
//
// cpp-httplib's own timeouts apply per read (a client trickling a byte a second holds a
// worker forever) and 0.11 bounds neither the header lines nor the queue. It hands a task
// queue each accepted connection as a closure, without its socket; on Linux the guard finds
// that socket right after the accept, on the listening thread: the socket in /proc/self/fd
// it does not know yet whose own end (getsockname) is the server's address and port. It
// keeps a duplicate of it and shuts it down when its request runs past the deadline or the
// byte limit, or when the server stops. A connection waits for a worker without a deadline
// (the others' deadlines bound the wait).

#include <httplib.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <algorithm>
#include <atomic>
#include <functional>
#include <iterator>
#include <memory>
#include <mutex>
#include <string>
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
    for_each_socket([&](int fd, uint64_t inode) {
      SocketEnd end;
      if (std::find(listening_before.begin(), listening_before.end(), inode) == listening_before.end() &&
          socket_end(fd, end) && end.listening && end.port == port)
        bound.push_back(end.address);
      return true;
    });
    addresses_ = bound.size() == 1 ? bound : local_addresses(host, port);  // a name's addresses: all of them
    watchdog_ = std::thread([this] { watch(); });
#else
    (void)host;
    (void)listening_before;
#endif
  }

  /// The inodes of the process's listening sockets now (Linux; else none).
  static std::vector<uint64_t> listening_sockets() {
    std::vector<uint64_t> out;
#ifdef __linux__
    for_each_socket([&](int fd, uint64_t inode) {
      SocketEnd end;
      if (socket_end(fd, end) && end.listening) out.push_back(inode);
      return true;
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
    // The process's sockets, from the highest descriptor down: the one just accepted took the
    // lowest free number, usually the highest or close to it. Only sockets not seen before
    // are asked for their address; the scan ends at the first of the server's it does not
    // know, unless an earlier adoption failed (then all of them are looked for).
    std::vector<uint64_t> known_now;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const Connection& c : connections_) known_now.push_back(c.inode);
    }
    std::vector<std::pair<int, uint64_t>> found;  // descriptor, inode
    std::vector<uint64_t> foreign;
    const bool look_for_all = suspect_.exchange(false);
    const bool complete = for_each_socket(
        [&](int fd, uint64_t inode) {
          if (std::find(known_now.begin(), known_now.end(), inode) != known_now.end()) return true;
          SocketEnd end;
          if (std::binary_search(foreign_.begin(), foreign_.end(), inode) || !socket_end(fd, end) || end.listening ||
              end.port != port_ || !listens_on(end.address)) {
            foreign.push_back(inode);  // another's socket, or not a connection: never one of ours
            return true;
          }
          found.emplace_back(fd, inode);
          return look_for_all;
        },
        /*descending=*/true);
    if (complete || foreign_.size() > 4096) foreign_.clear();  // what a whole scan did not see is gone
    foreign_.insert(foreign_.end(), foreign.begin(), foreign.end());
    std::sort(foreign_.begin(), foreign_.end());
    foreign_.erase(std::unique(foreign_.begin(), foreign_.end()), foreign_.end());
    if (found.empty()) suspect_ = true;  // an accepted connection not found: look for it next time
    // One unknown connection: the one just accepted. Several (one could not be adopted
    // before, e.g. out of descriptors): which is which is not known, so each gets the
    // time and bytes of one request from now, without the restart a response gives.
    uint64_t id = 0;
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [fd, inode] : found) {
      // A duplicate keeps the socket itself (not a number another thread may reuse) until
      // the connection's task has ended.
      const int copy = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);
      if (copy < 0 || socket_inode(copy) != inode) {
        if (copy >= 0) ::close(copy);
        suspect_ = true;
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

  /// A socket's local address: its bytes as 32-bit words (one for IPv4, four for IPv6), or,
  /// for a listening address, any address of the family.
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

  /// A socket's own end, as getsockname and SO_ACCEPTCONN tell it.
  struct SocketEnd {
    LocalAddress address;
    int port = -1;
    bool listening = false;
  };

  /// The own end of stream socket `fd` (false: not a TCP socket, or gone).
  static bool socket_end(int fd, SocketEnd& end) {
    int type = 0, listening = 0;
    socklen_t n = sizeof type;
    if (::getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &n) != 0 || type != SOCK_STREAM) return false;
    n = sizeof listening;
    if (::getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &n) != 0) return false;
    sockaddr_storage a{};
    n = sizeof a;
    if (::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n) != 0) return false;
    if (a.ss_family == AF_INET) {
      const auto* v4 = reinterpret_cast<const sockaddr_in*>(&a);
      std::memcpy(end.address.words, &v4->sin_addr, sizeof v4->sin_addr);
      end.port = ntohs(v4->sin_port);
    } else if (a.ss_family == AF_INET6) {
      const auto* v6 = reinterpret_cast<const sockaddr_in6*>(&a);
      std::memcpy(end.address.words, &v6->sin6_addr, sizeof v6->sin6_addr);
      end.address.v6 = true;
      end.port = ntohs(v6->sin6_port);
    } else {
      return false;
    }
    end.listening = listening != 0;
    // Bound to 0.0.0.0 or ::, a listening socket takes connections on any address of its family.
    end.address.any = std::all_of(std::begin(end.address.words), std::end(end.address.words), [](uint32_t w) { return w == 0; });
    return true;
  }

  /// Calls `f(fd, inode)` for each socket descriptor of the process (ascending, or descending)
  /// until it returns false; true when it saw them all. Reads /proc/self/fd's links only.
  template <typename F>
  static bool for_each_socket(F&& f, bool descending = false) {
    std::vector<int> fds;
    DIR* dir = ::opendir("/proc/self/fd");
    if (dir == nullptr) return false;
    while (const dirent* e = ::readdir(dir)) {
      char* end = nullptr;
      const long fd = std::strtol(e->d_name, &end, 10);
      if (end != e->d_name && *end == '\0' && fd != ::dirfd(dir)) fds.push_back(static_cast<int>(fd));
    }
    ::closedir(dir);
    std::sort(fds.begin(), fds.end());
    if (descending) std::reverse(fds.begin(), fds.end());
    for (int fd : fds) {
      const uint64_t inode = socket_inode(fd);
      if (inode != 0 && !f(fd, inode)) return false;
    }
    return true;
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
        if (late || bytes_received(c.fd) - c.bytes_base > limits_.request_bytes) cut(c);
      }
      // No task releases an orphan: once cut, cpp-httplib ends it; the duplicate goes now.
      // Until cpp-httplib has closed its own descriptor the socket looks unknown again, so
      // the next adoption looks at every socket.
      for (auto it = connections_.begin(); it != connections_.end();) {
        if (it->orphan && it->cut) {
          ::close(it->fd);
          it = connections_.erase(it);
          suspect_ = true;
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
  std::vector<uint64_t> foreign_;  ///< sorted inodes of sockets not the server's (adopt's thread only)
  std::atomic<bool> suspect_{false};  ///< a connection of the server's may be unknown
#endif
  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<Connection> connections_;
  uint64_t last_id_ = 0;
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
