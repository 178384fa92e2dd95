// Which matrix-multiply kernels the trainer's BLAS runs. LibTorch does its CPU matmuls (nearly all
// of a transformer step) in the system BLAS, OpenBLAS on Debian, which picks its kernels by CPU
// model when it loads unless OPENBLAS_CORETYPE names them. The choice can halve a step's speed
// (on an AVX-512 CPU the AVX2 "Haswell" kernels do the model's fp32 matmuls at about half the rate
// of the AVX-512 "SkylakeX"/"Cooperlake" ones; see bench/RESULTS.md), so every rank logs it.
#ifndef TRAINYARD_WORKER_TRAINER_KERNELS_BLAS_H_
#define TRAINYARD_WORKER_TRAINER_KERNELS_BLAS_H_

#include <string>

namespace trainyard::trainer {

// One line for the log, e.g. "BLAS: OpenBLAS 0.3.21 NO_LAPACKE DYNAMIC_ARCH ... Cooperlake
// MAX_THREADS=64; kernels Cooperlake", with "(set by OPENBLAS_CORETYPE)" when the environment
// chose them.
std::string DescribeBlas();

// Has OpenBLAS run its matmuls on `threads` threads. Its pthreads build keeps a pool of its own,
// sized at load by OPENBLAS_NUM_THREADS, else OMP_NUM_THREADS, else every CPU the process may use;
// torch::set_num_threads does not reach it. A trainer started with --threads 1 and no
// OMP_NUM_THREADS (by hand, by a bench) would otherwise run two ranks' BLAS on twice the cores, and
// its spinning threads lose badly to other work on the cores. Nothing for another BLAS.
void SetBlasThreads(int threads);

}  // namespace trainyard::trainer

#endif  // TRAINYARD_WORKER_TRAINER_KERNELS_BLAS_H_
