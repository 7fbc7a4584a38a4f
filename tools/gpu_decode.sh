#!/usr/bin/env bash
# The decode GPU run, in one call: the decode GPU tests (memory safety included) and the
# decode benchmark.
# Usage on a CUDA machine, from the repository root:
#   source tools/gpu_env.sh; bash tools/gpu_decode.sh OUT_DIR [bench args]
set -u -o pipefail
out=${1:?usage: tools/gpu_decode.sh OUT_DIR [bench args]}
shift
mkdir -p "$out"
source tools/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' \
  | tee -a "$out/gpu.txt"
python3 -m attngen check examples/*.yaml 2>&1 | tee "$out/check.log"
ATTNGEN_HYPOTHESIS_PROFILE=gpu python3 -m pytest -m gpu -q -p no:cacheprovider \
  tests/test_decode_gpu.py tests/test_rotary_gpu.py tests/test_prefill_gpu.py \
  tests/test_safety_gpu.py 2>&1 \
  | tee "$out/pytest_gpu_decode.log"
tests_rc=$?
python3 tools/bench_decode.py --out "$out" "$@" 2>&1 | tee "$out/bench_decode.log"
bench_rc=$?
echo "gpu tests rc=$tests_rc, bench rc=$bench_rc"
tail -n 3 "$out/pytest_gpu_decode.log"
exit $(( tests_rc != 0 || bench_rc != 0 ))
