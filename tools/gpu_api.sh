#!/usr/bin/env bash
# The API-level and memory-safety suites on a CUDA GPU (the H200), in one run:
#   1. tests/test_api_gpu.py: decode and varlen through the public functions and the committed
#      generated/ modules, every caller tensor inside a sentinel-filled guard region;
#   2. tests/test_safety_gpu.py: the kernels' bounds on bad index tensors at real sizes;
#   3. the gpu-marked KV-cache tests: decode modules with their append (bf16 at every length,
#      NaN poisoning, forced splits, CUDA-graph capture), flash_attn_with_kvcache under a CUDA
#      graph and through a module built on demand.
# Each group runs in its own pytest process, and each property of test_api_gpu.py too: an
# illegal address ends the CUDA context, and every test after it in that process would only
# report that. A summary (one line per group, then the first failures) ends the output and
# is written to OUT_DIR/summary.txt; the exit status is nonzero when any group failed.
#
# Usage on a CUDA machine, from the repository root:
#   bash tools/gpu_api.sh OUT_DIR
set -u -o pipefail
out=${1:?usage: tools/gpu_api.sh OUT_DIR}
mkdir -p "$out"
source tools/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' \
  | tee -a "$out/gpu.txt"
export ATTNGEN_HYPOTHESIS_PROFILE=gpu

groups=()
rc=0
run_group() {  # run_group NAME PYTEST-ARGS...: pytest -m gpu, its log in OUT_DIR/NAME.log
  local name=$1
  shift
  echo "== $name: pytest -m gpu $*"
  python3 -m pytest -m gpu -q -p no:cacheprovider "$@" 2>&1 | tee "$out/$name.log"
  local status=${PIPESTATUS[0]}
  rc=$(( rc || status ))
  groups+=("$name|$status")
}

run_group api_kvcache "tests/test_api_gpu.py::test_kvcache_on_cuda"
run_group api_packed "tests/test_api_gpu.py::test_packed_sequences_on_cuda"
run_group safety tests/test_safety_gpu.py
run_group kvcache -k "kvcache or decode or attngen_calls" \
  tests/test_decode_gpu.py tests/test_integration_gpu.py tests/test_ondemand_gpu.py

{
  echo "== summary (logs in $out)"
  for group in "${groups[@]}"; do
    name=${group%%|*}
    status=${group##*|}
    result=$(grep -E "(passed|failed|error|skipped|no tests ran)" "$out/$name.log" | tail -1)
    printf '%-12s rc=%-3s %s\n' "$name" "$status" "$result"
  done
  failures=$(grep -hE "^(FAILED|ERROR) " "$out"/*.log | head -20)
  if [ -n "$failures" ]; then
    echo "first failures:"
    echo "$failures"
  fi
  echo "gpu api run rc=$rc"
} | tee "$out/summary.txt"
exit $rc
