#!/usr/bin/env bash
# Gluon kernels alone under Nsight Compute (their durations; default clocks, as
# tools/ncu_versus.py), the package's templates (A) against candidate patches of this folder
# (B, and C... in the order named): the measurement a grid's spread cannot give. Each cell runs
# tools/ncu_cell.py (forward, backward, three times) and profiles its second launch of each
# kernel KERNELS matches.
# Usage on a CUDA machine, from the repository root:
#   bash tools/ab_alt/ncu.sh OUT [NAME[,NAME...]]        (default NAME: bwd_heads_in_l2)
# with, in the environment, KERNELS (default _gluon_attn_bwd; _gluon_attn_.. both), COUNT
# (the kernels KERNELS matches: 2 for _gluon_attn_.., else 1), DIMS (128), LENGTHS ("4096
# 16384"), MASKS ("unmasked causal").
set -u
out=${1:?usage: tools/ab_alt/ncu.sh OUT [NAME[,NAME...]]}
IFS=, read -r -a names <<< "${2:-bwd_heads_in_l2}"
kernels=${KERNELS:-_gluon_attn_bwd}
count=${COUNT:-$([ "$kernels" = _gluon_attn_.. ] && echo 2 || echo 1)}
for name in "${names[@]}"; do
  alt="$out/alt_$name"
  mkdir -p "$alt" && cp attngen/templates/*.jinja "$alt"/
  (cd "$alt" && git apply -p1 "$OLDPWD/tools/ab_alt/$name.patch") || exit 1
done
for d in ${DIMS:-128}; do
  for n in ${LENGTHS:-4096 16384}; do
    for mask in ${MASKS:-unmasked causal}; do
      causal=$([ "$mask" = causal ] && echo --causal)
      for side in A "${names[@]}"; do
        extra=$([ "$side" != A ] && echo "--alt $out/alt_$side")
        label=$([ "$side" = A ] && echo "A (main)" || echo "B ($side)")
        # shellcheck disable=SC2086  # the optional flags split into arguments
        ncu --clock-control none -k "regex:$kernels" -s "$count" -c "$count" \
          --metrics gpu__time_duration.sum --csv python3 tools/ncu_cell.py --d "$d" --n "$n" \
          --backward $causal $extra 2>/dev/null | grep gpu__time_duration \
          | awk -F'","' -v c="D $d N $n $mask $label" \
            '{k = $5; sub(/\(.*/, "", k); print c ": " k " " $NF " " $(NF - 1)}' | tr -d '"'
      done
    done
  done
done
