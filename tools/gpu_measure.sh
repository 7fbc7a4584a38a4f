#!/usr/bin/env bash
# The GPU measurements, in parts that each fit one 10-minute device command:
#   part "decode-prefill": decode GPU tests, the decode benchmark, the prefill benchmark;
#   part "integration":    integration GPU tests (transformers Llama, torch.compile, CUDA
#                          graphs), then the model benchmark.
# Usage, from the repository root:  bash tools/gpu_measure.sh PART OUT_DIR
set -u -o pipefail
part=${1:?usage: tools/gpu_measure.sh PART OUT_DIR}
out=${2:?usage: tools/gpu_measure.sh PART OUT_DIR}
mkdir -p "$out"
source tools/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' \
  | tee -a "$out/gpu.txt"
rc=0
run() {  # a step with its own time limit; its failure is reported, the next step still runs
  local limit=$1 log=$2; shift 2
  timeout "$limit" "$@" > "$out/$log" 2>&1 || { echo "FAILED ($?): $*"; rc=1; }
  tail -n 25 "$out/$log"
}
case "$part" in
  decode-prefill)
    run 150 pytest_decode_gpu.log python3 -m pytest -m gpu -q -p no:cacheprovider \
      tests/test_decode_gpu.py
    run 190 bench_decode.log python3 tools/bench_decode.py --out "$out"
    run 220 bench_prefill.log python3 tools/bench_prefill.py --out "$out" ;;
  integration)
    run 220 pytest_integration_gpu.log python3 -m pytest -m gpu -q -p no:cacheprovider \
      tests/test_integration_gpu.py
    run 330 bench_model.log python3 tools/bench_model.py --out "$out" ;;
  *) echo "unknown part $part"; exit 2 ;;
esac
exit $rc
