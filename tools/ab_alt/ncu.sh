#!/usr/bin/env bash
# The Gluon dK/dV kernel alone under Nsight Compute (its duration; default clocks, as
# tools/ncu_versus.py), the package's templates (A) against a candidate patch of this folder
# (B), at D 128 N 4k and 16k, unmasked and causal: the measurement a grid's spread cannot
# give. Usage on a CUDA machine, from the repository root:
#   bash tools/ab_alt/ncu.sh OUT [NAME]        (default NAME: bwd_dq_on_time)
set -u
out=${1:?usage: tools/ab_alt/ncu.sh OUT [NAME]}
name=${2:-bwd_dq_on_time}
alt="$out/alt_$name"
mkdir -p "$alt" && cp attngen/templates/*.jinja "$alt"/
(cd "$alt" && git apply -p1 "$OLDPWD/tools/ab_alt/$name.patch") || exit 1
for n in 4096 16384; do
  for causal in "" --causal; do
    for side in A B; do
      extra=$([ "$side" = B ] && echo "--alt $alt")
      # shellcheck disable=SC2086  # the optional flags split into arguments
      us=$(ncu --clock-control none -k regex:_gluon_attn_bwd -s 1 -c 1 \
        --metrics gpu__time_duration.sum --csv python3 tools/ncu_cell.py --d 128 --n $n \
        --backward $causal $extra 2>/dev/null | grep gpu__time_duration | tail -1 \
        | awk -F'","' '{print $NF}' | tr -d '"')
      echo "D 128 N $n ${causal:-unmasked} $side ($name as B): ${us:-?} (ncu's unit)"
    done
  done
done
