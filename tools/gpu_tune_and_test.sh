#!/usr/bin/env bash
# GPU call: autotune the benchmark and example specs (sm90 modules read K/V through TMA),
# rebuild generated/ from the new tuning file, then run the GPU tests of the prefill, varlen and
# integration paths on the tuned modules. Copy tuning/sm90.json back into the repository.
# Usage, from the repository root:  bash tools/gpu_tune_and_test.sh OUT_DIR [autotune options]
set -u -o pipefail
out=${1:?usage: tools/gpu_tune_and_test.sh OUT_DIR [autotune options]}
shift
mkdir -p "$out"
source tools/gpu_env.sh
# TUNE_SPECS: the spec files to tune (default: every benchmark and example spec); GPU_TESTS:
# the test files to run after (default: prefill and integration).
python3 -m attngen autotune ${TUNE_SPECS:-tools/bench_specs/*.yaml examples/*.yaml} "$@" 2>&1 \
  | tee "$out/autotune.log" | tail -n 24
tune_rc=$?
cp tuning/sm90.json tuning/.progress-sm90.json "$out/" 2>/dev/null
python3 -m attngen build examples/*.yaml >/dev/null && python3 -m attngen check examples/*.yaml
build_rc=$?
timeout "${GPU_TEST_TIMEOUT:-200}" python3 -m pytest -m gpu -q -p no:cacheprovider -x \
  ${GPU_TESTS:-tests/test_prefill_gpu.py tests/test_integration_gpu.py} 2>&1 | tee "$out/pytest_gpu.log" \
  | tail -n 15
tests_rc=$?
echo "autotune rc=$tune_rc, build rc=$build_rc, gpu tests rc=$tests_rc"
exit $(( tune_rc != 0 || build_rc != 0 || tests_rc != 0 ))
