# Sourced by the tools/gpu_*.sh scripts: the environment of a run on the GPU machine.
# That machine has torch and triton but no network and no pydantic: packages it lacks travel
# as wheels in .whl/ (downloaded here for CPython 3.12 manylinux x86_64; see CONTRIBUTING.md,
# "On the GPU machine") and are installed into a private folder put first on PYTHONPATH.
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "${ATTNGEN_SITE:-/tmp/attngen-site}" .whl/*.whl || exit 1
  # kept after it: what the caller put there (tools/gpu_fa4.sh's FA4, sourced before a
  # gpu_session.sh call, whose own sourcing of this file must not drop it)
  export PYTHONPATH="${ATTNGEN_SITE:-/tmp/attngen-site}${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
