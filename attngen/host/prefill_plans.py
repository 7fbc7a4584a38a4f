"""The prefill launcher's call plans (after plans.py): a layout's key, the launch from its
plan, and the flash-layout entry points' plans (attention_flash, attention_flash_out)."""

from typing import Any

import torch

from attngen.host.launch import (
    _DRIVER,
    _FAST_LAUNCH,
    _KNOBS,
    _LAUNCH_CACHE_SIZE,
    _TENSOR,
    _check_out,
    _launch,
    _runs_directly,
)
from attngen.host.plans import _CALL_PLANS
from attngen.host.tma import _descriptor

# The module's own (above the host code; stand-ins here): its configs, forward kernel, TMA
# bound and, with a Gluon forward, that forward's host side (attngen/host/gluon.py).
_STAND_IN: Any = None
CONFIG = config_for = _attn_fwd_kernel = _gluon_why = _gluon_run = _STAND_IN
POINTER_LOADS_UP_TO = 0

# -- host code: attngen/host/prefill_plans.py, copied verbatim ---------------------------------
_FLASH_PLANS: tuple[dict, dict] = ({}, {})  # [q, k, v in [B, N, H, D]]: key -> heads-last plan


class _CallPlan:
    """One layout's launch: config, longest (config_for's length), grid, ints, kernel scale,
    pointer loads' tail, constexprs per TMA, options, output shapes; tma: (pairs, k block,
    v block) where TMA can read the layout; gluon: _gluon_layout's answer (None: no Gluon
    forward); pads: pointers after the six tensors; flash: q, k, v in [B, N, H, D]; compiled:
    the _runner found per (kernel, alignment, TMA, Triton's knobs)."""

    __slots__ = ("config", "longest", "grid", "ints", "qk_scale", "tail", "constexprs",
                 "options", "out_shape", "lse_shape", "tma", "gluon", "pads", "flash",
                 "compiled")  # fmt: skip

    def __init__(self, flash=False, gluon=None, tma=None, pads=0, **fields):
        for name, value in fields.items():
            setattr(self, name, value)
        self.gluon, self.tma, self.pads, self.flash = gluon, tma, pads, flash
        self.compiled: dict[tuple, tuple] = {}

    def heads_last(self, flash: bool, out_shape: tuple[int, ...]) -> "_CallPlan":
        """This plan with its own output shape ([B, M, HQ, DV]), for q, k, v as it was made for
        them or (flash) for the [B, N, H, D] tensors whose [B, H, N, D] views they were: the
        same pointers and ints, and TMA descriptors of the views."""
        fields = {name: getattr(self, name) for name in self.__slots__[:-2]}
        return _CallPlan(flash=flash, **dict(fields, out_shape=out_shape))


def _call_key(q, k, v, sm_scale, alibi_slopes, return_lse, out):
    """The layout of a call a plan may serve (None: the full path decides): plain tensors,
    no slopes, sm_scale None or a float, return_lse a bool, the cached launcher on."""
    if not (_FAST_LAUNCH and alibi_slopes is None and type(q) is _TENSOR and type(k) is _TENSOR
            and type(v) is _TENSOR and (sm_scale is None or type(sm_scale) is float)
            and type(return_lse) is bool):  # fmt: skip
        return None
    if out is None:
        out_layout = None
    elif type(out) is _TENSOR:
        out_layout = (out.shape, out.stride(), out.dtype, out.is_cuda, out.get_device())
    else:
        return None
    return (q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(), q.dtype, k.dtype,
            v.dtype, q.is_cuda, k.is_cuda, v.is_cuda, q.get_device(), k.get_device(),
            v.get_device(), sm_scale, return_lse, out_layout)  # fmt: skip


def _run_plan(plan, q, k, v, out):
    """attention()'s launch from the plan of its layout (attention_flash's: its tensors in
    [B, N, H, D]): (out, lse or None), or None when the full path must run (the config
    changed, or the launch cannot run directly)."""
    longest = plan.longest  # None: the module has CONFIG alone (no shorter configs)
    if (CONFIG if longest is None else config_for(longest)) != plan.config:
        return None
    if out is None:
        out = q.new_empty(plan.out_shape)
    else:
        storage = out.untyped_storage().data_ptr()
        if storage in (q.untyped_storage().data_ptr(), k.untyped_storage().data_ptr(),
                       v.untyped_storage().data_ptr()):  # fmt: skip
            _check_out(out, plan.out_shape, q, (("q", q), ("k", k), ("v", v)))  # raises
    lse = None if plan.lse_shape is None else q.new_empty(plan.lse_shape, dtype=torch.float32)
    lse_arg = out if lse is None else lse
    if plan.gluon is not None and _gluon_why(plan.gluon, q, k, v, out) is None:
        _gluon_run(plan.gluon[0], q, k, v, out, lse_arg, plan.qk_scale)  # these bases fit it
        return out, lse
    tail = plan.tail
    tma = plan.tma  # (pairs, k block, v block); POINTER_LOADS_UP_TO: the module's
    use_tma = tma is not None and tma[0] > POINTER_LOADS_UP_TO
    use_tma = use_tma and (k.data_ptr() | v.data_ptr()) & 15 == 0
    if use_tma:
        k_heads, v_heads = (k.transpose(1, 2), v.transpose(1, 2)) if plan.flash else (k, v)
        _, k_block, v_block = tma
        tail = (plan.qk_scale, _descriptor(k_heads, k_block), _descriptor(v_heads, v_block))
    constexprs = plan.constexprs[use_tma]
    device = q.get_device()
    o = out.data_ptr()  # also the unused slopes' pointer
    addresses = [q.data_ptr(), k.data_ptr(), v.data_ptr(), o, lse_arg.data_ptr(), o]
    if plan.pads:
        addresses += [addresses[0]] * plan.pads
    slot = (_attn_fwd_kernel, addresses[0] & 15 == 0, addresses[1] & 15 == 0,
            addresses[2] & 15 == 0, addresses[3] & 15 == 0, addresses[4] & 15 == 0,
            use_tma, _KNOBS.runtime.debug, _KNOBS.compilation.instrumentation_mode)  # fmt: skip
    runner = plan.compiled.get(slot)
    if runner is None or not _runs_directly(_attn_fwd_kernel) or _DRIVER[0]() != device:
        tensors = (q, k, v, out, lse_arg, out, *[q] * plan.pads)
        runner = _launch(_attn_fwd_kernel, plan.grid, device, tensors, plan.ints, tail,
                         constexprs, plan.options)  # fmt: skip
        if runner is not None and _DRIVER[0]() == device:
            plan.compiled[slot] = runner
        return out, lse
    launch, prefix = runner
    launch(plan.grid, 1, 1, _DRIVER[1](device), *prefix, *addresses, *plan.ints, *tail,
           *constexprs.values())  # fmt: skip
    return out, lse


def _keep_flash_plan(plans, key, views_key, flash, out_shape):
    """Keep under `key` the plan attention() left for the call's views (none: nothing kept),
    as one that allocates a [B, M, HQ, DV] output (_CallPlan.heads_last)."""
    plan = _CALL_PLANS.get(views_key)
    if plan is not None:
        if len(plans) >= _LAUNCH_CACHE_SIZE:
            plans.clear()
        plans[key] = plan.heads_last(flash, out_shape)
