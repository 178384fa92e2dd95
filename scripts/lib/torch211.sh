# PyTorch 2.11 from PyPI, the CPU anchor of the step benchmarks (bench/ddp_bench.sh): eager with
# SDPA and fused AdamW, and torch.compile. PyPI's torch 2.11 is the CUDA wheel; its CPU side is
# what a PyPI user runs. It goes into build/torch211-venv with the three NVIDIA libraries it needs
# beyond the CUDA toolkit (the ones scripts/check-cuda-build.sh names) and runs with
# LD_LIBRARY_PATH at /usr/local/cuda/lib64 and the venv's nvidia/*/lib. Source this file.

TORCH211_VENV=${TORCH211_VENV:-build/torch211-venv}

# Makes the venv once (about 1 GB from PyPI).
torch211_setup() {
  if [ -f "$TORCH211_VENV/.complete" ]; then return 0; fi
  rm -rf "$TORCH211_VENV"
  python3 -m venv "$TORCH211_VENV"
  "$TORCH211_VENV/bin/pip" install -q --no-deps torch==2.11.0 nvidia-cusparselt-cu13==0.8.0 \
    nvidia-nvshmem-cu13==3.4.5 nvidia-cufile==1.15.1.6 typing_extensions sympy networkx jinja2 \
    fsspec filelock numpy mpmath MarkupSafe
  touch "$TORCH211_VENV/.complete"
}

# torch211_python ARGS...: the venv's python with the libraries torch 2.11 loads.
torch211_python() {
  local libs
  libs=$(printf "%s:" "$TORCH211_VENV"/lib/python3*/site-packages/nvidia/*/lib)
  LD_LIBRARY_PATH="${libs}${CUDA_HOME:-/usr/local/cuda}/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
    "$TORCH211_VENV/bin/python" "$@"
}
