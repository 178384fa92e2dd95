// The CUDA flavour of cuda_support.h: device queries and the NCCL communicator.
#include "worker/trainer/comm/cuda_support.h"

#ifndef USE_C10D_NCCL
#define USE_C10D_NCCL 1
#endif

#include <ATen/core/CachingHostAllocator.h>
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/cuda/nccl.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

#include <algorithm>
#include <exception>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace trainyard::trainer {
namespace {

class NcclHandle : public CommHandle {
 public:
  explicit NcclHandle(std::vector<c10::intrusive_ptr<c10d::Work>> works)
      : works_(std::move(works)) {}
  // Orders the current stream after the collectives (ProcessGroupNCCL's Work::wait: no host
  // wait unless TORCH_NCCL_BLOCKING_WAIT).
  void Wait() override {
    for (auto& w : works_) w->wait();
    works_.clear();
  }

 private:
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
};

class NcclCommunicator : public Communicator {
 public:
  explicit NcclCommunicator(c10::intrusive_ptr<c10d::ProcessGroupNCCL> pg)
      : pg_(std::move(pg)),
        device_(torch::kCUDA, c10::cuda::current_device()),
        host_stream_(c10::cuda::getStreamFromPool(/*isHighPriority=*/true, device_.index())) {}

  int rank() const override { return pg_->getRank(); }
  int world_size() const override { return pg_->getSize(); }
  std::string Describe() const override {
    const uint64_t v = torch::cuda::nccl::version();  // major << 32 | minor << 16 | patch
    return absl::StrFormat("nccl %d.%d.%d on %s", v >> 32, (v >> 16) & 0xffff, v & 0xffff,
                           device_.str());
  }

  std::unique_ptr<CommHandle> AllReduceSum(std::vector<torch::Tensor> tensors) override {
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    const int n = world_size();
    for (auto& t : tensors) {
      bytes_sent_ += 2 * (n - 1) * t.numel() * t.element_size() / n;  // as a ring sends it
      if (!t.is_cuda()) {
        // Small host tensors (the step's flags and loss): through the device, blocking, the
        // copies on a stream of their own (on the current one they would queue behind the
        // training kernels already launched). The all-reduce itself still runs on the group's
        // NCCL stream, behind the gradients' all-reduces (docs/gpu.md).
        c10::cuda::CUDAStreamGuard side(host_stream_);
        torch::Tensor d = t.to(device_);
        std::vector<at::Tensor> one{d};
        pg_->allreduce(one)->wait();
        t.copy_(d.cpu());
        continue;
      }
      std::vector<at::Tensor> one{t};
      works.push_back(pg_->allreduce(one));
    }
    return std::make_unique<NcclHandle>(std::move(works));
  }

  void Broadcast(std::vector<torch::Tensor> tensors, int root) override {
    c10d::BroadcastOptions options;
    options.rootRank = root;
    for (auto& t : tensors) {
      torch::Tensor d = t.is_cuda() ? t : t.to(device_);
      std::vector<at::Tensor> one{d};
      pg_->broadcast(one, options)->wait();
      if (!t.is_cuda()) t.copy_(d.cpu());
    }
  }

  std::vector<torch::Tensor> AllGather(const torch::Tensor& in) override {
    const torch::Tensor d = in.to(device_).contiguous();
    std::vector<std::vector<at::Tensor>> out(1);
    for (int r = 0; r < world_size(); ++r) out[0].push_back(torch::empty_like(d));
    std::vector<at::Tensor> input{d};
    pg_->allgather(out, input)->wait();
    bytes_sent_ += in.numel() * in.element_size() * (world_size() - 1);
    if (!in.is_cuda()) {
      for (auto& t : out[0]) t = t.cpu();
    }
    return out[0];
  }

  void AllGatherInto(const torch::Tensor& in, std::vector<torch::Tensor> outs) override {
    TORCH_CHECK(static_cast<int>(outs.size()) == world_size(), "AllGatherInto: one out per rank");
    // FSDP's case: the outs are consecutive chunks of one GPU buffer, which NCCL fills in place.
    const int64_t n = in.numel();
    bool consecutive = in.is_cuda() && n > 0;
    for (size_t r = 0; consecutive && r < outs.size(); ++r) {
      consecutive =
          outs[r].is_cuda() && outs[r].is_contiguous() && outs[r].numel() == n &&
          outs[r].scalar_type() == in.scalar_type() &&
          outs[r].storage().is_alias_of(outs[0].storage()) &&
          outs[r].storage_offset() == outs[0].storage_offset() + static_cast<int64_t>(r) * n;
    }
    if (consecutive) {
      at::Tensor whole = outs[0].as_strided({n * world_size()}, {1}, outs[0].storage_offset());
      at::Tensor input = in.contiguous();
      pg_->_allgather_base(whole, input)->wait();
      bytes_sent_ += n * in.element_size() * (world_size() - 1);
      return;
    }
    std::vector<torch::Tensor> results = AllGather(in);
    for (size_t r = 0; r < outs.size(); ++r) outs[r].copy_(results[r]);
  }

  // Equal chunks of a GPU buffer (FSDP's): NCCL's reduce-scatter; otherwise the ring over
  // send/recv.
  torch::Tensor ReduceScatterSum(torch::Tensor& flat, const std::vector<int64_t>& counts) override {
    const int n = world_size();
    TORCH_CHECK(static_cast<int>(counts.size()) == n, "ReduceScatterSum: one count per rank");
    const bool equal =
        std::all_of(counts.begin(), counts.end(), [&](int64_t c) { return c == counts[0]; });
    if (!flat.is_cuda() || !equal) return Communicator::ReduceScatterSum(flat, counts);
    TORCH_CHECK(flat.dim() == 1 && flat.numel() == counts[0] * n && flat.is_contiguous(),
                "ReduceScatterSum: flat must be 1-D, contiguous, of sum(counts) elements");
    at::Tensor out = torch::empty({counts[0]}, flat.options());
    if (counts[0] == 0) return out;
    pg_->_reduce_scatter_base(out, flat)->wait();
    bytes_sent_ += (n - 1) * counts[0] * flat.element_size();
    return out;
  }

  void Barrier() override { pg_->barrier()->wait(); }

  std::unique_ptr<CommHandle> Send(const torch::Tensor& t, int to, int tag) override {
    TORCH_CHECK(t.is_cuda(), "NCCL Send: the tensor must be on the GPU");
    std::vector<at::Tensor> out{t};
    bytes_sent_ += t.numel() * t.element_size();
    std::vector<c10::intrusive_ptr<c10d::Work>> works{pg_->send(out, to, tag)};
    return std::make_unique<NcclHandle>(std::move(works));
  }

  void Recv(torch::Tensor& t, int from, int tag) override {
    TORCH_CHECK(t.is_cuda(), "NCCL Recv: the tensor must be on the GPU");
    std::vector<at::Tensor> in{t};
    pg_->recv(in, from, tag)->wait();
  }

 private:
  c10::intrusive_ptr<c10d::ProcessGroupNCCL> pg_;
  torch::Device device_;
  c10::cuda::CUDAStream host_stream_;  // the host tensors' copies and collectives
};

}  // namespace

bool CudaBuild() { return true; }

std::string CudaDeviceSummary(int index) {
  const cudaDeviceProp* p = at::cuda::getDeviceProperties(index);
  return absl::StrFormat("%s, %.1f GiB, compute %d.%d", p->name,
                         static_cast<double>(p->totalGlobalMem) / (1 << 30), p->major, p->minor);
}

std::string CudaDeviceName(int index) { return at::cuda::getDeviceProperties(index)->name; }

void CudaSynchronize() { torch::cuda::synchronize(); }

int64_t CudaPeakAllocatedBytes() {
  if (!torch::cuda::is_available()) return 0;
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(c10::cuda::current_device());
  return stats.allocated_bytes[0].peak;  // StatType::AGGREGATE
}

void CudaResetPeak() {
  if (torch::cuda::is_available()) {
    c10::cuda::CUDACachingAllocator::resetPeakStats(c10::cuda::current_device());
  }
}

bool CudaGraphsBuilt() { return true; }

void UseStreamOfItsOwn(int index) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(index));
  c10::cuda::device_synchronize();  // what the default stream queued is done
  c10::cuda::setCurrentCUDAStream(
      c10::cuda::getStreamFromPool(/*isHighPriority=*/false, static_cast<c10::DeviceIndex>(index)));
}

absl::StatusOr<std::function<void()>> CaptureCudaGraph(const std::function<void()>& body) {
  auto one_line = [](std::string what) {
    std::replace(what.begin(), what.end(), '\n', ' ');
    return absl::InternalError(what.substr(0, 400));
  };
  c10::cuda::device_synchronize();
  c10::cuda::CUDACachingAllocator::emptyCache();
  // Destroyed (the last replay's copy gone) after the device is done with it; a CUDA error there
  // is a warning, not a throw from a deleter.
  std::shared_ptr<at::cuda::CUDAGraph> graph(new at::cuda::CUDAGraph(), [](at::cuda::CUDAGraph* g) {
    C10_CUDA_CHECK_WARN(cudaDeviceSynchronize());
    delete g;
  });
  const c10::DeviceIndex device = c10::cuda::current_device();
  const auto pool = at::cuda::graph_pool_handle();
  try {
    graph->capture_begin(pool);
    try {
      body();
    } catch (...) {
      // The body's error is the one to report; ending the capture releases the stream.
      try {
        graph->capture_end();
      } catch (...) {
      }
      throw;
    }
    graph->capture_end();
  } catch (const std::exception& e) {
    // A capture the CUDA runtime invalidated (a wait for the device, a copy from pageable memory)
    // throws in capture_end before the allocator hears of its end, and the graph's destructor
    // releases a pool only after a capture that ended: end it and release the pool here, or the
    // partial step's memory stays held and the allocator keeps behaving as if mid-capture.
    bool ended = true;
    try {
      (void)graph->pool();
    } catch (...) {
      ended = false;
    }
    if (!ended) {
      try {
        c10::cuda::CUDACachingAllocator::endAllocateToPool(device, pool);
      } catch (...) {
      }
      try {
        c10::cuda::CUDACachingAllocator::releasePool(device, pool);
      } catch (...) {
      }
      // The pinned host allocator records into the graph's pool too (where this LibTorch's
      // capture_begin registers it; elsewhere these throw, and are ignored).
      try {
        at::getHostAllocator(at::kCUDA)->end_allocate_to_pool(pool);
      } catch (...) {
      }
      try {
        at::getHostAllocator(at::kCUDA)->release_pool(pool);
      } catch (...) {
      }
    }
    const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
    return one_line(c10_error != nullptr ? c10_error->what_without_backtrace() : e.what());
  }
  return std::function<void()>([graph] { graph->replay(); });
}

absl::StatusOr<std::unique_ptr<Communicator>> MakeNcclCommunicator(
    c10::intrusive_ptr<c10d::Store> store, int rank, int world_size,
    std::chrono::milliseconds timeout) {
  try {
    auto options = c10d::ProcessGroupNCCL::Options::create();
    options->timeout = timeout;
    auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(
        c10::make_intrusive<c10d::PrefixStore>("nccl", store), rank, world_size, options);
    auto comm = std::make_unique<NcclCommunicator>(std::move(pg));
    // The communicator is made at the first collective: make it now, so that a rank that cannot
    // join fails here, naming NCCL, and not in the middle of the first backward.
    comm->Barrier();
    return comm;
  } catch (const c10::Error& e) {
    return absl::UnavailableError(
        absl::StrCat("NCCL: cannot join the process group: ", e.what_without_backtrace()));
  }
}

}  // namespace trainyard::trainer
