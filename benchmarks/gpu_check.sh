#!/usr/bin/env bash
# GPU check, on a CUDA machine (about 5 minutes): the kernel tests compiled on CUDA, then the decode benchmark.
# Writes benchmarks/results/gpu_check.log and benchmarks/results/bench_decode_gpu.csv (also copied to $OUT if set).
#
# The lent machines have no network: nothing is installed from an index. This project is checked against
# transformers 5.24; if the machine's is older, carry its wheel (pure Python) in .whl/, prepared here with
#   echo /.whl/ >> .git/info/exclude
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d .whl transformers==5.24.0
# and pass carry=[".whl"]; this script installs what it finds there into /tmp/site.
set -uo pipefail
cd "$(dirname "$0")/.."
mkdir -p benchmarks/results
log=benchmarks/results/gpu_check.log
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
  fi
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
  unset TRITON_INTERPRET
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_store.py tests/test_kernels_decode.py tests/test_backends.py
  echo "kernel tests exit: $?"
  timeout 240 python3 benchmarks/bench_decode.py --device cuda
  echo "benchmark exit: $?"
} 2>&1 | tee "$log"
if [ -n "${OUT:-}" ]; then cp benchmarks/results/gpu_check.log benchmarks/results/bench_decode_gpu.csv "$OUT"/ 2>/dev/null; fi
