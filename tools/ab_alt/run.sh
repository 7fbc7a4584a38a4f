#!/usr/bin/env bash
# Each candidate patch of this folder against the package's templates, by tools/ab_templates.py
# (B/A > 1: the candidate faster): the templates copied to OUT/alt_NAME, the patch applied
# there (`git apply`), then the A/B at the grid's N 4k and 16k, causal and not, at the head
# dims the candidate is for. Usage on a CUDA machine, from the repository root:
#   bash tools/ab_alt/run.sh OUT [NAME ...]        (default: every job below, in order)
# The A/B's forward, which a backward candidate leaves alone, read 0.98-1.12x on an H100
# (2026-12-07): a backward B/A within about 5% of 1 is noise. Measured and merged or dropped:
# dQ a step late (served at D 128), double-buffered dQ staging (slower causal), both at
# docs/results/ab_alt_h100_2026-12-07_83ac9e2d.log; the causal CTA orders (forward 4 heads
# interleaved, backward head by head) and dQ on time, measured under Nsight Compute and
# dropped (docs/results/ncu_order_h100_2026-12-07_48e6759a.log, their patches at bf87cf60).
set -u
out=${1:?usage: tools/ab_alt/run.sh OUT [NAME ...]}
shift
# Per-thread releases: at D 128 on top of dQ a step late (cross-compiled: 16 B spilled as
# without them), at D 64 the served BLOCK_M 128 / 64 forms; heads in L2: the causal dK/dV
# kernel with as many KV heads' key blocks interleaved as fit L2 (causal only: the unmasked
# kernels do not change); TMA epilogue: dK and dV stored by TMA from the dQ staging (BLOCK_M 64
# forms), the per-CTA cost at short sequences; one slot: the forward's K_j and V_{j-1} behind
# one ready and one empty barrier a step.
declare -A dims=([bwd_thread_arrives]="128 64" [bwd_heads_in_l2]="128 64" [bwd_tma_epilogue]="128 64"
  [fwd_kv_one_slot]="128 64")
declare -A lengths=([bwd_tma_epilogue]="1024 4096")
declare -A masks=([bwd_heads_in_l2]="1")
order=(bwd_heads_in_l2 bwd_tma_epilogue fwd_kv_one_slot bwd_thread_arrives)
failed=0
for name in "${@:-${order[@]}}"; do
  alt="$out/alt_$name"
  mkdir -p "$alt" && cp attngen/templates/*.jinja "$alt"/
  (cd "$alt" && git apply -p1 "$OLDPWD/tools/ab_alt/$name.patch") || { failed=1; continue; }
  backward=$([ "${name%%_*}" = bwd ] && echo --backward)
  # shellcheck disable=SC2086  # the head dims and the flag split into arguments
  python3 tools/ab_templates.py --alt "$alt" --out "$out/ab_$name" $backward --heads-last \
    --d ${dims[$name]} --n ${lengths[$name]:-4096 16384} --causal ${masks[$name]:-0 1} || failed=1
done
exit $failed
