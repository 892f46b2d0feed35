#!/usr/bin/env bash
# GPU check (run on a CUDA machine; about 5 minutes): kernel tests compiled on CUDA, then the decode benchmark.
# Writes benchmarks/results/gpu_check.log and benchmarks/results/bench_decode_gpu.csv (copied to $OUT if set).
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p benchmarks/results
log=benchmarks/results/gpu_check.log
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)" \
    || pip install -q "torch>=2.4" triton
  pip install -q -e ".[test]" 2>&1 | tail -1
  unset TRITON_INTERPRET
  timeout 300 python -m pytest -q tests/test_kernels_store.py tests/test_kernels_decode.py tests/test_backends.py
  echo "kernel tests exit: $?"
  timeout 240 python benchmarks/bench_decode.py --device cuda
  echo "benchmark exit: $?"
} 2>&1 | tee "$log"
if [ -n "${OUT:-}" ]; then cp benchmarks/results/gpu_check.log benchmarks/results/bench_decode_gpu.csv "$OUT"/ 2>/dev/null; fi
