"""Call plans: what a call's layout decides (checks passed, derivations made), kept for the
next call of that layout by the prefill and varlen launchers (attention, attention_varlen).

Copied verbatim into the prefill and varlen modules with call plans (the `call_plans` flag:
no sinks, expression tensors or dropout), after tma.py, and followed by the kind's own half:
prefill_plans.py or varlen_plans.py (attngen/host/__init__.py).
"""

from attngen.host.launch import _LAUNCH_CACHE_SIZE

# -- host code: attngen/host/plans.py, copied verbatim -----------------------------------------
# A launcher's checks and derivations depend on the call's layout alone (shapes, strides,
# dtypes and devices, the ints, sm_scale, return_lse; varlen's grid comes from max_seqlen_q,
# never from the index tensors' values), except out='s storage, the bases' alignment and
# ATTNGEN_CHECKS, read at every call. So once a call of a layout has passed the checks and
# launched, the next skips them and the derivations, unless the config changed (autotune
# updates CONFIG) or (prefill) the launch cannot run directly (a hook, another device).
_CALL_PLANS: dict = {}  # _call_key(...) -> the kind's plan (_CallPlan; varlen: a tuple)


def _remember_plan(key: tuple, plan: object) -> None:
    if len(_CALL_PLANS) >= _LAUNCH_CACHE_SIZE:
        _CALL_PLANS.clear()
    _CALL_PLANS[key] = plan
