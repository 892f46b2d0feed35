#!/usr/bin/env bash
# GPU check, for the day a CUDA machine is lent (about 10 minutes on one GPU). Every step runs even when an earlier
# one fails, and the log ends with one line per step and its exit status:
#   1. the kernel tests, compiled on CUDA (store codes bit-exact, decode within the CUDA tolerances) + backends
#   2. the compile table for this device's compute capability and sm_90/sm_80 (registers, spills, shared memory)
#   3. decode µs and GB/s vs bf16 baselines (SDPA, flash-attn if installed, a bf16 Triton MLA decode)
#   4. generate with patched tiny models (deepseek_v3 512 + 64, llama GQA 128), eager and under torch.compile
#      (transformers' compile_config, CUDA graphs): last, so that a failure there hides nothing else
# Writes benchmarks/results/gpu_check.log, bench_decode_gpu.csv and compile_sm<cc>.md (all copied to $OUT if set).
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
status=()
step() {  # step NAME TIMEOUT_S COMMAND...: run, record the exit status, never stop the script
  local name=$1 limit=$2
  shift 2
  echo "=== $name: $*"
  timeout "$limit" "$@"
  local rc=$?
  status+=("$name: exit $rc")
  echo "=== $name: exit $rc"
}
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv
  if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
  fi
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=1
  unset TRITON_INTERPRET
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
  cc=$(python3 -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'{m}{n}')" 2>/dev/null || echo 90)
  step "kernel tests (CUDA)" 420 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_store.py \
    tests/test_kernels_decode.py tests/test_backends.py
  archs=$(printf '%s\n' "$cc" 90 80 | awk '!seen[$0]++' | tr '\n' ' ')
  # shellcheck disable=SC2086  # one argument per architecture
  step "compile table (sm $archs)" 600 python3 benchmarks/compile_report.py --arch $archs --jobs 8
  step "decode benchmark" 420 python3 benchmarks/gpu_bench.py decode --out benchmarks/results/bench_decode_gpu.csv
  step "generate eager vs torch.compile" 600 python3 benchmarks/gpu_bench.py generate
  echo
  printf '%s\n' "${status[@]}"
} 2>&1 | tee "$log"
if [ -n "${OUT:-}" ]; then
  cp benchmarks/results/gpu_check.log benchmarks/results/bench_decode_gpu.csv benchmarks/results/compile_sm*.md "$OUT"/ 2>/dev/null
fi
