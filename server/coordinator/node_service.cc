#include "server/coordinator/service_auth.h"
#include "server/coordinator/services.h"

#include <algorithm>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>

#include <spdlog/spdlog.h>

#include "absl/base/thread_annotations.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "common/credentials.h"
#include "common/failpoint.h"
#include "common/grpc_status.h"
#include "common/log_text.h"
#include "common/placement.h"
#include "server/coordinator/job_state.h"

namespace trainyard::coordinator {
namespace {

// The longest reason an admin may give a cordon or drain (shown by yard nodes).
constexpr size_t kMaxCordonReasonBytes = 1024;

// The longest log line kept from a rank; longer ones are cut, saying how much was cut.
constexpr size_t kMaxLogLineBytes = 16 * 1024;

// Session: hello first, then heartbeats and rank status up; commands down.
class SessionReactor final
    : public grpc::ServerBidiReactor<v1::NodeMessage, v1::CoordinatorMessage> {
 public:
  // `token_node`: the node the caller's node token is bound to; hello must name it.
  SessionReactor(NodeRegistry& nodes, AttemptTracker& jobs, JobLogs& logs,
                 const IdentityRegistry& identities, std::string token_node, SerialExecutor& events,
                 NodeBacklog& backlog, CoordinatorMetrics* metrics)
      : nodes_(nodes),
        jobs_(jobs),
        logs_(logs),
        identities_(identities),
        events_(events),
        backlog_(backlog),
        metrics_(metrics),
        token_node_(std::move(token_node)),
        sink_(std::make_shared<Sink>(this)) {
    StartRead(&incoming_);
  }

  void OnReadDone(bool ok) override {
    if (!ok) {  // the node closed its side or went away
      End(grpc::Status::OK);
      return;
    }
    if (node_id_.empty()) {
      if (!incoming_.has_hello() || incoming_.hello().node_id().empty()) {
        End(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                         "hello.node_id: the first message of a session must be hello"));
        return;
      }
      if (incoming_.hello().node_id() != token_node_) {
        spdlog::warn("audit: node {} Session refused: hello names node {}", token_node_,
                     Quoted(incoming_.hello().node_id()));
        End(grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                         absl::StrCat("hello.node_id: the node token is for node ", token_node_,
                                      ", not ", incoming_.hello().node_id())));
        return;
      }
      if (absl::Status s = nodes_.AttachSession(incoming_.hello().node_id(), sink_); !s.ok()) {
        End(ToGrpcStatus(s));
        return;
      }
      node_id_ = incoming_.hello().node_id();
      // What waits on the job manager runs on the node-events thread, in arrival order; the
      // callback thread goes back to reading (its heartbeats count as they arrive).
      Defer([&jobs = jobs_, sink = sink_, node = node_id_, running = incoming_.hello().running()] {
        jobs.OnNodeHello(node, running);
        jobs.RequestSchedulingPass();
        // The node's active assignments, but those whose ranks it says it runs: it has them (a
        // reconnect, or a new leader rebuilding its view from the workers' hellos).
        std::set<std::tuple<std::string, int32_t, int32_t>> runs;
        for (const v1::RankStatus& r : running) runs.emplace(r.job_id(), r.attempt(), r.rank());
        for (const v1::Assignment& a : jobs.AssignmentsFor(node)) {
          bool has = false;
          for (int i = 0; i < RanksOf(a) && !has; ++i) {
            has = runs.count({a.job_id(), a.attempt(), a.first_rank() + i}) > 0;
          }
          if (has) continue;
          v1::CoordinatorMessage m;
          *m.mutable_assignment() = a;
          sink->Send(m);
        }
      });
    } else if (incoming_.has_heartbeat()) {
      // A node an admin denied while its session was open: its session ends here.
      if (identities_.IsNodeDenied(node_id_)) {
        spdlog::warn("audit: node {} Session ended: the node is denied", node_id_);
        End(grpc::Status(grpc::StatusCode::PERMISSION_DENIED,
                         absl::StrCat("node ", node_id_, " is denied by an admin")));
        return;
      }
      std::vector<std::string> faults;
      auto back = nodes_.Heartbeat(node_id_, incoming_.heartbeat().devices(), &faults);
      if (!back.ok()) {
        End(ToGrpcStatus(back.status()));
        return;
      }
      for (const std::string& fault : faults) {  // the node's own words: quoted
        spdlog::warn("audit: node {} is cordoned (or stays so): its {}", node_id_, Quoted(fault));
      }
      if (*back) {
        spdlog::info("node {} is back: READY again (its lost attempts stay failed)", node_id_);
      }
      // Acknowledged once what the node sent before it has been handled.
      Defer([&jobs = jobs_, sink = sink_, seq = incoming_.heartbeat().seq(), back = *back] {
        if (back) jobs.RequestSchedulingPass();
        v1::CoordinatorMessage ack;
        ack.mutable_heartbeat_ack()->set_seq(seq);
        sink->Send(ack);
      });
    } else if (incoming_.has_rank_status()) {
      const v1::RankStatus& status = incoming_.rank_status();
      if (status.phase() == v1::RANK_EXITED) {
        // What was dropped of its output since its last kept lines, said before its end (the
        // rank is the node's until then).
        if (const int64_t dropped =
                backlog_.TakeDropped(node_id_, {status.job_id(), status.attempt(), status.rank()});
            dropped > 0) {
          v1::LogLines none;
          none.set_job_id(status.job_id());
          none.set_attempt(status.attempt());
          none.set_rank(status.rank());
          Post([&jobs = jobs_, &logs = logs_, node = node_id_, in = std::move(none),
                dropped] { HandleLogs(jobs, logs, node, in, dropped); },
               0);
        }
      }
      Defer([&jobs = jobs_, node = node_id_, status] { jobs.OnRankStatus(node, status); });
    } else if (incoming_.has_logs()) {
      OnLogs();
    }
    StartRead(&incoming_);
  }

  void OnWriteDone(bool ok) override { sink_->queue.OnWriteDone(ok); }
  // May run concurrently with OnReadDone: touches only the thread-safe queue. OnDone detaches.
  void OnCancel() override {
    sink_->queue.FinishWhenDrained(grpc::Status(grpc::StatusCode::CANCELLED, "session cancelled"));
  }

  void OnDone() override {
    if (!node_id_.empty()) nodes_.DetachSession(node_id_, sink_.get());
    sink_->queue.Close();
    delete this;
  }

 private:
  using Base = grpc::ServerBidiReactor<v1::NodeMessage, v1::CoordinatorMessage>;
  struct Sink final : NodeSessionSink {
    explicit Sink(Base* reactor) : queue(reactor) {}
    // An assignment goes out once per session: a session that opens while a placement is being
    // made durable would otherwise get it both from the placement and from its hello.
    void Send(const v1::CoordinatorMessage& message) override {
      if (message.has_assignment()) {
        const v1::Assignment& a = message.assignment();
        absl::MutexLock lock(&mu);
        if (!sent.emplace(a.job_id(), a.attempt(), a.first_rank()).second) return;
      }
      queue.Push(message);
    }
    void Close(const absl::Status& why) override { queue.FinishWhenDrained(ToGrpcStatus(why)); }
    WriteQueue<Base, v1::CoordinatorMessage> queue;
    absl::Mutex mu;
    std::set<std::tuple<std::string, int32_t, int32_t>> sent ABSL_GUARDED_BY(mu);
  };

  // Runs `task` on the node-events thread after what the node sent before, the message read last
  // counted in the node's backlog until then.
  void Defer(std::function<void()> task) {
    const int64_t charge = NodeBacklog::Charge(incoming_);
    backlog_.Add(node_id_, charge, /*droppable=*/false);
    Post(std::move(task), charge);
  }

  // Runs `task` on the node-events thread, timing its wait; `charge` of the node's backlog is
  // given back once it has run.
  void Post(std::function<void()> task, int64_t charge) {
    events_.Post([metrics = metrics_, arrived = absl::Now(), task = std::move(task),
                  &backlog = backlog_, node = node_id_, charge] {
      Failpoint("node-event");
      if (metrics != nullptr) {
        metrics->ObserveNodeEventDelay(absl::ToDoubleSeconds(absl::Now() - arrived));
      }
      task();
      backlog.Remove(node, charge);
    });
  }

  // A node's log lines: handled after what it sent before or, while its backlog is full, dropped
  // and counted, their rank's next kept lines (or its end) saying how many.
  void OnLogs() {
    const v1::LogLines& in = incoming_.logs();
    const NodeBacklog::RankKey key{in.job_id(), in.attempt(), in.rank()};
    const int64_t charge = NodeBacklog::Charge(incoming_);
    if (!backlog_.Add(node_id_, charge, /*droppable=*/true)) {
      backlog_.Dropped(node_id_, key, in.lines_size());
      if (metrics_ != nullptr) metrics_->ObserveDroppedLogLines(in.lines_size());
      return;
    }
    Post([&jobs = jobs_, &logs = logs_, node = node_id_, in = std::move(*incoming_.mutable_logs()),
          before =
              backlog_.TakeDropped(node_id_, key)] { HandleLogs(jobs, logs, node, in, before); },
         charge);
  }

  // `dropped`: how many lines of the rank were dropped before these (NodeBacklog), said first.
  static void HandleLogs(AttemptTracker& jobs, JobLogs& logs, const std::string& node,
                         const v1::LogLines& in, int64_t dropped = 0) {
    if (!jobs.RankRunsOn(node, in.job_id(), in.attempt(), in.rank())) {
      // An ended rank's lines, sent again on a new session; the coordinator's own note of what
      // was dropped of a rank no longer the node's.
      if (in.again() || in.lines_size() == 0) return;
      // A node speaks only for the ranks it runs.
      spdlog::warn("audit: node {} sent lines of rank {} of {}, which it does not run: dropped",
                   node, in.rank(), Quoted(in.job_id()));
      return;
    }
    std::vector<v1::LogLine> lines;
    lines.reserve(in.lines_size() + 1);
    if (dropped > 0) {  // (unsequenced: always kept)
      v1::LogLine& l = lines.emplace_back();
      l.set_attempt(in.attempt());
      l.set_rank(in.rank());
      l.set_text(absl::StrCat("[trainyard] ", dropped,
                              " lines of this rank's output were dropped here: the coordinator "
                              "was behind on node ",
                              node, "'s messages"));
    }
    // (Seqs are the worker's word for which lines it sends again; a malformed list is ignored.)
    const bool sequenced = in.seqs_size() == in.lines_size();
    for (int i = 0; i < in.lines_size(); ++i) {
      const std::string& text = in.lines(i);
      v1::LogLine l;
      l.set_attempt(in.attempt());
      l.set_rank(in.rank());
      if (sequenced) l.set_seq(std::max<int64_t>(0, in.seqs(i)));
      if (text.size() > kMaxLogLineBytes) {
        // Kept, cut: a rank's line is its owner's data, but no line may be unbounded. Cut between
        // characters: one cut inside a UTF-8 character made the line, and the stored logs holding
        // it, unreadable (the coordinator could not start again).
        const absl::string_view kept = Utf8Prefix(text, kMaxLogLineBytes);
        l.set_text(absl::StrCat(kept, " [truncated ", text.size() - kept.size(), " bytes]"));
      } else {
        l.set_text(text);
      }
      lines.push_back(std::move(l));
    }
    logs.Append(in.job_id(), std::move(lines));
  }

  void End(grpc::Status status) {
    if (!node_id_.empty()) nodes_.DetachSession(node_id_, sink_.get());
    sink_->queue.FinishWhenDrained(std::move(status));
  }

  NodeRegistry& nodes_;
  AttemptTracker& jobs_;
  JobLogs& logs_;
  const IdentityRegistry& identities_;
  SerialExecutor& events_;
  NodeBacklog& backlog_;
  CoordinatorMetrics* const metrics_;
  const std::string token_node_;
  std::shared_ptr<Sink> sink_;
  v1::NodeMessage incoming_;
  std::string node_id_;  // set by hello; only the reactor's own callbacks touch it
};

}  // namespace

// ---- NodeService ----

grpc::ServerUnaryReactor* NodeServiceImpl::RegisterNode(grpc::CallbackServerContext* ctx,
                                                        const v1::RegisterNodeRequest* request,
                                                        v1::RegisterNodeResponse* response) {
  if (absl::Status s = CheckRequest(*request); !s.ok()) return Done(ctx, s);
  auto caller =
      AuthenticateNode(ctx, identities_, "RegisterNode", request->node_id(), node_certificates_);
  if (!caller.ok()) return Done(ctx, caller.status());
  // A node that takes only some users' jobs (a worker not running as root, a user's parameter
  // server) must hold a node token naming them: a token for any user's jobs is for nodes an
  // admin trusts with every job, and a node may not pick whose jobs it attracts.
  if (caller->node_owners.empty() && !caller->token_id.empty() && !request->owners().empty()) {
    return Done(
        ctx,
        Refused(
            "RegisterNode", caller->Describe(),
            absl::PermissionDeniedError(absl::StrCat(
                "owners: the node asks for the jobs of ", absl::StrJoin(request->owners(), ", "),
                " only, but its node token names no owners; give it a token that "
                "does (yard admin token create --node ",
                request->node_id(), " --owners ", absl::StrJoin(request->owners(), ","), ")"))));
  }
  // A node token limited to some owners' jobs: the node may not claim more (or any owner's).
  if (!caller->node_owners.empty()) {
    const auto& allowed = caller->node_owners;
    const bool within =
        !request->owners().empty() &&
        std::all_of(request->owners().begin(), request->owners().end(), [&](const std::string& o) {
          return std::find(allowed.begin(), allowed.end(), o) != allowed.end();
        });
    if (!within) {
      return Done(
          ctx, Refused("RegisterNode", caller->Describe(),
                       absl::PermissionDeniedError(absl::StrCat(
                           "owners: the node token allows only the jobs of ",
                           absl::StrJoin(allowed, ", "), "; the node asked for ",
                           request->owners().empty() ? std::string("any user's")
                                                     : absl::StrJoin(request->owners(), ", ")))));
    }
  }
  auto* reactor = ctx->DefaultReactor();
  nodes_.Register(*request, [this, reactor, response, who = *caller,
                             id = request->node_id()](absl::StatusOr<v1::Node> node) {
    Audit(who, "RegisterNode", id, node.status());
    if (node.ok()) {
      *response->mutable_node() = *std::move(node);
      response->set_heartbeat_interval_ms(absl::ToInt64Milliseconds(heartbeat_interval_));
      response->set_node_timeout_ms(absl::ToInt64Milliseconds(nodes_.node_timeout()));
      jobs_.RequestSchedulingPass();
    }
    reactor->Finish(ToGrpcStatus(node.status()));
  });
  return reactor;
}

grpc::ServerBidiReactor<v1::NodeMessage, v1::CoordinatorMessage>* NodeServiceImpl::Session(
    grpc::CallbackServerContext* ctx) {
  // The node's name is checked against hello's node_id when hello arrives.
  auto caller = AuthenticateNode(ctx, identities_, "Session", "", node_certificates_);
  if (!caller.ok()) {
    class Rejected final : public grpc::ServerBidiReactor<v1::NodeMessage, v1::CoordinatorMessage> {
     public:
      explicit Rejected(grpc::Status s) { Finish(std::move(s)); }
      void OnDone() override { delete this; }
    };
    return new Rejected(ToGrpcStatus(caller.status()));
  }
  return new SessionReactor(nodes_, jobs_, logs_, identities_, caller->node, node_events_, backlog_,
                            metrics_);
}

// ---- NodeBacklog ----

int64_t NodeBacklog::Charge(const v1::NodeMessage& message) {
  return static_cast<int64_t>(message.ByteSizeLong()) +
         (message.has_logs() ? kLineCharge * message.logs().lines_size() : 0);
}

bool NodeBacklog::Add(const std::string& node, int64_t charge, bool droppable) {
  absl::MutexLock lock(&mu_);
  Node& n = nodes_[node];
  if (droppable && (n.bytes + charge > kMaxBytes || total_ + charge > kMaxTotalBytes)) {
    if (n.bytes == 0 && n.dropped.empty() && n.episode == 0) nodes_.erase(node);
    return false;
  }
  n.bytes += charge;
  total_ += charge;
  return true;
}

void NodeBacklog::Remove(const std::string& node, int64_t charge) {
  absl::MutexLock lock(&mu_);
  auto it = nodes_.find(node);
  if (it == nodes_.end()) return;
  Node& n = it->second;
  n.bytes -= charge;
  total_ -= charge;
  // Caught up once half of both caps is free again (not at each message handled at a cap).
  if (n.episode > 0 && n.bytes <= kMaxBytes / 2 && total_ <= kMaxTotalBytes / 2) {
    spdlog::info("node {}: the coordinator caught up on its messages ({} log lines dropped)", node,
                 n.episode);
    n.episode = 0;
  }
  if (n.bytes <= 0 && n.dropped.empty() && n.episode == 0) nodes_.erase(it);
}

int64_t NodeBacklog::Bytes(const std::string& node) const {
  absl::MutexLock lock(&mu_);
  auto it = nodes_.find(node);
  return it == nodes_.end() ? 0 : it->second.bytes;
}

void NodeBacklog::Dropped(const std::string& node, const RankKey& rank, int64_t lines) {
  absl::MutexLock lock(&mu_);
  Node& n = nodes_[node];
  if (n.episode == 0) {
    spdlog::warn(
        "node {}: the coordinator is behind on its messages ({} MiB waiting; {} MiB of all "
        "nodes'): its ranks' log lines are dropped until it catches up (each rank's log says "
        "how many)",
        node, n.bytes >> 20, total_ >> 20);
  }
  n.episode += lines;
  if (auto it = n.dropped.find(rank); it != n.dropped.end()) {
    it->second += lines;
  } else if (n.dropped.size() < kMaxDroppedRanks) {
    n.dropped.emplace(rank, lines);
  }
}

int64_t NodeBacklog::TakeDropped(const std::string& node, const RankKey& rank) {
  absl::MutexLock lock(&mu_);
  auto it = nodes_.find(node);
  if (it == nodes_.end()) return 0;
  auto r = it->second.dropped.find(rank);
  if (r == it->second.dropped.end()) return 0;
  const int64_t lines = r->second;
  it->second.dropped.erase(r);
  return lines;
}

grpc::ServerUnaryReactor* NodeServiceImpl::ListNodes(grpc::CallbackServerContext* ctx,
                                                     const v1::ListNodesRequest* request,
                                                     v1::ListNodesResponse* response) {
  if (auto caller = AuthenticateUser(ctx, identities_, "ListNodes"); !caller.ok()) {
    return Done(ctx, caller.status());
  }
  for (v1::Node& node : jobs_.NodesWithAllocations()) *response->add_nodes() = std::move(node);
  return Done(ctx, absl::OkStatus());
}

grpc::ServerUnaryReactor* NodeServiceImpl::CordonNode(grpc::CallbackServerContext* ctx,
                                                      const v1::CordonNodeRequest* request,
                                                      v1::CordonNodeResponse* response) {
  if (absl::Status s = CheckRequest(*request); !s.ok()) return Done(ctx, s);
  const char* method = request->action() == v1::UNCORDON ? "UncordonNode"
                       : request->action() == v1::DRAIN  ? "DrainNode"
                                                         : "CordonNode";
  auto caller = AuthenticateAdmin(ctx, identities_, method);
  if (!caller.ok()) return Done(ctx, caller.status());
  absl::Status bad;
  if (request->node_id().empty()) bad = absl::InvalidArgumentError("node_id: required");
  if (!v1::CordonAction_IsValid(request->action()) ||
      request->action() == v1::CORDON_ACTION_UNSPECIFIED) {
    bad = absl::InvalidArgumentError("action: one of CORDON, UNCORDON, DRAIN");
  }
  if (request->reason().size() > kMaxCordonReasonBytes) {
    bad = absl::InvalidArgumentError(absl::StrCat("reason: ", request->reason().size(),
                                                  " bytes, at most ", kMaxCordonReasonBytes));
  }
  if (!bad.ok()) {
    Audit(*caller, method, request->node_id(), bad);
    return Done(ctx, bad);
  }
  auto* reactor = ctx->DefaultReactor();
  nodes_.SetCordon(request->node_id(), request->action(), request->reason(), caller->user,
                   [this, reactor, response, who = *caller, method, action = request->action(),
                    id = request->node_id()](absl::StatusOr<v1::Node> node) {
                     Audit(who, method, id, node.status());
                     if (!node.ok()) {
                       reactor->Finish(ToGrpcStatus(node.status()));
                       return;
                     }
                     *response->mutable_node() = *std::move(node);
                     // The job manager's work off the store's thread, in order with the nodes'
                     // events.
                     node_events_.Post([this, reactor, response, action, id, user = who.user] {
                       if (action == v1::DRAIN) {
                         for (std::string& job : jobs_.DrainNode(id, user)) {
                           response->add_moving_jobs(std::move(job));
                         }
                       }
                       // Uncordoned, the node takes ranks again; cordoned, the next pass leaves it
                       // out.
                       jobs_.RequestSchedulingPass();
                       reactor->Finish(grpc::Status::OK);
                     });
                   });
  return reactor;
}

grpc::ServerUnaryReactor* NodeServiceImpl::VerifyJobCredential(
    grpc::CallbackServerContext* ctx, const v1::VerifyJobCredentialRequest* request,
    v1::VerifyJobCredentialResponse* response) {
  if (absl::Status s = CheckRequest(*request); !s.ok()) return Done(ctx, s);
  auto caller = AuthenticateNode(ctx, identities_, "VerifyJobCredential", "", node_certificates_);
  if (!caller.ok()) return Done(ctx, caller.status());
  if (absl::Status s = CheckRequest(*request); !s.ok()) return Done(ctx, s);
  auto refuse = [&](absl::Status status) {
    return Done(ctx, Refused("VerifyJobCredential", caller->Describe(), std::move(status)));
  };
  // A parameter server is shown the attempt's credential for that server alone, never the job
  // credential, which the rendezvous and the reports accept.
  if (ParseJobCredential(request->credential()).ok()) {
    return refuse(absl::PermissionDeniedError(
        "credential: a job credential (tyj.); a rank shows a parameter server only its "
        "parameter-server credential (tys.), which is good at that server alone"));
  }
  auto rank = ParseServerCredential(request->credential());
  if (!rank.ok()) {
    return refuse(
        absl::UnauthenticatedError(absl::StrCat("credential: ", rank.status().message())));
  }
  auto job = lifecycle_.Get(rank->job_id);
  if (!job.ok()) {
    return refuse(absl::UnauthenticatedError(
        "credential: not a parameter-server credential this coordinator made"));
  }
  // Which of the attempt's ranges (by server address) it was made for: made with the attempt's
  // job credential, so the mac of a forged one, or of another attempt's, matches none.
  const std::string job_credential = identities_.JobCredentialFor(rank->job_id, rank->attempt);
  const v1::PsRange* range = nullptr;
  for (const v1::PsRange& r : job->ps_placement()) {
    if (ConstantTimeEquals(DeriveServerCredential(job_credential, r.address()),
                           request->credential())) {
      range = &r;
      break;
    }
  }
  if (job->attempt() != rank->attempt || !IsActive(job->state())) {
    return Done(ctx, absl::FailedPreconditionError(absl::StrCat(
                         rank->job_id, " attempt ", rank->attempt, " is not running (attempt ",
                         job->attempt(), " is ", v1::JobState_Name(job->state()), ")")));
  }
  if (range == nullptr) {
    return refuse(
        absl::UnauthenticatedError(absl::StrCat("credential: not made for a parameter server of ",
                                                rank->job_id, " attempt ", rank->attempt)));
  }
  if (range->node_id() != caller->node) {
    return refuse(absl::PermissionDeniedError(
        absl::StrCat("credential: made for the parameter server at ", range->address(), " (node ",
                     range->node_id(), "), not node ", caller->node)));
  }
  response->set_job_id(rank->job_id);
  response->set_attempt(rank->attempt);
  return Done(ctx, absl::OkStatus());
}

}  // namespace trainyard::coordinator

namespace trainyard::coordinator {
namespace {

// FetchContext: an archive held in memory (one copy for the fetches of it in flight), written in
// chunks of 1 MiB (the first names it).
class ContextReactor final : public grpc::ServerWriteReactor<v1::ContextChunk> {
 public:
  static constexpr size_t kChunkBytes = size_t{1} << 20;

  ContextReactor(std::string digest, std::shared_ptr<const std::string> archive)
      : digest_(std::move(digest)), archive_(std::move(archive)) {
    Next();
  }
  void OnWriteDone(bool ok) override {
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "the node went away"));
      return;
    }
    Next();
  }
  void OnDone() override { delete this; }

 private:
  void Next() {
    const std::string& archive = *archive_;
    if (offset_ >= archive.size()) {
      Finish(grpc::Status::OK);
      return;
    }
    chunk_.Clear();
    if (offset_ == 0) {
      chunk_.set_digest(digest_);
      chunk_.set_size_bytes(static_cast<int64_t>(archive.size()));
    }
    const size_t n = std::min(kChunkBytes, archive.size() - offset_);
    chunk_.set_data(archive.data() + offset_, n);
    offset_ += n;
    StartWrite(&chunk_);
  }

  const std::string digest_;
  const std::shared_ptr<const std::string> archive_;
  size_t offset_ = 0;
  v1::ContextChunk chunk_;
};

}  // namespace

grpc::ServerWriteReactor<v1::ContextChunk>* NodeServiceImpl::FetchContext(
    grpc::CallbackServerContext* ctx, const v1::FetchContextRequest* request) {
  if (absl::Status s = CheckRequest(*request); !s.ok()) {
    return RejectStream<v1::ContextChunk>(ToGrpcStatus(s));
  }
  auto caller =
      AuthenticateNode(ctx, identities_, "FetchContext", request->node_id(), node_certificates_);
  if (!caller.ok()) return RejectStream<v1::ContextChunk>(ToGrpcStatus(caller.status()));
  auto refuse = [&](absl::Status status) {
    return RejectStream<v1::ContextChunk>(ToGrpcStatus(
        Refused("FetchContext", caller->Describe(), std::move(status), request->job_id())));
  };
  // Only a node that runs the job's current attempt: the code is the owner's, as its files are.
  auto job = lifecycle_.Get(request->job_id());
  const bool placed =
      job.ok() && IsActive(job->state()) &&
      std::any_of(job->placement().begin(), job->placement().end(),
                  [&](const v1::RankPlacement& p) { return p.node_id() == request->node_id(); });
  if (!placed) {
    return refuse(absl::PermissionDeniedError(absl::StrCat(
        "job_id: ", request->job_id(), " has no running attempt on ", request->node_id())));
  }
  if (job->spec().context().empty()) {
    return RejectStream<v1::ContextChunk>(
        ToGrpcStatus(absl::NotFoundError(absl::StrCat(request->job_id(), " has no context"))));
  }
  absl::StatusOr<std::shared_ptr<const std::string>> archive =
      contexts_.ReadShared(job->owner(), job->spec().context());
  if (!archive.ok()) return RejectStream<v1::ContextChunk>(ToGrpcStatus(archive.status()));
  return new ContextReactor(job->spec().context(), *std::move(archive));
}

}  // namespace trainyard::coordinator
