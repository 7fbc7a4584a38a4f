#!/usr/bin/env bash
# The integration checks on the GPU, in one call: the integration tests (a Llama-3-8B-shaped
# transformers model through generated kernels, torch.compile with Inductor, CUDA-graph
# capture), then the model benchmark (attngen vs SDPA vs FlexAttention: prefill latency and
# memory, decode tokens/s).
# Usage on the H200 (torch 2.11, triton 3.6, transformers 5.17), from the repository root:
#   source tools/gpu_env.sh; bash tools/gpu_integrate.sh OUT_DIR [bench_model.py args]
set -u -o pipefail
out=${1:?usage: tools/gpu_integrate.sh OUT_DIR [bench args]}
shift
mkdir -p "$out"
source tools/gpu_env.sh
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton",
triton.__version__, "transformers", transformers.__version__)' | tee -a "$out/gpu.txt"
python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_integration_gpu.py \
  tests/test_prefill_gpu.py 2>&1 | tee "$out/pytest_integration_gpu.log"
tests_rc=$?
python3 tools/bench_model.py --out "$out" "$@" 2>&1 | tee "$out/bench_model.log"
bench_rc=$?
echo "gpu integration tests rc=$tests_rc, model bench rc=$bench_rc"
tail -n 3 "$out/pytest_integration_gpu.log"
exit $(( tests_rc != 0 || bench_rc != 0 ))
