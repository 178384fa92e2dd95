// GlooCommunicator: c10d's Gloo process group, with the shared-memory all-reduce for ranks on
// one host and host staging of device tensors (see communicator.h).
#include "worker/trainer/comm/communicator.h"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <condition_variable>
#include <deque>
#include <future>
#include <iostream>
#include <mutex>
#include <optional>
#include <thread>

#include "absl/strings/str_cat.h"
#include "worker/trainer/comm/shm_allreduce.h"

namespace trainyard::trainer {
namespace {

// Runs shared-memory all-reduces one after the other on a thread of its own, so that they
// overlap the caller's work as Gloo's do.
class ShmWorker {
 public:
  explicit ShmWorker(std::unique_ptr<ShmAllReduce> shm)
      : shm_(std::move(shm)), thread_([this] { Loop(); }) {}
  // Work nobody waited for is abandoned: a barrier in progress gives up, queued work fails.
  ~ShmWorker() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    shm_->Abort();
    cv_.notify_one();
    thread_.join();
  }

  // Sums each tensor (fp32, contiguous, CPU) in place over the host's ranks.
  std::future<absl::Status> Submit(std::vector<torch::Tensor> tensors) {
    Job job{std::move(tensors), {}};
    std::future<absl::Status> done = job.done.get_future();
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs_.push_back(std::move(job));
    }
    cv_.notify_one();
    return done;
  }

 private:
  struct Job {
    std::vector<torch::Tensor> tensors;
    std::promise<absl::Status> done;
  };

  void Loop() {
    while (true) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
        if (stopping_) {
          for (Job& j : jobs_) j.done.set_value(absl::CancelledError("communicator destroyed"));
          return;
        }
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      absl::Status status;
      for (torch::Tensor& t : job.tensors) {
        if (status.ok()) status = shm_->SumInPlace(t.data_ptr<float>(), t.numel());
      }
      job.done.set_value(status);
    }
  }

  std::unique_ptr<ShmAllReduce> shm_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  bool stopping_ = false;
  std::thread thread_;  // last: starts once the rest is built
};

// A device (GPU) tensor's host copy, for Gloo, which this trainer runs over host memory only: made
// before the collective (a synchronous copy, ordered after the kernels that wrote the tensor),
// copied back after it.
struct Staged {
  torch::Tensor device, host;
};

// (Without autograd: the tensors may be parameters, as in the broadcast of initial weights.)
torch::Tensor OnHost(const torch::Tensor& t, std::vector<Staged>* staged) {
  if (t.device().is_cpu()) return t;
  torch::NoGradGuard no_grad;
  torch::Tensor host = t.detach().to(torch::kCPU).contiguous();
  if (staged != nullptr) staged->push_back({t, host});
  return host;
}

void CopyBack(std::vector<Staged>& staged) {
  torch::NoGradGuard no_grad;
  for (Staged& s : staged) s.device.detach().copy_(s.host);
  staged.clear();
}

class GlooHandle : public CommHandle {
 public:
  GlooHandle(std::vector<c10::intrusive_ptr<c10d::Work>> works,
             std::optional<std::future<absl::Status>> shm = std::nullopt,
             std::vector<Staged> staged = {})
      : works_(std::move(works)), shm_(std::move(shm)), staged_(std::move(staged)) {}
  void Wait() override {
    for (auto& w : works_) w->wait();
    works_.clear();
    if (shm_.has_value()) {
      const absl::Status s = shm_->get();
      shm_.reset();
      TORCH_CHECK(s.ok(), std::string(s.message()));
    }
    CopyBack(staged_);
  }

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  std::optional<std::future<absl::Status>> shm_;
  std::vector<Staged> staged_;  // device tensors, updated from their host copies at the end
};

class GlooCommunicator : public Communicator {
 public:
  GlooCommunicator(c10::intrusive_ptr<c10d::ProcessGroupGloo> pg, std::unique_ptr<ShmAllReduce> shm,
                   std::string hostname)
      : pg_(std::move(pg)),
        shm_(shm ? std::make_unique<ShmWorker>(std::move(shm)) : nullptr),
        hostname_(std::move(hostname)) {}

  int rank() const override { return pg_->getRank(); }
  int world_size() const override { return pg_->getSize(); }
  std::string Describe() const override {
    // (GPU tensors travel through host copies: OnHost.)
    return shm_ ? absl::StrCat("gloo on ", hostname_, "; fp32 all-reduce through shared memory (",
                               world_size(), " ranks on this host)")
                : absl::StrCat("gloo on ", hostname_);
  }

  std::unique_ptr<CommHandle> AllReduceSum(std::vector<torch::Tensor> tensors) override {
    // A Gloo allreduce of several tensors means one tensor per device; issue one per tensor.
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    std::vector<torch::Tensor> shared;
    std::vector<Staged> staged;
    const int n = world_size();
    for (auto& given : tensors) {
      torch::Tensor t = OnHost(given, &staged);
      bytes_sent_ += 2 * (n - 1) * t.numel() * t.element_size() / n;  // as a ring sends it
      if (shm_ && t.scalar_type() == torch::kFloat && t.is_contiguous()) {
        shared.push_back(t);
        continue;
      }
      std::vector<at::Tensor> one{t};
      works.push_back(pg_->allreduce(one));
    }
    std::optional<std::future<absl::Status>> done;
    if (!shared.empty()) done = shm_->Submit(std::move(shared));
    return std::make_unique<GlooHandle>(std::move(works), std::move(done), std::move(staged));
  }

  void Broadcast(std::vector<torch::Tensor> tensors, int root) override {
    c10d::BroadcastOptions options;
    options.rootRank = root;
    for (auto& given : tensors) {
      std::vector<Staged> staged;
      std::vector<at::Tensor> one{OnHost(given, &staged)};
      pg_->broadcast(one, options)->wait();
      CopyBack(staged);
    }
  }

  std::vector<torch::Tensor> AllGather(const torch::Tensor& in) override {
    const torch::Tensor host = OnHost(in, nullptr).contiguous();
    std::vector<std::vector<at::Tensor>> out(1);
    for (int r = 0; r < world_size(); ++r) out[0].push_back(torch::empty_like(host));
    std::vector<at::Tensor> input{host};
    pg_->allgather(out, input)->wait();
    bytes_sent_ += in.numel() * in.element_size() * (world_size() - 1);
    if (!in.device().is_cpu()) {
      for (auto& t : out[0]) t = t.to(in.device());
    }
    return out[0];
  }
  void AllGatherInto(const torch::Tensor& in, std::vector<torch::Tensor> outs) override {
    TORCH_CHECK(static_cast<int>(outs.size()) == world_size(), "AllGatherInto: one out per rank");
    std::vector<Staged> staged;
    std::vector<std::vector<at::Tensor>> out(1);
    for (const torch::Tensor& o : outs) out[0].push_back(OnHost(o, &staged));
    std::vector<at::Tensor> input{OnHost(in, nullptr).contiguous()};
    pg_->allgather(out, input)->wait();
    bytes_sent_ += in.numel() * in.element_size() * (world_size() - 1);
    CopyBack(staged);
  }
  void Barrier() override { pg_->barrier()->wait(); }

  std::unique_ptr<CommHandle> Send(const torch::Tensor& t, int to, int tag) override {
    // (A device tensor's host copy lives in the send's work until it completes.)
    std::vector<at::Tensor> out{OnHost(t, nullptr)};
    bytes_sent_ += t.numel() * t.element_size();
    std::vector<c10::intrusive_ptr<c10d::Work>> works{pg_->send(out, to, tag)};
    return std::make_unique<GlooHandle>(std::move(works));
  }
  void Recv(torch::Tensor& t, int from, int tag) override {
    std::vector<Staged> staged;
    std::vector<at::Tensor> in{OnHost(t, &staged)};
    pg_->recv(in, from, tag)->wait();
    CopyBack(staged);
  }

 private:
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg_;
  std::unique_ptr<ShmWorker> shm_;
  std::string hostname_;  // where its transport listens
};

}  // namespace

absl::StatusOr<std::unique_ptr<Communicator>> MakeGlooCommunicator(
    c10::intrusive_ptr<c10d::Store> store, int rank, int world_size, const std::string& hostname,
    std::chrono::milliseconds timeout, bool same_host) {
  try {
    store->setTimeout(timeout);
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(hostname));
    options->threads = 2;
    auto pg = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, world_size, options);
    std::unique_ptr<ShmAllReduce> shm;
    if (same_host) {
      ShmAllReduce::Rendezvous rendezvous;
      rendezvous.set = [&store](const std::string& key, const std::string& value) {
        store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
      };
      rendezvous.get = [&store](const std::string& key) {
        const std::vector<uint8_t> value = store->get(key);
        return std::string(value.begin(), value.end());
      };
      auto made = ShmAllReduce::Create(rendezvous, rank, world_size,
                                       absl::FromChrono(std::chrono::milliseconds(timeout)));
      if (made.ok()) {
        shm = *std::move(made);
      } else {
        std::cout << made.status().message() << "; all-reduce through Gloo" << std::endl;
      }
    }
    return std::make_unique<GlooCommunicator>(std::move(pg), std::move(shm), hostname);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("cannot build the Gloo group (rank ", rank, " of ",
                                               world_size, ", ", hostname, "): ", e.what()));
  }
}

}  // namespace trainyard::trainer
