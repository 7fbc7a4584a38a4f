#!/usr/bin/env bash
# Each candidate patch of this folder against the package's templates, by tools/ab_templates.py
# (B/A > 1: the candidate faster): the templates copied to OUT/alt_NAME, the patch applied
# there (`git apply`), then the A/B at the grid's N 4k and 16k, causal and not, at the head
# dims the candidate is for. Usage on a CUDA machine, from the repository root:
#   bash tools/ab_alt/run.sh OUT [NAME ...]        (default: every job below, in order)
set -u
out=${1:?usage: tools/ab_alt/run.sh OUT [NAME ...]}
shift
# double staging: no shared memory for it at D 64 (BLOCK_M 128 without a mask); one step late:
# D 64 at BLOCK_M 128 spills 188 B with it
declare -A dims=([bwd_dq_double_staging]="128" [bwd_thread_arrives]="64 128"
                 [bwd_dq_one_step_late]="128" [bwd_dq_double_staging_thread_arrives]="128")
order=(bwd_dq_double_staging_thread_arrives bwd_dq_double_staging bwd_dq_one_step_late
       bwd_thread_arrives)
failed=0
for name in "${@:-${order[@]}}"; do
  alt="$out/alt_$name"
  mkdir -p "$alt" && cp attngen/templates/*.jinja "$alt"/
  (cd "$alt" && git apply -p1 "$OLDPWD/tools/ab_alt/$name.patch") || { failed=1; continue; }
  backward=$([ "${name%%_*}" = bwd ] && echo --backward)
  # shellcheck disable=SC2086  # the head dims and the flag split into arguments
  python3 tools/ab_templates.py --alt "$alt" --out "$out/ab_$name" $backward --heads-last \
    --d ${dims[$name]} --n 4096 16384 --causal 0 1 || failed=1
done
exit $failed
