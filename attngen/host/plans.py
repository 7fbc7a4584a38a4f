"""Call plans, what a call's layout decides kept for the next call of that layout, in
prefill and varlen modules (no sinks, expression tensors or dropout): the part both share."""

from attngen.host.launch import _LAUNCH_CACHE_SIZE

# -- host code: attngen/host/plans.py, copied verbatim -----------------------------------------
# A launcher's checks and derivations depend on the call's layout alone (shapes, strides,
# dtypes, devices, ints, sm_scale, return_lse; varlen's grid is max_seqlen_q's) but for out='s
# storage, the bases' alignment and ATTNGEN_CHECKS, read at every call. So once a layout has
# passed and launched, its next call skips them, unless the config changed (autotune) or
# (prefill) the launch cannot run directly (a hook, another device).
_CALL_PLANS: dict = {}  # _call_key(...) -> the kind's plan (_CallPlan; varlen: a tuple)


def _remember_plan(key: tuple, plan: object) -> None:
    if len(_CALL_PLANS) >= _LAUNCH_CACHE_SIZE:
        _CALL_PLANS.clear()
    _CALL_PLANS[key] = plan
