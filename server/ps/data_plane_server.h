// DataPlaneServer: trainyard-ps's TCP data plane (data_plane_wire.h). Accepts connections, one
// thread each, and serves their pushes and update-and-pulls on the ShardManager exactly as
// ParameterServiceImpl serves the gRPC calls: a push is received chunk by chunk into buffers the
// shard stages as they are (ReceivedBytes: no copy after the socket's), a pull is sent straight
// from where the shard holds the parameters, lent for the whole range until the last byte went
// (ShardManager::LendParams), so it carries one step's values throughout.
//
// A peer that stops sending or reading in the middle of a call is dropped after `io_timeout`
// without progress (its lent range returned); one that vanished is found by TCP keepalive.
//
// Thread-safe: Start and Shutdown from the owner's thread; the rest runs on its own threads.
#ifndef TRAINYARD_SERVER_PS_DATA_PLANE_SERVER_H_
#define TRAINYARD_SERVER_PS_DATA_PLANE_SERVER_H_

#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "rpc/ps/data_plane_wire.h"
#include "rpc/ps/tcp_io.h"
#include "rpc/ps/tls_io.h"
#include "server/ps/job_authorizer.h"
#include "server/ps/ps_service.h"
#include "server/ps/shard_manager.h"

namespace trainyard::ps {

struct DataPlaneOptions {
  std::string listen_address = "127.0.0.1:0";  // HOST:PORT; port 0 picks a free one
  std::string tcp_congestion;                  // of the listening and accepted sockets
  // A call with no byte moving for this long is dropped (its connection closed).
  absl::Duration io_timeout = absl::Seconds(60);
  // More connections at once are refused (RESOURCE_EXHAUSTED, then closed).
  int max_connections = 1024;
  // Decides each call by its credential (null: every call); must outlive the server. A refused
  // call is answered with the refusal and its connection closed.
  JobAuthorizer* authorizer = nullptr;
  // TLS on every connection (the server's certificate, followed when its files change); null:
  // plain TCP. A connection whose handshake fails is closed.
  std::shared_ptr<const TlsConfig> tls;
};

class DataPlaneServer {
 public:
  // Listens and starts accepting. `shards` must outlive the server; `metrics` members may be
  // null. INVALID_ARGUMENT / UNAVAILABLE naming --data-listen when it cannot listen.
  static absl::StatusOr<std::unique_ptr<DataPlaneServer>> Start(DataPlaneOptions options,
                                                                ShardManager& shards,
                                                                PsMetrics metrics);
  ~DataPlaneServer();  // Shutdown(now) if not done

  int port() const { return port_; }

  // Stops accepting: the listening socket is closed, so new connections are refused. Idempotent.
  void StopAccepting();
  // StopAccepting, then closes idle connections at once; calls in progress get until `deadline`
  // to finish, then their connections are closed too. Returns when every thread has ended. A
  // closed connection does not interrupt a call waiting inside the ShardManager (for a step, for
  // lent elements): the owner ends those first with ShardManager::Close, or they run out their
  // wait (at most the caller's timeout_ms, kMaxLentWait for updates).
  void Shutdown(absl::Time deadline);

 private:
  struct Connection {
    // The socket (Shutdown shuts it down); the connection's thread works on a duplicate of it,
    // with TLS over it when the data plane has TLS.
    UniqueFd fd;
    std::thread thread;
    bool busy = false;  // inside a call (guarded by the server's mu_)
    bool done = false;  // its thread is about to end; join it
  };

  DataPlaneServer(DataPlaneOptions options, ShardManager& shards, PsMetrics metrics);
  void AcceptLoop();
  // One connection's calls, until the peer closes it, an I/O error or shutdown.
  void Serve(Connection* c);
  // One call whose header was read. False when the connection must be closed after it.
  bool ServeCall(Conn& conn, const DataPlaneRequest& request);
  bool ServePush(Conn& conn, const DataPlaneRequest& request);
  bool ServeUpdateAndPull(Conn& conn, const DataPlaneRequest& request);
  bool Respond(Conn& conn, const DataPlaneResponse& response);
  // Sends `status` with the closing flag, then reads and drops what the peer still sends for a
  // little while (a lingering close), so that a peer still sending its request reads the answer
  // instead of a reset connection.
  void RespondAndLinger(Conn& conn, const absl::Status& status, absl::Duration linger);
  // Refuses a connection beyond max_connections, on the accept thread (in plain TCP: a TLS
  // peer sees its handshake fail).
  void Refuse(UniqueFd fd);
  // Joins the threads of connections that ended. Called with mu_ not held.
  void ReapDone();
  // Moves a connection into or out of a call; false when the server is stopping.
  bool SetBusy(Connection* c, bool busy);

  const DataPlaneOptions options_;
  ShardManager& shards_;
  const PsMetrics metrics_;
  UniqueFd listener_;
  UniqueFd wakeup_;  // an eventfd: written by Shutdown to end the accept loop
  int port_ = 0;
  std::thread accept_thread_;

  absl::Mutex mu_;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::list<Connection> connections_ ABSL_GUARDED_BY(mu_);
};

}  // namespace trainyard::ps

#endif  // TRAINYARD_SERVER_PS_DATA_PLANE_SERVER_H_
