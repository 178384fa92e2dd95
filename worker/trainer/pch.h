// Precompiled header of the trainer's LibTorch side (trainyard_trainer): the LibTorch headers that
// every such file includes. No gRPC or protobuf: see worker/CMakeLists.txt. Only CMake's
// target_precompile_headers includes this file.
#ifndef TRAINYARD_WORKER_TRAINER_PCH_H_
#define TRAINYARD_WORKER_TRAINER_PCH_H_

#include <torch/torch.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

#endif  // TRAINYARD_WORKER_TRAINER_PCH_H_
