#!/usr/bin/env bash
# The API-level property suite on a CUDA GPU: decode and varlen through the public functions
# and the committed generated/ modules, with guard regions around every caller tensor.
# Usage on a CUDA machine, from the repository root:
#   bash tools/gpu_api.sh OUT_DIR
set -u -o pipefail
out=${1:?usage: tools/gpu_api.sh OUT_DIR}
mkdir -p "$out"
source tools/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$out/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' \
  | tee -a "$out/gpu.txt"
# One test per process: an illegal address ends the CUDA context, and the next test would
# only report that.
rc=0
for test in test_kvcache_on_cuda test_packed_sequences_on_cuda; do
  ATTNGEN_HYPOTHESIS_PROFILE=gpu python3 -m pytest -m gpu -q -p no:cacheprovider \
    "tests/test_api_gpu.py::$test" 2>&1 | tee "$out/pytest_$test.log"
  rc=$(( rc || $? ))
done
echo "gpu api tests rc=$rc"
exit $rc
