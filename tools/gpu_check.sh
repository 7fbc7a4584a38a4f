#!/usr/bin/env bash
# The GPU run, in one call: the GPU tests (`pytest -m gpu`) and the prefill benchmark.
# Usage on a CUDA machine, from the repository root:  bash tools/gpu_check.sh OUT_DIR [bench args]
# Missing Python packages can be brought as wheels in .whl/ (see docs/gpu.md).
set -u -o pipefail
out=${1:?usage: tools/gpu_check.sh OUT_DIR [bench args]}
shift
mkdir -p "$out"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/attngen-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/attngen-site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$out/gpu.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' \
  | tee -a "$out/gpu.txt"
ATTNGEN_HYPOTHESIS_PROFILE=gpu python3 -m pytest -m gpu -q -p no:cacheprovider tests/ \
  2>&1 | tee "$out/pytest_gpu.log"
tests_rc=$?
python3 tools/bench_prefill.py --out "$out" "$@" 2>&1 | tee "$out/bench.log"
bench_rc=$?
echo "gpu tests rc=$tests_rc, bench rc=$bench_rc"
tail -n 3 "$out/pytest_gpu.log"
exit $(( tests_rc != 0 || bench_rc != 0 ))
