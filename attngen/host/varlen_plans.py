"""The varlen launcher's call plans (after plans.py): a layout's key, the launch from its
plan (a tuple: config, longest (None: CONFIG alone), output shapes, _Step, forward_path's)."""

from typing import Any

import torch

from attngen.host.launch import _FAST_LAUNCH, _TENSOR, _check_out, _checked, _layout, _run_step
from attngen.host.varlen import _validate_varlen

_STAND_IN: Any = None
CONFIG = config_for = _STAND_IN  # the module's own (above the host code)


# -- host code: attngen/host/varlen_plans.py, copied verbatim ----------------------------------
def _call_key(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, sm_scale,
              alibi_slopes, return_lse, seqused_k, out):  # fmt: skip
    """The layout of a call a plan may serve (None: the full path decides): plain tensors,
    int lengths, no slopes, sm_scale None or a float, return_lse a bool, the cached launcher
    on."""
    if not (_FAST_LAUNCH and alibi_slopes is None and type(q) is _TENSOR
            and type(max_seqlen_q) is int and type(max_seqlen_k) is int
            and (sm_scale is None or type(sm_scale) is float)
            and type(return_lse) is bool):  # fmt: skip
        return None
    try:
        return (q.shape, q.stride(), q.dtype, q.is_cuda, q.get_device(), _layout(k), _layout(v),
                _layout(cu_seqlens_q), _layout(cu_seqlens_k), _layout(seqused_k), _layout(out),
                max_seqlen_q, max_seqlen_k, sm_scale, return_lse)  # fmt: skip
    except TypeError:
        return None


def _run_plan(plan, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, seqused_k, out):
    """attention_varlen()'s launch from the plan of its layout (config, the length config_for
    picks it by, output shapes, _Step, forward_path's answer or None without a Gluon forward):
    (out, lse or None), or None when the full path must run (the config changed)."""
    config, longest, out_shape, lse_shape, step, _ = plan
    if (CONFIG if longest is None else config_for(longest)) != config:  # None: CONFIG alone
        return None
    if _checked():
        _validate_varlen(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, seqused_k)
    if out is None:
        out = q.new_empty(out_shape)
    else:
        storage = out.untyped_storage().data_ptr()
        if storage in (q.untyped_storage().data_ptr(), k.untyped_storage().data_ptr(),
                       v.untyped_storage().data_ptr()):  # fmt: skip
            _check_out(out, out_shape, q, (("q", q), ("k", k), ("v", v)))  # raises
    lse = None  # neither is filled: the kernel writes every row (_fill_rows)
    if lse_shape is not None:
        lse = torch.empty(lse_shape, dtype=torch.float32, device=q.device)
    lse_arg = out if lse is None else lse
    used_arg = cu_seqlens_k if seqused_k is None else seqused_k
    _run_step(step, q.get_device(), (q, k, v, out, lse_arg, out, cu_seqlens_q, cu_seqlens_k,
                                     used_arg))  # fmt: skip
    return out, lse
