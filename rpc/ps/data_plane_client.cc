#include "rpc/ps/data_plane_client.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "rpc/ps/wire_types.h"

namespace trainyard::ps {

absl::StatusOr<std::string> DataPlaneDialAddress(const std::string& data_plane_address,
                                                 const std::string& grpc_address) {
  std::string host, grpc_host;
  int port = 0, grpc_port = 0;
  RETURN_IF_ERROR(SplitHostPort(data_plane_address, "GetDataPlane.address", &host, &port));
  const bool wildcard = host == "0.0.0.0" || host == "::";
  if (wildcard && SplitHostPort(grpc_address, "address", &grpc_host, &grpc_port).ok()) {
    return JoinHostPort(grpc_host, port);
  }
  return data_plane_address;
}

DataPlaneClient::DataPlaneClient(std::string address, std::string tcp_congestion,
                                 std::string credential, std::shared_ptr<const TlsConfig> tls)
    : address_(std::move(address)),
      tcp_congestion_(std::move(tcp_congestion)),
      credential_(std::move(credential)),
      tls_(std::move(tls)) {}

absl::Status DataPlaneClient::CallOnce(Conn& conn, const DataPlaneRequest& request,
                                       const void* payload, void* out, absl::Time deadline,
                                       const std::function<void()>& on_first_byte,
                                       DataPlaneResponse* response, bool* answered, bool* keep) {
  *answered = false;
  *keep = false;
  const IoLimit limit = IoLimit::Until(deadline);
  const std::string head = EncodeRequest(request);
  const iovec pieces[2] = {
      {const_cast<char*>(head.data()), head.size()},
      {const_cast<void*>(payload), payload != nullptr ? size_t(request.payload_bytes()) : 0}};
  // A server that refused the request's header answers and closes while the payload is still
  // being sent: its answer is read even when sending failed.
  const absl::Status sent = SendAll(conn, pieces, limit);
  if (!sent.ok() && sent.code() != absl::StatusCode::kUnavailable) return sent;

  char header[kResponseHeaderBytes];
  size_t received = 0;
  absl::Status status = RecvAll(conn, header, kResponseHeaderBytes, limit, &received);
  *answered = received > 0;
  if (!status.ok()) return sent.ok() ? status : sent;
  if (on_first_byte) on_first_byte();
  uint32_t message_bytes = 0;
  ASSIGN_OR_RETURN(*response,
                   DecodeResponseHeader(absl::string_view(header, sizeof(header)), &message_bytes));
  std::string message(message_bytes, '\0');
  RETURN_IF_ERROR(RecvAll(conn, message.data(), message_bytes, limit));
  response->status = absl::Status(response->status.code(), message);
  if (response->status.ok() && request.op == DataPlaneOp::kUpdateAndPull) {
    if (response->count_a != request.payload_bytes()) {
      return absl::InternalError(absl::StrCat("pull: the answer announces ", response->count_a,
                                              " bytes for [", request.begin, ", ", request.end,
                                              "), not ", request.payload_bytes()));
    }
    RETURN_IF_ERROR(RecvAll(conn, static_cast<char*>(out), response->count_a, limit));
  }
  *keep = sent.ok() && !response->closing;
  return absl::OkStatus();
}

absl::Status DataPlaneClient::Call(const DataPlaneRequest& request, const void* payload, void* out,
                                   absl::Duration timeout,
                                   const std::function<void()>& on_first_byte,
                                   DataPlaneResponse* response) {
  const absl::Time deadline =
      timeout == absl::InfiniteDuration() ? absl::InfiniteFuture() : absl::Now() + timeout;
  DataPlaneRequest r = request;
  if (timeout != absl::InfiniteDuration()) {
    r.timeout_ms = std::max<int64_t>(1, absl::ToInt64Milliseconds(timeout));
  }
  // What the server would refuse is refused here, before a byte goes (and before a size computed
  // from a bad range or format could be sent).
  RETURN_IF_ERROR(ValidateRequest(r, r.job_id.size()));
  for (int attempt = 0;; ++attempt) {
    Conn conn;
    {
      absl::MutexLock lock(&mu_);
      if (attempt == 0 && !idle_.empty()) {
        conn = std::move(idle_.back());
        idle_.pop_back();
      }
    }
    const bool reused = conn.valid();
    absl::Status s;
    bool answered = false, keep = false;
    if (!reused) {
      auto connected = TcpConnect(address_, tcp_congestion_, deadline);
      s = connected.status();
      if (connected.ok() && tls_ == nullptr) {
        conn = Conn(*std::move(connected));
      } else if (connected.ok()) {
        std::string host;
        int port = 0;
        s = SplitHostPort(address_, "address", &host, &port);
        if (s.ok()) {
          auto shaken = TlsConnect(*std::move(connected), *tls_, host, IoLimit::Until(deadline));
          s = shaken.status();
          if (shaken.ok()) conn = *std::move(shaken);
        }
      }
    }
    if (s.ok()) {
      s = CallOnce(conn, r, payload, out, deadline, on_first_byte, response, &answered, &keep);
    }
    if (!s.ok() && reused && !answered && s.code() == absl::StatusCode::kUnavailable) {
      continue;  // the server closed the kept connection meanwhile: once more on a new one
    }
    if (!s.ok()) {
      return absl::Status(s.code(), absl::StrCat("data plane ", address_, ": ", s.message()));
    }
    if (keep) {
      absl::MutexLock lock(&mu_);
      idle_.push_back(std::move(conn));
    }
    return response->status;
  }
}

absl::Status DataPlaneClient::Push(const v1::GradientChunk& header, const void* data, int64_t begin,
                                   int64_t end, int64_t chunk_elements, absl::Duration timeout,
                                   v1::PushGradientsResponse* response) {
  DataPlaneRequest r;
  r.op = DataPlaneOp::kPush;
  r.format = header.format();  // as given: ValidateRequest refuses one it does not know
  r.job_id = header.job_id();
  r.credential = credential_;
  r.attempt = header.attempt();
  r.step = header.step();
  r.begin = begin;
  r.end = end;
  r.chunk_elements = chunk_elements;
  DataPlaneResponse answer;
  RETURN_IF_ERROR(Call(r, data, nullptr, timeout, nullptr, &answer));
  response->set_elements_staged(answer.count_a);
  response->set_elements_duplicate(answer.count_b);
  return absl::OkStatus();
}

absl::Status DataPlaneClient::UpdateAndPull(const v1::UpdateAndPullRequest& request, void* out,
                                            absl::Duration timeout,
                                            const std::function<void()>& on_first_byte) {
  DataPlaneRequest r;
  r.op = DataPlaneOp::kUpdateAndPull;
  r.format = request.format();
  r.job_id = request.job_id();
  r.credential = credential_;
  r.attempt = request.attempt();
  r.step = request.step();
  r.begin = request.begin();
  r.end = request.end();
  r.chunk_elements = request.chunk_elements();
  r.update = request.has_update();
  r.lr = request.update().lr();
  r.grad_scale = request.update().grad_scale();
  r.wait_ms = request.wait_ms();
  DataPlaneResponse answer;
  return Call(r, nullptr, out, timeout, on_first_byte, &answer);
}

}  // namespace trainyard::ps
