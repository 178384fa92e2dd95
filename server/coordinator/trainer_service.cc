#include "server/coordinator/service_auth.h"
#include "server/coordinator/services.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/field_limits.h"

namespace trainyard::coordinator {
namespace {

// What a rank's CheckpointReport must hold beyond the size limits, each error naming the field.
absl::Status CheckCheckpointReport(const v1::CheckpointReport& r) {
  auto bad = [](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); };
  if (r.job_id().empty()) return bad("job_id: required");
  if (r.path().empty()) return bad("path: required");
  if (r.step() < 0) return bad("step: must be >= 0, got ", r.step());
  if (r.bytes() < 0) return bad("bytes: must be >= 0, got ", r.bytes());
  if (r.has_eval_loss() && !std::isfinite(r.eval_loss())) return bad("eval_loss: must be finite");
  if (r.kept_size() > kMaxKeptCheckpoints) {
    return bad("kept: ", r.kept_size(), " entries, at most ", kMaxKeptCheckpoints);
  }
  for (int i = 0; i < r.kept_size(); ++i) {
    const v1::KeptCheckpoint& k = r.kept(i);
    if (k.step() < 0) return bad("kept[", i, "].step: must be >= 0, got ", k.step());
    if (k.path().empty()) return bad("kept[", i, "].path: required");
    if (k.has_eval_loss() && !std::isfinite(k.eval_loss())) {
      return bad("kept[", i, "].eval_loss: must be finite");
    }
  }
  return absl::OkStatus();
}

}  // namespace

// ---- TrainerService ----

grpc::ServerUnaryReactor* TrainerServiceImpl::ReportStep(grpc::CallbackServerContext* ctx,
                                                         const v1::StepReport* request,
                                                         v1::TrainerCommands* response) {
  if (absl::Status s =
          AuthenticateRank(ctx, identities_, "ReportStep", request->job_id(), request->attempt());
      !s.ok()) {
    return Done(ctx, s);
  }
  if (absl::Status s = CheckFieldSizes(*request, FieldLimits{4096, 1024, kMaxReportBytes}, "");
      !s.ok()) {
    return Done(ctx, s);
  }
  if (request->job_id().empty()) return Done(ctx, absl::InvalidArgumentError("job_id: required"));
  if (request->step() < 1) {
    return Done(
        ctx, absl::InvalidArgumentError(absl::StrCat("step: must be >= 1, got ", request->step())));
  }
  if (request->metrics_size() > 64) {
    return Done(ctx, absl::InvalidArgumentError(absl::StrCat("metrics: ", request->metrics_size(),
                                                             " entries, at most 64")));
  }
  // Other ranks' reports only fetch the commands, as does a report sent again that this
  // coordinator already has (StepReport.seq), and one from a rank that last spoke to another
  // coordinator: it sends its recent reports again, in order, on seeing this one's incarnation.
  bool record = request->rank() == 0 &&
                (request->incarnation().empty() || request->incarnation() == incarnation_) &&
                metrics_.Fresh(request->job_id(), *request);
  auto commands = jobs_.OnStepReport(*request, record);
  if (commands.ok()) {
    *response = *commands;
    response->set_incarnation(incarnation_);
    if (record && metrics_.Append(request->job_id(), {*request}) > 0 && prometheus_ != nullptr) {
      prometheus_->ObserveStep(*request);
    }
  }
  return Done(ctx, commands.status());
}

grpc::ServerUnaryReactor* TrainerServiceImpl::ReportCheckpoint(grpc::CallbackServerContext* ctx,
                                                               const v1::CheckpointReport* request,
                                                               v1::TrainerCommands* response) {
  if (absl::Status s = AuthenticateRank(ctx, identities_, "ReportCheckpoint", request->job_id(),
                                        request->attempt());
      !s.ok()) {
    return Done(ctx, s);
  }
  if (absl::Status s = CheckFieldSizes(*request, FieldLimits{4096, 1024, kMaxReportBytes}, "");
      !s.ok()) {
    return Done(ctx, s);
  }
  if (absl::Status s = CheckCheckpointReport(*request); !s.ok()) return Done(ctx, s);
  auto commands = jobs_.OnCheckpointReport(*request);
  if (commands.ok()) *response = *commands;
  return Done(ctx, commands.status());
}

}  // namespace trainyard::coordinator
