#!/usr/bin/env bash
# The backward GPU run, in one call: the backward GPU tests, then the backward benchmark.
# Usage on a CUDA machine, from the repository root:
#   bash tools/gpu_backward.sh OUT_DIR [bench args, e.g. --quick]
set -u -o pipefail
out=${1:?usage: tools/gpu_backward.sh OUT_DIR [bench args]}
shift
mkdir -p "$out"
source tools/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' \
  | tee -a "$out/gpu.txt"
ATTNGEN_HYPOTHESIS_PROFILE=gpu python3 -m pytest -m gpu -q -p no:cacheprovider \
  tests/test_backward_gpu.py 2>&1 | tee "$out/pytest_gpu_backward.log"
tests_rc=$?
python3 tools/bench_backward.py --out "$out" "$@" 2>&1 | tee "$out/bench_backward.log"
bench_rc=$?
echo "gpu tests rc=$tests_rc, bench rc=$bench_rc"
tail -n 3 "$out/pytest_gpu_backward.log"
exit $(( tests_rc != 0 || bench_rc != 0 ))
