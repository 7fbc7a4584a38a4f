#!/usr/bin/env bash
# Runs GPU test files one by one, each under its own limit, stopping each at its first failure
# so the reason is printed before a limit can cut the log (a killed pytest prints no summary).
# Logs land in OUT/<file>.log; the last lines of each are printed, with a one-line table last.
#
# Usage on a CUDA machine, from the repository root:
#   bash tools/gpu_files.sh OUT FILE[:SECONDS] ...      (default 120 s a file; -k via PYTEST_K)
set -u -o pipefail
out=${1:?usage: tools/gpu_files.sh OUT FILE[:SECONDS] ...}
shift
mkdir -p "$out"
source tools/gpu_env.sh
table=""
for item in "$@"; do
  file=${item%%:*}
  limit=${item#*:}
  [ "$limit" = "$item" ] && limit=120
  log="$out/$(basename "$file" .py).log"
  start=$(date +%s)
  timeout -k 5 "$limit" python3 -m pytest -m gpu -q -x --tb=short -rfs -p no:cacheprovider \
    ${PYTEST_K:+-k "$PYTEST_K"} "$file" > "$log" 2>&1
  rc=$?
  echo "== $file rc=$rc"
  grep -E '^(E |FAILED|ERROR|[a-z_/]+\.py:[0-9]+: )' "$log" | head -n 12
  last=$(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-110)
  table="$table$(basename "$file") rc=$rc $(( $(date +%s) - start ))s | $last"$'\n'
done
printf '%s' "$table"
