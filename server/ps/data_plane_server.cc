#include "server/ps/data_plane_server.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <spdlog/spdlog.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <system_error>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"

namespace trainyard::ps {
namespace {

// A lingering close reads at most this much, for at most this long.
constexpr size_t kLingerBytes = size_t{256} << 20;
constexpr absl::Duration kLingerTime = absl::Seconds(2);
// Shorter for a connection refused over the limit: the accept thread lingers.
constexpr absl::Duration kRefusalLingerTime = absl::Milliseconds(200);

}  // namespace

DataPlaneServer::DataPlaneServer(DataPlaneOptions options, ShardManager& shards, PsMetrics metrics)
    : options_(std::move(options)), shards_(shards), metrics_(metrics) {}

absl::StatusOr<std::unique_ptr<DataPlaneServer>> DataPlaneServer::Start(DataPlaneOptions options,
                                                                        ShardManager& shards,
                                                                        PsMetrics metrics) {
  std::unique_ptr<DataPlaneServer> s(new DataPlaneServer(std::move(options), shards, metrics));
  ASSIGN_OR_RETURN(s->listener_, TcpListen(s->options_.listen_address, s->options_.tcp_congestion,
                                           "--data-listen", &s->port_));
  s->wakeup_ = UniqueFd(eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK));
  if (!s->wakeup_.valid()) {
    return absl::InternalError(absl::StrCat("eventfd: ", std::strerror(errno)));
  }
  s->accept_thread_ = std::thread([raw = s.get()] { raw->AcceptLoop(); });
  return s;
}

DataPlaneServer::~DataPlaneServer() { Shutdown(absl::Now()); }

void DataPlaneServer::StopAccepting() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  if (accept_thread_.joinable()) {
    const uint64_t one = 1;
    if (write(wakeup_.get(), &one, sizeof(one)) != sizeof(one)) {
      spdlog::warn("data plane: cannot wake the accept loop: {}", std::strerror(errno));
    }
    accept_thread_.join();
    listener_.reset();  // new connections are refused, not left waiting in the backlog
  }
}

void DataPlaneServer::Shutdown(absl::Time deadline) {
  StopAccepting();
  std::vector<std::thread> threads;
  {
    absl::MutexLock lock(&mu_);
    // Idle connections close now (their threads wait for a next call that will not come).
    for (Connection& c : connections_) {
      if (!c.busy && c.fd.valid()) shutdown(c.fd.get(), SHUT_RDWR);
    }
    // Calls in progress get until the deadline.
    mu_.AwaitWithDeadline(absl::Condition(
                              +[](std::list<Connection>* cs) {
                                return std::none_of(cs->begin(), cs->end(),
                                                    [](const Connection& c) { return c.busy; });
                              },
                              &connections_),
                          deadline);
    for (Connection& c : connections_) {
      if (c.fd.valid()) shutdown(c.fd.get(), SHUT_RDWR);
      if (c.thread.joinable()) threads.push_back(std::move(c.thread));
    }
  }
  for (std::thread& t : threads) t.join();
  absl::MutexLock lock(&mu_);
  connections_.clear();
}

void DataPlaneServer::ReapDone() {
  std::vector<std::thread> ended;
  {
    absl::MutexLock lock(&mu_);
    for (auto it = connections_.begin(); it != connections_.end();) {
      if (!it->done) {
        ++it;
        continue;
      }
      ended.push_back(std::move(it->thread));
      it = connections_.erase(it);
    }
  }
  for (std::thread& t : ended) t.join();
}

void DataPlaneServer::AcceptLoop() {
  while (true) {
    pollfd fds[2] = {{listener_.get(), POLLIN, 0}, {wakeup_.get(), POLLIN, 0}};
    const int r = poll(fds, 2, -1);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      spdlog::error("data plane: poll: {}", std::strerror(errno));
      return;
    }
    if (fds[1].revents != 0) return;  // Shutdown
    UniqueFd fd(accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC));
    if (!fd.valid()) {
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        spdlog::warn("data plane: accept: {}", std::strerror(errno));
        absl::SleepFor(absl::Milliseconds(10));  // until a connection ends and frees a descriptor
      }
      continue;  // EAGAIN, EINTR, ECONNABORTED: the next one
    }
    ReapDone();
    if (absl::Status s = PrepareTcpSocket(fd.get(), options_.tcp_congestion); !s.ok()) {
      spdlog::warn("data plane: a new connection: {}", std::string(s.message()));
      continue;
    }
    bool full = false;
    {
      absl::MutexLock lock(&mu_);
      if (stopping_) return;
      full = static_cast<int>(connections_.size()) >= options_.max_connections;
      if (!full) {
        Connection& c = connections_.emplace_back();
        c.fd = std::move(fd);
        try {
          c.thread = std::thread([this, &c] { Serve(&c); });
        } catch (const std::system_error& e) {
          spdlog::warn("data plane: no thread for a new connection: {}", e.what());
          fd = std::move(c.fd);
          connections_.pop_back();
          full = true;
        }
      }
    }
    if (full) Refuse(std::move(fd));
  }
}

void DataPlaneServer::Refuse(UniqueFd fd) {
  // Told why (after what it may have sent already is read for a moment), then closed.
  Conn conn(std::move(fd));
  RespondAndLinger(conn,
                   absl::ResourceExhaustedError(
                       absl::StrCat("this parameter server serves at most ",
                                    options_.max_connections, " data-plane connections")),
                   kRefusalLingerTime);
}

bool DataPlaneServer::SetBusy(Connection* c, bool busy) {
  absl::MutexLock lock(&mu_);
  c->busy = busy;
  return !stopping_;
}

void DataPlaneServer::Serve(Connection* c) {
  int fd;
  {
    absl::MutexLock lock(&mu_);
    fd = c->fd.get();
  }
  const IoLimit limit = IoLimit::Idle(options_.io_timeout);
  // The connection's stream: the socket itself, or TLS over it once the handshake is done (the
  // socket stays in c->fd, so that Shutdown can shut it down, until the thread ends).
  Conn conn;
  if (options_.tls != nullptr) {
    auto shaken = TlsAccept(UniqueFd(::dup(fd)), *options_.tls, limit);
    if (!shaken.ok()) {
      spdlog::warn("data plane: a connection refused: {}", std::string(shaken.status().message()));
      absl::MutexLock lock(&mu_);
      c->fd.reset();
      c->done = true;
      return;
    }
    conn = *std::move(shaken);
  } else {
    conn = Conn(UniqueFd(::dup(fd)));
  }
  while (true) {
    char header[kRequestHeaderBytes];
    // An idle connection waits for its next call as long as it stays open (TCP keepalive finds
    // a peer that vanished); once a call began, every byte has the idle limit.
    if (!RecvAll(conn, header, 1, IoLimit()).ok()) break;
    const bool stopping = !SetBusy(c, true);
    bool keep = false;
    if (!stopping) {
      if (absl::Status s = RecvAll(conn, header + 1, kRequestHeaderBytes - 1, limit); s.ok()) {
        uint32_t job_id_bytes = 0, credential_bytes = 0;
        auto request = DecodeRequestHeader(absl::string_view(header, kRequestHeaderBytes),
                                           &job_id_bytes, &credential_bytes);
        if (!request.ok()) {
          RespondAndLinger(conn, request.status(), kLingerTime);
        } else {
          request->job_id.resize(job_id_bytes);
          request->credential.resize(credential_bytes);
          if (RecvAll(conn, request->job_id.data(), job_id_bytes, limit).ok() &&
              RecvAll(conn, request->credential.data(), credential_bytes, limit).ok()) {
            // A refused call's payload is not read: its connection closes.
            absl::Status allowed =
                options_.authorizer == nullptr
                    ? absl::OkStatus()
                    : options_.authorizer->Authorize(request->credential, request->job_id,
                                                     request->attempt);
            if (allowed.ok()) {
              keep = ServeCall(conn, *request);
            } else {
              RespondAndLinger(conn, allowed, kLingerTime);
            }
          }
        }
      }
    }
    if (!SetBusy(c, false) || !keep) break;
  }
  conn.reset();
  absl::MutexLock lock(&mu_);
  c->fd.reset();
  c->done = true;
}

bool DataPlaneServer::ServeCall(Conn& conn, const DataPlaneRequest& request) {
  return request.op == DataPlaneOp::kPush ? ServePush(conn, request)
                                          : ServeUpdateAndPull(conn, request);
}

bool DataPlaneServer::Respond(Conn& conn, const DataPlaneResponse& response) {
  return SendAll(conn, EncodeResponse(response), IoLimit::Idle(options_.io_timeout)).ok();
}

void DataPlaneServer::RespondAndLinger(Conn& conn, const absl::Status& status,
                                       absl::Duration linger) {
  if (!Respond(conn, {status, /*closing=*/true})) return;
  ShutdownWrite(conn);
  DiscardUntilClosed(conn, kLingerBytes, {absl::Now() + linger, absl::Seconds(1)});
}

bool DataPlaneServer::ServePush(Conn& conn, const DataPlaneRequest& r) {
  const IoLimit limit = IoLimit::Idle(options_.io_timeout);
  const int64_t element_bytes = WireElementBytes(r.format);
  // Checked before any payload is received: a push for an unknown job, a stale attempt or
  // elements outside the range has its payload read and dropped.
  absl::Status error = shards_.CheckPushRange(r.job_id, r.attempt, r.begin, r.end);
  if (!error.ok()) {
    return Discard(conn, r.payload_bytes(), limit).ok() && Respond(conn, {error});
  }
  const int64_t chunk = r.chunk_elements > 0 ? r.chunk_elements : kDefaultChunkElements;
  int64_t staged = 0, duplicate = 0;
  for (int64_t a = r.begin; a < r.end; a += chunk) {
    const size_t bytes = std::min(chunk, r.end - a) * element_bytes;
    if (!error.ok()) {  // the rest of a push that failed: read and dropped
      if (!Discard(conn, bytes, limit).ok()) return false;
      continue;
    }
    // Received straight into the buffer the shard stages; the update reads it there.
    std::shared_ptr<char> buffer(new char[bytes], std::default_delete<char[]>());
    if (absl::Status s = RecvAll(conn, buffer.get(), bytes, limit); !s.ok()) {
      spdlog::debug("data plane: push of job {} cut off: {}", r.job_id, std::string(s.message()));
      return false;
    }
    const absl::string_view data(buffer.get(), bytes);
    auto pushed = shards_.Push(r.job_id, r.attempt, r.step, a, r.format,
                               ReceivedBytes{{data}, std::move(buffer)});
    if (!pushed.ok()) {
      error = pushed.status();
      continue;
    }
    staged += pushed->staged;
    duplicate += pushed->duplicate;
    if (metrics_.pushed_bytes != nullptr) metrics_.pushed_bytes->Increment(bytes);
  }
  return Respond(conn, {error, false, staged, duplicate});
}

bool DataPlaneServer::ServeUpdateAndPull(Conn& conn, const DataPlaneRequest& r) {
  if (r.update) {
    const absl::Time start = absl::Now();
    absl::Status s =
        shards_.Update(r.job_id, r.attempt, r.step, r.begin, r.end, r.lr, r.grad_scale,
                       LentWaitDeadline(r.timeout_ms > 0 ? start + absl::Milliseconds(r.timeout_ms)
                                                         : absl::InfiniteFuture()));
    if (!s.ok()) return Respond(conn, {s});
    if (metrics_.adam_step_seconds != nullptr) {
      metrics_.adam_step_seconds->Observe(absl::ToDoubleSeconds(absl::Now() - start));
    }
  }
  // The whole range lent until its last byte is in the socket: one step's values throughout.
  // Waits for the step no longer than the caller does.
  const int64_t wait_ms = r.timeout_ms > 0 ? std::min(r.wait_ms, r.timeout_ms) : r.wait_ms;
  auto lent = shards_.LendParams(r.job_id, r.attempt, r.step, r.begin, r.end, r.format,
                                 absl::Milliseconds(wait_ms));
  if (!lent.ok()) return Respond(conn, {lent.status()});
  const std::string header =
      EncodeResponse({absl::OkStatus(), false, static_cast<int64_t>((*lent)->bytes()), 0});
  const iovec pieces[2] = {{const_cast<char*>(header.data()), header.size()},
                           {const_cast<char*>((*lent)->data()), (*lent)->bytes()}};
  if (absl::Status s = SendAll(conn, pieces, IoLimit::Idle(options_.io_timeout)); !s.ok()) {
    spdlog::debug("data plane: pull of job {} cut off: {}", r.job_id, std::string(s.message()));
    return false;
  }
  if (metrics_.pulled_bytes != nullptr) {
    metrics_.pulled_bytes->Increment(static_cast<double>((*lent)->bytes()));
  }
  return true;
}

}  // namespace trainyard::ps
