#!/usr/bin/env bash
# Two lists of single-GPU sections at once on a two-GPU machine, one per GPU, so that a device
# call does twice the work. The second list runs in a copy of the tree (a section may rebuild
# generated/, as autotune_backward does, under the other list's tests) with its own package
# folder. Host-time sections (host_public, profile_launch) do not belong here: the other
# process shares the CPUs.
#
# Usage: bash tools/gpu_parallel.sh OUT "SECTION[:SECONDS] ..." "SECTION[:SECONDS] ..."
# Results: OUT/gpu0.tgz and OUT/gpu1.tgz (each list's logs and JSON) and OUT/gpu*.txt; each
# list's summary is printed last. Only those land in OUT: the device tool returns at most 8 files.
set -u
out=${1:?usage: tools/gpu_parallel.sh OUT "SECTIONS for GPU 0" "SECTIONS for GPU 1"}
first=${2:?sections for GPU 0}
second=${3:?sections for GPU 1}
copy=/tmp/attngen-gpu1
rm -rf "$copy" && cp -a . "$copy"
runs=/tmp/attngen-parallel
rm -rf "$runs" && mkdir -p "$runs" "$out"
# shellcheck disable=SC2086  # each list is split into its sections on purpose
CUDA_VISIBLE_DEVICES=0 bash tools/gpu_session.sh "$runs/gpu0" $first > "$out/gpu0.txt" 2>&1 &
# shellcheck disable=SC2086
(cd "$copy" && CUDA_VISIBLE_DEVICES=1 ATTNGEN_SITE=/tmp/attngen-site1 \
  bash tools/gpu_session.sh "$runs/gpu1" $second) > "$out/gpu1.txt" 2>&1 &
wait
rc=0
for gpu in gpu0 gpu1; do
  echo "== $gpu"
  cp "$runs/$gpu/results.tgz" "$out/$gpu.tgz" 2>/dev/null
  cat "$runs/$gpu/summary.txt" 2>/dev/null || { tail -n 20 "$out/$gpu.txt"; rc=1; }
  grep -q ' rc=[1-9]' "$runs/$gpu/summary.txt" 2>/dev/null && rc=1
done
exit $rc
