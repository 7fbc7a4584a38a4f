"""decode()'s call plans, copied verbatim into decode modules that keep them, after plans.py
(attngen/host/__init__.py). The module's own: _call_key, _plan_config, _STATE_STAND_IN (a
plan passes q for the split kernel's block state)."""

from typing import Any

import torch

from attngen.host.decode import _cache_size, _ints_around, _partial_sizes, _partials, _unit_descale
from attngen.host.launch import _LAUNCH_CACHE_SIZE, _check_out, _int_classes
from attngen.host.plans import _CALL_PLANS, _remember_plan

_STAND_IN: Any = None
# the module's own (above the host code), and launch.py's launches
KV_LAYOUT = LAST_NUM_SPLITS = _STATE_STAND_IN = _DRIVER = _TENSOR = _STAND_IN
_plan_config = _split_count = _validate_indices = _STAND_IN
_checked = _direct_on = _run_step = _STAND_IN
_LENGTH_DIM = 0


# -- host code: attngen/host/decode_plans.py, copied verbatim ----------------------------------
# What decode() checks and derives depends on the call's layout (_call_key: every tensor's
# layout but the caches' varying dimension, the scalars, FORCE_NUM_SPLITS) and on the caches'
# size (the split rule reads shapes and the SM count, never cache_seqlens' values). So a call
# whose layout passed and launched runs the steps (append, split, combine) the full path built
# for its split count and its size ints' classes, with ints derived from its own caches. Read
# at every call: the caches' size and strides and the checks on them, out= sharing memory, the
# bases' alignment, ATTNGEN_CHECKS, and the config (_plan_config: a changed one leaves it).
class _CallPlan:
    """One call layout's decode: its config, output shapes, what the split rule and the
    kernels' ints take besides the caches' size, and the steps built so far:
    launches[_launch_class(...)] = (append or None, split, combine or None); the caches'
    varying dimension (length_dim: decode_flash's caller's caches have theirs elsewhere); and
    `last`, the latest size's derivation (_size_run), so that a repeated size costs one tuple
    compare."""

    __slots__ = ("config", "out_shape", "lse_shape", "num_new", "num_q_tokens", "programs",
                 "block_n", "sm_count", "requested", "rows", "append_parts", "split_parts",
                 "launches", "length_dim", "last")  # fmt: skip
    launches: dict  # (the others are read where the plan's type is not known)

    def __init__(self, length_dim=_LENGTH_DIM, **fields):
        self.length_dim, self.last = length_dim, None
        for name, value in fields.items():
            setattr(self, name, value)

    def heads_last(self, length_dim, out_shape):
        """This plan (its launches shared) for the caller's tensors whose [B, H, N, D] views it
        was made for (decode_flash), caches varying along length_dim, out [B, NQ, HQ, DV]."""
        fields = {name: getattr(self, name) for name in self.__slots__[:-2]}
        return _CallPlan(length_dim, **dict(fields, out_shape=out_shape))


def _cache_layout(t, length_dim):
    """A cache's layout in a plan's key: its shape without the varying dimension (length_dim),
    dtype, device. Its strides are read at each call: the kernels take them as ints."""
    if type(t) is not _TENSOR:
        raise TypeError  # not a plain tensor: the full path decides
    shape = t.shape
    return shape[:length_dim], shape[length_dim + 1 :], t.dtype, t.is_cuda, t.get_device()


def _launch_class(splits, strides, sizes):
    """What picks a plan's steps for caches of some size: the split count (grid, DIRECT, the
    combine's BLOCK_SPLITS), the classes of the ints that follow the size (Triton's)."""
    return splits, _int_classes((*strides, *sizes))


def _remember_launches(key, launch_class, launches, **fields):
    """Keeps a call's steps in its layout's plan (a new one where none is or its config changed)."""
    plan = _CALL_PLANS.get(key)
    if plan is None or plan.config != fields["config"]:
        plan = _CallPlan(launches={}, **fields)
        _remember_plan(key, plan)
    if len(plan.launches) >= _LAUNCH_CACHE_SIZE:
        plan.launches.clear()
    plan.launches[launch_class] = launches


def _size_run(plan, capacity, num_pages, k_strides, v_strides):
    """(splits, launches, the append's ints or None, the split's ints, the launches' kernels,
    _partial_sizes) for caches of this size and strides, None while no steps are kept for its
    launch class; kept on the plan, as a decode loop asks again at every step."""
    size = (capacity, num_pages, k_strides, v_strides)
    last = plan.last
    if last is not None and last[0] == size:
        return last[1]
    splits, split_len = _split_count(plan.programs, capacity, plan.block_n, plan.num_q_tokens,
                                     plan.sm_count, plan.requested)  # fmt: skip
    if KV_LAYOUT != "paged" and plan.length_dim == _LENGTH_DIM:  # [B, HKV, Lmax, D]: in order
        strides = (*k_strides, *v_strides)
    else:  # pages [P, S, HKV, D], decode_flash's [B, Lmax, HKV, D]: as _cache_strides
        strides = (k_strides[0], k_strides[2], k_strides[1], k_strides[3],
                   v_strides[0], v_strides[2], v_strides[1], v_strides[3])  # fmt: skip
    sizes = (split_len, capacity - plan.num_new, num_pages)
    launches = plan.launches.get(_launch_class(splits, strides, sizes))
    if launches is None:
        return None
    append_ints = None
    if launches[0] is not None:
        append_ints = _ints_around(plan.append_parts, strides, sizes[1:])
    run = (splits, launches, append_ints,
           _ints_around(plan.split_parts, strides, (splits, *sizes)),
           [step.kernel for step in launches if step is not None],
           _partial_sizes(plan.rows, splits))  # fmt: skip
    plan.last = (size, run)
    return run


def _run_plan(plan, q, k_cache, v_cache, cache_seqlens, block_table, k_new, v_new, out,
              rotary_cos, rotary_sin, tree_mask=None, descales=None):  # fmt: skip
    """decode()'s launches from its layout's plan for caches of this call's size: (out, lse or
    None), or None when the full path must run (the config changed, a check of the size fails
    and the full path raises, or no steps are kept for this size's launch class yet: the full
    path launches and keeps them). descales: an fp8 module's (k_descale, v_descale)."""
    if _plan_config() != plan.config:
        return None
    length_dim = plan.length_dim
    capacity, num_pages = _cache_size(k_cache, block_table, length_dim)
    num_new = plan.num_new
    if (v_cache.shape[length_dim] != k_cache.shape[length_dim] or num_new > capacity
            or (rotary_cos is not None and rotary_cos.shape[0] < capacity)):  # fmt: skip
        return None
    run = _size_run(plan, capacity, num_pages, k_cache.stride(), v_cache.stride())
    if run is None:
        return None
    splits, (append, split, combine), append_ints, split_ints, kernels, partial_sizes = run
    if out is None:
        out = q.new_empty(plan.out_shape)
    else:
        fp8 = () if descales is None else zip(("k_descale", "v_descale"), descales, strict=True)
        inputs = (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("k_new", k_new),
                  ("v_new", v_new), ("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin), *fp8,
                  ("tree_mask", tree_mask))  # fmt: skip
        storage = out.untyped_storage().data_ptr()
        if any(t is not None and t.untyped_storage().data_ptr() == storage for _, t in inputs):
            _check_out(out, plan.out_shape, q, inputs)  # raises when out has elements
    if _checked():
        _validate_indices(cache_seqlens, block_table, num_new, plan.num_q_tokens, capacity,
                          num_pages)  # fmt: skip
    lse = None if plan.lse_shape is None else q.new_empty(plan.lse_shape, dtype=torch.float32)
    table = block_table if KV_LAYOUT == "paged" else cache_seqlens
    device = q.get_device()
    direct = _direct_on(device, kernels)
    stream = _DRIVER[1](device) if direct else None  # one question for the call's launches
    cos, sin = (q, q) if rotary_cos is None else (rotary_cos, rotary_sin)
    extra = () if descales is None else [_unit_descale(q) if t is None else t for t in descales]
    if append is not None:
        _run_step(append, device, (k_new, v_new, k_cache, v_cache, cache_seqlens, table, cos,
                                   sin, *extra), append_ints, direct, stream)  # fmt: skip
    global LAST_NUM_SPLITS
    LAST_NUM_SPLITS = splits
    lse_arg = out if lse is None else lse
    part_out = part_lse = out
    if combine is not None:
        part_out, part_lse = _partials(q, plan.rows, splits, partial_sizes)
    tree = out if tree_mask is None else tree_mask.view(torch.uint8)
    _run_step(split, device, (q, k_cache, v_cache, out, lse_arg, part_out, part_lse,
                              cache_seqlens, table, cos, sin, out, tree, *extra,
                              *((q,) if _STATE_STAND_IN else ())),
              split_ints, direct, stream)  # fmt: skip
    if combine is not None:
        _run_step(combine, device, (part_out, part_lse, out, lse_arg), None, direct, stream)
    return out, lse


# -- flash-attn's layouts: decode_flash's and decode_flash_out's plans ---------------------------
_FLASH_PLANS: tuple[dict, dict] = ({}, {})  # [flash-attn's layout]: _call_key(...) -> _CallPlan


def _keep_flash_plan(plans, key, views_key, length_dim, out_shape):
    """Keep under `key` the plan decode() left for the call's views (none: nothing kept), as
    one whose caches vary along length_dim and that allocates a [B, NQ, HQ, DV] output."""
    plan = _CALL_PLANS.get(views_key)
    if plan is not None:
        if len(plans) >= _LAUNCH_CACHE_SIZE:
            plans.clear()
        plans[key] = plan.heads_last(length_dim, out_shape)
