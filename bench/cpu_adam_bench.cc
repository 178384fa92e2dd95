// Benchmark of the parameter server's CPU AdamW (kernels/adam/cpu_adam.h) on arrays far beyond the
// caches (64 Mi params by default: 1 GiB of fp32 params, grads, m and v). In one run it measures
// (a) AdamWStepParallel params/s for every Highway target this CPU supports, on 1 thread and on
//     all of them (plus the best target with the bf16 copy of the params, and with bf16 grads);
// (b) PyTorch's torch.optim.AdamW, foreach=True and foreach=False, on the same number of params
//     and threads (torch.set_num_threads), through /usr/bin/python3 (Debian's python3-torch): as
//     one flat tensor (what a parameter-server shard is) and as 64 tensors of 1/64 each (what a
//     model's parameter list looks like; each tensor's temporaries then fit in the caches);
// (c) the memory-bandwidth floor: memcpy bandwidth of a 1 GiB buffer (bytes read + written per
//     second, split over the same threads) divided by the 28 bytes an AdamW step moves per param
//     (reads p, g, m, v; writes p, m, v); and, as a second anchor, the same traffic with trivial
//     arithmetic (p += g, m += g, v += g * g over the same arrays, threads and chunks). Where
//     in-place streams run faster than memcpy, that loop, not memcpy, bounds the kernel.
// Our measurements run in rounds, each round every case once in a new random order (fixed seed),
// so that no case always follows the same one; PyTorch runs afterwards in its own process, its
// configurations interleaved rep by rep. The table shows medians.
//
// Run through bench/cpu_adam_bench.sh, or: cpu_adam_bench [--params N] [--reps N]
// [--threads N] [--python PATH] (--python "" skips PyTorch).
#include <stdlib.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "kernels/adam/cpu_adam.h"
#include "kernels/adam/thread_pool.h"

namespace trainyard::adam {
namespace {

constexpr double kAdamBytesPerParam = 28;  // reads p, g, m, v; writes p, m, v (fp32)
constexpr double kGoalOfFloor = 0.9;
constexpr int64_t kCopyBytes = int64_t{1} << 30;
constexpr int kTorchTensorCounts[] = {1, 64};

struct Flags {
  int64_t params = int64_t{64} << 20;
  int reps = 7;
  int threads = 0;  // 0: every hardware thread
  std::string python = "/usr/bin/python3";
};

Flags ParseFlags(int argc, char** argv) {
  Flags flags;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool has_value = i + 1 < argc;
    bool ok = has_value;
    if (arg == "--params" && has_value) {
      ok = absl::SimpleAtoi(argv[++i], &flags.params) && flags.params >= 64;
    } else if (arg == "--reps" && has_value) {
      ok = absl::SimpleAtoi(argv[++i], &flags.reps) && flags.reps > 0;
    } else if (arg == "--threads" && has_value) {
      ok = absl::SimpleAtoi(argv[++i], &flags.threads);
    } else if (arg == "--python" && has_value) {
      flags.python = argv[++i];
    } else {
      ok = false;
    }
    if (!ok) {
      std::fprintf(stderr,
                   "usage: %s [--params N>=64] [--reps N] [--threads N] [--python PATH|\"\"]\n",
                   argv[0]);
      std::exit(2);
    }
  }
  if (flags.threads <= 0) flags.threads = std::max(1u, std::thread::hardware_concurrency());
  return flags;
}

double Seconds(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double Median(std::vector<double> x) {
  if (x.empty()) return 0;
  std::sort(x.begin(), x.end());
  const size_t mid = x.size() / 2;
  return x.size() % 2 ? x[mid] : 0.5 * (x[mid - 1] + x[mid]);
}

std::string Format(const char* format, double x) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), format, x);
  return buf;
}

std::string Ratio(double a, double b) { return b > 0 ? Format("%.2fx", a / b) : "-"; }

// 64-byte aligned, uninitialized.
struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
template <typename T>
std::unique_ptr<T[], FreeDeleter> Allocate(int64_t n) {
  const size_t bytes = (static_cast<size_t>(n) * sizeof(T) + 63) / 64 * 64;
  return std::unique_ptr<T[], FreeDeleter>(static_cast<T*>(std::aligned_alloc(64, bytes)));
}

// Bytes read + written per second by memcpy of `bytes`, split into `threads` contiguous parts
// (each large enough for glibc's non-temporal stores), one std::thread per part.
double CopyBandwidth(const char* src, char* dst, int64_t bytes, int threads) {
  std::atomic<bool> go{false};
  std::vector<std::thread> workers;
  const int64_t part = (bytes / threads + 63) / 64 * 64;
  for (int t = 0; t < threads; ++t) {
    const int64_t begin = std::min(bytes, t * part), end = std::min(bytes, begin + part);
    workers.emplace_back([&, begin, end] {
      while (!go.load(std::memory_order_acquire)) {
      }
      std::memcpy(dst + begin, src + begin, static_cast<size_t>(end - begin));
    });
  }
  const auto start = std::chrono::steady_clock::now();
  go.store(true, std::memory_order_release);
  for (std::thread& w : workers) w.join();
  return 2.0 * static_cast<double>(bytes) / Seconds(start);
}

// The memory traffic of an AdamW step with trivial arithmetic: reads p, g, m, v; writes p, m, v.
// v stays non-negative, so the AdamW steps that follow see ordinary numbers (no NaN).
__attribute__((target_clones("avx512f", "avx2", "default"))) void SameTrafficNoMath(
    float* __restrict p, float* __restrict m, float* __restrict v, const float* __restrict g,
    int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    p[i] += g[i];
    m[i] += g[i];
    v[i] += g[i] * g[i];
  }
}

// PyTorch's side. argv: n, reps, thread counts, tensor counts (comma-separated). Prints
// "torch <tensors> <threads> <foreach 0|1> <seconds of one step>" per timed step.
constexpr char kTorchScript[] = R"PY(
import sys, time
import torch
n, reps = int(sys.argv[1]), int(sys.argv[2])
thread_counts = [int(t) for t in sys.argv[3].split(",")]
tensor_counts = [int(t) for t in sys.argv[4].split(",")]
torch.manual_seed(0)
configs = []
for tensors in tensor_counts:
    sizes = [n // tensors] * (tensors - 1) + [n - (n // tensors) * (tensors - 1)]
    for foreach in (True, False):
        params = [torch.nn.Parameter(torch.randn(s)) for s in sizes]
        for p in params:
            p.grad = torch.randn(p.numel())
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, foreach=foreach)
        configs.append((tensors, foreach, opt))
for threads in thread_counts:  # warm-up: allocates the state
    torch.set_num_threads(threads)
    for _, _, opt in configs:
        opt.step()
for rep in range(reps):
    for threads in thread_counts:
        torch.set_num_threads(threads)
        for tensors, foreach, opt in configs:
            start = time.perf_counter()
            opt.step()
            print("torch", tensors, threads, int(foreach), time.perf_counter() - start, flush=True)
)PY";

using TorchKey = std::tuple<int, int, int>;  // tensors, threads, foreach

// Seconds per step by TorchKey; empty when PyTorch could not run.
std::map<TorchKey, std::vector<double>> RunTorch(const Flags& flags,
                                                 const std::vector<int>& threads) {
  std::map<TorchKey, std::vector<double>> seconds;
  if (flags.python.empty()) return seconds;
  char path[] = "/tmp/cpu_adam_bench_XXXXXX.py";
  const int fd = mkstemps(path, 3);
  if (fd < 0) return seconds;
  const bool written = write(fd, kTorchScript, sizeof(kTorchScript) - 1) ==
                       static_cast<ssize_t>(sizeof(kTorchScript) - 1);
  close(fd);
  std::string thread_list, tensor_list;
  for (int t : threads) absl::StrAppend(&thread_list, thread_list.empty() ? "" : ",", t);
  for (int t : kTorchTensorCounts) {
    absl::StrAppend(&tensor_list, tensor_list.empty() ? "" : ",", t);
  }
  const std::string command = absl::StrCat(flags.python, " ", path, " ", flags.params, " ",
                                           flags.reps, " ", thread_list, " ", tensor_list);
  FILE* pipe = written ? popen(command.c_str(), "r") : nullptr;
  if (pipe != nullptr) {
    char line[256];
    while (std::fgets(line, sizeof(line), pipe) != nullptr) {
      std::vector<std::string> f = absl::StrSplit(line, ' ', absl::SkipWhitespace());
      int tensors = 0, t = 0, foreach = 0;
      double s = 0;
      if (f.size() == 5 && f[0] == "torch" && absl::SimpleAtoi(f[1], &tensors) &&
          absl::SimpleAtoi(f[2], &t) && absl::SimpleAtoi(f[3], &foreach) &&
          absl::SimpleAtod(f[4], &s)) {
        seconds[{tensors, t, foreach}].push_back(s);
      }
    }
    if (pclose(pipe) != 0) std::fprintf(stderr, "PyTorch run failed: %s\n", command.c_str());
  }
  unlink(path);
  return seconds;
}

struct Case {
  std::string target;
  int threads;
  bool bf16_copy;
  bool bf16_grads;
  double bytes_per_param;
  std::string Name() const {
    std::string name = "trainyard " + target;
    if (bf16_grads) name += ", bf16 grads";
    if (bf16_copy) name += ", + bf16 copy";
    return name;
  }
};

int Main(int argc, char** argv) {
  const Flags flags = ParseFlags(argc, argv);
  const int64_t n = flags.params;
  std::vector<int> thread_counts = {1};
  if (flags.threads > 1) thread_counts.push_back(flags.threads);
  const std::vector<std::string> targets = SupportedTargets();

  std::printf("CPU AdamW: %lld params (fp32 p, g, m, v = %.2f GiB), median of %d reps; ",
              static_cast<long long>(n), 16.0 * n / (1 << 30), flags.reps);
  std::printf("dispatch picks %s; targets:", ActiveTarget().c_str());
  for (const std::string& t : targets) std::printf(" %s", t.c_str());
  std::printf("\n");
  std::fflush(stdout);

  auto param = Allocate<float>(n), m = Allocate<float>(n), v = Allocate<float>(n),
       grad = Allocate<float>(n);
  auto grad_bf16 = Allocate<uint16_t>(n), param_bf16 = Allocate<uint16_t>(n);
  uint32_t state = 12345;
  for (int64_t i = 0; i < n; ++i) {
    state = state * 1664525u + 1013904223u;
    const float r = static_cast<float>(state >> 8) / static_cast<float>(1 << 24) - 0.5f;  // +-0.5
    param[i] = r;
    grad[i] = 0.01f * r + 1e-3f;
    m[i] = 0;
    v[i] = 0;
    param_bf16[i] = 0;
  }
  FloatToBf16(grad.get(), grad_bf16.get(), n);
  auto copy_src = Allocate<char>(kCopyBytes), copy_dst = Allocate<char>(kCopyBytes);
  std::memset(copy_src.get(), 1, kCopyBytes);
  std::memset(copy_dst.get(), 2, kCopyBytes);
  std::map<int, std::unique_ptr<ThreadPool>> pools;
  for (int t : thread_counts) pools[t] = std::make_unique<ThreadPool>(t);

  // Every measurement of a round, as (what it adds to, how to take it).
  std::vector<Case> cases;
  for (int t : thread_counts) {
    for (const std::string& target : targets) cases.push_back({target, t, false, false, 28});
    cases.push_back({targets.front(), t, true, false, 30});
    cases.push_back({targets.front(), t, true, true, 26});
  }
  std::vector<std::vector<double>> case_seconds(cases.size());
  std::map<int, std::vector<double>> copy_bandwidth, traffic_seconds;
  std::vector<std::function<void()>> round;
  int64_t step = 1;
  for (size_t i = 0; i < cases.size(); ++i) {
    round.push_back([&, i] {
      const Case& c = cases[i];
      if (!ForceTarget(c.target).ok()) std::abort();
      AdamWConfig config;
      config.lr = 1e-3f;
      config.step = step++;
      ThreadPool& pool = *pools[c.threads];
      uint16_t* copy = c.bf16_copy ? param_bf16.get() : nullptr;
      const auto start = std::chrono::steady_clock::now();
      if (c.bf16_grads) {
        AdamWStepBf16GradParallel(pool, config, param.get(), m.get(), v.get(), grad_bf16.get(),
                                  copy, n);
      } else {
        AdamWStepParallel(pool, config, param.get(), m.get(), v.get(), grad.get(), copy, n);
      }
      case_seconds[i].push_back(Seconds(start));
    });
  }
  for (int t : thread_counts) {
    round.push_back([&, t] {
      copy_bandwidth[t].push_back(CopyBandwidth(copy_src.get(), copy_dst.get(), kCopyBytes, t));
    });
    round.push_back([&, t] {
      const auto start = std::chrono::steady_clock::now();
      pools[t]->ParallelFor(n, kParallelChunk, [&](int64_t begin, int64_t end) {
        SameTrafficNoMath(param.get() + begin, m.get() + begin, v.get() + begin, grad.get() + begin,
                          end - begin);
      });
      traffic_seconds[t].push_back(Seconds(start));
    });
  }
  for (auto& measure : round) measure();  // warm-up: page faults, frequency
  for (auto& c : case_seconds) c.clear();
  copy_bandwidth.clear();
  traffic_seconds.clear();
  std::mt19937 rng(1);
  std::vector<size_t> order(round.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  for (int rep = 0; rep < flags.reps; ++rep) {
    std::shuffle(order.begin(), order.end(), rng);
    for (size_t i : order) round[i]();
  }
  if (!ForceTarget("").ok()) std::abort();
  copy_src.reset();
  copy_dst.reset();

  std::printf("PyTorch %s...\n", flags.python.empty() ? "skipped " : "running ");
  std::fflush(stdout);
  const auto torch_seconds = RunTorch(flags, thread_counts);
  auto torch_rate = [&](int tensors, int t, int foreach) {
    auto it = torch_seconds.find({tensors, t, foreach});
    return it == torch_seconds.end() ? 0.0 : n / Median(it->second);
  };

  std::printf(
      "\n| case | threads | M params/s | GB/s moved | vs memcpy floor | "
      "vs same traffic, trivial math | vs best PyTorch |\n|---|---|---|---|---|---|---|\n");
  std::string verdict;
  for (int t : thread_counts) {
    const double copy_floor = Median(copy_bandwidth[t]) / kAdamBytesPerParam;
    const double traffic_floor = n / Median(traffic_seconds[t]);
    double best_torch = 0;
    for (int tensors : kTorchTensorCounts) {
      for (int foreach : {0, 1}) best_torch = std::max(best_torch, torch_rate(tensors, t, foreach));
    }
    auto row = [&](const std::string& name, double rate, double bytes_per_param,
                   const std::string& versus_torch) {
      std::printf("| %s | %d | %.0f | %.1f | %s | %s | %s |\n", name.c_str(), t, rate / 1e6,
                  rate * bytes_per_param / 1e9, Ratio(rate, copy_floor).c_str(),
                  Ratio(rate, traffic_floor).c_str(), versus_torch.c_str());
    };
    for (size_t i = 0; i < cases.size(); ++i) {
      if (cases[i].threads != t) continue;
      const double rate = n / Median(case_seconds[i]);
      row(cases[i].Name(), rate, cases[i].bytes_per_param, Ratio(rate, best_torch));
      if (cases[i].target == targets.front() && !cases[i].bf16_copy) {
        absl::StrAppend(&verdict, cases[i].target, ", ", t,
                        " thread(s): ", Format("%.0f", 100 * rate / copy_floor),
                        "% of the memcpy floor (goal >= ", Format("%.0f", 100 * kGoalOfFloor),
                        "%: ", rate >= kGoalOfFloor * copy_floor ? "met" : "NOT met", "), ",
                        Format("%.0f", 100 * rate / traffic_floor),
                        "% of the same traffic with trivial math, ", Ratio(rate, best_torch),
                        " the best PyTorch\n");
      }
    }
    for (int tensors : kTorchTensorCounts) {
      for (int foreach : {1, 0}) {
        const double rate = torch_rate(tensors, t, foreach);
        if (rate == 0) continue;
        row(absl::StrCat("PyTorch AdamW foreach=", foreach ? "True" : "False", ", ",
                         tensors == 1 ? "1 tensor" : absl::StrCat(tensors, " tensors")),
            rate, kAdamBytesPerParam, "");
      }
    }
    row(absl::StrCat("floor: memcpy ", Format("%.1f", Median(copy_bandwidth[t]) / 1e9),
                     " GB/s / 28 B"),
        copy_floor, kAdamBytesPerParam, "");
    row("same traffic, trivial math (p += g, m += g, v += g*g)", traffic_floor, kAdamBytesPerParam,
        "");
  }
  std::printf(
      "\nGB/s moved: params/s x bytes read and written per param (28; 30 with the bf16 copy; 26 "
      "with bf16 grads and the copy; PyTorch's passes move more than 28).\n%s",
      verdict.c_str());
  return 0;
}

}  // namespace
}  // namespace trainyard::adam

int main(int argc, char** argv) { return trainyard::adam::Main(argc, argv); }
