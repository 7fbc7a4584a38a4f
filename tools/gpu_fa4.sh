#!/usr/bin/env bash
# FlashAttention-4 (flash_attn.cute) on the GPU machine, from wheels carried in pieces.
#
# One device call carries at most 64 MiB, and FA4's CUTLASS DSL wheel is 92 MB: it travels
# split (`split -b 31000000 WHEEL part.`) into the ignored folders fa4a/, fa4b/ and fa4c/
# (fa4c/ also holds the other wheels and cu13.sha256, the whole wheel's digest), one folder a
# call, each call made while the machine is still warm. Sourced at the start of each call:
#   source tools/gpu_fa4.sh
# it keeps every part it finds in /tmp/fa4parts (which outlives the call on a warm machine);
# once all parts and the other wheels are there, it joins and checks the wheel, installs
# everything into /tmp/fa4site, and puts it on PYTHONPATH (FA4_READY=1). A later call on the
# same machine finds /tmp/fa4site and only sets the path.
parts=/tmp/fa4parts
site=/tmp/fa4site
mkdir -p "$parts"
for folder in fa4a fa4b fa4c; do
  [ -d "$folder" ] && cp -n "$folder"/* "$parts"/ 2>/dev/null
done
FA4_READY=0
if [ ! -f "$site/.done" ] && [ -f "$parts/part.aa" ] && [ -f "$parts/part.ab" ] \
  && [ -f "$parts/part.ac" ] && [ -f "$parts/cu13.sha256" ]; then
  wheel="$parts/nvidia_cutlass_dsl_libs_cu13-4.8.1-cp312-cp312-manylinux_2_28_x86_64.whl"
  cat "$parts"/part.aa "$parts"/part.ab "$parts"/part.ac > "$wheel"
  if [ "$(sha256sum "$wheel" | cut -d' ' -f1)" = "$(cat "$parts/cu13.sha256")" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" \
      "$parts"/*.whl && touch "$site/.done"
  else
    echo "gpu_fa4: the joined wheel's sha256 differs; not installed" >&2
  fi
fi
if [ -f "$site/.done" ]; then
  export PYTHONPATH="$site:$site/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}"
  export FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=1
  FA4_READY=1
fi
echo "gpu_fa4: FA4_READY=$FA4_READY (parts: $(ls "$parts" | tr '\n' ' '))"
