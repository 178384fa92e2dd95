#include "common/malformed_request.h"

#include <google/protobuf/descriptor.h>

#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace trainyard {
namespace {

class MalformedRequestInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit MalformedRequestInterceptor(const google::protobuf::MethodDescriptor* method)
      : method_(method) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using grpc::experimental::InterceptionHookPoints;
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::POST_RECV_MESSAGE) &&
        methods->GetRecvMessage() != nullptr) {
      received_ = true;
    }
    if (method_ != nullptr && !received_ &&
        methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status status = methods->GetSendStatus();
      // gRPC's own answer to a request it could not parse: no handler ran, so no message.
      if ((status.error_code() == grpc::StatusCode::UNIMPLEMENTED ||
           status.error_code() == grpc::StatusCode::INTERNAL) &&
          status.error_message().empty()) {
        methods->ModifySendStatus(
            grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                         absl::StrCat("request: not a valid ", method_->input_type()->full_name(),
                                      " (the bytes are not its protobuf encoding)")));
      }
    }
    methods->Proceed();
  }

 private:
  const google::protobuf::MethodDescriptor* const method_;  // null: not one of ours
  bool received_ = false;
};

class Factory final : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    // "/trainyard.v1.JobService/SubmitJob" -> "trainyard.v1.JobService.SubmitJob"
    std::string name = info->method() != nullptr ? info->method() : "";
    if (!name.empty() && name[0] == '/') name.erase(0, 1);
    absl::StrReplaceAll({{"/", "."}}, &name);
    return new MalformedRequestInterceptor(
        google::protobuf::DescriptorPool::generated_pool()->FindMethodByName(name));
  }
};

}  // namespace

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
MalformedRequestInterceptorFactory() {
  return std::make_unique<Factory>();
}

}  // namespace trainyard
