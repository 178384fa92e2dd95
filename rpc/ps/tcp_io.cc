#include "rpc/ps/tcp_io.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "rpc/ps/tcp_congestion.h"

namespace trainyard::ps {

UniqueFd& UniqueFd::operator=(UniqueFd&& other) noexcept {
  if (this != &other) {
    reset();
    fd_ = other.release();
  }
  return *this;
}

void UniqueFd::reset() {
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

namespace {

// The status of a failed system call `what`: UNAVAILABLE for what a vanished or refusing peer
// causes, INTERNAL otherwise.
absl::Status ErrnoStatus(absl::string_view what, int error) {
  const std::string message = absl::StrCat(what, ": ", std::strerror(error));
  switch (error) {
    case ECONNRESET:
    case ECONNREFUSED:
    case ECONNABORTED:
    case EPIPE:
    case ENOTCONN:
    case ETIMEDOUT:
    case EHOSTUNREACH:
    case ENETUNREACH:
    case ENETDOWN:
    case EHOSTDOWN:
      return absl::UnavailableError(message);
    default:
      return absl::InternalError(message);
  }
}

// Waits until `fd` is ready for `events` or `limit` runs out (counting idleness from
// `last_progress`). DEADLINE_EXCEEDED naming `what` when it ran out; OK when poll says ready or
// the socket has an error or hang-up (the next call reports it).

using AddrInfoList = std::unique_ptr<addrinfo, void (*)(addrinfo*)>;

// The TCP addresses of `host` and `port` (`passive`: to listen on). UNAVAILABLE saying why a name
// does not resolve.
absl::StatusOr<AddrInfoList> Resolve(const std::string& host, int port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* found = nullptr;
  if (const int r = getaddrinfo(host.c_str(), absl::StrCat(port).c_str(), &hints, &found); r != 0) {
    return absl::UnavailableError(absl::StrCat("cannot resolve '", host, "': ", gai_strerror(r)));
  }
  return AddrInfoList(found, freeaddrinfo);
}

absl::Status SetIntOption(int fd, int level, int name, int value, absl::string_view what) {
  if (setsockopt(fd, level, name, &value, sizeof(value)) != 0) return ErrnoStatus(what, errno);
  return absl::OkStatus();
}

}  // namespace

absl::Status WaitReady(int fd, short events, const IoLimit& limit, absl::Time last_progress,
                       absl::string_view what) {
  while (true) {
    const absl::Time now = absl::Now();
    const absl::Time until = std::min(limit.deadline, last_progress + limit.idle);
    int timeout_ms = -1;
    if (until != absl::InfiniteFuture()) {
      if (now >= until) {
        return absl::DeadlineExceededError(
            limit.deadline <= now
                ? absl::StrCat(what, ": deadline exceeded")
                : absl::StrCat(what, ": nothing moved for ", absl::FormatDuration(limit.idle)));
      }
      // Rounded up so that a wait never ends just before `until` and spins.
      timeout_ms = static_cast<int>(std::min<int64_t>(
          absl::ToInt64Milliseconds(absl::Ceil(until - now, absl::Milliseconds(1))),
          int64_t{1} << 30));
    }
    pollfd p{fd, events, 0};
    const int r = poll(&p, 1, timeout_ms);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return ErrnoStatus(absl::StrCat(what, ": poll"), errno);
    if (r > 0) return absl::OkStatus();
  }
}

absl::Status SplitHostPort(const std::string& address, const std::string& flag, std::string* host,
                           int* port) {
  const size_t colon = address.rfind(':');
  std::string h = colon == std::string::npos ? "" : address.substr(0, colon);
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  int p = -1;
  if (colon == std::string::npos || h.empty() ||
      !absl::SimpleAtoi(absl::string_view(address).substr(colon + 1), &p) || p < 0 || p > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat(flag, ": '", address, "' is not HOST:PORT with a port in [0, 65535]"));
  }
  *host = std::move(h);
  *port = p;
  return absl::OkStatus();
}

std::string JoinHostPort(const std::string& host, int port) {
  return host.find(':') != std::string::npos ? absl::StrCat("[", host, "]:", port)
                                             : absl::StrCat(host, ":", port);
}

absl::StatusOr<UniqueFd> TcpListen(const std::string& address, const std::string& congestion,
                                   const std::string& flag, int* bound_port) {
  std::string host;
  int port = 0;
  RETURN_IF_ERROR(SplitHostPort(address, flag, &host, &port));
  auto found = Resolve(host, port, /*passive=*/true);
  if (!found.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(flag, ": ", found.status().message()));
  }
  absl::Status last = absl::UnavailableError(absl::StrCat(flag, ": no address for ", address));
  UniqueFd fd;
  for (addrinfo* a = found->get(); a != nullptr; a = a->ai_next) {
    UniqueFd s(socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!s.valid()) {
      last = ErrnoStatus(absl::StrCat(flag, ": socket"), errno);
      continue;
    }
    SetIntOption(s.get(), SOL_SOCKET, SO_REUSEADDR, 1, "SO_REUSEADDR").IgnoreError();
    if (absl::Status st = SetSocketTcpCongestion(s.get(), congestion); !st.ok()) {
      last = absl::InvalidArgumentError(absl::StrCat(flag, ": ", st.message()));
      continue;
    }
    if (bind(s.get(), a->ai_addr, a->ai_addrlen) != 0 || listen(s.get(), 128) != 0) {
      last = absl::UnavailableError(
          absl::StrCat(flag, ": cannot listen on ", address, ": ", std::strerror(errno)));
      continue;
    }
    fd = std::move(s);
    break;
  }
  if (!fd.valid()) return last;
  sockaddr_storage bound{};
  socklen_t len = sizeof(bound);
  if (getsockname(fd.get(), reinterpret_cast<sockaddr*>(&bound), &len) != 0) {
    return ErrnoStatus(absl::StrCat(flag, ": getsockname"), errno);
  }
  *bound_port =
      ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<const sockaddr_in6*>(&bound)->sin6_port
                                        : reinterpret_cast<const sockaddr_in*>(&bound)->sin_port);
  return fd;
}

absl::Status PrepareTcpSocket(int fd, const std::string& congestion,
                              absl::Duration keepalive_idle) {
  const int flags = fcntl(fd, F_GETFL);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) != 0) {
    return ErrnoStatus("O_NONBLOCK", errno);
  }
  RETURN_IF_ERROR(SetIntOption(fd, IPPROTO_TCP, TCP_NODELAY, 1, "TCP_NODELAY"));
  const int idle_s = std::max<int>(1, static_cast<int>(absl::ToInt64Seconds(keepalive_idle)));
  RETURN_IF_ERROR(SetIntOption(fd, SOL_SOCKET, SO_KEEPALIVE, 1, "SO_KEEPALIVE"));
  RETURN_IF_ERROR(SetIntOption(fd, IPPROTO_TCP, TCP_KEEPIDLE, idle_s, "TCP_KEEPIDLE"));
  RETURN_IF_ERROR(
      SetIntOption(fd, IPPROTO_TCP, TCP_KEEPINTVL, std::max(1, idle_s / 2), "TCP_KEEPINTVL"));
  RETURN_IF_ERROR(SetIntOption(fd, IPPROTO_TCP, TCP_KEEPCNT, 3, "TCP_KEEPCNT"));
  return SetSocketTcpCongestion(fd, congestion);
}

absl::StatusOr<UniqueFd> TcpConnect(const std::string& address, const std::string& congestion,
                                    absl::Time deadline) {
  std::string host;
  int port = 0;
  RETURN_IF_ERROR(SplitHostPort(address, "address", &host, &port));
  auto found = Resolve(host, port, /*passive=*/false);
  if (!found.ok()) {
    return absl::UnavailableError(absl::StrCat("connect: ", found.status().message()));
  }
  absl::Status last = absl::UnavailableError(absl::StrCat("connect: no address for '", host, "'"));
  UniqueFd fd;
  for (addrinfo* a = found->get(); a != nullptr && !fd.valid(); a = a->ai_next) {
    UniqueFd s(socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
    if (!s.valid()) {
      last = ErrnoStatus("connect: socket", errno);
      continue;
    }
    const std::string what = "connect";
    int error = connect(s.get(), a->ai_addr, a->ai_addrlen) == 0 ? 0 : errno;
    if (error == EINPROGRESS) {
      if (absl::Status st =
              WaitReady(s.get(), POLLOUT, IoLimit::Until(deadline), absl::Now(), what);
          !st.ok()) {
        last = st;
        break;  // the deadline is over for every address
      }
      socklen_t len = sizeof(error);
      if (getsockopt(s.get(), SOL_SOCKET, SO_ERROR, &error, &len) != 0) error = errno;
    }
    if (error != 0) {
      last = ErrnoStatus(what, error);
      continue;
    }
    if (absl::Status st = PrepareTcpSocket(s.get(), congestion); !st.ok()) {
      last = absl::Status(st.code(), absl::StrCat(what, ": ", st.message()));
      continue;
    }
    fd = std::move(s);
  }
  if (!fd.valid()) return last;
  return fd;
}

absl::Status SendAll(int fd, absl::Span<const iovec> pieces, IoLimit limit) {
  std::vector<iovec> left(pieces.begin(), pieces.end());
  size_t first = 0;  // the first piece not sent in full
  size_t total = 0, sent = 0;
  for (const iovec& v : left) total += v.iov_len;
  absl::Time last_progress = absl::Now();
  while (first < left.size()) {
    if (left[first].iov_len == 0) {
      ++first;
      continue;
    }
    msghdr msg{};
    msg.msg_iov = &left[first];
    msg.msg_iovlen = std::min<size_t>(left.size() - first, IOV_MAX);
    const ssize_t n = sendmsg(fd, &msg, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) {
        return ErrnoStatus(absl::StrCat("send (", sent, " of ", total, " bytes sent)"), errno);
      }
      RETURN_IF_ERROR(WaitReady(fd, POLLOUT, limit, last_progress,
                                absl::StrCat("send (", sent, " of ", total, " bytes sent)")));
      continue;
    }
    last_progress = absl::Now();
    sent += n;
    for (size_t done = n; done > 0;) {
      const size_t take = std::min(done, left[first].iov_len);
      left[first].iov_base = static_cast<char*>(left[first].iov_base) + take;
      left[first].iov_len -= take;
      done -= take;
      if (left[first].iov_len == 0) ++first;
    }
  }
  return absl::OkStatus();
}

absl::Status RecvAll(int fd, char* out, size_t n, IoLimit limit, size_t* received) {
  size_t got = 0;
  if (received != nullptr) *received = 0;
  absl::Time last_progress = absl::Now();
  while (got < n) {
    const ssize_t r = recv(fd, out + got, n - got, 0);
    if (r > 0) {
      got += r;
      if (received != nullptr) *received = got;
      last_progress = absl::Now();
      continue;
    }
    if (r == 0) {
      return absl::UnavailableError(
          absl::StrCat("recv: the peer closed the connection after ", got, " of ", n, " bytes"));
    }
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) {
      return ErrnoStatus(absl::StrCat("recv (", got, " of ", n, " bytes received)"), errno);
    }
    RETURN_IF_ERROR(WaitReady(fd, POLLIN, limit, last_progress,
                              absl::StrCat("recv (", got, " of ", n, " bytes received)")));
  }
  return absl::OkStatus();
}

absl::StatusOr<size_t> RecvSome(int fd, char* out, size_t n, IoLimit limit) {
  const absl::Time start = absl::Now();
  while (true) {
    const ssize_t r = recv(fd, out, n, 0);
    if (r > 0) return static_cast<size_t>(r);
    if (r == 0) return absl::UnavailableError("recv: the peer closed the connection");
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return ErrnoStatus("recv", errno);
    RETURN_IF_ERROR(WaitReady(fd, POLLIN, limit, start, "recv"));
  }
}

absl::Status Discard(int fd, size_t n, IoLimit limit) {
  std::vector<char> scratch(std::min<size_t>(n, size_t{1} << 20));
  for (size_t left = n; left > 0;) {
    const size_t take = std::min(left, scratch.size());
    RETURN_IF_ERROR(RecvAll(fd, scratch.data(), take, limit));
    left -= take;
  }
  return absl::OkStatus();
}

void DiscardUntilClosed(int fd, size_t max_bytes, IoLimit limit) {
  std::vector<char> scratch(64 << 10);
  absl::Time last_progress = absl::Now();
  for (size_t dropped = 0; dropped < max_bytes;) {
    const ssize_t r = recv(fd, scratch.data(), std::min(scratch.size(), max_bytes - dropped), 0);
    if (r == 0) return;
    if (r > 0) {
      dropped += r;
      last_progress = absl::Now();
      continue;
    }
    if (errno == EINTR) continue;
    if ((errno != EAGAIN && errno != EWOULDBLOCK) ||
        !WaitReady(fd, POLLIN, limit, last_progress, "linger").ok()) {
      return;
    }
  }
}

}  // namespace trainyard::ps
