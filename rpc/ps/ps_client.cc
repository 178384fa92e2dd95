#include "rpc/ps/ps_client.h"

#include <grpcpp/completion_queue.h>
#include <grpcpp/create_channel.h>
#include <grpcpp/impl/codegen/proto_utils.h>
#include <grpcpp/security/credentials.h>
#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/client_interceptor.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "rpc/ps/ps_wire.h"

namespace trainyard::ps {
namespace {

constexpr char kPushGradients[] = "/trainyard.v1.ParameterServerService/PushGradients";
constexpr char kUpdateAndPull[] = "/trainyard.v1.ParameterServerService/UpdateAndPull";

// One call through a generic stub on its own completion queue, each operation waited for in turn
// (the synchronous API has no generic streaming calls). Used by one thread.
class AsyncCall {
 public:
  AsyncCall(grpc::GenericStub& stub, const char* method, absl::Duration timeout) {
    if (timeout != absl::InfiniteDuration()) {
      ctx_.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
    }
    call_ = stub.PrepareCall(&ctx_, method, &cq_);
    call_->StartCall(this);
    started_ = Wait();
  }
  ~AsyncCall() {
    if (!finished_) {
      Cancel();
      Finish();
    }
    cq_.Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (cq_.Next(&tag, &ok)) {
    }
  }

  bool started() const { return started_; }
  // Each returns false once the call is over (Read: no more messages).
  bool Write(const grpc::ByteBuffer& message) {
    call_->Write(message, this);
    return Wait();
  }
  bool WritesDone() {
    call_->WritesDone(this);
    return Wait();
  }
  bool Read(grpc::ByteBuffer* message) {
    call_->Read(message, this);
    return Wait();
  }
  void Cancel() { ctx_.TryCancel(); }
  grpc::Status Finish() {
    finished_ = true;
    grpc::Status status;
    call_->Finish(&status, this);
    Wait();
    return status;
  }

 private:
  bool Wait() {
    void* tag = nullptr;
    bool ok = false;
    return cq_.Next(&tag, &ok) && ok;
  }

  grpc::ClientContext ctx_;
  grpc::CompletionQueue cq_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call_;
  bool started_ = false;
  bool finished_ = false;
};

}  // namespace

grpc::Status PushGradientsZeroCopy(grpc::GenericStub& stub, const v1::GradientChunk& header,
                                   const void* data, int64_t begin, int64_t end,
                                   int64_t chunk_elements, absl::Duration timeout,
                                   v1::PushGradientsResponse* response) {
  const int64_t element_bytes = WireElementBytes(header.format());
  chunk_elements = std::max<int64_t>(1, chunk_elements);
  AsyncCall call(stub, kPushGradients, timeout);
  v1::GradientChunk chunk = header;
  chunk.clear_data();
  bool ok = call.started();
  for (int64_t a = begin; ok && a < end; a += chunk_elements) {
    const int64_t n = std::min(chunk_elements, end - a);
    chunk.set_offset(a);
    ok = call.Write(EncodeGradientChunk(
        chunk, static_cast<const char*>(data) + (a - begin) * element_bytes, n * element_bytes));
  }
  if (ok) call.WritesDone();
  grpc::ByteBuffer reply;
  const bool replied = call.Read(&reply);
  const grpc::Status status = call.Finish();
  if (!status.ok()) return status;
  if (!replied ||
      !grpc::SerializationTraits<v1::PushGradientsResponse>::Deserialize(&reply, response).ok()) {
    return grpc::Status(grpc::StatusCode::INTERNAL, "push: a malformed PushGradientsResponse");
  }
  return grpc::Status::OK;
}

grpc::Status UpdateAndPullZeroCopy(grpc::GenericStub& stub, const v1::UpdateAndPullRequest& request,
                                   void* out, absl::Duration timeout,
                                   const std::function<void()>& on_first_chunk) {
  const grpc::Slice serialized(request.SerializeAsString());
  AsyncCall call(stub, kUpdateAndPull, timeout);
  const bool sent =
      call.started() && call.Write(grpc::ByteBuffer(&serialized, 1)) && call.WritesDone();
  grpc::ByteBuffer message;
  int64_t received = 0;
  bool first = true;
  absl::Status decoded;
  while (sent && decoded.ok() && call.Read(&message)) {
    if (first && on_first_chunk) on_first_chunk();
    first = false;
    decoded = DecodeParameterChunkInto(message, request.format(), request.begin(), request.end(),
                                       out, &received);
  }
  if (!decoded.ok()) call.Cancel();
  const grpc::Status finished = call.Finish();
  if (!decoded.ok()) {
    return grpc::Status(grpc::StatusCode::INTERNAL, std::string(decoded.message()));
  }
  if (!finished.ok()) return finished;
  if (received != request.end() - request.begin()) {
    return grpc::Status(
        grpc::StatusCode::INTERNAL,
        absl::StrCat("pull: ", received, " of the ", request.end() - request.begin(),
                     " elements of [", request.begin(), ", ", request.end(), ") arrived"));
  }
  return grpc::Status::OK;
}

namespace {

// Adds the "authorization" metadata to every call of its channel.
class AuthorizationInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit AuthorizationInterceptor(const std::string* value) : value_(value) {}
  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_INITIAL_METADATA)) {
      methods->GetSendInitialMetadata()->insert({"authorization", *value_});
    }
    methods->Proceed();
  }

 private:
  const std::string* value_;
};

class AuthorizationInterceptorFactory final
    : public grpc::experimental::ClientInterceptorFactoryInterface {
 public:
  explicit AuthorizationInterceptorFactory(std::string value) : value_(std::move(value)) {}
  grpc::experimental::Interceptor* CreateClientInterceptor(
      grpc::experimental::ClientRpcInfo*) override {
    return new AuthorizationInterceptor(&value_);
  }

 private:
  const std::string value_;  // outlives the channel's calls: the channel owns the factory
};

}  // namespace

std::shared_ptr<grpc::Channel> CreatePsChannel(
    const std::string& address, const grpc::ChannelArguments& args,
    const std::string& authorization, std::shared_ptr<grpc::ChannelCredentials> credentials) {
  if (authorization.empty()) return grpc::CreateCustomChannel(address, credentials, args);
  std::vector<std::unique_ptr<grpc::experimental::ClientInterceptorFactoryInterface>> factories;
  factories.push_back(std::make_unique<AuthorizationInterceptorFactory>(authorization));
  return grpc::experimental::CreateCustomChannelWithInterceptors(address, credentials, args,
                                                                 std::move(factories));
}

}  // namespace trainyard::ps
