// LocalCommunicator: one rank, every collective a no-op or a copy (see communicator.h).
#include "worker/trainer/comm/communicator.h"

namespace trainyard::trainer {
namespace {

class DoneHandle : public CommHandle {
 public:
  void Wait() override {}
};

class LocalCommunicator : public Communicator {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  std::string Describe() const override { return "none (one rank)"; }
  std::unique_ptr<CommHandle> AllReduceSum(std::vector<torch::Tensor>) override {
    return std::make_unique<DoneHandle>();
  }
  void Broadcast(std::vector<torch::Tensor>, int) override {}
  std::vector<torch::Tensor> AllGather(const torch::Tensor& in) override { return {in.clone()}; }
  void AllGatherInto(const torch::Tensor& in, std::vector<torch::Tensor> outs) override {
    outs.at(0).copy_(in);
  }
  void Barrier() override {}
  std::unique_ptr<CommHandle> Send(const torch::Tensor&, int, int) override {
    TORCH_CHECK(false, "Send: one rank has no peer");
  }
  void Recv(torch::Tensor&, int, int) override { TORCH_CHECK(false, "Recv: one rank has no peer"); }
};

}  // namespace

std::unique_ptr<Communicator> MakeLocalCommunicator() {
  return std::make_unique<LocalCommunicator>();
}

}  // namespace trainyard::trainer
