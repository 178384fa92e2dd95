// Whole-buffer TCP I/O with time limits on non-blocking sockets: what the parameter server's data
// plane (data_plane_client.h, data_plane_server.h) moves its bytes with. Each call loops over
// send/recv until every byte went, polling only when the kernel has no room or no data, so a
// transfer costs what a plain blocking socket costs. No gRPC, no protobuf.
//
// Errors: UNAVAILABLE when the peer closed or reset the connection (or it cannot be reached),
// DEADLINE_EXCEEDED when the time limit passed, INTERNAL for any other failure of a system call;
// each message names the operation and says how far it got.
#ifndef TRAINYARD_RPC_PS_TCP_IO_H_
#define TRAINYARD_RPC_PS_TCP_IO_H_

#include <sys/uio.h>

#include <cstddef>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace trainyard::ps {

// An owned file descriptor, closed on destruction. Movable.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { reset(); }

  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }
  void reset();

 private:
  int fd_ = -1;
};

// When a transfer must be over: at `deadline`, or after `idle` without a byte moving, whichever
// comes first. Clients give a call's deadline; the server, which must not be held forever by a
// peer that stopped reading or sending, an idle limit.
struct IoLimit {
  absl::Time deadline = absl::InfiniteFuture();
  absl::Duration idle = absl::InfiniteDuration();

  static IoLimit Until(absl::Time deadline) { return {deadline, absl::InfiniteDuration()}; }
  static IoLimit Idle(absl::Duration idle) { return {absl::InfiniteFuture(), idle}; }
};

// Waits until `fd` is ready for `events` (POLLIN, POLLOUT) within `limit`, counting the idle
// time from `last_progress`; DEADLINE_EXCEEDED naming `what` when it runs out.
absl::Status WaitReady(int fd, short events, const IoLimit& limit, absl::Time last_progress,
                       absl::string_view what);

// Splits "HOST:PORT" ("[v6]:PORT" too). INVALID_ARGUMENT naming `flag` when it is not that.
absl::Status SplitHostPort(const std::string& address, const std::string& flag, std::string* host,
                           int* port);

// "HOST:PORT", with brackets around an IPv6 address.
std::string JoinHostPort(const std::string& host, int port);

// A listening TCP socket on `address` (HOST:PORT; port 0 picks a free one), non-blocking, with
// `congestion` as its TCP congestion control (inherited by the connections it accepts; empty: the
// host's). `bound_port` gets the port. Errors name `flag`.
absl::StatusOr<UniqueFd> TcpListen(const std::string& address, const std::string& congestion,
                                   const std::string& flag, int* bound_port);

// Makes a connected socket ready for bulk transfers: non-blocking, TCP_NODELAY, keepalive probes
// after `keepalive_idle` of silence (a peer that vanished fails the connection), `congestion`
// (empty: unchanged).
absl::Status PrepareTcpSocket(int fd, const std::string& congestion,
                              absl::Duration keepalive_idle = absl::Seconds(20));

// Connects to `address` (HOST:PORT, a name or a numeric address) before `deadline` and prepares
// the socket (PrepareTcpSocket). Its errors do not repeat the address; the caller names it.
absl::StatusOr<UniqueFd> TcpConnect(const std::string& address, const std::string& congestion,
                                    absl::Time deadline);

// Sends every byte of `pieces`, in order (MSG_NOSIGNAL: a closed peer is an error, not SIGPIPE).
absl::Status SendAll(int fd, absl::Span<const iovec> pieces, IoLimit limit);
inline absl::Status SendAll(int fd, absl::string_view bytes, IoLimit limit) {
  const iovec piece{const_cast<char*>(bytes.data()), bytes.size()};
  return SendAll(fd, absl::MakeConstSpan(&piece, 1), limit);
}

// Receives exactly `n` bytes into `out`. `*received`, if given, counts the bytes that arrived
// (also on error): a peer that closed before the first byte is then told apart from one that
// closed in the middle.
absl::Status RecvAll(int fd, char* out, size_t n, IoLimit limit, size_t* received = nullptr);

// Receives what has arrived, at least one byte and at most `n` (waiting within `limit` for the
// first): the count. UNAVAILABLE when the peer closed the connection first.
absl::StatusOr<size_t> RecvSome(int fd, char* out, size_t n, IoLimit limit);

// Receives and drops `n` bytes (a request whose payload is not wanted).
absl::Status Discard(int fd, size_t n, IoLimit limit);

// Receives and drops bytes until the peer closes the connection, `max_bytes` went, or `limit`
// runs out, whichever comes first (a lingering close).
void DiscardUntilClosed(int fd, size_t max_bytes, IoLimit limit);

}  // namespace trainyard::ps

#endif  // TRAINYARD_RPC_PS_TCP_IO_H_
