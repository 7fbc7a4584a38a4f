#!/usr/bin/env bash
# GPU call 1: autotune the example and benchmark specs on this GPU, rebuild generated/ from the
# tuning database, and run the GPU tests on the tuned modules. Results land in OUT_DIR
# (tuning file, progress file, logs); copy tuning/<arch>.json back into the repository.
# Usage, from the repository root:  bash tools/gpu_autotune.sh OUT_DIR [autotune options]
set -u -o pipefail
out=${1:?usage: tools/gpu_autotune.sh OUT_DIR [autotune options]}
shift
mkdir -p "$out"
source tools/gpu_env.sh
python3 -m attngen autotune examples/*.yaml tools/bench_specs/*.yaml "$@" 2>&1 \
  | tee "$out/autotune.log"
tune_rc=$?
cp tuning/*.json tuning/.progress-*.json "$out/" 2>/dev/null
python3 -m attngen build examples/*.yaml && python3 -m attngen check examples/*.yaml
build_rc=$?
ATTNGEN_HYPOTHESIS_PROFILE=gpu python3 -m pytest -m gpu -q -p no:cacheprovider tests/ \
  2>&1 | tee "$out/pytest_gpu.log"
tests_rc=$?
echo "autotune rc=$tune_rc, build rc=$build_rc, gpu tests rc=$tests_rc"
tail -n 3 "$out/pytest_gpu.log"
exit $(( tune_rc != 0 || build_rc != 0 || tests_rc != 0 ))
